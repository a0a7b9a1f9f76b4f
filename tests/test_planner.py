"""The planner (pure functions) and its use by the coordinator's state machine: ordering,
striping, partial replicas, cross-datacenter seeding and takeover."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorhub import ConflictError
from tensorhub._planner import (
    Candidate, choose_sources, chunk_order, grid_chunk_bytes, locality_cost, pick_chunk, start_fraction,
)
from tensorhub.server.state import CoordinatorState, StateConfig
from tensorhub.protocol import AcquireLease, Locality, Manifest, RegisterReplica, TensorSpec

MiB = 1 << 20
# These tests jump time without the shell's once-a-second expiry ticks; pause grace (its
# own tests: tests/test_consistency_state.py) would read each jump as a paused coordinator.
CFG = StateConfig(lease_ttl=10.0, worker_ttl=5.0, suspect_ttl=3.0, pause_grace=1e9)


def loc(dc: str = "a", zone: str = "z", host: str = "h") -> Locality:
    return Locality(datacenter=dc, zone=zone, host=host)


def cand(rid: str, where: Locality, load: int = 0, chunks=None, t: float = 0.0) -> Candidate:
    return Candidate(rid, "w-" + rid, where, load, t, None if chunks is None else frozenset(chunks))


def ids(choice) -> list[str]:
    return [c.replica_id for c, _ in choice.sources]


# ---------------------------------------------------------------- pure planner
def test_cost_order_then_load_and_stripe_over_k_equally_near():
    me = loc(host="me")
    cands = [cand("far", loc(dc="b")), cand("dc", loc(zone="y", host="x")),
             cand("z1", loc(host="h1"), load=3), cand("z2", loc(host="h2"), load=1),
             cand("z3", loc(host="h3"), load=2), cand("same", loc(host="me"), load=9)]
    assert ids(choose_sources(me, "me", cands, max_sources=4)) == ["same"]  # same host wins over load
    rest = [c for c in cands if c.replica_id != "same"]
    assert ids(choose_sources(me, "me", rest, max_sources=2)) == ["z2", "z3"]  # nearest tier, least loaded
    assert ids(choose_sources(me, "me", rest, max_sources=8)) == ["z2", "z3", "z1"]  # never a farther tier
    assert [locality_cost(me, c.locality) for c in cands] == [3, 2, 1, 1, 1, 0]


def test_partials_need_pipelined_readers_and_a_complete_source_stays_reachable():
    me = loc(host="me")
    pub = cand("pub", loc(zone="y", host="p"), load=5)  # same dc, other zone: cost 2
    parts = [cand(f"p{i}", loc(host=f"h{i}"), chunks={0, 1}) for i in range(3)]  # cost 1, partial
    assert ids(choose_sources(me, "me", [pub, *parts], max_sources=4, pipelined=False)) == ["pub"]
    got = choose_sources(me, "me", [pub, *parts], max_sources=3)
    assert ids(got) == ["pub", "p0"] and got.seed_levels == (0, 1)  # zone seeder: keeps a partial, + outside
    follower = choose_sources(me, "me", [pub, *parts], max_sources=3, seeders={1: ("w-p0", True)})
    assert set(ids(follower)) == {"p0", "p1", "p2"}  # its zone has no complete replica: reads inside
    full = cand("p9", loc(host="h9"), load=7)  # a complete replica in the nearest tier: no seeding
    got = choose_sources(me, "me", [pub, *parts, full], max_sources=3)
    assert "pub" not in ids(got) and "p9" in ids(got)
    lone = choose_sources(me, "me", [pub, cand("q", loc(host="h1"), chunks={0})], max_sources=1)
    assert ids(lone) == ["pub"]  # one slot: the complete replica keeps every chunk reachable


def test_cross_datacenter_seeding_one_seeder_followers_local_takeover():
    pub = cand("pub", loc(dc="a", host="p"))
    me = loc(dc="b", host="r1")
    first = choose_sources(me, "r1", [pub], max_sources=4)
    assert first.seed and ids(first) == ["pub"]
    seed_partial = cand("s", loc(dc="b", host="r1"), chunks={0, 1, 2})
    follower = choose_sources(loc(dc="b", host="r2"), "r2", [pub, seed_partial], max_sources=4,
                              seeder="w-s", seeder_alive=True)
    assert not follower.seed and ids(follower) == ["s"]  # never the slow link
    # the seeder died: the next reader takes over, from what its datacenter already has + remote
    other = cand("o", loc(dc="b", host="r3"), chunks={0, 1})
    took = choose_sources(loc(dc="b", host="r2"), "r2", [pub, other], max_sources=4,
                          seeder="w-s", seeder_alive=False)
    assert took.seed and "takes over" in took.reason and set(ids(took)) == {"o", "pub"}
    # once the datacenter has a complete replica, nobody crosses
    done = cand("d", loc(dc="b", host="r4"))
    assert ids(choose_sources(loc(dc="b", host="r5"), "r5", [pub, done], max_sources=4)) == ["d"]


def test_single_source_baseline_reads_the_first_replica():
    pub = cand("pub", loc(dc="a", host="p"), load=9, t=0.0)
    peer = cand("peer", loc(dc="a", host="r"), t=1.0)
    got = choose_sources(loc(dc="a", host="r"), "me", [peer, pub], max_sources=4, policy="single-source")
    assert ids(got) == ["pub"]
    with pytest.raises(ValueError, match="unknown planner policy"):
        choose_sources(loc(), "me", [pub], max_sources=1, policy="nope")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 31), max_size=32), st.lists(st.one_of(st.none(), st.sets(st.integers(0, 31))),
                                                             max_size=4),
       st.one_of(st.none(), st.sets(st.integers(0, 31))), st.sets(st.integers(0, 31)))
def test_pick_chunk_only_picks_what_the_source_holds_and_rarest_first(order, others, have, skip):
    order = list(dict.fromkeys(order))
    h = None if have is None else frozenset(have)
    os_ = [None if o is None else frozenset(o) for o in others]
    c = pick_chunk(order, h, os_, skip)
    eligible = [x for x in order if x not in skip and (h is None or x in h)]
    if h is None:  # a complete source leaves to partial sources what they hold
        eligible = [x for x in eligible if not any(o is not None and x in o for o in os_)]
    if not eligible:
        assert c is None
        return
    assert c in eligible
    count = lambda x: sum(1 for o in os_ if o is None or x in o)  # noqa: E731
    assert count(c) == min(count(x) for x in eligible)


def test_grid_and_order():
    assert grid_chunk_bytes(256 * MiB) == 4 * MiB
    assert grid_chunk_bytes(10) == MiB and grid_chunk_bytes(1 << 40) == 64 * MiB
    assert sorted(chunk_order(10, 0.55)) == list(range(10)) and chunk_order(10, 0.55)[0] == 5
    assert chunk_order(5, 0.4, reverse=True) == [2, 1, 0, 4, 3]
    assert len({int(start_fraction(k) * 8) for k in range(8)}) >= 6  # concurrent readers spread out


# ---------------------------------------------------------------- in the state machine
def man(n: int = 4, nbytes: int = 4 * MiB) -> Manifest:
    return Manifest(tensors=[TensorSpec(name=f"w{i}", dtype="uint8", shape=(nbytes,), nbytes=nbytes) for i in range(n)])


def reg(worker: str, version: int, **kw) -> RegisterReplica:
    return RegisterReplica(worker_id=worker, model="m", version=version, manifest=man(),
                           addresses=[(i + 1) << 24 for i in range(4)], **kw)


def state(**where: Locality) -> CoordinatorState:
    s = CoordinatorState(CFG, now=0)
    for w, l in where.items():
        s.register_worker(0, w, f"ep-{w}", l)
    return s


def acquire(s: CoordinatorState, now: float, who: str, **kw):
    return s.acquire_lease(now, AcquireLease(worker_id=who, model="m", version=1, pipelined=True, **kw))


def test_state_partial_replicas_are_offered_only_for_reported_chunks():
    s = state(pub=loc(host="p"), r1=loc(host="1"), r2=loc(host="2"))
    v = s.allocate_version(0, "m")
    s.register_replica(0, reg("pub", v))
    g1 = acquire(s, 0, "r1")
    assert g1.chunk_bytes == grid_chunk_bytes(16 * MiB) and [r.worker_id for r in g1.replicas] == ["pub"]
    with pytest.raises(ConflictError, match="chunk grid"):
        s.register_replica(0, reg("r1", v, partial=True, chunk_bytes=123, num_chunks=4))
    rid, _ = s.register_replica(0, reg("r1", v, partial=True, chunk_bytes=g1.chunk_bytes, num_chunks=16))
    g2 = acquire(s, 0, "r2")
    got = {r.worker_id: r.chunks for r in g2.replicas}
    assert got == {"r1": [], "pub": None}  # r1 holds nothing reported yet
    s.add_chunks(0.5, rid, "r1", [3, 4], [g1.lease_id])
    g2 = acquire(s, 0.6, "r2", lease_id=g2.lease_id)  # refresh: same lease, newer chunk sets
    assert {r.worker_id: r.chunks for r in g2.replicas}["r1"] == [3, 4]
    assert not s.acquire_lease(0.6, AcquireLease(worker_id="r2", model="m", version=1)).replicas[0].chunks
    assert [r.worker_id for r in s.acquire_lease(0.6, AcquireLease(worker_id="r2", model="m", version=1)).replicas] == ["pub"]
    # a partial replica does not count for retention; completing it does
    from tensorhub import RetentionError
    with pytest.raises(RetentionError):
        s.unpublish(1, "pub", "m", v)
    assert s.register_replica(1, reg("r1", v))[0] == rid and s.replicas[rid].chunks is None
    assert s.unpublish(1, "pub", "m", v)[0] is False  # draining now (r2's lease names pub)
    # a chunk read under a lapsed lease is never offered (time only moves forward: last)
    with pytest.raises(ConflictError, match="lapsed"):
        s.add_chunks(CFG.lease_ttl + 1, rid, "r1", [5], [g1.lease_id])


def test_state_seeding_and_takeover():
    s = state(pub=loc(dc="a", host="p"), b1=loc(dc="b", host="1"), b2=loc(dc="b", host="2"),
              b3=loc(dc="b", host="3"))
    v = s.allocate_version(0, "m")
    s.register_replica(0, reg("pub", v))
    g1 = acquire(s, 0, "b1")
    assert g1.seed and [r.worker_id for r in g1.replicas] == ["pub"]
    g2 = acquire(s, 0.1, "b2")  # b1 named seeder, partial not registered yet: wait, do not cross
    assert not g2.seed and g2.replicas == []
    grid = g1.chunk_bytes
    r1, _ = s.register_replica(0.2, reg("b1", v, partial=True, chunk_bytes=grid, num_chunks=16))
    s.register_replica(0.2, reg("b2", v, partial=True, chunk_bytes=grid, num_chunks=16))
    s.add_chunks(0.3, r1, "b1", range(8), [g1.lease_id])
    g2 = acquire(s, 0.4, "b2", lease_id=g2.lease_id)
    assert not g2.seed and [r.worker_id for r in g2.replicas] == ["b1"]
    # b1 dies; b2 (which has chunks of its own) takes over; b3 then follows b2
    s.remove_worker(1.0, "b1")
    g2 = acquire(s, 1.1, "b2", lease_id=g2.lease_id)
    assert g2.seed and "pub" in [r.worker_id for r in g2.replicas]
    g3 = acquire(s, 1.2, "b3")
    assert not g3.seed and [r.worker_id for r in g3.replicas] == ["b2"]
    # a reported (suspect) seeder loses the role too
    s.report(1.3, [r.replica_id for r in s.replicas.values() if r.worker_id == "b2"][0], "b3", "boom")
    g3 = acquire(s, 1.4, "b3", lease_id=g3.lease_id)
    assert g3.seed and [r.worker_id for r in g3.replicas] == ["pub"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["report", "lease", "complete"]), st.integers(0, 2),
                          st.sets(st.integers(0, 15), max_size=4)), max_size=30))
def test_state_offers_a_partial_replica_only_for_chunks_it_reported(ops):
    s = state(pub=loc(host="p"), r0=loc(host="0"), r1=loc(host="1"), r2=loc(host="2"))
    v = s.allocate_version(0, "m")
    s.register_replica(0, reg("pub", v))
    grid = grid_chunk_bytes(16 * MiB)
    rids, leases, reported = {}, {}, {}
    for i in range(3):
        g = acquire(s, 0, f"r{i}")
        leases[i] = g.lease_id
        rids[i] = s.register_replica(0, reg(f"r{i}", v, partial=True, chunk_bytes=grid, num_chunks=16))[0]
        reported[i] = set()
    for t, (op, who, chunks) in enumerate(ops, start=1):
        now = t * 0.01
        if op == "report":
            s.add_chunks(now, rids[who], f"r{who}", sorted(chunks), [leases[who]], coming=[15])
            reported[who] |= chunks
        elif op == "complete":
            s.register_replica(now, reg(f"r{who}", v))
            reported[who] = set(range(16))
        else:
            g = acquire(s, now, f"r{who}", lease_id=leases[who])
            for r in g.replicas:
                if r.chunks is not None:
                    w = int(r.worker_id[1:])
                    assert set(r.chunks) <= reported[w], (r.worker_id, r.chunks, reported[w])
                    assert 15 not in set(r.chunks) - reported[w]  # "coming" is never offered


def test_reserve_chunks_splits_a_scarce_source_between_readers():
    from tensorhub._planner import reserve_chunks

    order = chunk_order(16, 0.0)
    a = reserve_chunks(order, frozenset({0}), frozenset(), frozenset(), n=4)
    assert a == {1, 2, 3, 4}
    b = reserve_chunks(chunk_order(16, 0.5, True), frozenset(), a, frozenset(), n=4)
    assert b == {8, 7, 6, 5} and not a & b
    kept = reserve_chunks(order, frozenset({1, 2}), frozenset(), a, n=4)
    assert {3, 4} <= kept and len(kept) == 4 and not kept & {1, 2}  # keeps what it still lacks


def test_state_reserves_disjoint_chunks_of_the_one_complete_source():
    s = state(pub=loc(host="p"), r1=loc(host="1"), r2=loc(host="2"))
    v = s.allocate_version(0, "m")
    s.register_replica(0, reg("pub", v))
    grid = grid_chunk_bytes(16 * MiB)
    g1 = acquire(s, 0, "r1")
    s.register_replica(0, reg("r1", v, partial=True, chunk_bytes=grid, num_chunks=16))
    g2 = acquire(s, 0, "r2")
    s.register_replica(0, reg("r2", v, partial=True, chunk_bytes=grid, num_chunks=16))
    g1 = acquire(s, 0.1, "r1", lease_id=g1.lease_id)
    g2 = acquire(s, 0.1, "r2", lease_id=g2.lease_id)
    assert g1.reserved and g2.reserved and not set(g1.reserved) & set(g2.reserved)
    assert set(g1.reserved) <= set(g2.claimed) or set(g2.reserved) <= set(g1.claimed)
    # a second complete replica: nothing scarce, no rationing
    s.register_replica(0.2, reg("r1", v))
    g2 = acquire(s, 0.3, "r2", lease_id=g2.lease_id)
    assert g2.reserved is None
