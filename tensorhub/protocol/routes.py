"""The coordinator's routes in one table: method, path, request body, answer model, and the
rank of the call gate. The application (``tensorhub.coordinator``) registers its routes from
it, the gate (``tensorhub.server.asgi``) ranks calls by it, and the client (``tensorhub._client``)
spells its paths and reads its answers with it: a path or an answer is written once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

from .answers import (ChunksHeld, Done, Health, HeartbeatAnswer, Info, LeaseGrant, ModelList, Released, Renewed,
                      ReplicaRegistered, Unpublished, VersionAnswer, VersionView, WorkerRegistered, WorkerRemoved)
from .manifest import Manifest
from .requests import (AcquireLease, AllocateVersion, FetchReport, FleetApplied, FleetJoin, FleetReady, FleetSwitch,
                       Heartbeat, LeaseCovers, RegisterReplica, RegisterWorker, Report, ReportChunks, Resolve,
                       SwapReport, Unpublish)

__all__ = ["Route", "ROUTES", "gate_rank"]

_PARAM = re.compile(r"\{[a-z_]+\}")


@dataclass(frozen=True)
class Route:
    """One route. ``answer``: the model its answers are (None: a plain JSON object or list
    the caller reads as such, or not JSON); ``gate``: its rank at the call gate, lower
    first (None: not gated: heartbeats, renewals, releases, reports and long polls)."""

    method: str
    path: str
    body: Optional[type] = None
    answer: Optional[type] = None
    gate: Optional[int] = None

    def url(self, **params: Any) -> str:
        """The path with its parameters filled in (``{model}`` -> ``params["model"]``)."""
        return self.path.format(**params)

    @property
    def pattern(self) -> "re.Pattern[str]":
        """``"<METHOD> <path>"`` of any call of this route (each parameter one path segment)."""
        return re.compile(re.escape(f"{self.method} ") + _PARAM.sub("[^/]+", self.path.replace(".", r"\.")))


#: Every route of the coordinator, by the name the client's method has.
ROUTES: dict[str, Route] = {
    "healthz": Route("GET", "/healthz", None, Health),
    "info": Route("GET", "/v1/info", None, Info),
    "register_worker": Route("POST", "/v1/workers", RegisterWorker, WorkerRegistered),
    "heartbeat": Route("POST", "/v1/workers/{worker_id}/heartbeat", Heartbeat, HeartbeatAnswer),
    "remove_worker": Route("DELETE", "/v1/workers/{worker_id}", None, WorkerRemoved),
    "models": Route("GET", "/v1/models", None, ModelList, gate=4),
    # A reader's last call (release + complete registration: it becomes a source) and a
    # publisher's first go first; then leases and refreshes, manifests, resolves, the views.
    "allocate_version": Route("POST", "/v1/models/{model}/versions", AllocateVersion, VersionAnswer, gate=0),
    "latest": Route("GET", "/v1/models/{model}/latest", None, VersionAnswer),
    "resolve": Route("POST", "/v1/models/{model}/resolve", Resolve, VersionAnswer, gate=3),
    "register_replica": Route("POST", "/v1/replicas", RegisterReplica, ReplicaRegistered, gate=0),
    "version": Route("GET", "/v1/models/{model}/versions/{version}", None, VersionView, gate=4),
    "manifest": Route("GET", "/v1/models/{model}/versions/{version}/manifest", None, Manifest, gate=2),
    "unpublish": Route("POST", "/v1/models/{model}/versions/{version}/unpublish", Unpublish, Unpublished),
    "report_replica": Route("POST", "/v1/replicas/{replica_id}/report", Report, Done),
    "report_chunks": Route("POST", "/v1/replicas/{replica_id}/chunks", ReportChunks, ChunksHeld),
    "acquire_lease": Route("POST", "/v1/leases", AcquireLease, LeaseGrant, gate=1),
    "renew_lease": Route("POST", "/v1/leases/{lease_id}/renew", None, Renewed),
    "release_lease": Route("POST", "/v1/leases/{lease_id}/release", None, Released),
    "lease_covers": Route("POST", "/v1/leases/{lease_id}/covers", LeaseCovers, Released),
    "status": Route("GET", "/v1/status", gate=4),
    "report_fetch": Route("POST", "/v1/fetches", FetchReport, Done),
    "report_swap": Route("POST", "/v1/swaps", SwapReport, Done),
    "fleet_join": Route("POST", "/v1/fleets/{group}/join", FleetJoin),
    "fleet_ready": Route("POST", "/v1/fleets/{group}/ready", FleetReady),
    "fleet_switch": Route("POST", "/v1/fleets/{group}/switch", FleetSwitch),
    "fleet_round": Route("GET", "/v1/fleets/{group}/rounds/{version}"),
    "fleet_applied": Route("POST", "/v1/fleets/{group}/applied", FleetApplied),
    "fleet": Route("GET", "/v1/fleets/{group}"),
    "metrics": Route("GET", "/metrics"),
}

_GATED = tuple((r.pattern, r.gate) for r in ROUTES.values() if r.gate is not None)


def gate_rank(method: str, path: str) -> Optional[int]:
    """The gate's rank of a call (lower goes first), or None: not gated."""
    call = f"{method} {path}"
    for pattern, rank in _GATED:
        if pattern.fullmatch(call):
            return rank
    return None
