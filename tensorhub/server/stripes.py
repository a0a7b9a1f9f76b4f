"""Striped distribution trees: which source a pipelined reader reads each chunk from, fixed
by the coordinator when it grants the lease (issue 13), not negotiated chunk by chunk.

Why: with chunk maps (``_chunkmap``) the coordinator no longer hears which chunks a
receiving reader holds, so it can no longer split a scarce complete source (the
publisher's uplink, or the copy that crossed into a datacenter) between the readers by
reservations. Readers racing for the same chunks made the publisher send each chunk to
several of them (3-10x the version at 128-1,024 GPUs in ``benchmarks/simulate.py``) and
left the readers' own uplinks half idle. A plan fixed at the grant makes every reader's
uplink carry about one version and the root's exactly one, with no per-chunk messages.

The plan (SplitStream-like), one per (model, version, layout, shard, datacenter, root):

* the shard's chunks are dealt into ``stripes`` (D) stripes, chunk ``c`` in stripe
  ``c % D``;
* members are the serving pipelined readers of the shard in that datacenter, in the
  order they asked (their *arrival index* a); member a is *interior* in stripe ``a % D``
  and a *leaf* in the others (with fewer than D members, member ``s % members`` is
  interior in stripe s too);
* in stripe s the interior members form a D-ary tree in arrival order (the first one
  reads the stripe from the root, the j-th from interior ``(j - 1) // D``) -- when the
  members' hosts are known, a tree of hosts (``_interior``): one interior member per host
  reads the stripe over the network, its host-mates read it from that one, and a host's
  D child hosts are served by all its interior members of the stripe; every leaf of
  stripe s then hangs under an interior member of s *on its own host* if there is one
  (the one with the fewest such children; read over NVLink / memory, off the network), else
  under the interior member of s with the fewest children over the network (ties: the
  later one, deeper in the tree). Each member thus sends at most about D children 1/D of
  the version each over the network (one version in all), the root sends every stripe
  once, and a chunk travels about ``log_D(members / D) + 2`` hops;

  Why hosts count (issue 13): with 8 GPUs of a node in one plan, a node's 6 leaves of a
  stripe were spread over other nodes' interior members, so every interior NIC uplink
  carried exactly its stripe's rate to 4 children: no slack, and any late chunk made the
  lag grow hop by hop (``benchmarks/simulate.py`` at 128-1,024 GPUs: a tail of 0.07-0.12 s
  after the publisher's last chunk). Reading a stripe from a host-mate leaves every
  interior uplink with at most D / 2 network children (8 GPUs to a node: 2 interior
  members per host and stripe), room to catch up, and a host-mate's hop takes a fraction
  of a millisecond;
* the *root* is the datacenter's one complete replica (the publisher), or, when the
  datacenter has none, its seeder's partial replica (the one reader that crosses the
  slow link, ``_planner.choose_sources``).

Across datacenters (issue 13: 4 datacenters took 1.83x the bound in
``benchmarks/simulate.py``): the seeders of the datacenters that have no complete replica
form one more plan, scope :data:`WAN`, rooted at the one complete replica elsewhere (the
publisher), with one stripe per such datacenter (:func:`wan_stripes`). Each seeder takes
its own stripe over the link from the publisher's datacenter and every other stripe from
the seeder that carries it, over the link between their datacenters: with D of them, every
slow link carries 1/D of the version instead of the publisher's links carrying all of it.
The root's stripes are not read from the publisher itself when its datacenter has a plan
of its own (:func:`relayed`): the member of that plan that carries the stripe first hands
it on, so the publisher's uplink still sends the version once (sending it once more to the
other datacenters made it the bottleneck: 1.5x the bound at 4 datacenters).

The layout needs the members, so a plan *forms* for ``window`` seconds after its first
member joined: meanwhile member a < D reads its own stripe from the root (so the root
sends from the first moment, and sends each stripe once) and the other stripes from the
first members that carry them (asking once more after ``EARLY`` for those that had not
come yet: up to two refreshes for these four), and a later member reads its
own stripe from its interior parent and the other stripes from their least loaded
interior member so far (earlier members only); every member is told to ask again (its
one lease refresh) when the window closes and then gets its parents from the fixed,
balanced layout (chunks already read stay read). Readers that join after that (late: the
coordinator served their lease after the window, e.g. most of a large fleet, or an engine
restarted mid-distribution) become **carriers at the bottom of the tree** (issue 31): each
carries the stripe with the fewest free child slots (``CARRIER_CHILDREN`` per carrier), hangs
in it under its parent in the stripe's D-ary heap of carriers (the layout's interior members
first, then late carriers in arrival order: depth log_D) and is a leaf of every other stripe
under the carrier of it with the fewest children. ``benchmarks/simulate.py``, 1,024 GPUs, 59
readers in the plan: 7.50x the bound instead of 23.2x with late joiners as leaves, whose
parents' uplinks carried tens of versions; a carrier that got leaves before it got its heap
children sends up to 7 children a stripe each (1.75 versions). What is left is the leases'
arrival: the coordinator answers the last of 1,024 leases 1.3 s after the first (subscribing
ahead, issue 31 item 1, is the cure). A late joiner's parents all arrived before it, so none
is its descendant.

A parent a reader reported failing (``AcquireLease.exclude``) is replaced on that
refresh by the next interior member of the stripe with the fewest children, or the
root. Which chunks a parent holds the reader still learns from the parent's chunk map,
so the plan decides *where from*, never *whether*: nobody reads a chunk that is not
complete on its source (``_pipeline``'s invariant stands unchanged).

Pure: no I/O and no clock of its own; the coordinator (``server.state``) and the simulation
(``benchmarks/simulate.py``) call the same code.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

__all__ = ["HOSTS_IN_PLANS", "STRIPES", "WINDOW", "MIN_CHUNKS", "NONE", "WAN", "Plan", "stripe_of", "layout", "plan_root", "wan_root",
           "wan_stripes", "relayed"]

#: Stripes per shard (the tree fan-out, too).
STRIPES = 4
#: Seconds a plan forms before its layout is fixed. Readers of one version ask within a
#: few ms of each other on a quiet host, tens of ms on a loaded one; the window costs the
#: root nothing (the first D members keep its uplink busy meanwhile).
WINDOW = 0.05
#: While a plan forms, one of the first D members that misses carriers of other stripes
#: asks again after this long (once), to read those stripes from them.
EARLY = 0.01
#: Shards of fewer chunks get no plan (too small to pipeline through a tree).
MIN_CHUNKS = 32
#: Children a carrier takes over the network in its stripe before a late joiner is placed
#: under a less loaded one (a carrier sends its stripe, 1/D of the version, to each child:
#: D of them make one version).
CARRIER_CHILDREN = STRIPES
#: Lay plans out by host (host-mates under each other, ``_interior``) only where a same-host
#: path exists for partial replicas (issue 31 item 4). None exists yet: the memfd path
#: (``transport/_shm``) copies complete replicas in Hub memory only, and CUDA IPC is not
#: written, so a host-mate's partial replica is read through Mooncake -- through the interior
#: member's NIC, which then carries its network children *and* its host-mates.
#: ``benchmarks/simulate.py`` (subscribed ahead, same-host reads over the NIC): 1.76x / 1.97x /
#: 2.90x the bound at 64 / 256 / 1,024 GPUs with hosts in plans, 1.33x / 1.58x / 2.55x without.
HOSTS_IN_PLANS = False
#: "no parent (yet)" in a parents list.
NONE = ""
#: The scope of a plan across datacenters (its members: the datacenters' seeders).
WAN = "*"


def stripe_of(chunk: int, stripes: int) -> int:
    return chunk % stripes


def _same_host(hosts: Sequence[Optional[str]], a: int, b: int) -> bool:
    return hosts[a] is not None and hosts[a] == hosts[b]


def layout(members: int, stripes: int, hosts: Optional[Sequence[Optional[str]]] = None) -> list[list[int]]:
    """Parent of each member in each stripe, by arrival index (-1: the root). ``hosts``:
    each member's host (None: unknown); a leaf reads a stripe from an interior member on
    its own host when there is one (the module docstring says why)."""
    d = max(1, stripes)
    out = [[-1] * d for _ in range(members)]
    for s in range(d):
        # (fewer members than stripes: member s % members carries stripe s too)
        inner = list(range(s, members, d)) or ([s % members] if members else [])
        if not inner:
            continue
        kids = {m: 0 for m in inner}  # children over the network
        for m, p in _interior(inner, hosts, d).items():
            out[m][s] = p
            if p >= 0 and not (hosts is not None and _same_host(hosts, p, m)):
                kids[p] += 1
        local: dict[str, list[int]] = {}
        if hosts is not None:
            for m in inner:
                if hosts[m] is not None:
                    local.setdefault(hosts[m], []).append(m)
        near = {m: 0 for m in inner}
        # the interior members by (children, -index): the fewest children, ties the later
        # (a heap: a scan per leaf made the layout quadratic in the members, ~0.15 s of the
        # publish's call at 1,024 subscribers)
        least = [(k, -m) for m, k in kids.items()]
        heapq.heapify(least)
        for m in range(members):
            if m in kids:
                continue
            mates = local.get(hosts[m]) if hosts is not None and hosts[m] is not None else None
            if mates:  # a host-mate carries the stripe: read it there, off the network
                p = min(reversed(mates), key=lambda x: near[x])
                near[p] += 1
            else:
                _, neg = heapq.heappop(least)
                p = -neg
                kids[p] += 1
                heapq.heappush(least, (kids[p], neg))
            out[m][s] = p
    return out


def _interior(inner: list[int], hosts: Optional[Sequence[Optional[str]]], d: int) -> dict[int, int]:
    """One stripe's tree over its interior members (arrival order): the parent of each (-1:
    the root). Grouped by host (a member of unknown host is a group of its own), the
    groups form a D-ary tree in order of their first member (the k-th group under group
    ``(k - 1) // D``); a group's first member reads the stripe over the network from the
    member of its parent group with the fewest network children so far (ties: the earlier)
    that arrived before it, the group's other members read it from that first one on
    their host. So a host's D child hosts are served by all its interior members of the
    stripe (with 2 of them, 2 network children each: half their uplink), and every parent
    arrived before its child (a replacement that arrived earlier is never a descendant).
    With one member per host (or hosts unknown): member j under member ``(j - 1) // D``."""
    groups: dict[object, list[int]] = {}
    for m in inner:
        h = hosts[m] if hosts is not None and hosts[m] is not None else ("", m)
        groups.setdefault(h, []).append(m)
    order = list(groups.values())
    par: dict[int, int] = {}
    sends = {m: 0 for m in inner}
    for k, g in enumerate(order):
        head = g[0]
        if k == 0:
            par[head] = -1
        else:
            up = [x for x in order[(k - 1) // d] if x < head]
            p = min(up, key=lambda x: (sends[x], x))
            par[head] = p
            sends[p] += 1
        for m in g[1:]:
            par[m] = head
    return par


@dataclass
class Plan:
    """One plan (see the module docstring). ``members``: worker ids in arrival order
    (``order``: worker id -> that index); ``replicas``: worker id -> its partial replica id
    (``member_of``: a member's replica id -> its index)."""

    root: str
    stripes: int
    opened: float
    window: float = WINDOW
    members: list[str] = field(default_factory=list)
    order: dict[str, int] = field(default_factory=dict)
    replicas: dict[str, str] = field(default_factory=dict)
    member_of: dict[str, int] = field(default_factory=dict)
    hosts: list = field(default_factory=list)  # each member's host (None: unknown)
    fixed: Optional[list[list[int]]] = None  # the layout, once the window closed
    kids: dict[tuple[int, int], int] = field(default_factory=dict)  # (member, stripe) -> network children
    late: dict[str, list[str]] = field(default_factory=dict)  # late joiners' parents (replica ids)
    #: Per stripe, the members that carry it (arrival indices, in arrival order): the
    #: layout's interior members, then late joiners, each of which carries one stripe.
    carriers: list[list[int]] = field(default_factory=list)
    n_fixed: int = 0  # members when the layout was fixed (later ones are late joiners)
    _free: list[int] = field(default_factory=list)  # per stripe, child slots left under the cap
    _carries: dict[int, tuple[int, int]] = field(default_factory=dict)  # late carrier -> (stripe, position)
    last_used: float = 0.0
    #: While forming: each member's provisional parents (arrival indices, -1 the root, None
    #: none), and per stripe a heap of (children, -index) of its interior members so far.
    prov: list[list[Optional[int]]] = field(default_factory=list)
    _heaps: list[list[tuple[int, int]]] = field(default_factory=list)
    _pk: dict[tuple[int, int], int] = field(default_factory=dict)  # provisional children
    _early: set = field(default_factory=set)  # first members told to ask again early

    @property
    def closes(self) -> float:
        return self.opened + self.window

    def join(self, worker: str, replica_id: str, now: float, host: Optional[str] = None) -> None:
        self.last_used = now
        if worker in self.replicas or worker in self.late:
            return
        if self.fixed is None and now < self.closes:
            self.order[worker] = len(self.members)
            self.member_of[replica_id] = len(self.members)
            self.members.append(worker)
            self.hosts.append(host if host else None)  # ("": a worker without a host label: unknown)
            self.replicas[worker] = replica_id
            self._provisional(len(self.members) - 1)
        else:  # a late joiner: a carrier at the bottom of the stripe that needs one most
            self._fix()
            a = len(self.members)
            self.order[worker] = a
            self.member_of[replica_id] = a
            self.members.append(worker)
            self.hosts.append(host if host else None)
            self.replicas[worker] = replica_id
            self.late[worker] = [NONE] * self.stripes
            s = min(range(self.stripes), key=lambda x: (self._free[x], x))
            self._carries[a] = (s, len(self.carriers[s]))
            self.carriers[s].append(a)
            self._free[s] += CARRIER_CHILDREN

    def _provisional(self, a: int) -> None:
        """Parents of the newest member while the plan forms: members 0..D-1 read their own
        stripe from the root (so the root sends every stripe once) and nothing else yet;
        a later member reads its own stripe from its interior parent (as in the layout)
        and each other stripe from that stripe's interior member with the fewest children
        so far -- earlier members only, so nobody waits on a reader below it."""
        d = self.stripes
        if not self._heaps:
            self._heaps = [[] for _ in range(d)]
        own = a % d
        row: list[Optional[int]] = [None] * d
        j = a // d
        row[own] = -1 if j == 0 else ((j - 1) // d) * d + own
        if a >= d:
            for s in range(d):
                if s != own:
                    row[s] = self._least(s)
        for s, p in enumerate(row):
            if p is not None and p >= 0:
                self._pk[(p, s)] = self._pk.get((p, s), 0) + 1
                heapq.heappush(self._heaps[s], (self._pk[(p, s)], -p))
        heapq.heappush(self._heaps[own], (0, -a))
        self.prov.append(row)

    def _least(self, s: int) -> int:
        """The interior member of stripe ``s`` with the fewest provisional children (ties:
        the later one); its heap holds stale counts, skipped."""
        h = self._heaps[s]
        while True:
            n, neg = h[0]
            if self._pk.get((-neg, s), 0) == n:
                return -neg
            heapq.heappop(h)

    def fix(self) -> None:
        """Fix the layout now (subscribers bound at the publish, ``server.ahead``: every member
        is known, so nobody waits for the window)."""
        self._fix()

    def _fix(self) -> None:
        if self.fixed is None:
            n, d = len(self.members), self.stripes
            self.fixed = layout(n, d, self.hosts)
            self.n_fixed = n
            for m, row in enumerate(self.fixed):
                for s, p in enumerate(row):
                    if p >= 0 and not _same_host(self.hosts, p, m):  # (children over the network)
                        self.kids[(p, s)] = self.kids.get((p, s), 0) + 1
            self.carriers = [list(range(s, n, d)) or ([s % n] if n else []) for s in range(d)]  # (as ``layout``)
            self._free = [sum(max(0, CARRIER_CHILDREN - self.kids.get((m, s), 0)) for m in c)
                          for s, c in enumerate(self.carriers)]

    def _rid(self, member: int) -> str:
        return self.root if member < 0 else self.replicas[self.members[member]]

    def parents(self, worker: str, now: float, bad: Callable[[str], bool] = lambda rid: False
                ) -> tuple[list[str], float]:
        """``worker``'s parent replica per stripe (``NONE``: read that stripe from nobody
        yet) and, while the plan forms, when to ask again (0: the plan is fixed).
        ``bad(replica_id)``: that replica failed, is gone or was reported by the reader
        (replaced; never handed out)."""
        self.last_used = now
        if self.fixed is None and now < self.closes:
            a, d = self.order[worker], self.stripes
            again = self.closes
            if a < d:  # the root for its own stripe, the first members for theirs (as they come)
                row = [self.root if s == a else self._rid(s) if s < len(self.members) else NONE for s in range(d)]
                if NONE in row and worker not in self._early:
                    self._early.add(worker)  # once: ask again soon, for the carriers still to come
                    again = min(self.closes, now + EARLY)
            else:
                row = [NONE if p is None else self._rid(p) for p in self.prov[a]]
            return [NONE if x != NONE and bad(x) else x for x in row], again
        self._fix()
        assert self.fixed is not None
        if worker in self.late:  # parents that arrived before it: never its own descendants
            row, a = self.late[worker], self.order[worker]
            for s in range(self.stripes):
                if row[s] == NONE or bad(row[s]):
                    row[s] = self._place(s, a, bad)
            return list(row), 0.0
        a = self.order[worker]
        row = [self._rid(p) for p in self.fixed[a]]
        for s in range(self.stripes):
            if row[s] != NONE and bad(row[s]):
                # (an interior member adopts only an earlier one: never its own descendant)
                new = self._adopt(s, bad, exclude=a, before=a if a % self.stripes == s else None)
                row[s] = new
                if new == NONE:
                    continue  # (nobody left to read that stripe from: the reader's fallback)
                old = self.fixed[a][s]
                if old >= 0 and not _same_host(self.hosts, old, a):  # (network children only)
                    self.kids[(old, s)] = max(0, self.kids.get((old, s), 1) - 1)
                self.fixed[a][s] = -1 if new == self.root else self.member_of[new]
        return row, 0.0

    def _place(self, s: int, a: int, bad: Callable[[str], bool]) -> str:
        """Late joiner ``a``'s parent in stripe ``s``. If ``a`` carries ``s``: its parent in
        the stripe's D-ary heap of carriers (the carrier at position ``(i - 1) // D`` of
        :attr:`carriers`, arrival order; the layout's interior members come first, so the
        tree keeps growing level by level: depth log_D of the readers), else, if that one
        failed, the earliest carrier alive. If ``a`` is a leaf of ``s``: the carrier of ``s``
        with the fewest network children (ties: the later). Only carriers that arrived
        before ``a`` (never its descendants); the root when there is none (NONE if it
        failed too)."""
        best: Optional[tuple[int, int]] = None
        c = self.carriers[s]
        own = self._carries.get(a)
        if own is not None and own[0] == s and own[1] > 0:
            i = own[1]
            for j in ((i - 1) // self.stripes, *range(i)):
                p = c[j]
                if not bad(self._rid(p)):
                    best = (self.kids.get((p, s), 0), p)
                    break
        else:
            for m in c:
                if m >= a:
                    break
                k = self.kids.get((m, s), 0)
                if (best is None or k <= best[0]) and not bad(self._rid(m)):
                    best = (k, m)
        if best is None:
            return NONE if bad(self.root) else self.root
        k, p = best
        self.kids[(p, s)] = k + 1
        if k < CARRIER_CHILDREN:
            self._free[s] -= 1
        return self._rid(p)

    def _adopt(self, s: int, bad: Callable[[str], bool], exclude: Optional[int] = None, before: Optional[int] = None) -> str:
        """A parent in stripe ``s`` for a late or orphaned reader: the interior member of
        ``s`` (arrived before ``before``, if given) with the fewest children, else the
        root (NONE if that failed too)."""
        n = self.n_fixed
        end = n if before is None else min(n, before)
        carriers = range(s, end, self.stripes) if s < n else [s % n] if n and s % n < end else []
        inner = [m for m in carriers if m != exclude and not bad(self._rid(m))]
        if not inner:
            return NONE if bad(self.root) else self.root
        p = min(reversed(inner), key=lambda m: self.kids.get((m, s), 0))
        self.kids[(p, s)] = self.kids.get((p, s), 0) + 1
        return self._rid(p)

    def relay(self, stripe: int, bad: Callable[[str], bool] = lambda rid: False) -> Optional[str]:
        """The member that receives stripe ``stripe % stripes`` first (the earliest interior
        member of it that has not failed), or None: who hands that stripe on to another
        datacenter instead of the root (:func:`relayed`)."""
        t, n = stripe % self.stripes, (self.n_fixed if self.fixed is not None else len(self.members))
        for m in range(t, n, self.stripes) if t < n else [t % n] if n else []:  # (as ``layout``)
            rid = self._rid(m)
            if not bad(rid):
                return rid
        return None


def plan_root(reader, reader_id: str, cands, seeder_replica: Optional[str]) -> Optional[str]:
    """The root of a plan for a reader at locality ``reader``, or None (no plan: the usual
    choice, ``_planner.choose_sources``). ``cands``: the shard's serving replicas (as
    ``_planner.Candidate``); ``seeder_replica``: the partial replica of its datacenter's
    live seeder, if another reader is that. A plan only where one source is scarce: the
    datacenter has exactly one complete replica, not on the reader's host (a same-host
    copy is read at memory speed), or none and a seeder bringing the version in."""
    complete = [c for c in cands if c.complete and c.worker_id != reader_id
                and c.locality.datacenter == reader.datacenter]
    if any(c.locality.host == reader.host for c in complete):
        return None
    if len(complete) == 1:
        return complete[0].replica_id
    if not complete and seeder_replica is not None:
        return seeder_replica
    return None


def wan_root(reader, reader_id: str, cands) -> Optional[str]:
    """The root of a plan across datacenters (scope :data:`WAN`) for a reader about to seed
    its datacenter (no live seeder there but itself), or None. Only where the version is
    scarce: no complete replica in the reader's datacenter and exactly one anywhere else
    (the publisher, before any reader completed)."""
    complete = [c for c in cands if c.complete and c.worker_id != reader_id]
    if len(complete) != 1 or complete[0].locality.datacenter == reader.datacenter:
        return None
    return complete[0].replica_id


def wan_stripes(datacenters, root_datacenter: str) -> int:
    """Stripes of a plan across datacenters: one per datacenter that will seed (those with
    workers, but the root's), so each seeder carries one. Under 2 the coordinator makes no
    such plan: with one datacenter to seed there is nothing to stripe between, and its
    seeder reads best from several sources at once (``_planner.choose_sources``: 1.06x the
    bound at 2 datacenters in ``benchmarks/simulate.py``, 1.13x by a one-stripe plan)."""
    return max(1, len(set(datacenters) - {root_datacenter}))


def relayed(row: Sequence[str], root: str, origin: Optional[Plan],
            bad: Callable[[str], bool] = lambda rid: False) -> list[str]:
    """A plan across datacenters' parents per stripe with the root replaced, stripe by
    stripe, by the member of the root's own datacenter plan (``origin``) that receives that
    stripe first (:meth:`Plan.relay`; the root where there is none). That member receives
    every other stripe too, a hop or two later, well ahead of a slow link. Why: the
    publisher then sends the version once, to its own datacenter, and its readers hand it
    across (module docstring)."""
    if origin is None:
        return list(row)
    return [(origin.relay(s, bad) or root) if x == root else x for s, x in enumerate(row)]
