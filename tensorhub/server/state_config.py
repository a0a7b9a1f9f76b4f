"""The coordinator state's timing knobs and policies (:class:`StateConfig`), read by the
state (``server.state``) and its lease decisions (``server.grants``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["StateConfig"]


@dataclass(frozen=True)
class StateConfig:
    """Timing knobs of the coordinator (seconds)."""

    #: How long a read lease stays valid without renewal.
    lease_ttl: float = 30.0
    #: A worker that has not heart-beaten for this long is dead; its replicas are dropped.
    worker_ttl: float = 10.0
    #: How long a replica reported as failing gets no new leases.
    suspect_ttl: float = 30.0
    #: How long a group's resolved version is remembered.
    group_ttl: float = 600.0
    #: Source-choice policy (``_planner.POLICIES``): ``topology``, or the benchmarks'
    #: ``single-source`` baseline.
    policy: str = "topology"
    #: Retention of metadata: a model keeps the manifests of its newest ``keep_versions``
    #: complete versions, of any newer version still being published, and of every version
    #: something still holds, reads or was told to read (a group's answer); older ones are
    #: retired (their numbers are never handed out again).
    keep_versions: int = 16
    #: A gap with no call at all longer than this (the coordinator was paused, e.g.
    #: SIGSTOP, or starved) gives every worker a fresh ``worker_ttl`` instead of expiring
    #: them all at once. None: ``worker_ttl / 2`` (the shell ticks every second or faster).
    pause_grace: Optional[float] = None
    #: Striped plans for pipelined readers where one source is scarce (``server.stripes``);
    #: False: the readers choose chunks among their sources by their chunk maps alone.
    plans: bool = True
    #: An allocated version that is not complete is a publish in progress (its ranks may not
    #: have registered anything yet): retention keeps it for this long after its allocation
    #: (on this incarnation's clock; one restored from the store counts from the restart),
    #: and for as long as anything names it; then it is abandoned and may be retired.
    abandon_after: float = 600.0

    @property
    def gap(self) -> float:
        return self.worker_ttl / 2 if self.pause_grace is None else self.pause_grace
