"""Striped plans (tensorhub/server/stripes.py): the layout's shape (every stripe reachable from the
root without cycles, the root sends each stripe once, nobody uploads much more than a
version), the forming window, late joiners, failed parents, and the coordinator's grants
(CoordinatorState: which readers get a plan, and the sources it names)."""

from __future__ import annotations

import collections

import pytest

from tensorhub.server.stripes import (
    EARLY, MIN_CHUNKS, NONE, STRIPES, WAN, WINDOW, Plan, layout, plan_root, relayed, stripe_of, wan_root, wan_stripes,
)


def _depth(lay, m, s, seen=()):
    p = lay[m][s]
    if p < 0:
        return 1
    assert p not in seen and p != m, f"cycle through member {m} in stripe {s}"
    return 1 + _depth(lay, p, s, seen + (m,))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 16, 33, 128, 1024])
def test_layout_reaches_everyone_from_the_root_once_per_stripe(n):
    d = STRIPES
    lay = layout(n, d)
    kids = collections.Counter((p, s) for row in lay for s, p in enumerate(row))
    # The root sends every stripe exactly once: one child per stripe.
    assert all(kids[(-1, s)] == 1 for s in range(d)), kids
    uploads = collections.Counter(p for (p, s), k in kids.items() for _ in range(k) if p >= 0)
    depth = max(_depth(lay, m, s) for m in range(n) for s in range(d))
    if n >= d:
        # every member uploads at most D stripe copies (one version); a few members more
        # than D but not a multiple of it leave one stripe with fewer carriers (n=7: one
        # member carries stripe 3 to the six others, 1.5 versions)
        assert max(uploads.values(), default=0) <= (d if n % d == 0 or n >= d * d else 2 * d), uploads
        # ... and interior members are the members of that stripe (a % D)
        assert all(p % d == s for (p, s) in kids if p >= 0)
    else:  # fewer members than stripes: one member carries several stripes
        assert sum(uploads.values()) == n * d - d
    # the tree is shallow: about log_D(n / D) + 2 hops
    import math

    assert depth <= max(2, math.ceil(math.log(max(n, 1), d))) + 2, depth


def _layout_by_scan(members, stripes, hosts=None):
    """``layout``'s leaves placed as it places them, by the rule's plain scan (the fewest
    network children, ties the later; a host-mate first): the reference its heap must equal."""
    from tensorhub.server.stripes import _interior, _same_host

    d = max(1, stripes)
    out = [[-1] * d for _ in range(members)]
    for s in range(d):
        inner = list(range(s, members, d)) or ([s % members] if members else [])
        if not inner:
            continue
        kids = {m: 0 for m in inner}
        for m, p in _interior(inner, hosts, d).items():
            out[m][s] = p
            if p >= 0 and not (hosts is not None and _same_host(hosts, p, m)):
                kids[p] += 1
        local = {}
        for m in inner:
            if hosts is not None and hosts[m] is not None:
                local.setdefault(hosts[m], []).append(m)
        near = {m: 0 for m in inner}
        for m in range(members):
            if m in kids:
                continue
            mates = local.get(hosts[m]) if hosts is not None and hosts[m] is not None else None
            if mates:
                p = min(reversed(mates), key=lambda x: near[x])
                near[p] += 1
            else:
                p = min(reversed(inner), key=lambda x: kids[x])
                kids[p] += 1
            out[m][s] = p
    return out


def test_layout_places_leaves_as_the_plain_scan():
    """The leaves' parents come from a heap (a scan per leaf made the layout quadratic: 4.6 s
    of the publish's call at 10,000 subscribers, 0.05 s now); the layout is the scan's,
    exactly, and at 10,000 members still balanced."""
    import random

    rnd = random.Random(7)
    for n in [*range(0, 40), 63, 64, 65, 255, 257, 600]:
        for d in (1, 2, 3, 4, 5):
            for hosts in (None, [None] * n, [f"h{i // 8}" for i in range(n)],
                          [rnd.choice(["a", "b", None, "c"]) for _ in range(n)]):
                assert layout(n, d, hosts) == _layout_by_scan(n, d, hosts), (n, d, hosts)
    lay = layout(10_000, STRIPES, [None] * 10_000)
    kids = collections.Counter((p, s) for row in lay for s, p in enumerate(row) if p >= 0)
    assert max(kids.values()) <= STRIPES + 1


