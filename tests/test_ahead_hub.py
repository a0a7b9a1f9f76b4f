"""Subscribing ahead end to end (``Hub.fetch_next``, tensorhub/server/ahead.py): a real coordinator
process, real Mooncake over loopback, worker processes. Readers that hold v1 ask for v2's
lease before v2 exists; at the publish they read it as members of one fixed plan. Checked:
the bytes (sha256 per tensor), the publisher sending about one version, the subscribers
the coordinator held, a held lease trusted for its whole life after a hold longer than the
lease ttl, a subscriber killed before the publish, a version with other tensors, and no
version within the wait."""

from __future__ import annotations

import time

import httpx
import pytest

from tensorhub.testing import digest, make_weights

pytestmark = pytest.mark.multiprocess

MiB = 1 << 20
NBYTES = 64 * MiB


def _subscribers(url: str) -> list:
    return httpx.get(f"{url}/v1/status", timeout=10).json()["subscribers"]


def _wait_subscribed(url: str, n: int, timeout: float = 30.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        subs = _subscribers(url)
        if len(subs) >= n:
            return subs
        time.sleep(0.05)
    raise AssertionError(f"{len(_subscribers(url))} of {n} readers subscribed")


@pytest.fixture
def short_leases(coordinator_with):
    return coordinator_with("--lease-ttl", "3")


def test_subscribers_read_the_next_version_from_one_plan(short_leases, workers):
    url = short_leases.url
    pub = workers(url, "pub")
    readers = [workers(url, f"r{k}", locality={"host": f"h{k}"}) for k in range(4)]
    v1 = pub.call("publish", seed=1, nbytes=NBYTES)
    for r in readers:
        assert r.call("fetch", version=v1)["digest"] == digest(make_weights(1, NBYTES))
    for r in readers:
        r.send("fetch_next", after=v1, wait=60.0)
    subs = _wait_subscribed(url, 4)
    assert {s["worker_id"] for s in subs} == {r.worker_id for r in readers} and {s["version"] for s in subs} == {v1 + 1}
    time.sleep(4.0)  # held longer than the lease ttl (3 s): the lease is trusted from its grant, not the ask
    t_pub = time.time()
    v2 = pub.call("publish", seed=2, nbytes=NBYTES)
    got = [r.result(120) for r in readers]
    want = digest(make_weights(2, NBYTES))
    total = sum(t.nbytes for t in make_weights(2, NBYTES).values())
    for g in got:
        assert g["version"] == v2 and g["digest"] == want and g["nbytes"] == total
        assert g["waited"] > 4.0 and g["done_at"] > t_pub
    from_pub = sum(g["sources"].get("pub", 0) for g in got)
    # the plan: the publisher sends each stripe once (a little more where a reader fell back)
    assert from_pub <= 1.5 * total, [g["sources"] for g in got]
    assert all(set(g["sources"]) - {"pub"} for g in got[1:]), [g["sources"] for g in got]
    assert _subscribers(url) == []
    # and again: the next version after v2, into the copy of v2 just read (no new memory)
    for r in readers:
        r.send("fetch_next", after=v2, wait=60.0)
    _wait_subscribed(url, 4)
    v3 = pub.call("publish", seed=3, nbytes=NBYTES)
    assert all(r.result(120)["digest"] == digest(make_weights(3, NBYTES)) for r in readers)
    assert v3 == v2 + 1


def test_a_killed_subscriber_other_tensors_and_no_version_in_time(coordinator_with, workers):
    url = coordinator_with("--worker-ttl", "2").url
    pub = workers(url, "pub")
    a, b, doomed = (workers(url, n) for n in ("a", "b", "doomed"))
    v1 = pub.call("publish", seed=1, nbytes=NBYTES)
    for r in (a, b, doomed):
        r.call("fetch", version=v1)
    # nothing published within the wait: None, and the place is given up
    t0 = time.monotonic()
    assert a.call("fetch_next", after=v1, wait=1.0) is None
    assert 0.9 < time.monotonic() - t0 < 10
    # a subscriber killed before the publish: its subscription goes with its worker (heartbeat
    # lapsed), so it is nobody's parent; the others read v2 from the publisher and each other
    for r in (a, b, doomed):
        r.send("fetch_next", after=v1, wait=60.0)
    _wait_subscribed(url, 3)
    doomed.kill()
    deadline = time.monotonic() + 30
    while "doomed" in {s["worker_id"] for s in _subscribers(url)}:
        assert time.monotonic() < deadline, "the dead subscriber was never dropped"
        time.sleep(0.1)
    v2 = pub.call("publish", seed=2, nbytes=NBYTES)
    want = digest(make_weights(2, NBYTES))
    got = [a.result(120), b.result(120)]
    assert all(g["digest"] == want and "doomed" not in g["sources"] for g in got), got
    # the next version has other tensors than the destination: read the usual way
    for r in (a, b):
        r.send("fetch_next", after=v2, wait=60.0)
    _wait_subscribed(url, 2)
    v3 = pub.call("publish", seed=3, nbytes=NBYTES // 2)
    want3 = digest(make_weights(3, NBYTES // 2))
    for r in (a, b):
        g = r.result(120)
        assert g["version"] == v3 and g["digest"] == want3


def test_a_member_hung_at_the_publish_is_read_around_and_catches_up(coordinator_with, workers):
    """A subscriber stopped (SIGSTOP: both planes) just before the publish is still alive for
    the coordinator, so it is bound into the plan as a member and named as a parent. Its
    children stall, read around it (after 0.5 s without progress, any source; its worker
    expires and its partial replica goes) and get every byte; resumed, it reads v2 too."""
    import os
    import signal

    url = coordinator_with("--worker-ttl", "3").url
    pub = workers(url, "pub")
    readers = [workers(url, f"r{k}", locality={"host": f"h{k}"}) for k in range(5)]
    v1 = pub.call("publish", seed=1, nbytes=NBYTES)
    for r in readers:
        r.call("fetch", version=v1)
    for r in readers:
        r.send("fetch_next", after=v1, wait=60.0)
    _wait_subscribed(url, 5)
    hung = readers[0]  # the first to subscribe: carries stripe 0, straight from the publisher
    os.kill(hung.pid, signal.SIGSTOP)
    try:
        v2 = pub.call("publish", seed=2, nbytes=NBYTES)
        want = digest(make_weights(2, NBYTES))
        got = [r.result(120) for r in readers[1:]]
        assert all(g["version"] == v2 and g["digest"] == want for g in got), got
    finally:
        os.kill(hung.pid, signal.SIGCONT)
    g = hung.result(120)  # its answer was waiting; its worker re-registers; it reads v2 whole
    assert g["version"] == v2 and g["digest"] == want
