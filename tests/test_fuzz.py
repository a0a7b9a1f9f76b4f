"""Bad input: generated requests never make the coordinator answer 5xx or stop serving.

Two generators, both against the real FastAPI app in this process (ASGI, no sockets):

* ``schemathesis`` reads ``/openapi.json`` and generates, per operation, requests that fit
  the schema (positive) and requests that break it (negative: wrong types, missing
  fields, out-of-range numbers, odd strings in paths and bodies).
* a hypothesis sequence test drives the state machine through plausible calls (a few
  worker, model and lease ids, so calls meet each other) with hostile manifests: negative
  or overflowing sizes, control characters, unknown dtypes, duplicate names, shape/size
  mismatches, manifests that differ from the registered one.

Every answer must be < 500, and the service must still answer afterwards. CI runs a few
hundred requests; the full run (thousands) prints the counts::

    FUZZ_EXAMPLES=300 python -m pytest -q -s tests/test_fuzz.py
"""

from __future__ import annotations

import collections
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

#: Examples per operation and generation mode (schemathesis), and sequences (state test).
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "20"))

_SETTINGS = dict(deadline=None, database=None, derandomize=False,
                 suppress_health_check=list(HealthCheck))


@pytest.fixture
def app(tmp_path):
    from tensorhub.server.state import StateConfig
    from tensorhub.coordinator import Coordinator, create_app

    coord = Coordinator(tmp_path / "state", StateConfig(lease_ttl=5.0, worker_ttl=3600.0))
    yield create_app(coord)
    coord.close()


def _seed(client) -> None:
    """A worker, a model with a complete version, a lease: so generated ids can hit something."""
    for w in ("a", "b"):
        client.post("/v1/workers", json={"worker_id": w, "endpoint": "127.0.0.1:1"}).raise_for_status()
    client.post("/v1/models/m/versions", json={}).raise_for_status()
    client.post("/v1/replicas", json={
        "worker_id": "a", "model": "m", "version": 1, "addresses": [4096],
        "manifest": {"tensors": [{"name": "w", "dtype": "float32", "shape": [4], "nbytes": 16}]},
    }).raise_for_status()
    client.post("/v1/leases", json={"worker_id": "b", "model": "m", "version": 1}).raise_for_status()


def test_generated_requests_from_the_openapi_document_get_no_5xx(app):
    schemathesis = pytest.importorskip("schemathesis")
    from schemathesis.generation import GenerationMode
    from starlette.testclient import TestClient

    with TestClient(app, raise_server_exceptions=False) as client:
        _seed(client)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    counts: dict[str, collections.Counter] = {}
    server_errors: list[str] = []
    ops = [r.ok() for r in schema.get_all_operations()]
    assert len(ops) >= 15, [op.label for op in ops]
    for op in ops:
        seen = counts.setdefault(op.label, collections.Counter())
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(max_examples=EXAMPLES, **_SETTINGS)
            @given(case=op.as_strategy(generation_mode=mode))
            def check(case):  # type: ignore[no-untyped-def]
                q = case.query or {}
                if isinstance(q.get("wait"), (int, float)) and not isinstance(q["wait"], bool) and q["wait"] > 0.01:
                    q["wait"] = 0.01  # a valid long poll would hold the request for up to 60 s
                resp = case.call()
                seen[resp.status_code] += 1
                if resp.status_code >= 500:
                    server_errors.append(f"{case.method} {case.formatted_path} {case.body!r:.300}: "
                                         f"{resp.status_code} {resp.text[:300]}")

            try:
                check()
            except Unsatisfiable:
                assert mode == GenerationMode.NEGATIVE  # nothing to break (no parameters, no body)
    total = sum(sum(c.values()) for c in counts.values())
    print(f"\n{total} generated requests over {len(ops)} operations")
    for label, c in sorted(counts.items()):
        print(f"  {label:<52} {dict(sorted(c.items()))}")
    assert not server_errors, "\n".join(server_errors[:10])
    with TestClient(app) as client:
        assert client.get("/healthz").status_code == 200
        assert client.get("/v1/status").status_code == 200
        assert client.get("/v1/models/m/latest").json() == {"version": 1}


