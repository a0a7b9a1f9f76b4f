"""Fleet switch groups: a group of engines switches to a version in two phases, never mixed.

``tensorhub follow --group G`` (one follow process per engine) and ``Hub.fleet_switch``.
A *round* per version ``v`` of the group's model:

1. **ready**: each member's follow process waits until its engine holds ``v`` (the
   engine's prefetch, off the critical path) and says so (``POST .../ready``);
2. **decision**: once every member in the group is ready -- or at the round's deadline --
   the coordinator fixes the round's ``go`` list (the ready members) and its ``left`` list
   (members of the group that were not ready: they leave the group for ``v``, said in
   every answer and counted in ``tensorhub_fleet_left``). With ``switch="caller"`` the
   round decides only after the caller asked for it (``Hub.fleet_switch``, at the step
   boundary the caller chose), the deadline counted from that call;
3. **apply**: each ``go`` member swaps its engine and reports the outcome
   (``POST .../applied``); the round is *done* when every ``go`` member reported (or
   ``apply_timeout`` passed: the silent ones leave the group as failed). A member whose
   apply failed (its engine rolled back) leaves the group too. ``Hub.fleet_switch``
   returns when the round is done: from then on every member in the group serves ``v``.

A member that left catches up on its own (its follow process swaps when its engine is
ready) and is back in the group from the next round it is ready for. Members refresh
themselves with every call (the follow loop calls at least every few seconds); one not
heard from for ``member_ttl`` is dropped. ``mixed`` (``tensorhub_fleet_mixed``) is the
alarm: members in the group reporting different versions outside a round's apply phase,
which the protocol never produces (e.g. an engine restarted on another version by hand).

Soft state on the coordinator that leads (not in its store): after a restart or a
failover the follow processes join again with their engines' versions (their next call
is answered ``unknown_fleet_member``) and the next round runs as usual.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .._exceptions import ConflictError, NotFoundError
from ..protocol import FLEET_ID, FleetApplied, FleetJoin, FleetReady, FleetSwitch

__all__ = ["FleetGroups", "FleetJoin", "FleetReady", "FleetApplied", "FleetSwitch", "add_routes",
           "MEMBER_TTL", "APPLY_TIMEOUT"]

#: Seconds a member may stay silent before it is dropped from its group.
MEMBER_TTL = 15.0
#: Seconds a round waits for its ``go`` members' outcomes before the silent ones leave as failed.
APPLY_TIMEOUT = 600.0

@dataclass
class _Member:
    id: str
    version: Optional[int]
    seen: float
    in_group: bool = True
    why_out: str = ""
    engine: Optional[str] = None


@dataclass
class _Round:
    version: int
    opened: float
    deadline: Optional[float]  # None: waits for the caller's switch
    ready: set = field(default_factory=set)
    decided: Optional[float] = None
    go: list = field(default_factory=list)
    left: list = field(default_factory=list)
    outcomes: dict = field(default_factory=dict)  # member -> (ok, error)
    done: Optional[float] = None

    def view(self) -> dict:
        state = "done" if self.done is not None else "apply" if self.decided is not None else "ready"
        return {"version": self.version, "state": state, "ready": sorted(self.ready), "go": list(self.go),
                "left": list(self.left),
                "applied": sorted(m for m, (ok, _) in self.outcomes.items() if ok),
                "failed": {m: err for m, (ok, err) in sorted(self.outcomes.items()) if not ok}}


@dataclass
class _Group:
    name: str
    model: str
    switch: str
    wait: float
    members: dict = field(default_factory=dict)
    rounds: dict = field(default_factory=dict)
    version: Optional[int] = None  # the version of the last round done
    left_total: int = 0
    failed_total: int = 0


class FleetGroups:
    """Every fleet group on this coordinator (thread-safe; ``clock`` in seconds)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, member_ttl: float = MEMBER_TTL,
                 apply_timeout: float = APPLY_TIMEOUT) -> None:
        self.clock, self.member_ttl, self.apply_timeout = clock, member_ttl, apply_timeout
        self.lock = threading.Lock()
        self.groups: dict[str, _Group] = {}

    # ------------------------------------------------------------ calls
    def join(self, group: str, req: FleetJoin) -> dict:
        """A member (re)joins with its engine's version; also its refresh. A member whose
        version is not the group's joins as out (catching up) until a round takes it in."""
        with self.lock:
            now = self._tick()
            g = self.groups.get(group)
            if g is None:
                g = self.groups[group] = _Group(group, req.model, req.switch, req.wait)
            elif g.model != req.model or g.switch != req.switch:
                raise ConflictError(f"fleet group {group!r} follows {g.model!r} with switch={g.switch!r}; "
                                    f"this member asked for {req.model!r} with switch={req.switch!r}",
                                    "fleet_mismatch")
            m = g.members.get(req.member)
            if m is None:
                if g.version is None and not any(x.in_group for x in g.members.values()):
                    g.version = req.version  # the first member sets where the group stands
                inside = req.version is not None and req.version == g.version
                m = g.members[req.member] = _Member(req.member, req.version, now, inside,
                                                    "" if inside else f"runs v{req.version}, the group v{g.version}",
                                                    req.engine)
            else:
                m.seen = now
                if not self._applying(g):  # (mid-apply the outcome, not a refresh, moves it)
                    m.version = req.version  # in the group and another version: counted as mixed
                    if not m.in_group and req.version is not None and req.version == g.version:
                        m.in_group, m.why_out = True, ""  # caught up with the group on its own
            return self._view(g, now)

    def ready(self, group: str, req: FleetReady) -> dict:
        with self.lock:
            now = self._tick()
            g, m = self._member(group, req.member, now)
            r = self._round(g, req.version, now)
            if r.decided is None:
                r.ready.add(m.id)
                self._decide_if_due(g, r, now)
            return r.view() | {"group": group}

    def switch(self, group: str, req: FleetSwitch) -> dict:
        """The caller asks round ``version`` to decide (now, if everyone is ready; else at
        ``wait`` from now)."""
        with self.lock:
            now = self._tick()
            g = self.groups.get(group)
            if g is None:
                raise NotFoundError(f"no fleet group {group!r} (no follow process joined it)", "unknown_fleet")
            if req.model != g.model:
                raise ConflictError(f"fleet group {group!r} follows {g.model!r}, not {req.model!r}", "fleet_mismatch")
            if g.version is not None and req.version <= g.version and req.version not in g.rounds:
                raise ConflictError(f"fleet group {group!r} already runs v{g.version}", "fleet_stale_version")
            r = self._round(g, req.version, now)
            if r.decided is None:
                deadline = now + (req.wait if req.wait is not None else g.wait)
                r.deadline = deadline if r.deadline is None else min(r.deadline, deadline)
                self._decide_if_due(g, r, now, asked=True)
            return r.view() | {"group": group}

    def round(self, group: str, version: int, member: Optional[str] = None) -> dict:
        with self.lock:
            now = self._tick()
            if member is not None:
                g, _ = self._member(group, member, now)
            else:
                g = self.groups.get(group)
                if g is None:
                    raise NotFoundError(f"no fleet group {group!r}", "unknown_fleet")
            r = g.rounds.get(version)
            if r is None:
                return {"group": group, "version": version, "state": "none", "ready": [], "go": [], "left": [],
                        "applied": [], "failed": {}}
            return r.view() | {"group": group}

    def applied(self, group: str, req: FleetApplied) -> dict:
        with self.lock:
            now = self._tick()
            g, m = self._member(group, req.member, now)
            r = g.rounds.get(req.version)
            if r is None or m.id not in r.go:
                raise ConflictError(f"{m.id} is not in round v{req.version} of fleet group {group!r}",
                                    "fleet_not_in_round")
            r.outcomes[m.id] = (req.ok, req.error)
            if req.ok:
                m.version, m.in_group, m.why_out = req.version, True, ""
            else:
                m.in_group, m.why_out = False, f"its swap to v{req.version} failed: {req.error or 'no reason given'}"
                g.failed_total += 1
            self._finish_if_done(g, r, now)
            return r.view() | {"group": group}

    def view(self, group: str) -> dict:
        with self.lock:
            now = self._tick()
            g = self.groups.get(group)
            if g is None:
                raise NotFoundError(f"no fleet group {group!r}", "unknown_fleet")
            return self._view(g, now)

    def views(self) -> list:
        with self.lock:
            now = self._tick()
            return [self._view(g, now) for _, g in sorted(self.groups.items())]

    # ------------------------------------------------------------ rules
    def _tick(self) -> float:
        """Drop silent members; decide rounds that are due; finish rounds past the apply
        timeout. Under the lock."""
        now = self.clock()
        for g in list(self.groups.values()):
            for mid in [k for k, m in g.members.items() if now - m.seen > self.member_ttl]:
                del g.members[mid]
            for r in g.rounds.values():
                if r.decided is None:
                    self._decide_if_due(g, r, now)
                elif r.done is None:
                    self._finish_if_done(g, r, now)
            if not g.members:
                del self.groups[g.name]
            else:  # keep the last few rounds' answers
                for v in sorted(g.rounds)[:-8]:
                    if g.rounds[v].done is not None:
                        del g.rounds[v]
        return now

    def _member(self, group: str, member: str, now: float) -> tuple[_Group, _Member]:
        g = self.groups.get(group)
        m = g.members.get(member) if g is not None else None
        if m is None:
            raise NotFoundError(f"{member} is not a member of fleet group {group!r} (join first; a coordinator "
                                "restart forgets the groups)", "unknown_fleet_member")
        m.seen = now
        return g, m

    def _round(self, g: _Group, version: int, now: float) -> _Round:
        r = g.rounds.get(version)
        if r is None:
            if g.version is not None and version <= g.version:
                raise ConflictError(f"fleet group {g.name!r} already runs v{g.version}; v{version} is not newer",
                                    "fleet_stale_version")
            r = g.rounds[version] = _Round(version, now, None if g.switch == "caller" else now + g.wait)
        return r

    def _applying(self, g: _Group) -> bool:
        return any(r.decided is not None and r.done is None for r in g.rounds.values())

    def _decide_if_due(self, g: _Group, r: _Round, now: float, asked: bool = False) -> None:
        if r.decided is not None or any(x.decided is not None and x.done is None for x in g.rounds.values()):
            return  # one round applies at a time
        if any(v < r.version and x.decided is None for v, x in g.rounds.items()):
            older = [v for v, x in g.rounds.items() if v < r.version and x.decided is None]
            for v in older:  # a newer version overtakes rounds not decided yet: nobody applies those
                g.rounds[v].decided = g.rounds[v].done = now
        inside = [m for m in g.members.values() if m.in_group]
        everyone = bool(inside) and all(m.id in r.ready for m in inside)
        waiting_for_caller = g.switch == "caller" and r.deadline is None
        if waiting_for_caller or not (everyone or (r.deadline is not None and now >= r.deadline)):
            return
        if not r.ready:  # nobody is ready: the round waits (the deadline moves on)
            if r.deadline is not None:
                r.deadline = now + g.wait
            return
        r.decided = now
        r.go = sorted(m for m in r.ready if m in g.members)
        r.left = sorted(m.id for m in inside if m.id not in r.ready)
        for mid in r.left:
            m = g.members[mid]
            m.in_group, m.why_out = False, f"not ready for v{r.version} by the round's deadline"
        g.left_total += len(r.left)
        self._finish_if_done(g, r, now)

    def _finish_if_done(self, g: _Group, r: _Round, now: float) -> None:
        if r.done is not None or r.decided is None:
            return
        silent = [m for m in r.go if m not in r.outcomes]
        if silent and now - r.decided < self.apply_timeout:
            return
        for mid in silent:
            r.outcomes[mid] = (False, f"no outcome within {self.apply_timeout:.0f}s")
            if mid in g.members:
                g.members[mid].in_group = False
                g.members[mid].why_out = f"its swap to v{r.version} never reported"
            g.failed_total += 1
        r.done = now
        if any(ok for ok, _ in r.outcomes.values()):
            g.version = r.version

    def _view(self, g: _Group, now: float) -> dict:
        inside = [m for m in g.members.values() if m.in_group]
        mixed = not self._applying(g) and len({m.version for m in inside}) > 1
        return {"group": g.name, "model": g.model, "switch": g.switch, "wait": g.wait, "version": g.version,
                "mixed": mixed, "left_total": g.left_total, "failed_total": g.failed_total,
                "members": [{"member": m.id, "engine": m.engine, "version": m.version, "in_group": m.in_group, "why_out": m.why_out,
                             "seen_s_ago": round(now - m.seen, 3)} for _, m in sorted(g.members.items())],
                "rounds": [r.view() for _, r in sorted(g.rounds.items())]}

    # ------------------------------------------------------------ metrics
    def collector(self) -> Any:
        """A Prometheus collector: ``tensorhub_fleet_mixed``, ``tensorhub_fleet_members``,
        ``tensorhub_fleet_left`` and ``tensorhub_fleet_failed`` by group."""
        fleets = self

        class _Collector:
            def describe(self) -> list:
                return []

            def collect(self) -> Any:
                from prometheus_client.core import GaugeMetricFamily

                mixed = GaugeMetricFamily("tensorhub_fleet_mixed", "1 when members in a fleet group run different "
                                          "versions outside a switch (the alarm), else 0.", labels=["group"])
                members = GaugeMetricFamily("tensorhub_fleet_members", "Members of a fleet group, in it or out "
                                            "(catching up).", labels=["group", "state"])
                left = GaugeMetricFamily("tensorhub_fleet_left", "Members that left a fleet group because they "
                                         "were not ready in time (since the coordinator started).", labels=["group"])
                failed = GaugeMetricFamily("tensorhub_fleet_failed", "Swaps of a fleet group's members that failed "
                                           "(since the coordinator started).", labels=["group"])
                for v in fleets.views():
                    mixed.add_metric([v["group"]], 1 if v["mixed"] else 0)
                    inside = sum(1 for m in v["members"] if m["in_group"])
                    members.add_metric([v["group"], "in"], inside)
                    members.add_metric([v["group"], "out"], len(v["members"]) - inside)
                    left.add_metric([v["group"]], v["left_total"])
                    failed.add_metric([v["group"]], v["failed_total"])
                return [mixed, members, left, failed]

        return _Collector()


