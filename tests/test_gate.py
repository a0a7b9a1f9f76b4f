"""The coordinator's gate for the readers' calls (``server.asgi._Guard``, ``GATE_SLOTS``):
a burst of leases, resolves and manifest GETs runs a few at a time, so heartbeats and other
short calls are answered between them; a slow body, an unread answer or a slow disk holds
no slot."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tensorhub.server.core import Coordinator
from tensorhub.server.state import StateConfig
from tensorhub.server.asgi import GATE_SLOTS, _Gate, _Guard
from tensorhub.protocol.routes import gate_rank as _gate_rank
from tensorhub.coordinator import create_app

from _stores import SlowStore

CFG = StateConfig(lease_ttl=10.0, worker_ttl=30.0, pause_grace=1e9, group_ttl=100.0, keep_versions=4)


@pytest.mark.parametrize("call", [
    "POST /v1/leases", "POST /v1/replicas", "POST /v1/models/m/resolve", "POST /v1/models/m/versions",
    "GET /v1/models/m/versions/3/manifest", "GET /v1/models/m/versions/3", "GET /v1/status", "GET /v1/models",
])
def test_the_readers_and_publishers_calls_are_gated(call):
    assert _gate_rank(*call.split(" ")) is not None


@pytest.mark.parametrize("call", [
    "POST /v1/workers/w1/heartbeat", "POST /v1/workers", "POST /v1/leases/l1/renew", "POST /v1/leases/l1/release",
    "GET /v1/leases/l1/covers", "GET /v1/models/m/latest", "POST /v1/replicas/r1/report",
    "POST /v1/replicas/r1/chunks", "POST /v1/fetches", "POST /v1/swaps", "GET /healthz", "GET /metrics",
    "GET /v1/info", "POST /v1/models/m/versions/3/unpublish", "DELETE /v1/workers/w1",
])
def test_heartbeats_renewals_reports_and_long_polls_are_not(call):
    assert _gate_rank(*call.split(" ")) is None


def _scope(method: str, path: str, body: bytes = b"") -> dict:
    headers = [(b"content-length", str(len(body)).encode())] if body else []
    return {"type": "http", "method": method, "path": path, "headers": headers}


class _Inner:
    """An ASGI app that holds gated calls until ``go`` is set, counting how many run."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.running = self.most = 0
        self.order: list[str] = []
        self.bodies: list[bytes] = []

    async def __call__(self, scope, receive, send) -> None:
        msg = await receive() if scope["headers"] else {"body": b""}
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            if "heartbeat" not in scope["path"]:
                await self.go.wait()
            self.order.append(scope["path"])
            self.bodies.append(msg.get("body", b""))
        finally:
            self.running -= 1
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def _client(body: bytes = b"", stall: "asyncio.Event | None" = None):
    """receive/send for one request; ``stall``: the body arrives only once it is set."""
    got: list[dict] = []

    async def receive() -> dict:
        if stall is not None:
            await stall.wait()
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(msg: dict) -> None:
        got.append(msg)

    return receive, send, got


def test_a_burst_runs_a_few_at_a_time_in_order_and_heartbeats_pass_it():
    async def main() -> None:
        inner = _Inner()
        guard = _Guard(inner, None, slots=2)
        calls = []
        for i in range(6):
            r, s, got = _client(b'{"i": %d}' % i)
            calls.append((asyncio.ensure_future(guard(_scope("POST", f"/v1/models/m{i}/resolve", b'{"i": %d}' % i), r, s)), got))
            await asyncio.sleep(0)
        for _ in range(5):
            await asyncio.sleep(0)
        assert inner.running == 2, "the gate lets exactly its slots in"
        r, s, got = _client()
        await asyncio.wait_for(guard(_scope("POST", "/v1/workers/w1/heartbeat"), r, s), 1)
        assert got[0]["status"] == 200, "a heartbeat is answered while the burst waits"
        inner.go.set()
        await asyncio.wait_for(asyncio.gather(*(t for t, _ in calls)), 5)
        assert inner.most <= 3  # two gated calls and the heartbeat
        assert inner.order[1:] == [f"/v1/models/m{i}/resolve" for i in range(6)], "first come, first served"
        assert inner.bodies[1:] == [b'{"i": %d}' % i for i in range(6)], "each call gets its own body"
        assert all(got[0]["status"] == 200 for _, got in calls)

    asyncio.run(main())


