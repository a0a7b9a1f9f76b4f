"""A replica's addresses as runs (``tensorhub._addresses``): runs expand to exactly the
addresses they were made from; a real coordinator process stores and forwards them without
expanding (except for readers that did not ask for runs), refuses malformed ones with a
clear 422 and keeps serving; and a reader that predates runs and one that reads them fetch
the same bytes (real Mooncake between worker processes) from each other's replicas."""

from __future__ import annotations

import json
import random

import httpx
import pytest
from hypothesis import given, settings, strategies as st

from tensorhub import _addresses
from tensorhub._addresses import ALIGNS, check, encode, expand
from tensorhub.protocol import AddressRuns, LeaseGrant, Manifest, TensorSpec, manifest_digest
from tensorhub.testing import Worker, digest, make_weights

DTYPES = [("float32", 4), ("bfloat16", 2), ("int8", 1), ("float64", 8)]


def _manifest(sizes: list[tuple[str, int]]) -> Manifest:
    return Manifest(tensors=[TensorSpec(name=f"t{i}", dtype=d, shape=(n,), nbytes=n * dict(DTYPES)[d])
                             for i, (d, n) in enumerate(sizes)])


def _layout(man: Manifest, pieces: list[tuple[str, int, int]], rng: random.Random) -> list[int]:
    """Addresses of ``man``'s tensors: for each piece (kind, tensors, align), the next
    tensors either packed as the Hub packs them (at ``align``, after a gap) or each at an
    arbitrary address (a user's tensors)."""
    out: list[int] = []
    i, n = 0, len(man.tensors)
    for kind, count, align in pieces:
        if i >= n:
            break
        take = range(i, min(n, i + count))
        if kind == "user":
            out += [rng.randrange(0, 1 << 48) for _ in take]
        else:
            addr = (rng.randrange(1 << 20, 1 << 47) // align) * align
            for k in take:
                out.append(addr)
                addr += -(-man.tensors[k].nbytes // align) * align
        i = take.stop
    out += [rng.randrange(0, 1 << 48) for _ in range(i, n)]
    return out


@settings(max_examples=150, deadline=None)
@given(sizes=st.lists(st.tuples(st.sampled_from([d for d, _ in DTYPES]), st.integers(0, 5000)),
                     min_size=1, max_size=300),
       pieces=st.lists(st.tuples(st.sampled_from(["hub", "hub", "user"]), st.integers(1, 120),
                                 st.sampled_from([1, 8, 64, 512])), max_size=8),
       seed=st.integers(0, 1 << 30))
def test_runs_expand_to_exactly_the_addresses(sizes, pieces, seed):
    man = _manifest(sizes)
    addrs = _layout(man, pieces, random.Random(seed))
    runs = encode(addrs, man)
    if runs is None:  # not shorter: the plain list is sent
        return
    assert runs.align in ALIGNS and 4 * len(runs.runs) <= len(addrs)
    assert expand(runs, man) == addrs
    check([], runs, man, ValueError)
    # what goes on the wire reads back the same
    back = AddressRuns.model_validate_json(runs.model_dump_json())
    assert back == runs and expand(back, man) == addrs


def test_hub_layout_is_one_run_and_user_tensors_stay_a_list():
    import torch

    from tensorhub._tensors import allocate_like, manifest_of

    w = {f"layer{i}.w": torch.zeros(1 + (i * 37) % 300, dtype=torch.bfloat16 if i % 3 else torch.float32)
         for i in range(5000)}
    man, user = manifest_of(w)
    assert encode(user, man) is None  # separate allocations: no runs
    _, out = allocate_like(man)
    addrs = [out[t.name].data_ptr() for t in man.tensors]
    runs = encode(addrs, man)
    assert runs is not None and len(runs.runs) == 1 and runs.runs[0] == (addrs[0], 5000)
    assert expand(runs, man) == addrs


def test_a_run_past_the_address_space_or_miscounted_is_refused():
    man = _manifest([("float32", 10)] * 8)
    with pytest.raises(ValueError, match="64-bit"):
        check([], AddressRuns(align=64, runs=[((1 << 64) - 64 * 7 - 39, 8)]), man, ValueError)
    check([], AddressRuns(align=64, runs=[((1 << 64) - 64 * 7 - 40, 8)]), man, ValueError)  # ends at 2^64
    with pytest.raises(ValueError, match="place 7 tensors"):
        check([], AddressRuns(align=64, runs=[(0, 3), (4096, 4)]), man, ValueError)


# ---------------------------------------------------------------- a real coordinator process
N = 2000  # tensors: enough that answers splice (LeaseAnswers), small enough to be quick


def _setup(c: httpx.Client):
    man = _manifest([("bfloat16", 16 + i % 9) for i in range(N)])
    for w in ("pub", "reader", "old"):
        r = c.post("/v1/workers", json={"worker_id": w, "endpoint": f"{w}:1"})
        assert r.json()["address_runs"] is True  # the coordinator says it reads runs
    v = c.post("/v1/models/m/versions", json={}).json()["version"]
    base = 1 << 40
    addrs, a = [], base
    for t in man.tensors:
        addrs.append(a)
        a += -(-t.nbytes // 64) * 64
    runs = encode(addrs, man)
    assert runs is not None and runs.runs == [(base, N)]
    return man, v, addrs, runs


def _lease(c: httpx.Client, worker: str, v: int, **kw) -> httpx.Response:
    return c.post("/v1/leases", json={"worker_id": worker, "model": "m", "version": v, "manifest": False, **kw})


def test_runs_are_stored_and_forwarded_and_expanded_only_for_old_readers(coordinator):
    with httpx.Client(base_url=coordinator.url, timeout=30) as c:
        man, v, addrs, runs = _setup(c)
        body = {"worker_id": "pub", "model": "m", "version": v, "manifest": man.model_dump(mode="json"),
                "address_runs": runs.model_dump(mode="json")}
        rid = c.post("/v1/replicas", json=body).json()["replica_id"]
        assert c.post("/v1/replicas", json=body).json()["replica_id"] == rid  # idempotent, same runs

        new = _lease(c, "reader", v, address_runs=True)
        assert new.status_code == 200, new.text
        src = new.json()["replicas"][0]
        assert src["addresses"] == [] and src["address_runs"] == {"align": 64, "runs": [[1 << 40, N]]}
        assert len(new.content) < 2000  # a few numbers, not 2,000 addresses

        for _ in range(2):  # an old reader (no address_runs): the list, and no field it would refuse
            old = _lease(c, "old", v)
            assert old.status_code == 200, old.text
            assert "address_runs" not in old.text
            g = LeaseGrant.model_validate_json(old.content)  # extra="forbid", as older clients parse it
            assert g.replicas[0].addresses == addrs

        # a reader registering by digest with runs, and a plain-list replica read by a new reader
        plain = [(1 << 45) + 4096 * i for i in range(N)]
        r = c.post("/v1/replicas", json={"worker_id": "old", "model": "m", "version": v,
                                         "manifest_digest": manifest_digest(man), "addresses": plain})
        assert r.status_code == 200, r.text
        g = _lease(c, "reader", v, address_runs=True, max_sources=4).json()
        by_worker = {x["worker_id"]: x for x in g["replicas"]}
        assert by_worker["old"]["addresses"] == plain and "address_runs" not in by_worker["old"]
        assert by_worker["pub"]["address_runs"]["runs"] == [[1 << 40, N]]


BAD_RUNS = [
    ({"align": 64, "runs": [[-1, N]]}, "greater than or equal to 0"),
    ({"align": 64, "runs": [[1 << 64, N]]}, "less than"),
    ({"align": 64, "runs": [[4096, 0], [8192, N]]}, "greater than or equal to 1"),
    ({"align": 64, "runs": [[4096, 10 ** 12]]}, "less than or equal to"),
    ({"align": 0, "runs": [[4096, N]]}, "align"),
    ({"align": 64, "runs": [[4096, N - 1]]}, f"place {N - 1} tensors"),
    ({"align": 64, "runs": [[4096 * k, 1] for k in range(N + 1)]}, f"place {N + 1} tensors"),
    ({"align": 64, "runs": [[(1 << 64) - 4096, N]]}, "64-bit address space"),
    ({"align": 64, "runs": [[4096, "many"]]}, "integer"),
    ({"align": 64, "runs": [[4096]]}, "runs"),
    ({"align": 64}, "runs"),
    ("4096:2000", "address_runs"),
]


@pytest.mark.parametrize("runs,why", BAD_RUNS)
def test_malformed_runs_are_refused_clearly_and_the_service_keeps_serving(coordinator, runs, why):
    with httpx.Client(base_url=coordinator.url, timeout=30) as c:
        man, v, addrs, good = _setup(c)
        by_manifest = {"worker_id": "pub", "model": "m", "version": v, "manifest": man.model_dump(mode="json"),
                       "address_runs": runs}
        r = c.post("/v1/replicas", json=by_manifest)
        assert r.status_code == 422 and r.json()["code"] == "invalid_request", r.text
        assert why in r.json()["detail"], r.json()["detail"]
        both = dict(by_manifest, address_runs=good.model_dump(mode="json"), addresses=addrs)
        r = c.post("/v1/replicas", json=both)
        assert r.status_code == 422 and "not both" in r.json()["detail"]
        # the service keeps serving: the good registration, then the same bad runs by digest
        ok = c.post("/v1/replicas", json=dict(by_manifest, address_runs=good.model_dump(mode="json")))
        assert ok.status_code == 200, ok.text
        by_digest = {"worker_id": "reader", "model": "m", "version": v, "manifest_digest": manifest_digest(man),
                     "address_runs": runs}
        r = c.post("/v1/replicas", json=by_digest)
        assert r.status_code == 422 and r.json()["code"] == "invalid_request", r.text
        assert why in r.json()["detail"], r.json()["detail"]
        # a serving lease offering them: the lease stands, the offer is refused with the reason
        offer = {"manifest_digest": manifest_digest(man), "address_runs": runs, "chunk_bytes": 1 << 20,
                 "num_chunks": 1, "status_addr": 4096, "status_tag": 7}
        g = _lease(c, "reader", v, pipelined=True, serve=offer, address_runs=True)
        if g.status_code == 200:  # runs that parse but do not fit the manifest
            assert g.json()["partial_replica_id"] is None and why in g.json()["serve_refused"]
        else:
            assert g.status_code == 422 and g.json()["code"] == "invalid_request", g.text
        assert c.post("/v1/workers/pub/heartbeat").status_code == 200
        assert _lease(c, "reader", v, address_runs=True).json()["replicas"][0]["address_runs"] == \
            good.model_dump(mode="json")
        assert json.loads(c.get("/v1/status").text)["models"]


# ---------------------------------------------------------------- worker processes, Mooncake
MiB = 1 << 20


@pytest.mark.multiprocess
def test_old_and_new_clients_read_each_other_through_runs(tmp_path, monkeypatch):
    """A publisher and readers that send runs, and readers that predate them (plain lists:
    ``TENSORHUB_ADDRESS_RUNS=0``), on one in-process coordinator: every fetch (pipelined,
    real Mooncake) moves the exact bytes, from either kind of source."""
    from tensorhub.server.state import StateConfig
    from tensorhub.coordinator import EmbeddedCoordinator

    made: list[Worker] = []

    def worker(name: str, old: bool) -> Worker:
        if old:
            monkeypatch.setenv("TENSORHUB_ADDRESS_RUNS", "0")
        else:
            monkeypatch.delenv("TENSORHUB_ADDRESS_RUNS", raising=False)
        made.append(Worker(emb.url, name))
        return made[-1]

    with EmbeddedCoordinator(tmp_path / "state", config=StateConfig(lease_ttl=10.0, worker_ttl=5.0)) as emb:
        try:
            state = emb.coordinator.state
            pub = worker("pub", old=False)
            v = pub.call("publish", seed=3, nbytes=24 * MiB, empty_like=True)
            want = digest(make_weights(3, 24 * MiB))
            old1 = worker("old1", old=True)
            assert old1.call("fetch", version=v)["digest"] == want  # from pub's runs, expanded for it
            new1 = worker("new1", old=False)
            assert new1.call("fetch", version=v)["digest"] == want

            def forms() -> dict:
                return {r.worker_id: type(r.addresses).__name__ for r in state.replicas.values() if r.version == v}

            assert forms() == {"pub": "AddressRuns", "old1": "list", "new1": "AddressRuns"}
            pub.kill()  # now old1 (a list) and new1 (runs) serve, then new2 (runs) too
            for name, old in (("new2", False), ("old2", True)):
                got = worker(name, old).call("fetch", version=v)
                assert got["digest"] == want and set(got["sources"]) <= {"old1", "new1", "new2"} - {name}, \
                    got["sources"]
            assert forms()["new2"] == "AddressRuns" and forms()["old2"] == "list"
        finally:
            for w in made:
                w.close()


def test_bench_routes_runs_mode_answers_every_route_with_small_bodies():
    """``benchmarks/bench_routes.py --addresses runs``, shortened: every route answers 200
    for every reader, and the serving lease's request and answer, the refresh's answer and
    the release + complete request stop carrying one address per tensor."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_routes.py"
    spec = importlib.util.spec_from_file_location("bench_routes", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_routes"] = mod
    spec.loader.exec_module(mod)
    outs = [mod.run_routes(readers=6, tensors=3000, chunks=256, beats=20, runs=runs) for runs in (False, True)]
    print(mod.report_both(*outs))
    plain, runs = ({r["route"]: r for r in o["routes"]} for o in outs)
    for name, r in runs.items():
        assert r["statuses"] == ({200: r["n"]} if r["n"] else {}), (name, r)
    lease = "lease, serving (readers 4-6 of 6)"
    for name, field in ((lease, "bytes"), (lease, "request_bytes"), ("lease refresh", "bytes"),
                        ("complete + release", "request_bytes")):
        assert runs[name][field] < 2000 < 10_000 < plain[name][field], (name, field, runs[name], plain[name])
