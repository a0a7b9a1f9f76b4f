"""The coordinator's routes: the FastAPI application around a :class:`Coordinator`
(``tensorhub.server.core``), one handler per route of the table
(``tensorhub.protocol.routes.ROUTES``), each answering its model. The HTTP shell below them
(the leader gate, the call gate, the token and body guard, the fast paths for heartbeats,
leases and registrations) is ``tensorhub.server.asgi``; starting a server is
``tensorhub.coordinator``."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Optional

from fastapi import Body, FastAPI, Path as PathParam, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from .asgi import (
    GATE_SLOTS, _accepts_gzip, _FastHeartbeat, _Guard, _heartbeat_answer, _LeaderGate, _lease, _Leases,
    _not_leader, _record_all, _register, _Registration, error_response, record_fetch,
)
from .core import NOT_LEADER, Coordinator
from .._exceptions import CoordinatorError
from .fleet import add_routes as add_fleet_routes
from .views import version_view
from ..protocol import (Heartbeat, MAX_BODY_BYTES, MAX_NAME_LEN, MAX_SHARDS, MAX_VERSION, AcquireLease,
                       AllocateVersion, FetchReport, LeaseCovers, RegisterReplica, RegisterWorker, Report,
                       ReportChunks, Resolve, SwapReport, Unpublish)
from ..protocol.answers import (ChunksHeld, Done, Health, HeartbeatAnswer, Info, ModelEntry, ModelList, Released,
                               Renewed, ReplicaRegistered, Unpublished, VersionAnswer, VersionView, WorkerRegistered,
                               WorkerRemoved)
from ..protocol.routes import ROUTES

__all__ = ["create_app"]

logger = logging.getLogger("tensorhub.coordinator")


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
    async def healthz() -> Health:
        """Liveness, and the role: ``leader`` (always, on SQLite) or ``follower`` with the
        leader's URL (``null`` while an election runs)."""
        if coord.election is None:
            return Health(ok=True, epoch=coord.state.epoch, role="leader", leader=None)
        leading = coord.leading()
        return Health(ok=True, epoch=coord.state.epoch if leading else None,
                      role="leader" if leading else "follower", leader=coord.leader_url(), url=coord.election.url)

    @_on(app, "info")
    async def info() -> Info:
        c = coord.config
        return Info(epoch=coord.state.epoch, time=time.time(), lease_ttl=c.lease_ttl, worker_ttl=c.worker_ttl,
                    suspect_ttl=c.suspect_ttl, max_body_bytes=MAX_BODY_BYTES)

    @_on(app, "register_worker")
    async def register_worker(req: RegisterWorker) -> WorkerRegistered:
        coord.call(lambda now: st().register_worker(now, req.worker_id, req.endpoint, req.locality), soft=True)
        return WorkerRegistered(epoch=coord.state.epoch, worker_ttl=coord.config.worker_ttl,
                                lease_ttl=coord.config.lease_ttl, address_runs=True, lease_secrets=True,
                                ahead=True, register_like=True, slices_grant=True,
                                suspect_ttl=coord.config.suspect_ttl)

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
    def models() -> ModelList:
        return ModelList(coord.read(lambda: [ModelEntry(model=name, counter=m.counter, latest=st().latest(name))
                                             for name, m in sorted(st().models.items())]))

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
    async def report(req: Report, replica_id: str = _id()) -> Done:
        r = coord.call(lambda now: st().report(now, replica_id, req.worker_id, req.reason), soft=True)
        if r is not None:
            coord.metrics.source_failures.labels(r.model).inc()
        # %r: a reason with newlines or control characters cannot forge log lines
        logger.warning("replica %s (%s, %s v%s) reported failing by %s: %r", replica_id,
                       r.worker_id if r else "gone", r.model if r else "-", r.version if r else "-",
                       req.worker_id, req.reason)
        return Done()

    @_on(app, "report_chunks")
    async def report_chunks(req: ReportChunks, replica_id: str = _id()) -> ChunksHeld:
        """A partial replica's holder: these chunks are complete in its memory."""
        return ChunksHeld(held=coord.call(lambda now: st().add_chunks(now, replica_id, req.worker_id, req.chunks,
                                                                      req.lease_ids, req.coming), soft=True))

    @_on(app, "acquire_lease")
    async def acquire(req: AcquireLease, wait: float = Query(default=0.0, ge=0.0, le=60.0)) -> Response:
        """A read lease. Asked ahead (``req.ahead``, ``tensorhub.server.ahead``): held up to ``wait``
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
    async def fetch_report(req: FetchReport) -> Done:
        """A reader reports a fetch: while it runs (shown by ``status``) and when it ended
        (counted in ``/metrics``). Only models the coordinator knows are accepted. (Newer
        clients send these in their heartbeats' bodies.)"""
        record_fetch(coord, req)
        return Done()

    @_on(app, "report_swap")
    async def swap_report(req: SwapReport) -> Done:
        """An engine reports switching to a version: its stall feeds
        ``tensorhub_swap_stall_seconds``. Only models the coordinator knows are accepted."""
        coord.call(lambda now: st().record_swap(now, req), soft=True)
        coord.metrics.swap(req.model, req.stall, req.ok)
        logger.info("engine %s %s %s v%d: stall %.3fs%s", req.worker_id,
                    "swapped to" if req.ok else "failed to swap to", req.model, req.version, req.stall,
                    "" if req.fetch_seconds is None else f" (fetch {req.fetch_seconds:.3f}s"
                    + ("" if req.apply_seconds is None else f", apply {req.apply_seconds:.3f}s") + ")")
        return Done()

    add_fleet_routes(coord.fleets, lambda name: _on(app, name))

    @_on(app, "metrics", response_class=_PrometheusText,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    def metrics() -> Response:
        """Prometheus metrics (text exposition format). Needs the token like ``/v1``."""
        return _PrometheusText(coord.metrics.exposition())

    coord.metrics.known_routes((m, r.path) for r in app.routes for m in (getattr(r, "methods", None) or ()))
    return app
