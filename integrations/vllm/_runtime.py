"""What one vLLM worker process holds: its Hub, the version it serves, its ``hf`` copy.

Runs in every vLLM worker process (one per TP/PP rank). The model loader creates the
state at start; the weight-transfer engine (same process) reuses it for hot-swaps.

Memory: vLLM on CPU prepacks linear weights in ``process_weights_after_loading`` and
leaves the parameters empty, so the engine's own bytes cannot be served. The serving
rank(s) therefore keep an ``hf`` copy of the version (checkpoint names and dtypes, the
size of the checkpoint) registered with the coordinator: one extra model-size of host
memory per serving rank, plus a second one during a hot-swap until readers of the old
version drained.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional

from .._ranks import EngineRanks
from ._settings import Settings, SettingsError

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()
_STATE: Optional["WorkerState"] = None


@dataclass
class WorkerState:
    """Per worker process; see the module docstring."""

    settings: Settings
    hub: Any
    rank: int = 0
    tp_size: int = 1
    serving: bool = True  # this rank keeps and serves the hf copy
    version: Optional[int] = None
    copy: Optional[Mapping[str, Any]] = None  # the hf copy of ``version`` (registered if serving)
    specs: Optional[dict] = None  # name -> (shape, dtype) of the hf tensors the engine runs (every rank)
    retired: list = field(default_factory=list)  # old copies whose readers had not drained
    pp_rank: int = 0
    pp_size: int = 1
    layout: Optional[str] = None  # the engine-native layout's name (see _native.fingerprint)
    native: bool = False  # the parameters are registered in place as ``version`` in ``layout``
    native_refused: bool = False  # logged once why the native layout is not served
    spare: Optional[dict] = None  # a drained old copy (same tensors), the next swap's destination
    prefetcher: Any = None  # the _prefetch.Prefetcher of this worker (setting ``prefetch``)


def get_state() -> Optional[WorkerState]:
    return _STATE


def ranks() -> tuple[int, int, int]:
    """(tp rank, tp size, pp rank) of this worker; (0, 1, 0) outside a vLLM worker."""
    try:
        from vllm.distributed import parallel_state as ps

        return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(), \
            ps.get_pp_group().rank_in_group
    except Exception:  # not initialised (unit use)
        return 0, 1, 0


def _pp_size() -> int:
    try:
        from vllm.distributed import parallel_state as ps

        return ps.get_pp_group().world_size
    except Exception:
        return 1


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


def broadcast(obj: Any) -> Any:
    """The engine root's ``obj`` (PP stage 0, TP rank 0) on every rank of every stage."""
    return engine().broadcast(obj)


def gather(obj: Any) -> list[tuple[str, Any]]:
    """Every rank's ``obj`` with its place (``"pp stage 1, tp rank 0"``; ``""`` alone), over
    the whole engine, the same list on every rank."""
    return engine().gather(obj)


def _probe(settings: Settings) -> None:
    """Fail fast, naming the setting, when the coordinator does not answer."""
    import httpx

    url = settings.coordinator.rstrip("/")
    deadline = time.monotonic() + settings.connect_timeout
    last: Exception | str = ""
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{url}/healthz", timeout=min(5.0, settings.connect_timeout))
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            last = e
        time.sleep(0.5)
    raise SettingsError(f"tensorhub: setting 'coordinator': {url} did not answer within "
                        f"{settings.connect_timeout:g}s ({last})")


def open_hub(settings: Settings, engine: str, tp_rank: int, tp_size: int, pp_rank: int) -> Any:
    """Probe the coordinator and connect this rank's Hub (worker id ``<base>[-tp<r>][-pp<r>]``,
    base from the settings, ``TENSORHUB_WORKER_ID`` or ``<engine>-<host>-<pid>``); a refused
    token becomes the one-line settings error. Shared by the vLLM and SGLang adapters."""
    import tensorhub

    _probe(settings)
    base = settings.worker_id or os.environ.get("TENSORHUB_WORKER_ID") or \
        f"{engine}-{socket.gethostname()}-{os.getpid()}"
    wid = base + (f"-tp{tp_rank}" if tp_size > 1 else "") + (f"-pp{pp_rank}" if pp_rank else "")
    try:
        return tensorhub.connect(settings.coordinator, worker_id=wid, locality=settings.locality,
                                 token=settings.token, fetch_timeout=settings.fetch_timeout)
    except tensorhub.UnauthorizedError as e:
        raise SettingsError(f"tensorhub: setting 'token': the coordinator at {settings.coordinator} "
                            f"refused it ({e.message})") from None


