"""Chunk maps (``tensorhub._chunkmap``): availability read from the source itself.

Unit level: the map's layout, staleness (tag) and retirement. Coordinator level (pure
state machine): a partial replica registered with the first lease by manifest digest,
its map advertised to other pipelined readers, the release folded into the complete
registration. Transport level, over real Mooncake between processes: the no-read-before-
complete invariant, checked on the traces of every process (``testing._workers._Traced``):
every data range a reader asked of a source was complete in that source's memory before
the read was submitted, and the only other reads are of chunk maps.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tensorhub._chunkmap import HEADER, READY, ChunkMap, map_bytes, parse
from tensorhub.server.state import CoordinatorState, StateConfig
from tensorhub.protocol import AcquireLease, Locality, Manifest, RegisterReplica, TensorSpec, manifest_digest

MiB = 1 << 20


# ---------------------------------------------------------------- the map itself
def test_map_layout_marks_and_staleness():
    m = ChunkMap(10)
    raw = m.buf.numpy()
    assert len(raw) == map_bytes(10) == HEADER + 10
    assert parse(raw, m.tag, 10) == frozenset()
    m.mark(3)
    m.mark(9)
    assert raw[HEADER + 3] == READY
    assert parse(raw, m.tag, 10) == frozenset({3, 9})
    assert parse(raw, m.tag ^ 2, 10) is None  # another replica's tag: stale
    assert parse(raw, m.tag, 11) is None  # another grid: stale
    assert parse(raw[:12], m.tag, 10) is None  # short read
    with pytest.raises(ValueError):
        m.mark(10)
    m.retire()
    assert parse(raw, m.tag, 10) is None  # retired: nothing is ready any more
    assert ChunkMap(10).tag != ChunkMap(10).tag  # (random tags: reused memory never matches)


# ---------------------------------------------------------------- the coordinator's side
MAN = Manifest(tensors=[TensorSpec(name=f"t{i}", dtype="float32", shape=(1 << 18,), nbytes=1 << 20)
                        for i in range(8)])


def _state():
    st = CoordinatorState(StateConfig(lease_ttl=5.0, worker_ttl=30.0), now=0.0)
    for w in ("pub", "a", "b"):
        st.register_worker(0.0, w, f"ep-{w}", Locality(host=w))
    v = st.allocate_version(0.0, "m")
    st.register_replica(0.0, RegisterReplica(worker_id="pub", model="m", version=v, manifest=MAN,
                                             addresses=[(1 << 30) + i * MiB for i in range(8)]))
    return st, v


def _offer(addr: int, tag: int, chunks: int = 8, digest: str = manifest_digest(MAN)) -> dict:
    return {"manifest_digest": digest, "addresses": [addr + i * MiB for i in range(8)],
            "chunk_bytes": MiB, "num_chunks": chunks, "status_addr": addr - 4096, "status_tag": tag}


def test_first_lease_registers_the_partial_replica_and_others_get_its_map():
    st, v = _state()
    g = st.acquire_lease(0.1, AcquireLease(worker_id="a", model="m", version=v, pipelined=True, manifest=False,
                                           serve=_offer(1 << 40, 77)))
    assert g.partial_replica_id and not g.serve_refused and g.chunk_bytes == MiB
    r = st.replicas[g.partial_replica_id]
    assert r.chunks == set() and r.status_addr == (1 << 40) - 4096 and r.status_tag == 77
    g2 = st.acquire_lease(0.2, AcquireLease(worker_id="b", model="m", version=v, pipelined=True, manifest=False))
    part = [x for x in g2.replicas if x.worker_id == "a"]
    assert part and part[0].status_tag == 77 and part[0].num_chunks == 8 and part[0].chunks == []
    # A plain reader never sees it.
    g3 = st.acquire_lease(0.2, AcquireLease(worker_id="b", model="m", version=v))
    assert {x.worker_id for x in g3.replicas} == {"pub"}


def test_offer_with_a_wrong_digest_or_grid_is_refused_but_the_lease_stands():
    st, v = _state()
    g = st.acquire_lease(0.1, AcquireLease(worker_id="a", model="m", version=v, pipelined=True,
                                           serve=_offer(1 << 40, 5, digest="sha256:" + "0" * 64)))
    assert g.partial_replica_id is None and "digest" in g.serve_refused and g.lease_id in st.leases
    g = st.acquire_lease(0.1, AcquireLease(worker_id="b", model="m", version=v, pipelined=True,
                                           serve=dict(_offer(1 << 41, 5), chunk_bytes=2 * MiB)))
    assert g.partial_replica_id is None and "grid" in g.serve_refused


def test_release_and_register_completes_only_when_every_lease_stayed_valid():
    st, v = _state()
    g = st.acquire_lease(0.1, AcquireLease(worker_id="a", model="m", version=v, pipelined=True,
                                           serve=_offer(1 << 40, 9)))
    done = RegisterReplica(worker_id="a", model="m", version=v, manifest_digest=manifest_digest(MAN),
                           addresses=[(1 << 40) + i * MiB for i in range(8)], release=[g.lease_id])
    rid, complete, released = st.release_and_register(1.0, done)
    assert released == {g.lease_id: True} and rid == g.partial_replica_id and complete
    assert st.replicas[rid].chunks is None and st.replicas[rid].status_addr is None  # complete now
    assert g.lease_id not in st.leases
    # A lease that lapsed: released (answered invalid), nothing registered.
    g = st.acquire_lease(2.0, AcquireLease(worker_id="b", model="m", version=v))
    late = done.model_copy(update={"worker_id": "b", "release": [g.lease_id],
                                   "addresses": [(1 << 42) + i * MiB for i in range(8)]})
    rid, _, released = st.release_and_register(2.0 + 6.0, late)
    assert rid == "" and released == {g.lease_id: False}
    assert not [r for r in st.replicas.values() if r.worker_id == "b"]


def test_register_by_digest_refuses_another_manifest():
    from tensorhub._exceptions import ManifestMismatchError

    st, v = _state()
    other = Manifest(tensors=MAN.tensors[:7])
    with pytest.raises(ManifestMismatchError, match="digest"):
        st.register_replica(0.5, RegisterReplica(worker_id="a", model="m", version=v,
                                                 manifest_digest=manifest_digest(other),
                                                 addresses=[1 << 40] * 8))


# ---------------------------------------------------------------- real Mooncake, real processes
def _events(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.multiprocess
def test_real_mooncake_readers_read_only_chunks_complete_on_their_source(coordinator, tmp_path):
    """Five processes over real Mooncake: a publisher and four pipelined readers whose
    completions reach the Hub 30 ms late (so reads overlap on loopback). From every
    process's trace: each data range any reader asked of any source was complete in that
    source's memory (published, or landed there and reported DONE) before the read was
    submitted; every other read was of a chunk map; readers read from each other."""
    from tensorhub.testing import Worker, digest, make_weights

    url, made = coordinator.url, []
    traces = {n: str(tmp_path / f"{n}.jsonl") for n in ("pub", "r0", "r1", "r2", "r3")}
    try:
        pub = Worker(url, "pub", locality="dc=a,zone=z,host=p", trace=(traces["pub"], 0.0))
        made.append(pub)
        readers = [Worker(url, n, locality=f"dc=a,zone=z,host={n}", trace=(traces[n], 0.03))
                   for n in ("r0", "r1", "r2", "r3")]
        made += readers
        nbytes = 48 * MiB
        want = digest(make_weights(7, nbytes))
        v = pub.call("publish", seed=7, nbytes=nbytes)
        for w in readers:
            w.send("fetch", version=v)
        got = {w.name: w.result(120) for w in readers}
    finally:
        for w in made:
            w.close()
    for name, g in got.items():
        assert g["version"] == v and g["digest"] == want, name
    ev = {n: _events(p) for n, p in traces.items() if os.path.exists(p)}
    endpoint = {next(e["ep"] for e in es if e["ev"] == "endpoint"): n for n, es in ev.items()}
    complete = {n: sorted((e["t"], e["addr"], e["n"]) for e in es if e["ev"] == "complete") for n, es in ev.items()}
    maps = {n: [(e["addr"], e["n"]) for e in es if e["ev"] == "map"] for n, es in ev.items()}
    violations, map_reads, data_reads, from_peers = [], 0, 0, 0
    for reader, es in ev.items():
        for e in (x for x in es if x["ev"] == "read"):
            src = endpoint[e["peer"]]
            lo, hi = e["addr"], e["addr"] + e["n"]
            if any(a <= lo and hi <= a + n for a, n in maps[src]):
                map_reads += 1
                continue
            data_reads += 1
            from_peers += src != "pub"
            need = lo
            for t, a, n in sorted((c for c in complete[src] if c[0] <= e["t"]), key=lambda c: c[1]):
                if a <= need < a + n:
                    need = a + n
                if need >= hi:
                    break
            if need < hi:
                violations.append(f"{reader} read [{lo:#x}, {hi:#x}) of {src} at {e['t']:.4f}, "
                                  f"not complete there then")
    assert not violations, violations[:5]
    assert data_reads and map_reads, (data_reads, map_reads)
    assert from_peers, "no reader read from another reader: the pipelined path was not exercised"
    assert sum(bool(m) for m in maps.values()) == 4  # every reader served while receiving


# ---------------------------------------------------------------- the Hub's calls, counted by the coordinator
def _requests(url: str) -> dict:
    import httpx

    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("tensorhub_requests_total{"):
            out[line.split('route="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
    return out


def test_pipelined_readers_make_a_fixed_number_of_coordinator_calls(embedded):
    """Four pipelined readers of one version (in-memory transport, throttled so reads
    overlap): each makes the manifest GET, one lease (which registers its partial replica),
    at most one refresh and one release-and-register call -- no chunk reports, no progress
    posts -- and still reads from the others (their chunk maps)."""
    import threading

    import tensorhub
    from tensorhub.testing import InMemoryTransport

    hubs = [tensorhub.connect(embedded.url, worker_id=n, locality=f"dc=a,zone=z,host={n}", heartbeat_interval=5.0,
                              transport=InMemoryTransport(bandwidth=24 * MiB)) for n in ("pub", "r0", "r1", "r2", "r3")]
    try:
        g = torch.Generator().manual_seed(5)
        w = {f"w{i}": torch.randn(MiB, generator=g) for i in range(4)}  # 16 MiB, 16 chunks
        v = hubs[0].publish("m", w)
        for h in hubs[1:]:
            h.endpoint  # the data plane started (its one registration) before counting
        before = _requests(embedded.url)
        got: dict = {}
        ts = [threading.Thread(target=lambda h=h: got.setdefault(h.worker_id, h.fetch("m", v))) for h in hubs[1:]]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        after = _requests(embedded.url)
    finally:
        for h in hubs:
            h.close()
    calls = {k: after[k] - before.get(k, 0) for k in after  # heartbeats aside: they come on a timer
             if after[k] - before.get(k, 0) and "metrics" not in k and "heartbeat" not in k}
    assert len(got) == 4 and all(torch.equal(f[k], w[k]) for f in got.values() for k in w)
    assert calls.get("GET /v1/models/{model}/versions/{version}/manifest") == 4, calls
    assert calls.get("POST /v1/replicas") == 4, calls  # release + complete registration, one each
    assert 4 <= calls.get("POST /v1/leases", 0) <= 8, calls  # the lease, at most one refresh each
    assert not any("/chunks" in k or "/fetches" in k or "/release" in k for k in calls), calls
    assert sum(calls.values()) <= 4 * 4, calls
    assert any(src != "pub" for f in got.values() for src in f.sources), "no reader read from another"
