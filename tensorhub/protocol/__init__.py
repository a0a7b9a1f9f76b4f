"""Everything that crosses the coordinator's HTTP API, as validated pydantic models, and
the names and limits they use: what adapters and tools import to speak the protocol.

Nothing on the wire is pickled: requests and answers are JSON, checked by these models.

- ``base``: the limits (documented in the README, "Limits"), names, dtypes;
- ``layouts``: layout names with a meaning (deltas, sliced publishes);
- ``manifest``: a shard's manifest, its canonical JSON and digests, a version's meta;
- ``requests``: the request bodies; ``answers``: the coordinator's answers.
"""

from .answers import (ChunksHeld, Done, Error, Health, HeartbeatAnswer, Info, LayoutView, LeaseGrant, ModelEntry,
                      ModelList, Released, Renewed, ReplicaInfo, ReplicaRegistered, ReplicaView, Unpublished,
                      VersionAnswer, VersionSums, VersionView, WorkerRegistered, WorkerRemoved)
from .base import (API_VERSION, DTYPE_SIZES, MAX_BODY_BYTES, MAX_CHUNKS, MAX_DIMS, MAX_NAME_LEN, MAX_SHARDS,
                   MAX_TENSOR_BYTES, MAX_TENSORS, MAX_VERSION, Address, Ident, ModelName, Name, Shard, Version)
from .layouts import DELTA_PREFIX, SLICED, delta_layout, is_delta_layout
from .manifest import (MAX_META_BYTES, AddressRuns, Locality, Manifest, SliceSpec, TensorSpec, VersionMeta,
                       first_difference, keep_like, manifest_digest, manifest_json, parse_base, shape_digest)
from .requests import (FLEET_ID, AcquireLease, AllocateVersion, Bytes, FetchReport, FleetApplied, FleetJoin,
                       FleetReady, FleetSwitch, Heartbeat, LeaseCovers, ManifestLike, RegisterReplica, RegisterWorker,
                       Report, ReportChunks, Resolve, Seconds, ServeOffer, SwapReport, Unpublish, lease_proof)

__all__ = [
    # base
    "API_VERSION", "DTYPE_SIZES", "MAX_BODY_BYTES", "MAX_CHUNKS", "MAX_DIMS", "MAX_NAME_LEN", "MAX_SHARDS",
    "MAX_TENSOR_BYTES", "MAX_TENSORS", "MAX_VERSION", "Address", "Ident", "ModelName", "Name", "Shard", "Version",
    # layouts
    "DELTA_PREFIX", "SLICED", "delta_layout", "is_delta_layout",
    # manifest
    "MAX_META_BYTES", "AddressRuns", "Locality", "Manifest", "SliceSpec", "TensorSpec", "VersionMeta",
    "first_difference", "keep_like", "manifest_digest", "manifest_json", "parse_base", "shape_digest",
    # requests
    "AcquireLease", "AllocateVersion", "Bytes", "FetchReport", "Heartbeat", "LeaseCovers", "ManifestLike",
    "RegisterReplica", "RegisterWorker", "Report", "ReportChunks", "Resolve", "Seconds", "ServeOffer", "SwapReport",
    "Unpublish", "lease_proof", "FLEET_ID", "FleetJoin", "FleetReady", "FleetSwitch", "FleetApplied",
    # answers
    "ChunksHeld", "Done", "Error", "Health", "HeartbeatAnswer", "Info", "LayoutView", "LeaseGrant", "ModelEntry",
    "ModelList", "Released", "Renewed", "ReplicaInfo", "ReplicaRegistered", "ReplicaView", "Unpublished",
    "VersionAnswer", "VersionSums", "VersionView", "WorkerRegistered", "WorkerRemoved",
]
