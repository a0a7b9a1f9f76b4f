"""The route table (``tensorhub.protocol.routes``) is the coordinator's: every route the
application serves is in it with its method, path and answer model, and nothing else is;
the client reaches each route through it."""

from __future__ import annotations

import inspect

import pytest

from tensorhub._client import CoordinatorClient
from tensorhub.protocol.routes import ROUTES, Route, gate_rank

_DOCS = {"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    from tensorhub.coordinator import Coordinator, create_app

    coord = Coordinator(tmp_path_factory.mktemp("routes") / "state")
    try:
        yield create_app(coord)
    finally:
        coord.close()


def test_the_app_serves_exactly_the_tables_routes(app):
    served = {(m, r.path) for r in app.routes for m in (getattr(r, "methods", None) or ()) if m != "HEAD"
              and r.path not in _DOCS}
    assert served == {(r.method, r.path) for r in ROUTES.values()}


def test_every_answer_model_is_in_the_openapi_document(app):
    doc = app.openapi()
    for name, r in ROUTES.items():
        if r.answer is None:
            continue
        op = doc["paths"][r.path][r.method.lower()]
        schema = op["responses"]["200"]["content"]["application/json"]["schema"]
        assert schema.get("$ref", "").endswith(f"/{r.answer.__name__}"), (name, schema)


def test_every_route_has_a_client_method_of_its_name():
    """Each route but the shell's own (liveness, metrics) is one method of the client,
    which calls it by that name (``CoordinatorClient.call``)."""
    src = inspect.getsource(CoordinatorClient)
    for name in ROUTES:
        if name in ("healthz", "metrics"):
            continue
        assert f'"{name}"' in src, name


def test_a_routes_url_and_pattern():
    r = Route("GET", "/v1/models/{model}/versions/{version}/manifest")
    assert r.url(model="m.1", version=3) == "/v1/models/m.1/versions/3/manifest"
    assert r.pattern.fullmatch("GET /v1/models/m.1/versions/3/manifest")
    assert not r.pattern.fullmatch("GET /v1/models/a/b/versions/3/manifest")
    assert not r.pattern.fullmatch("POST /v1/models/m/versions/3/manifest")
    assert gate_rank("POST", "/v1/replicas") == 0 and gate_rank("POST", "/v1/leases") == 1


def test_the_plain_routes_answer_their_models(app):
    """Liveness, info, the model list and the reports answer what their models say (the
    client reads info and models back as the dicts and list it always gave)."""
    from fastapi.testclient import TestClient

    from tensorhub.protocol import Health, Info, ModelList

    with TestClient(app) as c:
        h = Health.model_validate(c.get("/healthz").json())
        assert h.ok and h.role == "leader" and h.leader is None and h.epoch
        info = c.get("/v1/info").json()
        assert Info.model_validate(info).lease_ttl == 30.0 and info["suspect_ttl"] == 30.0
        assert c.post("/v1/models/m/versions", json={}).json() == {"version": 1}
        assert ModelList.model_validate(c.get("/v1/models").json()).model_dump() == \
            [{"model": "m", "counter": 1, "latest": None}]
        assert c.post("/v1/workers", json={"worker_id": "w", "endpoint": "127.0.0.1:1"}).json()["suspect_ttl"] == 30.0
        assert c.post("/v1/replicas/r-1/report", json={"worker_id": "w", "reason": "x"}).json() == {}
        bad = c.post("/v1/swaps", json={"nope": 1})
        assert bad.status_code == 422 and bad.json()["code"] == "invalid_request"
