"""SGLang's hooks into the engine-neutral core: its ranks and its layer groups.

Runs in every SGLang scheduler process (one per TP/PP rank). The core
(:mod:`tensorhub.integrations._core.worker`) connects, resolves, fetches and loads; SGLang tells it
its ranks (:func:`engine`: every pipeline stage x TP rank, from SGLang's
``parallel_state``; :func:`stage`: this stage's TP group, over which the per-stage native
layout is chosen) and how its checkpoint names group into layers (:func:`layer_groups`).
The engine-native layout (parameters served in place) is :mod:`._native`.
"""

from __future__ import annotations

import re
from typing import Any

from .._core import worker
from .._core.ranks import EngineRanks
from .._core.settings import Settings

__all__ = ["HOOKS", "connect", "engine", "stage", "layer_groups"]


def _groups() -> tuple[Any, Any]:
    """(PP group, TP group) of this worker; (None, None) outside an SGLang worker."""
    try:
        from sglang.srt.distributed import parallel_state as ps

        return ps.get_pp_group(), ps.get_tp_group()
    except Exception:  # parallel state not initialised (unit use)
        return None, None


def engine() -> EngineRanks:
    """This worker's engine: every pipeline stage x TP rank (a lone process outside SGLang)."""
    pp, tp = _groups()
    return EngineRanks([("pp", pp), ("tp", tp)])


def stage() -> EngineRanks:
    """This worker's pipeline stage: its TP group only (for what differs per stage, such as
    the native layout, whose name includes the stage)."""
    return EngineRanks([("tp", _groups()[1])])


_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


def layer_groups(names: list) -> list:
    """Runs of consecutive names of one layer (``...layers.<i>.``); the names between
    layers (embeddings, final norm, ``lm_head``) group likewise."""
    out: list = []
    key: Any = object()
    for name in names:
        m = _LAYER.match(name)
        this = m.group(1) if m else None
        if not out or this != key:
            out.append([])
            key = this
        out[-1].append(name)
    return out


#: SGLang for the core.
HOOKS = worker.EngineHooks("sglang", engine, layer_groups)


def connect(settings: Settings) -> worker.WorkerState:
    """This process's state (the core's :func:`~tensorhub.integrations._core.worker.connect`)."""
    return worker.connect(settings, HOOKS)
