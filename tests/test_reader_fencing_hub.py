"""Consistency, reader side (issue 30), between real processes: a reader whose control
plane is cut (a blackholed relay to the coordinator; its data plane untouched) while it
holds a lease.

Real coordinator process, real Hub worker processes; the reader reads the holder's memory
in place on this host (``Hub.borrow``, the vLLM/SGLang loaders' start) and uses it once
more *after* the holder tried to take it back. On b990e80 the coordinator expired the
reader, its expiry dropped the lease, the holder's ``unpublish`` returned at once and
zeroed the memory, and the reader read zeros while ``trusted()`` still said True.
"""

from __future__ import annotations

import time

import httpx
import pytest

from _blackhole import Blackhole
from tensorhub.testing import CoordinatorProcess, digest, make_weights

pytestmark = pytest.mark.multiprocess

MiB = 1 << 20


def _workers_of(url: str) -> set[str]:
    return {w["worker_id"] for w in httpx.get(f"{url}/v1/status", timeout=10).json()["workers"]}


def test_a_borrower_cut_off_and_expired_keeps_the_holders_memory_fenced(tmp_path, workers):
    coord = CoordinatorProcess(tmp_path / "state", extra=("--lease-ttl", "10", "--worker-ttl", "1"))
    url = coord.start()
    relay = Blackhole(url)
    try:
        pub = workers(url, "pub", own_transport=True)
        v1 = pub.call("publish", seed=21, nbytes=8 * MiB, empty_like=True)
        v2 = pub.call("publish", seed=22, nbytes=8 * MiB, empty_like=True)  # v1 is not the newest
        reader = workers(relay.url, "reader", own_transport=True)
        assert reader.call("borrow", version=v2)["digest"] == digest(make_weights(22, 8 * MiB))  # transport up
        reader.send("borrow", version=v1, hold=6.0, digest_after=True)
        time.sleep(1.0)  # it holds its lease and the views of pub's memory
        relay.cut()
        end = time.monotonic() + 10
        while "reader" in _workers_of(url):  # expired by the coordinator (worker_ttl 1 s)
            assert time.monotonic() < end, "the coordinator did not expire the cut-off reader"
            time.sleep(0.2)
        t0 = time.monotonic()
        # pub unpublishes v1 and zeroes its memory the moment unpublish returns; heal the
        # reader's route meanwhile (cut ~2.5 x worker_ttl) so it can release.
        pub.send("unpublish", version=v1, drain_timeout=60)
        time.sleep(max(0.0, 2.5 - (time.monotonic() - t0)))
        relay.heal()
        got = reader.result()
        waited = pub.result()
        assert got["trusted_after"] is True
        assert got["digest_after"] == digest(make_weights(21, 8 * MiB)), \
            f"the reader used zeroed memory while it trusted its lease (unpublish returned after {waited:.2f}s)"
        assert got["lapsed"] is None  # the lease outlived the reader's registration: released valid
        assert waited >= 1.5, f"unpublish returned after {waited:.2f}s while the expired reader held its lease"
        assert "reader" in _workers_of(url)  # it came back by itself
    finally:
        relay.close()
        coord.stop()