def test_calls_further_along_a_read_go_first_and_a_cancelled_wait_frees_nothing_twice():
    """Waiting calls pass by rank (complete registration, lease, manifest, resolve, views),
    then in arrival order; a waiter that gives up (its client went away) takes no slot, and
    one granted as it gave up passes the slot on."""
    async def main() -> None:
        inner = _Inner()
        guard = _Guard(inner, None, slots=1)
        first = asyncio.ensure_future(guard(_scope("GET", "/v1/status"), *_client()[:2]))
        await asyncio.sleep(0)
        assert inner.running == 1
        calls = [("GET", "/v1/models/m/versions/1"), ("POST", "/v1/models/m/resolve"),
                 ("GET", "/v1/models/m/versions/1/manifest"), ("POST", "/v1/leases"), ("POST", "/v1/replicas"),
                 ("POST", "/v1/models/m/resolve")]
        waiting = []
        for m, path in calls:
            waiting.append(asyncio.ensure_future(guard(_scope(m, path, b"{}" if m == "POST" else b""),
                                                       *_client(b"{}" if m == "POST" else b"")[:2])))
            await asyncio.sleep(0)
        gone = asyncio.ensure_future(guard(_scope("POST", "/v1/leases", b"{}"), *_client(b"{}")[:2]))
        await asyncio.sleep(0)
        gone.cancel()
        inner.go.set()
        await asyncio.wait_for(asyncio.gather(first, *waiting), 5)
        assert inner.order == ["/v1/status", "/v1/replicas", "/v1/leases", "/v1/models/m/versions/1/manifest",
                               "/v1/models/m/resolve", "/v1/models/m/resolve", "/v1/models/m/versions/1"]
        assert inner.most == 1

        gate = _Gate(1)
        await gate.acquire(0)
        w = asyncio.ensure_future(gate.acquire(1))
        await asyncio.sleep(0)
        gate.release()  # granted to w ...
        w.cancel()  # ... as it gives up: the slot is passed on, not lost
        with pytest.raises(asyncio.CancelledError):
            await w
        assert gate.free == 1
        await asyncio.wait_for(gate.acquire(3), 1)

    asyncio.run(main())


@pytest.mark.parametrize("body", [b"", b"1", b"\xff\xfe", b"{}", b'{"a": [1, 2]}' * 1000])
def test_a_gated_call_gets_its_body_byte_for_byte(body):
    """Whatever its size, down to 0-2 bytes (not taken for an empty object), in several
    chunks too, the body a gated call reads is the one the client sent."""
    async def main() -> None:
        inner = _Inner()
        inner.go.set()
        guard = _Guard(inner, None, slots=1)
        chunks = [body[i:i + 7] for i in range(0, len(body), 7)] or [b""]

        async def receive() -> dict:
            return {"type": "http.request", "body": chunks.pop(0), "more_body": bool(chunks)}

        got: list = []

        async def send(msg: dict) -> None:
            got.append(msg)

        scope = _scope("POST", "/v1/models/m/versions", body)
        await asyncio.wait_for(guard(scope, receive, send), 1)
        assert inner.bodies == [body] and got[0]["status"] == 200

    asyncio.run(main())


def test_a_slow_body_and_an_unread_answer_hold_no_slot():
    async def main() -> None:
        inner = _Inner()
        inner.go.set()
        guard = _Guard(inner, None, slots=1)
        stall = asyncio.Event()
        r, s, _ = _client(b"{}", stall=stall)  # its body never comes
        slow = asyncio.ensure_future(guard(_scope("POST", "/v1/leases", b"{}"), r, s))
        await asyncio.sleep(0.01)

        unread = asyncio.Event()

        async def blocked_send(msg: dict) -> None:  # a client that does not read its answer
            if msg["type"] == "http.response.body":
                await unread.wait()

        r2, _, _ = _client(b"{}")
        stuck = asyncio.ensure_future(guard(_scope("POST", "/v1/leases", b"{}"), r2, blocked_send))
        await asyncio.sleep(0.01)
        r3, s3, got = _client(b"{}")
        await asyncio.wait_for(guard(_scope("POST", "/v1/leases", b"{}"), r3, s3), 1)
        assert got[0]["status"] == 200
        stall.set()
        unread.set()
        await asyncio.wait_for(asyncio.gather(slow, stuck), 1)

    asyncio.run(main())


def test_a_call_waiting_for_the_disk_lets_go_of_its_slot(tmp_path):
    """More publishers than slots allocate versions on a slow disk: each lets go of its slot
    while its commit waits, so the next ones get in and their writes share commits (group
    commit) instead of one slow commit per slot's turn."""
    store = SlowStore(tmp_path / "state", delay=0.5)
    coord = Coordinator(None, CFG, store=store)
    n = 3 * GATE_SLOTS

    async def main() -> list:
        app = create_app(coord)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://c") as c:
            rs = await asyncio.gather(*(c.post(f"/v1/models/m{i}/versions", json={}) for i in range(n)))
        return rs

    try:
        rs = asyncio.run(main())
        assert [r.status_code for r in rs] == [200] * n, [r.text for r in rs]
        assert sorted(r.json()["version"] for r in rs) == [1] * n
        assert len(store.batches) < n / GATE_SLOTS, f"commits did not batch: {store.batches}"
    finally:
        coord.close()
    back = Coordinator(tmp_path / "state", CFG)
    try:
        assert all(back.state.models[f"m{i}"].counter == 1 for i in range(n)), "every answered version is durable"
    finally:
        back.close()


