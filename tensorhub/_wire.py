"""Everything that crosses the coordinator's HTTP API, as validated pydantic models.

Nothing on the wire is pickled: requests and answers are JSON, checked here. The limits
below bound every request; they are documented in the README ("Limits").
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
from typing import Annotated, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_serializer, model_validator

from ._kept import KeptBy

API_VERSION = "v1"

#: Largest request body the coordinator accepts (bytes).
MAX_BODY_BYTES = 64 << 20
#: Most tensors in one manifest.
MAX_TENSORS = 200_000
#: Longest tensor / model / layout name.
MAX_NAME_LEN = 512
#: Most dimensions of one tensor.
MAX_DIMS = 16
#: Largest single tensor (bytes) and largest shard (bytes): 1 PiB, far above any model.
MAX_TENSOR_BYTES = 1 << 50
#: Most shards per layout.
MAX_SHARDS = 65_536
#: Largest version number.
MAX_VERSION = (1 << 53) - 1
#: Most chunks of one shard's pipelining grid.
MAX_CHUNKS = 1 << 22

#: Layout names of deltas (``tensorhub._delta_path``) start with this: ``delta:<base>``
#: (the delta of layout ``hf``) or ``delta:<base>:<layout>``.
DELTA_PREFIX = "delta:"


def delta_layout(base: int, layout: str = "hf") -> str:
    """The layout name of the delta against v``base`` of ``layout``."""
    return f"{DELTA_PREFIX}{base}" if layout == "hf" else f"{DELTA_PREFIX}{base}:{layout}"


def is_delta_layout(layout: str) -> bool:
    """A delta layout (:func:`delta_layout`): one more replica of a version for readers that
    hold its base, never the version itself -- it alone does not complete a version."""
    return layout.startswith(DELTA_PREFIX)


def lease_proof(secret: str, lease_id: str, replica_id: str, endpoint: str) -> str:
    """What a same-host reader sends a holder's fd server (``transport/_shm``) instead of
    any credential: HMAC-SHA256, keyed by the lease's secret (``LeaseGrant.secret``, hex),
    of ``"<lease_id>|<replica_id>|<holder endpoint>"``, hex. The holder cannot check it: it
    forwards it (``LeaseCovers``) and the coordinator, which keeps the secret, does; a
    proof opens only that replica of that holder, and only while the lease is valid."""
    return hmac.new(secret.encode(), f"{lease_id}|{replica_id}|{endpoint}".encode(), hashlib.sha256).hexdigest()


#: dtype name -> bytes per element. Names follow torch (``torch.float32`` -> ``float32``).
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
}

_NAME_RE = re.compile(r"^[^\x00-\x1f\x7f]+$")
_ID_RE = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,256}$")

Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME_LEN, pattern=r"^[^\x00-\x1f\x7f]+$")]
Ident = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9._:@/+=-]+$")]
#: Model names travel in URL paths: no slash, no spaces.
ModelName = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9._:@+=-]+$")]
Version = Annotated[int, Field(ge=1, le=MAX_VERSION)]
Shard = Annotated[int, Field(ge=0, lt=MAX_SHARDS)]
Address = Annotated[int, Field(ge=0, lt=1 << 64)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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
            from ._checksum import count  # imported here: _checksum depends on this module

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


def _addresses_of(self: "RegisterReplica | ServeOffer") -> None:
    """``addresses`` or ``address_runs``: one of the two (an empty manifest has empty addresses)."""
    if self.address_runs is not None and self.addresses:
        raise ValueError("send addresses or address_runs, not both")


class Locality(_Model):
    datacenter: Annotated[str, Field(max_length=128)] = ""
    zone: Annotated[str, Field(max_length=128)] = ""
    host: Annotated[str, Field(max_length=256)] = ""


# ---------------------------------------------------------------- requests
class RegisterWorker(_Model):
    worker_id: Ident
    endpoint: Annotated[str, Field(max_length=512)]
    locality: Locality = Locality()


class AllocateVersion(_Model):
    version: Optional[Version] = None
    #: Client-chosen id of this request: a retry with the same id gets the same number.
    request_id: Optional[Ident] = None


class Resolve(_Model):
    group: Optional[Ident] = None
    newer_than: Optional[Annotated[int, Field(ge=0, le=MAX_VERSION)]] = None


class ManifestLike(_Model):
    """A new version's manifest as an earlier version's tensors plus its own sums
    (``RegisterReplica.like``): a model trained in place publishes every version with the
    same tensors, so its publisher sends the earlier version's number and ``shape_digest``
    and this version's checksums and meta instead of the whole manifest (50,000 tensors:
    6 MB of JSON the coordinator parsed and validated for ~0.2 s before the version was
    complete and any reader could start). The coordinator builds the manifest from its own
    copy of the earlier one; one it no longer has, or with other tensors, is refused
    (``like_unknown`` / ``like_mismatch``) and the publisher sends the manifest."""

    #: An earlier version of the same model, layout and shard, whose tensors these are.
    version: Version
    shape_digest: Annotated[str, Field(pattern=r"^sha256:[0-9a-f]{64}$")]
    checksum: Optional[Annotated[str, Field(min_length=1, max_length=32, pattern=r"^[a-z0-9_]+$")]] = None
    checksums: Optional[list[Annotated[int, Field(ge=0, lt=1 << 64)]]] = Field(default=None, max_length=MAX_CHUNKS)
    meta: Optional[VersionMeta] = None

    @model_validator(mode="after")
    def _pair(self) -> "ManifestLike":
        if (self.checksum is None) != (self.checksums is None):
            raise ValueError("checksum (the algorithm) and checksums (the values) go together")
        return self

    def manifest(self, earlier: Manifest) -> Manifest:
        """The manifest: ``earlier``'s tensors with these sums (the count of checksums
        checked by the caller, against the earlier manifest's grid)."""
        return Manifest.model_construct(tensors=earlier.tensors, checksum=self.checksum, checksums=self.checksums,
                                        meta=self.meta, slices=None)


