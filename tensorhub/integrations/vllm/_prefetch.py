"""``prefetch``: fetch each new version while the engine still generates.

With the ``prefetch`` setting on, every worker runs one daemon thread (started by the
loader once the engine is loaded) that waits on the coordinator for a complete version
newer than the one the engine runs and fetches it at once, into the kept spare copy when
there is one (``reuse_buffers``), registered as a replica like a swap's fetch (so the
fleet can already read it from this engine). A later ``update_weights`` to that version
finds it local: the swap's stall is the apply alone. An update that arrives while that
very version is being prefetched waits for it instead of fetching it twice.

Once the publisher is seen to publish no deltas (a version read the usual way found none
from the version before), the next version's lease is asked ahead (``Hub.fetch_next``): the
thread asks while the engine still runs the current one, and at the publish this rank is
in the version's plan from its first moment instead of queueing with the fleet (issue 31).
Each version read so is checked for deltas afterwards (one call, off the critical path): if
the publisher has started publishing them, the next version is read the usual way again,
through them.

Only the newest prefetched version is kept: when a newer one lands first, the older copy
is retired like a swapped-out one (unpublished once its readers drained, then kept as the
spare). Memory: one more model-size copy (the prefetched version) between a publish and
the swap to it. Each rank prefetches on its own; a rank whose prefetched version differs
from the one the engine swaps to (the root's answer, for every stage) fetches it as usual.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

logger = logging.getLogger(__name__)

__all__ = ["Prefetcher"]


class Prefetcher:
    """One per worker process (see the module docstring); ``st``: its
    :class:`~tensorhub.integrations.vllm._runtime.WorkerState`. ``take(v)`` hands over a prefetched
    copy of ``v`` (or None); ``stop()`` ends the thread."""

    def __init__(self, st: Any, poll: float = 30.0) -> None:
        self.st = st
        self.poll = poll
        self._cond = threading.Condition()
        self._ready: Optional[tuple[int, Any]] = None  # (version, Fetched)
        self._busy: Optional[int] = None  # the version being fetched now
        self._stop = threading.Event()
        #: Ask the next version's lease ahead (no deltas seen): see the module docstring.
        self._ahead = False
        self._thread = threading.Thread(target=self._run, name="tensorhub-prefetch", daemon=True)

    def start(self) -> "Prefetcher":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _newest_known(self) -> int:
        with self._cond:
            ready = self._ready[0] if self._ready else 0
        return max(self.st.version or 0, ready)

    def _run(self) -> None:
        import tensorhub

        from .._core import worker

        st, s = self.st, self.st.settings
        while not self._stop.is_set():
            if self._ahead and self._newest_known():
                if self._run_ahead():
                    continue
                self._stop.wait(1.0)
                continue
            try:
                v = st.hub.wait_for_version(s.model, newer_than=self._newest_known(), timeout=self.poll)
            except tensorhub.HubTimeoutError:
                continue
            except tensorhub.HubClosedError:
                return
            except Exception as e:  # coordinator away: try again later
                logger.debug("tensorhub: prefetch: %s", e)
                self._stop.wait(1.0)
                continue
            if v is None or v <= self._newest_known():
                continue
            with self._cond:
                self._busy = v
            t0 = time.monotonic()
            got = None
            try:
                spare = st.take_spare()
                got = worker.fetch(st, v, into=spare, base=st.spare_base(spare, v))
            except Exception as e:
                logger.warning("tensorhub: prefetching %s v%d failed (%s); the swap will fetch it", s.model, v, e)
            if got is not None:  # no delta from the version before: ask the next one ahead
                self._ahead = worker.ask_ahead_after(got)
            self._landed(v, got, t0)
            if got is None:
                self._stop.wait(1.0)

    def _landed(self, v: int, got: Any, t0: float) -> None:
        old = None
        with self._cond:
            self._busy = None
            if got is not None:
                old, self._ready = self._ready, (v, got)
                logger.info("tensorhub: prefetched %s v%d in %.2fs while serving v%s", self.st.settings.model, v,
                            time.monotonic() - t0, self.st.version)
            self._cond.notify_all()
        if old is not None:
            self._retire(*old, reason=f"v{v} was prefetched before a swap to it")

    def _run_ahead(self) -> bool:
        """One ask ahead for the version after the newest known (held up to ``poll``); False
        when it failed (then the usual way again)."""
        from .._core import worker

        st, s = self.st, self.st.settings
        after = self._newest_known()
        with self._cond:
            self._busy = after + 1  # (the likely next number: a swap to it waits for this read)
        t0 = time.monotonic()
        spare = st.take_spare()
        got = None
        try:
            got = worker.fetch_next(st, after, into=spare, wait=self.poll)
        except Exception as e:
            logger.warning("tensorhub: prefetching the version after %s v%d failed (%s); the swap will fetch it",
                           s.model, after, e)
            self._ahead = False
        if got is None:
            with self._cond:
                self._busy = None
                self._cond.notify_all()
            if spare is not None and st.spare is None and self._ahead:  # nothing came: nothing was written
                st.spare = spare
            return self._ahead
        self._landed(got.version, got, t0)
        self._ahead = not worker.deltas_published(st.hub, s.model, got.version)  # (then through them again)
        return True

    def _retire(self, v: int, got: Any, reason: str) -> None:
        if v == self.st.version:  # the engine swapped to it by another path: it is the copy now
            return
        self.st.retire_later(v, got, reason)

    def take(self, version: int, timeout: float) -> Optional[Any]:
        """The prefetched copy of ``version`` (waiting up to ``timeout`` while it is being
        fetched), else None; a prefetched copy of an older version is retired."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._busy == version and time.monotonic() < deadline:
                self._cond.wait(deadline - time.monotonic())
            ready, self._ready = self._ready, None
        if ready is None:
            return None
        if ready[0] == version:
            return ready[1]
        if ready[0] > version:  # newer than asked: keep it for the next swap
            with self._cond:
                if self._ready is None:
                    self._ready, ready = ready, None
            if ready is not None:  # an even newer one landed meanwhile
                self._retire(*ready, reason=f"v{self._ready[0]} was prefetched meanwhile")
            return None
        self._retire(*ready, reason=f"the engine swaps to v{version}")
        return None