@pytest.mark.parametrize("slots", ["1", "0"])
def test_the_coordinator_process_serves_with_any_number_of_slots(tmp_path, slots):
    """``tensorhub coordinator --call-slots N``: a real coordinator process answers a burst
    of publishers' allocations and resolves, with heartbeats between them, whatever N."""
    from concurrent.futures import ThreadPoolExecutor

    from tensorhub.testing import CoordinatorProcess

    c = CoordinatorProcess(tmp_path / "state", extra=("--call-slots", slots))
    url = c.start()
    try:
        with httpx.Client(base_url=url, timeout=30) as h:
            assert h.post("/v1/workers", json={"worker_id": "w", "endpoint": "127.0.0.1:1"}).status_code == 200

            def one(i: int) -> tuple[int, int]:
                v = h.post(f"/v1/models/m{i % 4}/versions", json={}).json()["version"]
                beat = h.post("/v1/workers/w/heartbeat", json={})
                return v, beat.status_code

            with ThreadPoolExecutor(16) as ex:
                got = list(ex.map(one, range(40)))
            assert sorted(v for v, _ in got) == sorted(list(range(1, 11)) * 4)  # each model's 1..10, once each
            assert {b for _, b in got} == {200}
            r = h.get("/v1/models")  # gated too
            assert r.status_code == 200
            assert {m["model"]: (m["counter"], m["latest"]) for m in r.json()} == {
                f"m{i}": (10, None) for i in range(4)}  # allocated, none complete
    finally:
        c.stop()


@pytest.mark.parametrize("flag,value,says", [("--call-slots", "-1", "--call-slots must be >= 0"),
                                             ("--suspect-ttl", "0", "--suspect-ttl must be > 0")])
def test_a_negative_number_of_slots_or_no_suspect_time_is_refused(tmp_path, flag, value, says):
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "tensorhub", "coordinator", "--state-dir", str(tmp_path),
                        flag, value], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and says in p.stderr


def _big_registration(n: int, worker: str = "trainer", version: int = 1, dtype: str = "float32") -> dict:
    tensors = [{"name": f"model.layers.{i}.mlp.weight", "dtype": dtype, "shape": [4, 8], "nbytes": 128}
               for i in range(n)]
    return {"worker_id": worker, "model": "m", "version": version, "layout": "hf", "shard": 0, "num_shards": 1,
            "manifest": {"tensors": tensors}, "addresses": [(1 << 32) + 4096 * i for i in range(n)]}


