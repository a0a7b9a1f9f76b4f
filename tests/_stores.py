"""A real SQLite store behind a slow (or failing) disk, for the control-plane tests."""

from __future__ import annotations

import threading
import time

from tensorhub.server.store import SqliteStore


class SlowStore(SqliteStore):
    """The real SQLite store behind a disk that takes ``delay`` per commit (or fails, with
    ``fail``); ``started`` is set at the first commit, ``batches`` records how many writes
    each commit carried."""

    def __init__(self, path, delay: float = 0.0) -> None:
        super().__init__(path)
        self.delay, self.fail, self.started = delay, False, threading.Event()
        self.batches: list[int] = []

    def commit(self, writes):
        writes = list(writes)
        if writes:
            self.batches.append(len(writes))
            self.started.set()
            time.sleep(self.delay)
            if self.fail:
                raise OSError("disk on fire")
        super().commit(writes)
