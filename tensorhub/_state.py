"""The coordinator's decisions, as a pure state machine.

No I/O and no clock: every method takes ``now`` (seconds on a monotonic clock: the
coordinator passes ``time.monotonic()``) and either returns its decision or raises a :class:`CoordinatorError` subclass
whose ``status`` the HTTP shell sends back. Durable changes (models, version counters,
manifests) are queued as *writes*; the shell commits them (``take_writes()``) to its
store before it answers, so nothing a client was told is lost by a restart.
``CoordinatorState.restore(rows)`` rebuilds the durable part after a restart; soft state
(workers, replicas, leases) starts empty and is re-registered by the clients.

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

Observability (no decision depends on it): readers report their fetches
(``record_fetch``: live progress while running, bytes per source at the end) and engines
their swaps (``record_swap``); each worker's served leases and bytes are counted here and
answered on its heartbeat; ``metrics_view`` is what ``/metrics`` shows of the state.
"""

from __future__ import annotations

import itertools
import secrets
from dataclasses import dataclass, field
from typing import Iterable, Optional

from ._exceptions import (
    ConflictError,
    ManifestMismatchError,
    NotFoundError,
    RetentionError,
)
from ._planner import (
    LEVELS, Candidate, choose_sources, chunk_order, claims, grid_chunk_bytes, group_key, locality_cost,
    reserve_chunks, start_fraction, start_reverse,
)
from ._wire import (
    AcquireLease,
    FetchReport,
    LeaseGrant,
    Locality,
    Manifest,
    RegisterReplica,
    ReplicaInfo,
    SwapReport,
    first_difference,
)

__all__ = ["StateConfig", "CoordinatorState", "Write"]

#: A durable change: (table, key tuple, value). See ``_store.py``.
Write = tuple

#: A running fetch not reported for this long is dropped from the live table (seconds).
FETCH_STALE = 10.0
#: Most running fetches the live table keeps (more are not shown, still counted at the end).
MAX_LIVE_FETCHES = 10_000
#: Allocation answers kept per model for retries (``allocate_version``'s ``request_id``).
ALLOCATIONS_KEPT = 1024
#: ``locality_cost`` -> the ``distance`` label of fetched bytes.
DISTANCES = ("same_host", "same_zone", "same_datacenter", "other_datacenter")


@dataclass(frozen=True)
class StateConfig:
    """Timing knobs of the coordinator (seconds)."""

    #: How long a read lease stays valid without renewal.
    lease_ttl: float = 30.0
    #: A worker that has not heart-beaten for this long is dead; its replicas are dropped.
    worker_ttl: float = 10.0
    #: How long a replica reported as failing gets no new leases.
    suspect_ttl: float = 30.0
    #: How long a group's resolved version is remembered.
    group_ttl: float = 600.0
    #: Source-choice policy (``_planner.POLICIES``): ``topology``, or the benchmarks'
    #: ``single-source`` baseline.
    policy: str = "topology"
    #: A gap with no call at all longer than this (the coordinator was paused, e.g.
    #: SIGSTOP, or starved) gives every worker a fresh ``worker_ttl`` instead of expiring
    #: them all at once. None: ``worker_ttl / 2`` (the shell ticks every second or faster).
    pause_grace: Optional[float] = None

    @property
    def gap(self) -> float:
        return self.worker_ttl / 2 if self.pause_grace is None else self.pause_grace


@dataclass
class Worker:
    worker_id: str
    endpoint: str
    locality: Locality
    last_seen: float
    registered_at: float
    #: Since this coordinator started: leases naming its replicas, bytes readers reported
    #: reading from it (answered on each heartbeat: the holder cannot see one-sided reads).
    served_leases: int = 0
    served_bytes: int = 0


@dataclass
class Replica:
    replica_id: str
    worker_id: str
    model: str
    version: int
    layout: str
    shard: int
    addresses: list[int]
    registered_at: float
    draining: bool = False
    suspect_until: float = 0.0
    served: int = 0  # leases granted on it
    #: Its worker was dropped while leases named it (see invariant 8): fenced, never offered.
    tombstone: bool = False
    #: Pipelined replication: chunks reported complete while still receiving; None = complete.
    chunks: Optional[set[int]] = None
    num_chunks: int = 0
    coming: set[int] = field(default_factory=set)  # chunks it is receiving (a hint)


