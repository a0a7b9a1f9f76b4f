"""What the plug-in adds to vLLM's engine core: cache reset and the version label at a swap.

Runs in vLLM's engine-core process (the process that schedules; offline ``LLM`` and the
OpenAI server alike), installed by :func:`tensorhub.integrations.vllm.register` (which vLLM calls at
the top of ``EngineCore.__init__``). It acts only on engines configured with
``--weight-transfer-config '{"backend": "tensorhub"}'`` or ``--load-format tensorhub``.

**Caches at a swap.** vLLM keys its prefix cache by token ids, not by weights: without a
reset, a prompt seen before a swap would reuse KV blocks computed with the old weights.
vLLM resets its caches when generation is paused (``/pause``, ``clear_cache`` true by
default), but not on the weight-update calls themselves: an offline ``LLM`` (which has no
pause), vLLM's trainer-side clients (``HTTPVLLMWeightSyncClient`` and the Ray client call
``start/update/finish_weight_update`` without pausing) and ``/pause?clear_cache=false``
all keep the old blocks. So right after every successful ``update_weights`` of the
tensorhub backend, inside the same engine-core call (no step runs in between), the engine
core runs vLLM's own ``_reset_caches``: the prefix cache (running requests are preempted
and recompute their KV with the new weights, as vLLM's pause does), the multi-modal and
encoder caches, and a KV connector's.

**The version label.** vLLM labels every output token with the engine core's weight
version (``CompletionOutput.weight_versions``, ``/weight_info``); it is ``"default"`` until
someone calls ``finish_weight_update(weight_version=...)``. Here the label becomes the
TensorHub version the workers hold: once the engine is up (``--load-format tensorhub``
loaded ``vN``) and in the same engine-core call as each successful ``update_weights``, so
the tokens of the first step on the new weights already carry the new version, even when
the caller does not pause. ``finish_weight_update(weight_version=X)`` still sets vLLM's
label to ``X`` afterwards (``tensorhub follow`` and the trainer engine pass the TensorHub
number, so it stays the same).

**A failed swap.** When a tensorhub ``update_weights`` raises, the workers have rolled back
to the version they ran (:mod:`tensorhub.integrations._core.rollback`): the caches are reset all the
same and the label is set to the version the workers hold (the old one). If a worker could
not restore it, its parameters are a mix of two versions: the engine then refuses every
request (``add_request`` raises; in the OpenAI server's engine-core process the busy loop
stops, so vLLM reports the engine dead and ``/health`` fails) -- a restart, not an answer
from mixed weights.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

logger = logging.getLogger(__name__)

__all__ = ["install", "worker_version", "worker_broken", "uses_tensorhub"]


def worker_version(worker: Any = None) -> Optional[int]:
    """The TensorHub version this worker's parameters hold (None: no TensorHub state, e.g.
    weights from vLLM's own loader and no swap yet). Called on every worker through
    ``collective_rpc`` (vLLM passes the worker)."""
    from .._core import worker as core

    st = core.get_state()
    return None if st is None else st.version


def uses_tensorhub(vllm_config: Any) -> bool:
    """The engine runs TensorHub's weight-transfer backend or its loader."""
    wt = getattr(vllm_config, "weight_transfer_config", None)
    load = getattr(vllm_config, "load_config", None)
    return getattr(wt, "backend", None) == "tensorhub" or getattr(load, "load_format", None) == "tensorhub"


def _label(core: Any, when: str) -> None:
    """Set vLLM's weight-version label to the version the workers hold (PP stage 0's TP rank
    0 answers first; every rank holds the same version)."""
    try:
        versions = core.model_executor.collective_rpc(worker_version)
    except Exception as e:  # the label is a convenience; never break the engine for it
        logger.warning("tensorhub: could not read the workers' version %s: %s", when, e)
        return
    v = versions[0] if isinstance(versions, list) and versions else versions
    if isinstance(v, int):
        core.set_weight_version(str(v))


def _reset(core: Any) -> None:
    reset = getattr(core, "_reset_caches", None)
    if reset is not None:  # vLLM's own: exactly what /pause(clear_cache=True) runs
        reset(reset_running_requests=True, reset_connector=True)
    elif not core.reset_prefix_cache(reset_running_requests=True):
        raise RuntimeError("tensorhub: vLLM could not reset its prefix cache after the swap")


def worker_broken(worker: Any = None) -> Optional[str]:
    """Why this worker's parameters are a mix of two versions (a failed swap whose rollback
    failed too), None when they are one version's bytes. Called through ``collective_rpc``."""
    from .._core import worker as core

    st = core.get_state()
    return None if st is None else st.broken


def worker_touched(worker: Any = None) -> bool:
    """Whether this worker's last swap changed parameters (then rolled back or not)."""
    from .._core import worker as core

    st = core.get_state()
    return st is not None and st.touched


