"""Pipelined replication: the reader's chunk loop (reader process; the fetch that drives it,
its leases and its partial replica are ``_fetch.PipelinedSources``).

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
import time
from dataclasses import dataclass
from typing import Any, Optional

from ._exceptions import FetchError, TransferError
from ._planner import chunk_order, pick_chunk
from ._reader import ShardReader, Source
from .transport import PENDING

__all__ = ["PSource", "PipelinedReader"]

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
