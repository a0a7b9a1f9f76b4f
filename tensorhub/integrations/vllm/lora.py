"""LoRA adapter versions in vLLM: ``tensorhub://<model>/<N>`` as a LoRA path.

A LoRA adapter published with ``hub.publish(model, tensors, kind="lora", base_model=...,
config=peft_config)`` is loaded through vLLM's own LoRA API, named ``<model>@v<N>`` and
with the path ``tensorhub://<model>/<N>``:

* OpenAI server (``--enable-lora``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``):
  ``POST /v1/load_lora_adapter {"lora_name": "pol-lora@v3", "lora_path": "tensorhub://pol-lora/3"}``,
  then requests with ``"model": "pol-lora@v3"``; ``tensorhub follow --lora K`` does this
  for every new version (:mod:`.follow`);
* offline: ``llm.generate(..., lora_request=LoRARequest("pol-lora@v3", 3, "tensorhub://pol-lora/3"))``.

:func:`install` (called by the plug-in's ``register`` in every vLLM process) wraps vLLM's
``WorkerLoRAManager._load_adapter``: in each worker process, a request whose path is a
TensorHub reference is read from the peers that hold that version (this worker's Hub: the
one the tensorhub loader or backend connected, else one opened from the loader's extra
config or ``TENSORHUB_COORDINATOR``), and vLLM's ``LoRAModel`` is built from the tensors
and the PEFT config in memory (``LoRAModel.from_lora_tensors``; no file is written). Any
other path loads as vLLM loads it.

Checks, each one error naming the adapter (vLLM's server answers it as the load's error):
the version exists and is a LoRA adapter; its base (``base_model`` at publish, ``<model>``
or ``<model>@v<N>``) is the model this engine serves (its TensorHub model when it loaded
from TensorHub, else its ``--served-model-name`` / ``--model``; and the version the engine
runs when the base names one); its rank fits ``--max-lora-rank``.

Memory: the worker keeps the fetched tensors of the newest ``max(--max-cpu-loras, 2)``
adapter versions it loaded and serves them to other engines (TP rank 0; registered with
the coordinator like any fetched version); vLLM's ``LoRAModel`` holds its own copy, so a
kept copy is only a source for peers and for vLLM reloading an adapter it evicted (a read
from peers again once dropped). Older ones are unpublished (once their readers drained).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from typing import Any, Optional

__all__ = ["SCHEME", "install", "lora_name", "lora_path", "parse_path", "LoRAAdapterError"]

logger = logging.getLogger(__name__)

#: A LoRA path naming a TensorHub version: ``tensorhub://<model>/<N>``.
SCHEME = "tensorhub://"
_PATH = re.compile(r"^tensorhub://(?P<model>.+)/(?P<version>[0-9]+)$")


class LoRAAdapterError(ValueError):
    """A ``tensorhub://`` LoRA adapter cannot be loaded into this engine (the message says
    which and why). A ``ValueError``: what vLLM raises for a bad adapter."""


def lora_name(model: str, version: int) -> str:
    """vLLM's name for adapter version ``version`` of ``model``: ``<model>@v<N>`` (a version
    is never reused, so neither is a name)."""
    return f"{model}@v{version}"


def lora_path(model: str, version: int) -> str:
    """The LoRA path vLLM is given for it: ``tensorhub://<model>/<N>``."""
    return f"{SCHEME}{model}/{version}"


def parse_path(path: str) -> Optional[tuple[str, int]]:
    """``(model, version)`` of a ``tensorhub://`` path; None for any other path. A
    ``tensorhub://`` path that names no version is an error."""
    if not isinstance(path, str) or not path.startswith(SCHEME):
        return None
    m = _PATH.match(path)
    if m is None or int(m["version"]) < 1:
        raise LoRAAdapterError(f"tensorhub: LoRA path {path!r}: expected {SCHEME}<model>/<version> "
                               f"(e.g. {SCHEME}policy-lora/3)")
    return m["model"], int(m["version"])


_installed = False
_install_lock = threading.Lock()


