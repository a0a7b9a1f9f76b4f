"""Delta versions on the Hub: publish a version's change against a base, fetch through it.

A delta of (model, version v, layout L, shard s) against base b is one more *layout* of v,
:func:`delta_layout` ``delta:<b>`` (``delta:<b>:<L>`` for layouts other than ``hf``). Its
manifest is the encoded buffers: one ``uint8`` tensor per tensor of the version, named like
it, holding its :mod:`tensorhub._delta` blob, and first a header tensor
(:data:`HEADER`, JSON) that binds the delta to exactly its base and its result: model,
base and version numbers, layout, shard, the tensors (name, dtype, shape) and the chunk
checksums of the base bytes and of the result (``xxh3_64`` on the shard's chunk grid,
``_checksum.compute``). The delta layout has its own chunk checksums like any layout, so it
is leased, read, verified, pipelined, seeded once per datacenter and served like any other;
the full layout of v stays published beside it.

Who calls what:

* holder (``Hub.publish(..., base=b)``, :func:`publish_with_delta`): :func:`check_base`
  before anything is published (the base must be held by this process or passed, and
  must be exactly b: names, dtypes, shapes, checksums); then the version number is
  allocated, :func:`publish_delta` encodes and registers the delta layout of v, and only
  then the full layout is published. A delta layout never completes a version
  (``protocol.is_delta_layout``, ``server.catalog.VersionInfo.complete``), so the full layout is what
  completes v: whoever is woken by v's completion (``wait_for_version``, an engine's
  prefetcher) finds its delta already registered. If the delta cannot be published (an
  error, or too big to be worth it) the full version is published all the same.
* reader (``Hub.fetch``): :func:`fetch_through_delta` when it holds an older version of the
  same layout and shard (its served copy; or ``into`` with ``base=b``, the caller saying
  ``into`` holds b). It plans by bytes (:func:`plan`: the direct delta b->v, or the chain
  b->b+1->...->v, or the full version, whichever moves fewest bytes), reads the deltas,
  checks the base against the header's checksums, applies them into its spare copy (a new
  buffer holding a copy of the served base) or ``into`` in place, checks the result against
  the header's and the version's checksums, and then serves v in full (``serve=True``)
  beside the deltas it read. Any problem -- no delta, no replica of it, an evicted base,
  a corrupt blob, a result that does not verify -- returns None after one warning and a
  count in ``tensorhub_hub_delta_fetches{outcome="fallback"}``; the caller then reads the
  full version (into the same ``into``).

What is not done here: CUDA destinations (the delta path runs on host memory; a CUDA
reader reads the full version), sharded reads (``names=``).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import numpy as np

from . import _delta, _holder
from ._checksum import DEFAULT as CHECKSUM_ALGO, compute
from ._delta import DeltaError
from ._exceptions import (
    ConfigError, CoordinatorError, FetchError, NotFoundError, TensorHubError, TensorMismatchError,
)
from ._fetch import Fetch, FetchOptions, Fetched
from ._sources import PipelinedSources, PlainSources, acquire_lease, withdraw
from ._holdings import Held, Holdings, unregister_regions
from ._metrics import Track
from ._session import Session
from ._tensors import allocate_like, check_into, coalesce, dtype_name, manifest_of
from .protocol import LeaseGrant, Manifest, VersionMeta, delta_layout, is_delta_layout

__all__ = ["HEADER", "DeltaRead", "check_base", "check_fetch_base", "delta_layout", "fetch_through_delta", "plan", "publish_delta"]

logger = logging.getLogger(__name__)

#: Name of the header tensor of a delta layout (JSON, see the module docstring).
HEADER = "__tensorhub_delta__"
FORMAT = 1
#: Longest chain of consecutive deltas a reader considers.
MAX_CHAIN = 16
#: A delta route is taken only when it moves at most this fraction of the full version's
#: bytes, and a publisher keeps no delta above it: applying costs a pass over the whole
#: version (zlib-inflated XOR at ~0.1-0.6 GB/s on one core here), so a delta of most of
#: the bytes was slower than the full read in benchmarks/bench_delta.py (70% of the bytes:
#: 385 ms vs 185 ms for the full read over a 100 Mbit/s link; 4% of them: 49 ms vs 177 ms).
MAX_FRACTION = 0.5


_COUNTER: Any = None
_COUNTER_LOCK = threading.Lock()


def _count(model: str, outcome: str) -> None:
    """``tensorhub_hub_delta_fetches{model, outcome}``: ok (through a delta), fallback (read full)."""
    global _COUNTER
    with _COUNTER_LOCK:
        if _COUNTER is None:
            _COUNTER = _make_counter()
    _COUNTER.labels(model, outcome).inc()


def _make_counter() -> Any:
    from prometheus_client import Counter

    try:
        return Counter("tensorhub_hub_delta_fetches",
                       "Fetches that tried a delta: ok (applied and verified), fallback (read the full "
                       "version instead).", ["model", "outcome"])
    except ValueError:  # pragma: no cover - registered by another import of this module
        from prometheus_client import REGISTRY

        return REGISTRY._names_to_collectors["tensorhub_hub_delta_fetches"]


def _raw(t: Any) -> np.ndarray:
    """The bytes of a contiguous CPU tensor as a writable uint8 array (no copy)."""
    if t.numel() == 0:
        return np.zeros(0, np.uint8)
    import torch

    return t.reshape(-1).view(torch.uint8).numpy()


def threads() -> int:
    """Threads of the encode and apply passes: this process's cores, at most 8."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        n = os.cpu_count() or 1
    return max(1, min(8, n))


