"""vLLM's hooks into the engine-neutral core, and what a vLLM worker keeps between swaps.

Runs in every vLLM worker process (one per TP/PP rank). The core
(:mod:`tensorhub.integrations._core.worker`) connects, resolves, fetches and loads; vLLM tells it its
ranks (:func:`engine`: pipeline stages x prefill-context-parallel x TP ranks, from vLLM's
``parallel_state``) and its layer groups (vLLM's ``layerwise_groups``), and keeps, beyond
the core's state, the old ``hf`` copies of its hot-swaps (:class:`WorkerState`).

Memory: vLLM on CPU prepacks linear weights in ``process_weights_after_loading`` and
leaves the parameters empty, so the engine's own bytes cannot be served there; the
serving rank(s) keep the ``hf`` copy instead (see :mod:`tensorhub.integrations._core.worker`).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Optional

from .._core import worker
from .._core.load import specs_of
from .._core.ranks import EngineRanks
from .._core.settings import Settings

logger = logging.getLogger(__name__)

__all__ = ["HOOKS", "WorkerState", "off_engine_cores", "connect", "engine", "layer_groups"]


def engine() -> EngineRanks:
    """This worker's engine: its pipeline stages x TP ranks (x prefill-context-parallel
    ranks, which hold the same weights as their TP peers); a lone process outside vLLM."""
    try:
        from vllm.distributed import parallel_state as ps

        axes = [("pp", ps.get_pp_group())]
        pcp = getattr(ps, "_PCP", None)  # vLLM's prefill context parallelism, when it has any
        if pcp is not None:
            axes.append(("pcp", pcp))
        axes.append(("tp", ps.get_tp_group()))
    except Exception:  # not initialised (unit use)
        return EngineRanks()
    return EngineRanks(axes)


def layer_groups(names: list) -> list:
    """vLLM's own partition of checkpoint names into layers (``layerwise_groups``)."""
    from vllm.distributed.weight_transfer.base import layerwise_groups

    return layerwise_groups(list(names))


#: vLLM for the core.
HOOKS = worker.EngineHooks("vllm", engine, layer_groups)


@dataclass
class WorkerState(worker.WorkerState):
    """The core's worker state plus what vLLM's weight-transfer engine keeps between swaps
    (``reuse_buffers``, ``prefetch``)."""

    spare: Optional[dict] = None  # a drained old copy (same tensors), the next swap's destination
    prefetcher: Any = None  # the _prefetch.Prefetcher of this worker (setting ``prefetch``)
    native_refused: bool = False  # logged once why the native layout is not served
    hooks: worker.EngineHooks = HOOKS

    def take_spare(self) -> Optional[dict]:
        """The kept copy, for a fetch to land in; it leaves the state (a failed fetch leaves
        it in no known state, and it is dropped)."""
        with self._copies:
            spare, self.spare = self.spare, None
        return spare

    def spare_base(self, spare: Optional[dict], v: int) -> Optional[int]:
        """The version ``spare`` holds, as the delta base for fetching ``v`` into it: on a rank
        that serves nothing the kept copy is the running version's fetched copy (checked
        against the delta's checksums before any delta is applied; a wrong one reads in full)."""
        old = self.version
        return old if spare is not None and not self.serving and old is not None and old < v else None

    def drained(self, copy: Any) -> None:
        """A retired copy nobody reads any more (the core's ``retire``, on a background
        thread after a swap or a superseded prefetch): one of the running version's tensors
        is kept as :attr:`spare`, the next swap's destination (``reuse_buffers``)."""
        if self.settings.reuse_buffers and self.spare is None and self.specs is not None \
                and specs_of(copy) == self.specs:
            self.spare = dict(copy)

    def retire_later(self, old_v: Optional[int], old_copy: Any, reason: str = "") -> None:
        """:meth:`retire` on a background thread: draining readers never stalls the engine."""
        threading.Thread(target=self.retire, args=(old_v, old_copy, reason), name="tensorhub-retire",
                         daemon=True).start()


#: (moved to the engine-neutral core, which SGLang's start in place uses too)
off_engine_cores = worker.off_engine_cores
engine_quiet = worker.engine_quiet


def connect(settings: Settings) -> WorkerState:
    """This process's state (the core's :func:`~tensorhub.integrations._core.worker.connect`)."""
    return worker.connect(settings, HOOKS, WorkerState)
