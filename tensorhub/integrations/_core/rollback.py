"""A failed swap rolls back: the engine's parameters get the previous version's exact bytes again.

Runs in every engine worker process, inside the adapter's hot-swap (vLLM's
``update_weights``), after applying the new version failed on some rank with some of the
parameters already changed (an engine error in ``load_weights``, a failed finalize). Every
rank of the engine then applies the previous version again, in full, from:

1. the rank's kept ``hf`` copy of that version (:attr:`WorkerState.copy` on a serving rank).
   It is served to peers while the engine runs it, so nothing frees or overwrites it during
   the swap (the swap fetches into other memory; it is retired only after a swap that
   succeeded); its bytes were checked against the version's checksums when it was fetched;
2. else (a rank that keeps no copy: the other TP ranks under ``serve_ranks="first"``, a start
   in place whose copy is not made yet) the previous version read again from peers through
   the Hub, checked against its checksums as every fetch is.

When neither works, or applying the previous version fails too, the engine holds a mix of
layers: :func:`roll_back` marks the state broken (:attr:`WorkerState.broken`) and raises
:class:`RollbackError`; the adapter then refuses to serve (vLLM: the engine core stops, so
``/health`` fails and requests get an error) rather than answer with mixed weights.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping, Optional

logger = logging.getLogger(__name__)

__all__ = ["RollbackError", "previous_bytes", "roll_back"]


class RollbackError(RuntimeError):
    """The previous version could not be put back: the engine's parameters are a mix."""


def previous_bytes(st: Any, version: int, kept: Optional[Mapping[str, Any]]) -> tuple[Mapping[str, Any], str]:
    """The ``hf`` tensors of ``version`` (the one the engine ran before the failed swap) and
    where they came from: ``kept`` (the rank's served copy) when there is one, else a fresh
    read from peers (not registered: it only feeds the restore)."""
    if kept is not None:
        return kept, f"from this worker's kept copy of v{version}"
    s = st.settings
    t0 = time.monotonic()
    got = st.hub.fetch(s.model, version, layout="hf", serve=False, timeout=s.fetch_timeout)
    return got, f"v{version} read again from peers ({got.nbytes / 1e6:.1f} MB in {time.monotonic() - t0:.2f}s)"


def roll_back(st: Any, version: Optional[int], kept: Optional[Mapping[str, Any]],
              apply: Callable[[Mapping[str, Any]], Any], failed: str) -> str:
    """Apply ``version``'s exact bytes again with ``apply`` (the adapter's full apply, which
    first clears what the failed one left half done); returns how, for the swap's error.
    ``failed``: why the swap failed, for the log. Raises :class:`RollbackError` (and sets
    ``st.broken``) when the bytes cannot be had or applied."""
    s = st.settings
    try:
        if version is None:
            raise RuntimeError("the engine ran no TensorHub version before (its weight files), "
                               "so there is no copy to restore from")
        tensors, how = previous_bytes(st, version, kept)
        apply(tensors)
    except Exception as e:
        why = str(e).removeprefix("tensorhub: ")
        st.broken = (f"{s.model!r} holds a mix of two versions' layers after a failed swap ({failed}); "
                     f"restoring v{version} failed: {why}")
        logger.error("tensorhub: %s; this engine refuses to serve a mix of layers: restart it", st.broken)
        raise RollbackError(f"tensorhub: {st.broken}") from None
    logger.warning("tensorhub: the swap failed (%s); rolled back to %s v%d %s", failed, s.model, version, how)
    return how