def each(fn: Callable[[Any], Any], items: list) -> list:
    """``fn`` over ``items`` (tensors) on up to :func:`threads` threads, results in order;
    the first exception is raised. zlib and numpy's array passes release the GIL, so the
    encode and apply passes use several cores (``zlib.compress`` was most of an encode)."""
    n = min(len(items), threads())
    if n <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(n, thread_name_prefix="tensorhub-delta") as ex:
        return list(ex.map(fn, items))


def _sums(tensors: list[Any], algo: str = CHECKSUM_ALGO) -> list[int]:
    out = compute(tensors, "on", algo)
    assert out is not None
    return out[1]


# ---------------------------------------------------------------------- holder
@dataclass
class BaseCopy:
    """The base a publisher encodes against: its tensors (manifest order) and checksums."""

    version: int
    tensors: dict[str, Any]
    sums: list[int]


def check_base(session: Session, holdings: Holdings, model: str, tensors: Mapping[str, Any], base: int,
               base_tensors: Optional[Mapping[str, Any]], layout: str, shard: int) -> BaseCopy:
    """The base of ``publish(..., base=base)``, checked before anything is published:
    held by this process (``base_tensors`` None) or passed, and then exactly ``base``
    (names, dtypes, shapes and, where the coordinator has them, chunk checksums)."""
    if not isinstance(base, int) or isinstance(base, bool) or base < 1:
        raise ConfigError(f"base must be a positive version number, got {base!r}")
    if base_tensors is None:
        held = holdings.get((model, base, layout, shard))
        if held is None:
            raise ConfigError(f"publish(base={base}): this process holds no replica of {model!r} v{base} "
                              f"layout {layout!r} shard {shard}; pass base_tensors= (a copy of v{base}'s tensors)")
        btensors = dict(held.tensors)
        manifest = held.manifest
    else:
        btensors = dict(base_tensors)
        try:
            manifest = session.manifest(model, base, layout, shard)
        except NotFoundError as e:
            raise ConfigError(f"publish(base={base}): {model!r} v{base} layout {layout!r} shard {shard} "
                              f"is not known to the coordinator: {e.message}") from None
    names = [s.name for s in manifest.tensors]
    if list(tensors) != names and sorted(tensors) != sorted(names):
        extra = sorted(set(tensors) ^ set(names))
        raise TensorMismatchError(f"publish(base={base}): the tensors differ from v{base}'s "
                                  f"(first difference: {extra[0]!r})")
    for s in manifest.tensors:
        t, b = tensors[s.name], btensors.get(s.name)
        if b is None:
            raise TensorMismatchError(f"publish(base={base}): base_tensors has no {s.name!r}")
        for what, x in (("tensor", t), ("base tensor", b)):
            if dtype_name(x.dtype) != s.dtype or tuple(x.shape) != tuple(s.shape):
                raise TensorMismatchError(
                    f"publish(base={base}): {what} {s.name!r} is {dtype_name(x.dtype)}{list(x.shape)}, "
                    f"v{base} has {s.dtype}{list(s.shape)}")
    ordered = {s.name: btensors[s.name].contiguous() for s in manifest.tensors}
    sums = _sums(list(ordered.values()))
    if manifest.checksum == CHECKSUM_ALGO and manifest.checksums is not None and list(manifest.checksums) != sums:
        bad = next(i for i, (a, b) in enumerate(zip(manifest.checksums, sums)) if a != b)
        raise TensorMismatchError(f"publish(base={base}): the base tensors are not {model!r} v{base} "
                                  f"(chunk {bad} differs from v{base}'s checksum)")
    return BaseCopy(base, ordered, sums)


