"""The reader's data path: chunked, striped, asynchronous reads with failover.

Runs in the reader process, called by ``Hub.fetch``. The shard is cut into chunks (at
most ``chunk_bytes`` and at most ``MAX_BATCH_ENTRIES`` tensor pieces each, so a chunk is
one batch of at most 2048 entries of at most 1 GiB). Each source keeps ``depth``
batches in flight; completion is polled with a short, growing sleep (no spinning).

Failures: a batch that fails marks its source failed (reported to the coordinator) and
its chunk goes back to the queue for another source. A batch that makes no progress
within its deadline marks its source hung; its chunk is re-read only after the transport
says that batch reached a terminal state, because until then the engine may still write
into that destination (Mooncake's ``MC_TCP_PROGRESS_TIMEOUT_SEC`` bounds the wait).
When no source is left, ``get_sources`` is asked for more (a new lease). A failed source is
excluded for the coordinator's ``suspect_ttl``, then let back in (:class:`Excluded`).

Checksums (``_checksum``): with a :class:`~tensorhub._checksum.Verifier` the shard is cut on
its chunk grid, and a chunk the transport says is DONE is hashed in local memory before it
counts as read; a mismatch fails its source like a failed batch (reported, excluded) and
the chunk is read again from another. If the fetch then fails for want of sources, the
error names the mismatches.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

from ._checksum import Verifier, cut
from ._exceptions import FetchError, TransferError
from .transport import DONE, MAX_ENTRY_BYTES, PENDING, ReadOp, Transport

#: What _poll_one answers for a batch the transport withdrew before it sent anything.
_CANCELLED = -125

__all__ = ["Source", "ShardReader", "ReadStats", "Excluded"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Source:
    """One replica a reader may read from, under ``lease_id``.

    ``secret`` (the lease's, ``LeaseGrant.secret``) and ``host`` (the replica's locality
    host label) are for same-host reads (``transport/_shm``): its holder's fd socket is asked
    only when ``host`` is this reader's own host label, and then shown a proof of the lease
    made with ``secret`` (never the secret, never the API token). Keyword-only, so subclasses'
    positional fields stay where they were."""

    replica_id: str
    worker_id: str
    endpoint: str
    addresses: tuple[int, ...]
    lease_id: str
    cost: int = 0
    secret: str = field(default="", kw_only=True, repr=False)
    host: Optional[str] = field(default=None, kw_only=True)


@dataclass
class ReadStats:
    nbytes: int = 0
    seconds: float = 0.0
    bytes_by_source: dict[str, int] = field(default_factory=dict)  # worker_id -> bytes
    chunks_by_lease: dict[str, list[int]] = field(default_factory=dict)
    failed_sources: list[str] = field(default_factory=list)  # replica ids


@dataclass
class _Inflight:
    chunk: int
    source: Source
    submitted: float
    deadline: float
    abandoned: bool = False
    #: The hash of the landed bytes the transport computed while copying (None: not computed).
    digest: Optional[int] = None


#: While reads are in flight the loop sleeps at most this share of the time between two
#: chunks landing (:func:`busy_cap`); the weight of the newest gap in that time (:func:`next_gap`).
CAP_SHARE = 0.25
GAP_EWMA = 0.25


def next_gap(gap_s: Optional[float], seconds: float, landed: int, weight: float = GAP_EWMA) -> float:
    """The smoothed time between two chunks landing, after ``landed`` chunks were seen
    ``seconds`` after the last landing (or the first submit of a busy spell)."""
    sample = seconds / landed
    return sample if gap_s is None else gap_s + weight * (sample - gap_s)


def busy_cap(gap_s: Optional[float], poll_interval: float, share: float = CAP_SHARE) -> float:
    """The read loop's longest sleep while reads are in flight: ``poll_interval``, or
    ``share`` of the time between two chunks landing once that was measured, if that is
    shorter (not under ``poll_interval / 8``; ``share`` 0: always ``poll_interval``). A
    landed chunk is seen at most that late. At 400 Gbit/s a 64 MiB chunk lands every ~1.3 ms
    however many share the NIC, and a sleep of up to 2 ms after it landed cost every hop of
    a plan's tree up to 2 ms more (``benchmarks/simulate.py``, which calls this); where
    chunks land further apart (slower links, fewer sources) the loop polls no more often than
    before, so its polls per chunk stay bounded. The gap measured includes the loop's own
    lateness: it converges from above."""
    if gap_s is None or share <= 0:
        return poll_interval
    return min(poll_interval, max(poll_interval / 8, gap_s * share))


class Excluded(set):
    """The replica ids a read excludes: the sources that failed it. One that failed a read
    (an error, or no progress within its deadline) is let back in ``forgive_after`` seconds
    later: a paused holder, or a loaded machine where Mooncake's own progress timeout ends a
    batch, gives a false verdict, and it must not shut out the only complete source for the
    rest of the read (partial readers would then wait on each other until the deadline).
    The coordinator keeps a reported replica suspect for its ``suspect_ttl`` (the value
    readers use here), so it comes back when the coordinator offers it again, not before;
    a dead one never does. A checksum mismatch (wrong bytes) stays excluded."""

    def __init__(self, forgive_after: float = 30.0) -> None:
        super().__init__()
        self.forgive_after = forgive_after
        self.since: dict[str, float] = {}  # replica id -> when it failed (forgivable ones)
        #: Failures recorded, forgiven ones included (a count that never goes down).
        self.count = 0

    def fail(self, replica_id: str, lasting: bool) -> None:
        self.add(replica_id)
        self.count += 1
        if lasting:
            self.since.pop(replica_id, None)
        else:
            self.since[replica_id] = time.monotonic()

    def forgive(self) -> None:
        """Let back in the sources that failed ``forgive_after`` seconds ago or more."""
        if not self.since:
            return
        cutoff = time.monotonic() - self.forgive_after
        for rid in [r for r, t in self.since.items() if t <= cutoff]:
            del self.since[rid]
            self.discard(rid)
            logger.info("replica %s failed a read %.0fs ago: it may be read again", rid, self.forgive_after)


def forgive(excluded: set[str]) -> None:
    """Before asking for sources again: let back in the failed ones whose time is up."""
    if isinstance(excluded, Excluded):
        excluded.forgive()


class ShardReader:
    """Reads one shard into local memory; one instance per fetch attempt."""

    def __init__(self, transport: Transport, sizes: list[int], local_addrs: list[int], *,
                 chunk_bytes: int = 64 << 20, depth: int = 2, progress_timeout: float = 10.0,
                 min_rate: float = 10e6, poll_interval: float = 0.002,
                 checksums: Optional[Verifier] = None, forgive_after: float = 30.0) -> None:
        """``checksums``: verify each chunk before accepting it; its chunks (the shard's
        grid) then replace the cut by ``chunk_bytes``. ``forgive_after``: a source that failed
        a read may be read again this many seconds later (:class:`Excluded`)."""
        if not 0 < chunk_bytes <= MAX_ENTRY_BYTES:
            raise ValueError(f"chunk_bytes must be in (0, {MAX_ENTRY_BYTES}]")
        self.t = transport
        self.sizes = sizes
        self.local = local_addrs
        self.depth = max(1, depth)
        self.progress_timeout = progress_timeout
        self.min_rate = min_rate
        self.poll_interval = poll_interval
        self.forgive_after = forgive_after
        #: Verifies chunks in local memory (None: no checksums to check).
        self.checksums = checksums
        self.chunks = checksums.chunks if checksums is not None else self._cut(chunk_bytes)
        #: replica id -> the checksum mismatch that failed it (this reader's, all runs).
        self.mismatched: dict[str, str] = {}
        #: True when a run ended with a batch that may still write into local memory.
        self.stuck = False
        #: The running (or last) run's counts, updated as chunks land.
        self.live: Optional[ReadStats] = None
        #: Set by ``get_sources`` when the coordinator had no source: the error at the deadline.
        self.why_no_source = ""
        self._last_progress = 0.0
        #: Seconds between two chunks landing while reads are in flight, smoothed (None: not
        #: measured yet), and when the last one was seen (None: nothing in flight since).
        self._gap_s: Optional[float] = None
        self._landed_at: Optional[float] = None

    def _cut(self, chunk_bytes: int) -> list[list[tuple[int, int, int]]]:
        """Chunks as lists of (tensor index, offset in tensor, length)."""
        return cut(self.sizes, chunk_bytes)

    def depth_of(self, src: Source) -> int:
        """Batches in flight per source: twice ``depth`` for one this process copies from on
        its own host (``SameHostTransport.local``): the copy pool then always has the next
        chunk queued while the loop sleeps between polls (at ``depth`` the gaps cost a same-host
        read ~30% of its speed; over the network they hide behind the wire)."""
        local = getattr(self.t, "local", None)
        return self.depth * 2 if local is not None and local(src) else self.depth

    def chunk_bytes(self, c: int) -> int:
        return sum(p[2] for p in self.chunks[c])

    def _ops(self, c: int, src: Source) -> list[ReadOp]:
        ops: list[ReadOp] = []
        for i, off, n in self.chunks[c]:
            local, remote = self.local[i] + off, src.addresses[i] + off
            if ops and ops[-1].local_addr + ops[-1].length == local and \
                    ops[-1].remote_addr + ops[-1].length == remote and ops[-1].length + n <= MAX_ENTRY_BYTES:
                last = ops.pop()
                ops.append(ReadOp(last.local_addr, last.remote_addr, last.length + n))
            else:
                ops.append(ReadOp(local, remote, n))
        return ops

    def run(self, get_sources: Callable[[set[str]], list[Source]],
            report: Callable[[Source, str], None], *, chunks: Optional[list[int]] = None,
            deadline: float = float("inf"), on_tick: Callable[[], None] = lambda: None) -> ReadStats:
        """Read ``chunks`` (default: all). ``get_sources(excluded_replica_ids)`` returns fresh
        sources or raises; ``report(source, reason)`` tells the coordinator about a failure."""
        stats = ReadStats()
        self.live = stats  # read by the caller's on_tick (progress)
        todo = deque(range(len(self.chunks)) if chunks is None else chunks)
        inflight: dict[int, _Inflight] = {}
        failed = Excluded(self.forgive_after)
        sources: list[Source] = []
        t0 = time.monotonic()

        def fail(src: Source, reason: str, lasting: bool = False) -> None:
            if src.replica_id in failed:
                return
            failed.fail(src.replica_id, lasting)
            stats.failed_sources.append(src.replica_id)
            sources[:] = [s for s in sources if s.replica_id != src.replica_id]
            logger.warning("source %s (replica %s, %s) failed: %s; continuing from other replicas",
                           src.worker_id, src.replica_id, src.endpoint, reason)
            try:
                report(src, reason)
            except Exception as e:  # reporting is best effort
                logger.debug("could not report %s: %s", src.replica_id, e)

        leases: set[str] = set()

        def sources_of(excluded: set[str]) -> list[Source]:
            got = get_sources(excluded)
            leases.update(s.lease_id for s in got)
            return got

        try:
            self._loop(todo, inflight, failed, sources, stats, fail, sources_of, deadline, on_tick)
        except BaseException as e:
            self._drain(inflight)
            if isinstance(e, FetchError) and self.mismatched:
                bad = "; ".join(f"replica {r}: {why}" for r, why in self.mismatched.items())
                raise FetchError(f"{e}; {len(self.mismatched)} source(s) excluded after a checksum "
                                 f"mismatch ({bad})") from e
            raise
        finally:
            if hasattr(self.t, "forget"):  # same-host reads: close the holders' fds (transport/_shm)
                self.t.forget(leases | {s.lease_id for s in sources})
        stats.seconds = time.monotonic() - t0
        return stats

    def _submit(self, src: Source, ops: list[ReadOp], c: int) -> int:
        """Submit chunk ``c``'s batch from ``src``; a same-host transport (``transport/_shm``)
        is told the source (its lease and replica), which it needs to copy from the holder's
        memory, and, when the chunk has a checksum to check in place, how to hash what it
        lands (it then hashes each piece right after copying it, on its own threads)."""
        if hasattr(self.t, "submit_from"):
            v = self.checksums
            if v is not None and v.expected[c] is not None and v.in_place:
                return self.t.submit_from(src, ops, hasher=v.hasher)
            return self.t.submit_from(src, ops)
        return self.t.submit_read(src.endpoint, ops)

    def _drain(self, inflight: dict[int, "_Inflight"]) -> None:
        """After an error: wait (bounded) until no batch can still write into local memory."""
        end = time.monotonic() + 2 * self.progress_timeout + 5
        while inflight and time.monotonic() < end:
            for h in list(inflight):
                try:
                    if self.t.poll(h) != PENDING:
                        del inflight[h]
                except TransferError:
                    del inflight[h]
            time.sleep(self.poll_interval)
        if inflight:
            self.stuck = True
            logger.error("%d read batch(es) never ended; their destination memory is quarantined",
                         len(inflight))

    def _poll_one(self, inflight: dict[int, "_Inflight"], h: int, fail: Callable[[Source, str], None]) -> int:
        """Poll one batch: PENDING (marking its source hung past the deadline, but keeping
        the batch, whose buffer is not ours until it ends), else drop it and return its status."""
        f = inflight[h]
        st = self.t.poll(h)
        if st == PENDING:
            if not f.abandoned and time.monotonic() > f.deadline:
                f.abandoned = True
                fail(f.source, f"no progress for {f.deadline - f.submitted:.1f}s (hung)")
                if self.t.cancel(h):  # it never went out (e.g. stuck in a handshake): re-read now
                    del inflight[h]
                    return _CANCELLED
            return PENDING
        del inflight[h]
        if st == DONE and hasattr(self.t, "digest"):
            f.digest = self.t.digest(h)
        return st

    def _accept(self, f: "_Inflight", fail: Callable[[Source, str], None]) -> bool:
        """A chunk the transport says is DONE: True if it may count as read (its checksum
        matches, or there is none); else fail its source (reported, excluded): the caller
        reads the chunk again."""
        if self.checksums is None:
            return True
        why = self.checksums.check(f.chunk, f.digest)
        if why is None:
            return True
        self.mismatched.setdefault(f.source.replica_id, why)
        fail(f.source, f"{why} (read from {f.source.endpoint})", True)
        return False

    def _count(self, stats: ReadStats, f: "_Inflight") -> None:
        """Account a chunk that landed."""
        nb = self.chunk_bytes(f.chunk)
        stats.nbytes += nb
        stats.bytes_by_source[f.source.worker_id] = stats.bytes_by_source.get(f.source.worker_id, 0) + nb
        stats.chunks_by_lease.setdefault(f.source.lease_id, []).append(f.chunk)

    # ------------------------------------------------------------------ the chunk loop
    def _loop(self, todo, inflight, failed, sources, stats, fail, get_sources, deadline, on_tick) -> None:
        """The one chunk loop of every read: submit to the sources in order of preference,
        refresh the sources, poll. What a pipelined read changes are the policy hooks below
        (the chunk order, which chunk a source is asked for, when sources are refreshed)."""
        need = self._order(todo)
        self._last_progress = time.monotonic()
        sleep = self.poll_interval / 8
        while need or inflight:
            now = time.monotonic()
            if now > deadline:
                raise self._deadline_error(need, inflight, sources)
            self._fill(need, sources, failed, get_sources)
            busy = {s.replica_id: 0 for s in sources}
            for f in inflight.values():
                if not f.abandoned and f.source.replica_id in busy:
                    busy[f.source.replica_id] += 1
            progressed = True
            while need and progressed:
                progressed = False
                for src in sorted(sources, key=lambda s: self._preference(s, busy[s.replica_id])):
                    if not need or busy[src.replica_id] >= self.depth_of(src):
                        continue
                    c = self._pick(src, need, sources, inflight, now)
                    if c is None:
                        continue
                    need.remove(c)
                    try:
                        h = self._submit(src, self._ops(c, src), c)
                    except TransferError as e:
                        need.appendleft(c)
                        fail(src, str(e))
                        break
                    nb = self.chunk_bytes(c)
                    if self._landed_at is None:
                        self._landed_at = now  # a busy spell starts: the first gap runs from here
                    inflight[h] = _Inflight(c, src, now, now + self.progress_timeout + nb / self.min_rate)
                    self._submitted(c)
                    busy[src.replica_id] += 1
                    progressed = True
            self._refresh(need, sources, failed, get_sources, busy, now)
            landed = 0
            for h in list(inflight):
                f = inflight[h]
                st = self._poll_one(inflight, h, fail)
                if st == PENDING:
                    continue
                landed += 1
                self._last_progress = time.monotonic()
                self._ended(f.chunk)
                if st == DONE and not f.abandoned:
                    if self._accept(f, fail):  # verified before it counts (or is offered to others)
                        self._count(stats, f)
                        self._completed(f)
                    else:
                        need.appendleft(f.chunk)  # checksum mismatch: read it from another source
                else:
                    if st != DONE:
                        fail(f.source, f"read failed with code {st}")
                    need.appendleft(f.chunk)
            self._landed(landed, bool(inflight), self._last_progress)
            on_tick()
            if landed:
                sleep = self.poll_interval / 8
            elif inflight or need:
                time.sleep(self._nap(sleep))
                sleep = min(sleep * 2, self._busy_cap if inflight else self._idle_cap)

    def _deadline_error(self, need, inflight, sources) -> FetchError:
        stuck = [f.source.endpoint for f in inflight.values() if f.abandoned]
        if need and not sources and not stuck and self.why_no_source:
            return FetchError(self.why_no_source)
        return FetchError(
            f"fetch deadline passed with {len(need) + len(inflight)} of {len(self.chunks)} chunks "
            f"unread" + (f"; batches from {sorted(set(stuck))} never ended" if stuck else ""))

    CAP_SHARE = CAP_SHARE
    GAP_EWMA = GAP_EWMA

    def _landed(self, n: int, busy: bool, now: float) -> None:
        """``n`` batches ended in this turn, the last seen at ``now``; ``busy``: reads
        still in flight after it."""
        if n and self._landed_at is not None:
            self._gap_s = next_gap(self._gap_s, now - self._landed_at, n, self.GAP_EWMA)
            self._landed_at = now
        if not busy:
            self._landed_at = None  # an idle spell (waiting for sources) is no gap

    @property
    def _busy_cap(self) -> float:
        """The longest sleep while reads are in flight (:func:`busy_cap`)."""
        return busy_cap(self._gap_s, self.poll_interval, self.CAP_SHARE)

    # Policy hooks of a plain read: chunks in order, any source for any chunk, new sources
    # (a new lease) only when none is left.
    #: The longest sleep while chunks wait and nothing is in flight (seconds).
    @property
    def _idle_cap(self) -> float:
        return self.poll_interval

    def _nap(self, sleep: float) -> float:
        """How long this turn sleeps, given the loop's back-off ``sleep``."""
        return sleep

    def _order(self, todo) -> deque:
        return deque(todo)

    def _fill(self, need, sources, failed, get_sources) -> None:
        if need and not sources:
            sources.extend(s for s in get_sources(failed) if s.replica_id not in failed)
            if not sources:
                raise FetchError("no source left to read from")

    def _preference(self, src: Source, busy: int) -> tuple:
        return (busy,)

    def _pick(self, src: Source, need, sources, inflight, now: float) -> Optional[int]:
        return need[0]

    def _refresh(self, need, sources, failed, get_sources, busy, now: float) -> None:
        pass

    def _submitted(self, chunk: int) -> None:
        pass

    def _ended(self, chunk: int) -> None:
        pass

    def _completed(self, f: "_Inflight") -> None:
        pass
