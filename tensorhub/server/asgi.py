"""The coordinator's HTTP shell below its routes (``coordinator.create_app`` adds them):
the leader gate, the gate that bounds the calls waiting for the state lock, the token and
body guard, and the fast paths that answer the hot calls without FastAPI's routing
(heartbeats, ``POST /v1/leases``, ``POST /v1/replicas``), each parsing its body with the
route's own request model so answers and errors are the route's.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import hmac
import logging
import re
import threading
import time
from typing import Any, Callable, Optional

from fastapi.responses import JSONResponse

from .._exceptions import (
    ConflictError, CoordinatorError, InvalidRequestError, NotFoundError, UnauthorizedError,
)
from .ahead import warm
from .core import NOT_LEADER, Coordinator, before_disk_wait
from ..protocol import Heartbeat, MAX_BODY_BYTES, AcquireLease, FetchReport, RegisterReplica, manifest_json
from ..protocol.answers import HeartbeatAnswer, ReplicaRegistered
from ..protocol.routes import ROUTES, gate_rank


logger = logging.getLogger("tensorhub.coordinator")  # (its records as before the split)


def _not_leader(coord: "Coordinator", scope: Any) -> JSONResponse:
    """A follower's answer: 307 to the same path on the leader, or 503 while none is known.
    Clients (``_client``) switch to the leader; ``curl -L`` follows it too."""
    leader = coord.leader_url()
    body = {"code": NOT_LEADER, "detail": "this coordinator is not the leader", "leader": leader}
    if leader is None:
        body["detail"] += "; no leader elected yet, retry"
        return JSONResponse(body, 503, headers={"Retry-After": "1"})
    qs = scope.get("query_string", b"")
    loc = leader + scope["path"] + (("?" + qs.decode("latin-1")) if qs else "")
    return JSONResponse(body, 307, headers={"Location": loc})


class _LeaderGate:
    """HA: a coordinator that does not lead answers every route but ``OPEN`` with
    ``_not_leader`` (``/healthz`` and ``/metrics`` answer on every coordinator). Sits inside
    ``_Guard``: unauthenticated requests learn nothing, not even who leads."""

    OPEN = ("/healthz", "/metrics", "/openapi.json", "/docs", "/redoc")

    def __init__(self, app: Any, coord: "Coordinator") -> None:
        self.app, self.coord = app, coord

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and not self.coord.leading() and scope["path"] not in self.OPEN:
            return await _not_leader(self.coord, scope)(scope, receive, send)
        await self.app(scope, receive, send)


#: Request bodies above this size are parsed one at a time (see ``_Guard``).
_LARGE_BODY = 1 << 20

#: The routes with fast paths here.
_LEASES, _REPLICAS = ROUTES["acquire_lease"], ROUTES["register_replica"]

#: How many gated calls run at once: a heartbeat arriving in a burst of a thousand readers'
#: calls waits for at most this many of them on the event loop, not for the whole burst
#: (the burst takes as long either way: its work is the same, one at a time).
GATE_SLOTS = 4


class _Gate:
    """``slots`` at a time; waiters by rank, then first come first served. A reader further
    along its read goes first: a burst's first readers get their leases and start fetching
    (and serving the others) while later ones still resolve, instead of every lease waiting
    for every resolve."""

    def __init__(self, slots: int) -> None:
        self.free = slots
        self._waiting: list[tuple[int, int, asyncio.Future]] = []
        self._seq = 0

    async def acquire(self, rank: int) -> None:
        if self.free > 0 and not self._waiting:
            self.free -= 1
            return
        fut = asyncio.get_running_loop().create_future()
        self._seq += 1
        heapq.heappush(self._waiting, (rank, self._seq, fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted as it was cancelled: pass it on
                self.release()
            raise

    def release(self) -> None:
        while self._waiting:
            _, _, fut = heapq.heappop(self._waiting)
            if not fut.done():
                fut.set_result(None)  # the slot goes to it directly
                return
        self.free += 1


class _Guard:
    """Token check and body limit before routing, as plain ASGI middleware (Starlette's
    ``@app.middleware("http")`` costs several times more per request).

    Bodies over ``_LARGE_BODY`` bytes are handled one at a time: parsing JSON takes about
    ten times its size in memory (a 48 MiB manifest of a million tiny tensors peaks near
    500 MiB before it is refused), so concurrent large requests cannot multiply that.

    The readers' and publishers' calls (``protocol.routes``: the routes with a ``gate``
    rank) pass a gate of ``GATE_SLOTS``
    (``_Gate``): the event loop runs ready requests first come first served, so without it
    a heartbeat that arrives just after a publish waits behind every reader's resolve,
    manifest GET and lease (1,024 readers: about a second of the loop); now behind at most
    ``GATE_SLOTS`` of them. Waiting at the gate costs the loop nothing."""

    def __init__(self, app: Any, expected: Optional[bytes], count: Optional[Callable[[str, str], None]] = None,
                 slots: int = GATE_SLOTS) -> None:
        self.app, self.expected, self.count = app, expected, count
        self._large = asyncio.Semaphore(1)
        self._gate = _Gate(slots) if slots > 0 else None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        auth = length = chunked = None
        for k, v in scope["headers"]:
            if k == b"authorization" and auth is None:
                auth = v
            elif k == b"content-length" and length is None:
                length = v
            elif k == b"transfer-encoding":
                chunked = v
        refuse = None
        if self.expected is not None and scope["path"] != "/healthz":
            if not hmac.compare_digest(auth or b"", self.expected):
                refuse = JSONResponse({"code": "unauthorized", "detail": "missing or wrong token"}, 401,
                                      headers={"WWW-Authenticate": "Bearer"})
        if refuse is None and length is not None:
            if not length.isdigit() or int(length) > MAX_BODY_BYTES:
                refuse = JSONResponse(
                    {"code": "too_large", "detail": f"request body over {MAX_BODY_BYTES} bytes"}, 413
                )
        elif refuse is None and chunked and scope["method"] in ("POST", "PUT", "PATCH"):
            refuse = JSONResponse({"code": "length_required", "detail": "send Content-Length"}, 411)
        if refuse is not None:
            return await refuse(scope, receive, send)
        if self.count is not None:  # ``tensorhub_requests_total{route}``: authenticated calls only
            self.count(scope["method"], scope["path"])
        rank = gate_rank(scope["method"], scope["path"]) if self._gate is not None else None
        inner = self.app if rank is None else functools.partial(self._gated, rank=rank)
        if length is not None and int(length) > _LARGE_BODY and not _held(scope):
            async with self._large:
                return await inner(scope, receive, send)
        await inner(scope, receive, send)

    async def _gated(self, scope: Any, receive: Any, send: Any, rank: int) -> None:
        """A gated call: its body is read first, and the slot is let go when the call
        waits for the disk (``before_disk_wait``) or its answer starts, so a client that
        sends its body slowly or does not read the answer, and a slow disk, hold no slot."""
        body = await _read_body(receive)  # every byte (an empty body is one message too)
        if body is None:
            return  # the client went away
        gate = self._gate
        assert gate is not None
        await gate.acquire(rank)
        held = True
        loop, on_loop = asyncio.get_running_loop(), threading.get_ident()

        def let_go() -> None:  # on the loop; from a route's worker thread, through the loop
            nonlocal held
            if not held:  # (a commit wait asks twice: on the loop, then in its thread)
                return
            if threading.get_ident() != on_loop:
                loop.call_soon_threadsafe(let_go)
                return
            held = False
            gate.release()

        async def answer(msg: dict) -> None:
            if msg["type"] == "http.response.start":
                let_go()
            await send(msg)

        token = before_disk_wait.set(let_go)  # the route's context (and its threads') sees it
        try:
            await self.app(scope, _replay(body, receive), answer)
        finally:
            before_disk_wait.reset(token)
            let_go()


def _held(scope: Any) -> bool:
    """A lease asked ahead (``?wait=``): held for up to a minute, so it takes no turn of the
    large bodies' one-at-a-time parsing (a publisher's registration would wait behind it)."""
    return (scope["method"] == _LEASES.method and scope["path"] == _LEASES.path
            and b"wait=" in scope.get("query_string", b""))


class _FastHeartbeat:
    """``POST /v1/workers/{id}/heartbeat`` without FastAPI's routing and validation.

    Heartbeats are most of a fleet's requests (10,000 workers every 2 s: 5,000/s), and
    while a worker fetches its progress rides on them (a body of fetch reports); this path
    costs a fraction of the route's CPU. Its answers are the route's: a body it cannot
    validate, and ids it does not accept, go to the route (which also keeps it in the
    OpenAPI document). It sits inside ``_Guard``: token and body checks first."""

    _PATH = re.compile(ROUTES["heartbeat"].path.replace("{worker_id}", "([A-Za-z0-9._:@+=-]{1,256})"))

    def __init__(self, app: Any, coord: Coordinator) -> None:
        self.app, self.coord = app, coord

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        m = self._PATH.fullmatch(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if m is None:
            return await self.app(scope, receive, send)
        reports: list[FetchReport] = []
        if _has_body(scope):  # fetch reports (``_Guard`` bounded its size)
            body = await _read_body(receive)
            if body is None:
                return
            try:
                reports = Heartbeat.model_validate_json(body).fetches
            except ValueError:  # the route answers it (422 as always)
                return await self.app(scope, _replay(body), send)
        wid = m.group(1)
        try:
            w = self.coord.call(lambda now: self.coord.state.heartbeat(now, wid), soft=True)
            resp = JSONResponse(_heartbeat_answer(self.coord, w, _record_all(self.coord, wid, reports))
                                .model_dump(exclude_unset=True))
        except CoordinatorError as e:
            resp = _not_leader(self.coord, scope) if e.code == NOT_LEADER else error_response(e)
        await resp(scope, receive, send)


async def _lease(coord: Coordinator, req: AcquireLease, wait: float) -> bytes:
    """``POST /v1/leases`` (the route, and ``_Leases``): the grant's JSON, ``{"pending":
    true}`` for a poll asked ahead that nothing answered in ``wait`` seconds; raises the
    refusal (CoordinatorError)."""
    if not req.ahead:
        grant = await coord.acall(lambda now: coord.state.acquire_lease(now, req))
        if grant.lease_id and grant.lease_id != req.lease_id:  # ("": a sliced version's layout, no lease)
            coord.metrics.leases_granted.labels(grant.model).inc()
        # Already a validated LeaseGrant: serialized once (response_model would re-validate it).
        return coord.lease_answers.encode(grant)
    rid = str(req.request_id)
    arrived = time.monotonic()
    fut = coord.subscribers.register(req.worker_id, rid, arrived) if req.request_id is not None else None
    try:
        grant = await coord.acall(lambda now: coord.state.subscribe(now, req, wait))
        if grant is None:
            assert fut is not None
            let_go = before_disk_wait.get()
            if let_go is not None:
                let_go()  # held: the gate's slot goes to the next call
            try:
                answer = await asyncio.wait_for(fut, wait)
            except asyncio.TimeoutError:
                answer = None
            if answer is None:
                return b'{"pending":true}'
            if isinstance(answer, CoordinatorError):
                raise answer
            coord.metrics.leases_granted.labels(req.model).inc()
            return answer
    finally:
        if fut is not None:
            coord.subscribers.forget(req.worker_id, rid, fut)
    coord.metrics.leases_granted.labels(grant.model).inc()
    return coord.lease_answers.encode(grant)


class _Leases:
    """``POST /v1/leases`` without FastAPI's routing and validation: every reader asks one
    per version (a subscriber's is held until the version is published, then answered in
    plan order, ``server.ahead``), so its fixed cost, paid on the event loop, is paid once per
    reader-version; at 1,024 subscribers the answers go out one after another. The body is
    parsed with the request model, ``wait`` read from the query; the answer is the route's
    (``_lease``), sent as two ASGI messages. A body or query this path cannot parse goes to
    the route (its 422 as always). Sits inside ``_Guard`` (token, size, the gate)."""

    def __init__(self, app: Any, coord: Coordinator) -> None:
        self.app, self.coord = app, coord

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if not (scope["type"] == "http" and scope["method"] == _LEASES.method and scope["path"] == _LEASES.path):
            return await self.app(scope, receive, send)
        wait = _wait_of(scope.get("query_string", b""))
        body = await _read_body(receive)
        if body is None:
            return
        try:
            req = None if wait is None else AcquireLease.model_validate_json(body)
        except ValueError:
            req = None
        if req is None:  # the route answers it (422 as always)
            return await self.app(scope, _replay(body, receive), send)
        try:
            answer = await _lease(self.coord, req, wait)  # type: ignore[arg-type]
        except CoordinatorError as e:
            resp = _not_leader(self.coord, scope) if e.code == NOT_LEADER else error_response(e)
            return await resp(scope, receive, send)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(answer))]})
        await send({"type": "http.response.body", "body": answer})


def _wait_of(query: bytes) -> Optional[float]:
    """``?wait=S`` of a lease request (0 without one), or None where the route must judge
    the query (several, not a number, out of 0..60)."""
    if not query:
        return 0.0
    waits = [v for k, _, v in (p.partition(b"=") for p in query.split(b"&")) if k == b"wait"]
    if not waits:
        return 0.0
    try:
        w = float(waits[0]) if len(waits) == 1 else None
    except ValueError:
        return None
    return w if w is not None and 0.0 <= w <= 60.0 else None


async def _register(coord: Coordinator, req: RegisterReplica) -> ReplicaRegistered:
    """``POST /v1/replicas`` (the route, and ``_Registration``)."""
    if req.release:  # a reader's last call of a read: release its leases, then register
        rid, complete, released = await coord.acall(lambda now: coord.state.release_and_register(now, req))
    else:
        (rid, complete), released = await coord.acall(lambda now: coord.state.register_replica(now, req)), None
    if rid and not req.partial:
        coord.metrics.registrations.labels(req.model, "like" if req.like is not None else
                                           "manifest" if req.manifest is not None else "digest").inc()
    logger.debug("replica %s: %s v%d layout %r shard %d/%d on worker %s%s", rid or "(not registered)",
                 req.model, req.version, req.layout, req.shard, req.num_shards, req.worker_id,
                 " (partial)" if req.partial else " (version complete)" if complete else "")
    return ReplicaRegistered(replica_id=rid, complete=complete,
                             **({"released": released} if released is not None else {}))


def _parse_registration(body: bytes, subscribed: Callable[[str], bool] = lambda model: False) -> RegisterReplica:
    """A large registration parsed and validated, and its manifest's canonical JSON made
    (kept for its digest and the store's commit), off the event loop; for a model with
    readers subscribed ahead (``subscribed(model)``), what binding them computes once per
    manifest too (``server.ahead.warm``)."""
    req = RegisterReplica.model_validate_json(body)
    if req.manifest is not None:
        manifest_json(req.manifest)
        if subscribed(req.model):
            warm(req.manifest)
    return req


class _Registration:
    """``POST /v1/replicas`` without FastAPI's routing and validation.

    A body over ``_LARGE_BODY`` (a publisher's replica: a 50,000-tensor manifest is 6-7 MB)
    is parsed and validated on a worker thread, not on the event loop: on the loop that
    took ~0.3-0.4 s at each publish, and every heartbeat and lease waited for it; on a
    thread the loop runs between the validators' steps. A smaller one (every reader's last
    call of a read: release + register, by digest; a partial replica) is parsed here, on
    the loop, which costs a fraction of the route's dependency machinery: at 1,024 readers
    ending a version together these calls queue at the coordinator one after the other
    (``benchmarks/bench_routes.py``, "complete + release"). The answer is the route's; a
    body that does not validate goes to the route (its 422 as always), as does one without
    a content-length. Sits inside ``_Guard`` (token, size, the gate: one slot for large
    bodies) and ``_LeaderGate``."""

    def __init__(self, app: Any, coord: Coordinator) -> None:
        self.app, self.coord = app, coord

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if not (scope["type"] == "http" and scope["method"] == _REPLICAS.method and scope["path"] == _REPLICAS.path):
            return await self.app(scope, receive, send)
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is None or not length.isdigit():
            return await self.app(scope, receive, send)
        body = await _read_body(receive)
        if body is None:
            return
        try:
            req = await asyncio.to_thread(_parse_registration, body,
                                          lambda model: self.coord.state.ahead.waits_on(model)) \
                if int(length) > _LARGE_BODY else \
                RegisterReplica.model_validate_json(body)
        except ValueError:  # the route answers it (422 as always)
            return await self.app(scope, _replay(body, receive), send)
        try:
            resp = JSONResponse((await _register(self.coord, req)).model_dump(exclude_unset=True))
        except CoordinatorError as e:
            resp = _not_leader(self.coord, scope) if e.code == NOT_LEADER else error_response(e)
        await resp(scope, receive, send)


async def _read_body(receive: Callable[[], Any]) -> Optional[bytes]:
    """A request's whole body (its chunks joined once), or None if the client went away."""
    parts, more = [], True
    while more:
        msg = await receive()
        if msg["type"] != "http.request":
            return None
        parts.append(msg.get("body", b""))
        more = msg.get("more_body", False)
    return b"".join(parts)


def _replay(body: bytes, rest: Optional[Callable[[], Any]] = None) -> Callable[[], Any]:
    """An ASGI ``receive`` that hands ``body`` over again (once read, a body is gone); then
    what ``rest`` (the connection's own ``receive``) says, or a disconnect."""
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if sent:
            return await rest() if rest is not None else {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


def record_fetch(coord: Coordinator, req: FetchReport) -> None:
    """A reader's fetch report (``POST /v1/fetches``, or in a heartbeat's body): recorded by
    the state machine, counted in ``/metrics`` and logged when the fetch ended."""
    by_distance = coord.call(lambda now: coord.state.record_fetch(now, req), soft=True)
    if req.state != "running":
        coord.metrics.fetch(req.model, req.state, by_distance, req.nbytes, req.seconds)
        gbps = req.nbytes / req.seconds / 1e9 if req.seconds > 0 else 0.0
        logger.log(logging.INFO if req.state == "ok" else logging.WARNING,
                   "fetch of %s v%d layout %r shard %d by %s %s: %.1f MB in %.3fs (%.2f GB/s) from %s%s",
                   req.model, req.version, req.layout, req.shard, req.worker_id, req.state,
                   req.nbytes / 1e6, req.seconds, gbps, dict(sorted(req.sources.items())[:8]),
                   f", {req.failed_sources} failed source(s)" if req.failed_sources else "")


def _record_all(coord: Coordinator, worker_id: str, reports: list[FetchReport]) -> int:
    """A heartbeat's fetch reports, recorded as ``POST /v1/fetches`` would; how many were."""
    done = 0
    for rep in reports:
        try:
            record_fetch(coord, rep)
            done += 1
        except CoordinatorError as e:  # an unknown model: telemetry only, the heartbeat stands
            logger.debug("fetch report of %s in a heartbeat not recorded: %s", worker_id, e)
    return done


def _has_body(scope: Any) -> bool:
    """More than an empty JSON object in the request's body (by its content-length)."""
    for k, v in scope.get("headers", ()):
        if k == b"content-length":
            return v.isdigit() and int(v) > 2
        if k == b"transfer-encoding":
            return True
    return False


def _accepts_gzip(scope: Any) -> bool:
    """Does the request's ``Accept-Encoding`` accept gzip (``gzip;q=0`` refuses it; ``*``
    counts when gzip is not named)?"""
    q: dict[str, bool] = {}
    for k, v in scope.get("headers", ()):
        if k == b"accept-encoding":
            for part in v.decode("latin-1").lower().split(","):
                name, _, params = part.partition(";")
                params = params.replace(" ", "")
                q[name.strip()] = not (params.startswith("q=") and _qzero(params[2:]))
    return q.get("gzip", q.get("*", False))


def _qzero(q: str) -> bool:
    try:
        return float(q) == 0.0
    except ValueError:
        return False


def _heartbeat_answer(coord: Coordinator, w: Any, fetches: int) -> HeartbeatAnswer:
    """The epoch, what the worker served since this coordinator started (its Hub turns
    these totals into its ``tensorhub_hub_served_*`` counters), and how many of the fetch
    reports the heartbeat carried were recorded."""
    return HeartbeatAnswer(epoch=coord.state.epoch, served_leases=w.served_leases, served_bytes=w.served_bytes,
                           fetches=fetches)


#: The HTTP status of each refusal of the state machine (which knows no HTTP); the first
#: class in an error's MRO listed here decides, anything else is a 500.
_HTTP_STATUS = {UnauthorizedError: 401, NotFoundError: 404, ConflictError: 409, InvalidRequestError: 422}


def error_response(e: CoordinatorError) -> JSONResponse:
    """The answer to a refused request: ``{"code", "detail"}`` with the refusal's status."""
    status = e.status or next((_HTTP_STATUS[c] for c in type(e).__mro__ if c in _HTTP_STATUS), 500)
    return JSONResponse({"code": e.code or "error", "detail": e.message}, status)