def add_routes(fleets: FleetGroups, on: Callable[[str], Any]) -> None:
    """The fleet routes (``/v1/fleets/...``), each registered by ``on(route name)``."""
    from fastapi import Path, Query

    gid = Path(pattern=FLEET_ID)

    @on("fleet_join")
    def fleet_join(req: FleetJoin, group: str = gid) -> dict:
        """A follow process joins (or refreshes) its engine in a fleet group."""
        return fleets.join(group, req)

    @on("fleet_ready")
    def fleet_ready(req: FleetReady, group: str = gid) -> dict:
        """A member's engine holds the version (prefetched): ready to apply."""
        return fleets.ready(group, req)

    @on("fleet_switch")
    def fleet_switch(req: FleetSwitch, group: str = gid) -> dict:
        """The caller asks the group to switch to a version (two phases; see ``Hub.fleet_switch``)."""
        return fleets.switch(group, req)

    @on("fleet_round")
    def fleet_round(group: str = gid, version: int = Path(ge=0),
                    member: Optional[str] = Query(default=None, pattern=FLEET_ID)) -> dict:
        """A round's state: ready, apply (its go and left lists fixed) or done."""
        return fleets.round(group, version, member)

    @on("fleet_applied")
    def fleet_applied(req: FleetApplied, group: str = gid) -> dict:
        """A go member's swap outcome."""
        return fleets.applied(group, req)

    @on("fleet")
    def fleet_view(group: str = gid) -> dict:
        """A fleet group: members (version, in or out and why), rounds, mixed, counts."""
        return fleets.view(group)
