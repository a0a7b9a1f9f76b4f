"""The coordinator's soft registry: live workers, the replicas they hold, read leases,
and the tombstones of dropped workers' leased replicas.

Soft: it lives only in memory and is rebuilt by the clients' re-registration after a
restart. Every lookup the decisions make is by an index (shard key, worker, replica),
so the work of one request does not grow with the fleet or with history: a lease
decision touches the replicas and leases of its own shard only.

This module keeps the indexes right and decides nothing; ``server.state`` decides.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator, NamedTuple, Optional

from ..protocol import AddressRuns, Locality

__all__ = ["ShardKey", "Worker", "Replica", "Lease", "Registry"]


class ShardKey(NamedTuple):
    """What a replica holds and a lease reads: one shard of one layout of one version."""

    model: str
    version: int
    layout: str
    shard: int


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
    addresses: "list[int] | AddressRuns"  # as registered (``_addresses.stored``)
    registered_at: float
    draining: bool = False
    suspect_until: float = 0.0
    served: int = 0  # leases granted on it
    #: Its worker was dropped while leases named it (``server.state`` invariant 8): fenced, never offered.
    tombstone: bool = False
    #: Pipelined replication: chunks reported complete while still receiving; None = complete.
    chunks: Optional[set[int]] = None
    num_chunks: int = 0
    coming: set[int] = field(default_factory=set)  # chunks it is receiving (a hint)
    #: A partial replica's chunk map in its holder's memory (``_chunkmap``): readers read
    #: which chunks it holds from there, and ``chunks`` stays empty (no reports).
    status_addr: Optional[int] = None
    status_tag: Optional[int] = None

    @property
    def key(self) -> ShardKey:
        return ShardKey(self.model, self.version, self.layout, self.shard)


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
    #: The key of the proofs a same-host reader shows holders (``protocol.lease_proof``),
    #: random per lease, answered (hex) only to the reader: ``lease_covers`` checks them.
    secret: bytes = b""

    @property
    def key(self) -> ShardKey:
        return ShardKey(self.model, self.version, self.layout, self.shard)


# An index maps a key to the ids under it, as a dict used as an ordered set: lookups
# answer in registration order, as a scan of the whole table would (the planner breaks
# ties by input order).
def _add(index: dict, key, item) -> None:
    index.setdefault(key, {})[item] = None


def _discard(index: dict, key, item) -> None:
    s = index.get(key)
    if s is not None:
        s.pop(item, None)
        if not s:
            del index[key]


def _on_shard(table: dict, ids: Iterable[str], key: ShardKey) -> Iterator:
    """The records of ``table`` named by ``ids`` (one worker's index) that are of ``key``."""
    return (x for x in map(table.__getitem__, ids) if x.key == key)


class Registry:
    """Workers, replicas, leases and tombstones, with their indexes.

    The dicts (``workers``, ``replicas``, ``leases``, ``tombstones``) are read freely;
    they are changed only through the methods here, which keep the indexes."""

    def __init__(self) -> None:
        self.workers: dict[str, Worker] = {}
        self.replicas: dict[str, Replica] = {}
        self.leases: dict[str, Lease] = {}
        #: Replicas of dropped workers that leases still name, by replica id.
        self.tombstones: dict[str, Replica] = {}
        self._replicas_of_shard: dict[ShardKey, dict[str, None]] = {}
        self._complete_of_shard: dict[ShardKey, dict[str, None]] = {}  # (chunks is None)
        self._replicas_of_worker: dict[str, dict[str, None]] = {}
        self._replicas_of_version: dict[tuple[str, int], dict[str, None]] = {}
        self._tombstones_of_version: dict[tuple[str, int], dict[str, None]] = {}
        self._leases_of_version: dict[tuple[str, int], dict[str, None]] = {}
        self._tombstones_of_shard: dict[ShardKey, dict[str, None]] = {}
        self._tombstones_of_worker: dict[str, dict[str, None]] = {}
        self._leases_of_shard: dict[ShardKey, dict[str, None]] = {}
        self._leases_of_worker: dict[str, dict[str, None]] = {}
        self._leases_naming: dict[str, dict[str, None]] = {}  # replica id -> ids of leases naming it
        #: replica id -> a lower bound of the expiry of the leases naming it: while it is
        #: not past, every one of them is unlapsed and ``load`` is their count, no scan.
        #: (Leases only ever get later expiries, by renewal: the bound stays a bound.)
        self._naming_floor: dict[str, float] = {}

    # ----------------------------------------------------------------- replicas
    def add_replica(self, r: Replica) -> None:
        self.replicas[r.replica_id] = r
        _add(self._replicas_of_shard, r.key, r.replica_id)
        if r.chunks is None:
            _add(self._complete_of_shard, r.key, r.replica_id)
        _add(self._replicas_of_worker, r.worker_id, r.replica_id)
        _add(self._replicas_of_version, (r.model, r.version), r.replica_id)

    def drop_replica(self, rid: str) -> Replica:
        r = self.replicas.pop(rid)
        _discard(self._replicas_of_shard, r.key, rid)
        _discard(self._complete_of_shard, r.key, rid)
        _discard(self._replicas_of_worker, r.worker_id, rid)
        _discard(self._replicas_of_version, (r.model, r.version), rid)
        return r

    def completed(self, r: Replica) -> None:
        """A partial replica now holds all of its shard (its ``chunks`` were set to None)."""
        if r.replica_id in self.replicas:
            _add(self._complete_of_shard, r.key, r.replica_id)

    def replicas_of_shard(self, key: ShardKey) -> list[Replica]:
        return [self.replicas[rid] for rid in self._replicas_of_shard.get(key, ())]

    def complete_of_shard(self, key: ShardKey) -> list[Replica]:
        """The shard's complete replicas (not its readers' partial ones: a lease under a
        plan needs these and its parents only, whatever the number of readers)."""
        return [self.replicas[rid] for rid in self._complete_of_shard.get(key, ())]

    def replica_of(self, worker_id: str, key: ShardKey) -> Iterator[Replica]:
        """The replicas of ``key`` that ``worker_id`` holds (usually one)."""
        return _on_shard(self.replicas, self._replicas_of_worker.get(worker_id, ()), key)

    def replicas_of_worker(self, worker_id: str) -> list[Replica]:
        return [self.replicas[rid] for rid in self._replicas_of_worker.get(worker_id, ())]

    def replicas_of_version(self, model: str, version: int) -> list[Replica]:
        return [self.replicas[rid] for rid in self._replicas_of_version.get((model, version), ())]

    # ----------------------------------------------------------------- tombstones
    def bury(self, r: Replica) -> None:
        """Keep a dropped worker's replica as a tombstone (fenced, never offered)."""
        r.draining = r.tombstone = True
        self.tombstones[r.replica_id] = r
        _add(self._tombstones_of_shard, r.key, r.replica_id)
        _add(self._tombstones_of_worker, r.worker_id, r.replica_id)
        _add(self._tombstones_of_version, (r.model, r.version), r.replica_id)

    def drop_tombstone(self, rid: str) -> None:
        r = self.tombstones.pop(rid)
        _discard(self._tombstones_of_shard, r.key, rid)
        _discard(self._tombstones_of_worker, r.worker_id, rid)
        _discard(self._tombstones_of_version, (r.model, r.version), rid)

    def tombstones_of_shard(self, key: ShardKey) -> list[Replica]:
        return [self.tombstones[rid] for rid in self._tombstones_of_shard.get(key, ())]

    def tombstones_of_worker(self, worker_id: str) -> list[Replica]:
        return [self.tombstones[rid] for rid in self._tombstones_of_worker.get(worker_id, ())]

    # ----------------------------------------------------------------- leases
    def add_lease(self, l: Lease) -> None:
        self.leases[l.lease_id] = l
        _add(self._leases_of_shard, l.key, l.lease_id)
        _add(self._leases_of_worker, l.worker_id, l.lease_id)
        _add(self._leases_of_version, (l.model, l.version), l.lease_id)
        for rid in l.replica_ids:
            self._name(rid, l)

    def _name(self, rid: str, l: Lease) -> None:
        _add(self._leases_naming, rid, l.lease_id)
        floor = self._naming_floor.get(rid)
        if floor is None or l.expires < floor:
            self._naming_floor[rid] = l.expires

    def name_replicas(self, l: Lease, ids: Iterable[str]) -> None:
        """A refreshed lease also names ``ids`` (it keeps naming the earlier ones)."""
        l.replica_ids = tuple(dict.fromkeys(l.replica_ids + tuple(ids)))
        for rid in l.replica_ids:
            self._name(rid, l)

    def drop_lease(self, lid: str) -> Optional[Lease]:
        l = self.leases.pop(lid, None)
        if l is None:
            return None
        _discard(self._leases_of_shard, l.key, lid)
        _discard(self._leases_of_worker, l.worker_id, lid)
        _discard(self._leases_of_version, (l.model, l.version), lid)
        for rid in l.replica_ids:
            _discard(self._leases_naming, rid, lid)
            if rid not in self._leases_naming:
                self._naming_floor.pop(rid, None)
        return l

    def leases_of_shard(self, key: ShardKey) -> list[Lease]:
        return [self.leases[lid] for lid in self._leases_of_shard.get(key, ())]

    def leases_of_worker(self, worker_id: str) -> list[Lease]:
        return [self.leases[lid] for lid in self._leases_of_worker.get(worker_id, ())]

    def shard_leases_of(self, worker_id: str, key: ShardKey) -> Iterator[Lease]:
        """The leases of ``worker_id`` on ``key``."""
        return _on_shard(self.leases, self._leases_of_worker.get(worker_id, ()), key)

    def leases_naming(self, rids: Iterable[str]) -> Iterator[Lease]:
        """The leases naming any of ``rids`` (each once)."""
        seen: set[str] = set()
        for rid in rids:
            for lid in self._leases_naming.get(rid, ()):
                if lid not in seen:
                    seen.add(lid)
                    yield self.leases[lid]

    def load(self, rid: str, now: float, but: Optional[Lease] = None) -> int:
        """How many unlapsed leases (other than ``but``) name replica ``rid``. O(1) while
        none of them has lapsed (the usual case); a scan otherwise, which renews the bound."""
        naming = self._leases_naming.get(rid)
        if not naming:
            return 0
        if self._naming_floor[rid] >= now:  # none lapsed
            return len(naming) - (but is not None and but.lease_id in naming and but.expires >= now)
        leases, n, floor = self.leases, 0, float("inf")
        for lid in naming:
            l = leases[lid]
            floor = min(floor, l.expires)
            if l.expires >= now and l is not but:
                n += 1
        self._naming_floor[rid] = floor  # the true minimum again (lapsed leases, once dropped, leave it)
        return n

    def leased(self, rid: str, now: float) -> bool:
        """Does an unlapsed lease name replica ``rid``?"""
        return any(self.leases[lid].expires >= now for lid in self._leases_naming.get(rid, ()))

    def in_use(self, model: str, version: int) -> bool:
        """Does anything still name the version: a replica (partial, draining or not), a
        tombstone, or a lease (lapsed ones too, until they are forgotten)?"""
        key = (model, version)
        return key in self._replicas_of_version or key in self._tombstones_of_version \
            or key in self._leases_of_version

    def open_leases(self, now: float, rids: Iterable[str]) -> int:
        """How many unlapsed leases name any of ``rids``."""
        return sum(1 for l in self.leases_naming(rids) if l.expires >= now)