class RegisterReplica(_Model):
    worker_id: Ident
    model: ModelName
    version: Version
    layout: Name = "hf"
    shard: Shard = 0
    num_shards: Annotated[int, Field(ge=1, le=MAX_SHARDS)] = 1
    #: The shard's manifest; or, when the coordinator has it already (a reader registering
    #: what it fetched), only ``manifest_digest`` (``manifest_digest()`` of it): one of the two.
    manifest: Optional[Manifest] = None
    manifest_digest: Optional[Annotated[str, Field(pattern=r"^sha256:[0-9a-f]{64}$")]] = None
    #: Or (a publisher, when the coordinator reads it: ``WorkerRegistered.register_like``)
    #: an earlier version's tensors with this version's sums (``ManifestLike``).
    like: Optional[ManifestLike] = None
    addresses: list[Address] = Field(default_factory=list, max_length=MAX_TENSORS)
    #: The addresses as runs (``AddressRuns``) instead, when the coordinator said it reads
    #: them (``WorkerRegistered.address_runs``).
    address_runs: Optional[AddressRuns] = None
    #: A reader that is still receiving (pipelined replication): it serves only the chunks
    #: it reports through ``ReportChunks``; registering again without ``partial`` completes it.
    partial: bool = False
    #: The chunk grid the partial replica uses (must be the lease's ``chunk_bytes``).
    chunk_bytes: Annotated[int, Field(ge=0, le=1 << 30)] = 0
    num_chunks: Annotated[int, Field(ge=0, le=MAX_CHUNKS)] = 0
    #: A partial replica's chunk map (``_chunkmap``): where its status bytes lie in the
    #: holder's registered memory, and the tag they start with. Readers then learn which
    #: chunks it holds from it (one-sided), and it sends no chunk reports.
    status_addr: Optional[Address] = None
    status_tag: Optional[Annotated[int, Field(ge=1, lt=1 << 64)]] = None
    #: Release these leases of the worker in the same call (a reader registering what it
    #: read under them): the replica is registered only if every one stayed valid, and the
    #: answer's ``released`` says which did.
    release: list[Ident] = Field(default_factory=list, max_length=1024)

    @model_validator(mode="after")
    def _shape(self) -> "RegisterReplica":
        if self.shard >= self.num_shards:
            raise ValueError(f"shard {self.shard} >= num_shards {self.num_shards}")
        if (self.manifest is not None) + (self.manifest_digest is not None) + (self.like is not None) != 1:
            raise ValueError("send the manifest, its digest (manifest_digest) or an earlier version's (like), "
                             "exactly one of them")
        if self.like is not None and (self.like.version >= self.version or self.partial or self.release):
            raise ValueError("like names an earlier version, for a complete replica")
        if (self.status_addr is None) != (self.status_tag is None):
            raise ValueError("status_addr and status_tag go together")
        if self.status_addr is not None and not self.partial:
            raise ValueError("status_addr is for partial replicas")
        if self.release and self.partial:
            raise ValueError("release goes with the complete registration")
        _addresses_of(self)
        if self.manifest is not None and self.address_runs is None \
                and len(self.addresses) != len(self.manifest.tensors):
            raise ValueError(
                f"{len(self.addresses)} addresses for {len(self.manifest.tensors)} tensors"
            )
        return self  # (runs are checked against the manifest by the coordinator: ``_addresses.check``)


