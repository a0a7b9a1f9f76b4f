"""Lossless per-tensor deltas: the change of a tensor against its base, on raw bytes.

Pure numpy, no torch, no I/O: :func:`encode` turns (base bytes, new bytes) into one blob,
:func:`apply` turns the base bytes into the new bytes in place. Both work on the raw
bytes viewed as unsigned integers of the element size (``uint8`` for fp8 / int8 / bool,
``uint16`` for bf16 / fp16, ...; elements wider than 8 bytes, complex128, as ``uint64``
pairs), so the result is bit-exact for every dtype: a NaN payload, a -0.0 or an fp8
bit pattern comes back as it was, and no float arithmetic ever touches the values.

Who calls it: the publisher (``_delta_path.publish_delta``) encodes each tensor against
the base version it still holds; a reader (``_delta_path``) applies the blobs it fetched
to its copy of the base.

Blob format (little endian)::

    magic  b"THD1"   4 bytes
    mode   uint8     SAME | SPARSE | SPARSE_Z | XOR_Z | RAW
    unit   uint8     bytes per compared element (1, 2, 4, 8)
    pad    2 bytes
    n      uint64    elements (of ``unit`` bytes) in the tensor
    payload:
      SAME      nothing: the tensor did not change
      SPARSE    k uint64, then k indices (uint32 if n < 2**32 else uint64), then k values
      SPARSE_Z  k uint64, zlib(gaps between indices as uint32/uint64, then k values)
      XOR_Z     zlib(new XOR base)
      RAW       the new bytes

Which mode, by measurement (:data:`SPARSE_BELOW`; benchmarks/bench_delta.py prints each
mode's size on a real bf16 AdamW run): nothing changed, SAME; up to ``SPARSE_BELOW`` of
the elements changed, the smaller of SPARSE (``4 + unit`` bytes per change, no compression
pass) and SPARSE_Z (index gaps are small numbers: zlib shrinks them); above it, XOR_Z
(unchanged elements XOR to zeros, and the high bytes of a small float change too). RAW
bounds every blob at the full size plus the header. ``encode(..., modes=...)`` picks the
smallest of the modes given, tried all.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ._exceptions import TensorHubError

__all__ = ["DeltaError", "Encoded", "MODES", "apply", "changed", "encode", "unit_of"]

MAGIC = b"THD1"
SAME, SPARSE, SPARSE_Z, XOR_Z, RAW = 0, 1, 2, 3, 4
MODES = {SAME: "same", SPARSE: "sparse", SPARSE_Z: "sparse+zlib", XOR_Z: "xor+zlib", RAW: "raw"}
_HEAD = struct.Struct("<4sBB2xQ")
_COUNT = struct.Struct("<Q")
#: zlib level: 1 (fastest) compresses XOR'd bf16 within a few % of level 6 at 3-5x the speed.
ZLIB_LEVEL = 1
#: Up to this fraction of changed elements the sparse forms are tried (the smaller of
#: SPARSE and SPARSE_Z wins), above it XOR_Z. Measured (uint16, random positions): at 1%
#: changed sparse 3.0%, sparse+zlib 1.8%, xor+zlib 2.0% of the bytes; at 10% changed
#: 30%, 15%, 9.4%; XOR+zlib encodes at ~0.2 GB/s on one core here, sparse+zlib at ~0.7 GB/s.
SPARSE_BELOW = 0.05
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class DeltaError(TensorHubError):
    """A delta cannot be applied: malformed blob, wrong base, or a result that does not verify.

    Readers never let it reach the caller: they fall back to the full version and log why."""


@dataclass(frozen=True)
class Encoded:
    """One encoded tensor: the blob, its mode, and the elements that changed."""

    blob: bytes
    mode: int
    changed: int
    elements: int

    @property
    def mode_name(self) -> str:
        return MODES[self.mode]


def unit_of(itemsize: int) -> int:
    """Bytes per compared element for a dtype of ``itemsize`` bytes."""
    if itemsize in _UINT:
        return itemsize
    if itemsize % 8 == 0:
        return 8
    raise DeltaError(f"element size {itemsize} is not supported by the delta encoding")


def _as_units(data: np.ndarray, unit: int) -> np.ndarray:
    """A flat ``uint<unit*8>`` view of a contiguous array (no copy)."""
    flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if flat.nbytes % unit:
        raise DeltaError(f"{flat.nbytes} bytes are not a whole number of {unit}-byte elements")
    return flat.view(_UINT[unit])


def changed(base: np.ndarray, new: np.ndarray, itemsize: int) -> np.ndarray:
    """Indices (in ``unit_of(itemsize)`` elements) where the bytes of ``new`` differ from ``base``."""
    unit = unit_of(itemsize)
    b, n = _as_units(base, unit), _as_units(new, unit)
    if b.shape != n.shape:
        raise DeltaError(f"base has {b.nbytes} bytes, the new tensor {n.nbytes}")
    return np.flatnonzero(b != n)


def encode(base: np.ndarray, new: np.ndarray, itemsize: int, *, modes: Optional[tuple[int, ...]] = None) -> Encoded:
    """The blob that turns ``base``'s bytes into ``new``'s (same byte length), choosing the
    smallest mode (see the module docstring); ``modes`` restricts the choice (benchmarks
    and tests measure each mode alone)."""
    unit = unit_of(itemsize)
    b, n = _as_units(base, unit), _as_units(new, unit)
    if b.shape != n.shape:
        raise DeltaError(f"base has {b.nbytes} bytes, the new tensor {n.nbytes}")
    count = b.size
    idx = np.flatnonzero(b != n)
    k = idx.size
    allowed = set(MODES) if modes is None else set(modes)
    head = lambda mode: _HEAD.pack(MAGIC, mode, unit, count)  # noqa: E731
    if k == 0 and SAME in allowed:
        return Encoded(head(SAME), SAME, 0, count)
    itype = np.uint32 if count < (1 << 32) else np.uint64
    if modes is None:  # by measurement (module docstring): sparse forms when few changed, else XOR
        allowed = {SPARSE, SPARSE_Z, RAW} if k <= SPARSE_BELOW * count else {XOR_Z, RAW}
    cands: list[tuple[int, int, list]] = []  # (size, mode, parts)
    sparse_size = _COUNT.size + k * (np.dtype(itype).itemsize + unit)
    if SPARSE in allowed:
        cands.append((sparse_size, SPARSE, [lambda: _COUNT.pack(k), lambda: idx.astype(itype).tobytes(),
                                            lambda: n[idx].tobytes()]))
    out: list[tuple[int, int, bytes]] = []
    if SPARSE_Z in allowed:
        gaps = np.diff(idx, prepend=0).astype(itype) if k else np.zeros(0, itype)
        z = _COUNT.pack(k) + zlib.compress(gaps.tobytes() + n[idx].tobytes(), ZLIB_LEVEL)
        out.append((len(z), SPARSE_Z, z))
    if XOR_Z in allowed:
        z = zlib.compress(np.bitwise_xor(b, n).tobytes(), ZLIB_LEVEL)
        out.append((len(z), XOR_Z, z))
    if RAW in allowed:
        cands.append((n.nbytes, RAW, [lambda: n.tobytes()]))
    best: Optional[tuple[int, int, bytes]] = None
    for size, mode, parts in cands:
        if best is None or size < best[0]:
            best = (size, mode, b"".join(p() for p in parts))
    for item in out:
        if best is None or item[0] < best[0]:
            best = item
    if best is None:
        raise DeltaError(f"no delta mode among {sorted(allowed)} can encode a change")
    return Encoded(head(best[1]) + best[2], best[1], int(k), count)


def _header(blob: memoryview) -> tuple[int, int, int]:
    if len(blob) < _HEAD.size:
        raise DeltaError(f"delta blob of {len(blob)} bytes is shorter than its header")
    magic, mode, unit, count = _HEAD.unpack_from(blob, 0)
    if magic != MAGIC:
        raise DeltaError(f"not a delta blob (magic {bytes(magic)!r})")
    if mode not in MODES or unit not in _UINT:
        raise DeltaError(f"delta blob has unknown mode {mode} or element size {unit}")
    return mode, unit, count


def apply(base: np.ndarray, blob: "bytes | memoryview | np.ndarray") -> int:
    """Turn ``base`` (a writable contiguous array, any dtype) into the encoded version, in
    place; returns the number of elements written. Raises :class:`DeltaError` on a blob that
    does not fit ``base`` (size, element width) or is malformed; ``base`` is then unchanged
    except for a RAW/XOR blob that failed half way (never: those are checked before writing)."""
    view = memoryview(blob).cast("B") if not isinstance(blob, np.ndarray) else memoryview(blob.reshape(-1).view(np.uint8))
    mode, unit, count = _header(view)
    dst = _as_units(base, unit)
    if dst.size != count:
        raise DeltaError(f"delta is for {count} elements of {unit} bytes, the base has {dst.size}")
    payload = view[_HEAD.size:]
    if mode == SAME:
        if len(payload):
            raise DeltaError("SAME delta blob carries a payload")
        return 0
    if mode == RAW:
        if len(payload) != dst.nbytes:
            raise DeltaError(f"RAW delta has {len(payload)} bytes, the tensor {dst.nbytes}")
        dst[:] = np.frombuffer(payload, dtype=dst.dtype)
        return count
    if mode == XOR_Z:
        x = _inflate(payload, dst.nbytes)
        np.bitwise_xor(dst, np.frombuffer(x, dtype=dst.dtype), out=dst)
        return count
    if len(payload) < _COUNT.size:
        raise DeltaError("sparse delta blob has no count")
    (k,) = _COUNT.unpack_from(payload, 0)
    itype = np.uint32 if count < (1 << 32) else np.uint64
    isz = np.dtype(itype).itemsize
    if k > count:
        raise DeltaError(f"sparse delta changes {k} of {count} elements")
    body = payload[_COUNT.size:]
    if mode == SPARSE_Z:
        body = memoryview(_inflate(body, k * (isz + unit)))
    if len(body) != k * (isz + unit):
        raise DeltaError(f"sparse delta body has {len(body)} bytes, {k} changes need {k * (isz + unit)}")
    idx = np.frombuffer(body, dtype=itype, count=k)
    vals = np.frombuffer(body, dtype=dst.dtype, count=k, offset=k * isz)
    if mode == SPARSE_Z:
        idx = np.cumsum(idx, dtype=np.uint64)
    if k and int(idx[-1]) >= count:
        raise DeltaError(f"sparse delta index {int(idx[-1])} is past the tensor's {count} elements")
    if k > 1 and mode == SPARSE and not bool(np.all(idx[1:] > idx[:-1])):
        raise DeltaError("sparse delta indices are not increasing")
    dst[idx] = vals
    return int(k)


def _inflate(data: memoryview, want: int) -> bytes:
    try:
        d = zlib.decompressobj()
        out = d.decompress(data, want + 1)
    except zlib.error as e:
        raise DeltaError(f"delta blob does not decompress: {e}") from None
    if len(out) != want or not d.eof:
        raise DeltaError(f"delta blob inflates to {len(out)}{'+' if not d.eof else ''} bytes, expected {want}")
    return out