def read_disk(model_dir: str) -> dict:
    """``on_missing="disk"``: every ``*.safetensors`` tensor in ``model_dir``, contiguous."""
    import glob

    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise SettingsError(f"tensorhub: setting 'on_missing'='disk': no *.safetensors in {model_dir}")
    out: dict = {}
    for f in files:
        out.update(load_file(f))
    return {k: v.contiguous() for k, v in out.items()}


def connect(settings: Settings) -> WorkerState:
    """The process's state, connecting its Hub on first use (same settings expected)."""
    global _STATE
    with _LOCK:
        if _STATE is not None:
            return _STATE
        tp_rank, tp_size, pp_rank = ranks()
        hub = open_hub(settings, "vllm", tp_rank, tp_size, pp_rank)
        wid = hub.worker_id
        serving = settings.serve_ranks == "all" or tp_rank == 0
        _STATE = WorkerState(settings, hub, tp_rank, tp_size, serving, pp_rank=pp_rank, pp_size=_pp_size())
        logger.info("tensorhub: worker %s connected to %s (tp rank %d/%d, serving hf copy: %s)",
                    wid, settings.coordinator, tp_rank, tp_size, serving)
        return _STATE


def resolve(st: WorkerState, requested: Any, *, on_missing: str = "error",
            what: str = "setting 'version'") -> Optional[int]:
    """The version every rank of the engine loads, every TP rank of every pipeline stage;
    None means "no version, load from disk".

    The engine's root (PP stage 0, TP rank 0) decides, the others receive its answer (or
    its error text): a version published meanwhile cannot split the stages."""
    eng = engine()
    answer: Any = None
    if eng.root:
        try:
            answer = _resolve_here(st, requested, on_missing, what)
        except Exception as e:  # hand the one-line error to every rank
            answer = ("error", str(e))
    answer = eng.broadcast(answer)
    if isinstance(answer, tuple):
        raise SettingsError(answer[1])
    return answer


def _resolve_here(st: WorkerState, requested: Any, on_missing: str, what: str) -> Optional[int]:
    import tensorhub

    s, hub = st.settings, st.hub
    if requested != "latest":
        st_all = hub.api.status()
        m = next((m for m in st_all["models"] if m["model"] == s.model), None)
        if m is None:
            raise SettingsError(f"tensorhub: setting 'model': unknown model {s.model!r} on {s.coordinator}")
        vi = next((v for v in m["versions"] if v["version"] == requested), None)
        if vi is None or not vi["complete"]:
            have = [v["version"] for v in m["versions"] if v["complete"]]
            raise SettingsError(f"tensorhub: {what}: {s.model!r} has no complete version {requested} "
                                f"(complete: {have or 'none'})")
        return int(requested)
    try:
        return hub.latest(s.model) or _missing(st, on_missing, f"model {s.model!r} has no complete version yet")
    except tensorhub.NotFoundError as e:
        return _missing(st, on_missing, f"{e.message} on {s.coordinator}")


def _missing(st: WorkerState, on_missing: str, why: str) -> Optional[int]:
    s = st.settings
    if on_missing == "disk":
        logger.info("tensorhub: %s; loading the weight files from disk (on_missing='disk')", why)
        return None
    if on_missing == "wait":
        logger.info("tensorhub: %s; waiting up to %gs for one (on_missing='wait')", why, s.wait_timeout)
        try:
            return st.hub.wait_for_version(s.model, timeout=s.wait_timeout)
        except Exception as e:
            raise SettingsError(f"tensorhub: setting 'on_missing'='wait': {e}") from None
    raise SettingsError(f"tensorhub: setting 'model': {why} (on_missing='error'; use \"disk\" to load "
                        "the weight files and publish them, or \"wait\")")


def fetch(st: WorkerState, version: int, into: Optional[Mapping[str, Any]] = None) -> Any:
    """Fetch ``version`` in the ``hf`` layout into ``into`` (a spare copy: memory already
    touched, so no page faults) or new memory; registered when this rank serves."""
    s = st.settings
    t0 = time.monotonic()
    got = st.hub.fetch(s.model, version, layout="hf", serve=st.serving, timeout=s.fetch_timeout, into=into)
    logger.info("tensorhub: fetched %s v%d (hf): %.1f MB in %.2fs (%.2f GB/s) from %s%s%s",
                s.model, version, got.nbytes / 1e6, time.monotonic() - t0, got.gbps, got.sources,
                f"; failed sources {got.failed_sources}" if got.failed_sources else "",
                "; into the kept copy of an older version" if into is not None else "")
    return got


