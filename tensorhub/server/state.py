"""The coordinator's decisions, as a pure state machine.

No I/O and no clock: every method takes ``now`` (seconds on a monotonic clock: the
coordinator passes ``time.monotonic()``) and either returns its decision or raises a
:class:`CoordinatorError` subclass (the HTTP shell picks the status it answers with).
The state is two parts and the decisions over both:

- the durable **catalog** (``server.catalog``: models, version counters, versions, layouts,
  manifests). Its changes are queued as *writes*; the shell commits them
  (``take_writes()``) to its store before it answers, so nothing a client was told is
  lost by a restart; ``CoordinatorState.restore(rows)`` rebuilds it after one;
- the soft **registry** (``server.registry``: workers, replicas, leases, tombstones, indexed
  by shard key, worker and replica). It starts empty after a restart and is
  re-registered by the clients.

Invariants this module keeps (DESIGN.md, "Protocol and its invariants"):

1. ``latest`` only returns versions whose layout has a manifest for every shard, i.e.
   every shard has had a replica ("complete").
2. A replica being unpublished gets no new leases and is removed only once no unexpired
   lease names it; after a restart, not before ``boot + lease_ttl`` (leases granted by
   the previous incarnation have lapsed by then).
3. Releasing a lease answers whether it stayed valid (unexpired) for the whole read.
4. Version numbers only grow; an explicit version below the counter must already exist.
5. The first manifest registered for (model, version, layout, shard) is final; a
   different one is refused naming the first difference.
6. Unpublishing the last replica of a model's newest complete version is refused.
7. All ranks resolving with the same ``group`` get the same version.
8. Fencing across expiry: when a worker is dropped (expired, closed, or re-registered
   with a new endpoint), each of its replicas that an unlapsed lease still names stays as
   a *tombstone*: never offered again, but counted by ``unpublish``'s drain of that
   worker's (model, version), so a holder that comes back never gets "drained" while a
   reader still reads its memory. Tombstones go once no unlapsed lease names them.
9. Time only moves forward: ``now`` is clamped to the largest value seen (a lease once
   seen lapsed stays lapsed). A gap longer than ``pause_grace`` between two calls (the
   coordinator was paused or starved) gives every worker a fresh ``worker_ttl`` instead
   of expiring all of them at once.
10. Retries are idempotent: an allocation or a lease asked for again with the same
    ``request_id`` gets the first answer (allocations durably, so across a restart).
11. A version that is not the newest complete one and that nobody serves or can serve
    again (no replica, partial replica, tombstone or open lease of the shard; not within
    a restart's re-registration window) is refused with ``version_gone`` at once.
12. A partial replica (a reader still receiving, pipelined replication) is offered only to
   pipelined readers and only for chunks its holder reported complete under a lease that
   was valid at that moment; it never counts for completeness or retention. Source
   choice and seeding are ``_planner``'s pure functions.
13. A worker's removal (expiry, close, a new endpoint) never ends its read leases: each
    stays, counted by ``unpublish``, until released or lapsed on this clock (a reader cut
    off from the coordinator still trusts it up to 0.98 x ``lease_ttl``).
14. Retention never retires a version that is allocated and not yet complete (a publish in
    progress) until it is abandoned: nothing names it and ``abandon_after`` passed since its
    allocation (or this incarnation's start). A retried allocation whose request id names a
    retired number is refused (``version_retired``), never answered with it.

Observability (no decision depends on it): readers report their fetches
(``record_fetch``: live progress while running, bytes per source at the end) and engines
their swaps (``record_swap``); each worker's served leases and bytes are counted here and
answered on its heartbeat; ``metrics_view`` is what ``/metrics`` shows of the state.
"""

from __future__ import annotations

import hmac
import itertools
import secrets
from typing import Iterable, Optional

