"""What the coordinator answers: the lease grant (sources, plan, sums) and the answers
read by attribute (``_Answer``: fields a newer coordinator adds are ignored)."""

from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, RootModel, model_serializer

from .base import _Model
from .manifest import AddressRuns, Locality, Manifest, VersionMeta

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
    #: A striped plan (``tensorhub.server.stripes``): chunk ``c`` is read from the replica
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
    #: The coordinator answers ``AcquireLease.slices`` (a grant that says the version is
    #: laid out as slices).
    slices_grant: bool = False
    #: How long a replica a reader reported stays suspect (no new leases name it); readers
    #: let a source they failed as hung back in after it. None: an older coordinator.
    suspect_ttl: Optional[float] = None


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


class Health(_Answer):
    """``GET /healthz``: alive, and the role (``leader``, or ``follower`` with the leader's
    URL, ``null`` while an election runs); ``url``: this coordinator's own (etcd HA only)."""

    ok: bool
    epoch: Optional[str]
    role: str
    leader: Optional[str]
    url: Optional[str] = None


class Info(_Answer):
    """``GET /v1/info``: the coordinator's epoch, wall-clock time and timing settings."""

    epoch: str
    time: float
    lease_ttl: float
    worker_ttl: float
    suspect_ttl: float
    max_body_bytes: int


class ModelEntry(_Answer):
    model: str
    #: The last version number allocated.
    counter: int
    #: The newest complete version (None: none yet).
    latest: Optional[int]


class ModelList(RootModel[list[ModelEntry]]):
    """``GET /v1/models``: every model the coordinator knows, by name."""


class Done(_Answer):
    """An answer that says only that the call was taken (reports): ``{}``."""
