"""The read loop's sleep while reads are in flight follows the time between two chunks
landing (``ShardReader._busy_cap``): a landed chunk is seen within a quarter of that gap,
not up to ``poll_interval`` (2 ms) later, where chunks land often; where they land far
apart the loop polls no more often than before.

The transport here is a test double whose reads end a fixed time after they are submitted
(the loop's timing is what is under test, not the bytes: the transports' own tests and the
pipelined tests over Mooncake check those)."""

from __future__ import annotations

import random
import time

import pytest

from tensorhub._reader import ShardReader, Source
from tensorhub.transport._base import DONE, PENDING

# What these check tilts on a loaded machine: scripts/test.sh runs them with no other test beside them.
pytestmark = pytest.mark.alone


class _TimedReads:
    """Each read batch ends ``seconds`` (+- ``jitter`` of it, seeded) after it was
    submitted; counts polls and records how late each batch was seen ended. (Without
    jitter, reads submitted at the loop's polls end in step with them.)"""

    def __init__(self, seconds: float, jitter: float = 0.0) -> None:
        self.seconds = seconds
        self.rng = random.Random(7)
        self.jitter = jitter
        self.due: dict[int, float] = {}
        self.late: list[float] = []  # seen ended this long after it ended
        self.polls = 0
        self._next = 0

    def submit_read(self, peer, ops) -> int:
        self._next += 1
        self.due[self._next] = time.monotonic() + self.seconds * (1 + self.rng.uniform(-self.jitter, self.jitter))
        return self._next

    def poll(self, handle: int) -> int:
        self.polls += 1
        now = time.monotonic()
        if now < self.due[handle]:
            return PENDING
        self.late.append(now - self.due.pop(handle))
        return DONE

    def cancel(self, handle: int) -> bool:
        return False


def _read(seconds: float, chunks: int, depth: int = 1, jitter: float = 0.0) -> tuple[ShardReader, _TimedReads]:
    t = _TimedReads(seconds, jitter)
    size = 1 << 20
    reader = ShardReader(t, [size] * chunks, [(1 << 30) + i * size for i in range(chunks)],  # type: ignore[arg-type]
                         chunk_bytes=size, depth=depth)
    src = Source("r-1", "w-1", "peer:1", tuple((1 << 40) + i * size for i in range(chunks)), "l-1")
    stats = reader.run(lambda excluded: [src], lambda s, why: None)
    assert stats.nbytes == size * chunks
    return reader, t


def test_chunks_landing_often_are_seen_within_a_quarter_of_the_gap():
    """Reads of ~16 ms, 4 in flight: a chunk lands every ~4 ms although each takes 16 ms,
    so the loop sleeps at most ~1 ms between polls (not 2 ms) and sees each landing sooner."""
    reader, t = _read(0.016, 64, depth=4, jitter=0.25)
    assert reader._gap_s is not None
    # the gap measured is the landings' (~4 ms), plus the loop's lateness, not the read's 16 ms
    assert 0.002 <= reader._gap_s < 0.004 + reader.poll_interval
    cap = reader._busy_cap
    assert cap == pytest.approx(max(reader.poll_interval / 8, reader._gap_s * ShardReader.CAP_SHARE))
    assert cap < reader.poll_interval * 0.75
    # once the first landings taught the gap, a landing is seen on average within half a
    # cap or so (the sleep's overshoot on a busy machine allowed); with poll_interval as
    # the cap (before) ~0.8 ms here, ~0.5 ms now
    late = t.late[8:]
    assert sum(late) / len(late) < cap / 2 + 0.0004


def test_chunks_landing_far_apart_keep_the_sleep_at_poll_interval():
    """Reads of 20 ms one after another (a slow link): the cap stays ``poll_interval``: no
    more polls than before (a back-off from poll_interval / 8 up to 2 ms per chunk)."""
    reader, t = _read(0.020, 6)
    assert reader._gap_s is not None and reader._gap_s >= 0.020
    assert reader._busy_cap == reader.poll_interval
    # per chunk: the back-off's steps up to the cap, then one poll per cap (~10), + slack
    assert t.polls / 6 < 20


def test_an_idle_spell_is_no_gap_and_the_cap_has_a_floor():
    r = ShardReader(_TimedReads(0.001), [8], [1 << 30], chunk_bytes=8)  # type: ignore[arg-type]
    assert r._gap_s is None and r._busy_cap == r.poll_interval
    r._landed_at = 10.0
    r._landed(1, busy=False, now=10.0001)  # instant reads (memory): never under poll_interval / 8
    assert r._gap_s == pytest.approx(0.0001) and r._busy_cap == r.poll_interval / 8
    assert r._landed_at is None  # nothing in flight: the wait until the next submit is not a gap
    r._landed(0, busy=False, now=10.0002)
    assert r._gap_s == pytest.approx(0.0001)