class Unpublish(_Model):
    worker_id: Ident
    #: Only these replicas of the worker (default: all of its replicas of the version).
    replica_ids: Optional[list[Ident]] = Field(default=None, max_length=1024)


class ServeOffer(_Model):
    """A pipelined reader offers to serve the shard while it receives it: its partial
    replica (destination addresses and chunk map, ``_chunkmap``), registered together with
    its first lease (one call; readers arriving later are sent to it at once)."""

    manifest_digest: Annotated[str, Field(pattern=r"^sha256:[0-9a-f]{64}$")]
    addresses: list[Address] = Field(default_factory=list, max_length=MAX_TENSORS)
    address_runs: Optional[AddressRuns] = None
    chunk_bytes: Annotated[int, Field(ge=1, le=1 << 30)]
    num_chunks: Annotated[int, Field(ge=1, le=MAX_CHUNKS)]
    status_addr: Address
    status_tag: Annotated[int, Field(ge=1, lt=1 << 64)]

    @model_validator(mode="after")
    def _one_form(self) -> "ServeOffer":
        _addresses_of(self)
        return self


class AcquireLease(_Model):
    worker_id: Ident
    model: ModelName
    version: Version
    layout: Name = "hf"
    shard: Shard = 0
    max_sources: Annotated[int, Field(ge=1, le=64)] = 4
    exclude: list[Ident] = Field(default_factory=list, max_length=1024)
    #: The reader understands partial replicas (chunk sets) and cross-datacenter seeding.
    pipelined: bool = False
    #: Refresh this (still valid) lease of the same worker instead of opening a new one.
    lease_id: Optional[Ident] = None
    #: Client-chosen id of this request: a retry with the same id gets the same lease.
    request_id: Optional[Ident] = None
    #: Answer the shard's manifest in the grant (and in refreshes). Readers that keep
    #: manifests by version (final once registered: ``GET .../manifest``) send false.
    manifest: bool = True
    #: A new pipelined lease only: register this partial replica of the reader with it.
    serve: Optional[ServeOffer] = None
    #: The reader reads ``ReplicaInfo.address_runs``: sources registered with runs are
    #: answered as runs, not expanded to one address per tensor.
    address_runs: bool = False
    #: Answer the lease's secret (``LeaseGrant.secret``): the reader proves its lease with it
    #: to same-host holders (``lease_proof``). Sent only to coordinators that said they
    #: answer it (``WorkerRegistered.lease_secrets``).
    lease_secret: bool = False
    #: Subscribe ahead (``tensorhub._ahead``): a lease on the first complete version >=
    #: ``version``, held (``POST /v1/leases?wait=S``) until one is published; the reader is a
    #: member of its plan from the start. Needs ``request_id`` and ``pipelined``; its ``serve``
    #: offer names the destination by ``shape_digest`` (the version's checksums do not exist
    #: yet). Sent only to coordinators that said they answer it (``WorkerRegistered.ahead``).
    ahead: bool = False


