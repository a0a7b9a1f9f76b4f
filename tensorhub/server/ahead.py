"""Subscribing ahead (issue 31 item 1): a reader that follows a model takes its serving lease
for the next version as soon as it holds the current one, before the next is published.

Why: readers that ask for their lease once a version is complete queue at the coordinator
(``benchmarks/bench_routes.py``: ~0.8 ms of its CPU per serving lease, plus the manifest),
so at 1,024 readers the last lease was answered 1.3 s after the first, most readers missed
the plan's forming window and joined as late carriers (``benchmarks/simulate.py``: 7.5x
the lower bound). A subscriber instead asks while the previous version is still being
used, with its destination (the reuse buffer) and chunk map as a serve offer; its request
is held (``POST /v1/leases?wait=S``, a long poll). When the version completes (the
publisher's replica registers), :func:`bind` runs in the same state call:

1. subscribers whose worker stopped heart-beating, or whose poll lapsed (not asked again
   within its ``wait`` + :data:`GRACE`), are dropped;
2. every other subscriber's offer is registered (its partial replica) and it joins the
   plan of its datacenter in arrival order (``Grants.join_ahead``); then each plan's layout
   is fixed at once (``server.stripes.Plan.fix``), with every subscriber in it: no forming
   window, no refresh to learn the fixed layout, nobody late;
3. once the version is durable, the HTTP shell makes each subscriber's grant in plan order
   (:func:`grant`: ``Grants.acquire_lease``, the usual answer from the fixed layout),
   encodes it and answers that held request at once, before the next grant is made
   (``server.core.Subscribers.stream``): the root's first children read while the last
   subscribers' grants are still being made.

A subscriber whose offer does not fit the version (its tensors differ: ``shape_digest``)
is granted a lease without a partial replica (``serve_refused`` says why) and reads the
version the usual way. One whose worker is unknown, or a version without that layout, gets
the error as its answer. Readers across datacenters (who seed theirs through a plan across
datacenters) are answered the usual way, after the home plans are fixed.

A subscriber whose offer fits is answered the version's checksums and meta with its grant
(``LeaseGrant.sums``): with the tensors it has, they make the version's manifest, so it
reads none. A reader's calls per version: this lease and the release that registers its
complete replica.

Pure, like ``server.state``: no I/O, no clock of its own; ``st`` is the ``CoordinatorState`` that
calls in (passed, not imported: it imports this module).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from .._exceptions import ConflictError, CoordinatorError, InvalidRequestError, NotFoundError
from .registry import ShardKey
from .grants import grid_of
from ..protocol import AcquireLease, LeaseGrant, Manifest, VersionSums, shape_digest

__all__ = ["GRACE", "MAX_PENDING", "Bound", "Sub", "Subscriptions", "subscribe", "bind", "grant", "warm"]

#: Seconds past a held poll's ``wait`` a subscription stays without being asked again
#: (the reader's next poll is on its way).
GRACE = 2.0
#: Subscriptions held at once (each keeps its reader's serve offer); past it, readers are
#: refused (``too_many_subscribers``) and read after the publish as before.
MAX_PENDING = 65_536


@dataclass
class Sub:
    req: AcquireLease
    since: float
    until: float


class Subscriptions:
    """The held subscriptions: (model, layout, shard) -> worker id -> :class:`Sub`, in
    arrival order (one per worker and shard; a new request of that worker replaces its
    old one and goes last, a poll asked again keeps its place)."""

    def __init__(self) -> None:
        self.pending: dict[tuple[str, str, int], dict[str, Sub]] = {}

    def __bool__(self) -> bool:
        return bool(self.pending)  # (an emptied shard's entry is always removed)

    def add(self, now: float, req: AcquireLease, wait: float) -> None:
        subs = self.pending.setdefault((req.model, req.layout, req.shard), {})
        old = subs.get(req.worker_id)
        if old is not None and old.req.request_id == req.request_id:
            old.until = now + wait + GRACE  # asked again: keeps its place
            return
        if old is not None:
            del subs[req.worker_id]
        elif self.held() >= MAX_PENDING:
            if not subs:
                del self.pending[(req.model, req.layout, req.shard)]
            raise ConflictError(f"{self.held()} readers already subscribe ahead; read after the publish",
                                "too_many_subscribers")
        subs[req.worker_id] = Sub(req, now, now + wait + GRACE)

    def take(self, model: str, version: int, now: float, alive) -> list[AcquireLease]:
        """Remove and return (arrival order) the subscriptions of ``model`` that ``version``
        answers, dropping those whose poll lapsed or whose worker is gone (``alive``)."""
        out: list[AcquireLease] = []
        for k in [k for k in self.pending if k[0] == model]:
            subs = self.pending[k]
            for wid in [w for w, s in subs.items() if s.req.version <= version]:
                s = subs.pop(wid)
                if now <= s.until and alive(wid):
                    out.append(s.req)
            if not subs:
                del self.pending[k]
        return out

    def expire(self, now: float) -> None:
        """Forget subscriptions whose poll lapsed (their readers went away)."""
        for k in list(self.pending):
            subs = self.pending[k]
            for wid in [w for w, s in subs.items() if now > s.until]:
                del subs[wid]
            if not subs:
                del self.pending[k]

    def drop_worker(self, worker_id: str) -> None:
        for k in list(self.pending):
            if self.pending[k].pop(worker_id, None) is not None and not self.pending[k]:
                del self.pending[k]

    def held(self) -> int:
        return sum(len(subs) for subs in self.pending.values())

    def waits_on(self, model: str) -> bool:
        """Does a subscription wait for a version of ``model``? Read without the state's lock
        (by the registration's parse thread, :func:`warm`): a race only makes it warm a
        manifest up for nothing, or not."""
        try:
            return any(k[0] == model for k in self.pending)
        except RuntimeError:  # (changed while read)
            return True


def warm(manifest: Manifest) -> None:
    """Make what binding subscribers to a version of this manifest computes once per
    manifest -- its shape digest (each offer is named by it), its chunk grid -- ahead,
    off the event loop: the registration's parse thread calls this for a model with
    subscribers, so the call that completes the version and binds them does not (~50 ms
    of its fixed cost for 50,000 tensors; ``benchmarks/bench_routes.py --only ahead``)."""
    shape_digest(manifest)
    grid_of(manifest)


def subscribe(st: Any, now: float, req: AcquireLease, wait: float) -> Optional[LeaseGrant]:
    """A lease asked ahead: answered at once (a grant) when a complete version >=
    ``req.version`` exists or this request was bound already, else held (None): the
    subscription waits for :func:`bind`."""
    if req.request_id is None or not req.pipelined:
        raise InvalidRequestError("a lease asked ahead needs request_id and pipelined")
    hit = st.grants.lease_requests.get((req.worker_id, req.request_id))
    if hit is not None:
        lease = st.leases.get(hit[0])
        if lease is not None and lease.expires >= now:  # bound while the reader was between two polls
            return hit[1].model_copy(update={"granted_after": min(0.0, lease.granted_at - now)})
    st._worker(req.worker_id)
    if req.model not in st.models:
        raise NotFoundError(f"unknown model {req.model!r}", "unknown_model")
    newest = st.latest(req.model)
    if newest is not None and newest >= req.version:
        at, refused = at_version(st, req, newest)
        return granted(st, at, st.acquire_lease(now, at), refused)
    st.ahead.add(now, req, wait)
    return None


def sums_of(st: Any, at: AcquireLease) -> Optional[VersionSums]:
    """The checksums and meta of the version ``at`` names, for a reader whose offer fits it."""
    if at.serve is None:
        return None
    m = st.manifest(at.model, at.version, at.layout, at.shard)
    return VersionSums.model_construct(checksum=m.checksum, checksums=m.checksums, meta=m.meta)


def at_version(st: Any, req: AcquireLease, version: int) -> tuple[AcquireLease, str]:
    """The subscription as an ordinary lease request on ``version``, and why its offer was
    dropped ("" if not): kept (named by the version's real manifest digest) when its
    tensors are the version's. Raises when the version lacks the layout."""
    man = st.manifest(req.model, version, req.layout, req.shard)
    serve, refused = req.serve, ""
    if serve is not None:
        if serve.manifest_digest == shape_digest(man):
            serve = serve.model_copy(update={"manifest_digest": st.digest_of(req.model, version, req.layout,
                                                                              req.shard, man)})
        else:
            serve, refused = None, (f"the tensors of {req.model!r} v{version} differ from the ones this reader "
                                    "offered to receive them into")
    return req.model_copy(update={"version": version, "ahead": False, "serve": serve}), refused


def granted(st: Any, at: AcquireLease, grant: LeaseGrant, refused: str) -> LeaseGrant:
    """The grant with the version's checksums for a reader whose offer fits (it needs no
    manifest), or saying why the offer was dropped; kept so for a poll asked again."""
    update = {"serve_refused": refused} if refused else {"sums": sums_of(st, at)}
    if not refused and update["sums"] is None:
        return grant
    grant = grant.model_copy(update=update)
    st.grants.lease_requests[(at.worker_id, str(at.request_id))] = (grant.lease_id, grant)
    return grant


#: A bound subscriber: (its lease request on the version, why its offer was dropped or ""),
#: its grant to be made by :func:`grant`; or the error it is answered with.
Bound = Union[tuple[AcquireLease, str], CoordinatorError]


def bind(st: Any, now: float, models: set) -> list[tuple[str, str, Bound]]:
    """Versions of ``models`` just completed: bind the subscriptions they satisfy (module
    docstring): offers registered, every subscriber in its plan, the layouts fixed. Returns
    (worker id, request id, what to grant or the error) in plan order; the grants are made
    one by one by :func:`grant` (the coordinator's shell streams them, answering each as it
    is made, once the version is durable)."""
    out: list[tuple[str, str, Bound]] = []
    for model in sorted(models):
        newest = st.latest(model)
        if newest is None:
            continue
        due = st.ahead.take(model, newest, now, lambda w: w in st.workers)
        if not due:
            continue
        reqs: list[tuple[AcquireLease, AcquireLease, str]] = []
        plans: dict[tuple, object] = {}
        for r in due:
            try:
                at, refused = at_version(st, r, newest)
            except CoordinatorError as e:
                out.append((r.worker_id, str(r.request_id), e))
                continue
            reqs.append((r, at, refused))
            pk = st.join_ahead(now, at)
            if pk is not None:
                plans[pk] = st.grants.plans[pk]
        for plan in plans.values():
            plan.fix()  # type: ignore[attr-defined]
        first = [x for x in reqs if st.grants.plan_of.get((_key(x[1]), x[0].worker_id)) in plans]
        rest = [x for x in reqs if st.grants.plan_of.get((_key(x[1]), x[0].worker_id)) not in plans]
        first.sort(key=lambda x: _order(st, x[1], x[0].worker_id))
        out += [(r.worker_id, str(r.request_id), (at, refused)) for r, at, refused in first + rest]
    return out


def grant(st: Any, now: float, at: AcquireLease, refused: str) -> LeaseGrant:
    """The grant of one bound subscriber (``bind``): the usual grant, made from its plan's
    fixed layout (its offer was registered when it joined)."""
    try:
        return granted(st, at, st.acquire_lease(now, at), refused)
    finally:
        st.grants.joined.pop((_key(at), at.worker_id), None)


def _key(req: AcquireLease) -> tuple:
    return ShardKey(req.model, req.version, req.layout, req.shard)


def _order(st: Any, req: AcquireLease, worker: str) -> int:
    """A member's place in its plan (arrival order): the order its answer is sent in."""
    pk = st.grants.plan_of.get((_key(req), worker))
    plan = st.grants.plans.get(pk) if pk is not None else None
    return plan.order.get(worker, 0) if plan is not None else 0  # type: ignore[attr-defined]
