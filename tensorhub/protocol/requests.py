"""What clients send the coordinator: one pydantic model per request body, and the
proof a same-host reader shows a holder (``lease_proof``)."""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated, Literal, Optional

from pydantic import BaseModel, Field, model_validator

from .base import (MAX_CHUNKS, MAX_SHARDS, MAX_TENSOR_BYTES, MAX_TENSORS, MAX_VERSION, Address, Ident,
                   ModelName, Name, Shard, Version, _Model)
from .manifest import AddressRuns, Locality, Manifest, VersionMeta


def lease_proof(secret: str, lease_id: str, replica_id: str, endpoint: str) -> str:
    """What a same-host reader sends a holder's fd server (``transport/_shm``) instead of
    any credential: HMAC-SHA256, keyed by the lease's secret (``LeaseGrant.secret``, hex),
    of ``"<lease_id>|<replica_id>|<holder endpoint>"``, hex. The holder cannot check it: it
    forwards it (``LeaseCovers``) and the coordinator, which keeps the secret, does; a
    proof opens only that replica of that holder, and only while the lease is valid."""
    return hmac.new(secret.encode(), f"{lease_id}|{replica_id}|{endpoint}".encode(), hashlib.sha256).hexdigest()


def _addresses_of(self: "RegisterReplica | ServeOffer") -> None:
    """``addresses`` or ``address_runs``: one of the two (an empty manifest has empty addresses)."""
    if self.address_runs is not None and self.addresses:
        raise ValueError("send addresses or address_runs, not both")


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


class _ShardCall(_Model):
    """A worker's call about one shard of a version's layout."""

    worker_id: Ident
    model: ModelName
    version: Version
    layout: Name = "hf"
    shard: Shard = 0


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


class RegisterReplica(_ShardCall):
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


class AcquireLease(_ShardCall):
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
    #: Subscribe ahead (``tensorhub.server.ahead``): a lease on the first complete version >=
    #: ``version``, held (``POST /v1/leases?wait=S``) until one is published; the reader is a
    #: member of its plan from the start. Needs ``request_id`` and ``pipelined``; its ``serve``
    #: offer names the destination by ``shape_digest`` (the version's checksums do not exist
    #: yet). Sent only to coordinators that said they answer it (``WorkerRegistered.ahead``).
    ahead: bool = False
    #: The reader assembles a version published as slices itself: for ``hf`` shard 0 of such
    #: a version that no assembled copy serves, the answer is a grant of layout ``hf.slices``
    #: (its ``num_shards``; no lease, no replicas) instead of the ``read_slices`` refusal.
    #: (Asked ahead, the refusal as before.) Sent only to coordinators that said they answer it
    #: (``WorkerRegistered.slices_grant``).
    slices: bool = False


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


# ---------------------------------------------------------------- fleet switch groups (``tensorhub.server.fleet``)
#: A fleet group's or member's id (in URL paths: no slash).
FLEET_ID = r"^[A-Za-z0-9._:@+=-]{1,256}$"


class FleetJoin(BaseModel):
    member: str = Field(pattern=FLEET_ID)
    model: str = Field(min_length=1, max_length=256)
    version: Optional[int] = Field(default=None, ge=0)  # what its engine runs now (None: not known)
    switch: Literal["auto", "caller"] = "auto"
    wait: float = Field(default=60.0, gt=0, le=86400)  # a round's deadline after it opened (auto) / was asked
    engine: Optional[str] = Field(default=None, max_length=512)  # what it drives (shown by status)


class FleetReady(BaseModel):
    member: str = Field(pattern=FLEET_ID)
    version: int = Field(ge=0)


class FleetApplied(BaseModel):
    member: str = Field(pattern=FLEET_ID)
    version: int = Field(ge=0)
    ok: bool
    error: Optional[str] = Field(default=None, max_length=2000)


class FleetSwitch(BaseModel):
    model: str = Field(min_length=1, max_length=256)
    version: int = Field(ge=0)
    wait: Optional[float] = Field(default=None, gt=0, le=86400)  # default: the group's