@dataclass
class DeltaStats:
    """What one delta publish made (benchmarks print it)."""

    nbytes: int = 0
    full_nbytes: int = 0
    changed: int = 0
    elements: int = 0
    seconds: float = 0.0
    modes: dict[str, int] = field(default_factory=dict)


def encode_tensors(tensors: Mapping[str, Any], base: BaseCopy, *, model: str, version: int, layout: str,
                   shard: int, num_shards: int, arena: bool = True) -> tuple[dict[str, Any], Any, DeltaStats]:
    """The delta layout's tensors (header first, then one blob per tensor) in one buffer
    (``arena``: memory same-host readers map, ``HubConfig.samehost``)."""
    t0 = time.perf_counter()
    stats = DeltaStats()
    names = list(tensors)  # the new version's manifest order: what a reader's copy is laid out in
    new = [tensors[n].detach().contiguous().cpu() for n in names]
    olds = [base.tensors[n] for n in names]
    base_sums = base.sums if names == list(base.tensors) else _sums(olds)

    def encode(pair: tuple[Any, Any]) -> _delta.Encoded:
        t, b = pair
        return _delta.encode(_raw(b.cpu()), _raw(t), t.element_size())

    blobs: list[bytes] = []
    for t, e in zip(new, each(encode, list(zip(new, olds)))):
        blobs.append(e.blob)
        stats.changed += e.changed
        stats.elements += e.elements
        stats.full_nbytes += t.numel() * t.element_size()
        stats.modes[e.mode_name] = stats.modes.get(e.mode_name, 0) + 1
    header = json.dumps({
        "format": FORMAT, "model": model, "version": version, "base": base.version, "layout": layout,
        "shard": shard, "num_shards": num_shards, "checksum": CHECKSUM_ALGO,
        "base_checksums": base_sums, "checksums": _sums(new),
        "tensors": [[n, dtype_name(t.dtype), list(t.shape)] for n, t in zip(names, new)],
    }).encode()
    from .protocol import TensorSpec

    specs = [TensorSpec(name=HEADER, dtype="uint8", shape=(len(header),), nbytes=len(header))]
    specs += [TensorSpec(name=n, dtype="uint8", shape=(len(b),), nbytes=len(b)) for n, b in zip(names, blobs)]
    buf, out = allocate_like(Manifest(tensors=specs), arena=arena)
    for spec, data in zip(specs, [header] + blobs):
        _raw(out[spec.name])[:] = np.frombuffer(data, np.uint8)
    stats.nbytes = sum(s.nbytes for s in specs)
    stats.seconds = time.perf_counter() - t0
    return out, buf, stats