def test_interior_parents_arrived_earlier():
    lay = layout(300, STRIPES)
    for m, row in enumerate(lay):
        s = m % STRIPES
        assert row[s] < m  # (-1 = the root) an interior member's parent in its own stripe came before it


def _net_hops(lay, hosts, m, s):
    p = lay[m][s]
    if p < 0:
        return 1
    return (hosts[p] != hosts[m]) + _net_hops(lay, hosts, p, s)


def test_layout_by_host_reads_over_the_network_once_per_host_and_stripe():
    """8 members to a host (GPUs of a node): per stripe, one interior member of a host reads
    it over the network, its host-mates (interior or leaf) read it from one on their host;
    a host's child hosts are served by all its interior members of that stripe, so none
    sends to more than D / 2 others over the network (half its uplink). Hosts unknown
    (None) or all different: the layout without hosts."""
    d, n = STRIPES, 256
    hosts = [f"h{m // 8}" for m in range(n)]
    lay = layout(n, d, hosts)
    plain = layout(n, d)
    net = collections.Counter()
    for s in range(d):
        entered = collections.Counter(hosts[m] for m in range(n) if lay[m][s] == -1 or hosts[lay[m][s]] != hosts[m])
        assert set(entered.values()) == {1} and len(entered) == n // 8, entered  # once per host
    for m, row in enumerate(lay):
        for s, p in enumerate(row):
            assert p < 0 or p % d == s  # parents are interior members of the stripe
            if m % d == s:
                assert p < m  # (an interior parent arrived before its child)
            else:  # a leaf of s: under an interior member of s on its own host
                assert p >= 0 and hosts[p] == hosts[m], (m, s, p)
            if p >= 0 and hosts[p] != hosts[m]:
                net[p] += 1
    assert max(net.values()) <= d // 2, net
    # no more network hops than without hosts (fewer: the leaves' last hop is local)
    for s in range(d):
        assert max(_net_hops(lay, hosts, m, s) for m in range(n)) < max(_depth(plain, m, s) for m in range(n))
    # hosts unknown, or one member per host: the same layout as without hosts
    assert layout(n, d, [None] * n) == plain
    assert layout(n, d, [f"h{m}" for m in range(n)]) == plain
    # a host with no interior member of a stripe: its leaves go over the network as before
    odd = [f"h{m // 3}" for m in range(30)]  # 3 members to a host: some hosts lack a stripe
    lay3 = layout(30, d, odd)
    for m, row in enumerate(lay3):
        for s, p in enumerate(row):
            if m % d != s and not any(q % d == s and odd[q] == odd[m] for q in range(30)):
                assert p >= 0 and p % d == s and odd[p] != odd[m]


def test_layout_by_host_interleaved_arrivals_parents_came_first():
    """Readers of many hosts arrive interleaved: every interior parent still arrived before
    its child (so a failed parent's replacement, an earlier member, is never below it)."""
    import random

    rnd = random.Random(7)
    for n in (5, 37, 300):
        hosts = [f"h{rnd.randrange(max(1, n // 6))}" for _ in range(n)]
        lay = layout(n, STRIPES, hosts)
        for m, row in enumerate(lay):
            for s, p in enumerate(row):
                if m % STRIPES == s:
                    assert p < m
                _depth(lay, m, s)  # (no cycles)


