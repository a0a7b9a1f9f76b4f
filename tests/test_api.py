"""The coordinator's HTTP API (embedded, real HTTP on loopback), the public surface, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

import tensorhub


def test_public_api_is_locked():
    assert sorted(tensorhub.__all__) == sorted([
        "connect", "Hub", "HubConfig", "Fetched", "Borrowed", "Locality", "TensorHubError", "ConfigError", "TransportUnavailableError",
        "HubClosedError", "HubTimeoutError", "CoordinatorError", "UnauthorizedError", "NotFoundError",
        "ConflictError", "ManifestMismatchError", "RetentionError", "InvalidRequestError",
        "CoordinatorUnavailableError", "TensorMismatchError", "TransferError", "FetchError",
        "LeaseLapsedError", "__version__", "FetchProgress", "start_metrics_server", "Slice", "VersionMeta",
    ])
    for name in tensorhub.__all__:
        assert hasattr(tensorhub, name), name


def test_import_loads_no_engine_torch_or_mooncake():
    code = "import sys, tensorhub; print(sorted(m for m in ('torch','mooncake','mooncake.engine','vllm','sglang') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def spec(name="w", dtype="float32", shape=(4,), nbytes=16):
    return {"name": name, "dtype": dtype, "shape": list(shape), "nbytes": nbytes}


def replica_body(worker="a", version=1, tensors=None, addresses=None):
    tensors = tensors if tensors is not None else [spec()]
    return {"worker_id": worker, "model": "m", "version": version, "manifest": {"tensors": tensors},
            "addresses": addresses if addresses is not None else [4096] * len(tensors)}


@pytest.fixture
def api(embedded):
    with httpx.Client(base_url=embedded.url, timeout=30) as c:
        c.post("/v1/workers", json={"worker_id": "a", "endpoint": "127.0.0.1:1"}).raise_for_status()
        yield c


def test_healthz_openapi_and_happy_path(api):
    assert api.get("/healthz").json()["ok"] is True
    doc = api.get("/openapi.json").json()
    assert "/v1/leases" in doc["paths"] and "/v1/replicas" in doc["paths"]
    assert api.post("/v1/models/m/versions", json={}).json() == {"version": 1}
    r = api.post("/v1/replicas", json=replica_body())
    assert r.status_code == 200 and r.json()["complete"] is True
    assert api.get("/v1/models/m/latest").json() == {"version": 1}


@pytest.mark.parametrize("tensors,needle", [
    ([spec(nbytes=-1)], "nbytes"),
    ([spec(shape=(2**40, 2**40), nbytes=0)], "too large"),
    ([spec(name="bad\x07name")], "name"),
    ([spec(name="x" * 600)], "name"),
    ([spec(dtype="float13")], "unknown dtype 'float13'"),
    ([spec(nbytes=15)], "nbytes 15 != 4 elements"),
    ([spec(), spec()], "duplicate tensor name"),
    ([spec(shape=(1,) * 17, nbytes=4)], "shape"),
    ([spec(shape=(-4,), nbytes=16)], "shape"),
    ([spec(nbytes=2**64)], "nbytes"),
    ([spec(shape=(2**62,), dtype="int64", nbytes=2**65)], "nbytes"),
    ([spec(name=f"t{i}", shape=(2**47,), dtype="int8", nbytes=2**47) for i in range(9)], "larger than 1 PiB"),
    ([spec(name="")], "name"),
    ([spec(name="tab\tname")], "name"),
    ([spec(dtype="torch.float32")], "unknown dtype"),
    ([spec(shape=(4.5,))], "shape"),
])
def test_malformed_manifests_are_refused_with_4xx_and_a_message(api, tensors, needle):
    api.post("/v1/models/m/versions", json={})
    r = api.post("/v1/replicas", json=replica_body(tensors=tensors))
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["code"] == "invalid_request" and needle in body["detail"], body
    assert api.get("/healthz").status_code == 200
    assert api.get("/v1/models/m/latest").json() == {"version": None}  # nothing registered


def test_other_bad_requests(api):
    assert api.post("/v1/replicas", content=b"{not json", headers={"content-type": "application/json"}).status_code == 422
    assert api.post("/v1/replicas", json=replica_body(addresses=[1, 2])).status_code == 422
    assert api.post("/v1/models/bad%20name/versions", json={}).status_code == 422
    assert api.post("/v1/models/m/versions", json={"version": -3}).status_code == 422
    assert api.post("/v1/models/m/versions", json={"version": 2**70}).status_code == 422
    r = api.post("/v1/leases", json={"worker_id": "a", "model": "nope", "version": 1})
    assert r.status_code == 404 and "unknown model 'nope'" in r.json()["detail"]
    r = api.post("/v1/leases/l-zzz-1/renew")
    assert r.status_code == 409
    assert api.post("/v1/workers/ghost/heartbeat").status_code == 404


def test_huge_request_body_is_refused_before_parsing(api):
    # a million tensors: the body alone is over the 64 MiB limit
    one = json.dumps(spec(name="t" * 40)).encode()
    body = b'{"worker_id":"a","model":"m","version":1,"manifest":{"tensors":[' + b",".join([one] * 1_000_000) + b"]}}"
    assert len(body) > 64 << 20
    r = api.post("/v1/replicas", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "67108864 bytes" in r.json()["detail"]
    assert api.get("/healthz").status_code == 200


def test_token_required_except_healthz(tmp_path):
    from tensorhub.coordinator import EmbeddedCoordinator

    with EmbeddedCoordinator(tmp_path / "s", token="tok") as c:
        assert httpx.get(f"{c.url}/healthz").status_code == 200
        assert httpx.get(f"{c.url}/v1/status").status_code == 401
        assert httpx.post(f"{c.url}/v1/models/m/versions", json={}, headers={"Authorization": "Bearer tok2"}).status_code == 401
        assert httpx.get(f"{c.url}/v1/status", headers={"Authorization": "Bearer tok"}).status_code == 200
        with pytest.raises(tensorhub.UnauthorizedError):
            tensorhub.connect(c.url, token="wrong")
        with tensorhub.connect(c.url, token="tok") as hub:
            with pytest.raises(tensorhub.NotFoundError, match="unknown model"):
                hub.latest("m")


def test_versions_survive_restart_of_embedded_coordinator(tmp_path):
    from tensorhub.coordinator import EmbeddedCoordinator

    with EmbeddedCoordinator(tmp_path / "s") as c:
        for _ in range(3):
            httpx.post(f"{c.url}/v1/models/m/versions", json={}).raise_for_status()
    with EmbeddedCoordinator(tmp_path / "s") as c:
        assert httpx.post(f"{c.url}/v1/models/m/versions", json={}).json() == {"version": 4}


def test_cli_status_table_and_json(embedded):
    r = subprocess.run([sys.executable, "-m", "tensorhub", "status", "--coordinator", embedded.url],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "coordinator epoch" in r.stdout and "no models yet" in r.stdout
    r = subprocess.run([sys.executable, "-m", "tensorhub", "status", "--coordinator", embedded.url, "--json"],
                       capture_output=True, text=True, timeout=60)
    assert json.loads(r.stdout)["models"] == []


def test_cli_status_unreachable_coordinator_is_a_clear_error(capsys):
    from tensorhub.cli import main

    assert main(["status", "--coordinator", "http://127.0.0.1:9"]) == 2
    assert "unreachable" in capsys.readouterr().err