def publish_with_delta(session: Session, holdings: Holdings, checksum: str, model: str,
                       tensors: Mapping[str, Any], base: Optional[int], base_tensors: Optional[Mapping[str, Any]], *,
                       version: Optional[int], layout: str, shard: int, num_shards: int,
                       meta: Optional[VersionMeta] = None) -> int:
    """``Hub.publish(..., base=b)``: check the base and the tensors before anything is
    published, allocate the version, register its delta against v``b``, then publish the
    full layout, which completes the version (a delta layout never does): a reader woken
    by the completion finds the delta there. If the delta cannot be published the full
    version is published all the same (readers then read it in full); if the full layout
    cannot, the delta is withdrawn again and the error raised."""
    if base is None:
        raise ConfigError("publish(base_tensors=...) needs base= (the version they hold)")
    base_copy = check_base(session, holdings, model, tensors, base, base_tensors, layout, shard)
    # What _holder.publish would refuse, refused before the delta is registered.
    manifest_of(tensors, shapes_only=True)
    if not 0 <= shard < num_shards:
        raise ConfigError(f"shard {shard} is not in [0, {num_shards})")
    # The allocation _holder.publish makes (a retry with the same id gets the same number).
    v = session.api.allocate_version(model, version, request_id=secrets.token_hex(12))
    try:
        publish_delta(session, holdings, checksum, model, tensors, base_copy, version=v, layout=layout, shard=shard,
                      num_shards=num_shards)
    except Exception as e:  # the full version is published all the same
        logger.warning("%s v%d: its delta against v%d is not published (readers read it in full): %s",
                       model, v, base, e, exc_info=not isinstance(e, TensorHubError))
    try:
        return _holder.publish(session, holdings, checksum, model, tensors, version=v, layout=layout, shard=shard,
                               num_shards=num_shards, meta=meta)
    except BaseException:
        try:  # no delta left behind for a version that is not published
            _withdraw_delta(session, holdings, model, v, delta_layout(base, layout), shard)
        except Exception as e:
            logger.warning("%s v%d: its delta could not be withdrawn after the full publish failed: %s", model, v, e)
        raise


def publish_delta(session: Session, holdings: Holdings, checksum: str, model: str, tensors: Mapping[str, Any],
                  base: BaseCopy, *, version: int, layout: str, shard: int, num_shards: int) -> DeltaStats:
    """Encode ``tensors`` against ``base`` and register the delta layout of ``version``."""
    out, _buf, stats = encode_tensors(tensors, base, model=model, version=version, layout=layout, shard=shard,
                                      num_shards=num_shards, arena=session.config.samehost)
    dl = delta_layout(base.version, layout)
    if stats.nbytes > MAX_FRACTION * stats.full_nbytes:
        logger.info("%s v%d: no %s published: the delta would be %.0f%% of the version (readers read it in full "
                    "above %.0f%%)", model, version, dl, 100 * stats.nbytes / max(1, stats.full_nbytes),
                    100 * MAX_FRACTION)
        return stats
    _holder.publish(session, holdings, checksum, model, out, version=version, layout=dl, shard=shard,
                    num_shards=num_shards)
    logger.info("published %s v%d %s: %.2f MB for %.1f MB (%.2f%%), %.3f%% of elements changed, encoded in "
                "%.3fs (%.2f GB/s); modes %s", model, version, dl, stats.nbytes / 1e6, stats.full_nbytes / 1e6,
                100 * stats.nbytes / max(1, stats.full_nbytes), 100 * stats.changed / max(1, stats.elements),
                stats.seconds, stats.full_nbytes / max(stats.seconds, 1e-9) / 1e9, stats.modes)
    return stats


# ---------------------------------------------------------------------- reader: plan
@dataclass(frozen=True)
class Step:
    base: int
    version: int
    nbytes: int


def plan(full: int, direct: Optional[Step], chain: Optional[list[Step]]) -> Optional[list[Step]]:
    """The steps to read (fewest bytes), or None when the cheapest delta route moves more
    than :data:`MAX_FRACTION` of the full version's ``full`` bytes. Pure."""
    routes = [r for r in ([direct] if direct is not None else [], chain or []) if r]
    if not routes:
        return None
    best = min(routes, key=lambda r: (sum(s.nbytes for s in r), len(r)))
    return best if sum(s.nbytes for s in best) <= MAX_FRACTION * full else None


