"""Subscribing ahead (tensorhub/server/ahead.py, issue 31 item 1), on the coordinator's state
machine: subscribers held until their version completes, then put into one plan whose
layout is fixed with all of them (no forming window, no refresh), answered in plan order;
lapsed subscribers dropped; an offer whose tensors differ refused with the reason; errors
answered per subscriber. The real coordinator process and real readers: tests/test_ahead_hub.py."""

from __future__ import annotations

import pytest

from tensorhub._exceptions import CoordinatorError, InvalidRequestError, NotFoundError
from tensorhub.server.stripes import NONE, STRIPES, layout

N_CHUNKS = 64


def _state(nreaders, hosts=None):
    from tensorhub.server.state import CoordinatorState, StateConfig
    from tensorhub.protocol import Locality, Manifest, RegisterReplica, TensorSpec

    st = CoordinatorState(StateConfig(lease_ttl=30.0, worker_ttl=30.0), now=0.0)
    st.register_worker(0.0, "pub", "pub:1", Locality(datacenter="a", zone="z", host="hp"))
    man = Manifest(tensors=[TensorSpec(name="w", dtype="uint8", shape=[N_CHUNKS << 20], nbytes=N_CHUNKS << 20)])
    v = st.allocate_version(0.0, "m")
    st.register_replica(0.0, RegisterReplica(worker_id="pub", model="m", version=v, manifest=man,
                                             addresses=[1 << 20], num_shards=1))
    for k in range(nreaders):
        st.register_worker(0.0, f"w{k}", f"w{k}:1",
                           Locality(datacenter="a", zone="z", host=hosts[k] if hosts else f"h{k}"))
    return st, v, man


def _ask(st, k, version, now, man, wait=30.0, request_id=None, digest=None):
    from tensorhub._planner import grid_chunk_bytes
    from tensorhub.protocol import AcquireLease, ServeOffer, shape_digest

    serve = ServeOffer(manifest_digest=digest or shape_digest(man), addresses=[(k + 2) << 30],
                       chunk_bytes=grid_chunk_bytes(man.nbytes), num_chunks=N_CHUNKS,
                       status_addr=(k + 2) << 40, status_tag=k + 1)
    req = AcquireLease(worker_id=f"w{k}", model="m", version=version, pipelined=True, manifest=False, serve=serve,
                       request_id=request_id or f"q{k}", ahead=True)
    return st.subscribe(now, req, wait)


def _publish(st, now, man, checksums=None):
    """The publisher's next version (same tensors, other bytes: other checksums); returns
    (version, what the bind answered)."""
    from tensorhub.protocol import RegisterReplica

    v = st.allocate_version(now, "m")
    m2 = man.model_copy(update={"checksum": "xxh3_64", "checksums": checksums or [v] * N_CHUNKS})
    st.register_replica(now, RegisterReplica(worker_id="pub", model="m", version=v, manifest=m2,
                                             addresses=[1 << 20], num_shards=1))
    completed = st.catalog.take_completed()
    assert completed == {"m"}
    return v, [(w, r, x if isinstance(x, CoordinatorError) else st.grant_ahead(now, *x))
               for w, r, x in st.bind_ahead(now, completed)]


@pytest.mark.parametrize("n", [3, 12, 64])
def test_subscribers_form_one_fixed_plan_at_the_publish(n):
    st, v1, man = _state(n)
    for k in range(n):
        assert _ask(st, k, v1 + 1, 0.1 + 0.001 * k, man) is None  # held: nothing published yet
    assert st.ahead.held() == n
    v2, bound = _publish(st, 5.0, man)
    assert [w for w, _, _ in bound] == [f"w{k}" for k in range(n)]  # answered in plan (arrival) order
    grants = [g for _, _, g in bound]
    assert all(not isinstance(g, CoordinatorError) for g in grants)
    pub = next(r.replica_id for r in st.registry.replicas_of_worker("pub") if r.version == v2)
    ids = {f"w{k}": g.partial_replica_id for k, g in enumerate(grants)}
    assert all(ids.values())  # every offer registered: others read from them at once
    lay = layout(n, STRIPES, [f"h{k}" for k in range(n)])
    for k, g in enumerate(grants):
        assert g.version == v2 and g.stripes == STRIPES
        assert g.refresh_after == 0.0 and "forming" not in g.reason and "late" not in g.reason, g.reason
        assert g.stripe_sources == [pub if q < 0 else ids[f"w{q}"] for q in lay[k]]
        assert {x.replica_id for x in g.replicas} == set(g.stripe_sources) - {NONE}
    # the publisher sends every stripe once
    assert sum(g.stripe_sources.count(pub) for g in grants) == STRIPES
    assert st.ahead.held() == 0


