"""The engine-native layout of an SGLang engine: each rank's parameters, served in place.

* the engine-native layout (``native=true``): the rank's parameters, registered **in
  place** (no copy) as shard ``tp_rank`` of ``tp_size`` under the layout name
  :func:`fingerprint` returns (one layout per pipeline stage: the name includes the
  stage). Same-layout peers (another SGLang engine with the same SGLang version, model
  config, dtype, quantization, TP/PP) read them raw; so does SGLang's own
  ``remote_instance`` loader through :mod:`.seed`.
* the ``hf`` copy (checkpoint names, full tensors) the serving rank(s) fetched
  (``serve_ranks``), kept and registered for trainers, vLLM and other TP sizes. A start
  or swap that read the native layout has no ``hf`` copy to keep.

Before the parameters change (a swap), the rank unpublishes the version it runs (both
layouts), which returns once that version's readers drained: memory a reader may still
read is never overwritten (invariant 3).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Optional

from .._core.load import layout_name
from .._core.worker import WorkerState, serve_in_place, version_status
from ._runtime import engine

logger = logging.getLogger(__name__)

__all__ = ["native_tensors", "fingerprint", "publish", "choose_layout"]


def native_tensors(model: Any) -> dict:
    """The rank's parameters by SGLang name (what ``remote_instance`` readers ask for),
    in place: ``named_parameters()`` order, tied parameters once."""
    return {name: p.data for name, p in model.named_parameters()}


def fingerprint(model: Any, st: Optional[WorkerState] = None) -> str:
    """The native layout's name: ``sglang-<hash>`` of everything that fixes the bytes of
    one rank's parameters (:func:`~tensorhub.integrations._core.load.layout_name`): engine and its
    version, the model config, the quantization, TP/PP sizes and the PP stage, and every
    parameter's name, shape and dtype."""
    try:
        from importlib.metadata import version as _v

        engine_version = _v("sglang")
    except Exception:
        engine_version = "unknown"
    cfg = getattr(model, "config", None)
    try:
        cfg_d = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(vars(cfg)) if cfg is not None else {}
    except Exception:
        cfg_d = {}
    quant = getattr(model, "quant_config", None)
    if st is not None:
        tp_size, pp_rank, pp_size = st.tp_size, st.pp_rank, st.pp_size
    else:
        eng = engine()
        tp_size, pp_rank, pp_size = eng.size_on("tp"), eng.rank_on("pp"), eng.size_on("pp")
    return layout_name("sglang", native_tensors(model), engine_version=engine_version,
                       config=json.dumps(cfg_d, sort_keys=True, default=str),
                       quantization=None if quant is None else getattr(quant, "get_name", lambda: str(quant))(),
                       tp_size=tp_size, pp_size=pp_size, pp_rank=pp_rank)


def publish(st: WorkerState, model: Any, version: int) -> None:
    """Register the rank's parameters in place as ``version``'s native shard."""
    if not st.settings.native:
        return
    tensors = native_tensors(model)
    bad = [n for n, t in tensors.items() if not t.is_contiguous()]
    if bad:
        logger.warning("tensorhub: not serving the native layout: parameter %r is not contiguous", bad[0])
        return
    st.layout = st.layout or fingerprint(model, st)
    serve_in_place(st, tensors, version, st.rank, st.tp_size)  # one layout per stage: TP shards only


def choose_layout(st: WorkerState, version: int) -> str:
    """The layout this pipeline stage's TP group reads ``version`` in (its TP rank 0 asks,
    the group follows; each stage has its own native layout): the native one when the
    coordinator has it complete, else ``hf``. Never raises: a status that cannot be read
    means ``hf``.

    ``hf`` also wins over a complete native layout when ``version`` has a delta against the
    version this stage runs (layout ``delta:<running>``) and every rank of the stage keeps
    that version's ``hf`` copy (TP 1, or ``serve_ranks="all"``): each rank then reads only
    the delta and applies it to its copy (``Hub.fetch``), a few % of the bytes."""
    if not st.settings.native or st.layout is None:
        return "hf"
    from tensorhub.protocol import delta_layout

    try:
        v = version_status(st.hub, st.settings.model, version)
        if v is not None and v.layout_complete(st.layout):
            if _delta_base_everywhere(st) and v.layout_complete(delta_layout(st.version)):
                return "hf"
            return st.layout
    except Exception as e:
        logger.warning("tensorhub: could not read the coordinator's status (%s); reading hf", e)
    return "hf"


def _delta_base_everywhere(st: WorkerState) -> bool:
    """Whether every rank of this stage keeps the running version's ``hf`` copy (a delta base)."""
    return st.version is not None and st.copy is not None and (st.tp_size == 1 or st.settings.serve_ranks == "all")
