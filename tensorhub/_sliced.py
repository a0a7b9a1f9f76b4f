"""Sliced publishing without a gather, and the reads that assemble it (``_slices`` is the pure part).

Who calls what:

* trainer rank (holder): ``Hub.publish(model, {name: DTensor | Slice | tensor}, ...)`` lands
  in :func:`publish`. Each rank registers its own slices *in place* (the DTensor's local
  tensor, or the tensor of a :class:`Slice`) as shard ``rank`` of ``world`` of the layout
  ``hf.slices``; it never sends its bytes anywhere. The ranks agree on one version number:
  one rank allocates it and passes it on (``version=v``), or every rank passes the same
  ``key`` (a retried allocation with the same key answers the same number). The version is
  complete once the last rank's slices are in and the coordinator found them covering every
  tensor exactly (``_slices.check_register``). The tensors must stay untouched until
  ``unpublish`` returns, exactly as for a full publish: a rank's memory cost per version is
  its own snapshot of its own shard.
* reader: ``Hub.fetch(model, v)`` (layout ``hf``) of a sliced version that no assembled copy
  serves yet is told so by the coordinator's answer to its lease (a grant of layout
  ``hf.slices``: ``AcquireLease.slices``) and lands in :func:`fetch`: it leases
  every rank's shard, reads each slice straight into its place in the full tensors (one
  thread per shard, so the read is striped over the slice holders, each thread striping over
  that shard's replicas), checks each shard's chunk checksums in the assembled memory (as
  each chunk lands, failing a mismatching source over, when every slice lands in one piece;
  else after the read, failing the fetch), and
  with ``serve=True`` registers the full tensors as an ordinary ``hf`` replica: later readers
  read that copy, like any other. ``fetch(..., ranges={name: (rows, cols)})`` reads only a
  row range (dim 0) and a column range (dim 1) of tensors, and moves only those bytes; it
  works on any version (a full ``hf`` replica is one slice covering everything).

Leases and fencing are the full read's: one lease per shard, renewed while reading, released
checked (a lapsed lease's chunks are read again); a source that fails is reported and the
shard continues from another replica if it has one. Range reads are not checksummed (a
checksum covers a chunk of the shard's grid, which a range read reads only part of).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Any, Mapping, Optional, Sequence

from ._checksum import verifier
from ._attempts import read_attempts
from ._exceptions import ConfigError, FetchError, NotFoundError, TensorHubError
from ._fencing import LeaseClock
from ._holder import serve as serve_held
from ._holdings import Held, Holdings, register_regions, unregister_regions
from ._fetch import FetchOptions, Fetched, quarantine_stuck
from ._sources import DEPTH, acquire_lease, release_all, release_checked
from ._metrics import Track
from ._reader import ReadStats, ShardReader, Source
from ._session import Session
from ._slices import SLICED, Box, Run, box_of, full_specs, plan, range_box
from ._tensors import allocate_like, check_into, coalesce, manifest_of
from .protocol import Manifest, SliceSpec, TensorSpec
from .protocol.base import _ID_RE

__all__ = ["Slice", "is_sliced", "publish", "fetch", "full_manifest", "SLICED"]

logger = logging.getLogger(__name__)

#: Most bytes one chunk (one batch) of a sliced read moves; runs are packed up to it.
CHUNK_BYTES = 16 << 20


class Slice:
    """This rank's part of a full tensor, for ``Hub.publish``: ``tensor`` (contiguous; its
    bytes are registered in place) sits at ``offsets`` (one per dimension) in a full tensor
    of ``shape``. E.g. rows 512-1023 of a 2048x4096 weight: ``Slice(t, (2048, 4096), (512, 0))``."""

    __slots__ = ("tensor", "shape", "offsets")

    def __init__(self, tensor: Any, shape: Sequence[int], offsets: Sequence[int]) -> None:
        self.tensor = tensor
        self.shape = tuple(int(n) for n in shape)
        self.offsets = tuple(int(o) for o in offsets)

    def __repr__(self) -> str:
        return f"Slice(<{tuple(self.tensor.shape)}>, shape={list(self.shape)}, offsets={list(self.offsets)})"


def _is_dtensor(t: Any) -> bool:
    cls = type(t)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed")


def is_sliced(tensors: Mapping[str, Any]) -> bool:
    """Does a publish carry slices (a :class:`Slice` or a ``DTensor``)?"""
    return isinstance(tensors, Mapping) and any(isinstance(t, Slice) or _is_dtensor(t) for t in tensors.values())


def _mesh_rank(mesh: Any) -> tuple[int, int]:
    """(this rank's index in ``mesh``, row-major over its coordinates; the mesh's size)."""
    coord = mesh.get_coordinate()
    if coord is None:
        raise ConfigError("this rank is not in the DTensor's device mesh: it holds none of its slices")
    idx = 0
    for c, n in zip(coord, mesh.shape):
        idx = idx * n + c
    return idx, mesh.size()


def _of_dtensor(name: str, dt: Any) -> Optional[tuple[Any, tuple[int, ...], tuple[int, ...]]]:
    """(local tensor, full shape, offsets) of this rank's part of a DTensor; None when
    another rank publishes it (a replicated mesh dimension: coordinate 0 publishes)."""
    from torch.distributed.tensor import Replicate, Shard

    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    for d, p in enumerate(dt.placements):
        if isinstance(p, Replicate):
            if coord[d] != 0:
                return None
        elif not isinstance(p, Shard):
            raise ConfigError(f"tensor {name!r}: placement {p} on mesh dimension {d} is not a Shard or a "
                              "Replicate (a pending reduction cannot be published; reduce it first)")
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offsets = compute_local_shape_and_global_offset(dt.shape, mesh, dt.placements)
    local = dt.to_local()
    if tuple(local.shape) != tuple(shape):
        raise ConfigError(f"tensor {name!r}: the local tensor has shape {list(local.shape)}, its placement says "
                          f"{list(shape)} (a padded shard?): publish a Slice of its unpadded part")
    return local, tuple(dt.shape), tuple(int(o) for o in offsets)


def local_slices(tensors: Mapping[str, Any]) -> tuple[dict[str, Any], list[SliceSpec], Optional[tuple[int, int]]]:
    """This rank's tensors to register, their slice specs, and (rank, world) from the
    DTensors' mesh (None when there is none). A plain tensor is a whole tensor that this
    rank alone publishes."""
    import torch

    local: dict[str, Any] = {}
    specs: list[SliceSpec] = []
    mesh_rank: Optional[tuple[int, int]] = None
    for name, t in tensors.items():
        if _is_dtensor(t):
            r = _mesh_rank(t.device_mesh)
            if mesh_rank is not None and r != mesh_rank:
                raise ConfigError(f"tensor {name!r}: its device mesh puts this rank at {r[0]} of {r[1]}, another "
                                  f"tensor's at {mesh_rank[0]} of {mesh_rank[1]}: publish one mesh at a time")
            mesh_rank = r
            got = _of_dtensor(name, t)
            if got is None:
                continue
            tensor, shape, offsets = got
        elif isinstance(t, Slice):
            tensor, shape, offsets = t.tensor, t.shape, t.offsets
        elif isinstance(t, torch.Tensor):
            tensor, shape, offsets = t, tuple(t.shape), (0,) * t.dim()
        else:
            raise ConfigError(f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor, DTensor or Slice")
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(f"Slice {name!r} holds a {type(tensor).__name__}, not a torch.Tensor")
        if tensor.dim() == 0:
            raise ConfigError(f"tensor {name!r} is 0-dimensional: publish it whole from one rank as a "
                              "1-element tensor, or in a full publish")
        if len(shape) != tensor.dim() or len(offsets) != tensor.dim():
            raise ConfigError(f"Slice {name!r}: a {tensor.dim()}-dimensional tensor needs the full shape and "
                              f"offsets in {tensor.dim()} dimensions, got {list(shape)} and {list(offsets)}")
        for d, (n, o, full) in enumerate(zip(tensor.shape, offsets, shape)):
            if o < 0 or o + n > full:
                raise ConfigError(f"Slice {name!r}: rows [{o}, {o + n}) of dimension {d} are outside the full "
                                  f"tensor's {full}")
        local[name] = tensor
        specs.append(SliceSpec(shape=shape, offsets=offsets))
    if not local:
        raise ConfigError("this rank holds no slice to publish (every tensor is published by another rank)")
    return local, specs, mesh_rank


def publish(session: Session, holdings: Holdings, checksum: str, model: str, tensors: Mapping[str, Any], *,
            version: Optional[int], key: Optional[str], shard: Optional[int], num_shards: Optional[int]) -> int:
    """``Hub.publish`` of slices (see the module docstring): registers this rank's slices in
    place as shard ``shard`` of ``num_shards`` (default: the DTensors' mesh) of ``hf.slices``."""
    local, specs, mesh_rank = local_slices(tensors)
    if shard is None or num_shards is None:
        if mesh_rank is None:
            raise ConfigError("publishing Slices needs shard= (this rank) and num_shards= (the ranks publishing)")
        shard = mesh_rank[0] if shard is None else shard
        num_shards = mesh_rank[1] if num_shards is None else num_shards
    if not 0 <= shard < num_shards:
        raise ConfigError(f"shard {shard} is not in [0, {num_shards})")
    if version is None and key is None and num_shards > 1:
        raise ConfigError(f"a sliced publish over {num_shards} ranks needs one version: pass version= (one rank "
                          "allocates it with hub.api.allocate_version and passes it on) or the same key= on every rank")
    if key is not None and not _ID_RE.match(key):
        raise ConfigError(f"key {key!r} must be 1-256 of A-Z a-z 0-9 . _ : @ / + = -")
    plain, addrs = manifest_of(local, checksum)
    manifest = Manifest.model_construct(tensors=plain.tensors, checksum=plain.checksum, checksums=plain.checksums,
                                        slices=specs)
    try:
        Manifest.model_validate(manifest.model_dump(mode="json"))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    v = session.api.allocate_version(model, version, request_id=key if key is not None else secrets.token_hex(12))
    regions = coalesce([(a, s.nbytes) for a, s in zip(addrs, manifest.tensors)])
    h = Held(model, v, SLICED, shard, num_shards, manifest, addrs, regions, dict(local))
    serve_held(session, holdings, h, session.transport())
    logger.info("published %s v%d slices: shard %d/%d as replica %s of worker %s: %d tensors, %.1f MB in place",
                model, v, shard, num_shards, h.replica_id, session.worker_id, len(addrs), manifest.nbytes / 1e6)
    return v


# ---------------------------------------------------------------------- reader
def _sources(session: Session, model: str, version: int) -> tuple[str, int]:
    """The layout to read slices from and its shard count: ``hf.slices`` while every one of
    its shards has a serving replica, else ``hf`` (a full replica is one slice of everything)."""
    view = session.api.version(model, version)
    sl = view.layouts.get(SLICED)
    if sl is not None and sl.complete:
        serving = {r.shard for r in view.replicas if r.layout == SLICED and r.serving}
        hf = view.layouts.get("hf")
        if len(serving) == sl.num_shards or hf is None or not hf.complete:
            return SLICED, sl.num_shards
    hf = view.layouts.get("hf")
    if hf is None:
        raise NotFoundError(f"{model!r} v{version} has no hf layout and no complete {SLICED} layout "
                            f"(layouts: {sorted(view.layouts) or 'none'})", "unknown_layout")
    return "hf", hf.num_shards


def full_manifest(session: Session, model: str, version: int) -> list[TensorSpec]:
    """The full tensors (``hf``) of a version published as slices (``Hub.manifest``)."""
    layout, n = _sources(session, model, version)
    manifests = [session.manifest(model, version, layout, s) for s in range(n)]
    if layout == SLICED:
        return full_specs(manifests)
    return [t for m in manifests for t in m.tensors]


def fetch(session: Session, holdings: Holdings, opts: FetchOptions, model: str, version: int, *,
          into: Optional[Mapping[str, Any]], serve: bool, deadline: float, track: Track,
          names: Optional[list[str]] = None,
          ranges: Optional[Mapping[str, tuple[Any, Any]]] = None, num_shards: Optional[int] = None) -> Fetched:
    """Read ``model`` v``version``'s full tensors (or ``names``, or ``ranges``) from the
    holders of its slices; see the module docstring. ``num_shards``: the sliced layout's, as
    a lease's answer said (the slices are read; None: asked of the coordinator here)."""
    layout, n = (SLICED, num_shards) if num_shards is not None else _sources(session, model, version)
    manifests = [session.manifest(model, version, layout, s) for s in range(n)]
    specs = full_specs(manifests) if layout == SLICED else [t for m in manifests for t in m.tensors]
    by_name = {t.name: t for t in specs}
    ranges = dict(ranges or {})
    wanted = list(names) if names is not None else ([] if ranges else [t.name for t in specs])
    wanted += [k for k in ranges if k not in wanted]
    unknown = [k for k in wanted if k not in by_name]
    if unknown:
        raise ConfigError(f"{model!r} v{version} has no tensor {unknown[0]!r} ({len(unknown)} unknown)")
    want: dict[str, Box] = {}
    out_specs: list[TensorSpec] = []
    for name in wanted:
        spec = by_name[name]
        rows, cols = ranges.get(name, (None, None))
        box = range_box(spec, rows, cols)
        want[name] = box
        shape = tuple(b - a for a, b in box)
        out_specs.append(spec if shape == spec.shape else
                         TensorSpec(name=name, dtype=spec.dtype, shape=shape, nbytes=spec.nbytes // max(1, _numel(
                             spec.shape)) * _numel(shape)))
    whole = not ranges and names is None
    if serve and not whole:
        raise ConfigError("a fetch of part of a version (names= or ranges=) cannot be served: pass serve=False")
    out_manifest = Manifest.model_construct(tensors=out_specs)
    transport = session.transport()
    buf = None
    if into is not None:
        holdings.check_not_served(into)
        check_into(out_manifest, into)
        out = {t.name: into[t.name] for t in out_specs}
    else:
        buf, out = allocate_like(out_manifest, arena=session.config.samehost)
    base = {name: t.data_ptr() for name, t in out.items()}
    regions = coalesce([(base[s.name], s.nbytes) for s in out_specs])
    register_regions(transport, regions)
    track.version = version
    track.start(session, model, version, "hf", 0, sum(s.nbytes for s in out_specs))
    per_shard = plan(manifests, want)
    t0 = time.monotonic()
    results: dict[int, Any] = {}
    stuck: list[bool] = []

    direct: set[int] = set()  # shards read whole-slice by whole-slice: checksums checked chunk by chunk
    for s, runs_ in enumerate(per_shard):
        if not ranges and runs_ and all(r.src_off == 0 and r.nbytes == manifests[s].tensors[r.src_index].nbytes
                                        for r in runs_):
            direct.add(s)

    def one(s: int, runs: list[Run]) -> None:
        try:
            check = None
            if s in direct:  # each run is one whole slice, contiguous where it lands
                m = manifests[s]
                keep = [r.src_index for r in runs]
                views = {r.dst: _landing(out[r.dst], m, r.src_index) for r in runs}
                check = verifier(m, views, opts.checksum, None if len(keep) == len(m.tensors) else keep)
            results[s] = _read_shard(session, opts, model, version, layout, s, runs, base, deadline, stuck, check)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            results[s] = e

    threads = [threading.Thread(target=one, args=(s, r), name=f"tensorhub-slice-{s}", daemon=True)
               for s, r in enumerate(per_shard) if r]
    served = False
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if stuck:
            regions = []  # a hung batch may still write there: never unregister it
            raise quarantine_stuck(holdings, FetchError(f"{model!r} v{version}: a slice read never ended"),
                                   buf, out, into)
        errors = [(s, e) for s, e in sorted(results.items()) if isinstance(e, BaseException)]
        if errors:
            s, e = errors[0]
            if isinstance(e, TensorHubError):
                raise e
            raise FetchError(f"{model!r} v{version}: reading shard {s} of {layout!r} failed: {e!r}") from e
        seconds = time.monotonic() - t0
        nbytes, sources, failed = 0, {}, []
        for s in sorted(results):
            st: ReadStats = results[s]
            nbytes += st.nbytes
            failed += st.failed_sources
            for w, b in st.bytes_by_source.items():
                sources[w] = sources.get(w, 0) + b
        if not ranges:  # the other shards' slices landed in pieces: checked where they landed
            _verify([m if s not in direct else None for s, m in enumerate(manifests)], layout, out, opts.checksum,
                    model, version, set(wanted))
        if serve:
            full, addrs = manifest_of(out, opts.checksum)
            h = Held(model, version, "hf", 0, 1, full, addrs, regions, out, extra=[buf])
            h.replica_id = session.register_replica(h)  # its memory is registered already
            holdings.hold(h)
            served = True
        logger.info("worker %s read %s v%d from %d %s shard(s)%s: %.1f MB in %.3fs (%.2f GB/s) from %s%s",
                    session.worker_id, model, version, len(threads), layout, " (ranges)" if ranges else "",
                    nbytes / 1e6, seconds, nbytes / seconds / 1e9 if seconds else 0.0, sources,
                    "; serving the assembled tensors" if served else "")
        return Fetched.of(out, version, "hf", 0, nbytes, seconds, sources, failed)
    finally:
        if not served:
            unregister_regions(transport, regions)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _landing(dst: Any, m: Manifest, i: int) -> Any:
    """The view of destination ``dst`` where tensor ``i`` of shard manifest ``m`` lands."""
    if m.slices is None:
        return dst
    box = box_of(m.tensors[i], m.slices[i].offsets)
    return dst[tuple(slice(a, b) for a, b in box)]