def _after_failed_swap(core: Any) -> None:
    """A tensorhub ``update_weights`` raised: the workers rolled back to the version they ran
    (or could not). Reset the caches if any worker got as far as changing parameters (a
    failed fetch changed none: the cache stays valid), keep the label at the version the workers hold, and if
    any worker could not restore, stop the engine serving (:func:`_refuse_if_broken`)."""
    try:
        if any(_as_list(core.model_executor.collective_rpc(worker_touched))):
            _reset(core)
    except Exception as e:
        logger.warning("tensorhub: cache reset after the failed swap failed: %s", e)
    _label(core, "after the failed swap")
    try:
        why = next((b for b in _as_list(core.model_executor.collective_rpc(worker_broken)) if b), None)
    except Exception as e:
        why = f"could not ask the workers whether they restored the old version: {e}"
    if why:
        core._tensorhub_broken = why
        logger.error("tensorhub: %s; the engine refuses every request from now on (never answering with a mix "
                     "of layers): restart it", why)
    else:
        logger.warning("tensorhub: the swap failed and was rolled back; the engine serves v%s (prefix/KV cache "
                       "reset)", core.get_weight_version())


#: The first item of a worker's answer whose update_weights raised (guarded_update_weights).
_FAILED = "tensorhub: update_weights failed"


def guarded_update_weights(worker: Any, *args: Any, **kwargs: Any) -> tuple:
    """``worker.update_weights(...)`` with its error returned as a value, ``(_FAILED, message)``,
    instead of raised; ``(None, result)`` otherwise. Called on every worker through
    ``collective_rpc``. vLLM's multiprocess executor stops reading replies at the first worker
    that raised and leaves the other workers' replies queued, so the engine core's next call
    (the cache reset and rollback checks of :func:`_after_failed_swap`, or any later one)
    would read a stale reply: with TP > 1 a rolled-back engine was marked broken. The error
    is raised again in the engine core once every worker has answered."""
    try:
        return None, worker.update_weights(*args, **kwargs)
    except Exception as e:
        logger.error("tensorhub: update_weights failed on this worker: %s", e, exc_info=True)
        return _FAILED, str(e)


def _as_list(x: Any) -> list:
    return x if isinstance(x, list) else [x]


def _refuse_if_broken(core: Any) -> None:
    why = getattr(core, "_tensorhub_broken", None)
    if why:
        raise RuntimeError(f"tensorhub: this engine refuses requests: {why}; restart it")


def _hook_proc() -> None:
    """The engine-core process (the OpenAI server's): once a failed swap left a mix of
    layers, the utility call's error goes out first, then the busy loop stops, so vLLM marks
    the engine dead (``/health`` fails, every request gets an error) instead of serving it."""
    try:
        from vllm.v1.engine.core import EngineCoreProc
    except Exception:
        return
    handle = getattr(EngineCoreProc, "_handle_client_request", None)
    if handle is None:
        return

    def _handle_client_request(self, request_type, request):
        out = handle(self, request_type, request)
        _refuse_if_broken(self)
        return out

    _handle_client_request.__doc__ = handle.__doc__
    EngineCoreProc._handle_client_request = _handle_client_request


def install() -> bool:
    """Wrap ``EngineCore.collective_rpc`` (after ``update_weights``: reset the caches, set
    the label; after a failed one as well, and stop the engine if a worker could not roll
    back), ``EngineCore.add_request`` (refused once a worker could not roll back) and
    ``EngineCore._initialize_kv_caches`` (the engine is up: set the label).
    Idempotent; False (and one warning) when this vLLM lacks the names."""
    try:
        from vllm.v1.engine.core import EngineCore
    except Exception as e:  # not a vLLM with a V1 engine core
        logger.warning("tensorhub: no vLLM engine core to hook (%s): caches are not reset at swaps", e)
        return False
    if getattr(EngineCore, "_tensorhub_hooked", False):
        return True
    rpc, init_kv = getattr(EngineCore, "collective_rpc", None), getattr(EngineCore, "_initialize_kv_caches", None)
    add_req = getattr(EngineCore, "add_request", None)
    if rpc is None or init_kv is None or add_req is None:
        logger.warning("tensorhub: this vLLM's EngineCore has no collective_rpc/_initialize_kv_caches: "
                       "caches are not reset at swaps")
        return False

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        if method != "update_weights" or not uses_tensorhub(self.vllm_config):
            return rpc(self, method, timeout, args, kwargs)
        # Every worker answers (its error as a value): see guarded_update_weights.
        answers = _as_list(rpc(self, guarded_update_weights, timeout, args, kwargs))
        failed = [msg for tag, msg in answers if tag == _FAILED]
        if failed:
            _after_failed_swap(self)
            raise RuntimeError(failed[0])
        out = [result for _, result in answers]
        _reset(self)
        _label(self, "after the swap")
        logger.info("tensorhub: weights swapped to v%s: prefix/KV cache reset (blocks computed with the old "
                    "weights are never reused; running requests recompute theirs)", self.get_weight_version())
        return out

    def add_request(self, *a, **kw):
        _refuse_if_broken(self)
        return add_req(self, *a, **kw)

    def _initialize_kv_caches(self, *a, **kw):
        out = init_kv(self, *a, **kw)
        if uses_tensorhub(self.vllm_config):
            _label(self, "at start")
        return out

    collective_rpc.__doc__, _initialize_kv_caches.__doc__ = rpc.__doc__, init_kv.__doc__
    add_request.__doc__ = add_req.__doc__
    EngineCore.collective_rpc = collective_rpc
    EngineCore.add_request = add_request
    _hook_proc()
    EngineCore._initialize_kv_caches = _initialize_kv_caches
    EngineCore._tensorhub_hooked = True
    return True
