"""Pipelined replication: the reader's chunk loop (reader process; the fetch that drives it,
its leases and its partial replica are ``_sources.PipelinedSources``).

A pipelined fetch:

1. asks for a ``pipelined`` lease: the coordinator (``_planner.choose_sources``) may send
   it to *partial* replicas (readers still receiving), and tells it the shard's chunk grid
   and, across datacenters, whether it is its datacenter's seeder;
2. with ``serve=True``, registers its destination as a partial replica at once, with its
   *chunk map* (``_chunkmap``): one status byte per chunk in memory registered with the
   transport next to the data, whose address the coordinator hands to other readers;
3. reads chunk by chunk (:class:`PipelinedReader`). Before it asks a partial source for
   chunks it reads that source's chunk map one-sided (a few hundred bytes, like the data;
   again whenever the source idles for lack of chunks it is known to hold) and asks it
   only for chunks marked ready there (``_planner.pick_chunk``). The coordinator is asked
   again (a refresh of the same lease) at most once in a read, to learn partial replicas
   that registered since (and whenever every source failed);
4. marks each chunk it completed in its own chunk map -- only once the transport said
   DONE, its checksum matched (``_checksum``) and the lease it was read under is still
   trusted on this reader's clock (``_fencing.LeaseClock``): a chunk is offered to others
   only if it was read under a valid lease and is complete in memory. Nothing is reported
   to the coordinator per chunk;
5. at the end releases its leases and registers the replica as complete in one call
   (same replica id; registered only if every lease stayed valid). If the fetch fails, the
   partial replica (only it) is unpublished (readers drained), its map retired, and only
   then its memory released; if that is not confirmed in time, the memory is quarantined:
   the error says so, ``fetch(into=...)`` refuses it, and the Hub keeps trying to withdraw
   it on its heartbeats (then the quarantine is lifted).

Older holders (no chunk map) still report chunks to the coordinator
(``POST /v1/replicas/{id}/chunks``); their sources arrive with the chunk list the
coordinator knows, which this reader honours as before.

Invariant: nobody reads a chunk that is not complete on its source (tests/test_pipelined.py).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ._chunkmap import map_bytes, parse_all
from ._exceptions import TransferError
from ._planner import chunk_order, pick_chunk
from ._reader import ShardReader, Source
from .transport import DONE, PENDING, ReadOp

__all__ = ["PSource", "PipelinedReader"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PSource(Source):
    """A source plus the chunks it may be read for (None: all), or, for a partial replica
    with a chunk map (``_chunkmap``), where to read which chunks it holds."""

    chunks: Optional[frozenset] = None
    coming: frozenset = frozenset()
    status_addr: Optional[int] = None
    status_tag: int = 0
    num_chunks: int = 0


#: Chunk-map buffers whose read never ended (a transport may still write them): kept.
_STUCK_MAPS: list[Any] = []


class PipelinedReader(ShardReader):
    """A :class:`ShardReader` that reads each chunk only from a source holding it.

    ``get_sources(excluded)`` is called whenever the reader has no source, or has idle
    sources and chunks none of them holds (at most every ``refresh_interval`` seconds);
    it returns the *current* sources (replacing the old ones). ``completed`` lists
    ``(chunk, lease_id)`` in completion order."""

    def __init__(self, transport: Any, sizes: list[int], local_addrs: list[int], *, start: float = 0.0,
                 reverse: bool = False, refresh_interval: float = 0.05, claim_patience: float = 0.5,
                 status_interval: float = 0.01, max_refreshes: int = 1, first_refresh: float = 0.1,
                 **kw: Any) -> None:
        """``status_interval``: least seconds between two reads of one source's chunk map;
        ``max_refreshes``: coordinator refreshes per run while some source is left (more
        only when every source failed), the first not before ``first_refresh`` seconds."""
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
        self.status_interval = status_interval
        self.max_refreshes = max_refreshes
        self.first_refresh = first_refresh
        #: Coordinator refreshes asked in this reader's runs (chunk maps replace the rest).
        self.refreshes = 0
        self._failed_seen = 0
        #: Chunk-map reads submitted, and chunk maps that read as stale (tag mismatch).
        self.status_reads = 0
        self.stale_maps = 0
        #: replica id -> chunks its map said were ready (last read), and were coming (a hint).
        self.avail: dict[str, frozenset] = {}
        self.map_coming: dict[str, frozenset] = {}
        self._map_pending: dict[str, int] = {}  # replica id -> handle of its map read in flight
        self._map_src: dict[str, PSource] = {}
        self._map_last: dict[str, float] = {}
        self._map_buf: dict[str, Any] = {}  # replica id -> (tensor, addr, nbytes) registered
        self._stale: set[str] = set()  # replicas whose map once read as stale: never read from
        self._fail: Any = None
        self._t0 = 0.0
        #: The coordinator's striped plan (``server.stripes``): the replica to read chunk c from is
        #: ``plan[c % len(plan)]`` ("": none yet); None: no plan. And when to ask for its
        #: fixed layout (monotonic; 0: it is fixed).
        self.plan: Optional[tuple[str, ...]] = None
        self.plan_refresh_at = 0.0
        #: Least seconds between two reads of a parent's chunk map under a plan (a parent
        #: is followed closely: it forwards what it receives, chunk by chunk).
        self.plan_status_interval = 0.002
        #: Under a plan, also read other stripes' chunks from a member that holds them when
        #: it has nothing new of its own stripes (never from the root), once that stripe's
        #: parent holds all of it (``_spillable``).
        self.spill = True

    # Policy hooks (``ShardReader._loop``): the reader's own chunk order; each source is
    # asked only for chunks it holds, rarest first; sources refreshed now and then.
    @property
    def _idle_cap(self) -> float:
        # Under a plan the next chunk comes from a parent that is receiving it now: poll
        # as while reads are in flight, not with the idle back-off.
        return self._busy_cap if self.plan is not None else self.refresh_interval / 2

    def follow_plan(self, plan: Optional[Sequence[str]], refresh_after: float) -> None:
        """Take the plan of a lease answer (None: none) and when to ask again for its
        fixed layout (seconds from now; 0: it is fixed)."""
        self.plan = None if not plan else tuple(plan)
        self.plan_refresh_at = time.monotonic() + refresh_after if plan and refresh_after > 0 else 0.0

    def _loop(self, todo, inflight, failed, sources, stats, fail, *rest) -> None:  # type: ignore[override]
        self._fail = fail  # (a source whose chunk map cannot be read fails like one whose data cannot)
        super()._loop(todo, inflight, failed, sources, stats, fail, *rest)

    def run(self, get_sources, report, **kw: Any):  # type: ignore[override]
        self._t0 = time.monotonic()
        try:
            return super().run(get_sources, report, **kw)
        finally:
            self._close_maps()
            # The run's failure callback closes over the fetch, which holds this reader:
            # dropped here, so a fetched copy is freed (its arena pooled) the moment the
            # caller drops it, not at the next garbage collection.
            self._fail = None

    def _order(self, todo) -> deque:
        wanted = set(todo)
        self._last_refresh = float("-inf")
        return deque(c for c in self.order if c in wanted)

    def held(self, src: Source) -> Optional[frozenset]:
        """What ``src`` may be asked for: None (all: a complete replica), the chunks its map
        said were ready (a partial replica with a chunk map), or the chunks the coordinator
        listed (an older partial replica that reports them)."""
        if getattr(src, "status_addr", None) is not None:
            return self.avail.get(src.replica_id, frozenset())
        return getattr(src, "chunks", None)

    def _fill(self, need, sources, failed, get_sources) -> None:
        # (``_refresh`` asks for sources, after the submit step.) Under a plan, chunk maps
        # read since the last turn are taken in before the submit step, so a parent's new
        # chunk is asked for in the turn its map shows it, not one sleep later: a chunk
        # crosses a plan's tree hop by hop and every hop pays that wait (issue 13).
        if self.plan is not None:
            self._take_maps()

    def _nap(self, sleep: float) -> float:
        """Under a plan, while a parent's chunk map is being read (one small one-sided read:
        tens of microseconds over RDMA), wake after ``poll_interval / 8`` to use its answer,
        not after the loop's sleep (up to ``poll_interval``)."""
        if self.plan is not None and self._map_pending:
            return min(sleep, self.poll_interval / 8)
        return sleep

    def _preference(self, src: Source, busy: int) -> tuple:
        """Nearest sources first, partial before complete, then the least busy."""
        return (src.cost, self.held(src) is None, busy)

    def _pick(self, src: Source, need, sources, inflight, now: float) -> Optional[int]:
        """A chunk ``src`` holds, rarest first (``_planner.pick_chunk``)."""
        have = self.held(src)
        stalled = not inflight and now - self._last_progress > self.claim_patience
        if self.plan is not None and not stalled:  # each stripe from its parent first
            d = len(self.plan)
            c = pick_chunk([c for c in need if self.plan[c % d] == src.replica_id], have, [], set())
            if c is None and have is not None and self.spill:
                # A member (never the root) with nothing new of its stripes: what it holds of
                # the others, rarest first -- a link the plan left idle is used, not waited on.
                spill = self._spillable(need, sources)
                if spill:
                    c = pick_chunk(spill, have, [self.held(o) for o in sources if o is not src], set())
            return c
        # (off a plan, or stalled: what the other sources hold and are receiving counts)
        others = [self.held(o) for o in sources if o is not src]
        coming = self.claimed.union(*(getattr(o, "coming", frozenset()) for o in sources),
                                    *(self.map_coming.get(o.replica_id, frozenset()) for o in sources))
        order = need
        if stalled:
            coming = frozenset()  # stalled: do not wait on others' promises any longer
        elif have is None and self.reserved is not None:
            order, coming = [c for c in need if c in self.reserved], frozenset()
        return pick_chunk(order, have, others, set(), coming)

    def _spillable(self, need, sources) -> list[int]:
        """Under a plan, the chunks still needed that another member may be asked for (the
        spill-over): only those of stripes whose parent -- a partial replica -- already
        holds the whole stripe (its map said so). Why: every member is an interior node of
        one stripe, so its uplink is the plan's budget for its own children; a chunk pulled
        from it while the stripe is still flowing down the tree takes that uplink from them
        and the lag grows at every hop (at 1,024 GPUs ``benchmarks/simulate.py`` had 2/3 of
        all chunks spilled, the tail 0.1-0.2 s). Once the parent holds the whole stripe,
        what is left is only its uplink being shared by its children: spilling then uses
        another's idle moments for the tail. A stripe read from the root (complete) or
        from nobody yet is never spilled."""
        plan = self.plan
        if plan is None:
            return []
        d, n = len(plan), len(self.chunks)
        by = {s.replica_id: s for s in sources}
        done = set()
        for t, rid in enumerate(plan):
            src = by.get(rid)
            have = None if src is None else self.held(src)
            if src is not None and have is not None and have.issuperset(range(t, n, d)):
                done.add(t)
        return [c for c in need if c % d in done] if done else []

    def _refresh(self, need, sources, failed, get_sources, busy, now: float) -> None:
        """Chunk maps: take in those that arrived, read again those of sources idling for
        lack of chunks. The coordinator: only when no source is left, and at most
        ``max_refreshes`` times otherwise (partial replicas registered since the lease may
        be nearer or less loaded than the busy sources), soon when a source idles."""
        self._maps(need, sources, busy, now)
        if self.plan is not None and need:
            due = self.plan_refresh_at and now >= self.plan_refresh_at
            stuck = not any(busy.values()) and now - self._last_progress > self.claim_patience and \
                now - self._last_refresh >= self.refresh_interval
            if due or stuck or not sources or failed.count > self._failed_seen:
                # The plan's fixed layout (counted: it is the one refresh), or trouble.
                self._last_refresh, self._failed_seen = now, failed.count
                self.refreshes += bool(due)
                self.plan_refresh_at = 0.0
                fresh = get_sources(failed)
                sources[:] = [s for s in fresh if s.replica_id not in failed]
            return  # a fixed plan: nothing more to learn from the coordinator
        idle = not sources or any(busy.get(s.replica_id, 0) < self.depth_of(s) for s in sources)
        if not need or now - self._last_refresh < self.refresh_interval * (1 if idle else 2):
            return
        # Beyond the budget only when something went wrong: a source failed since the last
        # refresh, or nothing is in flight and nothing landed for ``claim_patience``.
        trouble = failed.count > self._failed_seen or (
            not any(busy.values()) and now - self._last_progress > self.claim_patience)
        if sources and not trouble and (self.refreshes >= self.max_refreshes or now - self._t0 < self.first_refresh):
            return
        self._last_refresh = now
        self._failed_seen = failed.count
        if sources and not trouble:  # (the first grant, or trouble: not counted)
            self.refreshes += 1
        fresh = get_sources(failed)
        sources[:] = [s for s in fresh if s.replica_id not in failed]

    # ------------------------------------------------------------------ chunk maps
    def _maps(self, need, sources, busy, now: float) -> None:
        self._take_maps()
        if not need:
            return
        for src in sources:
            if getattr(src, "status_addr", None) is None or src.replica_id in self._map_pending:
                continue
            if busy.get(src.replica_id, 0) >= self.depth_of(src):
                continue  # it has work: its map is read when it idles
            rid = src.replica_id
            have = self.avail.get(rid)
            # (under a plan, a parent's map as often as the loop polls its own reads: it
            # forwards chunks as fast as they land)
            gap = self.status_interval if self.plan is None else min(self.plan_status_interval, self._busy_cap)
            if have is not None and now - self._map_last.get(rid, 0.0) < gap:
                continue
            self._read_map(src, now)

    def _take_maps(self) -> None:
        """Take in the chunk maps whose reads ended (a map that cannot be read fails its
        source like data that cannot)."""
        for rid, h in list(self._map_pending.items()):
            try:
                st = self.t.poll(h)
            except TransferError:
                st = -1
            if st == PENDING:
                continue
            del self._map_pending[rid]
            src = self._map_src[rid]
            if st != DONE and self._fail is not None:
                self._fail(src, f"its chunk map could not be read (code {st})")
            if st == DONE:
                both = parse_all(self._map_buf[rid][0].numpy(), src.status_tag, src.num_chunks)
                got = None if both is None else both[0]
                self.map_coming[rid] = frozenset() if both is None else both[1] - self.avail.get(rid, frozenset())
                if got is None or rid in self._stale:  # not (any more) that replica's map: nothing
                    self.stale_maps += got is None  # is read from it again
                    self._stale.add(rid)
                    self.avail[rid] = frozenset()
                else:  # a ready byte never goes back while the tag stands: what we saw stays true
                    self.avail[rid] = got | self.avail.get(rid, frozenset())

    def _read_map(self, src: PSource, now: float) -> None:
        rid = src.replica_id
        n = map_bytes(src.num_chunks)
        buf = self._map_buf.get(rid)
        if buf is None or buf[2] != n:
            import torch

            t = torch.zeros(n, dtype=torch.uint8)
            try:
                self.t.register(t.data_ptr(), n)
            except TransferError as e:
                logger.debug("cannot register a chunk-map buffer: %s", e)
                return
            if buf is not None:
                self._drop_map_buf(rid)
            buf = self._map_buf[rid] = (t, t.data_ptr(), n)
        try:
            h = self.t.submit_read(src.endpoint, [ReadOp(buf[1], src.status_addr, n)])
        except TransferError as e:
            logger.debug("chunk map of %s not read: %s", rid, e)
            self._map_last[rid] = now
            if self._fail is not None:
                self._fail(src, f"its chunk map could not be read: {e}")
            return
        self.status_reads += 1
        self._map_pending[rid] = h
        self._map_src[rid] = src
        self._map_last[rid] = now

    def _drop_map_buf(self, rid: str) -> None:
        t, addr, n = self._map_buf.pop(rid)
        try:
            self.t.unregister(addr, n)
        except TransferError:  # pragma: no cover
            pass

    def _close_maps(self) -> None:
        """After a run: wait (bounded) for map reads in flight, then unregister the buffers
        (one a read may still write is kept for good)."""
        end = time.monotonic() + 2 * self.progress_timeout + 5
        while self._map_pending and time.monotonic() < end:
            for rid, h in list(self._map_pending.items()):
                try:
                    if self.t.poll(h) != PENDING:
                        del self._map_pending[rid]
                except TransferError:
                    del self._map_pending[rid]
            time.sleep(self.poll_interval)
        for rid in list(self._map_buf):
            if rid in self._map_pending:
                _STUCK_MAPS.append(self._map_buf.pop(rid))
            else:
                self._drop_map_buf(rid)
        self._map_pending.clear()

    def _submitted(self, chunk: int) -> None:
        self.receiving.add(chunk)

    def _ended(self, chunk: int) -> None:
        self.receiving.discard(chunk)

    def _completed(self, f: Any) -> None:
        self.completed.append((f.chunk, f.source.lease_id))
