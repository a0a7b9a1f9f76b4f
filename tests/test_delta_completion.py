"""A version published with a delta is complete only once its delta is registered (issues
#14 and #16), on a real coordinator process with trainer and readers in their own
processes over real Mooncake.

A reader that starts the moment a version is complete -- an engine's prefetcher:
``wait_for_version``, then ``fetch`` with the base it serves -- must find the delta. The
publisher registers the delta layout first (a delta layout never completes a version),
then the full layout, which completes it. Published in the other order, the waiting
readers found no delta yet and read the whole version: right bytes, all of them.
"""

from __future__ import annotations

import pytest

import tensorhub
from tensorhub._delta_path import delta_layout
from tensorhub.testing import InMemoryTransport

pytestmark = pytest.mark.multiprocess

#: Big enough that encoding the delta takes far longer than a woken reader's first call.
NBYTES = 16 << 20


def test_readers_woken_by_the_completion_read_through_the_delta(coordinator, workers):
    trainer = workers(coordinator.url, "trainer")
    readers = [workers(coordinator.url, f"reader-{i}") for i in range(2)]
    assert trainer.call("publish", seed=1, nbytes=NBYTES) == 1
    for r in readers:
        assert r.call("fetch", version=1)["delta"] is None  # nothing to start from: full
    observer = tensorhub.connect(coordinator.url, worker_id="observer", transport=InMemoryTransport())
    try:
        for v in (2, 3):
            for r in readers:  # waiting before the publish starts, like a prefetcher
                r.send("fetch", wait_newer_than=v - 1)
            assert trainer.call("publish", seed=v, nbytes=NBYTES, base=v - 1) == v
            want = trainer.call("fetch", version=v)["digest"]  # held: the trainer's own bytes
            dbytes = sum(s.nbytes for s in observer.manifest("policy", v, layout=delta_layout(v - 1)))
            assert dbytes < 0.1 * NBYTES
            for r in readers:
                got = r.result()
                assert got["version"] == v and got["digest"] == want
                assert got["delta"] == [(v - 1, v)], got["delta_skipped"]
                assert got["delta_skipped"] is None
                assert got["nbytes"] < 0.1 * NBYTES  # the delta (from the trainer or the other reader)
            info = observer.version_info("policy", v)
            assert info.complete and info.layout_complete("hf") and info.layout_complete(delta_layout(v - 1))
    finally:
        observer.close()
