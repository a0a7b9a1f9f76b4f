"""Sliced versions: the pure part (no I/O, no torch), shared by the coordinator and readers.

A trainer whose ranks each hold part of every tensor (FSDP2 ``DTensor`` shards, or any
per-rank slices) publishes without a gather: rank ``r`` of ``n`` registers its own slices
in place as shard ``r`` of the layout :data:`SLICED`. Each tensor of such a shard's
manifest carries a :class:`~tensorhub.protocol.SliceSpec` (the full tensor's shape and the
slice's offsets in it); the slice's bytes are the shard's own, contiguous, in row-major
order of the slice.

Coordinator (``server.catalog.add_manifest`` calls :func:`check_register`): a shard's slices
must agree with those already registered (same dtype and full shape per tensor name, no
two slices overlapping), and the last shard to register must leave no gap: only then is
the layout, and so the version, complete. A registration that breaks one of these is
refused with a :class:`~tensorhub.ManifestMismatchError` that names the tensor, the
shards and the offending ranges; nothing of it is recorded.

Readers (``tensorhub._sliced``): :func:`full_specs` is the version's ``hf`` manifest (the
full tensors, in a fixed order every reader computes alike); :func:`plan` cuts a read of
whole tensors, or of a row range (dim 0) and a column range (dim 1) of them, into runs of
bytes that are contiguous on both sides, per source shard.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence

from ._exceptions import ConfigError, ManifestMismatchError
from .protocol import DTYPE_SIZES, SLICED, Manifest, TensorSpec

__all__ = ["SLICED", "Box", "Run", "check_register", "full_specs", "plan", "box_of", "range_box"]

#: A box in a tensor: (start, stop) per dimension.
Box = tuple[tuple[int, int], ...]


def box_of(spec: TensorSpec, offsets: Sequence[int]) -> Box:
    return tuple((o, o + n) for o, n in zip(offsets, spec.shape))


def _fmt(box: Box) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in box) + "]"


def _overlap(a: Box, b: Box) -> bool:
    return all(x0 < y1 and y0 < x1 for (x0, x1), (y0, y1) in zip(a, b)) and bool(a)


def _volume(box: Box) -> int:
    return math.prod(b - a for a, b in box)


def _entries(m: Manifest) -> Iterable[tuple[TensorSpec, tuple[int, ...], Box]]:
    assert m.slices is not None
    for t, sl in zip(m.tensors, m.slices):
        yield t, sl.shape, box_of(t, sl.offsets)


def check_register(manifests: Mapping[int, Manifest], shard: int, new: Manifest, num_shards: int,
                   where: str) -> None:
    """Refuse ``new`` (shard ``shard`` of a layout of ``num_shards``, ``manifests`` the
    shards registered so far) when it mixes sliced and full shards, disagrees with them on
    a tensor's dtype or full shape, overlaps one of their slices, or -- being the last
    shard -- leaves part of a tensor uncovered. ``where`` names the layout in errors."""
    others = {s: m for s, m in manifests.items() if s != shard}
    sliced = new.slices is not None
    for s, m in others.items():
        if (m.slices is not None) != sliced:
            raise ManifestMismatchError(
                f"{where}: shard {shard} is {'sliced' if sliced else 'full tensors'} but shard {s} is "
                f"{'sliced' if m.slices is not None else 'full tensors'}; every shard of a layout is one or the other",
                "manifest_mismatch")
    if not sliced:
        return
    mine = {t.name: (t.dtype, full, box) for t, full, box in _entries(new)}
    for s, m in sorted(others.items()):
        for t, full, box in _entries(m):
            hit = mine.get(t.name)
            if hit is None:
                continue
            dtype, myfull, mybox = hit
            if dtype != t.dtype:
                raise ManifestMismatchError(
                    f"{where}: tensor {t.name!r} is {dtype} in shard {shard} but {t.dtype} in shard {s}",
                    "manifest_mismatch")
            if myfull != full:
                raise ManifestMismatchError(
                    f"{where}: tensor {t.name!r} has full shape {list(myfull)} in shard {shard} but "
                    f"{list(full)} in shard {s}", "manifest_mismatch")
            if _volume(box) and _volume(mybox) and _overlap(box, mybox):
                raise ManifestMismatchError(
                    f"{where}: tensor {t.name!r}: shard {shard}'s slice {_fmt(mybox)} overlaps shard {s}'s "
                    f"{_fmt(box)}", "slice_overlap")
    if len(others) + 1 < num_shards:
        return
    # The last shard: every tensor must be covered whole (no overlap, so volumes add up).
    covered: dict[str, int] = {}
    fulls: dict[str, tuple[int, ...]] = {}
    boxes: dict[str, list[tuple[int, Box]]] = {}
    for s, m in sorted({**others, shard: new}.items()):
        for t, full, box in _entries(m):
            covered[t.name] = covered.get(t.name, 0) + _volume(box)
            fulls[t.name] = full
            boxes.setdefault(t.name, []).append((s, box))
    for name, n in covered.items():
        want = math.prod(fulls[name])
        if n != want:
            have = ", ".join(f"shard {s} {_fmt(b)}" for s, b in boxes[name][:8])
            raise ManifestMismatchError(
                f"{where}: tensor {name!r} of full shape {list(fulls[name])}: the slices cover {n} of its "
                f"{want} elements (a gap: {have}{', ...' if len(boxes[name]) > 8 else ''}); shard {shard} is "
                "the last to register, so the version would be incomplete", "slice_gap")


def full_specs(manifests: Sequence[Manifest]) -> list[TensorSpec]:
    """The full tensors of a sliced layout (shards in order), ordered by where each name
    first appears: what a reader of ``hf`` gets, identical for every reader."""
    out: dict[str, TensorSpec] = {}
    for m in manifests:
        for t, full, _ in _entries(m):
            if t.name not in out:
                out[t.name] = TensorSpec(name=t.name, dtype=t.dtype, shape=tuple(full),
                                         nbytes=math.prod(full) * DTYPE_SIZES[t.dtype])
    return list(out.values())


def range_box(spec: TensorSpec, rows: Optional[tuple[int, int]], cols: Optional[tuple[int, int]]) -> Box:
    """The box of ``spec``'s full tensor a range read asks for: ``rows`` on dim 0, ``cols``
    on dim 1 (None: the whole dimension); refused with a clear error when out of bounds."""
    box = [(0, n) for n in spec.shape]
    for d, r, what in ((0, rows, "rows"), (1, cols, "cols")):
        if r is None:
            continue
        if d >= len(box):
            raise ConfigError(f"tensor {spec.name!r} of shape {list(spec.shape)} has no dimension {d} for {what}")
        try:
            a, b = (int(r[0]), int(r[1]))
        except (TypeError, ValueError, IndexError):
            raise ConfigError(f"{what} of {spec.name!r} must be a (start, stop) pair, got {r!r}") from None
        if not 0 <= a <= b <= box[d][1]:
            raise ConfigError(f"{what} ({a}, {b}) of {spec.name!r} is outside its dimension {d} "
                              f"of size {box[d][1]}")
        box[d] = (a, b)
    return tuple(box)


@dataclass(frozen=True)
class Run:
    """Bytes to read: from tensor ``src_index`` of the source shard at byte ``src_off``, into
    destination tensor ``dst`` (a name) at byte ``dst_off``, ``nbytes`` long."""

    src_index: int
    src_off: int
    dst: str
    dst_off: int
    nbytes: int


def _strides(shape: Sequence[int]) -> list[int]:
    out, acc = [0] * len(shape), 1
    for d in range(len(shape) - 1, -1, -1):
        out[d] = acc
        acc *= shape[d]
    return out


def runs(src: Box, want: Box, itemsize: int, src_index: int, dst: str) -> list[Run]:
    """The runs moving ``src ∩ want`` from a row-major source of box ``src`` into a
    row-major destination of box ``want`` (both in full-tensor coordinates)."""
    inter = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(src, want))
    if any(a >= b for a, b in inter):
        return []
    nd = len(inter)
    # k: the first dimension from which on each run is contiguous in both: every later
    # dimension is whole in the source, in the destination and in the intersection.
    k = nd - 1
    while k > 0 and inter[k] == src[k] == want[k]:
        k -= 1
    ss = _strides([b - a for a, b in src])
    ds = _strides([b - a for a, b in want])
    length = (inter[k][1] - inter[k][0]) * ss[k] * itemsize
    out: list[Run] = []
    for idx in itertools.product(*(range(a, b) for a, b in inter[:k])):
        so = sum((i - src[d][0]) * ss[d] for d, i in enumerate(idx)) + (inter[k][0] - src[k][0]) * ss[k]
        do = sum((i - want[d][0]) * ds[d] for d, i in enumerate(idx)) + (inter[k][0] - want[k][0]) * ds[k]
        out.append(Run(src_index, so * itemsize, dst, do * itemsize, length))
    return out


def plan(manifests: Sequence[Manifest], want: Mapping[str, Box]) -> list[list[Run]]:
    """Per source shard (in order), the runs that read ``want`` (name -> box of the full
    tensor) from it. A full (not sliced) shard's tensors are whole tensors."""
    out: list[list[Run]] = []
    for m in manifests:
        mine: list[Run] = []
        for i, t in enumerate(m.tensors):
            box = want.get(t.name)
            if box is None:
                continue
            src = box_of(t, m.slices[i].offsets) if m.slices is not None else tuple((0, n) for n in t.shape)
            if not t.shape:  # a 0-dimensional tensor: one element
                mine.append(Run(i, 0, t.name, 0, t.nbytes))
                continue
            mine.extend(runs(src, box, DTYPE_SIZES[t.dtype], i, t.name))
        out.append(mine)
    return out
