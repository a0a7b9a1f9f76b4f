"""Putting fetched weights into an engine's model: buckets, streaming, layout checks, raw copies.

Both engines take checkpoint-named full tensors through ``model.load_weights(iter)``, which
fuses and slices them itself; both take a native shard as raw bytes copied over the
parameters. What differs per engine is only how names group into layers (the adapter's
``EngineHooks.groups``: vLLM's ``layerwise_groups``, SGLang's ``...layers.<i>.`` prefixes)
and which tensors are "the parameters" (the adapter's ``_native.native_tensors``).

Nothing in the model changes before a version was checked against the one it runs:
:func:`check_same_layout` refuses other names, shapes or dtypes first.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Optional

from .settings import Settings, SettingsError

logger = logging.getLogger(__name__)

__all__ = ["LoaderMixin", "buckets", "load_into", "borrow_into", "stream_into", "specs_of", "check_same_layout",
           "copy_into", "copy_bytes", "layout_name"]


class LoaderMixin:
    """What both engines' ``--load-format tensorhub`` loaders share, mixed in before the
    engine's ``BaseModelLoader``: the settings from ``model_loader_extra_config``, nothing
    to download, and a failed load logged as one line before the engine's traceback."""

    def __init__(self, load_config: Any) -> None:
        super().__init__(load_config)  # type: ignore[call-arg]
        self.settings = Settings.from_extra(load_config.model_loader_extra_config)

    def download_model(self, model_config: Any) -> None:
        """Nothing to download: the weights come from peers."""

    @contextmanager
    def one_line_errors(self) -> Iterator[None]:
        """Log what stops the load in one line (the engine's traceback follows), re-raised."""
        try:
            yield
        except SettingsError as e:
            logger.error("%s", e)
            raise
        except Exception as e:
            logger.error("tensorhub: loading %r from peers failed: %s", self.settings.model, e)
            raise


Groups = Callable[[list], list]


def _cut(names: list, size: Mapping[str, int], limit: int, groups: Groups) -> Iterator[list]:
    """Lists of names of at most ``limit`` bytes (one tensor may exceed it), closed at layer
    boundaries (``groups(names)``) once half full."""
    try:
        parts = groups(list(names))
    except Exception:
        parts = [list(names)]
    cur: list = []
    total = 0
    for group in parts:
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


def buckets(tensors: Mapping[str, Any], limit: int, groups: Groups) -> Iterator[list[tuple[str, Any]]]:
    """``(name, tensor)`` lists of at most ``limit`` bytes (one tensor may exceed it), cut
    at layer boundaries (``groups``) where possible."""
    sizes = {name: t.numel() * t.element_size() for name, t in tensors.items()}
    for names in _cut(list(tensors), sizes, limit, groups):
        yield [(name, tensors[name]) for name in names]


def load_into(model: Any, tensors: Mapping[str, Any], limit: int, groups: Groups) -> int:
    """Feed ``tensors`` to ``model.load_weights`` bucket by bucket; returns the bucket count."""
    n = biggest = 0
    for bucket in buckets(tensors, limit, groups):
        model.load_weights(iter(bucket))
        biggest = max(biggest, sum(t.numel() * t.element_size() for _, t in bucket))
        n += 1
    logger.info("tensorhub: load_weights in %d bucket(s), largest %.1f MB (limit %.1f MB)",
                n, biggest / 1e6, limit / 1e6)
    return n


