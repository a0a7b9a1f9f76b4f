"""Hub client against a real (embedded) coordinator, with the in-memory transport double.

Fast, single-process checks of the client's behaviour: failover from hung and dead
sources, the buffer-reuse hazard, lapsed leases, retention, groups, liveness, misuse.
The same paths over real Mooncake between processes are in test_multiprocess.py.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

import tensorhub
from tensorhub import hub as hub_module
from tensorhub.testing import InMemoryTransport

MiB = 1 << 20


def weights(seed: int, mib: int = 8, n: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn((mib * MiB) // n // 4, generator=g) for i in range(n)}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_publish_fetch_into_and_serve(connect):
    pub, a, b = connect("pub"), connect("a"), connect("b")
    w = weights(1)
    v = pub.publish("m", w)
    assert pub.latest("m") == v == 1
    got = a.fetch("m")
    assert got.version == v and same(got, w) and got.sources == {"pub": 8 * MiB}
    into = {k: torch.zeros_like(t) for k, t in w.items()}
    got_b = b.fetch("m", v, into=into, serve=False)
    assert same(into, w) and all(got_b[k] is into[k] for k in w)
    assert set(got_b.sources) <= {"pub", "a"}
    assert b.held() == [] and a.held() == [("m", v, "hf", 0)]


def test_into_mismatch_names_first_tensor(connect):
    pub, r = connect("pub"), connect("r")
    w = weights(2)
    v = pub.publish("m", w)
    bad = {k: torch.zeros_like(t) for k, t in w.items()}
    bad["w1"] = torch.zeros(5)
    with pytest.raises(tensorhub.TensorMismatchError, match=r"into\['w1'\] has shape \[5\]"):
        r.fetch("m", v, into=bad)
    del bad["w1"]
    with pytest.raises(tensorhub.TensorMismatchError, match="into has no tensor 'w1'"):
        r.fetch("m", v, into=bad)
    with pytest.raises(tensorhub.ConfigError, match="not contiguous"):
        pub.publish("m", {"t": torch.zeros(4, 4).t()})
    with pytest.raises(tensorhub.ConfigError, match="non-empty mapping"):
        pub.publish("m", {})
    assert same(r.fetch("m", v), w)  # still serving


def test_hung_source_fails_over_after_its_batch_ends(connect):
    """A hung source's batch is only retried once the transport says it ended (as
    Mooncake does after MC_TCP_PROGRESS_TIMEOUT_SEC); the fetch completes from the other."""
    w = weights(3, mib=16)
    a = connect("a")
    b = connect("b")
    v = a.publish("m", w)
    b.fetch("m", v)
    reader = connect("reader", transport=InMemoryTransport(progress_timeout=1.0), progress_timeout=0.3)
    InMemoryTransport.hang(a.endpoint)
    try:
        t0 = time.monotonic()
        got = reader.fetch("m", v, serve=False, timeout=30)
        assert same(got, w)
        assert got.failed_sources and got.sources.get("b", 0) > 0
        assert time.monotonic() - t0 >= 1.0  # waited for the hung batch to end before re-reading
    finally:
        InMemoryTransport.resume(a.endpoint)


def test_destination_of_a_batch_that_never_ends_is_never_reused(connect):
    w = weights(4)
    a = connect("a")
    v = a.publish("m", w)
    reader = connect("reader", transport=InMemoryTransport(), progress_timeout=0.2)
    before = len(hub_module._QUARANTINE)
    InMemoryTransport.hang(a.endpoint)
    try:
        with pytest.raises(tensorhub.FetchError, match="never ended"):
            reader.fetch("m", v, serve=False, timeout=2)
        assert len(hub_module._QUARANTINE) == before + 1  # kept alive, not freed for reuse
    finally:
        InMemoryTransport.resume(a.endpoint)


def test_dead_source_only_replica_is_a_clear_error(connect):
    a, r = connect("a"), connect("r")
    v = a.publish("m", weights(5))
    InMemoryTransport.kill(a.endpoint)
    with pytest.raises(tensorhub.FetchError, match="no replica .* is serving"):
        r.fetch("m", v, timeout=1.5)


def test_lapsed_lease_means_the_bytes_are_read_again(embedded, connect, caplog, monkeypatch):
    embedded.coordinator.config = embedded.coordinator.state.config = \
        type(embedded.coordinator.config)(lease_ttl=0.5, worker_ttl=3.0)
    src = InMemoryTransport(bandwidth=8 * MiB)  # 8 MiB at 8 MiB/s: about 1 s, twice the lease
    a = connect("a", transport=src)
    w = weights(6, mib=8)
    v = a.publish("m", w)
    r = connect("r")
    # renewals never reach the coordinator, though the reader believes them answered
    monkeypatch.setattr(r.api, "renew_lease", lambda lease_id, **k: 0.5)
    threading.Timer(0.8, lambda: setattr(src, "bandwidth", None)).start()  # the re-read is fast
    with caplog.at_level(logging.WARNING, logger="tensorhub.hub"):
        got = r.fetch("m", v, serve=False)
    assert same(got, w)
    assert any("lapsed" in rec.message for rec in caplog.records)


def test_retention_waits_for_another_holder(connect):
    a, b = connect("a"), connect("b")
    v = a.publish("m", weights(7))
    with pytest.raises(tensorhub.RetentionError, match="last replica"):
        a.unpublish("m", v, timeout=0.3)
    assert a.held() == [("m", v, "hf", 0)]  # still serving
    threading.Timer(0.3, lambda: b.fetch("m", v)).start()
    a.unpublish("m", v, timeout=10)  # returns once b holds it
    assert a.held() == [] and same(connect("c").fetch("m", v), weights(7))


def test_group_ranks_get_one_version(connect):
    pub, r0, r1 = connect("pub"), connect("r0"), connect("r1")
    v1 = pub.publish("m", weights(8))
    assert r0.fetch("m", group="swap-1").version == v1
    v2 = pub.publish("m", weights(9))
    assert r1.fetch("m", group="swap-1").version == v1  # same group: same version
    assert r1.fetch("m", group="swap-2").version == v2


def test_wait_for_version(connect):
    pub, r = connect("pub"), connect("r")
    with pytest.raises(tensorhub.HubTimeoutError, match="no complete version of 'm'"):
        r.wait_for_version("m", timeout=0.3)
    threading.Timer(0.3, lambda: pub.publish("m", weights(10, mib=1))).start()
    assert r.wait_for_version("m", timeout=10) == 1
    threading.Timer(0.3, lambda: pub.publish("m", weights(11, mib=1))).start()
    assert r.wait_for_version("m", newer_than=1, timeout=10) == 2


def test_misuse_errors(connect):
    h = connect("h")
    with pytest.raises(tensorhub.NotFoundError, match="holds no replica"):
        h.unpublish("m", 1)
    with pytest.raises(tensorhub.ConfigError, match="positive int"):
        h.fetch("m", 0)
    h.close()
    with pytest.raises(tensorhub.HubClosedError):
        h.fetch("m")
    h.close()  # idempotent


def test_replicas_of_a_silent_worker_are_dropped_after_ttl(embedded, connect):
    a = connect("a")
    v = a.publish("m", weights(12, mib=1))
    connect("b").fetch("m", v)
    a._session._stop.set()  # a stops heart-beating (as if hung or partitioned)
    deadline = time.monotonic() + embedded.config.worker_ttl + 3
    while any(r.worker_id == "a" for r in embedded.coordinator.state.replicas.values()):
        assert time.monotonic() < deadline, "a's replica outlived the worker TTL"
        time.sleep(0.1)
    assert {r.worker_id for r in embedded.coordinator.state.replicas.values()} == {"b"}


def test_fetch_refuses_to_overwrite_memory_still_served(connect):
    pub, r = connect("pub"), connect("r")
    v1 = pub.publish("m", weights(13))
    mine = r.fetch("m", v1)  # r now serves v1 from `mine`
    v2 = pub.publish("m", weights(14))
    with pytest.raises(tensorhub.ConfigError, match=r"serves as 'm' v1; unpublish\('m', 1\) first"):
        r.fetch("m", v2, into=dict(mine))
    assert same(mine, weights(13))  # untouched
    r.unpublish("m", v1)
    assert same(r.fetch("m", v2, into=dict(mine)), weights(14))
    # fetching what we already hold into other tensors is a local copy
    other = {k: torch.zeros_like(t) for k, t in mine.items()}
    got = r.fetch("m", v2, into=other)
    assert same(other, weights(14)) and got.sources == {"r": got.nbytes}


def test_retention_unpublishing_every_holder_in_turn(connect):
    """The newest version keeps a replica while every holder unpublishes in turn: the
    last one either waits for another holder or hands the bytes to a CPU copy."""
    w = weights(15)
    pub, a, b = connect("pub"), connect("a"), connect("b", retain_on_cpu=True)
    v = pub.publish("m", w)
    mine_a = a.fetch("m", v)
    mine_b = b.fetch("m", v)
    pub.unpublish("m", v)
    a.unpublish("m", v)
    for t in mine_a.values():
        t.zero_()  # a reuses its memory
    with pytest.raises(tensorhub.RetentionError):
        b.unpublish("m", v, timeout=0.2, retain_on_cpu=False)  # configured to wait: refused
    b.unpublish("m", v)  # configured retain_on_cpu: hands the bytes to a CPU copy first
    for t in mine_b.values():
        t.fill_(7.0)  # b reuses its memory too
    assert b.held() == [("m", v, "hf", 0)]  # ... but still serves v from the copy
    got = connect("c").fetch("m", v, serve=False)
    assert same(got, w) and got.sources == {"b": got.nbytes}


def test_fetch_keeps_its_deadline_while_the_coordinator_is_down(embedded, connect):
    src = InMemoryTransport(bandwidth=4 * MiB)  # 8 MiB: about 2 s
    a = connect("a", transport=src)
    v = a.publish("m", weights(16, mib=8))
    r = connect("r")
    threading.Timer(0.5, embedded.stop).start()  # the coordinator dies mid-read and stays down
    t0 = time.monotonic()
    with pytest.raises((tensorhub.CoordinatorUnavailableError, tensorhub.FetchError)) as e:
        r.fetch("m", v, timeout=3.0)
    took = time.monotonic() - t0
    assert took < 3.0 + 2.0 + 1.5, f"fetch overran its deadline: {took:.1f}s"
    assert "unreachable" in str(e.value) or "deadline" in str(e.value)