def install() -> None:
    """Wrap vLLM's worker-side LoRA loading (idempotent; every process may call it)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        from vllm.lora import worker_manager as wm

        cls = wm.WorkerLoRAManager
        orig_init, orig_load = cls.__init__, cls._load_adapter

        def __init__(self, vllm_config, *args, **kwargs):  # noqa: N807
            orig_init(self, vllm_config, *args, **kwargs)
            self._tensorhub_vllm_config = vllm_config

        def _load_adapter(self, lora_request):
            ref = parse_path(lora_request.lora_path)
            if ref is None:
                return orig_load(self, lora_request)
            return _load(self, lora_request, *ref)

        cls.__init__, cls._load_adapter = __init__, _load_adapter
        _installed = True


# ---------------------------------------------------------------- the worker's Hub and kept copies
class _Adapters:
    """The fetched adapter versions this worker keeps (newest last) and the Hub they came
    through; one per worker process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.kept: OrderedDict[tuple[str, int], Any] = OrderedDict()
        self.retired: list[tuple[str, int]] = []
        self.own_hub: Any = None

    def hub(self, vllm_config: Any) -> tuple[Any, bool, Optional[str], Optional[int]]:
        """(Hub, whether this rank serves what it fetched, the TensorHub model and version
        the engine runs or None)."""
        from .._core import worker
        from . import _runtime

        st = worker.get_state()
        if st is not None:
            return st.hub, st.serving, st.settings.model, st.version
        if self.own_hub is None:
            from .._core.settings import Settings

            load = vllm_config.load_config if vllm_config is not None else None
            extra = dict(load.model_loader_extra_config) if load is not None and load.load_format == "tensorhub" \
                and isinstance(load.model_loader_extra_config, dict) else {}
            settings = Settings.from_config(extra, require_model=False)
            eng = _runtime.engine()
            self.own_hub = worker.open_hub(settings, "vllm", eng.rank_on("tp"), eng.size_on("tp"), eng.rank_on("pp"))
        return self.own_hub, _runtime.engine().rank_on("tp") == 0, None, None

    def keep(self, hub: Any, key: tuple[str, int], tensors: Any, capacity: int) -> None:
        """Keep ``key``'s fetched tensors (newest last); unpublish the ones past ``capacity``
        (those whose readers did not drain within a second are tried again next time)."""
        import tensorhub

        with self.lock:
            self.kept[key] = tensors
            self.kept.move_to_end(key)
            while len(self.kept) > capacity:
                old, _ = self.kept.popitem(last=False)
                self.retired.append(old)
            pending, self.retired = self.retired, []
        for model, v in pending:
            try:
                hub.unpublish(model, v, timeout=1.0)
            except tensorhub.NotFoundError:
                pass
            except tensorhub.TensorHubError as e:
                logger.info("tensorhub: keeping LoRA adapter %s v%d served a while longer: %s", model, v, e)
                with self.lock:
                    self.retired.append((model, v))


_ADAPTERS = _Adapters()


# ---------------------------------------------------------------- load
def engine_names(vllm_config: Any) -> list[str]:
    """The names this engine's base model goes by: its served model name(s) and ``--model``."""
    mc = getattr(vllm_config, "model_config", None)
    if mc is None:
        return []
    served = getattr(mc, "served_model_name", None)
    names = list(served) if isinstance(served, (list, tuple)) else [served] if served else []
    return [n for n in dict.fromkeys([*names, mc.model]) if n]


def check_adapter(ref: str, meta: Any, served_model: Optional[str], served_version: Optional[int],
                  names: list[str], max_rank: int) -> int:
    """The adapter's rank, once its meta says it is a LoRA adapter for this engine's base
    model (``served_model`` v``served_version`` when the engine loaded from TensorHub, else
    one of ``names``) of a rank within ``max_rank``; else :class:`LoRAAdapterError`."""
    from tensorhub.protocol import parse_base

    if meta is None or meta.kind != "lora":
        raise LoRAAdapterError(f"tensorhub: LoRA adapter {ref}: the version holds full weights, not a LoRA "
                               "adapter (publish adapters with kind='lora')")
    base, base_v = parse_base(meta.base)
    if served_model is not None:
        if base != served_model:
            raise LoRAAdapterError(f"tensorhub: LoRA adapter {ref} is for base model {meta.base!r}; this engine "
                                   f"serves {served_model!r}")
        if base_v is not None and served_version is not None and base_v != served_version:
            raise LoRAAdapterError(f"tensorhub: LoRA adapter {ref} is for base model {meta.base!r}; this engine "
                                   f"runs {served_model!r} v{served_version}")
    elif base not in names:
        raise LoRAAdapterError(f"tensorhub: LoRA adapter {ref} is for base model {meta.base!r}; this engine "
                               f"serves {' / '.join(repr(n) for n in names)} (--served-model-name names it)")
    cfg = meta.config or {}
    rank = max([int(cfg["r"]), *(int(v) for v in (cfg.get("rank_pattern") or {}).values())])
    if rank > max_rank:
        raise LoRAAdapterError(f"tensorhub: LoRA adapter {ref} has rank {rank}; this engine was started with "
                               f"--max-lora-rank {max_rank}")
    return rank