# ------------------------------------------------------------------ state-machine sequences
_names = st.one_of(
    st.sampled_from(["w", "x", "model.layers.0.weight", "bad\x07name", "tab\tname", "del\x7f", "", "x" * 513,
                     "\u00e9\u4e2d", "a/b", "../../etc/passwd"]),
    st.text(max_size=20),
)
_dtypes = st.one_of(st.sampled_from(["float32", "bfloat16", "float8_e4m3fn", "int8", "bool", "float13",
                                     "torch.float32", "", "FLOAT32"]), st.text(max_size=10))
_ints = st.one_of(st.sampled_from([0, 1, 4, 16, -1, 2**31, 2**50, 2**53, 2**63, 2**64, 2**70, -(2**63)]),
                  st.integers(-10, 10**6))
_spec = st.fixed_dictionaries({
    "name": _names, "dtype": _dtypes,
    "shape": st.one_of(st.lists(_ints, max_size=4), st.just([4]), st.lists(st.just(1), min_size=15, max_size=18)),
    "nbytes": _ints,
})
_good_spec = st.builds(lambda n, k: {"name": n, "dtype": "float32", "shape": [k], "nbytes": 4 * k},
                       st.sampled_from(["w", "v", "u"]), st.integers(0, 8))
_manifest = st.one_of(
    st.fixed_dictionaries({"tensors": st.lists(st.one_of(_spec, _good_spec), max_size=4)}),
    st.fixed_dictionaries({"tensors": st.lists(_good_spec, min_size=1, max_size=3, unique_by=lambda s: s["name"])}),
    st.just({"tensors": "not a list"}), st.just({}), st.just(None),
)
_worker = st.sampled_from(["a", "b", "c", "ghost", "", "a b", "x" * 300])
_model = st.sampled_from(["m", "n", "bad name", "m%2Fx", "x" * 300])
_version = st.one_of(st.sampled_from([1, 2, 3, 0, -1, 2**53, 2**64]), st.none())
_layout = st.sampled_from(["hf", "vllm-tp2", "", "bad\x00"])
_shard = st.sampled_from([0, 1, 2, -1, 2**20])



_ops = st.one_of(
    st.builds(lambda w: ("POST", "/v1/workers", {"worker_id": w, "endpoint": "127.0.0.1:1"}), _worker),
    st.builds(lambda w: ("POST", f"/v1/workers/{w}/heartbeat", None), _worker),
    st.builds(lambda w: ("DELETE", f"/v1/workers/{w}", None), _worker),
    st.builds(lambda m, v: ("POST", f"/v1/models/{m}/versions", {} if v is None else {"version": v}), _model, _version),
    st.builds(lambda w, m, v, lay, s, n, man, addrs: ("POST", "/v1/replicas", {
        "worker_id": w, "model": m, "version": v, "layout": lay, "shard": s, "num_shards": n,
        "manifest": man, "addresses": addrs}),
        _worker, _model, _version, _layout, _shard, st.sampled_from([1, 2, 0, 70000]), _manifest,
        st.one_of(st.lists(st.sampled_from([0, 4096, 2**64 - 1, 2**64, -1]), max_size=4), st.just([4096, 8192, 0]))),
    st.builds(lambda w, m, v, lay, s, p, ex: ("POST", "/v1/leases", {
        "worker_id": w, "model": m, "version": v, "layout": lay, "shard": s, "pipelined": p, "exclude": ex}),
        _worker, _model, _version, _layout, _shard, st.booleans(), st.lists(st.sampled_from(["r-x-1", "a"]), max_size=2)),
    st.builds(lambda i, verb: ("POST", f"/v1/leases/{i}/{verb}", None),
              st.sampled_from(["LAST", "l-zzz-1", "l-1", "x" * 300]), st.sampled_from(["renew", "release"])),
    st.builds(lambda w, m, v: ("POST", f"/v1/models/{m}/versions/{v}/unpublish", {"worker_id": w}),
              _worker, _model, _version),
    st.builds(lambda r, w: ("POST", f"/v1/replicas/{r}/report", {"worker_id": w, "reason": "fuzz\x00\n"}),
              st.sampled_from(["r-x-1", "LASTR"]), _worker),
    st.builds(lambda m, g, n: ("POST", f"/v1/models/{m}/resolve", {"group": g, "newer_than": n}),
              _model, st.sampled_from([None, "g1", ""]), st.sampled_from([None, 0, 1, -1])),
    st.builds(lambda m, n, wait: ("GET", f"/v1/models/{m}/latest?newer_than={n}&wait={wait}", None),
              _model, st.sampled_from([0, 1, -1, 2**64]), st.sampled_from([0, -1, 0.01, 1e9])),
    st.just(("GET", "/v1/status", None)),
    st.just(("GET", "/v1/models", None)),
)


