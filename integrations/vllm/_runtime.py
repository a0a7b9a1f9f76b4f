"""vLLM's hooks into the engine-neutral core, and what a vLLM worker keeps between swaps.

Runs in every vLLM worker process (one per TP/PP rank). The core
(:mod:`integrations._core.worker`) connects, resolves, fetches and loads; vLLM tells it its
ranks (:func:`engine`: pipeline stages x prefill-context-parallel x TP ranks, from vLLM's
``parallel_state``) and its layer groups (vLLM's ``layerwise_groups``), and keeps, beyond
the core's state, the old ``hf`` copies of its hot-swaps (:class:`WorkerState`).

Memory: vLLM on CPU prepacks linear weights in ``process_weights_after_loading`` and
leaves the parameters empty, so the engine's own bytes cannot be served there; the
serving rank(s) keep the ``hf`` copy instead (see :mod:`integrations._core.worker`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
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

    retired: list = field(default_factory=list)  # old (version, copy) whose readers had not drained
    spare: Optional[dict] = None  # a drained old copy (same tensors), the next swap's destination
    prefetcher: Any = None  # the _prefetch.Prefetcher of this worker (setting ``prefetch``)
    keeper: Optional[threading.Thread] = None  # making the hf copy after a start in place (keep_borrowed)
    native_refused: bool = False  # logged once why the native layout is not served
    hooks: worker.EngineHooks = HOOKS
    _copies: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

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

    def retire(self, old_v: Optional[int], old_copy: Any, reason: str = "") -> None:
        """Stop serving ``old_v`` (and copies retired earlier) and free them once their
        readers drained; a copy whose readers did not drain stays allocated for next time,
        and one drained copy of the running version's tensors is kept as :attr:`spare`.
        Runs on a background thread after a swap or a superseded prefetch (holder side)."""
        import tensorhub

        s = self.settings
        if reason:
            logger.info("tensorhub: dropping the fetched %s v%s: %s", s.model, old_v, reason)
        with self._copies:
            pending = list(self.retired)
            if old_v is not None and old_copy is not None:
                pending.append((old_v, old_copy))
            self.retired = []
            for v, copy in pending:
                try:
                    self.hub.unpublish(s.model, v, timeout=s.drain_timeout)
                except tensorhub.NotFoundError:
                    pass  # not held (any more)
                except tensorhub.TensorHubError as e:
                    logger.warning("tensorhub: keeping %s v%d allocated: %s", s.model, v, e)
                    self.retired.append((v, copy))
                    continue
                # Drained: nobody reads it any more. Keep one as the next swap's destination.
                if s.reuse_buffers and self.spare is None and self.specs is not None \
                        and specs_of(copy) == self.specs:
                    self.spare = dict(copy)

    def keep_borrowed(self, borrowed: Any, v: int) -> None:
        """After a start in place (``load.borrow_into``): make this serving rank's ``hf``
        copy of ``v`` from the borrowed memory on a background thread that gives way to the
        engine (:func:`off_engine_cores`), release the lease, register the copy (``publish``
        of ``v``: the coordinator checks its checksums) and keep it as :attr:`copy`.
        The engine answers requests meanwhile; it serves ``v`` once the copy is in. If the
        lease lapsed during the copy, the copy is dropped and ``v`` fetched instead. A swap
        waits for this first (:meth:`wait_kept`)."""
        self.keeper = threading.Thread(target=self._keep, args=(borrowed, v), name="tensorhub-keep", daemon=True)
        self.keeper.start()

    def _keep(self, borrowed: Any, v: int) -> None:
        import tensorhub

        from .._core.load import copy_bytes

        s = self.settings
        off_engine_cores()
        waited = engine_quiet()
        t0 = time.monotonic()
        copy: Any = None
        try:
            copy = self.hub.empty_like(borrowed)  # Hub memory: same-host readers copy from it in turn
            copy_bytes(copy, borrowed)
            borrowed.release()
            self.hub.publish(s.model, copy, version=v, layout="hf")
            how = "copied from the borrowed memory"
        except Exception as e:
            borrowed.release_quietly()
            copy = None
            logger.warning("tensorhub: keeping %s v%d from the borrowed memory failed (%s); fetching it", s.model, v,
                           e if isinstance(e, tensorhub.TensorHubError) else repr(e))
            try:
                copy = worker.fetch(self, v)
                how = "fetched"
            except Exception as e2:
                logger.warning("tensorhub: the engine runs %s v%d but serves no hf copy of it: %s", s.model, v, e2)
                return
        with self._copies:
            current = self.version == v and self.copy is None
            if current:
                self.copy = copy
        if not current:
            self.retire(v, copy, reason="the engine moved on while it was being copied")
            return
        logger.info("tensorhub: worker %s serves its hf copy of %s v%d (%s in the background in %.2fs, "
                    "after %.2fs waiting for the engine's start to quiet down)",
                    self.hub.worker_id, s.model, v, how, time.monotonic() - t0, waited)

    def wait_kept(self, timeout: float) -> None:
        """Wait (up to ``timeout``) for :meth:`keep_borrowed`'s copy: a swap then finds the
        running version's copy where it expects it."""
        k = self.keeper
        if k is not None:
            k.join(timeout)

    def retire_later(self, old_v: Optional[int], old_copy: Any, reason: str = "") -> None:
        """:meth:`retire` on a background thread: draining readers never stalls the engine."""
        threading.Thread(target=self.retire, args=(old_v, old_copy, reason), name="tensorhub-retire",
                         daemon=True).start()


def engine_quiet(limit: float = 10.0, window: float = 0.2, busy: float = 0.5) -> float:
    """Wait until this worker process has used less than ``busy`` of a core over ``window``
    seconds (vLLM's start after the load -- profiling, the KV cache, warm-up -- is done),
    at most ``limit`` seconds; returns the seconds waited. Why: a background copy of the
    model into new memory right after the load (page faults, memory bandwidth) made vLLM's
    "init engine" step 0.5 -> 1.3 s on the test VM; idle, the engine loses nothing to it."""
    import os

    t0 = time.monotonic()
    used = sum(os.times()[:2])
    while time.monotonic() - t0 < limit:
        time.sleep(window)
        now = sum(os.times()[:2])
        if now - used < busy * window:
            break
        used = now
    return time.monotonic() - t0


def off_engine_cores() -> None:
    """Make the calling thread (Linux: per thread) give way to the engine: off the cores
    the engine's threads are pinned to (vLLM's CPU worker pins its OpenMP threads, and
    every thread they start, to its cores; the others are left to its front-end processes),
    onto the others (every core when it has them all), at nice 10 (the front end's start
    goes first; unlike nice 19, a busy host still lets it finish). Best effort."""
    import os

    try:
        mine = os.sched_getaffinity(0)
        every = set(range(os.cpu_count() or 1))
        os.sched_setaffinity(0, (every - mine) or every)
    except (AttributeError, OSError, ValueError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


def connect(settings: Settings) -> WorkerState:
    """This process's state (the core's :func:`~integrations._core.worker.connect`)."""
    return worker.connect(settings, HOOKS, WorkerState)