class LeaseCovers(_Model):
    """A holder asks (``POST /v1/leases/{id}/covers``) before it hands a same-host reader
    its memory: does the lease cover ``replica_id`` for ``worker_id``, and is ``proof`` the
    reader's ``lease_proof`` of it for the holder at ``endpoint``?"""

    worker_id: Ident
    replica_id: Ident
    #: Empty (an older holder): never covered.
    proof: Annotated[str, Field(max_length=64, pattern=r"^[0-9a-f]*$")] = ""
    endpoint: Annotated[str, Field(max_length=512)] = ""


class ReportChunks(_Model):
    """A partial replica's holder reports chunks that are now complete in its memory."""

    worker_id: Ident
    chunks: list[Annotated[int, Field(ge=0, lt=MAX_CHUNKS)]] = Field(max_length=MAX_CHUNKS)
    #: The leases the chunks were read under: refused unless all are still valid, so a
    #: chunk read under a lease that lapsed is never offered to other readers.
    lease_ids: list[Ident] = Field(default_factory=list, max_length=1024)
    #: Chunks it is receiving now (replaces the last report's): not readable from it, but
    #: other readers leave them to it rather than pulling them from a complete replica too.
    coming: Optional[list[Annotated[int, Field(ge=0, lt=MAX_CHUNKS)]]] = Field(default=None, max_length=MAX_CHUNKS)


class Report(_Model):
    worker_id: Ident
    reason: Annotated[str, Field(max_length=1024)] = ""


#: Seconds in a report (a fetch, a swap): finite, at most about four months.
Seconds = Annotated[float, Field(ge=0.0, le=1e7, allow_inf_nan=False)]
Bytes = Annotated[int, Field(ge=0, le=MAX_TENSOR_BYTES)]


class FetchReport(_Model):
    """A reader's fetch of one shard, for ``/metrics`` and ``status``: about once a second
    while it runs (``state="running"``, only fetches longer than a second) and once when it
    ended (``"ok"`` or ``"failed"``). Optional telemetry: old clients never send it, and the
    reader goes on whatever the answer."""

    worker_id: Ident
    model: ModelName
    version: Version
    layout: Name = "hf"
    shard: Shard = 0
    state: Literal["running", "ok", "failed"] = "ok"
    #: Bytes read so far (running) or in all (ok, failed).
    nbytes: Bytes = 0
    #: Bytes of the shard (0: unknown).
    total: Bytes = 0
    seconds: Seconds = 0.0
    #: Bytes read from each source worker.
    sources: dict[Ident, Bytes] = Field(default_factory=dict, max_length=1024)
    #: Sources that failed during the fetch (each was also reported on its own).
    failed_sources: Annotated[int, Field(ge=0, le=1 << 20)] = 0


class Heartbeat(_Model):
    """A heartbeat's optional body: the worker's fetch reports since the last one
    (progress folded into heartbeats: no call of their own)."""

    fetches: list[FetchReport] = Field(default_factory=list, max_length=64)


