"""The client's half of the fencing rules (docs/consistency.md), against a real coordinator.

Real HTTP coordinator (embedded, restarted on its state dir where the scenario needs it)
and real Hub clients; the in-memory transport double carries the bytes, since what is
checked here is what the control plane tells the client and what the client does with
it. The same rules between processes over real Mooncake, with one plane cut at a time:
tests/test_control_plane_faults.py.
"""

from __future__ import annotations

import time
from urllib.parse import urlparse

import pytest
import torch

import tensorhub
from tensorhub import ConfigError, FetchError, HubTimeoutError
from tensorhub._fencing import LeaseClock
from tensorhub.server.state import StateConfig
from tensorhub.coordinator import EmbeddedCoordinator
from tensorhub.testing import InMemoryTransport

MiB = 1 << 20


def weights(seed: int, n: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(MiB // 4, generator=g) for i in range(n)}


def test_a_version_nobody_can_serve_fails_at_once_naming_the_newest(connect):
    t, r = connect("trainer"), connect("reader")
    v1 = t.publish("m", weights(1))
    v2 = t.publish("m", weights(2))
    t.unpublish("m", v1)
    t0 = time.monotonic()
    with pytest.raises(FetchError, match=rf"no longer held by anyone.*newest complete version is v{v2}"):
        r.fetch("m", v1)  # the default deadline is 600 s: this must not wait for it
    assert time.monotonic() - t0 < 5
    assert torch.equal(r.fetch("m", v2, serve=False)["w0"], weights(2)["w0"])  # the service keeps serving


def test_allocation_retries_with_one_request_id_get_one_number(embedded, connect):
    connect("t")  # the model exists once someone publishes; allocation itself needs no worker
    api = tensorhub.connect(embedded.url, worker_id="api", transport=InMemoryTransport()).api
    a = api.post("/v1/models/m/versions", {"request_id": "lost-answer-1"})["version"]
    b = api.post("/v1/models/m/versions", {"request_id": "lost-answer-1"})["version"]
    c = api.post("/v1/models/m/versions", {"request_id": "other"})["version"]
    assert a == b and c == a + 1


def test_reader_does_not_trust_a_lease_that_lapsed_before_a_coordinator_restart(tmp_path):
    """Rule 3: the restarted coordinator cannot know when a lease of the previous
    incarnation lapsed; it answers "valid" within boot + ttl. The reader's own bound
    (last grant or renewal + ttl, monotonic) decides, and it has passed: re-read."""
    cfg = StateConfig(lease_ttl=1.0, worker_ttl=30.0)
    c = EmbeddedCoordinator(tmp_path / "s", config=cfg)
    url = c.start()
    port = urlparse(url).port
    t = tensorhub.connect(url, worker_id="t", transport=InMemoryTransport(), heartbeat_interval=0.2)
    r = tensorhub.connect(url, worker_id="r", transport=InMemoryTransport(), heartbeat_interval=0.2)
    try:
        v = t.publish("m", weights(1))
        clock = LeaseClock()
        g = r._acquire("m", v, "hf", 0, set(), time.monotonic() + 10, clock)
        assert clock.trusted(g.lease_id)
        c.stop()
        time.sleep(1.2)  # the lease lapses while the coordinator is down
        c = EmbeddedCoordinator(tmp_path / "s", port=port, config=cfg)
        c.start()
        assert not clock.trusted(g.lease_id)
        assert r._release_checked([g.lease_id], clock) == [g.lease_id]
    finally:
        t.close()
        r.close()
        c.stop()


def test_release_after_the_readers_own_bound_is_not_trusted_even_if_the_coordinator_says_valid(connect):
    t, r = connect("t"), connect("r")
    v = t.publish("m", weights(1))
    clock = LeaseClock()
    g = r._acquire("m", v, "hf", 0, set(), time.monotonic() + 10, clock)
    clock._until[g.lease_id] = time.monotonic() - 0.001  # e.g. its renewals could not get through
    assert r._release_checked([g.lease_id], clock) == [g.lease_id]
    g2 = r._acquire("m", v, "hf", 0, set(), time.monotonic() + 10, clock)
    assert r._release_checked([g2.lease_id], clock) == []


def test_holder_that_learns_it_was_expired_waits_a_lease_ttl_before_overwriting(embedded, connect):
    t, r = connect("t"), connect("r")
    w1 = weights(1)
    v1 = t.publish("m", w1)
    t.publish("m", weights(2))
    # the coordinator forgets the holder (its heartbeats were cut longer than worker_ttl)
    embedded.coordinator.call(lambda now: embedded.coordinator.state.remove_worker(now, "t"))
    deadline = time.monotonic() + 5
    while not t._fence_until and time.monotonic() < deadline:
        time.sleep(0.05)  # the next heartbeat answers 404: the hub re-registers
    assert t._fence_until, "the hub did not notice it was forgotten"
    with pytest.raises(HubTimeoutError, match="expired or the coordinator restarted"):
        t.unpublish("m", v1, timeout=0.5)
    t0 = time.monotonic()
    t.unpublish("m", v1)
    waited = time.monotonic() - t0
    assert waited >= 0.5 * embedded.coordinator.config.lease_ttl - 1.0
    # the service keeps serving: v2 is fetchable
    assert r.fetch("m", serve=False).version == v1 + 1


def test_fetch_into_quarantined_memory_is_refused(connect):
    t, r = connect("t"), connect("r")
    v = t.publish("m", weights(1))
    into = {k: torch.empty_like(x) for k, x in weights(1).items()}
    r._quarantine.add(into, into, "peers may still read it (test)")
    with pytest.raises(ConfigError, match=r"into\['w0'\] is quarantined and must not be reused: peers may"):
        r.fetch("m", v, into=into, serve=False)
    assert r.fetch("m", v, serve=False).version == v


@pytest.mark.parametrize("step", [-3600.0, 3600.0])
def test_a_wall_clock_step_changes_no_answer(monkeypatch, connect, embedded, step):
    """Rule 1: the coordinator (real HTTP, in this process) decides leases and liveness
    on the monotonic clock; the wall clock jumps by an hour either way mid-read."""
    t, r = connect("t"), connect("r")
    w = weights(1)
    v = t.publish("m", w)
    t.publish("m", weights(2))
    clock = LeaseClock()
    g = r._acquire("m", v, "hf", 0, set(), time.monotonic() + 10, clock)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + step)
    time.sleep(0.5)  # a few heartbeats and expiry ticks under the stepped clock
    st = r.api.get("/v1/status")
    assert {x["worker_id"] for x in st["workers"]} >= {"t", "r"}
    assert [l["lease_id"] for l in st["leases"]] == [g.lease_id]
    drained = r.api.post(f"/v1/models/m/versions/{v}/unpublish", {"worker_id": "t"})
    assert drained == {"drained": False, "open_leases": 1}
    assert r._release_checked([g.lease_id], clock) == []
    monkeypatch.setattr(time, "time", real)


def test_a_replica_being_unpublished_is_not_announced_again_while_its_fence_runs(embedded, connect):
    """The race the model check found with the holder fence: a re-registration during
    unpublish's fence wait announced the replica again, a reader leased it, and the holder
    overwrote it when the wait ended."""
    import threading

    t, r = connect("t"), connect("r")
    v1 = t.publish("m", weights(1))
    t.publish("m", weights(2))
    coord = embedded.coordinator
    coord.call(lambda now: coord.state.remove_worker(now, "t"))  # forgotten: fenced on re-registration
    deadline = time.monotonic() + 5
    while not t._fence_until and time.monotonic() < deadline:
        time.sleep(0.05)
    done = threading.Event()
    threading.Thread(target=lambda: (t.unpublish("m", v1), done.set()), daemon=True).start()
    time.sleep(0.5)  # unpublish is drained and waits out the fence now
    coord.call(lambda now: coord.state.remove_worker(now, "t"))  # forgotten again mid-wait
    time.sleep(1.0)  # the heartbeat re-registers what it holds
    status = r.api.get("/v1/status")
    assert "t" in {w["worker_id"] for w in status["workers"]}
    held_v1 = [rep for m in status["models"] for v in m["versions"] if v["version"] == v1 for rep in v["replicas"]]
    assert held_v1 == [], "a replica being unpublished was announced again"
    with pytest.raises(FetchError, match="no longer held by anyone"):
        r.fetch("m", v1, timeout=3)
    assert done.wait(15)


def test_quarantined_into_is_refused_before_any_lease_is_asked_for(connect):
    r = connect("r")
    into = {k: torch.empty_like(x) for k, x in weights(1).items()}
    r._quarantine.add(into, into, "peers may still read it (test)")
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="quarantined"):
        r.fetch("m", 7, into=into, serve=False, timeout=30)  # no such version: never asked
    assert time.monotonic() - t0 < 2
