"""Consistency under control-plane faults, on the pure state machine (issue 11).

Each test is a scenario that returned a wrong answer before fencing, clamped time, pause
grace, idempotent retries and ``version_gone`` (see ``tensorhub/server/state.py`` invariants
8-11); the model-checking tests (test_state_model.py, test_state_exhaustive.py) cover
their interleavings.
"""

from __future__ import annotations

import pytest

from tensorhub import ConflictError
from tensorhub.server.state import CoordinatorState, StateConfig
from tensorhub.protocol import AcquireLease, Locality, Manifest, RegisterReplica

LOC = Locality(datacenter="d", zone="z", host="h")
MAN = Manifest.model_validate({"tensors": [{"name": "w", "dtype": "float32", "shape": [4], "nbytes": 16}]})


def reg(worker: str, v: int, addr: int, **kw) -> RegisterReplica:
    return RegisterReplica(worker_id=worker, model="m", version=v, manifest=MAN, addresses=[addr], **kw)


def test_issue_repro_expired_holder_cannot_drain_a_leased_replica():
    """The issue's sequence, verbatim: the trainer's heartbeats stall past worker_ttl
    while a reader reads v1 from it; it re-registers, publishes v2, unpublishes v1. v1's
    buffer must stay fenced until the reader releases."""
    st = CoordinatorState(StateConfig(), now=0.0)
    st.register_worker(0, "trainer", "ep-t", LOC)
    st.register_worker(0, "reader", "ep-r", LOC)
    v = st.allocate_version(0, "m")
    st.register_replica(0, reg("trainer", v, 4096))
    g = st.acquire_lease(1, AcquireLease(worker_id="reader", model="m", version=v))
    st.heartbeat(11.5, "reader")
    st.expire(12.0)
    st.register_worker(12.1, "trainer", "ep-t", LOC)
    st.register_replica(12.1, reg("trainer", v, 4096))
    v2 = st.allocate_version(12.15, "m")
    st.register_replica(12.15, reg("trainer", v2, 8192))
    assert st.unpublish(12.2, "trainer", "m", v) == (False, 1)
    assert st.release_lease(13.0, g.lease_id) is True
    assert st.unpublish(13.1, "trainer", "m", v) == (True, 0)


def ticking(cfg: StateConfig, *workers: str) -> CoordinatorState:
    st = CoordinatorState(cfg, now=0.0)
    for w in workers:
        st.register_worker(0, w, f"ep-{w}", LOC)
    return st


def tick(st: CoordinatorState, t0: float, t1: float, alive: tuple[str, ...]) -> None:
    """The shell's expiry ticker (every 0.5 s) from t0 to t1; ``alive`` heart-beat."""
    t = t0
    while t < t1:
        t = min(t1, t + 0.5)
        for w in alive:
            st.heartbeat(t, w)
        st.expire(t)


def test_expired_holder_tombstone_fences_its_memory_with_regular_ticks():
    cfg = StateConfig(lease_ttl=30.0, worker_ttl=10.0)
    st = ticking(cfg, "trainer", "reader")
    v = st.allocate_version(0, "m")
    st.register_replica(0, reg("trainer", v, 4096))
    g = st.acquire_lease(1, AcquireLease(worker_id="reader", model="m", version=v))
    tick(st, 1, 12, alive=("reader",))  # the trainer's route to the coordinator is cut
    assert "trainer" not in st.workers and len(st.tombstones) == 1
    # the tombstone is never offered
    st.register_worker(12.1, "other", "ep-o", LOC)
    with pytest.raises(ConflictError) as e:
        st.acquire_lease(12.1, AcquireLease(worker_id="other", model="m", version=v))
    assert e.value.code == "no_replica"
    # the trainer heals: re-registers what it holds and moves on
    st.register_worker(12.2, "trainer", "ep-t", LOC)
    st.register_replica(12.2, reg("trainer", v, 4096))
    v2 = st.allocate_version(12.3, "m")
    st.register_replica(12.3, reg("trainer", v2, 8192))
    drained, open_ = st.unpublish(12.4, "trainer", "m", v)
    assert (drained, open_) == (False, 1)
    st.renew_lease(20, g.lease_id)  # the reader is still reading: it renews
    tick(st, 20, 45, alive=("reader", "trainer", "other"))  # renewed at 20: good until 50
    assert st.unpublish(45, "trainer", "m", v)[0] is False
    assert st.release_lease(46, g.lease_id) is True
    assert st.unpublish(46.1, "trainer", "m", v) == (True, 0)
    assert not st.tombstones