class SwapReport(_Model):
    """An engine switched to ``version`` (or failed to): how long it stalled serving."""

    worker_id: Ident
    model: ModelName
    version: Version
    #: Seconds the engine did not serve (start of the update to its end).
    stall: Seconds
    #: Of which fetching, and applying the weights to the model.
    fetch_seconds: Optional[Seconds] = None
    apply_seconds: Optional[Seconds] = None
    ok: bool = True


# ---------------------------------------------------------------- answers
class ReplicaInfo(_Model):
    replica_id: str
    worker_id: str
    endpoint: str
    locality: Locality
    #: One address per tensor; empty when ``address_runs`` places them.
    addresses: list[int]
    cost: int = 0
    #: Chunks this replica may be read for (a partial replica); None: all of them.
    chunks: Optional[list[int]] = None
    #: Chunks a partial replica is receiving now (a hint; never read from it for these).
    coming: list[int] = Field(default_factory=list)
    #: A partial replica with a chunk map (``_chunkmap``): read it from the source for
    #: the chunks it holds (``chunks`` is then empty); None: an older holder's reports.
    status_addr: Optional[int] = None
    status_tag: Optional[int] = None
    num_chunks: int = 0
    #: The addresses as runs (only to readers that asked: ``AcquireLease.address_runs``).
    address_runs: Optional[AddressRuns] = None

    @model_serializer(mode="wrap")
    def _omit_no_runs(self, handler):  # type: ignore[no-untyped-def]
        """Written without ``address_runs`` when there are none: readers that predate runs
        (``extra="forbid"``) read the answer as before."""
        d = handler(self)
        if isinstance(d, dict) and "address_runs" in d and d["address_runs"] is None:
            del d["address_runs"]
        return d


class VersionSums(_Model):
    """What a lease asked ahead answers instead of the manifest (``LeaseGrant.sums``): the
    version's own checksums and meta. Its tensors are those the reader offered to receive
    them into (``shape_digest`` matched), so these complete the manifest exactly."""

    checksum: Optional[str] = None
    checksums: Optional[list[int]] = None
    meta: Optional[VersionMeta] = None

    def manifest(self, shaped: Manifest) -> Manifest:
        """The version's manifest: ``shaped`` (another version's, same tensors) with these."""
        return shaped.model_copy(update={"checksum": self.checksum, "checksums": self.checksums, "meta": self.meta})


class LeaseGrant(_Model):
    lease_id: str
    model: str
    version: int
    layout: str
    shard: int
    num_shards: int
    #: The shard's manifest: only on a new lease asked with ``manifest`` true.
    manifest: Optional[Manifest] = None
    replicas: list[ReplicaInfo]
    ttl: float
    #: Pipelined leases: the shard's chunk grid, where in the chunk order this reader
    #: starts and in which direction, whether it is its datacenter's seeder, and why.
    chunk_bytes: int = 0
    start: float = 0.0
    reverse: bool = False
    #: Chunks other readers in this datacenter are receiving now: the reader leaves them to
    #: them rather than pulling them from a complete replica too (a hint, never a source).
    claimed: list[int] = Field(default_factory=list)
    #: Chunks reserved for this reader to read from complete replicas (None: no limit).
    reserved: Optional[list[int]] = None
    seed: bool = False
    reason: str = ""
    #: The reader's partial replica registered with this lease (``AcquireLease.serve``);
    #: None when none was offered or it was refused (``serve_refused`` says why).
    partial_replica_id: Optional[str] = None
    serve_refused: str = ""
    #: A striped plan (``tensorhub._stripes``): chunk ``c`` is read from the replica
    #: ``stripe_sources[c % stripes]`` ("" = from nobody yet); 0 stripes: no plan.
    stripes: int = 0
    stripe_sources: list[str] = Field(default_factory=list)
    #: Seconds after which to refresh this lease once, for the plan's fixed layout (0: none).
    refresh_after: float = 0.0
    #: The lease's secret, hex (only to readers that asked: ``AcquireLease.lease_secret``):
    #: the key of the ``lease_proof`` it shows same-host holders. Never sent to them.
    secret: str = ""
    #: Seconds after this request reached the coordinator that the lease was granted: > 0
    #: for a lease asked ahead (held until its version came), < 0 for a retried request
    #: answered with the lease granted to its first try. The reader trusts the lease from
    #: the moment it sent the request plus this (``_fencing.LeaseClock``), never longer
    #: than the coordinator keeps it.
    granted_after: float = 0.0
    #: A lease asked ahead whose offer fits the version: its checksums and meta (the reader
    #: has its tensors already; no manifest to read). None otherwise.
    sums: Optional[VersionSums] = None

    @model_serializer(mode="wrap")
    def _omit_no_secret(self, handler):  # type: ignore[no-untyped-def]
        """Written without ``secret`` and ``granted_after`` when they are empty: readers that
        predate them (``extra="forbid"``) read the answer as before."""
        d = handler(self)
        if isinstance(d, dict):
            if d.get("secret", None) == "":
                del d["secret"]
            if d.get("granted_after", None) == 0.0:
                del d["granted_after"]
            if "sums" in d and d["sums"] is None:
                del d["sums"]
        return d