from .. import _addresses
from . import ahead as _ahead
from .catalog import ALLOCATIONS_KEPT, Catalog, LayoutInfo, ModelInfo, VersionInfo, Write
from .._exceptions import ConflictError, NotFoundError, RetentionError
from .grants import Grants
from .manifest_refs import ManifestRefs
from .._planner import locality_cost
from .registry import Lease, Registry, Replica, ShardKey, Worker
from .state_config import StateConfig
from .views import FETCH_STALE, metrics_view, record_fetch, status_view
from ..protocol import (AcquireLease, FetchReport, LeaseGrant, Locality, Manifest, RegisterReplica, SwapReport,
                       is_delta_layout, lease_proof)

__all__ = ["StateConfig", "CoordinatorState", "Write", "ShardKey"]

# Re-exported: the types the state is made of (tests and the shell name them here).
_ = (ALLOCATIONS_KEPT, LayoutInfo, ModelInfo, VersionInfo, Lease, Replica, Worker, locality_cost)

#: Most versions one retention pass retires (the rest on the next tick).
RETIRE_PER_TICK = 8


class CoordinatorState:
    """The durable catalog, the soft registry, and the decisions over both; the HTTP
    shell holds one and a lock around it. The lease decisions are :class:`Grants`'s
    (``self.grants``), given the catalog, the registry and the clamped clock."""

    def __init__(self, config: StateConfig = StateConfig(), *, now: float = 0.0, restored: bool = False,
                 catalog: Optional[Catalog] = None):
        self.config = config
        self.epoch = secrets.token_hex(4)
        self.boot_time = now
        #: True when built from a store that had state: drains wait out old leases.
        self.restored = restored
        self.catalog = catalog if catalog is not None else Catalog()
        self.registry = Registry()
        self.groups: dict[tuple[str, str], tuple[int, float]] = {}
        #: (worker, model, version, layout, shard) -> (last report of a running fetch, at)
        self.fetching: dict[tuple, tuple[FetchReport, float]] = {}
        #: The largest ``now`` seen (time never moves back) and when it was seen.
        self.clock = now
        #: Workers given a fresh ttl after a pause (invariant 9), counted for ``/metrics``.
        self.pauses = 0
        self._ids = itertools.count(1)
        #: The manifests registrations refer to by digest or as an earlier version's.
        self.refs = ManifestRefs(self.catalog)
        #: The lease decisions, and their plans, seeders and answered requests.
        self.grants = Grants(self.catalog, self.registry, config, new_id=self._new_id, offer=self.register_replica,
                             restored_at=now if restored else None)
        #: Leases asked ahead, held until their version completes (``server.ahead``).
        self.ahead = _ahead.Subscriptions()
        #: (model, version) -> when this incarnation allocated it, while it is not complete
        #: (retention's ``abandon_after``; soft: a restored version counts from the boot).
        self.allocated_at: dict[tuple[str, int], float] = {}

    # Read-only views (the tables live in the catalog and the registry).
    @property
    def models(self) -> dict[str, ModelInfo]:
        return self.catalog.models

    @property
    def allocations(self) -> dict[tuple[str, str], int]:
        return self.catalog.allocations

    @property
    def workers(self) -> dict[str, Worker]:
        return self.registry.workers

    @property
    def replicas(self) -> dict[str, Replica]:
        return self.registry.replicas

    @property
    def leases(self) -> dict[str, Lease]:
        return self.registry.leases

    @property
    def tombstones(self) -> dict[str, Replica]:
        return self.registry.tombstones

    def _now(self, now: float) -> float:
        """Clamp ``now`` (never back) and grant pause grace (invariant 9). Every public
        method that takes the time starts here."""
        if now <= self.clock:
            return self.clock
        if now - self.clock > self.config.gap and self.workers:
            self.pauses += 1
            for w in self.workers.values():
                w.last_seen = max(w.last_seen, now)
        self.clock = now
        return now

    # ----------------------------------------------------------------- durability
    def take_writes(self) -> list[Write]:
        """Durable changes since the last call, in order; the shell commits them."""
        return self.catalog.take_writes()

    def durable_rows(self) -> list[Write]:
        """Every durable fact as writes (what a store would hold)."""
        return self.catalog.rows()

    @classmethod
    def restore(cls, rows: Iterable[Write], config: StateConfig = StateConfig(), *, now: float) -> "CoordinatorState":
        """Rebuild from durable rows (in any order of tables as produced by ``durable_rows``)."""
        rows = list(rows)
        return cls(config, now=now, restored=bool(rows), catalog=Catalog.restore(rows))

    @property
    def config(self) -> StateConfig:
        return self._config

    @config.setter
    def config(self, config: StateConfig) -> None:
        self._config = config
        if "grants" in self.__dict__:
            self.grants.config = config

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}-{self.epoch}-{next(self._ids)}"

    # ----------------------------------------------------------------- workers
    def register_worker(self, now: float, worker_id: str, endpoint: str, locality: Locality) -> None:
        """A client (any process) announces itself; re-registering with a new endpoint
        drops the replicas of the old one (its memory is gone; leased ones are fenced)."""
        now = self._now(now)
        old = self.workers.get(worker_id)
        if old is not None and old.endpoint != endpoint:
            self._drop_worker_replicas(now, worker_id)
        w = self.workers[worker_id] = Worker(worker_id, endpoint, locality, now,
                                             now if old is None else old.registered_at)
        if old is not None:
            w.served_leases, w.served_bytes = old.served_leases, old.served_bytes

    def heartbeat(self, now: float, worker_id: str) -> Worker:
        now = self._now(now)
        w = self.workers.get(worker_id)
        if w is None:
            raise NotFoundError(f"unknown worker {worker_id!r}; register again", "unknown_worker")
        w.last_seen = now
        return w

    def remove_worker(self, now: float, worker_id: str) -> int:
        """A client closes, or is expired: its replicas go (leased ones as tombstones,
        invariant 8). Returns how many replicas went.

        Its own **read leases stay** (invariant 13): a reader cut off from the coordinator
        is expired after ``worker_ttl`` but trusts its leases for up to 0.98 x ``lease_ttl``
        (``_fencing.LeaseClock``) and may still be reading. Each stays a fenced record --
        counted by every ``unpublish`` of what it names -- until it is released (the reader
        came back) or lapses on this clock (``lease_ttl`` after its grant or renewal), never
        earlier than the reader stops trusting it."""
        now = self._now(now)
        if worker_id not in self.workers:
            raise NotFoundError(f"unknown worker {worker_id!r}", "unknown_worker")
        del self.workers[worker_id]
        self.ahead.drop_worker(worker_id)
        return self._drop_worker_replicas(now, worker_id)

    def _drop_worker_replicas(self, now: float, worker_id: str) -> int:
        """Drop a worker's replicas; those an unlapsed lease names become tombstones."""
        gone = self.registry.replicas_of_worker(worker_id)
        for r in gone:
            self.registry.drop_replica(r.replica_id)
            if self.registry.leased(r.replica_id, now):
                self.registry.bury(r)
        return len(gone)

    def _worker(self, worker_id: str) -> Worker:
        w = self.workers.get(worker_id)
        if w is None:
            raise NotFoundError(f"unknown worker {worker_id!r}; register again", "unknown_worker")
        return w

    def expire(self, now: float) -> list[str]:
        """Drop dead workers (and their replicas), forget long-lapsed leases, tombstones no
        lease names any more and old groups. Returns the ids of the workers dropped."""
        now = self._now(now)
        dead = [wid for wid, w in self.workers.items() if now - w.last_seen > self.config.worker_ttl]
        for wid in dead:
            self.remove_worker(now, wid)
        for lid in [lid for lid, l in self.leases.items() if now > l.expires + self.config.lease_ttl]:
            self.registry.drop_lease(lid)
        for rid in [rid for rid in self.tombstones if not self.registry.leased(rid, now)]:
            self.registry.drop_tombstone(rid)
        for key in [k for k, (_, exp) in self.groups.items() if now > exp]:
            del self.groups[key]
        for key in [k for k, (_, at) in self.fetching.items() if now > at + FETCH_STALE]:
            del self.fetching[key]
        self.ahead.expire(now)
        self.grants.forget(now)
        self.retire(now)
        return dead

    def retire(self, now: float) -> list[tuple[str, int]]:
        """Retention of metadata (``StateConfig.keep_versions``): retire the versions no
        one needs any more. Not inside a restart's re-registration window (holders have
        not told this incarnation what they hold yet). Returns what was retired."""
        now = self._now(now)
        keep = max(1, self.config.keep_versions)
        if self.restored and now <= self.boot_time + self.config.lease_ttl:
            return []
        asked = {(m, v) for (m, _), (v, exp) in self.groups.items() if now <= exp}
        gone: list[tuple[str, int]] = []
        for name, m in self.models.items():
            if len(m.versions) <= keep or m.newest is None:
                continue
            complete = sorted((v for v, vi in m.versions.items() if vi.complete), reverse=True)
            kept = set(complete[:keep])
            for v in sorted(m.versions):
                if len(gone) >= RETIRE_PER_TICK:
                    return gone  # the rest on the next tick: one commit stays small (etcd's txn limit)
                if v > m.newest or v in kept or (name, v) in asked or self.registry.in_use(name, v):
                    continue
                if not m.versions[v].complete and \
                        now - self.allocated_at.get((name, v), self.boot_time) <= self.config.abandon_after:
                    continue  # a publish in progress (invariant 14)
                self.catalog.retire(name, v)
                self.allocated_at.pop((name, v), None)
                gone.append((name, v))
        for key in [k for k in self.allocated_at if k[0] not in self.models
                    or k[1] not in self.models[k[0]].versions or self.models[k[0]].versions[k[1]].complete]:
            del self.allocated_at[key]
        return gone

    # ----------------------------------------------------------------- versions
    def manifest(self, model: str, version: int, layout: str, shard: int) -> Manifest:
        """The registered manifest of one (model, version, layout, shard)."""
        return self.catalog.manifest(model, version, layout, shard)

    def allocate_version(self, now: float, model: str, version: Optional[int] = None,
                         request_id: Optional[str] = None) -> int:
        """A publisher asks for a new version (``None``) or claims an explicit one
        (``Catalog.allocate``: never reused; a retry with the same ``request_id`` gets the
        first answer)."""
        now = self._now(now)
        v = self.catalog.allocate(now, model, version, request_id)
        vi = self.catalog.models[model].versions.get(v)
        if vi is not None and not vi.complete:
            self.allocated_at.setdefault((model, v), now)
        return v

    def latest(self, model: str, newer_than: Optional[int] = None) -> Optional[int]:
        """Newest complete version (or None); ``newer_than`` only filters."""
        return self.catalog.latest(model, newer_than)

    def resolve(self, now: float, model: str, group: Optional[str], newer_than: Optional[int] = None) -> int:
        """Pick the version a reader (or every rank of ``group``) fetches."""
        now = self._now(now)
        if group is not None:
            hit = self.groups.get((model, group))
            if hit is not None and now <= hit[1]:
                return hit[0]
        v = self.latest(model, newer_than)
        if v is None:
            what = f"newer than {newer_than}" if newer_than is not None else "yet"
            raise NotFoundError(f"model {model!r} has no complete version {what}", "no_complete_version")
        if group is not None:
            self.groups[(model, group)] = (v, now + self.config.group_ttl)
        return v

    # ----------------------------------------------------------------- replicas
    def register_replica(self, now: float, req: RegisterReplica) -> tuple[str, bool]:
        """A holder announces it holds a shard (complete, or partial while it receives).
        Returns (replica_id, version complete). ``req.manifest_digest`` instead of the
        manifest: the shard's registered manifest, if its digest matches. With
        ``req.release``, see :meth:`release_and_register`."""
        if req.release:
            rid, complete, _ = self.release_and_register(now, req)
            return rid, complete
        now = self._now(now)
        self._worker(req.worker_id)
        req = self.refs.by_like(req) if req.like is not None else \
            self.refs.by_digest(req) if req.manifest is None else _addresses.checked(req)
        self.catalog.add_manifest(req, self.refs.check_partial if req.partial else None)
        complete = self.catalog.version(req.model, req.version).complete  # a delta layout alone: not
        key = ShardKey(req.model, req.version, req.layout, req.shard)
        for r in self.registry.replica_of(req.worker_id, key):  # idempotent re-registration (same memory)
            if not r.draining and r.addresses == _addresses.stored(req):
                if not req.partial and r.chunks is not None:
                    r.chunks, r.coming = None, set()  # a partial replica completed
                    r.status_addr = r.status_tag = None
                    self.registry.completed(r)
                return r.replica_id, complete
        rid = self._new_id("r")
        self.registry.add_replica(Replica(
            rid, req.worker_id, req.model, req.version, req.layout, req.shard, _addresses.stored(req), now,
            chunks=set() if req.partial else None, num_chunks=req.num_chunks if req.partial else 0,
            status_addr=req.status_addr if req.partial else None, status_tag=req.status_tag if req.partial else None,
        ))
        return rid, complete

    def release_and_register(self, now: float, req: RegisterReplica) -> tuple[str, bool, dict[str, bool]]:
        """A reader ends its read in one call: release the leases it read under
        (``req.release``; each answers whether it stayed valid, as ``release_lease``) and,
        only if every one did, register the (complete) replica. Returns (replica id or ""
        when one lapsed, version complete, released)."""
        now = self._now(now)
        self._worker(req.worker_id)
        if req.manifest is None:  # refused before any lease is released
            req = self.refs.by_digest(req)
        released: dict[str, bool] = {}
        for lid in req.release:
            l = self.leases.get(lid)
            released[lid] = l is not None and l.worker_id == req.worker_id and self.release_lease(now, lid)
        if not all(released.values()):
            return "", self.catalog.version(req.model, req.version).complete, released
        rid, complete = self.register_replica(now, req.model_copy(update={"release": []}))
        return rid, complete, released

    def digest_of(self, model: str, version: int, layout: str, shard: int, known: Manifest) -> str:
        """``manifest_digest`` of a shard's registered manifest (:meth:`ManifestRefs.digest_of`)."""
        return self.refs.digest_of(model, version, layout, shard, known)

    # ----------------------------------------------------------------- leases
    def acquire_lease(self, now: float, req: AcquireLease) -> LeaseGrant:
        """A reader asks to read a shard: :meth:`Grants.acquire_lease` on this clock."""
        return self.grants.acquire_lease(self._now(now), req)

    def join_ahead(self, now: float, req: AcquireLease) -> Optional[tuple]:
        """A bound subscriber joins its plan before any grant (:meth:`Grants.join_ahead`)."""
        return self.grants.join_ahead(self._now(now), req)

    # ----------------------------------------------------------------- subscribing ahead
    def subscribe(self, now: float, req: AcquireLease, wait: float) -> Optional[LeaseGrant]:
        """A lease asked ahead (``server.ahead.subscribe``): a grant now, or None (held)."""
        return _ahead.subscribe(self, self._now(now), req, wait)

    def bind_ahead(self, now: float, models: set) -> list:
        """Bind the subscriptions that versions of ``models`` just completed satisfy
        (``server.ahead.bind``); their grants are made by :meth:`grant_ahead`."""
        return _ahead.bind(self, self._now(now), models) if self.ahead else []

    def grant_ahead(self, now: float, at: AcquireLease, refused: str) -> LeaseGrant:
        """One bound subscriber's grant (``server.ahead.grant``)."""
        return _ahead.grant(self, self._now(now), at, refused)

    def add_chunks(self, now: float, replica_id: str, worker_id: str, chunks: Iterable[int],
                   lease_ids: Iterable[str] = (), coming: Optional[Iterable[int]] = None) -> int:
        """The holder of a partial replica reports chunks complete in its memory; from now
        on pipelined readers may be sent to it for them. Refused unless every lease the
        chunks were read under is still valid. Returns how many chunks it holds."""
        now = self._now(now)
        self._worker(worker_id)
        r = self.replicas.get(replica_id)
        if r is None or r.worker_id != worker_id:
            raise NotFoundError(f"worker {worker_id!r} has no replica {replica_id!r}", "unknown_replica")
        for lid in lease_ids:
            l = self.leases.get(lid)
            if l is None or l.worker_id != worker_id or l.expires < now:
                raise ConflictError(f"lease {lid} has lapsed; chunks read under it are not served", "lease_lapsed")
        if r.chunks is None:
            return r.num_chunks
        for c in chunks:
            if not 0 <= c < r.num_chunks:
                raise ConflictError(f"chunk {c} outside [0, {r.num_chunks}) of {replica_id}", "bad_chunk")
            r.chunks.add(c)
        if coming is not None:
            r.coming = {c for c in coming if 0 <= c < r.num_chunks} - r.chunks
        return len(r.chunks)

    def _available(self, model: str, version: int, without: set[str]) -> bool:
        """Does some complete full layout of the version (not a delta: useless without its
        base) have a serving replica for every shard?"""
        vi = self.models[model].versions[version]
        for lname, li in vi.layouts.items():
            if not li.complete or is_delta_layout(lname):
                continue
            if all(
                any(not r.draining and r.chunks is None and r.replica_id not in without
                    for r in self.registry.replicas_of_shard(ShardKey(model, version, lname, shard)))
                for shard in range(li.num_shards)
            ):
                return True
        return False

    def unpublish(self, now: float, worker_id: str, model: str, version: int,
                  replica_ids: Optional[Iterable[str]] = None) -> tuple[bool, int]:
        """A holder stops serving (model, version) -- all its replicas of it, or only
        ``replica_ids``. Returns (drained, open leases).

        The first call marks those replicas as draining (no new leases); each call
        removes them once no unexpired lease names them. Refused (RetentionError) when it
        would leave the model's newest complete version without a replica.

        The worker's tombstones of (model, version) (invariant 8) drain with them: all of
        them, or with ``replica_ids`` those of the same layout and shard."""
        now = self._now(now)
        self._worker(worker_id)
        self.catalog.version(model, version)
        only = None if replica_ids is None else set(replica_ids)
        mine = {
            r.replica_id for r in self.registry.replicas_of_worker(worker_id)
            if r.model == model and r.version == version and (only is None or r.replica_id in only)
        }
        # Tombstones named by id (a partial replica that became one while the holder still
        # names it) and those of the same layout and shard as a named live replica (the
        # holder re-registered the same memory under a new id).
        parts = {(self.replicas[rid].layout, self.replicas[rid].shard) for rid in mine}
        fenced = {
            r.replica_id for r in self.registry.tombstones_of_worker(worker_id)
            if r.model == model and r.version == version
            and (only is None or r.replica_id in only or (r.layout, r.shard) in parts)
        }
        window = self.restored and now <= self.boot_time + self.config.lease_ttl
        if not mine and not fenced:
            # After a restart the holder may not have re-registered what it holds yet:
            # leases of the previous incarnation may still name it.
            return (False, 1) if window else (True, 0)
        newly = {rid for rid in mine if not self.replicas[rid].draining}
        if newly and self.latest(model) == version:
            if self._available(model, version, set()) and not self._available(model, version, mine):
                raise RetentionError(
                    f"{worker_id!r} holds the last replica of {model!r} v{version}, the newest complete "
                    "version; it stays until another holder has it",
                    "retention",
                )
        for rid in newly:
            self.replicas[rid].draining = True
        open_ = self.registry.open_leases(now, mine | fenced)
        if window:
            return False, max(open_, 1)  # leases granted before the restart may still run
        if open_:
            return False, open_
        for rid in mine:
            self.registry.drop_replica(rid)
        for rid in fenced:
            self.registry.drop_tombstone(rid)
        return True, 0

    def report(self, now: float, replica_id: str, reporter: str, reason: str) -> Optional[Replica]:
        """A reader saw ``replica_id`` fail: give it no new leases for ``suspect_ttl``.
        Returns the replica (None if it is already gone)."""
        now = self._now(now)
        self._worker(reporter)
        r = self.replicas.get(replica_id)
        if r is None:
            return None  # already gone
        r.suspect_until = now + self.config.suspect_ttl
        return r

    # ----------------------------------------------------------------- leases
    def renew_lease(self, now: float, lease_id: str) -> float:
        """Extend a still-valid lease by ``lease_ttl``; a lapsed one cannot be renewed."""
        now = self._now(now)
        l = self.leases.get(lease_id)
        if l is None or l.expires < now:
            raise ConflictError(f"lease {lease_id} has lapsed; read again", "lease_lapsed")
        l.expires = now + self.config.lease_ttl
        return self.config.lease_ttl

    def lease_covers(self, now: float, lease_id: str, replica_id: str, worker_id: str, proof: str = "",
                     endpoint: str = "") -> bool:
        """A holder asks before it hands a same-host reader its memory: is ``lease_id``
        valid now, ``worker_id``'s, does it name ``replica_id``, and is ``proof`` the
        reader's ``protocol.lease_proof`` of it for the holder at ``endpoint`` (keyed by the
        lease's secret, which only its reader was answered)? Compared in constant time; no
        proof (an older holder or reader): not covered. (Reads nothing else.)"""
        now = self._now(now)
        l = self.leases.get(lease_id)
        if l is None or not (now <= l.expires and l.worker_id == worker_id and replica_id in l.replica_ids):
            return False
        want = lease_proof(l.secret.hex(), lease_id, replica_id, endpoint) if l.secret else ""
        return bool(want) and hmac.compare_digest(want.encode(), proof.encode())

    def release_lease(self, now: float, lease_id: str) -> bool:
        """A reader finished: True if the lease was valid up to now (its bytes are good).

        A lease this incarnation never granted (the coordinator restarted) is never vouched
        for: the previous incarnation may have judged it lapsed (and let its holder drain)
        before it stopped, which nothing here can know. Readers in flight across a restart
        re-read what they read under such a lease (once). Holders still cannot finish
        draining before ``boot + lease_ttl`` (``unpublish``), so they never overwrite bytes
        such a reader may still be reading."""
        now = self._now(now)
        l = self.registry.drop_lease(lease_id)
        if l is None:
            return False
        return now <= l.expires

    # ----------------------------------------------------------------- observability
    def record_fetch(self, now: float, req: FetchReport) -> dict[str, int]:
        """A reader reports a fetch (``server.views.record_fetch``); only models this coordinator
        knows are accepted, which bounds the label sets of ``/metrics``."""
        now = self._now(now)
        self.catalog.model(req.model)
        return record_fetch(self, now, req)

    def record_swap(self, now: float, req: SwapReport) -> None:
        """An engine reports a swap (only known models are accepted; see ``record_fetch``)."""
        self.catalog.model(req.model)

    # ----------------------------------------------------------------- views
    def metrics_view(self, now: float) -> dict:
        """What ``/metrics`` shows of the state (``server.views.metrics_view``)."""
        return metrics_view(self, now)

    def status(self, now: float) -> dict:
        """Everything ``tensorhub status`` shows (``server.views.status_view``)."""
        return status_view(self, now)
