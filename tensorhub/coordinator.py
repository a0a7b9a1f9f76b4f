"""The coordinator service: a thin HTTP shell around :class:`Coordinator` (``_coordinator``:
the state machine, its store, lock, clock and leadership).

Run it as ``tensorhub coordinator --host 127.0.0.1 --port 0 --state-dir DIR``, or embed it
in a process with :class:`EmbeddedCoordinator` (the demo does). Every request takes one
lock, asks the state machine, commits the durable writes to SQLite, then answers.
Its clock is ``time.monotonic()``: a wall-clock step of either sign changes no lease,
liveness or drain answer (the state machine also never lets time move back). The API is versioned under ``/v1``; ``/openapi.json``
describes it. With a token configured every endpoint but ``/healthz`` needs
``Authorization: Bearer <token>`` (compared in constant time, never logged).

``GET /metrics`` serves Prometheus metrics (``tensorhub._metrics.CoordinatorMetrics``),
under the same token rule: a scraper sends the token as a bearer token (Prometheus:
``authorization: {credentials_file: FILE}`` in the scrape config). Metrics name models
and count workers, which the token keeps from whoever else reaches the port; with no
token configured it is open like every other route.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from fastapi import Body, FastAPI, Path as PathParam, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from ._asgi import (
    GATE_SLOTS, _accepts_gzip, _FastHeartbeat, _Guard, _heartbeat_answer, _LeaderGate, _lease, _Leases,
    _not_leader, _record_all, _register, _Registration, error_response, record_fetch,
)
from ._exceptions import ConfigError, CoordinatorError
from ._coordinator import NOT_LEADER, Coordinator, ha_coordinator
from ._fleet import add_routes as add_fleet_routes
from ._state import StateConfig
from ._views import version_view
from .protocol import (Heartbeat, MAX_BODY_BYTES, MAX_NAME_LEN, MAX_SHARDS, MAX_VERSION, AcquireLease,
                       AllocateVersion, FetchReport, LeaseCovers, RegisterReplica, RegisterWorker, Report,
                       ReportChunks, Resolve, SwapReport, Unpublish)
from .protocol.answers import (ChunksHeld, HeartbeatAnswer, Released, Renewed, ReplicaRegistered, Unpublished,
                               VersionAnswer, VersionView, WorkerRegistered, WorkerRemoved)
from .protocol.routes import ROUTES

__all__ = ["Coordinator", "EmbeddedCoordinator", "create_app", "serve", "ha_coordinator", "listen_socket",
           "socket_url"]

logger = logging.getLogger(__name__)

# FastAPI binds a Path() object to the first parameter that uses it: make one per use.
def _model() -> Any:
    return PathParam(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9._:@+=-]+$")


def _id() -> Any:
    return PathParam(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9._:@/+=-]+$")


def _version() -> Any:
    return PathParam(ge=1, le=MAX_VERSION)



def _on(app: FastAPI, name: str, **kw: Any) -> Callable:
    """Register a route of the table (``protocol.routes.ROUTES[name]``): its method and path,
    and its answer model, which FastAPI checks every answer of it against (the keys the
    handler set: an answer's JSON is what it was) and the OpenAPI document shows."""
    r = ROUTES[name]
    if r.answer is not None:
        kw.setdefault("response_model", r.answer)
        kw.setdefault("response_model_exclude_unset", True)
    return app.api_route(r.path, methods=[r.method], **kw)


class _PrometheusText(Response):
    media_type = "text/plain; version=0.0.4; charset=utf-8"


def create_app(coord: Coordinator, token: Optional[str] = None, call_slots: Optional[int] = None) -> FastAPI:
    """The FastAPI application serving ``coord``.

    Routes are ``async``: they run on the event loop and hold the lock for microseconds to
    a millisecond; a call that must wait for a commit waits on a thread (``acall``), not on
    the loop. The views that build large answers (status, a version's view, models) stay
    plain functions, which FastAPI runs on its thread pool. (Readers' registrations once
    ran there too: a burst of them from several threads took the interpreter's lock from
    the event loop for tens of milliseconds at a time, and heartbeats waited.)"""
    app = FastAPI(
        title="TensorHub coordinator",
        version="1",
        description="Which workers hold which version of which model; read leases; versions.",
    )
    expected = f"Bearer {token}".encode() if token else None

    app.add_middleware(_FastHeartbeat, coord=coord)
    app.add_middleware(_Registration, coord=coord)
    app.add_middleware(_Leases, coord=coord)
    if coord.election is not None:
        app.add_middleware(_LeaderGate, coord=coord)
    app.add_middleware(_Guard, expected=expected, count=coord.metrics.request,  # added last: outermost
                       slots=GATE_SLOTS if call_slots is None else call_slots)

    @app.exception_handler(CoordinatorError)
    async def _coordinator_error(request: Request, exc: CoordinatorError) -> JSONResponse:
        if exc.code == NOT_LEADER:
            return _not_leader(coord, request.scope)
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        parts = []
        for e in errs[:5]:
            loc = ".".join(str(x) for x in e.get("loc", ()))
            parts.append(f"{loc}: {e.get('msg', 'invalid')}")
        more = f" (+{len(errs) - 5} more)" if len(errs) > 5 else ""
        return JSONResponse({"code": "invalid_request", "detail": "; ".join(parts) + more}, 422)

    st = lambda: coord.state  # noqa: E731 - the state object is replaced on reload

    @_on(app, "healthz")
    async def healthz() -> dict:
        """Liveness, and the role: ``leader`` (always, on SQLite) or ``follower`` with the
        leader's URL (``null`` while an election runs)."""
        if coord.election is None:
            return {"ok": True, "epoch": coord.state.epoch, "role": "leader", "leader": None}
        leading = coord.leading()
        return {"ok": True, "epoch": coord.state.epoch if leading else None,
                "role": "leader" if leading else "follower", "leader": coord.leader_url(),
                "url": coord.election.url}

    @_on(app, "info")
    async def info() -> dict:
        c = coord.config
        return {"epoch": coord.state.epoch, "time": time.time(), "lease_ttl": c.lease_ttl,
                "worker_ttl": c.worker_ttl, "suspect_ttl": c.suspect_ttl, "max_body_bytes": MAX_BODY_BYTES}

    @_on(app, "register_worker")
    async def register_worker(req: RegisterWorker) -> WorkerRegistered:
        coord.call(lambda now: st().register_worker(now, req.worker_id, req.endpoint, req.locality), soft=True)
        return WorkerRegistered(epoch=coord.state.epoch, worker_ttl=coord.config.worker_ttl,
                                lease_ttl=coord.config.lease_ttl, address_runs=True, lease_secrets=True,
                                ahead=True, register_like=True, suspect_ttl=coord.config.suspect_ttl)

    @_on(app, "heartbeat")
    async def heartbeat(worker_id: str = _id(), req: Optional[Heartbeat] = Body(default=None)) -> HeartbeatAnswer:
        """A worker is alive; its body (optional) carries its fetch reports since the last
        one (progress folded into heartbeats), recorded as ``POST /v1/fetches`` would."""
        w = coord.call(lambda now: st().heartbeat(now, worker_id), soft=True)
        return _heartbeat_answer(coord, w, _record_all(coord, worker_id, req.fetches if req else []))

    @_on(app, "remove_worker")
    async def remove_worker(worker_id: str = _id()) -> WorkerRemoved:
        n = coord.call(lambda now: st().remove_worker(now, worker_id), soft=True)
        return WorkerRemoved(replicas_dropped=n)

    @_on(app, "models")
    def models() -> list:
        return coord.read(lambda: [
            {"model": name, "counter": m.counter, "latest": st().latest(name)}
            for name, m in sorted(st().models.items())
        ])

    @_on(app, "allocate_version")
    async def allocate(model: str = _model(), req: AllocateVersion = Body(default=AllocateVersion())) -> VersionAnswer:
        return VersionAnswer(version=await coord.acall(lambda now: st().allocate_version(now, model, req.version,
                                                                                          req.request_id)))

    @_on(app, "latest")
    async def latest(
        model: str = _model(),
        newer_than: Optional[int] = Query(default=None, ge=0, le=MAX_VERSION),
        wait: float = Query(default=0.0, ge=0.0, le=60.0),
    ) -> VersionAnswer:
        """Newest complete version (``null`` if none). With ``wait``, hold the request up
        to that many seconds until a version newer than ``newer_than`` is complete."""
        deadline = time.monotonic() + wait
        while True:
            woken = coord.watch.register(model)  # before reading: a publish in between wakes it
            try:
                v = await coord.aread(lambda: st().latest(model, newer_than))
                left = deadline - time.monotonic()
                if v is not None or left <= 0:
                    return VersionAnswer(version=v)
                await asyncio.wait_for(woken, left)
            except asyncio.TimeoutError:
                pass
            finally:
                coord.watch.forget(model, woken)

    @_on(app, "resolve")
    async def resolve(model: str = _model(), req: Resolve = Body(default=Resolve())) -> VersionAnswer:
        return VersionAnswer(version=await coord.acall(lambda now: st().resolve(now, model, req.group,
                                                                                 req.newer_than)))

    @_on(app, "register_replica")
    async def register_replica(req: RegisterReplica) -> ReplicaRegistered:
        return await _register(coord, req)

    @_on(app, "version")
    def version_info(model: str = _model(), version: int = _version()) -> VersionView:
        """One version now: complete or not, its layouts, its replicas (``VersionView``)."""
        return coord.read(lambda: version_view(st(), coord.clock(), model, version))

    @_on(app, "manifest")
    async def manifest(request: Request, model: str = _model(), version: int = _version(),
                       layout: str = Query(default="hf", min_length=1, max_length=MAX_NAME_LEN,
                                           pattern=r"^[^\x00-\x1f\x7f]+$"),
                       shard: int = Query(default=0, ge=0, lt=MAX_SHARDS)) -> Response:
        """The tensors (names, dtypes, shapes, sizes) of one shard of a version's layout.
        Gzipped when the client accepts it and the manifest is large."""
        man = await coord.aread(lambda: st().manifest(model, version, layout, shard))  # refusals as always
        enc = await coord.manifests.aget((model, version, layout, shard), man)  # encoded once per shard
        if enc.gzip is not None and _accepts_gzip(request.scope):
            return Response(enc.gzip, media_type="application/json",
                            headers={"Content-Encoding": "gzip", "Vary": "Accept-Encoding"})
        return Response(enc.json, media_type="application/json",
                        headers={"Vary": "Accept-Encoding"} if enc.gzip is not None else None)

    @_on(app, "unpublish")
    async def unpublish(req: Unpublish, model: str = _model(), version: int = _version()) -> Unpublished:
        drained, open_ = await coord.acall(lambda now: st().unpublish(now, req.worker_id, model, version,
                                                                 req.replica_ids))
        if drained:
            logger.info("worker %s unpublished %s v%d", req.worker_id, model, version)
        return Unpublished(drained=drained, open_leases=open_)

    @_on(app, "report_replica")
    async def report(req: Report, replica_id: str = _id()) -> dict:
        r = coord.call(lambda now: st().report(now, replica_id, req.worker_id, req.reason), soft=True)
        if r is not None:
            coord.metrics.source_failures.labels(r.model).inc()
        # %r: a reason with newlines or control characters cannot forge log lines
        logger.warning("replica %s (%s, %s v%s) reported failing by %s: %r", replica_id,
                       r.worker_id if r else "gone", r.model if r else "-", r.version if r else "-",
                       req.worker_id, req.reason)
        return {}

    @_on(app, "report_chunks")
    async def report_chunks(req: ReportChunks, replica_id: str = _id()) -> ChunksHeld:
        """A partial replica's holder: these chunks are complete in its memory."""
        return ChunksHeld(held=coord.call(lambda now: st().add_chunks(now, replica_id, req.worker_id, req.chunks,
                                                                      req.lease_ids, req.coming), soft=True))

    @_on(app, "acquire_lease")
    async def acquire(req: AcquireLease, wait: float = Query(default=0.0, ge=0.0, le=60.0)) -> Response:
        """A read lease. Asked ahead (``req.ahead``, ``tensorhub._ahead``): held up to ``wait``
        seconds until a complete version >= ``req.version`` exists; ``{"pending": true}``
        if none came (ask again with the same ``request_id``: the place is kept).
        (``_Leases`` answers it without FastAPI's routing; this route keeps it in the
        OpenAPI document and answers what that path refuses to parse, with the 422.)"""
        return Response(await _lease(coord, req, wait), media_type="application/json")

    @_on(app, "renew_lease")
    async def renew(lease_id: str = _id()) -> Renewed:
        return Renewed(ttl=coord.call(lambda now: st().renew_lease(now, lease_id), soft=True))

    @_on(app, "release_lease")
    async def release(lease_id: str = _id()) -> Released:
        return Released(valid=coord.call(lambda now: st().release_lease(now, lease_id), soft=True))

    @_on(app, "lease_covers")
    async def covers(req: LeaseCovers, lease_id: str = _id()) -> Released:
        # same-host reads (transport/_shm): may this reader, which proved its lease, map
        # that replica's memory? (A POST: the proof stays out of URLs. Older holders' GET
        # finds no route: they hand out nothing, and their readers read over Mooncake.)
        return Released(valid=coord.call(lambda now: st().lease_covers(now, lease_id, req.replica_id, req.worker_id,
                                                                       req.proof, req.endpoint), soft=True))

    @_on(app, "status")
    def status() -> dict:
        out = coord.read(lambda: st().status(coord.clock()))
        out["fleets"] = coord.fleets.views()
        if coord.election is not None:
            me = coord.election.url
            try:
                members = coord.election.members()
            except Exception:  # etcd briefly unreachable: still answer what this one knows
                members = [me]
            out["coordinators"] = {"leader": me, "followers": [u for u in members if u != me]}
        return out

    @_on(app, "report_fetch")
    async def fetch_report(req: FetchReport) -> dict:
        """A reader reports a fetch: while it runs (shown by ``status``) and when it ended
        (counted in ``/metrics``). Only models the coordinator knows are accepted. (Newer
        clients send these in their heartbeats' bodies.)"""
        record_fetch(coord, req)
        return {}

    @_on(app, "report_swap")
    async def swap_report(req: SwapReport) -> dict:
        """An engine reports switching to a version: its stall feeds
        ``tensorhub_swap_stall_seconds``. Only models the coordinator knows are accepted."""
        coord.call(lambda now: st().record_swap(now, req), soft=True)
        coord.metrics.swap(req.model, req.stall, req.ok)
        logger.info("engine %s %s %s v%d: stall %.3fs%s", req.worker_id,
                    "swapped to" if req.ok else "failed to swap to", req.model, req.version, req.stall,
                    "" if req.fetch_seconds is None else f" (fetch {req.fetch_seconds:.3f}s"
                    + ("" if req.apply_seconds is None else f", apply {req.apply_seconds:.3f}s") + ")")
        return {}

    add_fleet_routes(coord.fleets, lambda name: _on(app, name))

    @_on(app, "metrics", response_class=_PrometheusText,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    def metrics() -> Response:
        """Prometheus metrics (text exposition format). Needs the token like ``/v1``."""
        return _PrometheusText(coord.metrics.exposition())

    coord.metrics.known_routes((m, r.path) for r in app.routes for m in (getattr(r, "methods", None) or ()))
    return app


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening, non-blocking TCP socket on ``host:port`` (port 0: a free one), for uvicorn
    (``sockets=[...]``): bound before the server starts, so its URL is known at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def socket_url(host: str, sock: socket.socket, tls: bool) -> str:
    """The URL a server on ``sock`` (``listen_socket``) answers at."""
    port = sock.getsockname()[1]
    h = f"[{host}]" if ":" in host else host
    return f"{'https' if tls else 'http'}://{h}:{port}"


class _Server:
    """uvicorn on a pre-bound socket, plus the expiry ticker."""

    def __init__(self, coord: Coordinator, host: str, port: int, token: Optional[str],
                 ssl_certfile: Optional[str] = None, ssl_keyfile: Optional[str] = None,
                 sock: Optional[socket.socket] = None, call_slots: Optional[int] = None) -> None:
        import uvicorn

        self.coord = coord
        self.sock = listen_socket(host, port) if sock is None else sock
        self.url = socket_url(host, self.sock, ssl_certfile is not None)
        cfg = uvicorn.Config(
            create_app(coord, token, call_slots), log_level="warning", access_log=False,
            ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile, timeout_keep_alive=30,
        )
        self.server = uvicorn.Server(cfg)
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="tensorhub-expiry", daemon=True)

    def _tick(self) -> None:
        period = min(1.0, self.coord.config.worker_ttl / 4)
        while not self._stop.wait(period):
            try:
                self.coord.expire()
            except Exception:  # pragma: no cover - keep serving
                logger.exception("expiry tick failed")

    def run(self) -> None:
        self._ticker.start()
        try:
            self.server.run(sockets=[self.sock])
        finally:
            self._stop.set()


def serve(host: str, port: int, state_dir: Optional[str | os.PathLike], *, token: Optional[str] = None,
          config: StateConfig = StateConfig(), ssl_certfile: Optional[str] = None,
          ssl_keyfile: Optional[str] = None, on_ready: Callable[[str], None] = print,
          store: Optional[str] = None, advertise_url: Optional[str] = None, election_ttl: float = 2.0,
          etcd_ca_file: Optional[str] = None, etcd_cert_file: Optional[str] = None,
          etcd_key_file: Optional[str] = None, call_slots: Optional[int] = None) -> None:
    """Run the coordinator in the foreground until SIGINT/SIGTERM.

    ``store``: ``None``/``"sqlite"`` (a file in ``state_dir``) or ``etcd://h:p[,h:p...]``
    (highly available: one of several coordinators leads; ``advertise_url`` is how
    clients reach this one, default the URL it serves on)."""
    if store is None or store == "sqlite":
        if state_dir is None:
            raise ConfigError("the SQLite store needs --state-dir")
        coord = Coordinator(state_dir, config)
        srv = _Server(coord, host, port, token, ssl_certfile, ssl_keyfile, call_slots=call_slots)
    else:
        sock = listen_socket(host, port)
        url = advertise_url or socket_url(host, sock, ssl_certfile is not None)
        if advertise_url is None and host in ("0.0.0.0", "::", ""):
            raise ConfigError(f"listening on {host!r}: pass --advertise-url (the URL clients reach this one at)")
        coord = ha_coordinator(store, url, config, election_ttl=election_ttl, etcd_ca_file=etcd_ca_file,
                               etcd_cert_file=etcd_cert_file, etcd_key_file=etcd_key_file)
        srv = _Server(coord, host, port, token, ssl_certfile, ssl_keyfile, sock=sock, call_slots=call_slots)
    # This process is ours: keep what exists now (modules, the app, restored state) out of
    # the cycle collector's scans, and collect young objects less often. Full collections
    # otherwise stall every request for 20-80 ms every few seconds under load.
    # Our own process: leave out prometheus_client's *_created series (one per counter, noise
    # for a scraper that already sees the process start time metric).
    from prometheus_client import disable_created_metrics

    disable_created_metrics()
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)
    if coord.election is not None:
        # uvicorn re-raises SIGTERM once it has shut down; with the default handler the process
        # would die before ``close()`` revokes the leader's lease (a follower would then wait
        # out the ttl instead of taking over at once). Exit through ``finally`` instead.
        import signal

        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    on_ready(srv.url)
    try:
        srv.run()
    finally:
        coord.close()


