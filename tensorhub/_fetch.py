"""One read path: the :class:`Fetch` object behind ``Hub.fetch`` (reader process).

A fetch owns, from first lease to last release: its leases and how long each may be
trusted (``_fencing.LeaseClock``), its destination (``into`` or new memory) and that
memory's registration with the transport, the attempts (a lease that lapsed mid-read
re-reads only its chunks), and at the end either serving the result (a new replica in
``Holdings``) or cleaning up. Plain and pipelined reads are two *source policies* of this
one loop:

* :class:`PlainSources`: each lease names complete replicas; a failed source gets a new
  lease; chunks sized to stripe over every source (or the checksum grid).
* :class:`PipelinedSources` (default): leases may name partial replicas (readers still
  receiving); which chunks they hold is read from their chunk maps (``_chunkmap``), the
  lease refreshed at most once to learn newer partial replicas; with ``serve=True`` the
  destination is a partial replica from the start (registered with the first lease), its
  completed chunks marked ready in its own map (only under trusted leases) so others read
  them from here, and the release and complete registration are one call; a failed fetch
  retires the map and withdraws that partial replica, or quarantines its memory.

It works on small objects the Hub composes -- the :class:`~tensorhub._session.Session`
(API, identity, transport, lease ttl) and the :class:`~tensorhub._holdings.Holdings` --
never on the Hub itself.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from ._checksum import verifier
from ._exceptions import (
    ConflictError, FetchError, HubTimeoutError, LeaseLapsedError, NotFoundError, TensorHubError, TensorMismatchError,
)
from ._fencing import LeaseClock, renew_leases
from ._chunkmap import ChunkMap
from ._holdings import Held, Holdings, register_regions, unregister_regions
from ._metrics import Track, hub_metrics
from ._grid import grid_chunk_bytes
from ._pipeline import PipelinedReader, PSource
from ._planner import chunk_order
from ._reader import ShardReader, Source
from ._retry import jittered, next_delay
from ._session import Session
from ._tensors import allocate_like, check_into, coalesce
from .protocol import LeaseGrant, Manifest, shape_digest

__all__ = ["AHEAD_POLL", "Ahead", "NoNewVersion", "Reshaped", "Fetch", "FetchOptions", "Fetched", "PlainSources", "PipelinedSources", "QUARANTINE",
           "acquire_lease", "release_lease", "release_checked", "select"]

logger = logging.getLogger(__name__)

#: Batches in flight per source, and the smallest chunk worth striping.
DEPTH = 2
MIN_CHUNK = 4 << 20
#: Seconds past a fetch's deadline its coordinator calls (release, register) may still retry.
RELEASE_GRACE = 2.0
#: Destination memory a hung transfer or a peer may still use: never freed by us.
QUARANTINE: list[Any] = []


class Fetched(dict):
    """What ``fetch`` returns: ``name -> tensor``, plus where the bytes came from.

    Attributes: ``version``, ``layout``, ``shard``, ``nbytes``, ``seconds``, ``gbps``
    (GB/s), ``sources`` (worker id -> bytes read from it), ``failed_sources``, ``delta``
    and ``delta_skipped`` (delta versions).
    """

    version: int
    layout: str
    shard: int
    nbytes: int
    seconds: float
    sources: dict[str, int]
    failed_sources: list[str]
    #: How the bytes came through deltas (``_delta_path.DeltaRead``), or None: a full read.
    delta: Any = None
    #: Why a reader that had a base (an older version it serves, or ``fetch(base=)``) read
    #: the full version instead of deltas, in words; None otherwise.
    delta_skipped: Optional[str] = None

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    @classmethod
    def of(cls, out: Mapping[str, Any], version: int, layout: str, shard: int, nbytes: int, seconds: float,
           sources: dict[str, int], failed: list[str]) -> "Fetched":
        f = cls(out)
        f.version, f.layout, f.shard, f.nbytes, f.seconds = version, layout, shard, nbytes, seconds
        f.sources, f.failed_sources = sources, failed
        return f


@dataclass(frozen=True)
class FetchOptions:
    """The Hub's read settings (resolved once when it was built)."""

    max_sources: int
    chunk_bytes: int
    progress_timeout: float
    checksum: str


