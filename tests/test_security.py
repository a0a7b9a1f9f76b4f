"""Trust model checks (SECURITY.md): the token guards every route but ``/healthz`` and is
never logged; what the Mooncake data plane really listens on matches what SECURITY.md says."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "s3cret-Token-4-tests"


def test_every_route_but_healthz_needs_the_token_and_it_is_never_logged(tmp_path, caplog):
    from tensorhub.coordinator import EmbeddedCoordinator

    caplog.set_level(logging.DEBUG)
    with EmbeddedCoordinator(tmp_path / "s", token=TOKEN) as c:
        app = c._srv.server.config.app  # type: ignore[union-attr]
        paths = {(m, r.path) for r in app.routes for m in getattr(r, "methods", None) or {"GET"}}
        paths |= {("GET", "/docs"), ("GET", "/redoc"), ("GET", "/openapi.json"), ("GET", "/nope"),
                  ("OPTIONS", "/v1/status"), ("HEAD", "/v1/status"), ("GET", "/healthz/"), ("GET", "//healthz")}
        assert ("GET", "/openapi.json") in paths and ("POST", "/v1/leases") in paths
        with httpx.Client(base_url=c.url, timeout=10) as http:
            for method, path in sorted(paths):
                concrete = path.replace("{", "").replace("}", "")  # /v1/models/model/versions/version/...
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                                {"Authorization": f"bearer {TOKEN}"}, {"Authorization": f"Bearer {TOKEN}x"}):
                    r = http.request(method, concrete, headers=headers)
                    want = 200 if path == "/healthz" else 401
                    assert r.status_code == want, (method, concrete, headers, r.status_code)
                    if want == 401 and method != "HEAD":
                        assert r.json()["code"] == "unauthorized" and TOKEN not in r.text
            good = {"Authorization": f"Bearer {TOKEN}"}
            assert http.get("/openapi.json", headers=good).status_code == 200
            assert http.get("/docs", headers=good).status_code == 200
            assert http.post("/v1/workers", json={"worker_id": "w", "endpoint": "x:1"}, headers=good).status_code == 200
    assert TOKEN not in caplog.text


def _listeners(pid: int) -> list[tuple[str, int]]:
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        if f"pid={pid}," in line:
            local = line.split()[3]
            addr, _, port = local.rpartition(":")
            found.append((addr, int(port)))
    return found


def test_mooncake_listeners_match_security_md(monkeypatch, capsys):
    """Start a Mooncake transport bound (nominally) to 127.0.0.1 and list its listening
    sockets with ``ss``. SECURITY.md must say what is true: if any of them listens on a
    wildcard address, it says so."""
    pytest.importorskip("mooncake.engine")
    if shutil.which("ss") is None:
        pytest.skip("no ss")
    from tensorhub.transport import create_transport

    monkeypatch.setenv("TENSORHUB_TRANSPORT", "mooncake")
    t = create_transport(host="127.0.0.1")
    endpoint = t.start()
    try:
        found = _listeners(os.getpid())
    finally:
        t.close()
    print(f"\nendpoint {endpoint}; listening: {found}")
    rpc_port = int(endpoint.rsplit(":", 1)[1])
    assert rpc_port in {p for _, p in found}, (endpoint, found)
    wildcard = {p for a, p in found if a in ("0.0.0.0", "*", "[::]", "::")}
    doc = (ROOT / "SECURITY.md").read_text()
    if wildcard:
        assert "listen on all interfaces" in doc, found
    else:
        assert "listen on all interfaces" not in doc, ("Mooncake now binds the data host; update SECURITY.md", found)


def test_client_text_cannot_forge_log_lines(embedded, caplog):
    caplog.set_level(logging.WARNING, logger="tensorhub.coordinator")
    with httpx.Client(base_url=embedded.url, timeout=10) as http:
        http.post("/v1/workers", json={"worker_id": "a", "endpoint": "x:1"}).raise_for_status()
        r = http.post("/v1/replicas/r-x-1/report",
                      json={"worker_id": "a", "reason": "timeout\n2026-01-01 ERROR forged\x1b[2J"})
        assert r.status_code == 200
    msgs = [rec.getMessage() for rec in caplog.records if "reported failing" in rec.message]
    assert msgs and all("\n" not in m and "\x1b" not in m for m in msgs), msgs


def test_heartbeat_fast_path_answers_like_the_route(embedded):
    """Heartbeats skip FastAPI's routing (_asgi._FastHeartbeat); same answers."""
    with httpx.Client(base_url=embedded.url, timeout=10) as http:
        http.post("/v1/workers", json={"worker_id": "w:1@x", "endpoint": "x:1"}).raise_for_status()
        r = http.post("/v1/workers/w:1@x/heartbeat")
        assert r.status_code == 200 and r.json() == {"epoch": embedded.coordinator.state.epoch,
                                                      "served_leases": 0, "served_bytes": 0, "fetches": 0}
        r = http.post("/v1/workers/ghost/heartbeat", json={})
        assert r.status_code == 404 and r.json() == {
            "code": "unknown_worker", "detail": "unknown worker 'ghost'; register again"}
        assert http.post("/v1/workers/a%20b/heartbeat").status_code == 422  # falls through to the route
        assert http.post(f"/v1/workers/{'x' * 257}/heartbeat").status_code == 422
        assert http.post("/v1/workers/a/b/heartbeat").status_code == 404
        assert http.get("/v1/workers/w:1@x/heartbeat").status_code == 405


def test_heartbeat_fast_path_takes_fetch_reports_and_refuses_bad_bodies_like_the_route(embedded):
    """A heartbeat's body (fetch progress) is read on the fast path too: recorded as
    ``POST /v1/fetches`` would; a body that does not validate gets the route's 422."""
    with httpx.Client(base_url=embedded.url, timeout=10) as http:
        http.post("/v1/workers", json={"worker_id": "r", "endpoint": "x:1"}).raise_for_status()
        assert http.post("/v1/models/m/versions", json={}).json()["version"] == 1
        rep = {"worker_id": "r", "model": "m", "version": 1, "layout": "hf", "shard": 0, "state": "running",
               "nbytes": 1024, "total": 4096, "seconds": 0.5, "sources": {}, "failed_sources": 0}
        r = http.post("/v1/workers/r/heartbeat", json={"fetches": [rep, dict(rep, model="nope")]})
        assert r.status_code == 200 and r.json()["fetches"] == 1  # the unknown model: not recorded, beat stands
        rec, _ = embedded.coordinator.state.fetching[("r", "m", 1, "hf", 0)]  # its progress is known
        assert rec.nbytes == 1024 and rec.total == 4096
        bad = http.post("/v1/workers/r/heartbeat", json={"fetches": [dict(rep, nbytes=-1)]})
        assert bad.status_code == 422 and bad.json()["code"] == "invalid_request", bad.text
        assert "nbytes" in bad.json()["detail"]
        extra = http.post("/v1/workers/r/heartbeat", json={"fetches": [], "surprise": 1})
        assert extra.status_code == 422 and "surprise" in extra.json()["detail"]
        broken = http.post("/v1/workers/r/heartbeat", content=b'{"fetches": [', headers={"Content-Type": "application/json"})
        assert broken.status_code == 422 and broken.json()["code"] == "invalid_request"
        assert http.post("/v1/workers/ghost/heartbeat", json={"fetches": [rep]}).status_code == 404
