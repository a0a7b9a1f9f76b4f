"""A shard's manifest (its tensors, slices, checksums and meta), its canonical JSON and
digests, and where a replica's tensors lie (``AddressRuns``, ``Locality``)."""

from __future__ import annotations

import math
import re
from typing import Annotated, Literal, Optional

from pydantic import Field, TypeAdapter, field_validator, model_serializer, model_validator

from .._exceptions import ConfigError
from .._kept import KeptBy
from .base import (DTYPE_SIZES, MAX_CHUNKS, MAX_DIMS, MAX_NAME_LEN, MAX_TENSOR_BYTES, MAX_TENSORS, Address,
                   Name, _Model)


class TensorSpec(_Model):
    """One tensor of a manifest: its name, dtype, shape and size in bytes."""

    name: Name
    dtype: str
    shape: tuple[Annotated[int, Field(ge=0, le=MAX_TENSOR_BYTES)], ...] = Field(max_length=MAX_DIMS)
    nbytes: Annotated[int, Field(ge=0, le=MAX_TENSOR_BYTES)]

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, v: str) -> str:
        if v not in DTYPE_SIZES:
            raise ValueError(f"unknown dtype {v!r}; known: {', '.join(sorted(DTYPE_SIZES))}")
        return v

    @model_validator(mode="after")
    def _size_matches(self) -> "TensorSpec":
        numel = math.prod(self.shape)
        expect = numel * DTYPE_SIZES[self.dtype]
        if expect > MAX_TENSOR_BYTES:
            raise ValueError(f"tensor {self.name!r} of shape {list(self.shape)} is too large")
        if expect != self.nbytes:
            raise ValueError(
                f"tensor {self.name!r}: nbytes {self.nbytes} != {numel} elements x "
                f"{DTYPE_SIZES[self.dtype]} bytes ({self.dtype})"
            )
        return self


class SliceSpec(_Model):
    """Where a sliced shard's tensor sits in the full tensor (``tensorhub._slices``): the
    full tensor's ``shape`` and this slice's ``offsets`` in it (one per dimension; the
    slice's own shape is its :class:`TensorSpec`'s)."""

    shape: tuple[Annotated[int, Field(ge=0, le=MAX_TENSOR_BYTES)], ...] = Field(max_length=MAX_DIMS)
    offsets: tuple[Annotated[int, Field(ge=0, le=MAX_TENSOR_BYTES)], ...] = Field(max_length=MAX_DIMS)


#: The largest JSON of a version's :class:`VersionMeta` (a PEFT config is ~1 KiB).
MAX_META_BYTES = 64 << 10


class VersionMeta(_Model):
    """What a version is, beyond its tensors (``Hub.publish(kind=..., base_model=...,
    config=...)``): ``kind`` ``"full"`` (a model's weights, the default) or ``"lora"`` (a
    LoRA adapter: ``base`` names the base model it adapts, ``"<model>"`` or
    ``"<model>@v<N>"``; ``config`` is its PEFT ``adapter_config.json`` as a dict, with at
    least ``r``, ``lora_alpha`` and ``target_modules``). Carried on the manifest (the first
    replica's is final, like its tensors), at most ``MAX_META_BYTES`` of JSON."""

    kind: Literal["full", "lora"] = "full"
    base: Optional[Annotated[str, Field(min_length=1, max_length=MAX_NAME_LEN, pattern=r"^[^\x00-\x1f\x7f]+$")]] = None
    config: Optional[dict] = None

    @model_validator(mode="after")
    def _check(self) -> "VersionMeta":
        import json

        try:
            size = len(json.dumps(self.config, allow_nan=False)) if self.config is not None else 0
        except (TypeError, ValueError) as e:
            raise ValueError(f"config must be plain JSON (a PEFT adapter config): {e}") from None
        if size > MAX_META_BYTES:
            raise ValueError(f"config is {size} bytes of JSON; at most {MAX_META_BYTES}")
        if self.kind == "full":
            if self.base is not None or self.config is not None:
                raise ValueError("base and config describe a LoRA adapter: publish it with kind='lora'")
            return self
        if self.base is None or self.config is None:
            raise ValueError("kind 'lora' needs base (the base model) and config (the PEFT adapter config)")
        missing = [k for k in ("r", "lora_alpha", "target_modules") if k not in self.config]
        if missing:
            raise ValueError(f"the PEFT adapter config lacks {', '.join(missing)}")
        r = self.config["r"]
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise ValueError(f"the PEFT adapter config's r (the rank) must be a positive int, got {r!r}")
        alpha = self.config["lora_alpha"]
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
            raise ValueError(f"the PEFT adapter config's lora_alpha must be a number, got {alpha!r}")
        tm = self.config["target_modules"]
        names = isinstance(tm, list) and tm and all(isinstance(m, str) for m in tm)
        if not (isinstance(tm, str) and tm) and not names:
            raise ValueError(f"the PEFT adapter config's target_modules must be a module name or a non-empty list of "
                             f"them, got {tm!r}")
        return self