def test_a_poll_asked_again_keeps_its_place_and_a_bound_one_gets_its_grant():
    st, v1, man = _state(3)
    for k in range(3):
        _ask(st, k, v1 + 1, 0.0, man)
    assert _ask(st, 0, v1 + 1, 20.0, man) is None  # the same request id again: still first
    v2, bound = _publish(st, 21.0, man)
    assert [w for w, _, _ in bound] == ["w0", "w1", "w2"]
    # the reader was between two polls when it was bound: its next poll gets the grant
    again = _ask(st, 1, v1 + 1, 21.5, man)
    assert again is not None and again.lease_id == bound[1][2].lease_id


def test_lapsed_polls_and_dead_workers_are_dropped_at_the_publish():
    st, v1, man = _state(4)
    _ask(st, 0, v1 + 1, 0.0, man, wait=1.0)  # asked once, never again: lapses at 1 + GRACE
    _ask(st, 1, v1 + 1, 0.0, man, wait=30.0)
    _ask(st, 2, v1 + 1, 0.0, man, wait=30.0)
    _ask(st, 3, v1 + 1, 0.0, man, wait=30.0)
    st.remove_worker(1.0, "w2")  # closed
    for w in ("pub", "w1", "w3"):
        st.heartbeat(10.0, w)
    _, bound = _publish(st, 10.0, man)
    assert [w for w, _, _ in bound] == ["w1", "w3"]
    assert all(g.refresh_after == 0.0 for _, _, g in bound)


def test_an_offer_whose_tensors_differ_is_refused_with_the_reason():
    st, v1, man = _state(2)
    _ask(st, 0, v1 + 1, 0.0, man, digest="sha256:" + "0" * 64)
    _ask(st, 1, v1 + 1, 0.0, man)
    _, bound = _publish(st, 1.0, man)
    assert [w for w, _, _ in bound] == ["w1", "w0"]  # plan members first, then the others
    g1, g0 = bound[0][2], bound[1][2]
    assert g0.partial_replica_id is None and "differ" in g0.serve_refused
    assert g1.partial_replica_id is not None and g1.serve_refused == ""
    # the reason stays for a poll asked again
    assert "differ" in _ask(st, 0, v1 + 1, 1.5, man, digest="sha256:" + "0" * 64).serve_refused


def test_a_version_already_published_is_answered_at_once():
    st, v1, man = _state(1)
    g = _ask(st, 0, v1, 0.0, man)
    assert g is not None and g.version == v1 and g.partial_replica_id is not None
    assert st.ahead.held() == 0


def test_bad_subscriptions_get_clear_errors():
    from tensorhub.protocol import AcquireLease

    st, v1, man = _state(1)
    with pytest.raises(InvalidRequestError, match="request_id"):
        st.subscribe(0.0, AcquireLease(worker_id="w0", model="m", version=v1 + 1, pipelined=True, ahead=True), 5.0)
    with pytest.raises(NotFoundError, match="unknown model"):
        st.subscribe(0.0, AcquireLease(worker_id="w0", model="nope", version=1, pipelined=True, ahead=True,
                                       request_id="x"), 5.0)
    with pytest.raises(NotFoundError, match="unknown worker"):
        st.subscribe(0.0, AcquireLease(worker_id="ghost", model="m", version=2, pipelined=True, ahead=True,
                                       request_id="x"), 5.0)


def test_a_subscriber_whose_layout_is_missing_gets_the_error_and_the_others_their_grants():
    from tensorhub._planner import grid_chunk_bytes
    from tensorhub.protocol import AcquireLease, ServeOffer, shape_digest

    st, v1, man = _state(2)
    _ask(st, 0, v1 + 1, 0.0, man)
    serve = ServeOffer(manifest_digest=shape_digest(man), addresses=[9 << 30], chunk_bytes=grid_chunk_bytes(man.nbytes),
                       num_chunks=N_CHUNKS, status_addr=9 << 40, status_tag=9)
    assert st.subscribe(0.0, AcquireLease(worker_id="w1", model="m", version=v1 + 1, layout="native", pipelined=True,
                                          serve=serve, request_id="n", ahead=True), 30.0) is None
    _, bound = _publish(st, 1.0, man)
    by = {w: x for w, _, x in bound}
    assert not isinstance(by["w0"], CoordinatorError)
    assert isinstance(by["w1"], NotFoundError)