def test_a_large_registration_is_parsed_off_the_loop_and_answered_as_the_route_would(tmp_path):
    """A publisher's registration over 1 MB (``_Registration``: parsed on a thread)
    registers the same manifest, bytes for bytes, as a small one through the route; a
    large body that does not validate gets the route's 422; a wrong token is refused first;
    a registration for a version never allocated is the route's 404/409."""
    import json

    from tensorhub.server.asgi import _LARGE_BODY
    from tensorhub.coordinator import EmbeddedCoordinator

    n = 12_000
    body = _big_registration(n)
    assert len(json.dumps(body)) > _LARGE_BODY
    with EmbeddedCoordinator(tmp_path / "state", config=CFG) as c, httpx.Client(base_url=c.url, timeout=60) as h:
        assert h.post("/v1/workers", json={"worker_id": "trainer", "endpoint": "127.0.0.1:1"}).status_code == 200
        small = _big_registration(8)
        small["model"] = "small"
        for m in ("m", "small"):
            assert h.post(f"/v1/models/{m}/versions", json={}).json() == {"version": 1}
        r = h.post("/v1/replicas", json=body)
        assert r.status_code == 200 and r.json()["complete"] is True and r.json()["replica_id"], r.text
        assert h.post("/v1/replicas", json=small).json()["complete"] is True  # the route: same answer's shape
        got = h.get("/v1/models/m/versions/1/manifest?layout=hf&shard=0").json()
        assert got["tensors"] == body["manifest"]["tensors"]
        assert h.post("/v1/models/m/resolve", json={}).json() == {"version": 1}

        bad = _big_registration(n, version=1, dtype="float33")
        r = h.post("/v1/replicas", json=bad)
        assert r.status_code == 422 and r.json()["code"] == "invalid_request", r.text
        assert "dtype" in r.json()["detail"]
        r = h.post("/v1/replicas", content=json.dumps(body).encode()[:-10], headers={"Content-Type": "application/json"})
        assert r.status_code == 422 and r.json()["code"] == "invalid_request", r.text
        r = h.post("/v1/replicas", json=_big_registration(n, version=7))
        assert r.status_code in (404, 409) and r.json()["code"], r.text
        # The state is as it was: the refused ones registered nothing.
        assert h.get("/v1/models/m/versions/1/manifest?layout=hf&shard=0").json() == got

    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    from tensorhub.testing import CoordinatorProcess

    proc = CoordinatorProcess(tmp_path / "state2", token_file=token_file)
    url = proc.start()
    try:
        with httpx.Client(base_url=url, timeout=60) as h:
            r = h.post("/v1/replicas", json=body, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401 and r.json()["code"] == "unauthorized"
            ok = {"Authorization": "Bearer s3cret"}
            assert h.post("/v1/workers", json={"worker_id": "trainer", "endpoint": "127.0.0.1:1"},
                          headers=ok).status_code == 200
            assert h.post("/v1/models/m/versions", json={}, headers=ok).json() == {"version": 1}
            r = h.post("/v1/replicas", json=body, headers=ok)
            assert r.status_code == 200 and r.json()["complete"] is True, r.text
            assert h.get("/v1/models/m/versions/1/manifest?layout=hf&shard=0",
                         headers=ok).json()["tensors"] == body["manifest"]["tensors"]
    finally:
        proc.stop()


def test_small_registrations_skip_the_route_and_answer_as_it_would(tmp_path):
    """``_Registration`` parses small bodies on the loop too (every reader's release +
    register): a bad dtype, a cut body and an unknown field get the route's 422; a body sent
    chunked (no content-length) is refused first, as always; release + register answers which leases
    stayed valid and registers nothing when one did not."""
    import json

    from tensorhub.coordinator import EmbeddedCoordinator

    with EmbeddedCoordinator(tmp_path / "state", config=CFG) as c, httpx.Client(base_url=c.url, timeout=60) as h:
        for w in ("trainer", "reader"):
            assert h.post("/v1/workers", json={"worker_id": w, "endpoint": "127.0.0.1:1"}).status_code == 200
        assert h.post("/v1/models/m/versions", json={}).json() == {"version": 1}
        body = _big_registration(8)
        bad = _big_registration(8, dtype="float33")
        r = h.post("/v1/replicas", json=bad)
        assert r.status_code == 422 and r.json()["code"] == "invalid_request" and "dtype" in r.json()["detail"], r.text
        r = h.post("/v1/replicas", content=json.dumps(body).encode()[:-3], headers={"Content-Type": "application/json"})
        assert r.status_code == 422 and r.json()["code"] == "invalid_request", r.text
        r = h.post("/v1/replicas", json=dict(body, colour="blue"))
        assert r.status_code == 422 and r.json()["code"] == "invalid_request", r.text

        def chunked():
            yield json.dumps(body).encode()

        r = h.post("/v1/replicas", content=chunked(), headers={"Content-Type": "application/json"})
        assert r.status_code == 411 and r.json()["code"] == "length_required", r.text  # (``_Guard``, first)
        r = h.post("/v1/replicas", json=body)
        assert r.status_code == 200 and r.json()["complete"] is True, r.text
        lease = h.post("/v1/leases", json={"worker_id": "reader", "model": "m", "version": 1}).json()
        read = dict(_big_registration(8, worker="reader"), release=[lease["lease_id"], "l-nope"])
        r = h.post("/v1/replicas", json=read)
        assert r.status_code == 200, r.text
        assert r.json() == {"replica_id": "", "complete": True, "released": {lease["lease_id"]: True, "l-nope": False}}
        assert [x["worker_id"] for x in h.get("/v1/models/m/versions/1").json()["replicas"]] == ["trainer"]


def test_a_publish_with_subscribers_warms_its_manifest_on_the_parse_thread():
    """``_parse_registration`` makes what binding subscribers computes once per manifest
    (shape digest, chunk grid: ``server.ahead.warm``) only for a model someone subscribed to."""
    import json

    from tensorhub.server import grants as _grants
    from tensorhub.protocol import manifest as wire_manifest
    from tensorhub.server.asgi import _parse_registration

    body = json.dumps(_big_registration(64)).encode()
    cold = _parse_registration(body, lambda model: False)
    hot = _parse_registration(body, lambda model: model == "m")
    for kept in (wire_manifest._shapes_kept, _grants._GRIDS):
        held = [v[0] for v in kept._kept.values()]
        assert any(x is hot.manifest for x in held) and not any(x is cold.manifest for x in held)