def stream_into(st: WorkerState, model: Any, version: int, limit: int) -> dict:
    """Cold start of a rank that serves no copy: read ``version``'s ``hf`` tensors bucket by
    bucket (cut at layer boundaries, at most ``limit`` bytes unless one tensor is larger)
    into one reused buffer and feed each bucket to ``model.load_weights``. Peak extra
    memory: the largest bucket, not the model. Returns :func:`specs_of` the version."""
    import torch

    s = st.settings
    t0 = time.monotonic()
    deadline = t0 + s.fetch_timeout
    specs = st.hub.manifest(s.model, version, layout="hf")
    sizes = {t.name: t.nbytes for t in specs}
    by_name = {t.name: t for t in specs}
    plan = list(_cut(list(sizes), sizes, limit))
    align = 64
    need = max(sum(-(-sizes[n] // align) * align for n in names) for names in plan)
    buf = torch.empty(max(need, 1), dtype=torch.uint8)
    out: dict = {}
    nbytes, sources = 0, {}
    for names in plan:
        views, off = {}, 0
        for n in names:
            spec = by_name[n]
            dt = getattr(torch, spec.dtype)
            views[n] = buf[off:off + spec.nbytes].view(dt).view(spec.shape)
            off += -(-spec.nbytes // align) * align
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"fetching {s.model!r} v{version} took longer than fetch_timeout={s.fetch_timeout:g}s")
        got = st.hub.fetch(s.model, version, layout="hf", names=names, into=views, serve=False, timeout=left)
        model.load_weights(iter(views.items()))
        nbytes += got.nbytes
        for w, b in got.sources.items():
            sources[w] = sources.get(w, 0) + b
        out.update(specs_of(views))
    dt_s = time.monotonic() - t0
    logger.info("tensorhub: streamed %s v%d (hf): %.1f MB in %d bucket(s) through one %.1f MB buffer "
                "(limit %.1f MB) in %.2fs from %s", s.model, version, nbytes / 1e6, len(plan), need / 1e6,
                limit / 1e6, dt_s, sources)
    return out


def _cut(names: list, size: Mapping[str, int], limit: int) -> Iterator[list]:
    """Lists of names of at most ``limit`` bytes (one tensor may exceed it), closed at layer
    boundaries (vLLM's ``layerwise_groups``) once half full."""
    try:
        from vllm.distributed.weight_transfer.base import layerwise_groups

        groups = layerwise_groups(list(names))
    except Exception:
        groups = [list(names)]
    cur: list = []
    total = 0
    for group in groups:
        for name in group:
            n = size[name]
            if cur and total + n > limit:
                yield cur
                cur, total = [], 0
            cur.append(name)
            total += n
        if total >= limit // 2:
            yield cur
            cur, total = [], 0
    if cur:
        yield cur


def buckets(tensors: Mapping[str, Any], limit: int) -> Iterator[list[tuple[str, Any]]]:
    """``(name, tensor)`` lists of at most ``limit`` bytes (one tensor may exceed it), cut
    at layer boundaries where possible (vLLM's ``layerwise_groups``)."""
    sizes = {name: t.numel() * t.element_size() for name, t in tensors.items()}
    for names in _cut(list(tensors), sizes, limit):
        yield [(name, tensors[name]) for name in names]


def load_into(model: Any, tensors: Mapping[str, Any], limit: int) -> int:
    """Feed ``tensors`` to ``model.load_weights`` bucket by bucket; returns the bucket count."""
    n = 0
    biggest = 0
    for bucket in buckets(tensors, limit):
        model.load_weights(iter(bucket))
        biggest = max(biggest, sum(t.numel() * t.element_size() for _, t in bucket))
        n += 1
    logger.info("tensorhub: load_weights in %d bucket(s), largest %.1f MB (limit %.1f MB)",
                n, biggest / 1e6, limit / 1e6)
    return n


def specs_of(tensors: Mapping[str, Any]) -> dict:
    return {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}


def check_same_layout(old: Optional[dict], new: Mapping[str, Any], what: str) -> None:
    """Refuse a version whose tensor names/shapes/dtypes differ from what the engine runs
    (``old``: :func:`specs_of` the running version), before anything in the model changes."""
    if old is None:
        return
    for name, (shape, dtype) in old.items():
        u = new.get(name)
        if u is None:
            raise ValueError(f"{what} has no tensor {name!r}, which the engine's model has")
        if tuple(u.shape) != shape or u.dtype != dtype:
            raise ValueError(f"{what}: tensor {name!r} is {u.dtype}{tuple(u.shape)}, "
                             f"the engine's is {dtype}{shape}")
    extra = sorted(set(new) - set(old))
    if extra:
        raise ValueError(f"{what} has tensor {extra[0]!r}, which the engine's model does not have")