def test_generated_call_sequences_get_no_5xx(app):
    from starlette.testclient import TestClient

    codes: collections.Counter = collections.Counter()
    with TestClient(app, raise_server_exceptions=False) as client:
        _seed(client)
        last = {"LAST": "l-none-1", "LASTR": "r-none-1"}

        @settings(max_examples=EXAMPLES * 5, **_SETTINGS)
        @given(st.lists(_ops, min_size=1, max_size=12))
        def run(seq):  # type: ignore[no-untyped-def]
            for method, path, body in seq:
                for k, v in last.items():
                    path = path.replace(k, v)
                r = client.request(method, path, json=body) if body is not None else client.request(method, path)
                codes[r.status_code] += 1
                assert r.status_code < 500, f"{method} {path} {body!r:.300} -> {r.status_code} {r.text[:300]}"
                if r.status_code == 200 and path == "/v1/leases":
                    last["LAST"] = r.json()["lease_id"]
                    last["LASTR"] = r.json()["replicas"][0]["replica_id"] if r.json()["replicas"] else "r-none-1"

        run()
        assert client.get("/healthz").status_code == 200
        assert client.get("/v1/status").status_code == 200
    print(f"\n{sum(codes.values())} requests in generated sequences: {dict(sorted(codes.items()))}")


# ------------------------------------------------------------------ hand-picked bad input
def test_a_million_tiny_tensors_under_the_body_limit_are_refused_with_a_message(app):
    """48 MiB of one-byte tensors passes the 64 MiB body limit; the tensor limit refuses it."""
    from starlette.testclient import TestClient

    one = b'{"name":"t","dtype":"bool","shape":[],"nbytes":1}'
    body = (b'{"worker_id":"a","model":"m","version":1,"addresses":[],"manifest":{"tensors":['
            + b",".join([one] * 1_000_000) + b"]}}")
    assert len(body) < 64 << 20
    with TestClient(app) as client:
        _seed(client)
        r = client.post("/v1/replicas", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 422 and "at most 200000 items" in r.json()["detail"], r.text[:300]
        assert client.get("/v1/models/m/latest").json() == {"version": 1}


@pytest.mark.parametrize("patch,needle", [
    ({"layout": "hf\x00"}, "layout"),
    ({"layout": "x" * 513}, "layout"),
    ({"model": "m\n"}, "model"),
    ({"worker_id": "a b"}, "worker_id"),
    ({"num_shards": 0}, "num_shards"),
    ({"shard": 3, "num_shards": 2}, "shard 3 >= num_shards 2"),
    ({"addresses": [2**64]}, "addresses"),
    ({"addresses": [-1]}, "addresses"),
    ({"extra": 1}, "extra"),
])
def test_bad_replica_fields_are_refused_with_a_message(app, patch, needle):
    from starlette.testclient import TestClient

    body = {"worker_id": "a", "model": "m", "version": 1, "addresses": [4096],
            "manifest": {"tensors": [{"name": "w", "dtype": "float32", "shape": [4], "nbytes": 16}]}}
    body.update(patch)
    with TestClient(app) as client:
        _seed(client)
        r = client.post("/v1/replicas", json=body)
        assert r.status_code == 422 and needle in r.json()["detail"], r.text


@pytest.mark.parametrize("body", [
    b"[" * 100_000 + b"]" * 100_000,          # nesting deeper than the JSON parser's recursion limit
    b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    b"\xff\xfe", b"1e999999", b'"\\ud800"', b"NaN", b"", b"null",
    b'{"worker_id":"a","model":"m","version":1e308,"manifest":{"tensors":[]},"addresses":[]}',
    b'{"worker_id":"a","model":"m","version":NaN,"manifest":{"tensors":[]},"addresses":[]}',
])
def test_unparseable_bodies_get_4xx(app, body):
    from starlette.testclient import TestClient

    with TestClient(app) as client:
        for path in ("/v1/replicas", "/v1/leases", "/v1/models/m/versions"):
            r = client.post(path, content=body, headers={"content-type": "application/json"})
            if path.endswith("/versions") and body in (b"", b"null"):
                assert r.status_code == 200  # the body is optional there: a new version
                continue
            assert 400 <= r.status_code < 500, (path, r.status_code, r.text[:200])
        assert client.get("/healthz").status_code == 200