class Manifest(_Model):
    """The ordered tensors of one (model, version, layout, shard), and optionally one
    checksum per chunk of the shard's grid (``_checksum``: the publisher computes them,
    readers verify each chunk before accepting it). Manifests without checksums (older
    clients, CUDA tensors by default) stay valid.

    ``slices`` (a trainer rank's shard of a sliced publish, ``tensorhub._slices``): for each
    tensor, where it sits in the full tensor of that name; None for full tensors."""

    tensors: list[TensorSpec] = Field(max_length=MAX_TENSORS)
    #: The checksum algorithm (``_checksum.ALGORITHMS``, e.g. ``xxh3_64``); set with ``checksums``.
    checksum: Optional[Annotated[str, Field(min_length=1, max_length=32, pattern=r"^[a-z0-9_]+$")]] = None
    #: One unsigned 64-bit hash per chunk of ``_checksum.grid`` (in chunk order).
    checksums: Optional[list[Annotated[int, Field(ge=0, lt=1 << 64)]]] = Field(default=None, max_length=MAX_CHUNKS)
    #: What the version is (``VersionMeta``: a LoRA adapter, its base and PEFT config); None:
    #: full weights, and the field is left out of the JSON (peers that predate it read it as before).
    meta: Optional[VersionMeta] = None
    slices: Optional[list[SliceSpec]] = Field(default=None, max_length=MAX_TENSORS)

    @model_validator(mode="after")
    def _unique_names(self) -> "Manifest":
        seen: set[str] = set()
        for t in self.tensors:
            if t.name in seen:
                raise ValueError(f"duplicate tensor name {t.name!r}")
            seen.add(t.name)
        if sum(t.nbytes for t in self.tensors) > MAX_TENSOR_BYTES:
            raise ValueError("manifest is larger than 1 PiB")
        if (self.checksum is None) != (self.checksums is None):
            raise ValueError("checksum (the algorithm) and checksums (the values) go together")
        if self.checksums is not None:
            from .._checksum import count  # imported here: _checksum depends on this module

            want = count([t.nbytes for t in self.tensors], limit=len(self.checksums))
            if len(self.checksums) != want:
                raise ValueError(f"{len(self.checksums)} checksums for a shard of {want} chunks "
                                 "(one per chunk of its grid)")
        if self.slices is not None:
            if len(self.slices) != len(self.tensors):
                raise ValueError(f"{len(self.slices)} slices for {len(self.tensors)} tensors (one per tensor)")
            for t, sl in zip(self.tensors, self.slices):
                if not (len(sl.shape) == len(sl.offsets) == len(t.shape)):
                    raise ValueError(f"tensor {t.name!r}: a slice of shape {list(t.shape)} needs the full shape "
                                     f"and offsets in {len(t.shape)} dimensions, got shape {list(sl.shape)} "
                                     f"and offsets {list(sl.offsets)}")
                if not t.shape:
                    raise ValueError(f"tensor {t.name!r}: a 0-dimensional tensor cannot be sliced")
                for d, (n, off, full) in enumerate(zip(t.shape, sl.offsets, sl.shape)):
                    if off + n > full:
                        raise ValueError(f"tensor {t.name!r}: slice [{off}, {off + n}) of dimension {d} is "
                                         f"outside the full tensor's {full}")
        return self

    @model_serializer(mode="wrap")
    def _omit_no_slices(self, handler):  # type: ignore[no-untyped-def]
        """A manifest of full tensors is written without ``slices``: clients and
        coordinators that predate sliced publishing (``extra="forbid"``) read it as before."""
        d = handler(self)
        if isinstance(d, dict):
            for k in ("meta", "slices"):
                if d.get(k, 0) is None:
                    del d[k]
        return d

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