def _load(mgr: Any, req: Any, model: str, version: int) -> Any:
    """vLLM's ``WorkerLoRAManager._load_adapter`` for a ``tensorhub://`` path: the same
    checks and the same ``LoRAModel``, from tensors read from peers instead of files."""
    import tensorhub
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name

    ref = f"{req.lora_path} ({req.lora_name})"
    vcfg = getattr(mgr, "_tensorhub_vllm_config", None)
    hub, serving, served_model, served_version = _ADAPTERS.hub(vcfg)
    try:
        meta = hub.version_meta(model, version)
    except tensorhub.NotFoundError:
        try:
            newest: Any = hub.latest(model)
        except tensorhub.NotFoundError:
            newest = None
        raise LoRAAdapterError(f"tensorhub: LoRA adapter {ref}: {model!r} has no version {version} "
                               f"(newest complete: {newest or 'none'})") from None
    check_adapter(ref, meta, served_model, served_version, engine_names(vcfg), mgr.lora_config.max_lora_rank)
    t0 = time.monotonic()
    got = hub.fetch(model, version, serve=serving)
    cpu_loras = getattr(mgr.lora_config, "max_cpu_loras", None) or mgr.lora_config.max_loras
    _ADAPTERS.keep(hub, (model, version), got, max(int(cpu_loras), 2))
    d = getattr(got, "delta", None)
    logger.info("tensorhub: LoRA adapter %s: %d tensors, %.2f MB read in %.3fs from %s%s", ref, len(got),
                got.nbytes / 1e6, time.monotonic() - t0, got.sources or "this worker's copy",
                f" through delta(s) {d.steps}" if d is not None else "")

    am = mgr._adapter_manager
    expected: set[str] = set()
    for module in am.supported_lora_modules:
        expected.update(am.packed_modules_mapping.get(module, [module]))
        if module == "experts":
            expected.add(module)
    peft = PEFTHelper.from_dict({**meta.config, "vllm_max_position_embeddings": mgr.max_position_embeddings})
    peft.validate_legal(mgr.lora_config)
    lm = am.model
    mapper = getattr(lm, "hf_to_vllm_mapper", None)
    if mapper is not None:
        mapper = mapper.get_rename_mapper()
    skip = getattr(lm, "lora_skip_prefixes", None)
    unexpected = []
    for name in got:
        module, _ = parse_fine_tuned_lora_name(name, mapper)
        if module.rsplit(".", 1)[-1] not in expected and module.rsplit(".", 1)[-1] not in (peft.modules_to_save or ()):
            unexpected.append(module)
    if unexpected:
        raise LoRAAdapterError(f"tensorhub: LoRA adapter {ref} adapts modules {sorted(set(unexpected))[:5]}, which "
                               f"this engine's model does not have as LoRA targets ({sorted(expected)})")
    # vLLM's LoRAModel keeps its own tensors (ours stay served to peers, unchanged).
    lora = mgr._lora_model_cls.from_lora_tensors(
        lora_model_id=req.lora_int_id, tensors={k: v.clone() for k, v in got.items()}, peft_helper=peft,
        device="cpu", dtype=mgr.lora_config.lora_dtype, model_vocab_size=mgr.vocab_size, weights_mapper=mapper,
        skip_prefixes=skip)
    lora.is_3d_lora_weight = getattr(req, "is_3d_lora_weight", False)
    for check in ("_validate_moe_lora_format", "_validate_modules_to_save", "_validate_token_classification_lora"):
        fn = getattr(am, check, None)
        if fn is not None:
            fn(lora)
    return lora