def borrow_into(st: Any, model: Any, version: int, limit: int, keep: bool = True) -> Optional[Any]:
    """Start from a same-host holder's memory in place (``Hub.borrow``): feed its read-only
    views of ``version``'s ``hf`` tensors to ``model.load_weights`` in buckets, with no copy
    of the version of our own (``st``: the worker's ``WorkerState``). Returns the open
    ``Borrowed`` (its lease still held, so the caller may copy from it and then release
    it), or None when nothing was borrowed (no same-host holder in Hub memory; or the lease
    was past its bound when ``load_weights`` returned): then read the usual way, which
    loads every tensor again. ``keep=False`` (nothing more to copy from it): the lease is
    released here, and the load counts only if the coordinator also says it stayed valid
    (``Borrowed.release``); else None as well.

    Trust is judged after the last byte is used (``load_weights`` returned), never before:
    the coordinator keeps the lease -- and the holder's memory unchanged -- for at least as
    long as this reader trusts it, even if it expires the reader meanwhile (issue 30).

    Safety: a model tensor that still views the borrowed memory once ``load_weights``
    returned (an engine that kept a loaded tensor instead of copying it) is copied into
    memory of its own before anything else happens, so the model never reads the holder's
    memory after the lease."""
    import tensorhub

    s = st.settings
    t0 = time.monotonic()
    try:
        b = st.hub.borrow(s.model, version, layout="hf", timeout=s.fetch_timeout)
    except tensorhub.TensorHubError as e:  # the fetch says what is wrong, if anything still is
        logger.info("tensorhub: reading %s v%d in place failed (%s); fetching it", s.model, version, e)
        return None
    if b is None:
        return None
    try:
        t1 = time.monotonic()
        load_into(model, b, limit, st.hooks.groups)
        t2 = time.monotonic()
        named = list(_named_tensors(model))
        for name in b.sharing(named):
            t = dict(named)[name]
            t.data = t.data.clone()
            logger.info("tensorhub: %s kept the loaded tensor %s itself: copied", type(model).__name__, name)
        specs = {name: (tuple(t.shape), t.dtype) for name, t in b.items()}
        if not b.trusted():
            raise tensorhub.LeaseLapsedError(f"{s.model!r} v{version}: the borrowed lease passed its bound "
                                             "during load_weights")
        if not keep:
            b.release()  # LeaseLapsedError when the coordinator says it lapsed
    except tensorhub.LeaseLapsedError as e:
        b.release_quietly()
        logger.warning("tensorhub: %s; loading it again from a fetched copy", e)
        return None
    except BaseException:
        b.release_quietly()
        raise
    st.version, st.specs = version, specs
    logger.info("tensorhub: loaded %s v%d in place (hf): %.1f MB in %.2fs (lease + mapping + checksums %.2fs, "
                "load_weights %.2fs) from %s: the holder's memory on this host, no copy of our own", s.model, version,
                b.nbytes / 1e6, t2 - t0, t1 - t0, t2 - t1, {b.worker_id: b.nbytes})
    return b


def _named_tensors(model: Any) -> Iterator[tuple[str, Any]]:
    """A torch module's parameters and buffers, by name (nothing for other objects)."""
    for attr in ("named_parameters", "named_buffers"):
        fn = getattr(model, attr, None)
        if fn is not None:
            yield from fn()


def copy_bytes(dst: Mapping[str, Any], src: Mapping[str, Any]) -> int:
    """Copy every tensor of ``src`` into ``dst``'s (same names, contiguous CPU tensors of
    the same byte size): one ``memmove`` each, without the GIL (torch's threaded ``copy_``
    stalls on a busy host and runs on the engine's pinned OpenMP threads). Returns bytes."""
    import ctypes

    n = 0
    for name, s in src.items():
        d = dst[name]
        k = s.numel() * s.element_size()
        if d.numel() * d.element_size() != k or not (d.is_contiguous() and s.is_contiguous()):
            raise ValueError(f"copy_bytes: {name!r} differs in size or is not contiguous")
        if k:
            ctypes.memmove(d.data_ptr(), s.data_ptr(), k)
        n += k
    return n


def stream_into(st: Any, model: Any, version: int, limit: int) -> dict:
    """Cold start of a rank that serves no copy (``st``: its ``WorkerState``): read
    ``version``'s ``hf`` tensors bucket by bucket (cut at the engine's layer boundaries, at
    most ``limit`` bytes unless one tensor is larger) into one reused buffer and feed each
    bucket to ``model.load_weights``. Peak extra memory: the largest bucket, not the model.
    Returns :func:`specs_of` the version."""
    import torch

    s = st.settings
    t0 = time.monotonic()
    deadline = t0 + s.fetch_timeout
    specs = st.hub.manifest(s.model, version, layout="hf")
    sizes = {t.name: t.nbytes for t in specs}
    by_name = {t.name: t for t in specs}
    plan = list(_cut(list(sizes), sizes, limit, st.hooks.groups))
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


def specs_of(tensors: Mapping[str, Any]) -> dict:
    """name -> (shape, dtype): what :func:`check_same_layout` compares."""
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


def copy_into(params: Mapping[str, Any], got: Mapping[str, Any]) -> int:
    """Copy a fetched native shard over the parameters (``params``: the adapter's
    ``native_tensors(model)``); every name, shape and dtype is checked before the first byte
    is written. Returns the bytes copied."""
    check_same_layout(specs_of(params), got, "the fetched native shard")
    n = 0
    for name, p in params.items():
        p.copy_(got[name], non_blocking=True)
        n += p.numel() * p.element_size()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
    except Exception:  # pragma: no cover - no CUDA
        pass
    return n


def layout_name(engine: str, params: Mapping[str, Any], **fixed: Any) -> str:
    """An engine-native layout's name, ``<engine>-<16 hex>``: a hash of ``fixed`` (engine
    version, model config, quantization, TP/PP sizes, PP stage: whatever fixes one rank's
    bytes, as the adapter's fingerprint names it) and every parameter's name, shape and
    dtype. Two engines get the same name exactly when one's raw bytes fit the other's."""
    doc = {"engine": engine, **fixed, "params": [(n, list(t.shape), str(t.dtype)) for n, t in params.items()]}
    return f"{engine}-" + hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:16]
