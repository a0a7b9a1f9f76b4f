"""What one SGLang TP worker holds: its Hub, the version it runs, its replicas.

Runs in every SGLang scheduler process (one per TP/PP rank). The model loader creates the
state at start; the pull function (:mod:`.pull`, same process) reuses it for hot-swaps.

Replicas per rank, for the version the engine runs:

* the engine-native layout (``native=true``): the rank's parameters, registered **in
  place** (no copy) as shard ``tp_rank`` of ``tp_size`` under the layout name
  :func:`fingerprint` returns. Same-layout peers (another SGLang engine with the same
  SGLang version, model config, dtype, quantization, TP/PP) read them raw; so does
  SGLang's own ``remote_instance`` loader through :mod:`.seed`.
* the ``hf`` copy (checkpoint names, full tensors) the serving rank(s) fetched
  (``serve_ranks``), kept and registered for trainers, vLLM and other TP sizes. A start
  or swap that read the native layout has no ``hf`` copy to keep.

Before the parameters change (a swap), the rank unpublishes the version it runs (both
layouts), which returns once that version's readers drained: memory a reader may still
read is never overwritten (invariant 3).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional

from integrations.vllm._runtime import _resolve_here, check_same_layout, open_hub, specs_of

from .._ranks import EngineRanks
from ._settings import Settings, SettingsError

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()
_STATE: Optional["WorkerState"] = None

__all__ = ["WorkerState", "connect", "get_state", "fingerprint", "native_tensors"]


@dataclass
class WorkerState:
    """Per SGLang TP worker process; see the module docstring."""

    settings: Settings
    hub: Any
    rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    serving: bool = True  # this rank keeps and serves an hf copy it fetched
    version: Optional[int] = None  # the version the parameters hold
    copy: Optional[Mapping[str, Any]] = None  # the hf copy of ``version`` (registered if serving)
    specs: Optional[dict] = None  # name -> (shape, dtype) of the hf tensors (None after a native load)
    layout: Optional[str] = None  # the native layout name, once computed
    native_published: bool = False  # the parameters are registered as ``version`` in ``layout``


def get_state() -> Optional[WorkerState]:
    return _STATE


def ranks() -> tuple[int, int, int, int]:
    """(tp rank, tp size, pp rank, pp size); (0, 1, 0, 1) outside an SGLang worker."""
    try:
        from sglang.srt.distributed import parallel_state as ps

        tp = ps.get_tp_group()
        pp = ps.get_pp_group()
        return tp.rank_in_group, tp.world_size, pp.rank_in_group, pp.world_size
    except Exception:  # parallel state not initialised (unit use)
        return 0, 1, 0, 1


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


def broadcast(obj: Any) -> Any:
    """The engine root's ``obj`` (PP stage 0, TP rank 0) on every rank of every stage."""
    return engine().broadcast(obj)


def gather(obj: Any) -> list[tuple[str, Any]]:
    """Every rank's ``obj`` with its place (``"pp stage 1, tp rank 0"``; ``""`` alone), over
    the whole engine, the same list on every rank."""
    return engine().gather(obj)


def connect(settings: Settings) -> WorkerState:
    """The process's state, connecting its Hub on first use."""
    global _STATE
    with _LOCK:
        if _STATE is not None:
            return _STATE
        tp_rank, tp_size, pp_rank, pp_size = ranks()
        hub = open_hub(settings, "sglang", tp_rank, tp_size, pp_rank)
        wid = hub.worker_id
        serving = settings.serve_ranks == "all" or tp_rank == 0
        _STATE = WorkerState(settings, hub, tp_rank, tp_size, pp_rank, pp_size, serving)
        logger.info("tensorhub: worker %s connected to %s (tp rank %d/%d, serving hf copy: %s)",
                    wid, settings.coordinator, tp_rank, tp_size, serving)
        return _STATE


def resolve(st: WorkerState, requested: Any, *, on_missing: str = "error",
            what: str = "setting 'version'") -> Optional[int]:
    """The version every rank of the engine loads, every TP rank of every pipeline stage;
    None = "load from disk". The engine's root (PP stage 0, TP rank 0) decides, the others
    receive its answer (or its one-line error)."""
    eng = engine()
    answer: Any = None
    if eng.root:
        try:
            answer = _resolve_here(st, requested, on_missing, what)
        except Exception as e:
            answer = ("error", str(e))
    answer = eng.broadcast(answer)
    if isinstance(answer, tuple):
        raise SettingsError(answer[1])
    return answer


# ---------------------------------------------------------------- native layout
def native_tensors(model: Any) -> dict:
    """The rank's parameters by SGLang name (what ``remote_instance`` readers ask for),
    in place: ``named_parameters()`` order, tied parameters once."""
    return {name: p.data for name, p in model.named_parameters()}


