"""Delta chains and the coordinator's retention (issue #16), on a real coordinator process
(``--keep-versions 1``) with trainer and readers in their own processes over real Mooncake.

Retention retires only versions nothing holds (any layout, a delta layout included): while
someone serves v2's delta, the chain v1->v2->v3 stays readable though v2 is older than what
``--keep-versions`` keeps. Once every holder of v2 let it go, retention retires it; a reader
still on v1 then reads v3 in full and says why (the chain breaks at v1->v2: retired), with
the same bytes.
"""

from __future__ import annotations

import time

import pytest

import tensorhub
from tensorhub.testing import InMemoryTransport

pytestmark = pytest.mark.multiprocess

NBYTES = 4 << 20


@pytest.fixture
def coord(coordinator_with):
    return coordinator_with("--keep-versions", "1")


def _known(observer, v: int) -> bool:
    return observer.version_info("policy", v) is not None


def test_retention_keeps_a_held_chain_and_a_reader_falls_back_once_a_link_is_retired(coord, workers):
    observer = tensorhub.connect(coord.url, worker_id="observer", transport=InMemoryTransport())
    try:
        trainer = workers(coord.url, "trainer")
        r1, r2 = workers(coord.url, "reader-1"), workers(coord.url, "reader-2")
        assert trainer.call("publish", seed=1, nbytes=NBYTES) == 1
        for r in (r1, r2):
            assert r.call("fetch", version=1)["delta"] is None  # nothing to start from: full
        assert trainer.call("publish", seed=2, nbytes=NBYTES, base=1) == 2
        assert trainer.call("publish", seed=3, nbytes=NBYTES, base=2) == 3
        want = trainer.call("fetch", version=3)["digest"]  # held: the trainer's own bytes

        # v2 is older than --keep-versions 1 keeps, but the trainer holds it (full and delta):
        # retention leaves it, and the chain is read. (Retention is running meanwhile: an
        # unheld old version of another model is retired in the same window.)
        import torch

        for _ in range(2):
            observer.publish("other", {"w": torch.zeros(4)})
        observer.unpublish("other", 1)
        deadline = time.monotonic() + 30
        while observer.version_info("other", 1) is not None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert observer.version_info("other", 1) is None, "retention did not run"
        assert _known(observer, 2)
        got = r1.call("fetch", version=3)
        assert got["delta"] == [(1, 2), (2, 3)] and got["digest"] == want
        assert got["nbytes"] < 0.1 * NBYTES
        assert got["delta_skipped"] is None

        # Every holder lets v2 go (the trainer; r1 served the deltas it read): retired.
        trainer.call("unpublish", version=2)
        r1.call("unpublish", version=2)
        deadline = time.monotonic() + 30
        while _known(observer, 2) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _known(observer, 2), "retention did not retire v2"
        assert _known(observer, 1) and _known(observer, 3)  # r2 holds v1; v3 is the newest

        got = r2.call("fetch", version=3)
        assert got["delta"] is None and got["digest"] == want
        assert got["nbytes"] >= NBYTES  # the full version
        why = got["delta_skipped"]
        assert "breaks at v1->v2" in why and "retired" in why, why
    finally:
        observer.close()