def test_plan_passes_hosts_to_its_layout_and_counts_network_children():
    p = Plan("root", STRIPES, opened=0.0)
    for k in range(32):
        p.join(f"w{k}", f"r{k}", 0.0, host=f"h{k // 8}")
    row, again = p.parents("w1", 1.0)  # fixed now
    assert again == 0.0
    assert [int(x[1:]) // 8 if x != "root" else None for s, x in enumerate(row) if s != 1] == [0, 0, 0]
    # no host label (""): unknown, not one shared host -- the layout without hosts
    q = Plan("root", STRIPES, opened=0.0)
    for k in range(32):
        q.join(f"w{k}", f"r{k}", 0.0, host="")
    q.parents("w0", 1.0)
    assert q.fixed == layout(32, STRIPES)
    # a late joiner on a new host goes under the member with the fewest network children
    p.join("late", "rl", 1.0, host="h9")
    late, _ = p.parents("late", 1.0)
    assert all(int(x[1:]) % STRIPES == s for s, x in enumerate(late))


def test_plan_forms_then_fixes_and_answers_the_layout():
    p = Plan("root", STRIPES, opened=10.0)
    for k in range(9):
        p.join(f"w{k}", f"r{k}", 10.0 + k * 0.001)
    row, again = p.parents("w0", 10.01)  # the first: its stripe from the root, the others
    assert row == ["root", "r1", "r2", "r3"] and again == pytest.approx(10.0 + WINDOW)  # from their carriers
    q = Plan("root", STRIPES, opened=0.0)
    q.join("w0", "r0", 0.0)
    row, again = q.parents("w0", 0.0)  # alone so far: ask again soon (once), then at the close
    assert row == ["root", NONE, NONE, NONE] and again == pytest.approx(EARLY)
    q.join("w1", "r1", 0.005)
    row, again = q.parents("w0", EARLY)
    assert row == ["root", "r1", NONE, NONE] and again == pytest.approx(WINDOW)
    row, again = p.parents("w5", 10.01)  # not among the first D: earlier members, by stripe
    assert again and row[1] == "r1" and all(x.startswith("r") and int(x[1:]) < 5 for x in row)
    # while forming, the root is read for each stripe by one member only (the first D
    # carry a stripe each, straight from the root), and every later member's provisional
    # parents arrived before it (nobody waits on a reader below it)
    rows = [p.parents(f"w{k}", 10.01)[0] for k in range(9)]
    assert sorted(s for r in rows for s, x in enumerate(r) if x == "root") == list(range(STRIPES))
    assert all(int(x[1:]) < k for k, r in enumerate(rows) if k >= STRIPES for x in r)
    assert all(r == ["root" if s == k else f"r{s}" for s in range(STRIPES)] for k, r in enumerate(rows[:STRIPES]))
    lay = layout(9, STRIPES)
    for k in range(9):
        row, again = p.parents(f"w{k}", 10.0 + WINDOW)
        assert again == 0.0
        assert row == ["root" if q < 0 else f"r{q}" for q in lay[k]]
    # joining again (a retry) changes nothing
    p.join("w3", "r3", 11.0)
    assert p.members == [f"w{k}" for k in range(9)]


def test_late_joiners_are_leaves_under_the_least_loaded():
    p = Plan("root", STRIPES, opened=0.0)
    for k in range(16):
        p.join(f"w{k}", f"r{k}", 0.0)
    p.join("late", "rl", 1.0)
    row, again = p.parents("late", 1.0)
    assert again == 0.0 and all(x.startswith("r") and x != "root" for x in row)
    # in stripe s, its parent is an interior member of s (one that carries that stripe)
    assert all(int(x[1:]) % STRIPES == s for s, x in enumerate(row))
    assert p.parents("late", 2.0)[0] == row  # stable


def _late_fleet(fixed: int, total: int, bad=lambda rid: False):
    p = Plan("root", STRIPES, opened=0.0)
    for k in range(fixed):
        p.join(f"w{k}", f"r{k}", 0.0)
    rows = {}
    for k in range(fixed, total):
        p.join(f"w{k}", f"r{k}", 1.0)
        rows[k] = p.parents(f"w{k}", 1.0, bad)[0]
    for k in range(fixed):
        rows[k] = p.parents(f"w{k}", 1.0, bad)[0]
    return p, rows


def _row_depth(rows: dict, k: int, s: int) -> int:
    d = 0
    while k >= 0:
        x = rows[k][s]
        k = -1 if x == "root" else int(x[1:])
        d += 1
        assert d <= len(rows), "a cycle"
    return d


def test_late_joiners_become_carriers_and_every_uplink_stays_near_one_version():
    """1,024 readers of which 50 joined inside the window: the late ones carry stripes
    at the bottom of the tree (before: leaves under the 50, ~20 versions per uplink)."""
    p, rows = _late_fleet(50, 1024)
    sent = {}  # member -> children over all stripes (each child gets 1/D of the version)
    for (m, s), n in p.kids.items():
        sent[m] = sent.get(m, 0) + n
    assert max(sent.values()) <= 2 * STRIPES + 1  # <= 2.25 versions; most send 3/4 of one
    assert sorted(sent.values())[len(sent) // 2] <= STRIPES
    late_parents = {int(x[1:]) for k, row in rows.items() if k >= 50 for x in row if x != "root"}
    assert any(m >= 50 for m in late_parents)  # late joiners are parents too
    for k, row in rows.items():
        for s, x in enumerate(row):
            assert x != NONE
            if x != "root":
                q = int(x[1:])
                assert q < k or k < 50  # a late joiner's parents arrived first: never a descendant
                assert q in p.carriers[s]  # and carry that stripe
    assert max(_row_depth(rows, k, s) for k in rows for s in range(STRIPES)) <= 8  # log_D, not a chain
    # the root still sends every stripe once
    assert sum(1 for row in rows.values() for x in row if x == "root") == STRIPES


def test_a_late_joiner_under_a_failed_carrier_moves_to_an_earlier_one():
    p, rows = _late_fleet(8, 200)
    k = 199
    s = next(s for s, x in enumerate(rows[k]) if x != "root" and int(x[1:]) >= 8)  # a late parent
    dead = rows[k][s]
    row, _ = p.parents(f"w{k}", 2.0, lambda rid: rid == dead)
    assert row[s] != dead and row[s] != NONE and int(row[s][1:]) < k and int(row[s][1:]) in p.carriers[s]
    assert [x for i, x in enumerate(row) if i != s] == [x for i, x in enumerate(rows[k]) if i != s]


def test_failed_parent_is_replaced_never_by_a_descendant():
    n = 64
    p = Plan("root", STRIPES, opened=0.0)
    for k in range(n):
        p.join(f"w{k}", f"r{k}", 0.0)
    lay = layout(n, STRIPES)
    m = 41  # interior in stripe 1
    s = m % STRIPES
    parent = lay[m][s]
    assert parent >= 0
    dead = {f"r{parent}"}
    row, _ = p.parents(f"w{m}", 1.0, lambda rid: rid in dead)
    assert row[s] != f"r{parent}" and row[s] != NONE
    new = -1 if row[s] == "root" else int(row[s][1:])
    assert new < m  # an earlier interior member (never one below m in the stripe's tree)
    assert new == -1 or new % STRIPES == s
    # the root failed too and nobody is left in that stripe before m: "" (the reader's fallback)
    everyone = {f"r{k}" for k in range(n)} | {"root"}
    row, _ = p.parents(f"w{m}", 1.0, lambda rid: rid in everyone)
    assert row[s] == NONE


def test_failed_parent_with_hosts_is_replaced_by_an_earlier_member():
    n = 64
    p = Plan("root", STRIPES, opened=0.0)
    for k in range(n):
        p.join(f"w{k}", f"r{k}", 0.0, host=f"h{k // 8}")
    p.parents("w0", 1.0)
    for m in (41, 42, 47):
        s = m % STRIPES
        parent = p.fixed[m][s]
        assert 0 <= parent < m
        row, _ = p.parents(f"w{m}", 1.0, lambda rid, dead=f"r{parent}": rid == dead)
        new = -1 if row[s] == "root" else int(row[s][1:])
        assert new != parent and new < m and (new == -1 or new % STRIPES == s)
    assert all(v >= 0 for v in p.kids.values())


def test_stripe_of():
    assert [stripe_of(c, 4) for c in range(6)] == [0, 1, 2, 3, 0, 1]


# ---------------------------------------------------------------- where a plan applies
def _cand(rid, wid, host, dc="a", complete=True):
    from tensorhub._planner import Candidate
    from tensorhub.protocol import Locality

    return Candidate(rid, wid, Locality(datacenter=dc, zone="z", host=host), chunks=None if complete else frozenset())


def test_plan_root_only_where_one_source_is_scarce():
    from tensorhub.protocol import Locality

    me = Locality(datacenter="a", zone="z", host="h1")
    pub = _cand("rp", "pub", "h0")
    assert plan_root(me, "me", [pub], None) == "rp"
    assert plan_root(me, "me", [pub, _cand("rq", "q", "h2")], None) is None  # two complete: no plan
    assert plan_root(me, "me", [_cand("rs", "s", "h1")], None) is None  # a complete copy on my host
    assert plan_root(me, "me", [_cand("rx", "x", "h9", dc="b")], "rseed") == "rseed"  # the seeder's copy
    assert plan_root(me, "me", [_cand("rx", "x", "h9", dc="b")], None) is None  # I will be the seeder


def test_wan_root_only_for_a_seeder_while_one_complete_replica_exists():
    from tensorhub.protocol import Locality

    me = Locality(datacenter="b", zone="z", host="h1")
    pub = _cand("rp", "pub", "h0")
    assert wan_root(me, "me", [pub, _cand("rq", "q", "h2", complete=False)]) == "rp"
    assert wan_root(me, "me", [pub, _cand("rq", "q", "h2")]) is None  # two complete: the usual choice
    assert wan_root(me, "me", [_cand("rb", "x", "h3", dc="b")]) is None  # complete in my datacenter
    assert wan_root(me, "me", []) is None
    assert wan_stripes(["a", "b", "c", "d", "b", "a"], "a") == 3
    assert wan_stripes(["a"], "a") == 1


def test_relayed_takes_the_roots_stripes_from_the_origin_plans_first_carriers():
    origin = Plan("pub", STRIPES, 0.0)
    for k in range(6):
        origin.join(f"a{k}", f"ra{k}", 0.0)
    # a plan across 3 datacenters: its first member reads stripe 0 from the root, the others
    # from members 1 and 2
    row = ["pub", "rb", "rc"]
    assert relayed(row, "pub", origin) == ["ra0", "rb", "rc"]  # stripe 0's first carrier
    assert relayed(["rb", "pub", "pub"], "pub", origin) == ["rb", "ra1", "ra2"]
    # a failed carrier: the next interior member of that stripe (member 4 carries stripe 0 too)
    assert relayed(row, "pub", origin, lambda rid: rid == "ra0") == ["ra4", "rb", "rc"]
    assert relayed(row, "pub", origin, lambda rid: rid in ("ra0", "ra4")) == row  # none left: the root
    assert relayed(row, "pub", None) == row  # no plan in the root's datacenter
    few = Plan("pub", STRIPES, 0.0)
    for k in range(2):
        few.join(f"a{k}", f"ra{k}", 0.0)
    # fewer members than stripes: member s % 2 carries stripe s (as in ``layout``)
    assert relayed(["pub"] * 4, "pub", few) == ["ra0", "ra1", "ra0", "ra1"]


# ---------------------------------------------------------------- the coordinator's grants
def _state_with_version(nreaders, num_chunks=64, dcs=("a",)):
    from tensorhub.server.state import CoordinatorState, StateConfig
    from tensorhub.protocol import Locality, Manifest, RegisterReplica, TensorSpec

    st = CoordinatorState(StateConfig(lease_ttl=30.0, worker_ttl=30.0), now=0.0)
    st.register_worker(0.0, "pub", "pub:1", Locality(datacenter="a", zone="z", host="hp"))
    v = st.allocate_version(0.0, "m")
    man = Manifest(tensors=[TensorSpec(name="w", dtype="uint8", shape=[num_chunks << 20], nbytes=num_chunks << 20)])
    st.register_replica(0.0, RegisterReplica(worker_id="pub", model="m", version=v, manifest=man,
                                             addresses=[1 << 20], num_shards=1))
    for k in range(nreaders):
        st.register_worker(0.0, f"w{k}", f"w{k}:1", Locality(datacenter=dcs[k % len(dcs)], zone="z", host=f"h{k}"))
    return st, v, man


def _lease(st, v, man, k, now, num_chunks=64, lease_id=None, exclude=()):
    from tensorhub._planner import grid_chunk_bytes
    from tensorhub.protocol import AcquireLease, ServeOffer, manifest_digest

    serve = None if lease_id else ServeOffer(manifest_digest=manifest_digest(man), addresses=[(k + 2) << 30],
                                             chunk_bytes=grid_chunk_bytes(man.nbytes), num_chunks=num_chunks,
                                             status_addr=7 << 30, status_tag=k + 1)
    return st.acquire_lease(now, AcquireLease(worker_id=f"w{k}", model="m", version=v, pipelined=True, manifest=False,
                                              serve=serve, lease_id=lease_id, exclude=list(exclude)))


def test_coordinator_grants_follow_the_plan():
    n = 12
    st, v, man = _state_with_version(n)
    first = [_lease(st, v, man, k, 0.001 * k) for k in range(n)]
    pub = first[0].replicas[0].replica_id
    assert all(g.stripes == STRIPES and g.refresh_after > 0 for g in first)
    assert first[0].stripe_sources == [pub, NONE, NONE, NONE]  # forming: the first reads its stripe from the root
    assert pub not in first[5].stripe_sources and NONE not in first[5].stripe_sources
    ids = {f"w{k}": g.partial_replica_id for k, g in enumerate(first)}
    lay = layout(n, STRIPES)
    for k, g in enumerate(first):
        r = _lease(st, v, man, k, 0.001 * n + WINDOW, lease_id=g.lease_id)
        assert r.refresh_after == 0.0
        want = [pub if q < 0 else ids[f"w{q}"] for q in lay[k]]
        assert r.stripe_sources == want
        # the lease names exactly the parents (and what it named before)
        assert {x.replica_id for x in r.replicas} == set(want)
        assert r.claimed == [] and r.reserved is None


def test_coordinator_replaces_a_reported_parent():
    n = 8
    st, v, man = _state_with_version(n)
    first = [_lease(st, v, man, k, 0.0) for k in range(n)]
    g = _lease(st, v, man, 6, 1.0, lease_id=first[6].lease_id)
    bad = g.stripe_sources[0]
    r = _lease(st, v, man, 6, 1.1, lease_id=first[6].lease_id, exclude=[bad])
    assert r.stripe_sources[0] not in (bad, NONE)
    assert bad not in r.stripe_sources


def test_small_shards_and_old_clients_get_no_plan():
    from tensorhub.protocol import AcquireLease

    st, v, man = _state_with_version(2, num_chunks=MIN_CHUNKS - 1)
    g = _lease(st, v, man, 0, 0.0, num_chunks=MIN_CHUNKS - 1)
    assert g.stripes == 0 and g.stripe_sources == [] and g.refresh_after == 0.0
    st, v, man = _state_with_version(2)
    g = st.acquire_lease(0.0, AcquireLease(worker_id="w1", model="m", version=v, pipelined=True))  # no serve offer
    assert g.stripes == 0


def test_no_plans_config_turns_them_off():
    from tensorhub.server.state import StateConfig

    st, v, man = _state_with_version(3)
    st.config = StateConfig(lease_ttl=30.0, worker_ttl=30.0, plans=False)
    assert _lease(st, v, man, 0, 0.0).stripes == 0


def test_plans_are_forgotten_when_unused():
    st, v, man = _state_with_version(3)
    _lease(st, v, man, 0, 0.0)
    assert st.grants.plans
    for k in range(3):
        st.heartbeat(200.0, f"w{k}")
    st.heartbeat(200.0, "pub")
    st.expire(200.0)
    assert not st.grants.plans and not st.grants.plan_of


def test_coordinator_stripes_across_datacenters_and_relays_the_publishers_stripes():
    """Readers in 4 datacenters, the publisher in "a": each other datacenter's first reader
    (its seeder) joins one plan across datacenters with one stripe per seeding datacenter;
    once fixed, it reads its own stripe from a reader of "a" (the first that carries it
    there), never from the publisher, and each other stripe from the seeder that carries it.
    The others of its datacenter read by a plan rooted at its partial replica."""
    n = 16
    dcs = ("a", "b", "c", "d")
    st, v, man = _state_with_version(n, dcs=dcs)
    first = [_lease(st, v, man, k, 0.001 * k) for k in range(n)]
    pub = first[0].replicas[0].replica_id
    rid = {k: g.partial_replica_id for k, g in enumerate(first)}
    seeders = {1: "b", 2: "c", 3: "d"}  # reader k is in dcs[k % 4]: w1, w2, w3 came first in theirs
    for k in seeders:
        assert first[k].seed and "across datacenters" in first[k].reason and first[k].stripes == 3
    for k in range(4, n):
        g = first[k]
        assert not g.seed and g.stripes == STRIPES
        if k % 4:  # a follower in a seeded datacenter: its plan's root is the seeder's copy
            assert rid[k % 4] in g.stripe_sources and pub not in g.stripe_sources
    later = {k: _lease(st, v, man, k, 0.001 * n + WINDOW, lease_id=first[k].lease_id) for k in seeders}
    a_readers = {rid[k] for k in range(0, n, 4)}
    for k, g in later.items():
        assert g.refresh_after == 0.0 and g.stripes == 3
        own = g.stripe_sources[k - 1]
        assert own in a_readers, (k, g.stripe_sources)  # relayed: not the publisher
        assert pub not in g.stripe_sources
        assert [x for s, x in enumerate(g.stripe_sources) if s != k - 1] == \
            [rid[j] for j in seeders if j != k]  # the other stripes: the seeders that carry them
        assert {x.replica_id for x in g.replicas} >= set(g.stripe_sources)
    # three seeders, three different relays (stripe s of the plan across datacenters from
    # the first carrier of stripe s of a's plan)
    assert len({g.stripe_sources[k - 1] for k, g in later.items()}) == 3


def test_coordinator_replaces_a_failed_seeder_across_datacenters_by_a_relay():
    """A seeder that carries a stripe across datacenters fails: the seeder that reported it
    reads that stripe from a reader of the publisher's datacenter (the root's relay) on
    its refresh, never from nobody, never from the failed one."""
    n = 16
    st, v, man = _state_with_version(n, dcs=("a", "b", "c", "d"))
    first = [_lease(st, v, man, k, 0.001 * k) for k in range(n)]
    pub = first[0].replicas[0].replica_id
    rid = {k: g.partial_replica_id for k, g in enumerate(first)}
    g = _lease(st, v, man, 2, 1.0, lease_id=first[2].lease_id)  # c's seeder, the layout fixed
    assert g.stripe_sources[0] == rid[1]  # stripe 0 from b's seeder
    r = _lease(st, v, man, 2, 1.1, lease_id=first[2].lease_id, exclude=[rid[1]])
    assert r.stripe_sources[0] in {rid[k] for k in range(0, n, 4)}, r.stripe_sources
    assert rid[1] not in r.stripe_sources and pub not in r.stripe_sources and NONE not in r.stripe_sources


def test_plan_members_leases_do_not_scan_the_shard(monkeypatch):
    """Issue 13: a serving lease under a plan, and its refresh, look the complete replicas,
    the seeder and the parents up by id -- they never walk the shard's replicas or leases,
    whose number grows with the readers (1,024 partial replicas at 1,024 readers). Same
    grants as before: the layout's parents."""
    from tensorhub.server.registry import Registry

    n = 64
    st, v, man = _state_with_version(n)
    scans = collections.Counter()
    for name in ("replicas_of_shard", "leases_of_shard"):
        orig = getattr(Registry, name)

        def counted(self, key, _orig=orig, _name=name):
            scans[_name] += 1
            return _orig(self, key)

        monkeypatch.setattr(Registry, name, counted)
    first = [_lease(st, v, man, k, 0.0005 * k) for k in range(n)]
    assert all(g.stripes == STRIPES for g in first)
    later = [_lease(st, v, man, k, 1.0, lease_id=g.lease_id) for k, g in enumerate(first)]
    assert not scans, scans
    pub = first[0].replicas[0].replica_id
    ids = {k: g.partial_replica_id for k, g in enumerate(first)}
    lay = layout(n, STRIPES)
    assert [g.stripe_sources for g in later] == [[pub if q < 0 else ids[q] for q in lay[k]] for k in range(n)]
    # off a plan (a reader that does not serve) the usual choice still sees every replica
    from tensorhub.protocol import AcquireLease

    st.register_worker(1.0, "plain", "plain:1", first[0].replicas[0].locality)
    st.acquire_lease(1.0, AcquireLease(worker_id="plain", model="m", version=v, pipelined=True))
    assert scans["replicas_of_shard"] == 1
