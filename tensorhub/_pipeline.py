"""Pipelined replication: the reader side (runs in the reader process, called by ``Hub.fetch``).

A pipelined fetch:

1. asks for a ``pipelined`` lease: the coordinator (``_planner.choose_sources``) may send
   it to *partial* replicas (readers still receiving), each with the chunks it has reported
   complete, and tells it the shard's chunk grid and, across datacenters, whether it is its
   datacenter's seeder;
2. with ``serve=True``, registers its destination as a partial replica at once;
3. reads chunk by chunk (:class:`PipelinedReader`): a chunk is only ever asked of a source
   the coordinator said holds it (``_planner.pick_chunk``); when its sources hold nothing
   more it needs, it refreshes the lease (same lease id) to learn newer chunk sets;
4. reports the chunks it completed (``POST /v1/replicas/{id}/chunks``, every
   ``report_interval``), naming the lease they were read under; the coordinator refuses
   the report if that lease lapsed, so a chunk is offered to others only if it was read
   under a valid lease and is complete in memory (the transport said DONE, and its
   checksum matched when the manifest has checksums: ``_checksum``);
5. at the end registers the replica as complete (same replica id). If the fetch fails,
   the partial replica (only it) is unpublished (readers drained) before its memory is
   released; if that is not confirmed in time, the memory is quarantined: the error says
   so, ``fetch(into=...)`` refuses it, and the Hub keeps trying to withdraw it on its
   heartbeats (then the quarantine is lifted).

Leases are trusted only up to the reader's own bound (``_fencing.LeaseClock``): chunks
read under a lease past it are neither offered to others nor accepted.

Invariant: nobody reads a chunk that is not complete on its source (tests/test_pipelined.py).
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from ._checksum import verifier
from ._exceptions import ConflictError, FetchError, LeaseLapsedError, TensorHubError, TransferError
from ._fencing import LeaseClock, renew_leases
from ._planner import chunk_order, pick_chunk
from ._reader import ShardReader, Source
from ._tensors import allocate_like, check_into, coalesce
from ._wire import LeaseGrant
from .transport import PENDING

__all__ = ["PSource", "PipelinedReader", "fetch_pipelined"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PSource(Source):
    """A source plus the chunks it may be read for (None: all)."""

    chunks: Optional[frozenset] = None
    coming: frozenset = frozenset()


class PipelinedReader(ShardReader):
    """A :class:`ShardReader` that reads each chunk only from a source holding it.

    ``get_sources(excluded)`` is called whenever the reader has no source, or has idle
    sources and chunks none of them holds (at most every ``refresh_interval`` seconds);
    it returns the *current* sources (replacing the old ones). ``completed`` lists
    ``(chunk, lease_id)`` in completion order."""

    def __init__(self, transport: Any, sizes: list[int], local_addrs: list[int], *, start: float = 0.0,
                 reverse: bool = False, refresh_interval: float = 0.05, claim_patience: float = 0.5,
                 **kw: Any) -> None:
        super().__init__(transport, sizes, local_addrs, **kw)
        self.order = chunk_order(len(self.chunks), start, reverse)
        self.refresh_interval = refresh_interval
        self.completed: list[tuple[int, str]] = []
        #: Chunks in flight now (reported as ``coming``: a hint for other readers).
        self.receiving: set[int] = set()
        #: Chunks other readers nearby are receiving (from the last lease answer): left to them.
        self.claimed: frozenset = frozenset()
        #: After this long without a completed chunk and nothing in flight, ignore claims.
        self.claim_patience = claim_patience
        #: Chunks the coordinator reserved for us to read from complete replicas (None: any).
        self.reserved: Optional[frozenset] = None
        #: Set by ``get_sources`` when the coordinator had no source: the error at the deadline.
        self.why_no_source = ""

    def _loop(self, todo, inflight, failed, sources, stats, fail, get_sources, deadline, on_tick) -> None:
        wanted = set(todo)
        need = [c for c in self.order if c in wanted]
        last_refresh = float("-inf")
        last_progress = time.monotonic()
        sleep = self.poll_interval / 8
        while need or inflight:
            now = time.monotonic()
            if now > deadline:
                stuck = [f.source.endpoint for f in inflight.values() if f.abandoned]
                if need and not sources and not stuck and self.why_no_source:
                    raise FetchError(self.why_no_source)
                raise FetchError(
                    f"fetch deadline passed with {len(need) + len(inflight)} of {len(self.chunks)} chunks "
                    f"unread" + (f"; batches from {sorted(set(stuck))} never ended" if stuck else ""))
            busy = {s.replica_id: 0 for s in sources}
            for f in inflight.values():
                if not f.abandoned and f.source.replica_id in busy:
                    busy[f.source.replica_id] += 1
            # submit: nearest sources first, partial before complete; each takes a chunk it
            # holds, rarest first (_planner.pick_chunk)
            progressed = True
            while need and progressed:
                progressed = False
                for src in sorted(sources, key=lambda s: (s.cost, getattr(s, "chunks", None) is None,
                                                          busy[s.replica_id])):
                    if not need or busy[src.replica_id] >= self.depth:
                        continue
                    others = [getattr(o, "chunks", None) for o in sources if o is not src]
                    coming = self.claimed.union(*(getattr(o, "coming", frozenset()) for o in sources))
                    order = need
                    if not inflight and now - last_progress > self.claim_patience:
                        coming = frozenset()  # stalled: do not wait on others' promises any longer
                    elif getattr(src, "chunks", None) is None and self.reserved is not None:
                        order, coming = [c for c in need if c in self.reserved], frozenset()
                    c = pick_chunk(order, getattr(src, "chunks", None), others, set(), coming)
                    if c is None:
                        continue
                    need.remove(c)
                    try:
                        h = self.t.submit_read(src.endpoint, self._ops(c, src))
                    except TransferError as e:
                        need.insert(0, c)
                        fail(src, str(e))
                        break
                    nb = self.chunk_bytes(c)
                    inflight[h] = _inflight(c, src, now, now + self.progress_timeout + nb / self.min_rate)
                    self.receiving.add(c)
                    busy[src.replica_id] += 1
                    progressed = True
            # Refresh soon when a source idles for lack of chunks it holds, now and then otherwise
            # (newer partial replicas may be nearer or less loaded than the busy sources).
            idle = not sources or any(busy.get(s.replica_id, 0) < self.depth for s in sources)
            if need and now - last_refresh >= self.refresh_interval * (1 if idle else 2):
                last_refresh = now
                fresh = get_sources(set(failed))
                sources[:] = [s for s in fresh if s.replica_id not in failed]
            # poll
            done_any = False
            for h in list(inflight):
                f = inflight[h]
                st = self._poll_one(inflight, h, fail)
                if st == PENDING:
                    continue
                done_any = True
                last_progress = time.monotonic()
                self.receiving.discard(f.chunk)
                if st == 1 and not f.abandoned:
                    if self._accept(f, fail):  # verified before it is reported, so offered to others
                        self._count(stats, f)
                        self.completed.append((f.chunk, f.source.lease_id))
                    else:
                        need.insert(0, f.chunk)
                else:
                    if st != 1:
                        fail(f.source, f"read failed with code {st}")
                    need.insert(0, f.chunk)
            on_tick()
            if done_any:
                sleep = self.poll_interval / 8
            elif inflight or need:
                time.sleep(sleep)
                sleep = min(sleep * 2, self.poll_interval if inflight else self.refresh_interval / 2)


def _inflight(chunk: int, src: Source, submitted: float, deadline: float) -> Any:
    from ._reader import _Inflight

    return _Inflight(chunk, src, submitted, deadline)


def fetch_pipelined(hub: Any, model: str, version: int, layout: str, shard: int,
                    into: Optional[Mapping[str, Any]], serve: bool, deadline: float,
                    report_interval: float = 0.05, track: Any = None) -> Any:
    """``Hub.fetch`` for pipelined readers (see the module docstring). ``hub`` is the
    calling :class:`tensorhub.Hub`; ``track`` its progress bookkeeping; returns its ``Fetched``."""
    from . import hub as hub_mod
    from ._metrics import Track, hub_metrics

    track = track if track is not None else Track(None)

    transport = hub._ensure_transport()
    leases: list[str] = []
    cur: list[Optional[str]] = [None]
    no_source = [""]
    trust = LeaseClock()

    def acquire(excluded: set[str], wait: bool) -> Optional[LeaseGrant]:
        delay = 0.05
        while True:
            body = {"worker_id": hub.worker_id, "model": model, "version": version, "layout": layout,
                    "shard": shard, "max_sources": hub.max_sources, "exclude": sorted(excluded)[:1024],
                    "pipelined": True, "lease_id": cur[0]}
            if cur[0] is None:
                body["request_id"] = secrets.token_hex(12)  # a retried request gets the same lease
            sent = time.monotonic()
            try:
                g = LeaseGrant.model_validate(hub._as_worker("/v1/leases", body))
            except ConflictError as e:
                if e.code == "lease_lapsed" and cur[0] is not None:
                    cur[0] = None  # its chunks are re-read after release says so
                    continue
                why = f"cannot fetch {model!r} v{version}: {e.message}"
                if e.code != "no_replica" or (wait and time.monotonic() + delay > deadline):
                    raise FetchError(why) from e
                if not wait:
                    no_source[0] = why
                    return None
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            if g.version != version:
                raise FetchError(f"asked for {model!r} v{version} but the lease is for v{g.version}")
            if g.lease_id not in leases:
                leases.append(g.lease_id)
            trust.granted(g.lease_id, sent, g.ttl)
            cur[0] = g.lease_id
            return g

    grant = acquire(set(), True)
    assert grant is not None
    manifest = grant.manifest
    regions: list[tuple[int, int]] = []
    partial_id: Optional[str] = None
    served = False
    failure: Optional[BaseException] = None
    buf = None
    try:
        if into is not None:
            local = check_into(manifest, into)
            hub._check_not_served(into)
            out = dict(into)
        else:
            buf, out = allocate_like(manifest)
            local = [t.data_ptr() for t in out.values()]
        wanted = coalesce([(a, s.nbytes) for a, s in zip(local, manifest.tensors)])
        hub._register_regions(transport, wanted)
        regions = wanted
        reader = PipelinedReader(transport, [s.nbytes for s in manifest.tensors], local,
                                 chunk_bytes=grant.chunk_bytes, start=grant.start, reverse=grant.reverse,
                                 depth=hub_mod._DEPTH,
                                 progress_timeout=hub.progress_timeout,
                                 checksums=verifier(manifest, out, hub.checksum))
        prog = track.start(hub, model, version, layout, shard, manifest.nbytes)
        held = hub_mod._Held(model, version, layout, shard, grant.num_shards, manifest, local, regions, out,
                             extra=[buf])
        if serve:
            body = dict(hub._replica_body(held), partial=True, chunk_bytes=grant.chunk_bytes,
                        num_chunks=len(reader.chunks))
            try:
                partial_id = hub._as_worker("/v1/replicas", body)["replica_id"]
            except TensorHubError as e:
                logger.info("%s v%d: worker %s not serving while receiving: %s", model, version, hub.worker_id, e)
        if grant.seed:
            logger.info("%s v%d: %s seeds datacenter %r (%s)", model, version, hub.worker_id,
                        hub.locality.datacenter, grant.reason)
        first = [grant]
        last: list[PSource] = []

        def sources(excluded: set[str]) -> list[Source]:
            g = first.pop() if first else acquire(excluded, False)
            reader.why_no_source = no_source[0] if g is None or not g.replicas else ""
            # Sources an earlier answer gave under the same lease stay usable (the lease still
            # names them, e.g. a holder now draining waits for us), unless they failed.
            kept = [s for s in last if s.lease_id == cur[0] and s.replica_id not in excluded]
            if g is None:
                return list(kept)
            reader.claimed = frozenset(g.claimed)
            reader.reserved = None if g.reserved is None else frozenset(g.reserved)
            fresh = [PSource(r.replica_id, r.worker_id, r.endpoint, tuple(r.addresses), g.lease_id, r.cost,
                             None if r.chunks is None else frozenset(r.chunks), frozenset(r.coming))
                     for r in g.replicas]
            ids = {s.replica_id for s in fresh}
            last[:] = fresh + [s for s in kept if s.replica_id not in ids]
            return list(last)

        def report(src: Source, reason: str) -> None:
            hub_metrics().source_failures.labels(model).inc()
            hub._as_worker(f"/v1/replicas/{src.replica_id}/report",
                           {"worker_id": hub.worker_id, "reason": reason[:1000]}, retry_timeout=2.0)

        renew_every = max(0.1, hub._lease_ttl / 3)
        clock = {"renew": time.monotonic(), "report": 0.0}
        reported: set[int] = set()
        sent = [0]

        said_coming: list[frozenset] = [frozenset()]

        def publish_progress(force: bool = False) -> None:
            coming = frozenset(reader.receiving)
            if partial_id is None or (len(reader.completed) == sent[0] and coming == said_coming[0]):
                return
            if not force and time.monotonic() - clock["report"] < report_interval:
                return
            clock["report"] = time.monotonic()
            new = reader.completed[sent[0]:]
            sent[0] = len(reader.completed)
            by_lease: dict[str, list[int]] = {}
            for c, lid in new:
                if trust.trusted(lid):  # past the reader's bound: never offered (re-read at release)
                    by_lease.setdefault(lid, []).append(c)
            if not by_lease:
                by_lease[""] = []
            for lid, cs in by_lease.items():
                try:
                    hub.api.post(f"/v1/replicas/{partial_id}/chunks",
                                 {"worker_id": hub.worker_id, "chunks": cs, "lease_ids": [lid] if lid else [],
                                  "coming": sorted(coming)}, retry_timeout=2.0)
                    reported.update(cs)
                    said_coming[0] = coming
                except TensorHubError as e:  # lapsed lease or coordinator trouble: not offered
                    logger.debug("chunk report refused: %s", e)

        def tick() -> None:
            prog.tick(reader.live)
            now = time.monotonic()
            if now - clock["renew"] >= renew_every:
                clock["renew"] = now
                renew_leases(hub.api, leases, trust, hub._lease_ttl)
            publish_progress()

        todo: Optional[list[int]] = None
        total: dict[str, int] = {}
        failed: list[str] = []
        nbytes, seconds = 0, 0.0
        for attempt in range(3):
            try:
                stats = reader.run(sources, report, chunks=todo, deadline=deadline, on_tick=tick)
            except BaseException as e:
                if not reader.stuck:
                    raise
                regions = []  # a hung batch may still write there: never unregister it
                raise hub_mod._quarantine(hub, e, buf, out, into) from e
            nbytes += stats.nbytes
            seconds += stats.seconds
            failed += stats.failed_sources
            for w, n in stats.bytes_by_source.items():
                total[w] = total.get(w, 0) + n
            prog.tick(stats)
            prog.attempt_done()
            publish_progress(force=True)
            lapsed = hub._release_checked(leases, trust)
            cur[0] = None
            if not lapsed:
                break
            # Chunks already offered to others were read while their lease was valid: keep them.
            todo = sorted({c for lid in lapsed for c in stats.chunks_by_lease.get(lid, [])} - reported)
            logger.warning("%s v%d: worker %s's lease(s) %s lapsed during the read; re-reading %d chunk(s)",
                           model, version, hub.worker_id, lapsed, len(todo))
            reader.completed = [p for p in reader.completed if p[0] in reported]
            sent[0] = len(reader.completed)
            first.clear()
            if not todo:
                break
        else:
            raise LeaseLapsedError(f"{model!r} v{version}: leases kept lapsing; bytes discarded")
        if serve:
            held.replica_id = hub._register_replica(held)
            with hub._lock:
                hub._hold(held)
            served = True
        logger.info("worker %s fetched %s v%d layout %s shard %d (pipelined%s): %.1f MB in %.3fs (%.2f GB/s) "
                    "from %s%s%s", hub.worker_id, model, version, layout, shard, ", seeder" if grant.seed else "",
                    nbytes / 1e6, seconds, nbytes / seconds / 1e9 if seconds else 0.0, total,
                    f"; failed replicas {failed}" if failed else "",
                    f"; serving it as replica {held.replica_id}" if served else "")
        return hub._fetched(out, version, layout, shard, nbytes, seconds, total, failed)
    except BaseException as e:
        failure = e
        raise
    finally:
        if not served:
            hub._release_all(leases)
            # Withdraw within the fetch's deadline; if the coordinator cannot confirm that no
            # reader is left, the memory is quarantined instead of freed.
            if partial_id is not None and regions and not _withdraw(hub, model, version, partial_id,
                                                                     until=deadline + hub_mod._RELEASE_GRACE):
                keep = buf if buf is not None else out
                hub_mod._QUARANTINE.append(keep)
                pid = partial_id
                why = (f"peers may still read it: the failed fetch of {model!r} v{version} could not confirm "
                       f"that its partial replica {pid} drained")
                hub._quarantine.add(out, keep, why, regions=regions,
                                    withdraw=lambda: _withdraw(hub, model, version, pid, until=0.0, quiet=True))
                regions = []
                if into is not None and isinstance(failure, Exception):
                    raise FetchError(f"{failure}; the `into` tensors are quarantined and must not be reused "
                                     f"({why}; lifted once the coordinator confirms it)") from failure
            hub._unregister_regions(transport, regions)


def _withdraw(hub: Any, model: str, version: int, replica_id: str, until: float, quiet: bool = False) -> bool:
    """Unpublish a failed fetch's partial replica (only it: the worker may hold the version
    in other replicas); True once no reader holds a lease on it (False if that is not
    confirmed by ``until``, a ``time.monotonic()`` deadline)."""
    end = until
    while True:
        try:
            r = hub._as_worker(f"/v1/models/{model}/versions/{version}/unpublish",
                               {"worker_id": hub.worker_id, "replica_ids": [replica_id]}, retry_timeout=2.0)
            if r["drained"]:
                return True
        except TensorHubError as e:
            logger.warning("withdrawing worker %s's partial replica of %s v%d: %s", hub.worker_id, model, version, e)
        if time.monotonic() > end:
            if quiet:
                return False
            logger.error("worker %s's partial replica of %s v%d did not drain; its memory is quarantined",
                         hub.worker_id, model, version)
            return False
        time.sleep(0.05)