# ---------------------------------------------------------------------- leases
def acquire_lease(session: Session, model: str, version: int, layout: str, shard: int, excluded: set[str],
                  deadline: float, clock: Optional[LeaseClock], max_sources: int) -> LeaseGrant:
    """A (plain) lease on the shard; waits (until ``deadline``) while no replica is
    serving. ``clock`` learns how long the reader may trust it (docs/consistency.md)."""
    delay = 0.05
    while True:
        try:
            sent = time.monotonic()
            body = {
                "worker_id": session.worker_id, "model": model, "version": version, "layout": layout,
                "shard": shard, "max_sources": max_sources, "exclude": sorted(excluded)[:1024],
                "request_id": secrets.token_hex(12),  # a retried request gets the same lease
                "manifest": False,  # read once by version (Session.manifest), not with every lease
            }
            grant = session.lease(body)
            if grant.version != version:
                raise FetchError(f"asked for {model!r} v{version} but the lease is for v{grant.version}")
            if clock is not None:
                clock.granted(grant.lease_id, sent + grant.granted_after, grant.ttl)
            return grant
        except ConflictError as e:
            if e.code != "no_replica" or time.monotonic() + delay > deadline:
                raise FetchError(f"cannot fetch {model!r} v{version}: {e.message}") from e
        time.sleep(jittered(delay))
        delay = next_delay(delay)


def release_lease(session: Session, lease_id: str) -> bool:
    """Release a lease; True if the coordinator says it stayed valid."""
    try:
        return session.api.release_lease(lease_id)
    except NotFoundError:
        return False


def release_checked(session: Session, leases: list[str], clock: LeaseClock) -> list[str]:
    """Release a read's leases; returns those whose bytes cannot be trusted: the
    coordinator says the lease lapsed, or the reader's own bound passed first."""
    lapsed = []
    for lid in leases:
        trusted = clock.trusted(lid)  # the bytes are all in: judge before the round trip
        valid = release_lease(session, lid)
        if not (trusted and valid):
            if valid:
                logger.warning("lease %s: released in time for the coordinator, but past this reader's own "
                               "bound (last grant/renewal + ttl): re-reading", lid)
            lapsed.append(lid)
    leases.clear()
    return lapsed


def release_all(session: Session, leases: list[str]) -> None:
    for lid in leases:
        try:
            release_lease(session, lid)
        except TensorHubError:
            pass
    leases.clear()


def select(manifest: Manifest, names: list[str], model: str, version: int) -> list[int]:
    """Indices (manifest order) of ``names``; the error names the first unknown one."""
    index = {t.name: i for i, t in enumerate(manifest.tensors)}
    missing = [n for n in names if n not in index]
    if missing:
        raise TensorMismatchError(f"{model!r} v{version} has no tensor {missing[0]!r} "
                                  f"({len(missing)} of the {len(names)} names asked for are unknown)")
    return sorted(index[n] for n in names)