@pytest.mark.parametrize("by_host", [False, True])
def test_plans_use_host_labels_only_where_a_same_host_path_covers_partial_replicas(by_host, monkeypatch):
    """``server.stripes.HOSTS_IN_PLANS`` (False: no same-host path for partial replicas yet): the
    fixed layout ignores hosts, so no interior member's NIC carries its host-mates too;
    with a path (True) host-mates read from each other."""
    import tensorhub.server.grants as grants

    monkeypatch.setattr(grants, "HOSTS_IN_PLANS", by_host)
    hosts = [f"h{k // 4}" for k in range(16)]
    st, v1, man = _state(16, hosts)
    for k in range(16):
        _ask(st, k, v1 + 1, 0.0, man)
    v2, bound = _publish(st, 1.0, man)
    grants_ = [g for _, _, g in bound]
    lay = layout(16, STRIPES, hosts if by_host else None)
    assert lay != layout(16, STRIPES, hosts if not by_host else None)  # (the two differ here)
    ids = [g.partial_replica_id for g in grants_]
    pub = next(r.replica_id for r in st.registry.replicas_of_worker("pub") if r.version == v2)
    for k, g in enumerate(grants_):
        assert g.stripe_sources == [pub if q < 0 else ids[q] for q in lay[k]]


def test_late_readers_after_the_bind_become_carriers_of_the_fixed_plan():
    from tensorhub._planner import grid_chunk_bytes
    from tensorhub.protocol import AcquireLease, Locality, ServeOffer, manifest_digest

    st, v1, man = _state(8)
    for k in range(8):
        _ask(st, k, v1 + 1, 0.0, man)
    v2, bound = _publish(st, 1.0, man)
    st.register_worker(1.0, "late", "late:1", Locality(datacenter="a", zone="z", host="hl"))
    m2 = st.manifest("m", v2, "hf", 0)
    g = st.acquire_lease(1.001, AcquireLease(
        worker_id="late", model="m", version=v2, pipelined=True, manifest=False,
        serve=ServeOffer(manifest_digest=manifest_digest(m2), addresses=[99 << 30],
                         chunk_bytes=grid_chunk_bytes(man.nbytes), num_chunks=N_CHUNKS, status_addr=99 << 40,
                         status_tag=99)))
    assert "late carrier" in g.reason and g.refresh_after == 0.0
    pub = next(r.replica_id for r in st.registry.replicas_of_worker("pub") if r.version == v2)
    assert pub not in g.stripe_sources  # the root's stripes went to the subscribers


# ---------------------------------------------------------------- durability (the coordinator's shell)
def test_a_bound_lease_is_answered_only_once_its_version_is_durable_and_never_if_the_commit_fails(tmp_path):
    import threading
    import time

    from tensorhub.server.state import StateConfig
    from tensorhub.protocol import Locality, RegisterReplica
    from tensorhub.coordinator import Coordinator

    from _stores import SlowStore

    store = SlowStore(tmp_path / "state", delay=0.5)
    coord = Coordinator(None, StateConfig(lease_ttl=30.0, worker_ttl=30.0, pause_grace=1e9), store=store)
    delivered, pending = [], []
    coord.subscribers.stream = lambda bound, make, encode: delivered.append(
        (time.monotonic(), [(w, r, make(*x)) for w, r, x in bound]))
    coord.subscribers.wake_pending = lambda answers: pending.extend(answers)
    st = coord.state
    try:
        _, _, man = _state(0)  # (its manifest)
        for w in ("pub", "w0"):
            coord.call(lambda now, w=w: st.register_worker(now, w, f"{w}:1", Locality(host=w)), soft=True)

        def publish() -> int:
            v = coord.call(lambda now: st.allocate_version(now, "m"))
            coord.call(lambda now: st.register_replica(now, RegisterReplica(
                worker_id="pub", model="m", version=v, manifest=man, addresses=[1 << 20], num_shards=1)))
            return v

        v1 = publish()
        assert coord.call(lambda now: _ask(st, 0, v1 + 1, now, man)) is None
        v2 = coord.call(lambda now: st.allocate_version(now, "m"))
        done: list = []
        t = threading.Thread(target=lambda: done.append(coord.call(lambda now: st.register_replica(now, RegisterReplica(
            worker_id="pub", model="m", version=v2, manifest=man, addresses=[1 << 20], num_shards=1)))))
        t.start()
        time.sleep(0.25)
        assert not delivered  # bound, but v2's commit is still on the disk
        t.join(10)
        assert done and len(delivered) == 1
        (w, _, g), = delivered[0][1]
        assert w == "w0" and g.version == v2

        # the commit that completes v3 fails: the bound grant is never answered, its lease goes,
        # and the held request is told "pending" (it asks again and is held again)
        assert coord.call(lambda now: _ask(st, 0, v2 + 1, now, man, request_id="q3")) is None
        v3 = coord.call(lambda now: st.allocate_version(now, "m"))
        store.fail = True
        with pytest.raises(CoordinatorError):
            coord.call(lambda now: st.register_replica(now, RegisterReplica(
                worker_id="pub", model="m", version=v3, manifest=man, addresses=[1 << 20], num_shards=1)))
        store.fail = False
        assert len(delivered) == 1 and pending == [("w0", "q3", None)]
        assert ("w0", "q3") not in st.grants.lease_requests  # never granted
        assert not [l for l in st.leases.values() if l.version == v3]
        assert coord.call(lambda now: _ask(st, 0, v2 + 1, now, man, request_id="q3")) is None  # held again
    finally:
        coord.close()


