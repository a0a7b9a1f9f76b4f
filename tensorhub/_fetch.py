"""One read path: the :class:`Fetch` object behind ``Hub.fetch`` (reader process).

A fetch owns, from first lease to last release: its leases and how long each may be
trusted (``_fencing.LeaseClock``), its destination (``into`` or new memory) and that
memory's registration with the transport, the attempts (a lease that lapsed mid-read
re-reads only its chunks), and at the end either serving the result (a new replica in
``Holdings``) or cleaning up. Plain and pipelined reads are two *source policies* of this
one loop (``_sources``: ``PlainSources``, ``PipelinedSources``, and the lease calls).

It works on small objects the Hub composes -- the :class:`~tensorhub._session.Session`
(API, identity, transport, lease ttl) and the :class:`~tensorhub._holdings.Holdings` --
never on the Hub itself.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from ._checksum import verifier
from ._attempts import read_attempts
from ._exceptions import FetchError, NotFoundError, ReadSlices, TensorHubError, TensorMismatchError
from ._fencing import LeaseClock
from ._holdings import Held, Holdings, register_regions, unregister_regions
from ._metrics import Track
from ._reader import ReadStats, ShardReader, Source
from ._session import Session
from ._sources import QUARANTINE, PipelinedSources, PlainSources, release_all, release_checked
from ._tensors import allocate_like, check_into, coalesce
from .protocol import LeaseGrant, Manifest, shape_digest

__all__ = ["Ahead", "Reshaped", "Fetch", "FetchOptions", "Fetched", "copy_held", "quarantine_stuck", "select"]

logger = logging.getLogger(__name__)

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


def select(manifest: Manifest, names: list[str], model: str, version: int) -> list[int]:
    """Indices (manifest order) of ``names``; the error names the first unknown one."""
    index = {t.name: i for i, t in enumerate(manifest.tensors)}
    missing = [n for n in names if n not in index]
    if missing:
        raise TensorMismatchError(f"{model!r} v{version} has no tensor {missing[0]!r} "
                                  f"({len(missing)} of the {len(names)} names asked for are unknown)")
    return sorted(index[n] for n in names)


# ---------------------------------------------------------------------- the fetch
class Reshaped(FetchError):
    """Asked ahead: the version published has other tensors than the destination was laid
    out for; read it the usual way (``version``)."""

    def __init__(self, message: str, version: int) -> None:
        super().__init__(message)
        self.version = version


@dataclass(frozen=True)
class Ahead:
    """A fetch that subscribes ahead (``tensorhub.server.ahead``): its destination laid out by
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
            (self.ahead.manifest if self.ahead is not None else None) or self._manifest()
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
                self.buf, self.out = allocate_like(manifest, arena=self.session.config.samehost)
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
            st = self._attempts(grant, reader, prog)
            nbytes, seconds, total, failed = st.nbytes, st.seconds, st.bytes_by_source, st.failed_sources
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

    def _manifest(self) -> Manifest:
        """The shard's manifest, read before the lease (serving while receiving). A version
        with no ``hf`` manifest may have been published as slices: ``ReadSlices`` (the
        caller reads them, and says so if there are none)."""
        try:
            return self.session.manifest(self.model, self.version, self.layout, self.shard)
        except NotFoundError as e:
            if e.code != "unknown_layout" or (self.layout, self.shard) != ("hf", 0) or self.ahead is not None:
                raise
            raise ReadSlices(e.message) from e

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

    def _attempts(self, grant: LeaseGrant, reader: ShardReader, prog: Any) -> ReadStats:
        """Read until every chunk was read under a lease still trusted at its release
        (``_attempts.read_attempts``, this read's policy filling in its steps)."""
        first = [grant]

        def sources(excluded: set[str]) -> list[Source]:
            return self.policy.sources(first.pop() if first else None, excluded)

        def tick() -> None:
            prog.tick(reader.live)
            self.policy.tick()

        def end(stats: ReadStats) -> list[str]:
            prog.tick(stats)
            prog.attempt_done()
            self.policy.attempt_done()
            first.clear()  # a further attempt asks for its own lease
            return self._end_attempt()

        def stuck(e: BaseException) -> BaseException:
            self.regions = []  # a hung batch may still write there: never unregister it
            return quarantine_stuck(self.holdings, e, self.buf, self.out, self.into)

        return read_attempts(self.session, reader, sources, what=f"{self.model!r} v{self.version}",
                             model=self.model, leases=self.leases, clock=self.trust, deadline=self.deadline,
                             end=end, todo_of=self.policy.todo, tick=tick, stuck=stuck)


def quarantine_stuck(holdings: Holdings, e: BaseException, buf: Any, out: Any, into: Any) -> FetchError:
    """A read whose batch never ended: keep its destination alive forever (never freed or
    reused by us; ``fetch(into=...)`` refuses it) and say so in the error the caller raises."""
    QUARANTINE.append(buf if buf is not None else out)
    if into is not None:
        holdings.quarantine.add(into, into, "a hung source may still write into it (a fetch's transfer never ended)")
    return FetchError(f"{e}; a hung source may still write into the destination"
                      + (": the `into` tensors are quarantined and must not be reused" if into is not None else ""))


def copy_held(held: Held, into: Optional[Mapping[str, Any]], names: Optional[list[str]], holdings: Holdings,
              worker_id: str, arena: bool = True) -> Fetched:
    """A fetch of what this process holds already: no transfer (a copy into ``into``, else
    into new memory: an arena when ``arena``, ``HubConfig.samehost``)."""
    model, version, layout, shard = held.key
    if names is not None:  # part of what we hold: copy it
        keep = select(held.manifest, names, model, version)
        part = Manifest.model_construct(tensors=[held.manifest.tensors[i] for i in keep])
        if into is None:
            _, into = allocate_like(part, arena=arena)
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
