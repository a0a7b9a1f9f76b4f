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
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

from ._planner import chunk_order, pick_chunk
from ._reader import ShardReader, Source

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
        self._last_refresh = float("-inf")

    # Policy hooks (``ShardReader._loop``): the reader's own chunk order; each source is
    # asked only for chunks it holds, rarest first; sources refreshed now and then.
    @property
    def _idle_cap(self) -> float:
        return self.refresh_interval / 2

    def _order(self, todo) -> deque:
        wanted = set(todo)
        self._last_refresh = float("-inf")
        return deque(c for c in self.order if c in wanted)

    def _fill(self, need, sources, failed, get_sources) -> None:
        pass  # (``_refresh`` asks for sources, after the submit step)

    def _preference(self, src: Source, busy: int) -> tuple:
        """Nearest sources first, partial before complete, then the least busy."""
        return (src.cost, getattr(src, "chunks", None) is None, busy)

    def _pick(self, src: Source, need, sources, inflight, now: float) -> Optional[int]:
        """A chunk ``src`` holds, rarest first (``_planner.pick_chunk``)."""
        others = [getattr(o, "chunks", None) for o in sources if o is not src]
        coming = self.claimed.union(*(getattr(o, "coming", frozenset()) for o in sources))
        order = need
        if not inflight and now - self._last_progress > self.claim_patience:
            coming = frozenset()  # stalled: do not wait on others' promises any longer
        elif getattr(src, "chunks", None) is None and self.reserved is not None:
            order, coming = [c for c in need if c in self.reserved], frozenset()
        return pick_chunk(order, getattr(src, "chunks", None), others, set(), coming)

    def _refresh(self, need, sources, failed, get_sources, busy, now: float) -> None:
        """Soon when a source idles for lack of chunks it holds, now and then otherwise
        (newer partial replicas may be nearer or less loaded than the busy sources)."""
        idle = not sources or any(busy.get(s.replica_id, 0) < self.depth for s in sources)
        if need and now - self._last_refresh >= self.refresh_interval * (1 if idle else 2):
            self._last_refresh = now
            fresh = get_sources(set(failed))
            sources[:] = [s for s in fresh if s.replica_id not in failed]

    def _submitted(self, chunk: int) -> None:
        self.receiving.add(chunk)

    def _ended(self, chunk: int) -> None:
        self.receiving.discard(chunk)

    def _completed(self, f: Any) -> None:
        self.completed.append((f.chunk, f.source.lease_id))