class EmbeddedCoordinator:
    """A coordinator on a background thread of this process (demos, tests, single-node jobs).

    ``start()`` returns the URL; ``stop()`` shuts it down. Also a context manager.
    """

    def __init__(self, state_dir: str | os.PathLike, *, host: str = "127.0.0.1", port: int = 0,
                 token: Optional[str] = None, config: StateConfig = StateConfig()) -> None:
        self.state_dir = Path(state_dir)
        self.host, self.port, self.token, self.config = host, port, token, config
        self.url: Optional[str] = None
        self._srv: Optional[_Server] = None
        self._thread: Optional[threading.Thread] = None

    def start(self) -> str:
        coord = Coordinator(self.state_dir, self.config)
        self._srv = _Server(coord, self.host, self.port, self.token)
        self._thread = threading.Thread(target=self._srv.run, name="tensorhub-coordinator", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._srv.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("embedded coordinator did not start")
            time.sleep(0.01)
        self.url = self._srv.url
        return self.url

    @property
    def coordinator(self) -> Coordinator:
        assert self._srv is not None, "start() first"
        return self._srv.coord

    def stop(self) -> None:
        if self._srv is None:
            return
        self._srv.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._srv.coord.close()
        self._srv = None

    def __enter__(self) -> "EmbeddedCoordinator":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