_TENSORS = TypeAdapter(list[TensorSpec])
_SLICES = TypeAdapter(list[SliceSpec])

#: Canonical JSON of the last few manifests, by identity (``manifest_json``).
_json_kept = KeptBy(2)
#: Shape digests of the last few manifests, by identity (``shape_digest``).
_shapes_kept = KeptBy(4)


#: Tensors (and slices) serialized per call by ``_pieced_json``.
_PIECE = 2048


def manifest_json(m: Manifest) -> bytes:
    """The manifest's canonical JSON: what the coordinator answers for it and what its
    digest hashes. The last few are kept by identity, so the coordinator serializes a new
    version's manifest (~0.1-0.2 s for 50,000 tensors) once for both, not once each."""
    return _json_kept.get(m, lambda: _pieced_json(m) if len(m.tensors) > _PIECE else m.model_dump_json().encode())


def _pieced_json(m: Manifest) -> bytes:
    """``m.model_dump_json()``, byte for byte, made ``_PIECE`` tensors per call: one call for
    50,000 tensors holds the interpreter's lock ~70 ms, during which no other thread runs
    (the coordinator's event loop among them); between pieces they do."""
    def items(adapter: TypeAdapter, xs: list) -> bytes:
        return b",".join(adapter.dump_json(xs[i:i + _PIECE])[1:-1] for i in range(0, len(xs), _PIECE))

    shell = m.model_copy(update={"tensors": [], "slices": None if m.slices is None else []}).model_dump_json().encode()
    head, rest = b'{"tensors":[', shell[len(b'{"tensors":[]'):]
    out = head + items(_TENSORS, m.tensors) + b"]" + rest
    if m.slices is not None:
        assert out.endswith(b',"slices":[]}')
        out = out[:-2] + items(_SLICES, m.slices) + b"]}"
    return out


def manifest_digest(m: Manifest) -> str:
    """The digest a replica may register by instead of its manifest (``RegisterReplica``):
    sha256 of the manifest's canonical JSON."""
    import hashlib

    return "sha256:" + hashlib.sha256(manifest_json(m)).hexdigest()


def shape_digest(m: Manifest) -> str:
    """sha256 of the tensors alone (names, dtypes, shapes, sizes, and slices): what a reader
    that subscribes ahead (``AcquireLease.ahead``) offers its destination by, since the
    next version's checksums do not exist yet. Two versions of one model trained in place
    have the same shape digest."""
    def digest() -> str:
        import hashlib

        h = hashlib.sha256()
        for i in range(0, len(m.tensors), _PIECE):
            h.update(_TENSORS.dump_json(m.tensors[i:i + _PIECE]))
        h.update(b"|")
        for i in range(0, len(m.slices or ()), _PIECE):
            h.update(_SLICES.dump_json(m.slices[i:i + _PIECE]))
        return "sha256:" + h.hexdigest()

    return _shapes_kept.get(m, digest)


def keep_like(m: Manifest, earlier: Manifest, shape: str) -> None:
    """Keep for ``m`` (``ManifestLike.manifest(earlier)``: ``earlier``'s tensors, other sums)
    what follows from ``earlier``'s: its shape digest ``shape`` (checked equal by the caller)
    and its canonical JSON (``manifest_json``) made from ``earlier``'s, the tensors' bytes
    reused rather than serialized again (~40 ms for 50,000 tensors)."""
    _shapes_kept.get(m, lambda: shape)
    if earlier.slices is not None or m.slices is not None:
        return

    def spliced() -> bytes:
        old = manifest_json(earlier)  # b'{"tensors":[' + tensors + b']' + the rest
        return old[:len(old) - len(_rest(earlier))] + _rest(m)

    _json_kept.get(m, spliced)


