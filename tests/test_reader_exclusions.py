"""A source that failed a read is excluded, and let back in after ``forgive_after`` (the
coordinator's ``suspect_ttl``): a false verdict (a paused holder, Mooncake's own progress
timeout on a loaded machine) must not shut out the only complete source for the rest of the
read. A checksum mismatch stays excluded.

Unit checks of the loop with a test double transport; the same over real processes and
Mooncake, with a paused holder and two partial readers, is
``test_reliability.py::test_a_source_falsely_judged_hung_is_read_again_after_the_suspect_ttl``."""

from __future__ import annotations

import time

import pytest

from tensorhub import FetchError
from tensorhub._reader import Excluded, ShardReader, Source, forgive
from tensorhub.transport._base import DONE

MiB = 1 << 20


class _FailsFirst:
    """Reads end at once: the first ``fail`` of them with an error, the rest done."""

    def __init__(self, fail: int) -> None:
        self.fail = fail
        self.codes: dict[int, int] = {}

    def submit_read(self, peer, ops) -> int:
        h = len(self.codes) + 1
        self.codes[h] = -1 if self.fail > 0 else DONE
        self.fail -= 1
        return h

    def poll(self, handle: int) -> int:
        return self.codes[handle]

    def cancel(self, handle: int) -> bool:
        return False


def _coordinator(src: Source, asked: list, wait: float):
    """Like ``_sources.acquire_lease``: offers ``src`` unless excluded, waiting (up to
    ``wait``) while it is, letting failed sources back in as it asks again."""

    def get_sources(excluded: set[str]) -> list[Source]:
        end = time.monotonic() + wait
        while True:
            forgive(excluded)
            asked.append(set(excluded))
            if src.replica_id not in excluded:
                return [src]
            if time.monotonic() > end:
                raise FetchError("no replica is serving")
            time.sleep(0.02)

    return get_sources


def _reader(t, chunks: int, forgive_after: float) -> tuple[ShardReader, Source]:
    reader = ShardReader(t, [MiB] * chunks, [(1 << 30) + i * MiB for i in range(chunks)],  # type: ignore[arg-type]
                         chunk_bytes=MiB, depth=1, forgive_after=forgive_after)
    return reader, Source("r-1", "w-1", "peer:1", tuple((1 << 40) + i * MiB for i in range(chunks)), "l-1")


def test_the_only_source_failed_once_is_read_again_after_forgive_after():
    reader, src = _reader(_FailsFirst(1), 4, forgive_after=0.3)
    asked: list = []
    reported = []
    t0 = time.monotonic()
    stats = reader.run(_coordinator(src, asked, wait=5.0), lambda s, why: reported.append((s.replica_id, why)))
    took = time.monotonic() - t0
    assert stats.nbytes == 4 * MiB and stats.bytes_by_source == {"w-1": 4 * MiB}
    assert stats.failed_sources == ["r-1"] and reported == [("r-1", "read failed with code -1")]
    assert {"r-1"} in asked and asked[-1] == set()  # excluded, then let back in
    assert took >= 0.3


def test_without_forgiveness_the_read_fails_at_its_deadline():
    """The other side of the test above: with a forgive time beyond the wait, the only
    source stays excluded and the read ends with the coordinator's error."""
    reader, src = _reader(_FailsFirst(1), 4, forgive_after=60.0)
    with pytest.raises(FetchError, match="no replica is serving"):
        reader.run(_coordinator(src, [], wait=0.5), lambda s, why: None)


def test_a_checksum_mismatch_stays_excluded_and_failures_are_counted():
    e = Excluded(forgive_after=0.05)
    e.fail("bad-bytes", lasting=True)
    e.fail("paused", lasting=False)
    assert e == {"bad-bytes", "paused"} and e.count == 2
    e.forgive()
    assert e == {"bad-bytes", "paused"}  # not yet
    time.sleep(0.1)
    e.forgive()
    assert e == {"bad-bytes"} and e.count == 2  # the count never goes down (trouble detection)
    e.fail("paused", lasting=False)
    assert e == {"bad-bytes", "paused"} and e.count == 3