def _read_shard(session: Session, opts: FetchOptions, model: str, version: int, layout: str, shard: int,
                runs: list[Run], base: Mapping[str, int], deadline: float, stuck: list,
                check: Any = None) -> ReadStats:
    """Read one shard's runs (this thread), under leases on that shard; see the module
    docstring. ``check``: a ``_checksum.Verifier`` whose tensors are the runs (whole
    slices): each chunk is verified as it lands, and a mismatch fails its source over to
    another replica of the shard, as in a full read."""
    sizes = [r.nbytes for r in runs]
    local = [base[r.dst] + r.dst_off for r in runs]
    clock = LeaseClock()
    leases: list[str] = []

    def sources(excluded: set[str]) -> list[Source]:
        g = acquire_lease(session, model, version, layout, shard, excluded, deadline, clock, opts.max_sources)
        leases.append(g.lease_id)
        return [Source(x.replica_id, x.worker_id, x.endpoint,
                       tuple(x.addresses[r.src_index] + r.src_off for r in runs), g.lease_id, x.cost,
                       secret=g.secret, host=x.locality.host)
                for x in g.replicas]

    reader = ShardReader(session.transport(), sizes, local, chunk_bytes=min(opts.chunk_bytes, CHUNK_BYTES),
                         depth=DEPTH, progress_timeout=opts.progress_timeout, checksums=check,
                         forgive_after=session.suspect_ttl)

    def hung(e: BaseException) -> BaseException:
        stuck.append(True)  # (the caller quarantines the whole destination)
        return e

    try:
        return read_attempts(session, reader, sources, what=f"{model!r} v{version} {layout} shard {shard}",
                             model=model, leases=leases, clock=clock, deadline=deadline,
                             end=lambda st: release_checked(session, leases, clock), stuck=hung)
    finally:
        release_all(session, leases)


def _verify(manifests: Sequence[Optional[Manifest]], layout: str, out: Mapping[str, Any], mode: str, model: str,
            version: int, wanted: set[str]) -> None:
    """Check each shard's chunk checksums against the bytes where they landed (in the full
    tensors); a mismatch fails the fetch naming the shard and the chunk. None: a shard
    checked while it was read."""
    for s, m in enumerate(manifests):
        if m is None:
            continue
        keep = [i for i, t in enumerate(m.tensors) if t.name in wanted]
        if not keep or m.checksums is None:
            continue
        views = {}
        for i in keep:
            dst = _landing(out[m.tensors[i].name], m, i)
            views[m.tensors[i].name] = dst if dst.is_contiguous() else dst.contiguous()
        v = verifier(m, views, mode, None if len(keep) == len(m.tensors) else keep)
        if v is None:
            continue
        for c in range(len(v.chunks)):
            why = v.check(c)
            if why is not None:
                raise FetchError(f"{model!r} v{version} {layout} shard {s}: {why}; the assembled bytes are discarded")