def test_tombstone_goes_once_its_lease_lapses():
    cfg = StateConfig(lease_ttl=5.0, worker_ttl=2.0)
    st = ticking(cfg, "h", "r")
    v = st.allocate_version(0, "m")
    st.register_replica(0, reg("h", v, 4096))
    st.acquire_lease(0.5, AcquireLease(worker_id="r", model="m", version=v))
    tick(st, 0.5, 3, alive=("r",))
    assert len(st.tombstones) == 1
    tick(st, 3, 6, alive=("r",))  # the lease lapsed at 5.5 (never renewed): provably over
    assert not st.tombstones


def test_closing_or_new_endpoint_also_fences_leased_replicas():
    st = ticking(StateConfig(), "h", "r")
    v = st.allocate_version(0, "m")
    st.register_replica(0, reg("h", v, 4096))
    st.acquire_lease(0.1, AcquireLease(worker_id="r", model="m", version=v))
    st.register_worker(0.2, "h", "ep-new", LOC)  # a restarted process under the same id
    assert len(st.tombstones) == 1
    st.register_replica(0.3, reg("h", v, 4096))
    st.register_replica(0.3, reg("h", st.allocate_version(0.3, "m"), 8192))
    assert st.unpublish(0.4, "h", "m", v) == (False, 1)


def test_unpublish_of_one_partial_replica_drains_only_its_own_tombstones():
    st = ticking(StateConfig(), "h", "r")
    v = st.allocate_version(0, "m")
    st.register_replica(0, reg("h", v, 4096))
    rid2, _ = st.register_replica(0, RegisterReplica(worker_id="h", model="m", version=v, manifest=MAN,
                                                     addresses=[9000], layout="other"))
    assert st.unpublish(0.1, "h", "m", v, [rid2]) == (True, 0)
    assert any(r.layout == "hf" for r in st.replicas.values())  # the other replica stays


def test_time_never_moves_back_a_lapsed_lease_stays_lapsed():
    st = ticking(StateConfig(lease_ttl=5.0, worker_ttl=60.0), "h", "r")
    v = st.allocate_version(0, "m")
    st.register_replica(0, reg("h", v, 4096))
    g = st.acquire_lease(0, AcquireLease(worker_id="r", model="m", version=v))
    st.register_replica(0, reg("h", st.allocate_version(0, "m"), 8192))
    assert st.unpublish(3, "h", "m", v) == (False, 1)
    assert st.unpublish(6, "h", "m", v) == (True, 0)  # lapsed at 5: drained, the holder may write
    # the clock steps back by an hour: the lapsed lease is not good again
    assert st.release_lease(6 - 3600, g.lease_id) is False
    with pytest.raises(ConflictError, match="lapsed"):
        st.renew_lease(1, g.lease_id)


def test_forward_step_or_pause_does_not_expire_every_worker_at_once():
    cfg = StateConfig(lease_ttl=30.0, worker_ttl=10.0)
    st = ticking(cfg, "h", "r", "idle")
    v = st.allocate_version(0, "m")
    st.register_replica(0, reg("h", v, 4096))
    st.acquire_lease(1, AcquireLease(worker_id="r", model="m", version=v))
    tick(st, 1, 2, alive=("h", "r", "idle"))
    # the coordinator is SIGSTOPped for 60 s: no call at all, then its ticker runs first
    assert st.expire(62) == []
    assert set(st.workers) == {"h", "r", "idle"} and st.pauses == 1
    # workers that heart-beat keep living; one that stays silent goes after a fresh ttl
    tick(st, 62, 73, alive=("h", "r"))
    assert set(st.workers) == {"h", "r"}


def test_allocation_retry_with_the_same_request_id_does_not_skip_a_version(tmp_path):
    st = ticking(StateConfig(), "t")
    assert st.allocate_version(0, "m", request_id="req-1") == 1
    assert st.allocate_version(0.1, "m", request_id="req-1") == 1  # the answer was lost: retried
    assert st.allocate_version(0.2, "m", request_id="req-2") == 2
    # durable: a coordinator that restarts after committing still answers the retry
    st2 = CoordinatorState.restore(st.durable_rows(), StateConfig(), now=100)
    assert st2.allocate_version(100, "m", request_id="req-2") == 2
    assert st2.allocate_version(100, "m") == 3