@dataclass
class Lease:
    lease_id: str
    worker_id: str
    model: str
    version: int
    layout: str
    shard: int
    replica_ids: tuple[str, ...]
    granted_at: float
    expires: float
    #: Pipelined leases: where the reader's chunk order starts and its direction, and the
    #: chunks reserved for it to read from a complete replica (``_planner.reserve_chunks``).
    start: float = 0.0
    reverse: bool = False
    reserved: frozenset = frozenset()


@dataclass
class LayoutInfo:
    num_shards: int
    manifests: dict[int, Manifest] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.manifests) == self.num_shards


@dataclass
class VersionInfo:
    created: float
    layouts: dict[str, LayoutInfo] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return any(li.complete for li in self.layouts.values())


@dataclass
class ModelInfo:
    counter: int = 0  # highest version number ever handed out
    versions: dict[int, VersionInfo] = field(default_factory=dict)


class CoordinatorState:
    """All coordinator state; the HTTP shell holds one and a lock around it."""

    def __init__(self, config: StateConfig = StateConfig(), *, now: float = 0.0, restored: bool = False):
        self.config = config
        self.epoch = secrets.token_hex(4)
        self.boot_time = now
        #: True when built from a store that had state: drains wait out old leases.
        self.restored = restored
        self.models: dict[str, ModelInfo] = {}
        self.workers: dict[str, Worker] = {}
        self.replicas: dict[str, Replica] = {}
        self.leases: dict[str, Lease] = {}
        self.groups: dict[tuple[str, str], tuple[int, float]] = {}
        #: (model, version, layout, shard, level, *group) -> (seeder worker id, named at);
        #: level and group as in ``_planner.group_key`` (host, zone, datacenter).
        self.seeders: dict[tuple, tuple[str, float]] = {}
        #: (worker, model, version, layout, shard) -> (last report of a running fetch, at)
        self.fetching: dict[tuple, tuple[FetchReport, float]] = {}
        #: Replicas of dropped workers that leases still name (invariant 8), by replica id.
        self.tombstones: dict[str, Replica] = {}
        #: (model, request_id) -> version: allocations already answered (durable, bounded).
        self.allocations: dict[tuple[str, str], int] = {}
        #: (worker, request_id) -> (lease id, grant): leases already answered (soft).
        self.lease_requests: dict[tuple[str, str], tuple[str, LeaseGrant]] = {}
        #: The largest ``now`` seen (time never moves back) and when it was seen.
        self.clock = now
        #: Workers given a fresh ttl after a pause (invariant 9), counted for ``/metrics``.
        self.pauses = 0
        self._ids = itertools.count(1)
        self._writes: list[Write] = []

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
        w, self._writes = self._writes, []
        return w

    def durable_rows(self) -> list[Write]:
        """Every durable fact as writes (what a store would hold)."""
        rows: list[Write] = []
        for name, m in self.models.items():
            rows.append(("model", (name,), m.counter))
            for v, vi in m.versions.items():
                rows.append(("version", (name, v), vi.created))
                for lname, li in vi.layouts.items():
                    rows.append(("layout", (name, v, lname), li.num_shards))
                    for shard, man in li.manifests.items():
                        rows.append(("manifest", (name, v, lname, shard), man))
        for key, v in self.allocations.items():
            rows.append(("allocation", key, v))
        return rows

    @classmethod
    def restore(cls, rows: Iterable[Write], config: StateConfig = StateConfig(), *, now: float) -> "CoordinatorState":
        """Rebuild from durable rows (in any order of tables as produced by ``durable_rows``)."""
        rows = list(rows)
        st = cls(config, now=now, restored=bool(rows))
        order = {"model": 0, "version": 1, "layout": 2, "manifest": 3, "allocation": 4}
        for table, key, value in sorted(rows, key=lambda r: order[r[0]]):
            if table == "model":
                st.models[key[0]] = ModelInfo(counter=value)
            elif table == "version":
                st.models.setdefault(key[0], ModelInfo()).versions[key[1]] = VersionInfo(created=value)
            elif table == "layout":
                st.models[key[0]].versions[key[1]].layouts[key[2]] = LayoutInfo(num_shards=value)
            elif table == "manifest":
                st.models[key[0]].versions[key[1]].layouts[key[2]].manifests[key[3]] = value
            elif table == "allocation":
                st.allocations[tuple(key)] = value
        return st

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
            raise NotFoundError(404, f"unknown worker {worker_id!r}; register again", "unknown_worker")
        w.last_seen = now
        return w

    def remove_worker(self, now: float, worker_id: str) -> int:
        """A client closes: its replicas and leases go. Returns how many replicas went."""
        now = self._now(now)
        if worker_id not in self.workers:
            raise NotFoundError(404, f"unknown worker {worker_id!r}", "unknown_worker")
        del self.workers[worker_id]
        for lid in [lid for lid, l in self.leases.items() if l.worker_id == worker_id]:
            del self.leases[lid]
        return self._drop_worker_replicas(now, worker_id)

    def _drop_worker_replicas(self, now: float, worker_id: str) -> int:
        """Drop a worker's replicas; those an unlapsed lease names become tombstones."""
        gone = [rid for rid, r in self.replicas.items() if r.worker_id == worker_id]
        leased = self._leased(now)
        for rid in gone:
            r = self.replicas.pop(rid)
            if rid in leased:
                r.draining = r.tombstone = True
                self.tombstones[rid] = r
        return len(gone)

    def _leased(self, now: float) -> set[str]:
        """Ids of the replicas an unlapsed lease names."""
        return {rid for l in self.leases.values() if l.expires >= now for rid in l.replica_ids}

    def _worker(self, worker_id: str) -> Worker:
        w = self.workers.get(worker_id)
        if w is None:
            raise NotFoundError(404, f"unknown worker {worker_id!r}; register again", "unknown_worker")
        return w

    def expire(self, now: float) -> list[str]:
        """Drop dead workers (and their replicas), forget long-lapsed leases, tombstones no
        lease names any more and old groups. Returns the ids of the workers dropped."""
        now = self._now(now)
        dead = [wid for wid, w in self.workers.items() if now - w.last_seen > self.config.worker_ttl]
        for wid in dead:
            self.remove_worker(now, wid)
        for lid in [lid for lid, l in self.leases.items() if now > l.expires + self.config.lease_ttl]:
            del self.leases[lid]
        if self.tombstones:
            leased = self._leased(now)
            for rid in [rid for rid in self.tombstones if rid not in leased]:
                del self.tombstones[rid]
        for key in [k for k, (lid, _) in self.lease_requests.items() if lid not in self.leases]:
            del self.lease_requests[key]
        for key in [k for k, (_, exp) in self.groups.items() if now > exp]:
            del self.groups[key]
        for key in [k for k, (wid, _) in self.seeders.items() if wid not in self.workers]:
            del self.seeders[key]
        for key in [k for k, (_, at) in self.fetching.items() if now > at + FETCH_STALE]:
            del self.fetching[key]
        return dead

    # ----------------------------------------------------------------- versions
    def _model(self, model: str) -> ModelInfo:
        m = self.models.get(model)
        if m is None:
            raise NotFoundError(404, f"unknown model {model!r}", "unknown_model")
        return m

    def _version(self, model: str, version: int) -> VersionInfo:
        m = self._model(model)
        vi = m.versions.get(version)
        if vi is None:
            raise NotFoundError(
                404, f"model {model!r} has no version {version} (newest allocated: {m.counter})", "unknown_version"
            )
        return vi

    def manifest(self, model: str, version: int, layout: str, shard: int) -> Manifest:
        """The registered manifest of one (model, version, layout, shard)."""
        vi = self._version(model, version)
        li = vi.layouts.get(layout)
        if li is None or shard not in li.manifests:
            raise NotFoundError(
                404,
                f"{model!r} v{version} has no layout {layout!r} shard {shard} "
                f"(layouts: {sorted(vi.layouts) or 'none'})",
                "unknown_layout",
            )
        return li.manifests[shard]

    def allocate_version(self, now: float, model: str, version: Optional[int] = None,
                         request_id: Optional[str] = None) -> int:
        """A publisher asks for a new version (``None``) or claims an explicit one.

        An explicit version above the counter raises the counter to it; one at or below it
        must already exist (versions are never reused). A new version asked for again with
        the same ``request_id`` (a client retry whose first answer was lost) gets the same
        number: retries never skip one."""
        now = self._now(now)
        if version is None and request_id is not None:
            hit = self.allocations.get((model, request_id))
            if hit is not None:
                return hit
        m = self.models.get(model)
        if m is None:
            m = self.models[model] = ModelInfo()
        if version is None:
            version = m.counter + 1
        elif version <= m.counter:
            if version in m.versions:
                return version
            raise ConflictError(
                409,
                f"version {version} of {model!r} was skipped or retired (counter is {m.counter}); "
                "versions are never reused",
                "version_reused",
            )
        m.counter = version
        m.versions[version] = VersionInfo(created=now)
        self._writes.append(("model", (model,), m.counter))
        self._writes.append(("version", (model, version), now))
        if request_id is not None:
            self.allocations[(model, request_id)] = version
            self._writes.append(("allocation", (model, request_id), version))
            if version % 64 == 0:  # keep the answers of the last ALLOCATIONS_KEPT allocations
                floor = version - ALLOCATIONS_KEPT
                for key in [k for k, v in self.allocations.items() if k[0] == model and v <= floor]:
                    del self.allocations[key]
                self._writes.append(("allocation_floor", (model,), floor))
        return version

    def latest(self, model: str, newer_than: Optional[int] = None) -> Optional[int]:
        """Newest complete version (or None); ``newer_than`` only filters."""
        m = self._model(model)
        best = None
        for v, vi in m.versions.items():
            if vi.complete and (best is None or v > best):
                best = v
        if best is not None and newer_than is not None and best <= newer_than:
            return None
        return best

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
            raise NotFoundError(404, f"model {model!r} has no complete version {what}", "no_complete_version")
        if group is not None:
            self.groups[(model, group)] = (v, now + self.config.group_ttl)
        return v

    # ----------------------------------------------------------------- replicas
    def register_replica(self, now: float, req: RegisterReplica) -> tuple[str, bool]:
        """A holder announces it holds a complete shard. Returns (replica_id, version complete)."""
        now = self._now(now)
        self._worker(req.worker_id)
        vi = self._version(req.model, req.version)
        li = vi.layouts.get(req.layout)
        if li is None:
            li = vi.layouts[req.layout] = LayoutInfo(num_shards=req.num_shards)
            self._writes.append(("layout", (req.model, req.version, req.layout), req.num_shards))
        elif li.num_shards != req.num_shards:
            raise ManifestMismatchError(
                409,
                f"{req.model!r} v{req.version} layout {req.layout!r}: num_shards {req.num_shards} "
                f"!= registered {li.num_shards}",
                "manifest_mismatch",
            )
        known = li.manifests.get(req.shard)
        if req.partial:
            self._check_partial(req, known)
        if known is None:
            li.manifests[req.shard] = req.manifest
            self._writes.append(("manifest", (req.model, req.version, req.layout, req.shard), req.manifest))
        else:
            diff = first_difference(known, req.manifest)
            if diff is not None:
                raise ManifestMismatchError(
                    409,
                    f"{req.model!r} v{req.version} layout {req.layout!r} shard {req.shard}: {diff}",
                    "manifest_mismatch",
                )
        for r in self.replicas.values():  # idempotent re-registration (same memory)
            if (r.worker_id, r.model, r.version, r.layout, r.shard) == (
                req.worker_id, req.model, req.version, req.layout, req.shard
            ) and not r.draining and r.addresses == list(req.addresses):
                r.addresses = list(req.addresses)
                if not req.partial:
                    r.chunks, r.coming = None, set()  # a partial replica completed
                return r.replica_id, li.complete
        rid = self._new_id("r")
        self.replicas[rid] = Replica(
            rid, req.worker_id, req.model, req.version, req.layout, req.shard, list(req.addresses), now,
            chunks=set() if req.partial else None, num_chunks=req.num_chunks if req.partial else 0,
        )
        return rid, li.complete

    @staticmethod
    def _check_partial(req: RegisterReplica, known: Optional[Manifest]) -> None:
        where = f"{req.model!r} v{req.version} layout {req.layout!r} shard {req.shard}"
        if known is None:
            raise ConflictError(409, f"partial replica of {where}, which has no complete replica yet",
                                "unknown_layout")
        grid = grid_chunk_bytes(known.nbytes)
        if req.chunk_bytes != grid or req.num_chunks < 1:
            raise ConflictError(
                409, f"partial replica of {where}: chunk grid {req.chunk_bytes} bytes x {req.num_chunks} "
                f"!= the shard's {grid} bytes", "bad_chunk_grid")

    def add_chunks(self, now: float, replica_id: str, worker_id: str, chunks: Iterable[int],
                   lease_ids: Iterable[str] = (), coming: Optional[Iterable[int]] = None) -> int:
        """The holder of a partial replica reports chunks complete in its memory; from now
        on pipelined readers may be sent to it for them. Refused unless every lease the
        chunks were read under is still valid. Returns how many chunks it holds."""
        now = self._now(now)
        self._worker(worker_id)
        r = self.replicas.get(replica_id)
        if r is None or r.worker_id != worker_id:
            raise NotFoundError(404, f"worker {worker_id!r} has no replica {replica_id!r}", "unknown_replica")
        for lid in lease_ids:
            l = self.leases.get(lid)
            if l is None or l.worker_id != worker_id or l.expires < now:
                raise ConflictError(409, f"lease {lid} has lapsed; chunks read under it are not served",
                                    "lease_lapsed")
        if r.chunks is None:
            return r.num_chunks
        for c in chunks:
            if not 0 <= c < r.num_chunks:
                raise ConflictError(409, f"chunk {c} outside [0, {r.num_chunks}) of {replica_id}", "bad_chunk")
            r.chunks.add(c)
        if coming is not None:
            r.coming = {c for c in coming if 0 <= c < r.num_chunks} - r.chunks
        return len(r.chunks)

    def _open_leases(self, now: float, rids: set[str]) -> int:
        return sum(1 for l in self.leases.values() if l.expires >= now and rids.intersection(l.replica_ids))

    def _available(self, model: str, version: int, without: set[str]) -> bool:
        """Does some complete layout of the version have a serving replica for every shard?"""
        vi = self.models[model].versions[version]
        for lname, li in vi.layouts.items():
            if not li.complete:
                continue
            have = {
                r.shard
                for r in self.replicas.values()
                if r.model == model and r.version == version and r.layout == lname
                and not r.draining and r.chunks is None and r.replica_id not in without
            }
            if len(have) == li.num_shards:
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
        self._version(model, version)
        only = None if replica_ids is None else set(replica_ids)
        mine = {
            rid for rid, r in self.replicas.items()
            if r.worker_id == worker_id and r.model == model and r.version == version
            and (only is None or rid in only)
        }
        parts = {(self.replicas[rid].layout, self.replicas[rid].shard) for rid in mine}
        fenced = {
            rid for rid, r in self.tombstones.items()
            if r.worker_id == worker_id and r.model == model and r.version == version
            and (only is None or (r.layout, r.shard) in parts)
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
                    409,
                    f"{worker_id!r} holds the last replica of {model!r} v{version}, the newest complete "
                    "version; it stays until another holder has it",
                    "retention",
                )
        for rid in newly:
            self.replicas[rid].draining = True
        open_ = self._open_leases(now, mine | fenced)
        if window:
            return False, max(open_, 1)  # leases granted before the restart may still run
        if open_:
            return False, open_
        for rid in mine:
            del self.replicas[rid]
        for rid in fenced:
            del self.tombstones[rid]
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
    def acquire_lease(self, now: float, req: AcquireLease) -> LeaseGrant:
        """A reader asks to read (model, version, layout, shard). Asked again with the same
        ``request_id`` while that lease is open, it answers the first grant again."""
        now = self._now(now)
        reader = self._worker(req.worker_id)
        if req.request_id is not None and req.lease_id is None:
            hit = self.lease_requests.get((req.worker_id, req.request_id))
            if hit is not None and hit[0] in self.leases and self.leases[hit[0]].expires >= now:
                return hit[1]
        vi = self._version(req.model, req.version)
        li = vi.layouts.get(req.layout)
        if li is None or req.shard not in li.manifests:
            raise NotFoundError(
                404,
                f"{req.model!r} v{req.version} has no layout {req.layout!r} shard {req.shard} "
                f"(layouts: {sorted(vi.layouts) or 'none'})",
                "unknown_layout",
            )
        excluded = set(req.exclude)
        key = (req.model, req.version, req.layout, req.shard)
        refresh = self.leases.get(req.lease_id) if req.lease_id is not None else None
        if refresh is not None and (refresh.worker_id != req.worker_id or refresh.expires < now
                                    or (refresh.model, refresh.version, refresh.layout, refresh.shard) != key):
            raise ConflictError(409, f"lease {req.lease_id} has lapsed or is not this reader's; read again",
                                "lease_lapsed")
        load: dict[str, int] = {}
        arrivals: set[str] = set()  # readers of this shard now: spreads where concurrent readers start
        for l in self.leases.values():
            if l.expires >= now and l is not refresh:
                if (l.model, l.version, l.layout, l.shard) == key and l.worker_id != req.worker_id:
                    arrivals.add(l.worker_id)
                for rid in l.replica_ids:
                    load[rid] = load.get(rid, 0) + 1
        cands, by_id = [], {}
        own: Optional[frozenset] = None
        own_num = 0
        partials: list[tuple[Replica, Worker]] = []  # other readers' partial replicas
        for r in self.replicas.values():
            if (r.model, r.version, r.layout, r.shard) != key:
                continue
            if r.worker_id == req.worker_id and r.chunks is not None:
                own, own_num = frozenset(r.chunks | r.coming), r.num_chunks
            if r.chunks is not None and r.worker_id != req.worker_id:
                arrivals.add(r.worker_id)
                w = self.workers.get(r.worker_id)
                if req.pipelined and w is not None:
                    partials.append((r, w))
            if r.draining or r.suspect_until > now or r.replica_id in excluded or r.worker_id == req.worker_id:
                continue
            w = self.workers.get(r.worker_id)
            if w is None:
                continue
            by_id[r.replica_id] = (r, w)
            cands.append(Candidate(r.replica_id, r.worker_id, w.locality, load.get(r.replica_id, 0),
                                   r.registered_at, None if r.chunks is None else frozenset(r.chunks),
                                   frozenset(r.coming) if r.chunks is not None else frozenset()))
        skeys = {lvl: key + (lvl,) + group_key(reader.locality, lvl) for lvl in LEVELS}
        seeders = {}
        for lvl, skey in skeys.items():
            who = self.seeders.get(skey, (None, 0.0))[0]
            seeders[lvl] = (who, self._seeder_alive(now, who, key))
        choice = choose_sources(reader.locality, req.worker_id, cands, max_sources=req.max_sources,
                                pipelined=req.pipelined, seeders=seeders, policy=self.config.policy, have=own)
        if not choice.sources and not (req.pipelined and cands):
            self._check_gone(now, key, req.worker_id)
            raise ConflictError(
                409,
                f"no replica of {req.model!r} v{req.version} layout {req.layout!r} shard {req.shard} "
                "is serving now",
                "no_replica",
            )
        for lvl in choice.seed_levels:
            if seeders[lvl][0] != req.worker_id:
                self.seeders[skeys[lvl]] = (req.worker_id, now)
        chosen = [(cost, by_id[c.replica_id][0], by_id[c.replica_id][1]) for c, cost in choice.sources]
        ids = tuple(r.replica_id for _, r, _ in chosen)
        if refresh is not None:
            lid, lease = refresh.lease_id, refresh
            # Keep naming replicas an earlier answer sent it to: reads from them may still run.
            lease.replica_ids = tuple(dict.fromkeys(lease.replica_ids + ids))  # expiry: renew only
        else:
            lid = self._new_id("l")
            lease = Lease(lid, req.worker_id, req.model, req.version, req.layout, req.shard, ids, now,
                          now + self.config.lease_ttl, start_fraction(len(arrivals)), start_reverse(len(arrivals)))
            self.leases[lid] = lease
            for _, r, w in chosen:
                r.served += 1
                w.served_leases += 1
        # A scarce complete source (the publisher, the slow link) is split between readers
        # near each other, not raced for (_planner.claims / reserve_chunks).
        held_back: dict[str, frozenset] = {}
        for l in self.leases.values():
            if l is not lease and l.expires >= now and (l.model, l.version, l.layout, l.shard) == key:
                held_back[l.worker_id] = held_back.get(l.worker_id, frozenset()) | l.reserved
        claimed = claims([(c, cost) for c, cost in choice.sources],
                         [(locality_cost(reader.locality, w.locality), frozenset(r.coming),
                           held_back.get(r.worker_id, frozenset())) for r, w in partials])
        reserved: Optional[list[int]] = None
        if claimed is not None and own is not None:
            lease.reserved = reserve_chunks(chunk_order(own_num, lease.start, lease.reverse), own, claimed,
                                            lease.reserved)
            reserved = sorted(lease.reserved)
        chunk_bytes = grid_chunk_bytes(li.manifests[req.shard].nbytes) if req.pipelined else 0
        grant = LeaseGrant(
            lease_id=lid,
            model=req.model,
            version=req.version,
            layout=req.layout,
            shard=req.shard,
            num_shards=li.num_shards,
            manifest=li.manifests[req.shard],
            replicas=[
                ReplicaInfo(
                    replica_id=r.replica_id, worker_id=w.worker_id, endpoint=w.endpoint,
                    locality=w.locality, addresses=r.addresses, cost=cost,
                    chunks=None if r.chunks is None else sorted(r.chunks),
                    coming=sorted(r.coming) if r.chunks is not None else [],
                )
                for cost, r, w in chosen
            ],
            ttl=self.config.lease_ttl,
            chunk_bytes=chunk_bytes,
            start=lease.start if req.pipelined else 0.0,
            reverse=req.pipelined and lease.reverse,
            claimed=sorted(claimed or ()),
            reserved=reserved,
            seed=choice.seed,
            reason=choice.reason,
        )
        if req.request_id is not None and refresh is None:
            self.lease_requests[(req.worker_id, req.request_id)] = (lid, grant)
        return grant

    def _check_gone(self, now: float, key: tuple, reader: str) -> None:
        """Raise ``version_gone`` when nobody serves the shard and nobody can again
        (invariant 11): it is not the newest complete version, no replica of it (complete,
        partial, draining, suspect or fenced) is left, no other reader holds a lease on it
        (a plain reader registers its copy after reading), and re-registration after a
        restart (within ``worker_ttl`` of boot) is over."""
        model, version = key[0], key[1]
        newest = self.latest(model)
        if newest is None or version >= newest:
            return
        if self.restored and now <= self.boot_time + self.config.worker_ttl:
            return
        if any((r.model, r.version, r.layout, r.shard) == key and r.worker_id != reader
               for r in itertools.chain(self.replicas.values(), self.tombstones.values())):
            return  # (the reader's own partial replica holds nothing it could read)
        if any((l.model, l.version, l.layout, l.shard) == key and l.expires >= now and l.worker_id != reader
               for l in self.leases.values()):
            return
        raise ConflictError(
            409,
            f"{model!r} v{version} (layout {key[2]!r} shard {key[3]}) is no longer held by anyone and "
            f"cannot come back (it is not the newest); the newest complete version is v{newest}",
            "version_gone",
        )

    def _seeder_alive(self, now: float, seeder: Optional[str], key: tuple) -> bool:
        """Does the seeder named for a datacenter still count: a live worker holding a
        serving replica (partial or complete) of the shard, or (before it registered its
        partial replica) still holding a lease on the shard."""
        if seeder is None or seeder not in self.workers:
            return False
        for r in self.replicas.values():
            if r.worker_id == seeder and (r.model, r.version, r.layout, r.shard) == key:
                return not r.draining and r.suspect_until <= now
        return any(l.worker_id == seeder and (l.model, l.version, l.layout, l.shard) == key and l.expires >= now
                   for l in self.leases.values())

    def renew_lease(self, now: float, lease_id: str) -> float:
        """Extend a still-valid lease by ``lease_ttl``; a lapsed one cannot be renewed."""
        now = self._now(now)
        l = self.leases.get(lease_id)
        if l is None or l.expires < now:
            raise ConflictError(409, f"lease {lease_id} has lapsed; read again", "lease_lapsed")
        l.expires = now + self.config.lease_ttl
        return self.config.lease_ttl

    def release_lease(self, now: float, lease_id: str) -> bool:
        """A reader finished: True if the lease was valid up to now (its bytes are good).

        A lease this incarnation never granted (the coordinator restarted) is never vouched
        for: the previous incarnation may have judged it lapsed (and let its holder drain)
        before it stopped, which nothing here can know. Readers in flight across a restart
        re-read what they read under such a lease (once). Holders still cannot finish
        draining before ``boot + lease_ttl`` (``unpublish``), so they never overwrite bytes
        such a reader may still be reading."""
        now = self._now(now)
        l = self.leases.pop(lease_id, None)
        if l is None:
            return False
        return now <= l.expires

    # ----------------------------------------------------------------- observability
    def record_fetch(self, now: float, req: FetchReport) -> dict[str, int]:
        """A reader reports a fetch: running (kept in the live table ``status`` shows) or
        ended (dropped from it; its bytes are credited to the source workers). Only models
        this coordinator knows are accepted, which bounds the label sets of ``/metrics``.
        Returns an ended fetch's bytes by distance (``DISTANCES``, or ``unknown`` for a
        worker no longer registered); ``{}`` for a running one."""
        now = self._now(now)
        self._model(req.model)
        key = (req.worker_id, req.model, req.version, req.layout, req.shard)
        if req.state == "running":
            if key in self.fetching or len(self.fetching) < MAX_LIVE_FETCHES:
                self.fetching[key] = (req, now)
            return {}
        self.fetching.pop(key, None)
        reader = self.workers.get(req.worker_id)
        by_distance: dict[str, int] = {}
        for wid, n in req.sources.items():
            src = self.workers.get(wid)
            if src is not None and wid != req.worker_id:
                src.served_bytes += n
            d = "unknown" if src is None or reader is None else \
                DISTANCES[locality_cost(reader.locality, src.locality)]
            by_distance[d] = by_distance.get(d, 0) + n
        return by_distance

    def record_swap(self, now: float, req: SwapReport) -> None:
        """An engine reports a swap (only known models are accepted; see ``record_fetch``)."""
        self._model(req.model)

    def metrics_view(self, now: float) -> dict:
        """What ``/metrics`` shows of the state: per model, its latest complete version,
        version counter, versions with a replica, replicas by state (``fenced``: tombstones
        of dropped workers that leases still name), bytes held by serving complete replicas,
        open leases; the worker count, and how often a pause gave every worker a fresh ttl."""
        models: dict[str, dict] = {}
        for name, m in self.models.items():
            models[name] = {"latest": self.latest(name), "counter": m.counter, "held_versions": set(),
                            "replicas": {"serving": 0, "partial": 0, "suspect": 0, "draining": 0, "fenced": 0},
                            "bytes": 0, "leases": 0}
        for r in self.replicas.values():
            mv = models.get(r.model)
            if mv is None:
                continue
            state = "draining" if r.draining else "suspect" if r.suspect_until > now else \
                "partial" if r.chunks is not None else "serving"
            mv["replicas"][state] += 1
            if state == "serving":
                mv["held_versions"].add(r.version)
                li = self.models[r.model].versions[r.version].layouts.get(r.layout)
                man = li.manifests.get(r.shard) if li is not None else None
                mv["bytes"] += man.nbytes if man is not None else 0
        for r in self.tombstones.values():
            if r.model in models:
                models[r.model]["replicas"]["fenced"] += 1
        for l in self.leases.values():
            if l.expires >= now and l.model in models:
                models[l.model]["leases"] += 1
        for mv in models.values():
            mv["held_versions"] = len(mv["held_versions"])
        return {"workers": len(self.workers), "models": models, "pauses": self.pauses}

    # ----------------------------------------------------------------- views
    def status(self, now: float) -> dict:
        """Everything ``tensorhub status`` shows."""
        models = []
        for name, m in sorted(self.models.items()):
            versions = []
            for v, vi in sorted(m.versions.items()):
                reps = [r for r in self.replicas.values() if r.model == name and r.version == v]
                versions.append({
                    "version": v,
                    "complete": vi.complete,
                    "layouts": {
                        lname: {"num_shards": li.num_shards, "complete": li.complete,
                                "nbytes": sum(mf.nbytes for mf in li.manifests.values())}
                        for lname, li in vi.layouts.items()
                    },
                    "replicas": [
                        {
                            "replica_id": r.replica_id, "worker_id": r.worker_id, "layout": r.layout,
                            "shard": r.shard, "draining": r.draining,
                            "suspect": r.suspect_until > now,
                            "endpoint": self.workers[r.worker_id].endpoint,
                            "locality": self.workers[r.worker_id].locality.model_dump(),
                            "open_leases": self._open_leases(now, {r.replica_id}),
                            "served": r.served,
                            "partial": None if r.chunks is None else f"{len(r.chunks)}/{r.num_chunks}",
                        }
                        for r in sorted(reps, key=lambda r: r.registered_at)
                    ],
                })
            models.append({"model": name, "counter": m.counter, "latest": self.latest(name), "versions": versions})
        return {
            "epoch": self.epoch,
            "models": models,
            "workers": [
                {"worker_id": w.worker_id, "endpoint": w.endpoint, "locality": w.locality.model_dump(),
                 "last_seen_ago": round(now - w.last_seen, 3), "served_leases": w.served_leases,
                 "served_bytes": w.served_bytes}
                for w in self.workers.values()
            ],
            "leases": [
                {"lease_id": l.lease_id, "worker_id": l.worker_id, "model": l.model, "version": l.version,
                 "layout": l.layout, "shard": l.shard, "replicas": list(l.replica_ids),
                 "expires_in": round(l.expires - now, 3)}
                for l in self.leases.values() if l.expires >= now
            ],
            # Fetches running now (readers report about once a second, fetches over a second).
            "fetches": [
                {"worker_id": f.worker_id, "model": f.model, "version": f.version, "layout": f.layout,
                 "shard": f.shard, "nbytes": f.nbytes, "total": f.total, "seconds": f.seconds,
                 "sources": dict(f.sources), "failed_sources": f.failed_sources,
                 "reported_ago": round(now - at, 3)}
                for f, at in self.fetching.values() if now <= at + FETCH_STALE
            ],
        }