def _rest(m: Manifest) -> bytes:
    """What follows the tensors in ``m``'s canonical JSON (its sums, meta)."""
    return m.model_copy(update={"tensors": []}).model_dump_json().encode()[len(b'{"tensors":[]'):]


def first_difference(a: Manifest, b: Manifest) -> Optional[str]:
    """Describe the first difference between two manifests, or None if they are equal."""
    if len(a.tensors) != len(b.tensors):
        return f"tensor count {len(b.tensors)} != registered {len(a.tensors)}"
    for i, (x, y) in enumerate(zip(a.tensors, b.tensors)):
        for field in ("name", "dtype", "shape", "nbytes"):
            xv, yv = getattr(x, field), getattr(y, field)
            if xv != yv:
                return f"tensor #{i} {x.name!r}: {field} {_fmt(yv)} != registered {_fmt(xv)}"
    if (a.slices or None) != (b.slices or None):
        for i, t in enumerate(a.tensors):
            x = a.slices[i] if a.slices else None
            y = b.slices[i] if b.slices else None
            if x != y:
                return f"tensor #{i} {t.name!r}: slice {_slice(y)} != registered {_slice(x)}"
    # Meta compares only when both sides have it (a replica registered by an older client has none).
    if a.meta is not None and b.meta is not None and a.meta != b.meta:
        return f"meta {b.meta.model_dump_json()} != registered {a.meta.model_dump_json()}"
    # Checksums compare only when both sides have them with the same algorithm: a manifest
    # without them (an older client, a CUDA holder) or hashed otherwise is not a mismatch.
    if a.checksums is not None and b.checksums is not None and a.checksum == b.checksum:
        for c, (x, y) in enumerate(zip(a.checksums, b.checksums)):
            if x != y:
                return f"chunk {c}: {a.checksum} checksum {y:#x} != registered {x:#x} (different bytes)"
    return None


def _slice(s: Optional[SliceSpec]) -> str:
    return "none (a full tensor)" if s is None else f"at {list(s.offsets)} of {list(s.shape)}"


def _fmt(v: object) -> str:
    return str(list(v)) if isinstance(v, tuple) else repr(v)


class AddressRuns(_Model):
    """A replica's tensor addresses, compactly (``tensorhub._addresses``): runs of tensors
    laid out in manifest order. Run ``[start, count]`` covers the next ``count`` tensors;
    its first sits at ``start`` and each next one at the previous one's address plus the
    previous one's ``nbytes`` rounded up to ``align``. Memory the Hub allocates is one or a
    few runs however many tensors it holds, so the lease route parses and writes a few
    numbers instead of one per tensor (50,000 tensors: ~0.8 MB of JSON per replica)."""

    align: Annotated[int, Field(ge=1, le=1 << 30)]
    runs: list[tuple[Address, Annotated[int, Field(ge=1, le=MAX_TENSORS)]]] = Field(max_length=MAX_TENSORS)

    @model_validator(mode="after")
    def _bounded(self) -> "AddressRuns":
        if sum(c for _, c in self.runs) > MAX_TENSORS:
            raise ValueError(f"runs cover more than {MAX_TENSORS} tensors")
        return self

    @property
    def count(self) -> int:
        """How many tensors the runs place."""
        return sum(c for _, c in self.runs)


class Locality(_Model):
    datacenter: Annotated[str, Field(max_length=128)] = ""
    zone: Annotated[str, Field(max_length=128)] = ""
    host: Annotated[str, Field(max_length=256)] = ""


_BASE = re.compile(r"^(?P<name>.+?)(@v(?P<version>[0-9]+))?$")


def parse_base(base: str) -> tuple[str, Optional[int]]:
    """A LoRA adapter's base (``VersionMeta.base``): ``"policy"`` -> ``("policy", None)``;
    ``"policy@v3"`` -> ``("policy", 3)``."""
    m = _BASE.match(base)
    if m is None:
        raise ConfigError(f"base_model {base!r}: expected '<model>' or '<model>@v<N>'")
    return m["name"], None if m["version"] is None else int(m["version"])