# ---------------------------------------------------------------------- source policies
class PlainSources:
    """Complete replicas only; a new lease whenever the reader needs sources."""

    label = ""

    def __init__(self, fetch: "Fetch") -> None:
        self.f = fetch

    def first_grant(self) -> LeaseGrant:
        f = self.f
        g = acquire_lease(f.session, f.model, f.version, f.layout, f.shard, set(), f.deadline, f.trust,
                          f.opts.max_sources)
        f.leases.append(g.lease_id)
        return g

    def reader(self, grant: LeaseGrant, manifest: Manifest, local: list[int], out: Mapping[str, Any]) -> ShardReader:
        f = self.f
        # Enough chunks to stripe over every source with a few batches in flight each.
        spread = -(-manifest.nbytes // (2 * DEPTH * max(1, len(grant.replicas))))
        chunk = min(f.opts.chunk_bytes, max(MIN_CHUNK, spread))
        return ShardReader(f.transport, [s.nbytes for s in manifest.tensors], local, chunk_bytes=chunk,
                           depth=DEPTH, progress_timeout=f.opts.progress_timeout,
                           checksums=verifier(f.manifest, out, f.opts.checksum, f.keep))

    def sources(self, grant: Optional[LeaseGrant], excluded: set[str]) -> list[Source]:
        f = self.f
        g = grant if grant is not None else acquire_lease(f.session, f.model, f.version, f.layout, f.shard,
                                                          excluded, f.deadline, f.trust, f.opts.max_sources)
        if g.lease_id not in f.leases:
            f.leases.append(g.lease_id)
        keep = f.keep
        return [Source(r.replica_id, r.worker_id, r.endpoint,
                       tuple(r.addresses) if keep is None else tuple(r.addresses[i] for i in keep), g.lease_id, r.cost,
                       secret=g.secret, host=r.locality.host)
                for r in g.replicas]

    def offers(self) -> bool:
        """Whether the first lease also registers the reader's partial replica (then the
        lease is asked for after the destination exists: ``first_grant_serving``)."""
        return False

    def started(self, grant: LeaseGrant) -> None:
        pass

    def tick(self) -> None:
        pass

    def attempt_done(self) -> None:
        pass

    def todo(self, lapsed: list[str], stats: Any) -> list[int]:
        return sorted(c for lid in lapsed for c in stats.chunks_by_lease.get(lid, []))

    def failed(self, failure: Optional[BaseException]) -> None:
        pass


class PipelinedSources(PlainSources):
    """Partial replicas too (see the module docstring and ``_pipeline``)."""

    label = "pipelined"

    def __init__(self, fetch: "Fetch") -> None:
        super().__init__(fetch)
        self.cur: Optional[str] = None
        self.no_source = ""
        self.partial_id: Optional[str] = None
        self.last: list[PSource] = []
        #: Chunks marked ready in our chunk map (read under trusted leases: kept on a lapse).
        self.reported: set[int] = set()
        self.sent = 0  # completed chunks looked at so far
        self.seed = False
        #: Our partial replica's chunk map (``_chunkmap``; None: not serving while receiving).
        self.map: Optional[ChunkMap] = None
        #: The partial replica was offered with the first lease (``first_grant_serving``).
        self.offered = False
        self.offer: Optional[dict] = None
        self.grid = 0

    def _acquire(self, excluded: set[str], wait: bool) -> Optional[LeaseGrant]:
        f, offer = self.f, self.offer
        delay = 0.05
        ahead = f.ahead if self.cur is None and offer is not None else None
        rid = secrets.token_hex(12)  # (asked ahead: every poll is the same request)
        while True:
            body: dict[str, Any] = {"worker_id": f.session.worker_id, "model": f.model, "version": f.version,
                                    "layout": f.layout, "shard": f.shard, "max_sources": f.opts.max_sources,
                                    "exclude": sorted(excluded)[:1024], "pipelined": True, "lease_id": self.cur,
                                    "manifest": False}
            if self.cur is None:
                body["request_id"] = rid  # a retried request gets the same lease
                if offer is not None:
                    body["serve"] = offer
                if ahead is None:
                    rid = secrets.token_hex(12)
            sent = time.monotonic()
            try:
                if ahead is not None:  # held until a version >= f.version is published
                    left = ahead.until - time.monotonic()
                    if left <= 0:
                        raise NoNewVersion(f"no version of {f.model!r} newer than v{f.version - 1} was published "
                                           f"within {ahead.wait:g}s")
                    sent = time.monotonic()
                    g = f.session.lease(dict(body, ahead=True), wait=round(min(left, AHEAD_POLL), 3),
                                        shaped=ahead.manifest)
                    if g is None:
                        continue
                else:
                    g = f.session.lease(body)
            except ConflictError as e:
                if e.code == "lease_lapsed" and self.cur is not None:
                    self.cur = None  # its chunks are re-read after release says so
                    continue
                why = f"cannot fetch {f.model!r} v{f.version}: {e.message}"
                if e.code != "no_replica" or (wait and time.monotonic() + delay > f.deadline):
                    raise FetchError(why) from e
                if not wait:
                    self.no_source = why
                    return None
                time.sleep(jittered(delay))
                delay = next_delay(delay)
                continue
            if g.version != f.version and not (ahead is not None and g.version > f.version):
                raise FetchError(f"asked for {f.model!r} v{f.version} but the lease is for v{g.version}")
            if g.lease_id not in f.leases:
                f.leases.append(g.lease_id)
            f.trust.granted(g.lease_id, sent + g.granted_after, g.ttl)
            self.cur = g.lease_id
            return g

    def first_grant(self) -> LeaseGrant:
        g = self._acquire(set(), True)
        assert g is not None
        self.seed = g.seed
        return g

    def offers(self) -> bool:
        return self.f.serve and self.f.names is None

    def first_grant_serving(self) -> LeaseGrant:
        """The first lease, registering our partial replica (destination and chunk map)
        with it: one call, and readers that ask after us are sent to us at once."""
        f, r, m = self.f, self.r, self.map
        assert f.held is not None and m is not None
        f.held.chunkmap = m
        f.held.extra.append(m)
        digest = shape_digest(f.manifest) if f.ahead is not None else f.session.digest(f.manifest)
        offer = {"manifest_digest": digest, **f.session.addresses_of(f.held),
                 "chunk_bytes": self.grid, "num_chunks": len(r.chunks), "status_addr": m.addr, "status_tag": m.tag}
        self.offer = offer  # asked with the new lease (not with refreshes)
        try:
            g = self._acquire(set(), True)
        finally:
            self.offer = None
        assert g is not None
        self.seed = g.seed
        r.order = chunk_order(len(r.chunks), g.start, g.reverse)
        self.offered = True
        self.partial_id = g.partial_replica_id
        if self.partial_id is None:
            logger.info("%s v%d: worker %s not serving while receiving: %s", f.model, f.version,
                        f.session.worker_id, g.serve_refused or "the coordinator did not register it")
        return g

    def reader(self, grant: Optional[LeaseGrant], manifest: Manifest, local: list[int],
               out: Mapping[str, Any]) -> ShardReader:
        f = self.f
        self.grid = grant.chunk_bytes if grant is not None else grid_chunk_bytes(manifest.nbytes)
        self.r = PipelinedReader(f.transport, [s.nbytes for s in manifest.tensors], local, chunk_bytes=self.grid,
                                 start=grant.start if grant is not None else 0.0,
                                 reverse=grant.reverse if grant is not None else False,
                                 depth=DEPTH, progress_timeout=f.opts.progress_timeout,
                                 checksums=verifier(f.manifest, out, f.opts.checksum))
        if f.serve:  # its chunk map, registered next to the data (freed with it)
            self.map = ChunkMap(len(self.r.chunks))
            register_regions(f.transport, [self.map.region])
            f.regions = f.regions + [self.map.region]
        return self.r

    def started(self, grant: LeaseGrant) -> None:
        f = self.f
        if f.serve and f.held is not None and self.map is not None and not self.offered:
            f.held.chunkmap = self.map
            f.held.extra.append(self.map)
            try:
                self.partial_id = f.session.register_read(
                    f.held, partial=True, chunk_bytes=grant.chunk_bytes, num_chunks=len(self.r.chunks),
                    status_addr=self.map.addr, status_tag=self.map.tag).replica_id
            except TensorHubError as e:
                logger.info("%s v%d: worker %s not serving while receiving: %s", f.model, f.version,
                            f.session.worker_id, e)
        if self.partial_id and f.held is not None:  # same-host readers may copy its ready chunks
            f.holdings.receiving[self.partial_id] = f.held
        if grant.seed:
            logger.info("%s v%d: %s seeds datacenter %r (%s)", f.model, f.version, f.session.worker_id,
                        f.session.locality.datacenter, grant.reason)

    def sources(self, grant: Optional[LeaseGrant], excluded: set[str]) -> list[Source]:
        g = grant if grant is not None else self._acquire(excluded, False)
        r = self.r
        r.why_no_source = self.no_source if g is None or not g.replicas else ""
        # Sources an earlier answer gave under the same lease stay usable (the lease still
        # names them, e.g. a holder now draining waits for us), unless they failed.
        kept = [s for s in self.last if s.lease_id == self.cur and s.replica_id not in excluded]
        if g is None:
            return list(kept)
        r.claimed = frozenset(g.claimed)
        r.reserved = None if g.reserved is None else frozenset(g.reserved)
        r.follow_plan(g.stripe_sources if g.stripes else None, g.refresh_after)
        fresh = [PSource(x.replica_id, x.worker_id, x.endpoint, tuple(x.addresses), g.lease_id, x.cost,
                         None if x.chunks is None else frozenset(x.chunks), frozenset(x.coming),
                         x.status_addr, x.status_tag or 0, x.num_chunks, secret=g.secret, host=x.locality.host)
                 for x in g.replicas]
        ids = {s.replica_id for s in fresh}
        self.last[:] = fresh + [s for s in kept if s.replica_id not in ids]
        return list(self.last)

    def publish_progress(self, force: bool = False) -> None:
        """Mark newly completed chunks ready in our chunk map -- only those read under a
        lease still trusted on this reader's clock (the others are re-read at release).
        Nothing goes to the coordinator: other readers read the map from our memory."""
        f, r = self.f, self.r
        if self.map is not None and r.receiving != self.map.coming:
            self.map.receiving(set(r.receiving))  # a hint for others: leave these to us
        if self.map is None or len(r.completed) == self.sent:
            return
        new = r.completed[self.sent:]
        self.sent = len(r.completed)
        for c, lid in new:
            if f.trust.trusted(lid):  # past the reader's bound: never offered (re-read at release)
                self.map.mark(c)
                self.reported.add(c)

    def tick(self) -> None:
        self.publish_progress()

    def attempt_done(self) -> None:
        self.publish_progress(force=True)

    def todo(self, lapsed: list[str], stats: Any) -> list[int]:
        self.cur = None
        # Chunks already offered to others were read while their lease was valid: keep them.
        todo = sorted({c for lid in lapsed for c in stats.chunks_by_lease.get(lid, [])} - self.reported)
        self.r.completed = [p for p in self.r.completed if p[0] in self.reported]
        self.sent = len(self.r.completed)
        return todo

    def failed(self, failure: Optional[BaseException]) -> None:
        """Withdraw the partial replica within the fetch's deadline; if the coordinator
        cannot confirm that no reader is left, quarantine the memory instead of freeing it."""
        f = self.f
        if self.map is not None:
            self.map.retire()  # readers that read its map from now on read nothing from it
        if self.partial_id is None or not f.regions:
            return
        pid = self.partial_id
        if withdraw(f.session, f.model, f.version, pid, until=f.deadline + RELEASE_GRACE):
            return
        keep = f.buf if f.buf is not None else f.out
        QUARANTINE.append(keep)
        why = (f"peers may still read it: the failed fetch of {f.model!r} v{f.version} could not confirm "
               f"that its partial replica {pid} drained")
        session = f.session
        f.holdings.quarantine.add(f.out, keep, why, regions=f.regions,
                                  withdraw=lambda: withdraw(session, f.model, f.version, pid, until=0.0, quiet=True))
        f.regions = []
        if f.into is not None and isinstance(failure, Exception):
            raise FetchError(f"{failure}; the `into` tensors are quarantined and must not be reused "
                             f"({why}; lifted once the coordinator confirms it)") from failure


def withdraw(session: Session, model: str, version: int, replica_id: str, until: float,
             quiet: bool = False) -> bool:
    """Unpublish a failed fetch's partial replica (only it: the worker may hold the version
    in other replicas); True once no reader holds a lease on it (False if that is not
    confirmed by ``until``, a ``time.monotonic()`` deadline)."""
    while True:
        try:
            r = session.as_worker(lambda api: api.unpublish(model, version, session.worker_id, [replica_id],
                                                            retry_timeout=2.0))
            if r.drained:
                return True
        except TensorHubError as e:
            logger.warning("withdrawing worker %s's partial replica of %s v%d: %s", session.worker_id, model,
                           version, e)
        if time.monotonic() > until:
            if quiet:
                return False
            logger.error("worker %s's partial replica of %s v%d did not drain; its memory is quarantined",
                         session.worker_id, model, version)
            return False
        time.sleep(0.05)


# ---------------------------------------------------------------------- the fetch
#: Seconds one held poll of a lease asked ahead lasts (then it is asked again, keeping its place).
AHEAD_POLL = 30.0


class NoNewVersion(HubTimeoutError):
    """Asked ahead (``Ahead``): no newer version was published within the wait."""


class Reshaped(FetchError):
    """Asked ahead: the version published has other tensors than the destination was laid
    out for; read it the usual way (``version``)."""

    def __init__(self, message: str, version: int) -> None:
        super().__init__(message)
        self.version = version


@dataclass(frozen=True)
class Ahead:
    """A fetch that subscribes ahead (``tensorhub._ahead``): its destination laid out by
    ``manifest`` (the version it holds), its lease asked before the version exists and held
    until ``until`` (``time.monotonic()``), then ``timeout`` seconds to read."""

    manifest: Manifest
    wait: float
    until: float
    timeout: float
    #: Called with the version once its lease is granted, before the read.
    on_bound: Optional[Callable[[int], None]] = None


class Fetch:
    """One read of (model, version, layout, shard) into ``into`` or new memory; see the
    module docstring. ``run()`` once; it returns a :class:`Fetched` or raises."""

    def __init__(self, session: Session, holdings: Holdings, opts: FetchOptions, model: str, version: int,
                 layout: str, shard: int, *, into: Optional[Mapping[str, Any]], serve: bool, deadline: float,
                 track: Track, names: Optional[list[str]] = None, pipelined: bool = True,
                 ahead: Optional[Ahead] = None) -> None:
        self.session, self.holdings, self.opts = session, holdings, opts
        #: Asked ahead: ``version`` is the lowest wanted, fixed by the grant (``_bind``).
        self.ahead = ahead
        self.model, self.version, self.layout, self.shard = model, version, layout, shard
        self.into, self.serve, self.deadline, self.track, self.names = into, serve, deadline, track, names
        self.policy: PlainSources = PipelinedSources(self) if pipelined and names is None else PlainSources(self)
        self.transport = session.transport()
        self.trust = LeaseClock()
        self.leases: list[str] = []
        self.keep: Optional[list[int]] = None
        self.regions: list[tuple[int, int]] = []
        self.buf: Any = None
        self.out: Any = None
        self.held: Optional[Held] = None
        #: The complete replica was registered with the last release (``_end_attempt``).
        self.registered = False

    def run(self) -> Fetched:
        if self.into is not None:  # refused before asking anyone (no lease, no manifest needed)
            self.holdings.check_not_served(self.into)
        # Serving while receiving: the destination first, then one call for the lease and
        # the partial replica (``PipelinedSources.first_grant_serving``).
        grant: Optional[LeaseGrant] = None if self.policy.offers() else self.policy.first_grant()
        #: The whole shard's manifest (final once registered: read once per version and kept).
        self.manifest = manifest = (grant.manifest if grant is not None else None) or \
            (self.ahead.manifest if self.ahead is not None else None) or \
            self.session.manifest(self.model, self.version, self.layout, self.shard)
        served = False
        failure: Optional[BaseException] = None
        try:
            if self.names is not None:
                self.keep = select(manifest, self.names, self.model, self.version)
                manifest = Manifest.model_construct(tensors=[manifest.tensors[i] for i in self.keep])
            if self.into is not None:
                local = check_into(manifest, self.into)  # served/quarantined: checked before the lease
                self.out = dict(self.into)
            else:
                self.buf, self.out = allocate_like(manifest)
                local = [t.data_ptr() for t in self.out.values()]
            wanted = coalesce([(a, s.nbytes) for a, s in zip(local, manifest.tensors)])
            register_regions(self.transport, wanted)
            self.regions = wanted
            reader = self.policy.reader(grant, manifest, local, self.out)
            self.held = Held(self.model, self.version, self.layout, self.shard,
                             grant.num_shards if grant is not None else 0, manifest, local,
                             self.regions, self.out, extra=[self.buf])
            if grant is None:
                grant = self.policy.first_grant_serving()  # type: ignore[attr-defined]
                self.held.num_shards = grant.num_shards
                if self.ahead is not None:
                    self._bind(grant)
            prog = self.track.start(self.session, self.model, self.version, self.layout, self.shard, manifest.nbytes)
            self.policy.started(grant)
            nbytes, seconds, total, failed = self._attempts(grant, reader, prog)
            if self.serve:
                if not self.registered:
                    self.held.replica_id = self.session.register_replica(self.held)
                self.holdings.hold(self.held)
                served = True
            logger.info("worker %s fetched %s v%d layout %s shard %d%s: %.1f MB in %.3fs (%.2f GB/s) from %s%s%s",
                        self.session.worker_id, self.model, self.version, self.layout, self.shard,
                        f" ({self.policy.label}{', seeder' if getattr(self.policy, 'seed', False) else ''})"
                        if self.policy.label else "",
                        nbytes / 1e6, seconds, nbytes / seconds / 1e9 if seconds else 0.0, total,
                        f"; failed replicas {failed}" if failed else "",
                        f"; serving it as replica {self.held.replica_id}" if served else "")
            return Fetched.of(self.out, self.version, self.layout, self.shard, nbytes, seconds, total, failed)
        except BaseException as e:
            failure = e
            raise
        finally:
            self.holdings.done_receiving(self.held)  # served from now on as a held replica, or not at all
            if not served:
                release_all(self.session, self.leases)
                try:
                    self.policy.failed(failure)
                finally:
                    unregister_regions(self.transport, self.regions)
            # Break the fetch <-> policy cycle: new memory freed by the caller is then freed
            # (reused, page faults already paid: transport/_shm) at once, not at the next gc.
            self.policy.f = None  # type: ignore[assignment]

    def _bind(self, grant: LeaseGrant) -> None:
        """Asked ahead, granted: the version is ``grant.version``; its manifest (read once)
        must lay out exactly as the destination, else ``Reshaped`` (the caller reads it the
        usual way). Its checksums replace the held version's."""
        a, self.ahead = self.ahead, None
        assert a is not None and self.held is not None
        v = self.version = self.held.version = self.track.version = grant.version
        self.deadline = time.monotonic() + a.timeout
        m = self.session.manifest(self.model, v, self.layout, self.shard)
        r = self.policy.r  # type: ignore[attr-defined]
        check = verifier(m, self.out, self.opts.checksum)
        if shape_digest(m) != shape_digest(self.manifest) or (check is not None and check.chunks != r.chunks):
            raise Reshaped(f"{self.model!r} v{v} has other tensors than v{v - 1}'s destination", v)
        self.manifest = self.held.manifest = m
        r.checksums = check
        if a.on_bound is not None:
            a.on_bound(v)

    def _end_attempt(self) -> list[str]:
        """Release the attempt's leases; returns those whose bytes cannot be trusted.

        Serving the result (a whole shard), with every lease still trusted on this
        reader's clock: the release and the complete replica's registration are one call
        (registered only if every lease stayed valid for the coordinator too)."""
        h = self.held
        if not (self.serve and h is not None and self.keep is None and self.leases
                and all(self.trust.trusted(lid) for lid in self.leases)):
            return release_checked(self.session, self.leases, self.trust)
        leases = list(self.leases)
        self.leases.clear()
        try:
            r = self.session.register_read(h, release=leases)
        except TensorHubError:
            release_all(self.session, leases)
            raise
        released = r.released or {}
        lapsed = [lid for lid in leases if not released.get(lid, False)]
        if not lapsed and r.replica_id:
            h.replica_id, self.registered = r.replica_id, True
        return lapsed

    def _attempts(self, grant: LeaseGrant, reader: ShardReader, prog: Any) -> tuple[int, float, dict, list]:
        """Read until every chunk was read under a lease still trusted at its release."""
        first = [grant]

        def sources(excluded: set[str]) -> list[Source]:
            return self.policy.sources(first.pop() if first else None, excluded)

        def report(src: Source, reason: str) -> None:
            hub_metrics().source_failures.labels(self.model).inc()
            self.session.as_worker(lambda api: api.report_replica(src.replica_id, self.session.worker_id, reason,
                                                                  retry_timeout=2.0))

        renew_every = max(0.1, self.session.lease_ttl / 3)
        last_renew = [time.monotonic()]

        def tick() -> None:
            prog.tick(reader.live)
            if time.monotonic() - last_renew[0] >= renew_every:
                last_renew[0] = time.monotonic()
                renew_leases(self.session.api, self.leases, self.trust, self.session.lease_ttl)
            self.policy.tick()

        todo: Optional[list[int]] = None
        total: dict[str, int] = {}
        failed: list[str] = []
        nbytes, seconds = 0, 0.0
        for _ in range(3):
            try:
                stats = reader.run(sources, report, chunks=todo, deadline=self.deadline, on_tick=tick)
            except BaseException as e:
                if not reader.stuck:
                    raise
                self.regions = []  # a hung batch may still write there: never unregister it
                raise quarantine_stuck(self.holdings, e, self.buf, self.out, self.into) from e
            nbytes += stats.nbytes
            seconds += stats.seconds
            failed += stats.failed_sources
            for w, n in stats.bytes_by_source.items():
                total[w] = total.get(w, 0) + n
            prog.tick(stats)
            prog.attempt_done()
            self.policy.attempt_done()
            lapsed = self._end_attempt()
            if not lapsed:
                return nbytes, seconds, total, failed
            todo = self.policy.todo(lapsed, stats)
            logger.warning("%s v%d: worker %s's lease(s) %s lapsed during the read; re-reading %d chunk(s)",
                           self.model, self.version, self.session.worker_id, lapsed, len(todo))
            first.clear()
            if not todo:
                return nbytes, seconds, total, failed
        raise LeaseLapsedError(f"{self.model!r} v{self.version}: leases kept lapsing; bytes discarded")


def quarantine_stuck(holdings: Holdings, e: BaseException, buf: Any, out: Any, into: Any) -> FetchError:
    """A read whose batch never ended: keep its destination alive forever (never freed or
    reused by us; ``fetch(into=...)`` refuses it) and say so in the error the caller raises."""
    QUARANTINE.append(buf if buf is not None else out)
    if into is not None:
        holdings.quarantine.add(into, into, "a hung source may still write into it (a fetch's transfer never ended)")
    return FetchError(f"{e}; a hung source may still write into the destination"
                      + (": the `into` tensors are quarantined and must not be reused" if into is not None else ""))


def copy_held(held: Held, into: Optional[Mapping[str, Any]], names: Optional[list[str]], holdings: Holdings,
              worker_id: str) -> Fetched:
    """A fetch of what this process holds already: no transfer (a copy into ``into``)."""
    model, version, layout, shard = held.key
    if names is not None:  # part of what we hold: copy it
        keep = select(held.manifest, names, model, version)
        part = Manifest.model_construct(tensors=[held.manifest.tensors[i] for i in keep])
        if into is None:
            _, into = allocate_like(part)
        check_into(part, into)
        holdings.check_not_served(into)
        for spec in part.tensors:
            into[spec.name].copy_(held.tensors[spec.name])
        return Fetched.of(dict(into), version, layout, shard, part.nbytes, 0.0, {worker_id: part.nbytes}, [])
    if into is None:
        return Fetched.of(dict(held.tensors), version, layout, shard, 0, 0.0, {}, [])
    check_into(held.manifest, into)
    holdings.check_not_served(into)
    for name, t in held.tensors.items():
        into[name].copy_(t)
    return Fetched.of(dict(into), version, layout, shard, held.manifest.nbytes, 0.0,
                      {worker_id: held.manifest.nbytes}, [])
