"""The coordinator's state machine, called directly with a synthetic clock."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tensorhub import ConflictError, ManifestMismatchError, NotFoundError, RetentionError
from tensorhub.server.state import CoordinatorState, StateConfig, locality_cost
from tensorhub.protocol import AcquireLease, Locality, Manifest, RegisterReplica, TensorSpec

# These tests jump time without the shell's once-a-second expiry ticks; pause grace (its
# own tests: tests/test_consistency_state.py) would read each jump as a paused coordinator.
CFG = StateConfig(lease_ttl=10.0, worker_ttl=5.0, suspect_ttl=3.0, pause_grace=1e9, group_ttl=100.0)


def manifest(n: int = 2, dim: int = 4, dtype: str = "float32") -> Manifest:
    return Manifest(tensors=[TensorSpec(name=f"w{i}", dtype=dtype, shape=(dim,), nbytes=dim * 4) for i in range(n)])


def reg(worker: str, model: str, version: int, *, shard: int = 0, num_shards: int = 1,
        man: Manifest | None = None, layout: str = "hf") -> RegisterReplica:
    man = man or manifest()
    return RegisterReplica(worker_id=worker, model=model, version=version, layout=layout, shard=shard,
                           num_shards=num_shards, manifest=man, addresses=[1000 * (i + 1) for i in range(len(man.tensors))])


def lease(worker: str, model: str, version: int, **kw) -> AcquireLease:
    return AcquireLease(worker_id=worker, model=model, version=version, **kw)


def new_state(*workers: str, now: float = 0.0) -> CoordinatorState:
    s = CoordinatorState(CFG, now=now)
    for w in workers:
        s.register_worker(now, w, f"ep-{w}", Locality(datacenter="d", zone="z", host=w))
    return s


def publish(s: CoordinatorState, now: float, worker: str, model: str = "m", **kw) -> int:
    v = s.allocate_version(now, model, kw.pop("version", None))
    s.register_replica(now, reg(worker, model, v, **kw))
    return v


def test_versions_increase_and_are_never_reused_across_restart():
    s = new_state("a")
    assert [s.allocate_version(0, "m") for _ in range(3)] == [1, 2, 3]
    assert s.allocate_version(0, "m", 7) == 7  # explicit jump raises the counter
    with pytest.raises(ConflictError, match="never reused"):
        s.allocate_version(0, "m", 5)  # skipped number
    assert s.allocate_version(0, "m", 3) == 3  # an existing one may be named again
    rows = s.durable_rows()
    s2 = CoordinatorState.restore(rows, CFG, now=100.0)
    assert s2.allocate_version(100, "m") == 8
    assert s2.epoch != s.epoch


def test_latest_only_returns_complete_versions():
    s = new_state("a", "b")
    v = s.allocate_version(0, "m")
    assert s.latest("m") is None  # allocated, no replica yet
    s.register_replica(0, reg("a", "m", v, shard=0, num_shards=2))
    assert s.latest("m") is None  # shard 1 missing
    with pytest.raises(NotFoundError, match="no complete version"):
        s.resolve(0, "m", None)
    _, complete = s.register_replica(0, reg("b", "m", v, shard=1, num_shards=2))
    assert complete and s.latest("m") == v
    v2 = s.allocate_version(1, "m")
    assert s.latest("m") == v  # v2 allocated, not complete
    s.register_replica(1, reg("a", "m", v2))
    assert s.latest("m") == v2
    assert s.latest("m", newer_than=v2) is None


def test_a_delta_layout_alone_never_completes_a_version():
    """``publish(base=)`` registers the delta layout of v before its full layout: the full
    layout (every shard of it) completes v, never the delta (tensorhub._delta_path)."""
    from tensorhub.server.views import version_view
    from tensorhub.protocol import delta_layout

    s = new_state("a", "b")
    v1 = publish(s, 0, "a")
    v2 = s.allocate_version(1, "m")
    dl = delta_layout(v1)
    for shard in (0, 1):  # the delta of both shards: its layout is complete, the version not
        _, complete = s.register_replica(1, reg("a", "m", v2, shard=shard, num_shards=2, layout=dl))
        assert not complete
    assert s.catalog.take_completed() == {"m"}  # v1's, not v2's
    assert s.latest("m") == v1 and s.latest("m", newer_than=v1) is None
    assert s.resolve(1, "m", None) == v1
    view = version_view(s, 1, "m", v2)
    assert not view.complete and view.layouts[dl].complete  # shown, complete as a layout
    assert [v["complete"] for v in s.status(1)["models"][0]["versions"]] == [True, False]
    # v1's last holder may not leave: v2 has only a delta (useless without its base).
    with pytest.raises(RetentionError, match="last replica"):
        s.unpublish(1, "a", "m", v1)
    # A restart restores the same answer (the rows of the etcd and SQLite stores).
    assert CoordinatorState.restore(s.durable_rows(), CFG, now=2.0).latest("m") == v1
    _, complete = s.register_replica(2, reg("a", "m", v2, shard=0, num_shards=2))
    assert not complete and s.latest("m") == v1  # full shard 1 missing
    assert not s.catalog.take_completed()
    _, complete = s.register_replica(2, reg("b", "m", v2, shard=1, num_shards=2))
    assert complete and s.latest("m") == v2 and s.catalog.take_completed() == {"m"}
    assert CoordinatorState.restore(s.durable_rows(), CFG, now=3.0).latest("m") == v2


def test_manifest_mismatch_names_first_difference():
    s = new_state("a", "b")
    v = publish(s, 0, "a")
    bad = Manifest(tensors=[manifest().tensors[0], TensorSpec(name="w1", dtype="float16", shape=(4,), nbytes=8)])
    with pytest.raises(ManifestMismatchError, match=r"tensor #1 'w1': dtype 'float16' != registered 'float32'"):
        s.register_replica(0, reg("b", "m", v, man=bad))
    with pytest.raises(ManifestMismatchError, match="tensor count 3 != registered 2"):
        s.register_replica(0, reg("b", "m", v, man=manifest(3)))
    with pytest.raises(ManifestMismatchError, match="num_shards 2 != registered 1"):
        s.register_replica(0, reg("b", "m", v, num_shards=2))
    assert [r.worker_id for r in s.replicas.values()] == ["a"]


def test_unpublish_drains_leases_and_gives_no_new_ones():
    s = new_state("a", "b", "c")
    v1 = publish(s, 0, "a")
    v2 = publish(s, 0, "a")  # v1 is no longer the newest: no retention on it
    publish(s, 0, "b", version=v1)
    g = s.acquire_lease(0, lease("c", "m", v1, max_sources=1))
    src = g.replicas[0].worker_id
    drained, open_ = s.unpublish(1, src, "m", v1)
    assert (drained, open_) == (False, 1)
    g2 = s.acquire_lease(1, lease("c", "m", v1))
    assert src not in {r.worker_id for r in g2.replicas}  # draining replica gets no new leases
    assert s.release_lease(2, g.lease_id) is True
    assert s.unpublish(2, src, "m", v1) == (True, 0)
    assert all(r.worker_id != src or r.version != v1 for r in s.replicas.values())
    assert v2 == 2


def test_lapsed_lease_is_reported_at_release_and_lets_drain_finish():
    s = new_state("a", "b", "c")
    v1 = publish(s, 0, "a")
    publish(s, 0, "b")  # v2 newest
    g = s.acquire_lease(0, lease("c", "m", v1))
    assert s.unpublish(0, "a", "m", v1) == (False, 1)
    assert s.unpublish(CFG.lease_ttl + 1, "a", "m", v1) == (True, 0)  # expired lease no longer blocks
    assert s.release_lease(CFG.lease_ttl + 2, g.lease_id) is False  # ... and the reader must re-read
    with pytest.raises(ConflictError, match="lapsed"):
        s.renew_lease(CFG.lease_ttl + 2, g.lease_id)


def test_renew_extends_a_lease():
    s = new_state("a", "c")
    v = publish(s, 0, "a")
    g = s.acquire_lease(0, lease("c", "m", v))
    s.renew_lease(8, g.lease_id)
    assert s.release_lease(15, g.lease_id) is True


def test_retention_refuses_last_replica_of_newest_version():
    s = new_state("a", "b")
    v = publish(s, 0, "a")
    with pytest.raises(RetentionError, match="last replica"):
        s.unpublish(0, "a", "m", v)
    publish(s, 0, "b", version=v)
    assert s.unpublish(0, "a", "m", v) == (True, 0)
    with pytest.raises(RetentionError):
        s.unpublish(0, "b", "m", v)
    v2 = publish(s, 1, "a")
    assert s.unpublish(1, "b", "m", v) == (True, 0)  # v is no longer the newest
    assert s.latest("m") == v2


def test_dead_worker_replicas_dropped_after_ttl():
    s = new_state("a", "b")
    v = publish(s, 0, "a")
    s.heartbeat(4, "a")
    assert s.expire(4 + CFG.worker_ttl - 0.1) == ["b"]  # b never heart-beat after t=0
    assert len(s.replicas) == 1
    assert s.expire(4 + CFG.worker_ttl + 0.1) == ["a"]
    assert not s.replicas and s.latest("m") == v  # durable: still complete, just not held
    with pytest.raises(NotFoundError, match="unknown worker"):
        s.heartbeat(20, "a")


def test_restart_restores_durable_state_and_waits_out_old_leases():
    s = new_state("a", "b", "c")
    v1 = publish(s, 0, "a")
    publish(s, 0, "b", version=v1)
    g = s.acquire_lease(0, lease("c", "m", v1))
    s2 = CoordinatorState.restore(s.durable_rows(), CFG, now=50.0)
    assert s2.latest("m") == v1 and not s2.replicas
    for w in "abc":
        s2.register_worker(50, w, f"ep-{w}", Locality())
    s2.register_replica(50, reg("a", "m", v1))
    s2.register_replica(50, reg("b", "m", v1))
    # A lease from the previous incarnation: holders may not finish draining before it lapses ...
    assert s2.unpublish(51, "a", "m", v1) == (False, 1)
    # ... and it is never vouched for (the old one may have judged it lapsed): read again
    assert s2.release_lease(52, g.lease_id) is False
    assert s2.unpublish(50 + CFG.lease_ttl + 0.1, "a", "m", v1) == (True, 0)


def test_group_resolution_pins_one_version_for_all_ranks():
    s = new_state("a")
    v1 = publish(s, 0, "a")
    assert s.resolve(0, "m", "tp0:step1") == v1
    v2 = publish(s, 1, "a")
    assert s.resolve(2, "m", "tp0:step1") == v1  # every rank of the group: the same v1
    assert s.resolve(2, "m", "tp0:step2") == v2
    assert s.resolve(2, "m", None) == v2
    assert s.resolve(2 + CFG.group_ttl + 1, "m", "tp0:step1") == v2  # forgotten after its ttl


def test_source_choice_prefers_near_then_idle_and_skips_suspects():
    s = CoordinatorState(CFG, now=0)
    s.register_worker(0, "far", "e1", Locality(datacenter="x", zone="z", host="h1"))
    s.register_worker(0, "zone", "e2", Locality(datacenter="d", zone="z", host="h2"))
    s.register_worker(0, "zone2", "e3", Locality(datacenter="d", zone="z", host="h3"))
    s.register_worker(0, "reader", "e4", Locality(datacenter="d", zone="z", host="h4"))
    v = publish(s, 0, "far")
    for w in ("zone", "zone2"):
        s.register_replica(0, reg(w, "m", v))
    g = s.acquire_lease(0, lease("reader", "m", v, max_sources=4))
    assert sorted(r.worker_id for r in g.replicas) == ["zone", "zone2"]  # only the nearest tier
    near = {r.replica_id: r for r in s.replicas.values() if r.worker_id in ("zone", "zone2")}
    for rid in near:
        s.report(0, rid, "reader", "boom")
    g3 = s.acquire_lease(1, lease("reader", "m", v))
    assert [r.worker_id for r in g3.replicas] == ["far"]  # suspects skipped
    assert {r.worker_id for r in s.acquire_lease(CFG.suspect_ttl + 1, lease("reader", "m", v)).replicas} == {"zone", "zone2"}
    assert locality_cost(Locality(host="a"), Locality(host="a")) == 0


def test_least_loaded_replica_first():
    s = new_state("a", "b", "r1", "r2")
    v = publish(s, 0, "a")
    s.register_replica(0, reg("b", "m", v))
    g1 = s.acquire_lease(0, lease("r1", "m", v, max_sources=1))
    g2 = s.acquire_lease(0, lease("r2", "m", v, max_sources=1))
    assert {g1.replicas[0].worker_id, g2.replicas[0].worker_id} == {"a", "b"}


def test_no_replica_and_unknown_things_are_clear_errors():
    s = new_state("a", "c")
    with pytest.raises(NotFoundError, match="unknown model 'nope'"):
        s.latest("nope")
    v = publish(s, 0, "a")
    with pytest.raises(NotFoundError, match="has no version 9"):
        s.acquire_lease(0, lease("c", "m", 9))
    with pytest.raises(NotFoundError, match="no layout 'vllm'"):
        s.acquire_lease(0, lease("c", "m", v, layout="vllm"))
    s.remove_worker(0, "a")
    with pytest.raises(ConflictError, match="no replica"):
        s.acquire_lease(0, lease("c", "m", v))
    with pytest.raises(NotFoundError, match="unknown worker"):
        s.acquire_lease(0, lease("ghost", "m", v))


def test_reregistering_with_new_endpoint_drops_old_replicas():
    s = new_state("a")
    publish(s, 0, "a")
    s.register_worker(1, "a", "new-endpoint", Locality())
    assert not s.replicas


# ---------------------------------------------------------------- property test
WORKERS = ["w0", "w1", "w2", "w3"]


class Machine(RuleBasedStateMachine):
    """Random publish / lease / release / unpublish / death / restart sequences."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.s = CoordinatorState(CFG, now=0)
        self.issued: list[int] = []
        self.leases: dict[str, tuple[float, frozenset[str]]] = {}  # lease id -> (granted at, replica ids)
        self.removed_at: dict[str, float] = {}
        self.complete_seen: set[int] = set()
        self.dead_removed: set[str] = set()
        for w in WORKERS:
            self.s.register_worker(0, w, f"ep-{w}", Locality())

    def _alive(self) -> list[str]:
        return [w for w in WORKERS if w in self.s.workers]

    @rule(dt=st.floats(min_value=0, max_value=6))
    def tick(self, dt: float) -> None:
        self.now += dt
        for w in self._alive():
            if w != "w3":  # w3 is flaky: never heart-beats, so it dies
                self.s.heartbeat(self.now, w)
        before = set(self.s.replicas)
        self.s.expire(self.now)
        for rid in before - set(self.s.replicas):
            self.removed_at.setdefault(rid, self.now)
            self.dead_removed.add(rid)  # its worker died (ttl): not an unpublish under a lease

    @rule(w=st.sampled_from(WORKERS), explicit=st.booleans())
    def publish(self, w: str, explicit: bool) -> None:
        if w not in self.s.workers:
            self.s.register_worker(self.now, w, f"ep-{w}", Locality())
        v = self.s.allocate_version(self.now, "m", (max(self.issued, default=0) + 2) if explicit else None)
        assert all(v > x for x in self.issued), "version reused"
        self.issued.append(v)
        self.s.register_replica(self.now, reg(w, "m", v))
        self.complete_seen.add(v)

    @precondition(lambda self: self.issued)
    @rule(w=st.sampled_from(WORKERS), pick=st.integers(0, 100))
    def fetch(self, w: str, pick: int) -> None:
        if w not in self.s.workers:
            return
        v = sorted(self.s.models["m"].versions)[pick % len(self.s.models["m"].versions)]
        try:
            g = self.s.acquire_lease(self.now, lease(w, "m", v))
        except (ConflictError, NotFoundError):
            return
        assert g.version == v
        for r in g.replicas:
            assert not self.s.replicas[r.replica_id].draining
        self.leases[g.lease_id] = (self.now, frozenset(r.replica_id for r in g.replicas))
        if pick % 3 == 0:  # serve it afterwards
            self.s.register_replica(self.now, reg(w, "m", v))

    @precondition(lambda self: self.leases)
    @rule(pick=st.integers(0, 100))
    def release(self, pick: int) -> None:
        lid = sorted(self.leases)[pick % len(self.leases)]
        granted, rids = self.leases.pop(lid)
        valid = self.s.release_lease(self.now, lid)
        if valid:
            # Invariant: a valid release means no replica it read from was taken away (by
            # an unpublish) while the lease was open.
            for rid in rids:
                assert rid not in self.removed_at or self.removed_at[rid] >= self.now or \
                    rid in self.dead_removed, f"lease {lid} valid but {rid} was unpublished under it"

    @precondition(lambda self: self.issued)
    @rule(w=st.sampled_from(WORKERS), pick=st.integers(0, 100))
    def unpublish(self, w: str, pick: int) -> None:
        if w not in self.s.workers:
            return
        v = self.issued[pick % len(self.issued)]
        newest = self.s.latest("m")
        before = {rid for rid, r in self.s.replicas.items() if r.worker_id == w and r.version == v}
        available = v == newest and self.s._available("m", v, set())
        retired = v not in self.s.catalog.model("m").versions
        try:
            drained, _ = self.s.unpublish(self.now, w, "m", v)
        except RetentionError:
            assert v == newest
            return
        except NotFoundError as e:  # retention retired it (keep_versions): only a version nobody held
            assert retired and not before and e.code == "unknown_version" and "retired" in str(e), (v, e)
            return
        assert not retired, f"v{v} was retired, yet unpublish answered"
        if available:  # retention: the newest complete version still has a serving replica
            assert self.s._available("m", v, set())
        if drained:
            for rid in before:
                self.removed_at[rid] = self.now
                # drained => no unexpired lease names it
                for lid, l in self.s.leases.items():
                    assert not (rid in l.replica_ids and l.expires >= self.now)

    @rule(w=st.sampled_from(WORKERS))
    def die(self, w: str) -> None:
        if w in self.s.workers:
            for rid, r in list(self.s.replicas.items()):
                if r.worker_id == w:
                    self.dead_removed.add(rid)
            self.s.remove_worker(self.now, w)

    @rule()
    def restart(self) -> None:
        rows = self.s.durable_rows()
        self.now += 0.5
        self.s = CoordinatorState.restore(rows, CFG, now=self.now)
        self.leases.clear()
        for w in WORKERS:
            self.s.register_worker(self.now, w, f"ep-{w}", Locality())

    @invariant()
    def latest_is_complete(self) -> None:
        if "m" in self.s.models:
            v = self.s.latest("m")
            assert v is None or self.s.models["m"].versions[v].complete
            assert v is None or v in self.complete_seen

    @invariant()
    def counter_covers_all_issued(self) -> None:
        if self.issued:
            assert self.s.models["m"].counter >= max(self.issued)


Machine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])
TestStateMachine = Machine.TestCase


@given(st.lists(st.sampled_from(["alloc", "explicit", "restart"]), max_size=30))
def test_versions_strictly_increase_over_any_restart_sequence(ops):
    s = CoordinatorState(CFG, now=0)
    seen: list[int] = []
    for op in ops:
        if op == "restart":
            s = CoordinatorState.restore(s.durable_rows(), CFG, now=0)
            continue
        v = s.allocate_version(0, "m", (max(seen, default=0) + 3) if op == "explicit" else None)
        assert all(v > x for x in seen)
        seen.append(v)
