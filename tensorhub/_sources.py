"""Where a read's bytes come from: its leases (``acquire_lease`` and the releases that
judge whether the bytes can be trusted) and the two *source policies* of the one read loop
(``_fetch.Fetch``):

* :class:`PlainSources`: each lease names complete replicas; a failed source gets a new
  lease; chunks sized to stripe over every source (or the checksum grid).
* :class:`PipelinedSources` (default): leases may name partial replicas (readers still
  receiving); which chunks they hold is read from their chunk maps (``_chunkmap``), the
  lease refreshed at most once to learn newer partial replicas; with ``serve=True`` the
  destination is a partial replica from the start (registered with the first lease), its
  completed chunks marked ready in its own map (only under trusted leases) so others read
  them from here, and the release and complete registration are one call; a failed fetch
  retires the map and withdraws that partial replica (``withdraw``), or quarantines its memory.

A policy works on the ``Fetch`` it was made for (its session, destination, leases, clock).
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any, Mapping, Optional

from ._checksum import verifier
from ._chunkmap import ChunkMap
from ._exceptions import ConflictError, FetchError, HubTimeoutError, NotFoundError, TensorHubError
from ._fencing import LeaseClock
from ._grid import grid_chunk_bytes
from ._holdings import register_regions
from ._pipeline import PipelinedReader, PSource
from ._planner import chunk_order
from ._reader import ShardReader, Source, forgive
from ._retry import jittered, next_delay
from ._session import Session
from .protocol import LeaseGrant, Manifest, shape_digest

__all__ = ["AHEAD_POLL", "DEPTH", "MIN_CHUNK", "NoNewVersion", "PlainSources", "PipelinedSources", "QUARANTINE",
           "RELEASE_GRACE", "acquire_lease", "release_all", "release_checked", "release_lease", "withdraw"]

logger = logging.getLogger(__name__)

#: Batches in flight per source, and the smallest chunk worth striping.
DEPTH = 2
MIN_CHUNK = 4 << 20
#: Seconds past a fetch's deadline its coordinator calls (release, register) may still retry.
RELEASE_GRACE = 2.0
#: Destination memory a hung transfer or a peer may still use: never freed by us.
QUARANTINE: list[Any] = []
#: Seconds one held poll of a lease asked ahead lasts (then it is asked again, keeping its place).
AHEAD_POLL = 30.0


class NoNewVersion(HubTimeoutError):
    """Asked ahead (``Ahead``): no newer version was published within the wait."""


# ---------------------------------------------------------------------- leases
def acquire_lease(session: Session, model: str, version: int, layout: str, shard: int, excluded: set[str],
                  deadline: float, clock: Optional[LeaseClock], max_sources: int, *, slices: bool = False) -> LeaseGrant:
    """A (plain) lease on the shard; waits (until ``deadline``) while no replica is
    serving. ``clock`` learns how long the reader may trust it (docs/consistency.md).
    ``slices``: the caller reads a version published as slices itself (``ReadSlices`` is
    raised when the answer says the version is laid out so); others get the refusal."""
    delay = 0.05
    while True:
        forgive(excluded)
        try:
            sent = time.monotonic()
            body = {
                "worker_id": session.worker_id, "model": model, "version": version, "layout": layout,
                "shard": shard, "max_sources": max_sources, "exclude": sorted(excluded)[:1024],
                "request_id": secrets.token_hex(12),  # a retried request gets the same lease
                "manifest": False,  # read once by version (Session.manifest), not with every lease
            }
            if slices:
                body["slices"] = True  # (the coordinator answers it for hf shard 0 only)
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


# ---------------------------------------------------------------------- source policies
class PlainSources:
    """Complete replicas only; a new lease whenever the reader needs sources."""

    label = ""

    def __init__(self, fetch: Any) -> None:  # the _fetch.Fetch it was made for (below it: no import)
        self.f = fetch

    def first_grant(self) -> LeaseGrant:
        f = self.f
        g = acquire_lease(f.session, f.model, f.version, f.layout, f.shard, set(), f.deadline, f.trust,
                          f.opts.max_sources, slices=True)
        f.leases.append(g.lease_id)
        return g

    def reader(self, grant: LeaseGrant, manifest: Manifest, local: list[int], out: Mapping[str, Any]) -> ShardReader:
        f = self.f
        # Enough chunks to stripe over every source with a few batches in flight each.
        spread = -(-manifest.nbytes // (2 * DEPTH * max(1, len(grant.replicas))))
        chunk = min(f.opts.chunk_bytes, max(MIN_CHUNK, spread))
        return ShardReader(f.transport, [s.nbytes for s in manifest.tensors], local, chunk_bytes=chunk,
                           depth=DEPTH, progress_timeout=f.opts.progress_timeout,
                           checksums=verifier(f.manifest, out, f.opts.checksum, f.keep),
                           forgive_after=f.session.suspect_ttl)

    def sources(self, grant: Optional[LeaseGrant], excluded: set[str]) -> list[Source]:
        f = self.f
        g = grant if grant is not None else acquire_lease(f.session, f.model, f.version, f.layout, f.shard,
                                                          excluded, f.deadline, f.trust, f.opts.max_sources,
                                                          slices=True)
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

    def __init__(self, fetch: Any) -> None:  # the _fetch.Fetch it was made for (below it: no import)
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
            forgive(excluded)
            body: dict[str, Any] = {"worker_id": f.session.worker_id, "model": f.model, "version": f.version,
                                    "layout": f.layout, "shard": f.shard, "max_sources": f.opts.max_sources,
                                    "exclude": sorted(excluded)[:1024], "pipelined": True, "lease_id": self.cur,
                                    "manifest": False}
            body["slices"] = True  # a version published as slices: the answer says so
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
                                 checksums=verifier(f.manifest, out, f.opts.checksum),
                                 forgive_after=f.session.suspect_ttl)
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