def _step(session: Session, model: str, base: int, version: int, layout: str, shard: int,
          ) -> tuple[Optional[Step], str]:
    """The delta v``base`` -> v``version`` as the coordinator knows it, or None and why not
    (the coordinator's own words: no such layout, or the version was retired)."""
    try:
        m = session.manifest(model, version, delta_layout(base, layout), shard)
    except CoordinatorError as e:
        return None, e.message
    return Step(base, version, m.nbytes), ""


def _routes(session: Session, model: str, base: int, version: int, layout: str, shard: int, full: int,
            ) -> tuple[Optional[list[Step]], str]:
    """The cheapest delta route from v``base`` (:func:`plan`), or None and the reason the
    reader reads the full version: no direct delta and the chain breaks at a named version
    (not published with a delta, or retired by the coordinator's retention), or the full
    version moves fewer bytes."""
    direct, why_direct = _step(session, model, base, version, layout, shard)
    chain: Optional[list[Step]] = []
    why_chain = ""
    if version - base > 1 and version - base <= MAX_CHAIN:
        for v in range(base + 1, version + 1):
            s, why = _step(session, model, v - 1, v, layout, shard)
            if s is None:
                chain = None
                why_chain = f"the chain v{base}->...->v{version} breaks at v{v - 1}->v{v}: {why}"
                break
            chain.append(s)
    else:
        chain = None
        if version - base > MAX_CHAIN:
            why_chain = f"a chain of {version - base} deltas is longer than {MAX_CHAIN}"
    steps = plan(full, direct, chain)
    if steps is None:
        if direct is None and chain is None:
            return None, "; ".join(filter(None, [f"no direct delta v{base}->v{version}: {why_direct}", why_chain]))
        return None, "the full version moves fewer bytes"
    return steps, ""


# ---------------------------------------------------------------------- reader: read, check, apply
class _NoWaitPipelined(PipelinedSources):
    """A delta's leases: no replica left (none at all, or every one failed) means fall back
    to the full version now, not wait for one until the fetch's deadline."""

    def _acquire(self, excluded: set[str], wait: bool) -> Optional[LeaseGrant]:
        g = super()._acquire(excluded, False)
        if g is None:
            raise FetchError(self.no_source or f"no replica of {self.f.layout} is left")
        return g


class _NoWaitPlain(PlainSources):
    def first_grant(self) -> LeaseGrant:
        f = self.f
        g = acquire_lease(f.session, f.model, f.version, f.layout, f.shard, set(), time.monotonic(), f.trust,
                          f.opts.max_sources)
        f.leases.append(g.lease_id)
        return g


@dataclass
class DeltaRead:
    """How a fetch went through deltas (``Fetched.delta``)."""

    base: int
    steps: list[tuple[int, int]]
    nbytes: int
    full_nbytes: int
    apply_seconds: float


