"""The attempts loop of every read (reader process): one copy, run by ``_fetch.Fetch`` (a
whole shard: plain, pipelined, a delta's full fallback) and by ``_sliced`` (each shard's
runs of a read that assembles slices).

An attempt runs the :class:`~tensorhub._reader.ShardReader` over the read's chunks, renewing
its leases while it reads (every third of the lease ttl) and reporting a failing source to
the coordinator. At its end the read's leases are released, checked: the chunks read under
a lease that lapsed (for the coordinator, or past this reader's own bound) are read again,
in a new attempt; three attempts whose leases all lapsed fail the read, its bytes discarded
(``LeaseLapsedError``). What differs between reads is given: how the leases are released
(``end``: the pipelined read registers its complete replica in the same call), which chunks
a lapsed lease makes it read again (``todo_of``), its progress (``tick``), and what a batch
that never ended does to its destination (``stuck``).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

from ._exceptions import LeaseLapsedError
from ._fencing import LeaseClock, renew_leases
from ._metrics import hub_metrics
from ._reader import ReadStats, ShardReader, Source
from ._session import Session

__all__ = ["ATTEMPTS", "read_attempts", "lapsed_chunks"]

logger = logging.getLogger(__name__)

#: Attempts of one read before its bytes are discarded (every one's leases lapsed).
ATTEMPTS = 3


def lapsed_chunks(lapsed: list[str], stats: ReadStats) -> list[int]:
    """The chunks read under the leases that lapsed: read again."""
    return sorted(c for lid in lapsed for c in stats.chunks_by_lease.get(lid, []))


def read_attempts(session: Session, reader: ShardReader, sources: Callable[[set[str]], list[Source]], *,
                  what: str, model: str, leases: list[str], clock: LeaseClock, deadline: float,
                  end: Callable[[ReadStats], list[str]],
                  todo_of: Callable[[list[str], ReadStats], list[int]] = lapsed_chunks,
                  tick: Callable[[], None] = lambda: None,
                  stuck: Optional[Callable[[BaseException], BaseException]] = None) -> ReadStats:
    """Read until every chunk was read under a lease still trusted at its release.

    ``sources(excluded)``: fresh sources (a new lease, appended to ``leases``); ``end(stats)``:
    release the attempt's leases, returning those that lapsed; ``stuck(error)``: the error
    to raise when the read failed with a batch that may still write into local memory (None:
    raise the error as it is). ``what`` names the read in the log. Returns the sums of all
    attempts (``chunks_by_lease``: the last one's)."""

    def report(src: Source, reason: str) -> None:
        hub_metrics().source_failures.labels(model).inc()
        session.as_worker(lambda api: api.report_replica(src.replica_id, session.worker_id, reason,
                                                         retry_timeout=2.0))

    renew_every = max(0.1, session.lease_ttl / 3)
    last_renew = [time.monotonic()]

    def on_tick() -> None:
        tick()
        if time.monotonic() - last_renew[0] >= renew_every:
            last_renew[0] = time.monotonic()
            renew_leases(session.api, leases, clock, session.lease_ttl)

    total = ReadStats()
    todo: Optional[list[int]] = None
    for _ in range(ATTEMPTS):
        try:
            st = reader.run(sources, report, chunks=todo, deadline=deadline, on_tick=on_tick)
        except BaseException as e:
            if not reader.stuck or stuck is None:
                raise
            err = stuck(e)
            if err is e:
                raise
            raise err from e
        total.nbytes += st.nbytes
        total.seconds += st.seconds
        total.failed_sources += st.failed_sources
        for w, n in st.bytes_by_source.items():
            total.bytes_by_source[w] = total.bytes_by_source.get(w, 0) + n
        total.chunks_by_lease = st.chunks_by_lease
        lapsed = end(st)
        if not lapsed:
            return total
        todo = todo_of(lapsed, st)
        logger.warning("%s: worker %s's lease(s) %s lapsed during the read; re-reading %d chunk(s)",
                       what, session.worker_id, lapsed, len(todo))
        if not todo:
            return total
    raise LeaseLapsedError(f"{what}: leases kept lapsing; bytes discarded")