# ---------------------------------------------------------------- Hub.fetch_next on an embedded coordinator
def test_fetch_next_falls_back_to_the_usual_read_for_a_version_published_as_slices(connect):
    import threading

    import torch

    from tensorhub import Slice

    full = [{"w": torch.randn(64, 1 << 14)} for _ in range(2)]  # 4 MiB: 64 chunks of the grid

    def publish(k):
        for r, h in enumerate(ranks):
            h.publish("m", {"w": Slice(full[k]["w"][32 * r:32 * r + 32].clone(), (64, 1 << 14), (32 * r, 0))},
                      key=f"step-{k}", shard=r, num_shards=2)

    ranks = [connect(f"rank{i}") for i in range(2)]
    publish(0)
    reader = connect("reader")
    assert torch.equal(reader.fetch("m", 1)["w"], full[0]["w"])
    box: list = []
    t = threading.Thread(target=lambda: box.append(reader.fetch_next("m", 1, wait=30.0)))
    t.start()
    deadline = __import__("time").monotonic() + 10
    while not reader.api.get("/v1/status")["subscribers"]:
        assert __import__("time").monotonic() < deadline
        __import__("time").sleep(0.02)
    publish(1)  # v2 has no 'hf' manifest: the held lease is answered unknown_layout, read as slices
    t.join(30)
    assert box and box[0].version == 2 and torch.equal(box[0]["w"], full[1]["w"])


def test_fetch_next_waits_then_reads_and_says_none_when_nothing_came(connect):
    import threading
    import time

    import torch

    pub, reader = connect("pub"), connect("reader")
    w1 = {"a": torch.randn(1 << 20), "b": torch.randn(1 << 19)}
    v1 = pub.publish("m", w1)
    reader.fetch("m", v1)
    t0 = time.monotonic()
    assert reader.fetch_next("m", v1, wait=0.5) is None
    assert 0.45 < time.monotonic() - t0 < 5
    box: list = []
    asked: list = []
    api = reader._session.api
    real = api.manifest
    api.manifest = lambda *a, **kw: asked.append(a) or real(*a, **kw)
    t = threading.Thread(target=lambda: box.append(reader.fetch_next("m", v1, wait=30.0)))
    t.start()
    deadline = time.monotonic() + 10
    while not pub.api.get("/v1/status")["subscribers"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    from tensorhub.cli import format_status

    text = format_status(pub.api.get("/v1/status"))  # what `tensorhub status` shows
    assert "SUBSCRIBED AHEAD" in text and f">= {v1 + 1}" in text, text
    w2 = {k: torch.randn_like(x) for k, x in w1.items()}
    v2 = pub.publish("m", w2)
    t.join(30)
    got = box[0]
    assert got.version == v2 and all(torch.equal(got[k], w2[k]) for k in w2)
    assert ("m", v2, "hf", 0) in reader.held()  # served, like any fetch
    assert asked == []  # v2's checksums came with the grant: no manifest read
    assert reader._session.manifest("m", v2, "hf", 0) == pub._session.manifest("m", v2, "hf", 0)
    with pytest.raises(Exception, match="after must be a positive int"):
        reader.fetch_next("m", 0)