def test_allocation_answers_survive_a_real_store(tmp_path):
    from tensorhub.server.store import SqliteStore

    st = ticking(StateConfig(), "t")
    store = SqliteStore(tmp_path)
    store.open()
    st.allocate_version(0, "m", request_id="a")
    store.commit(st.take_writes())
    store.close()
    store = SqliteStore(tmp_path)
    store.open()
    st2 = CoordinatorState.restore(store.load(), StateConfig(), now=5)
    assert st2.allocate_version(5, "m", request_id="a") == 1
    assert st2.allocate_version(5, "m", request_id="b") == 2


def test_lease_retry_with_the_same_request_id_opens_no_second_lease():
    st = ticking(StateConfig(), "h", "r")
    v = st.allocate_version(0, "m")
    st.register_replica(0, reg("h", v, 4096))
    req = AcquireLease(worker_id="r", model="m", version=v, request_id="x1")
    g1 = st.acquire_lease(0.1, req)
    g2 = st.acquire_lease(0.2, req)
    assert g1.lease_id == g2.lease_id and len(st.leases) == 1
    assert st.acquire_lease(0.3, AcquireLease(worker_id="r", model="m", version=v,
                                              request_id="x2")).lease_id != g1.lease_id


def test_a_version_nobody_can_serve_any_more_fails_at_once_naming_the_newest():
    st = ticking(StateConfig(), "h", "r")
    v1 = st.allocate_version(0, "m")
    st.register_replica(0, reg("h", v1, 4096))
    v2 = st.allocate_version(0, "m")
    st.register_replica(0, reg("h", v2, 8192))
    assert st.unpublish(1, "h", "m", v1) == (True, 0)
    with pytest.raises(ConflictError) as e:
        st.acquire_lease(1, AcquireLease(worker_id="r", model="m", version=v1))
    assert e.value.code == "version_gone" and f"v{v2}" in e.value.message
    # the newest version with no replica is only "not serving now": it may come back
    st.register_worker(1, "h2", "ep-h2", LOC)
    st.register_replica(1, reg("h2", v2, 4096))
    st.remove_worker(1.1, "h")
    assert st.acquire_lease(1.2, AcquireLease(worker_id="r", model="m", version=v2)).replicas


def test_version_gone_waits_out_re_registration_after_a_restart():
    st = ticking(StateConfig(worker_ttl=10.0), "h")
    v1 = st.allocate_version(0, "m")
    st.register_replica(0, reg("h", v1, 4096))
    v2 = st.allocate_version(0, "m")
    st.register_replica(0, reg("h", v2, 8192))
    st2 = CoordinatorState.restore(st.durable_rows(), StateConfig(worker_ttl=10.0), now=100)
    st2.register_worker(100, "r", "ep-r", LOC)
    with pytest.raises(ConflictError) as e:  # holders may still re-register v1
        st2.acquire_lease(101, AcquireLease(worker_id="r", model="m", version=v1))
    assert e.value.code == "no_replica"
    st2.heartbeat(111, "r")
    with pytest.raises(ConflictError) as e:
        st2.acquire_lease(111, AcquireLease(worker_id="r", model="m", version=v1))
    assert e.value.code == "version_gone"


def test_metrics_view_counts_fenced_replicas_and_pauses():
    cfg = StateConfig(lease_ttl=30.0, worker_ttl=10.0)
    st = ticking(cfg, "h", "r")
    v = st.allocate_version(0, "m")
    st.register_replica(0, reg("h", v, 4096))
    st.acquire_lease(1, AcquireLease(worker_id="r", model="m", version=v))
    tick(st, 1, 12, alive=("r",))
    view = st.metrics_view(12)
    assert view["models"]["m"]["replicas"]["fenced"] == 1 and view["pauses"] == 0
    st.expire(40)  # paused 28 s
    assert st.metrics_view(40)["pauses"] == 1


def test_version_gone_does_not_count_the_readers_own_partial_replica():
    st = ticking(StateConfig(), "h", "r")
    v1 = st.allocate_version(0, "m")
    st.register_replica(0, reg("h", v1, 4096))
    g = st.acquire_lease(0, AcquireLease(worker_id="r", model="m", version=v1, pipelined=True))
    st.register_replica(0, reg("r", v1, 9000, partial=True, chunk_bytes=g.chunk_bytes, num_chunks=1))
    st.register_replica(0, reg("h", st.allocate_version(0, "m"), 8192))
    st.release_lease(0.1, g.lease_id)
    assert st.unpublish(0.2, "h", "m", v1) == (True, 0)
    with pytest.raises(ConflictError) as e:  # only its own partial replica is left: gone
        st.acquire_lease(0.3, AcquireLease(worker_id="r", model="m", version=v1, pipelined=True))
    assert e.value.code == "version_gone"