def fingerprint(model: Any, st: Optional[WorkerState] = None) -> str:
    """The native layout's name: ``sglang-<hash>`` of everything that fixes the bytes of
    one rank's parameters: engine and its version, the model config, the quantization,
    TP/PP sizes and the PP stage, and every parameter's name, shape and dtype. Two engines
    get the same name exactly when one's raw parameter bytes fit the other's."""
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
    tp_size, pp_rank, pp_size = (st.tp_size, st.pp_rank, st.pp_size) if st else ranks()[1:]
    doc = {
        "engine": "sglang", "engine_version": engine_version,
        "config": json.dumps(cfg_d, sort_keys=True, default=str),
        "quantization": None if quant is None else getattr(quant, "get_name", lambda: str(quant))(),
        "tp_size": tp_size, "pp_size": pp_size, "pp_rank": pp_rank,
        "params": [(n, list(t.shape), str(t.dtype)) for n, t in native_tensors(model).items()],
    }
    h = hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return f"sglang-{h}"


def publish_native(st: WorkerState, model: Any, version: int) -> None:
    """Register the rank's parameters in place as ``version``'s native shard."""
    if not st.settings.native:
        return
    tensors = native_tensors(model)
    bad = [n for n, t in tensors.items() if not t.is_contiguous()]
    if bad:
        logger.warning("tensorhub: not serving the native layout: parameter %r is not contiguous", bad[0])
        return
    st.layout = st.layout or fingerprint(model, st)
    st.hub.publish(st.settings.model, tensors, version=version, layout=st.layout, shard=st.rank,
                   num_shards=st.tp_size)
    st.native_published = True
    logger.info("tensorhub: tp rank %d serves %s v%d in place as layout %s (shard %d/%d, %.1f MB)",
                st.rank, st.settings.model, version, st.layout, st.rank, st.tp_size,
                sum(t.numel() * t.element_size() for t in tensors.values()) / 1e6)


def choose_layout(st: WorkerState, version: int) -> str:
    """The layout this pipeline stage's TP group reads ``version`` in (its TP rank 0 asks,
    the group follows; each stage has its own native layout): the native one when the
    coordinator has it complete, else ``hf``. Never raises: a status that cannot be read
    means ``hf``."""
    if not st.settings.native or st.layout is None:
        return "hf"
    try:
        for m in st.hub.api.status()["models"]:
            if m["model"] == st.settings.model:
                for v in m["versions"]:
                    if v["version"] == version and v["layouts"].get(st.layout, {}).get("complete"):
                        return st.layout
    except Exception as e:
        logger.warning("tensorhub: could not read the coordinator's status (%s); reading hf", e)
    return "hf"


def fetch(st: WorkerState, version: int, layout: str = "hf") -> Any:
    """Fetch ``version`` into new memory: ``hf`` (registered when this rank serves) or the
    native shard of this rank (never registered: the parameters are, once copied)."""
    s = st.settings
    t0 = time.monotonic()
    native = layout != "hf"
    got = st.hub.fetch(s.model, version, layout=layout, shard=st.rank if native else 0,
                       serve=st.serving and not native, timeout=s.fetch_timeout)
    logger.info("tensorhub: fetched %s v%d (%s): %.1f MB in %.2fs (%.2f GB/s) from %s%s",
                s.model, version, layout, got.nbytes / 1e6, time.monotonic() - t0, got.gbps, got.sources,
                f"; failed sources {got.failed_sources}" if got.failed_sources else "")
    return got


def copy_native(model: Any, got: Mapping[str, Any]) -> None:
    """Copy a fetched native shard into the parameters (names, shapes, dtypes checked first)."""
    params = native_tensors(model)
    check_same_layout(specs_of(params), got, "the fetched native shard")
    for name, t in params.items():
        t.copy_(got[name])


# ---------------------------------------------------------------- hf loading
_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


def buckets(tensors: Mapping[str, Any], limit: int) -> Iterator[list[tuple[str, Any]]]:
    """``(name, tensor)`` lists of at most ``limit`` bytes (one tensor may exceed it), cut
    between layers (``...layers.<i>.``) once half full."""
    cur: list[tuple[str, Any]] = []
    size, layer = 0, None
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        m = _LAYER.match(name)
        this = m.group(1) if m else None
        if cur and (size + n > limit or (this != layer and size >= limit // 2)):
            yield cur
            cur, size = [], 0
        cur.append((name, t))
        size += n
        layer = this
    if cur:
        yield cur


def load_into(model: Any, tensors: Mapping[str, Any], limit: int) -> int:
    """Feed ``tensors`` to SGLang's ``model.load_weights`` bucket by bucket; returns the count."""
    n = biggest = 0
    for bucket in buckets(tensors, limit):
        model.load_weights(iter(bucket))
        biggest = max(biggest, sum(t.numel() * t.element_size() for _, t in bucket))
        n += 1
    logger.info("tensorhub: load_weights in %d bucket(s), largest %.1f MB (limit %.1f MB)",
                n, biggest / 1e6, limit / 1e6)
    return n