def _header(blob: Any, step: Step, model: str, layout: str, shard: int, manifest: Manifest) -> dict:
    try:
        h = json.loads(bytes(_raw(blob)).decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise DeltaError(f"delta v{step.base}->v{step.version}: unreadable header ({e})") from None
    want = {"format": FORMAT, "model": model, "version": step.version, "base": step.base, "layout": layout,
            "shard": shard}
    for k, v in want.items():
        if h.get(k) != v:
            raise DeltaError(f"delta v{step.base}->v{step.version}: header says {k}={h.get(k)!r}, expected {v!r}")
    got = [(n, d, tuple(s)) for n, d, s in h.get("tensors", [])]
    mine = [(s.name, s.dtype, tuple(s.shape)) for s in manifest.tensors]
    if got != mine:
        raise DeltaError(f"delta v{step.base}->v{step.version}: its tensors differ from v{step.version}'s manifest")
    return h


def _verify(tensors: list[Any], algo: str, want: list[int], what: str) -> None:
    if algo not in (CHECKSUM_ALGO,):
        raise DeltaError(f"{what}: unknown checksum {algo!r}")
    got = _sums(tensors, algo)
    if got != list(want):
        bad = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        raise DeltaError(f"{what}: chunk {bad} does not match its checksum")


def check_fetch_base(base: Any, version: int, into: Optional[Mapping[str, Any]], names: Optional[list]) -> None:
    """``fetch(base=...)``'s arguments, refused before anything is read."""
    if names is not None:
        raise ConfigError("fetch(base=...) applies to whole versions, not fetch(names=...)")
    if into is None:
        raise ConfigError("fetch(base=...) names the version `into` holds: pass into=")
    if not isinstance(base, int) or isinstance(base, bool) or not 1 <= base < version:
        raise ConfigError(f"fetch(base={base!r}): the base must be a version below v{version}")


def fetch_through_delta(session: Session, holdings: Holdings, opts: FetchOptions, model: str, version: int,
                        layout: str, shard: int, *, into: Optional[Mapping[str, Any]], base: Optional[int],
                        serve: bool, deadline: float, track: Track, pipelined: bool,
                        ) -> tuple[Optional[Fetched], Optional[str]]:
    """``Hub.fetch`` through deltas when a base is at hand and deltas move fewer bytes.
    Returns ``(fetched, None)`` through deltas; ``(None, why)`` when the caller must read
    the full version though it had a base (a delta problem: one warning, counted; no
    route: logged); ``(None, None)`` when there was nothing to start from (silent). The
    Hub hands ``why`` to the caller as ``Fetched.delta_skipped``. See the module docstring."""
    if is_delta_layout(layout):
        return None, None
    src: Optional[Held] = None
    if base is None:
        older = [h for h in holdings.all() if h.model == model and h.layout == layout and h.shard == shard
                 and h.version < version]
        if not older:
            return None, None
        src = max(older, key=lambda h: h.version)
        b = src.version
    else:
        check_fetch_base(base, version, into, None)
        b = base
    try:
        manifest = session.manifest(model, version, layout, shard)
    except CoordinatorError as e:
        return None, e.message  # the full fetch says what is wrong
    steps, why = _routes(session, model, b, version, layout, shard, manifest.nbytes)
    if steps is not None and ((src is not None and any(t.device.type != "cpu" for t in src.tensors.values())) or (
            into is not None and any(getattr(t, "device", None) is not None and t.device.type != "cpu"
                                     for t in into.values()))):
        steps, why = None, f"base v{b} is not in host memory (deltas are applied on the CPU)"
    if steps is None:
        logger.info("%s v%d: reading the full version (%.1f MB) though this reader holds v%d: %s", model,
                    version, manifest.nbytes / 1e6, b, why)
        return None, why
    try:
        return _run(session, holdings, opts, model, version, layout, shard, manifest, steps, src, into, serve,
                    deadline, track, pipelined), None
    except Exception as e:  # any delta problem: the full read stands behind it
        _count(model, "fallback")
        logger.warning("%s v%d: delta from v%d not used, reading the full version instead: %s", model, version,
                       b, e, exc_info=not isinstance(e, TensorHubError))
        return None, f"delta from v{b} not used: {e}"


def _run(session: Session, holdings: Holdings, opts: FetchOptions, model: str, version: int, layout: str,
         shard: int, manifest: Manifest, steps: list[Step], src: Optional[Held], into: Optional[Mapping[str, Any]],
         serve: bool, deadline: float, track: Track, pipelined: bool) -> Fetched:
    t0 = time.monotonic()
    buf = None
    if into is not None:
        holdings.check_not_served(into)
        check_into(manifest, into)
        out = {s.name: into[s.name] for s in manifest.tensors}
    else:
        buf, out = allocate_like(manifest, arena=session.config.samehost)
    dst = [out[s.name] for s in manifest.tensors]
    nbytes, sources, failed = 0, {}, []
    apply_seconds = 0.0
    first = True
    for step in steps:
        dl = delta_layout(step.base, layout)
        f = Fetch(session, holdings, opts, model, step.version, dl, shard, into=None, serve=serve,
                  deadline=deadline, track=track, pipelined=pipelined)
        f.policy = _NoWaitPipelined(f) if isinstance(f.policy, PipelinedSources) else _NoWaitPlain(f)
        got = f.run()
        nbytes += got.nbytes
        failed += got.failed_sources
        for w, n in got.sources.items():
            sources[w] = sources.get(w, 0) + n
        names = [HEADER] + [s.name for s in manifest.tensors]
        if list(got) != names:
            raise DeltaError(f"delta v{step.base}->v{step.version}: its tensors are not the header and "
                             f"v{step.version}'s {len(manifest.tensors)} tensors")
        h = _header(got[HEADER], step, model, layout, shard, manifest)
        t1 = time.perf_counter()
        if first:  # a delta is only ever applied to exactly its base
            if src is not None:
                if holdings.get(src.key) is not src:
                    raise DeltaError(f"base v{src.version} was unpublished before the delta was applied")
                specs = {(t.name, t.dtype, tuple(t.shape)) for t in src.manifest.tensors}
                if specs != {(t.name, t.dtype, tuple(t.shape)) for t in manifest.tensors}:
                    raise DeltaError(f"base v{src.version}'s tensors differ from v{version}'s")
                # One memcpy per tensor: torch's threaded copy_ stalled up to 0.6 s on a busy 2-core host.
                for spec, d in zip(manifest.tensors, dst):
                    np.copyto(_raw(d), _raw(src.tensors[spec.name]))
            _verify(dst, h["checksum"], h["base_checksums"],
                    f"this reader's copy of base v{step.base} against the delta's record of it")
            first = False
        try:
            blobs = [got[spec.name] for spec in manifest.tensors]
            each(lambda pair: _delta.apply(_raw(pair[0]), _raw(pair[1])), list(zip(dst, blobs)))
            _verify(dst, h["checksum"], h["checksums"], f"v{step.version} rebuilt from v{step.base} by its delta")
            apply_seconds += time.perf_counter() - t1
        except DeltaError:
            _withdraw_delta(session, holdings, model, step.version, dl, shard)
            raise
    if manifest.checksum == CHECKSUM_ALGO and manifest.checksums is not None:
        _verify(dst, manifest.checksum, list(manifest.checksums), f"v{version} rebuilt by deltas")
    seconds = time.monotonic() - t0
    full = manifest.nbytes
    served = ""
    if serve:
        local = [t.data_ptr() for t in dst]
        regions = coalesce([(a, s.nbytes) for a, s in zip(local, manifest.tensors)])
        held = Held(model, version, layout, shard, int(h.get("num_shards", 1)), manifest, local, regions, out,
                    extra=[buf])
        _holder.serve(session, holdings, held, session.transport())
        served = f"; serving it as replica {held.replica_id}"
    _count(model, "ok")
    chain = "->".join([f"v{steps[0].base}"] + [f"v{s.version}" for s in steps])
    logger.info("worker %s fetched %s v%d layout %s shard %d through delta %s: %.2f MB instead of %.1f MB "
                "(%.2f%%) in %.3fs, applied in %.3fs (%.2f GB/s)%s", session.worker_id, model, version, layout,
                shard, chain, nbytes / 1e6, full / 1e6, 100 * nbytes / max(1, full), seconds, apply_seconds,
                full * len(steps) / max(apply_seconds, 1e-9) / 1e9, served)
    res = Fetched.of(out, version, layout, shard, nbytes, seconds, sources, failed)
    res.delta = DeltaRead(steps[0].base, [(s.base, s.version) for s in steps], nbytes, full, apply_seconds)
    return res


def _withdraw_delta(session: Session, holdings: Holdings, model: str, version: int, dl: str, shard: int) -> None:
    """A delta that did not verify is not served on from here."""
    h = holdings.get((model, version, dl, shard))
    if h is None:
        return
    if withdraw(session, model, version, h.replica_id, until=time.monotonic() + 5.0):
        holdings.drop(h.key)
        unregister_regions(session.transport(), h.regions)