class Error(_Model):
    code: str
    detail: str


# ---------------------------------------------------------------------- answers
class _Answer(BaseModel):
    """An answer of the coordinator, read by attribute (fields it adds later are ignored)."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class WorkerRegistered(_Answer):
    epoch: str
    worker_ttl: float
    lease_ttl: float
    #: The coordinator reads and answers ``AddressRuns`` (False: an older coordinator).
    address_runs: bool = False
    #: The coordinator answers lease secrets (``AcquireLease.lease_secret``) and checks
    #: same-host proofs (``LeaseCovers``); False: an older coordinator.
    lease_secrets: bool = False
    #: The coordinator answers leases asked ahead (``AcquireLease.ahead``).
    ahead: bool = False
    #: The coordinator reads ``RegisterReplica.like`` (a manifest as an earlier version's).
    register_like: bool = False


class HeartbeatAnswer(_Answer):
    epoch: str
    #: What the worker served since this coordinator started (None: an older coordinator).
    served_leases: Optional[int] = None
    served_bytes: Optional[int] = None
    #: Fetch reports the heartbeat carried that were recorded (None: an older coordinator,
    #: which ignores them: the client posts them to ``/v1/fetches`` instead).
    fetches: Optional[int] = None


class WorkerRemoved(_Answer):
    replicas_dropped: int


class VersionAnswer(_Answer):
    version: Optional[int]


class LayoutView(_Answer):
    num_shards: int
    complete: bool
    nbytes: int


class ReplicaView(_Answer):
    replica_id: str
    worker_id: str
    layout: str
    shard: int
    draining: bool
    suspect: bool
    #: "k/n" chunks held while still receiving (pipelined); None when complete.
    partial: Optional[str] = None

    @property
    def serving(self) -> bool:
        """Offered to new readers whole: not draining, suspect or partial."""
        return not self.draining and not self.suspect and self.partial is None


class VersionView(_Answer):
    """One version as the coordinator sees it now (``GET /v1/models/{m}/versions/{v}``)."""

    model: str
    version: int
    complete: bool
    layouts: dict[str, LayoutView]
    replicas: list[ReplicaView]

    def layout_complete(self, layout: str) -> bool:
        li = self.layouts.get(layout)
        return li is not None and li.complete


class ReplicaRegistered(_Answer):
    #: Empty when the request released leases and one had lapsed (nothing registered).
    replica_id: str
    complete: bool
    #: The leases the request released: lease id -> stayed valid (None: none asked, or an
    #: older coordinator).
    released: Optional[dict[str, bool]] = None


class Unpublished(_Answer):
    drained: bool
    open_leases: int


class ChunksHeld(_Answer):
    held: int


class Renewed(_Answer):
    ttl: float


class Released(_Answer):
    valid: bool
