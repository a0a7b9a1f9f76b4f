"""A start's head start: what the loader can do while the engine still builds its model.

An engine's start calls the loader's ``load_weights`` only once the model exists (vLLM's
``initialize_model``: modules allocated, quantization set up). Nothing the read needs
before its first byte depends on the model: connecting the Hub (the coordinator probe,
registration, the transport), resolving the version and, from a same-host holder,
borrowing it in place (lease, mapping, checksums: ``Hub.borrow``). :class:`HeadStart`
does those on a thread while the engine builds the model, so ``load_weights`` begins with
the bytes at hand; ``from local safetensors`` a start has no such fixed cost to hide.

Only what involves no other rank runs ahead: every engine connects its own rank; the
version is resolved (and borrowed) ahead only on an engine of one rank, because
``resolve`` is a collective across ranks that must not race the engine's own setup.
Whatever fails or is skipped ahead is simply done again, in order, by the load itself
(the errors users see come from there, as without a head start). A borrow the load does
not use (it found a peer's native layout for this exact engine) is given back, as is one
of a head start the load never takes (the engine failed to build its model).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

from . import worker
from .settings import Settings

logger = logging.getLogger(__name__)

__all__ = ["HeadStart"]


class HeadStart:
    """Connect, and on a one-rank engine resolve and borrow, on a thread (see the module
    docstring). ``connect(settings)`` gives the worker's state (``worker.connect`` with the
    adapter's hooks); ``place()``, run first on the thread, moves it where it does not slow
    the engine's own setup (the adapter's ``off_engine_cores``-like placement)."""

    def __init__(self, settings: Settings, connect: Callable[[Settings], Any],
                 place: Optional[Callable[[], None]] = None) -> None:
        self.settings = settings
        self._connect, self._place = connect, place
        self._state: Any = None
        self._version: Optional[tuple[Optional[int]]] = None  # (v,) once resolved ahead; None: not
        self._borrowed: Any = None
        self._taken = False
        self.seconds = 0.0  # what the thread spent (hidden behind the model's build)
        self._thread = threading.Thread(target=self._run, name="tensorhub-head-start", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        s = self.settings
        t0 = time.monotonic()
        try:
            if self._place is not None:
                self._place()
            st = self._state = self._connect(s)
            if st.engine().size > 1:  # resolve is a collective across the ranks
                return
            v = worker.resolve(st, s.version, on_missing=s.on_missing)
            self._version = (v,)
            if v is not None:
                self._borrowed = st.hub.borrow(s.model, v, layout="hf", timeout=s.fetch_timeout)
        except Exception as e:  # the load does it again, in order, and reports it
            logger.debug("tensorhub: head start stopped (%s); the load goes on without it", e)
        finally:
            self.seconds = time.monotonic() - t0

    def take(self) -> tuple[Any, Optional[tuple[Optional[int]]], Any]:
        """Wait for the thread; ``(state or None, (version,) or None, Borrowed or None)``:
        what it got done, for the load to go on from. Once only."""
        self._thread.join()
        self._taken = True
        out = (self._state, self._version, self._borrowed)
        self._borrowed = None
        return out

    def discard(self) -> None:
        """The load will not take it (the engine failed first): give back any lease."""
        if self._taken:
            return
        self._thread.join()
        self._taken = True
        b, self._borrowed = self._borrowed, None
        if b is not None:
            b.release_quietly()
