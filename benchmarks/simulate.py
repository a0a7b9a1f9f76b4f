"""Flow-level simulation of weight distribution at scale, driving TensorHub's own planner.

The readers here follow the client's pipelined read loop (``tensorhub._pipeline``) and the
coordinator's choices come from the same functions it calls (``tensorhub._planner``:
``choose_sources`` for cost/load ordering, striping, partial replicas and cross-datacenter
seeding; ``pick_chunk`` for which chunk to read from which source; ``chunk_order``,
``start_fraction``, ``start_reverse`` for where concurrent readers start). Only the network
is modelled:

* every GPU is a worker with its own NIC (``--nic-gbps`` up and down, default 400) and
  NVLink to the GPUs of its node (``--nvlink-gbps``); a node has 8 GPUs; nodes are grouped
  16 to a zone; the fabric inside a datacenter is non-blocking;
* between two datacenters one link per direction (``--wan-gbps``);
* a flow (one chunk read) runs at the equal share of its tightest link (each link's
  capacity split evenly among the flows crossing it): a conservative stand-in for max-min
  fairness; time advances from chunk completion to chunk completion;
* the control loop, ``--protocol``:

  - ``chunkmap`` (default; what the client does now, :class:`MapSim`): one lease per
    reader that also registers its partial replica (the coordinator never learns which
    chunks it holds); where one source is scarce the lease carries a striped plan
    (``tensorhub._stripes``, the coordinator's own code: which replica to read each
    stripe from; the layout fixed 50 ms after the first reader, each reader's one
    refresh then; ``--no-plans``: without); a reader learns what a partial source holds
    from its chunk map, read
    one-sided (``--rtt-us`` per read) whenever the source has a free slot, at most every
    10 ms (2 ms for a plan's parents); one refresh of the lease (under a plan: when its
    layout is fixed; else at the first loop turn 100 ms after the start; more only with no
    source or after a 0.5 s stall); the reader loop's sleeps (0.25 ms doubling to 2 ms
    with reads in flight or under a plan, to 25 ms without; under a plan a map answer is
    used in the turn it arrives, and the loop wakes 0.25 ms after a map read); one
    release+register at the end.
    Calls per reader (resolve, manifest, lease, refreshes, release) are printed;
  - ``reports`` (the loop before chunk maps, for comparison): readers report completed
    chunks every ``--report-ms`` and refresh their sources when idle every
    ``--refresh-ms`` (twice that when busy), 50 ms / 100 ms, and the coordinator reserves
    a scarce source's chunks for readers near each other.

Workloads (1,024 GPUs on 128 nodes in 1-4 datacenters by default):

* ``standalone``: a trainer publishes; every GPU fetches the new version.
* ``elastic``: 7/8 of the GPUs already serve the version; 1/8 join and fetch it.
* ``crossdc``: the trainer is in datacenter 0; GPUs are spread over D datacenters (with
  D > 2 the seeders of the others read by one plan across datacenters, scope
  ``tensorhub._stripes.WAN``, the trainer's stripes relayed by datacenter 0's readers).

Compared with: single-source (the planner's ``single-source`` policy, simulated), ring
broadcast (NCCL style, pipelined, analytic), push-then-pull through storage (analytic),
and the lower bound (bytes / bottleneck bandwidth). ``--validate out/bench_fanout.json``
runs the model at the testbed's size (N <= 8, 1 Gbit/s links) and prints its error against
the measurement; where the file carries each round's CPU (``bench_topology.py fanout``), the
testbed's shared cores become one more link every flow crosses (:func:`cpu_rate`,
leave-one-out from the file's other rows).

    python benchmarks/simulate.py                       # the three workloads at 1,024 GPUs
    python benchmarks/simulate.py --protocol reports --chunks 64   # the loop before chunk maps
    python benchmarks/simulate.py --validate out/bench_fanout.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tensorhub._planner import (  # noqa: E402 - the planner the coordinator runs
    LEVELS, Candidate, chunk_order, choose_sources, claims, grid_chunk_bytes, group_key, locality_cost, pick_chunk,
    reserve_chunks, start_fraction, start_reverse,
)
from tensorhub._stripes import (  # noqa: E402 - the plans it grants
    MIN_CHUNKS, NONE, STRIPES, WAN, Plan, plan_root, relayed, wan_root, wan_stripes,
)
from tensorhub._wire import Locality  # noqa: E402

GB = 1e9
GiB = 1 << 30
#: What the paper behind TensorHub reports (TensorHub versus its baselines).
PAPER = {"standalone": 6.7, "elastic": 4.8, "crossdc": 19.0}


@dataclass
class Cluster:
    nodes: int = 128
    gpus_per_node: int = 8
    dcs: int = 1
    nodes_per_zone: int = 16
    nic: float = 400e9 / 8  # bytes/s per GPU, each direction
    nvlink: float = 3600e9 / 8
    wan: float = 100e9 / 8  # bytes/s per datacenter pair and direction
    cpu: float = float("inf")  # bytes/s all transfers together can move on the hosts' shared cores (testbed)

    def locality(self, worker: int) -> Locality:
        if worker < 0:  # the trainer: its own host in datacenter 0
            return Locality(datacenter="dc0", zone="z0", host="trainer")
        node = worker // self.gpus_per_node
        dc = node * self.dcs // self.nodes
        return Locality(datacenter=f"dc{dc}", zone=f"z{node // self.nodes_per_zone}", host=f"n{node}")


@dataclass
class Reader:
    wid: int
    loc: Locality
    need: list
    have: set = field(default_factory=set)
    reported: set = field(default_factory=set)
    receiving: set = field(default_factory=set)
    sources: list = field(default_factory=list)  # Candidate snapshots
    start_t: float = 0.0
    done_t: Optional[float] = None
    last_refresh: float = -1.0
    last_report: float = -1.0
    pipelined: bool = True
    claimed: frozenset = frozenset()
    last_progress: float = 0.0
    order: list = field(default_factory=list)
    reserved: Optional[frozenset] = None


class Sim:
    """One distribution of one version to a set of readers."""

    def __init__(self, cl: Cluster, nbytes: float, num_chunks: int, *, policy: str = "topology",
                 max_sources: int = 4, depth: int = 2, report_s: float = 0.05, refresh_s: float = 0.05,
                 holders: tuple = (), readers: tuple = (), pipelined: bool = True) -> None:
        self.cl, self.nbytes, self.n = cl, nbytes, num_chunks
        self.chunk = nbytes / num_chunks
        self.policy, self.k, self.depth = policy, max_sources, depth
        self.report_s, self.refresh_s = report_s, refresh_s
        self.claim_patience = 0.5  # as the client (_pipeline.PipelinedReader)
        self.complete: dict[int, Locality] = {-1: cl.locality(-1)}  # worker -> locality (complete replicas)
        self.reg_time = {-1: 0.0}
        for h in holders:
            self.complete[h] = cl.locality(h)
            self.reg_time[h] = 0.0
        self.readers: dict[int, Reader] = {}
        for k, w in enumerate(readers):
            order = chunk_order(num_chunks, start_fraction(k), start_reverse(k) and pipelined)
            self.readers[w] = Reader(w, cl.locality(w), list(order), pipelined=pipelined, order=order)
            self.reg_time[w] = 1e-9 * (k + 1)
        self.seeders: dict[tuple, int] = {}  # (level, *group) -> seeder
        self._cands: Optional[list] = None  # all candidates, rebuilt once per time step
        self._groups: dict[tuple, list] = {}  # group -> unfinished pipelined readers, per time step
        self.load: dict[int, int] = {}
        # flows: (reader, source, chunk), remaining bytes, resource ids
        self.flows: list[list] = []
        self._res: dict[tuple, int] = {}
        self.cap: list[float] = []
        self.crossed = 0.0
        self.from_trainer = 0.0

    # ------------------------------------------------------------- network
    def _rid(self, key: tuple, cap: float) -> int:
        r = self._res.get(key)
        if r is None:
            r = self._res[key] = len(self.cap)
            self.cap.append(cap)
        return r

    def _path(self, src: int, dst: int) -> list[int]:
        a, b = self.cl.locality(src), self.cl.locality(dst)
        if a.host == b.host:
            return [self._rid(("nvup", src), self.cl.nvlink), self._rid(("nvdn", dst), self.cl.nvlink)]
        p = [self._rid(("up", src), self.cl.nic), self._rid(("dn", dst), self.cl.nic)]
        if a.datacenter != b.datacenter:
            p.append(self._rid(("wan", a.datacenter, b.datacenter), self.cl.wan))
        if self.cl.cpu != float("inf"):  # the testbed's cores: one more link every flow shares
            p.append(self._rid(("cpu",), self.cl.cpu))
        return p

    # ------------------------------------------------------------- planner calls
    def _candidates(self) -> list[Candidate]:
        """What the coordinator would see now (loads as of the start of this time step)."""
        if self._cands is None:
            out = [Candidate(str(w), str(w), loc, self.load.get(w, 0), self.reg_time[w])
                   for w, loc in self.complete.items()]
            for o in self.readers.values():
                if o.pipelined and o.wid not in self.complete:
                    out.append(Candidate(str(o.wid), str(o.wid), o.loc, self.load.get(o.wid, 0),
                                         self.reg_time[o.wid], frozenset(o.reported), frozenset(o.receiving)))
            self._cands = out
        return self._cands

    def _refresh(self, r: Reader, now: float) -> None:
        r.last_refresh = now
        keys = {lvl: (lvl,) + group_key(r.loc, lvl) for lvl in LEVELS}
        seeders = {lvl: (str(self.seeders[k]), True) for lvl, k in keys.items() if k in self.seeders}
        ch = choose_sources(r.loc, str(r.wid), self._candidates(), max_sources=self.k, pipelined=r.pipelined,
                            seeders=seeders, policy=self.policy, have=frozenset(r.reported))
        for lvl in ch.seed_levels:
            self.seeders[keys[lvl]] = r.wid
        # as the coordinator: claims and reservations among readers no farther than the
        # nearest complete source (atomically)
        complete = [cost for c, cost in ch.sources if c.complete]
        near = self._near(r, complete[0]) if r.pipelined and len(complete) == 1 else []
        got = claims(ch.sources, [(locality_cost(r.loc, o.loc), frozenset(o.receiving), o.reserved or frozenset())
                                  for o in near])
        r.claimed = got or frozenset()
        r.reserved = None if got is None else \
            reserve_chunks(r.order, frozenset(r.reported | r.receiving), got, r.reserved or frozenset())
        for c in r.sources:
            self.load[int(c.worker_id)] -= 1
        r.sources = [c for c, _ in ch.sources]
        for c in r.sources:
            self.load[int(c.worker_id)] = self.load.get(int(c.worker_id), 0) + 1

    def _near(self, r: Reader, reach: int) -> list:
        """Unfinished pipelined readers within cost ``reach`` of ``r`` (group lookups, not a scan)."""
        if reach < 0:
            return []
        key = group_key(r.loc, min(reach, 2)) if reach < 3 else ()
        if key not in self._groups:
            self._groups[key] = [o for o in self.readers.values() if o.pipelined and o.done_t is None and
                                 (reach >= 3 or group_key(o.loc, reach) == key)]
        return [o for o in self._groups[key] if o is not r]

    # ------------------------------------------------------------- the read loop (as _pipeline)
    def _submit(self, r: Reader, now: float) -> bool:
        busy: dict[str, int] = {c.worker_id: 0 for c in r.sources}
        for f in self.flows:
            if f[0] == r.wid and str(f[1]) in busy:
                busy[str(f[1])] += 1
        idle = False
        for src in sorted(r.sources, key=lambda s: (s.chunks is None, busy[s.worker_id])):
            while busy[src.worker_id] < self.depth and r.need:
                others = [o.chunks for o in r.sources if o is not src]
                coming = r.claimed.union(*(o.coming for o in r.sources))
                order = r.need
                if not r.receiving and now - r.last_progress > self.claim_patience:
                    coming = frozenset()
                elif src.chunks is None and r.reserved is not None:
                    order, coming = [x for x in r.need if x in r.reserved], frozenset()
                c = pick_chunk(order, src.chunks, others, set(), coming)
                if c is None:
                    idle = True
                    break
                r.need.remove(c)
                r.receiving.add(c)
                s = int(src.worker_id)
                self.flows.append([r.wid, s, c, self.chunk, self._path(s, r.wid)])
                busy[src.worker_id] += 1
        return idle or not r.sources

    def _rates(self) -> "np.ndarray":
        """Each flow's rate: the equal share of its tightest link."""
        m = len(self.flows)
        res = [f[4] for f in self.flows]
        width = max(len(p) for p in res)
        idx = np.full((m, width), -1)
        for i, p in enumerate(res):
            idx[i, : len(p)] = p
        cap = np.asarray(self.cap + [np.inf])
        counts = np.bincount(idx[idx >= 0].ravel(), minlength=len(self.cap) + 1).astype(float)
        counts[-1] = 1.0
        share = cap / np.maximum(counts, 1.0)
        return share[idx].min(axis=1)

    def run(self, t_max: float = 3600.0) -> dict:
        now = 0.0
        dt_min = self.chunk / self.cl.nic / 16
        for r in self.readers.values():
            self._refresh(r, now)
            self._submit(r, now)
        while any(r.done_t is None for r in self.readers.values()) and now < t_max:
            if self.flows:
                rates = self._rates()
                rem = np.array([f[3] for f in self.flows])
                step = max(float((rem / rates).min()), dt_min)
            else:
                step = self.refresh_s / 2
            step = min(step, self.refresh_s / 2)
            now += step
            self._cands, self._groups = None, {}
            finished = []
            if self.flows:
                rem = rem - rates * step
                for i, f in enumerate(self.flows):
                    f[3] = rem[i]
                finished = [f for f in self.flows if f[3] <= 1e-6 * self.chunk]
                self.flows = [f for f in self.flows if f[3] > 1e-6 * self.chunk]
            for rw, s, c, _, path in finished:
                r = self.readers[rw]
                r.have.add(c)
                r.receiving.discard(c)
                r.last_progress = now
                if s == -1:
                    self.from_trainer += self.chunk
                if self.cl.locality(s).datacenter != r.loc.datacenter:
                    self.crossed += self.chunk
                if len(r.have) == self.n and r.done_t is None:
                    r.done_t = now
                    r.reported = set(r.have)
                    self.complete[rw] = r.loc  # registered as a complete replica
            for r in self.readers.values():
                if r.done_t is not None:
                    continue
                if now - r.last_report >= self.report_s:
                    r.reported = set(r.have)
                    r.last_report = now
                idle = self._submit(r, now)
                if r.need and now - r.last_refresh >= self.refresh_s * (1 if idle else 2):
                    self._refresh(r, now)
                    self._submit(r, now)
        times = [r.done_t if r.done_t is not None else float("inf") for r in self.readers.values()]
        return {"seconds": max(times), "crossed_bytes": self.crossed, "from_trainer_bytes": self.from_trainer}



# ---------------------------------------------------------------- the chunk-map control loop
#: ``PipelinedReader`` / ``ShardReader`` constants (tensorhub/_pipeline.py, _reader.py, _fetch.py).
DEPTH = 2  # reads in flight per source (_fetch.DEPTH)
POLL = 0.002  # ShardReader.poll_interval: the loop's longest sleep while reads are in flight
IDLE_CAP = 0.025  # PipelinedReader._idle_cap (refresh_interval / 2): longest sleep with nothing in flight
STATUS_INTERVAL = 0.01  # least seconds between two reads of one source's chunk map
FIRST_REFRESH = 0.1  # the one refresh comes no sooner than this after the read started
MAX_REFRESHES = 1
REFRESH = 0.05  # refresh_interval (idle; twice that while every source is busy)
CLAIM_PATIENCE = 0.5
SPILL = True  # a plan's member also serves chunks of stripes it does not parent, when idle (the
#               reader's stripe parent holding that whole stripe already)
PLAN_STATUS_INTERVAL = 0.002  # ... for a reader with a plan (parents it follows closely)
LEASE_TTL = 30.0  # renewals every max(0.1, ttl / 3): none in a read shorter than 10 s
FIXED_CALLS = 2  # resolve ("latest") and the manifest GET, before the lease (1: the version was named)


@dataclass
class MapReader:
    wid: int
    loc: Locality
    need: list  # chunks not submitted yet, in the reader's order
    t0: float = 0.0
    have: set = field(default_factory=set)
    marked: frozenset = frozenset()  # READY bytes in its own chunk map
    marked_coming: frozenset = frozenset()  # COMING bytes
    inflight: dict = field(default_factory=dict)  # chunk -> source worker
    landed: list = field(default_factory=list)  # (chunk, source, time) completed, not polled yet
    sources: list = field(default_factory=list)  # (Candidate as granted, cost)
    named: set = field(default_factory=set)  # workers its lease names (load at the coordinator)
    avail: dict = field(default_factory=dict)  # source -> chunks its map said were ready
    mcoming: dict = field(default_factory=dict)  # source -> chunks its map said were coming
    map_pending: dict = field(default_factory=dict)  # source -> time the map read completes
    map_result: dict = field(default_factory=dict)  # source -> (ready, coming) read, not taken in yet
    map_last: dict = field(default_factory=dict)
    last_refresh: float = float("-inf")
    last_progress: float = 0.0
    refreshes: int = 0  # the refreshes the budget counts
    stalls: int = 0  # refreshes beyond it (no source left, or a stall)
    calls: int = 0
    map_reads: int = 0
    wake: float = 0.0
    sleep: float = POLL / 8
    done_t: Optional[float] = None
    leased: bool = False  # its lease (and so its partial replica) registered
    plan_key: Optional[tuple] = None  # (datacenter, root) of the plan it is a member of
    plan: Optional[list] = None  # parent replica id per stripe (NONE: none yet)
    plan_refresh: float = 0.0  # when to ask again for the fixed plan (0: fixed)
    dirty: bool = True  # something a submit step looks at changed since the last one (else it picks nothing)
    stalled: bool = False


class MapSim(Sim):
    """The control loop as implemented with chunk maps (``_pipeline``, ``_chunkmap``, ``_fetch``):

    * one pipelined lease per reader at its start, which also registers its partial replica:
      the coordinator knows it holds *nothing* (it never hears of chunks), so partial
      candidates are ordered by load and registration only, and no reservations or claims
      are made (``_state.acquire_lease``: ``own`` is None for a chunk-map replica); where
      one source is scarce the coordinator's striped plan (``_stripes.Plan``, joined and
      asked exactly as ``_state`` does) names each stripe's parent instead, and the reader
      reads each stripe only from it (any source after a stall);
    * the reader loop of ``ShardReader._loop``: submit (sources by cost, partial first,
      least busy; ``pick_chunk`` over what each source's map said), then the chunk maps
      (take in reads that completed; read again the map of every partial source with a free
      slot, at most every ``STATUS_INTERVAL``, one ``rtt`` each), then the refresh rule, then
      poll; sleep 0.25 ms doubling to 2 ms with reads in flight, to 25 ms without; a
      completed chunk resets the sleep and is marked READY in the reader's own map at once
      (what it receives is marked COMING); under a plan, maps whose read ended are taken in
      before the submit step too (``PipelinedReader._fill``) and the loop sleeps at most
      0.25 ms while a map read is in flight (``PipelinedReader._nap``);
    * the coordinator is asked again once, at the first loop turn ``FIRST_REFRESH`` after
      the start (if chunks are still to submit), beyond that only with no source or after a
      stall (nothing in flight, nothing landed for ``CLAIM_PATIENCE``); a refresh adds to
      the sources (those of the earlier answer stay usable under the same lease);
    * at the end one release+register call; the replica is complete from then on.

    Time advances in steps of at least ``tick`` seconds (rates held for a step; a read that
    ends inside a step frees its share at the step's end)."""

    def __init__(self, cl: Cluster, nbytes: float, num_chunks: int, *, rtt: float = 50e-6,
                 tick: float = 0.25e-3, fixed_calls: int = FIXED_CALLS, plans: bool = True, **kw) -> None:
        super().__init__(cl, nbytes, num_chunks, **kw)
        self.rtt, self.tick, self.fixed_calls = rtt, tick, fixed_calls
        self.plans_on, self.plans, self.now = plans, {}, 0.0
        self.mreaders: dict[int, MapReader] = {}
        for k, w in enumerate(self.readers):
            order = chunk_order(num_chunks, start_fraction(k), start_reverse(k))
            self.mreaders[w] = MapReader(w, self.cl.locality(w), list(order))
        self.ids = {w: k for k, w in enumerate([-1, *self.complete.keys() - {-1}, *self.readers])}  # registration order

    def _candidates(self) -> list[Candidate]:
        if self._cands is None:
            out = [Candidate(f"r{self.ids[w]:07d}", str(w), loc, self.load.get(w, 0), self.reg_time[w])
                   for w, loc in self.complete.items()]
            for o in self.mreaders.values():
                if o.leased and o.wid not in self.complete:  # registered with its lease; holds nothing, as
                    # far as the coordinator knows
                    out.append(Candidate(f"r{self.ids[o.wid]:07d}", str(o.wid), o.loc, self.load.get(o.wid, 0),
                                         self.reg_time[o.wid], frozenset(), frozenset()))
            self._cands = out
        return self._cands

    def _rid_of(self, w: int) -> str:
        return f"r{self.ids[w]:07d}"

    def _planned(self, r: MapReader) -> bool:
        """As ``_state.acquire_lease``: a plan (``tensorhub._stripes``) where one source is
        scarce; True when the reader's sources come from its plan."""
        if not self.plans_on:
            return False
        if r.plan_key is None:
            if r.leased or self.n < MIN_CHUNKS or self.policy != "topology":
                return False
            dc_key = (LEVELS[-1],) + group_key(r.loc, LEVELS[-1])
            seeder = self.seeders.get(dc_key)
            seeder_rid = self._rid_of(seeder) if seeder is not None and seeder != r.wid and \
                seeder in self.mreaders and self.mreaders[seeder].leased else None
            root = plan_root(r.loc, str(r.wid), self._candidates(), seeder_rid)
            scope = r.loc.datacenter
            if root is None and seeder in (None, r.wid):  # it seeds its datacenter: the plan across them
                root, scope = wan_root(r.loc, str(r.wid), self._candidates()), WAN
            if root is None:
                return False
            key = (scope, root)
            plan = self.plans.get(key)
            if plan is None:
                stripes = STRIPES
                if scope == WAN:
                    home = next(c.locality.datacenter for c in self._candidates() if c.replica_id == root)
                    stripes = wan_stripes({self.cl.locality(w).datacenter for w in [*self.complete, *self.readers]},
                                          home)
                    if stripes < 2:
                        return False  # one datacenter to seed: the usual choice (as _state._plan)
                plan = self.plans[key] = Plan(root, stripes, self.now)
            r.plan_key = key
            plan.join(str(r.wid), self._rid_of(r.wid), self.now, r.loc.host)
            if scope == WAN:
                for lvl in LEVELS:
                    self.seeders.setdefault((lvl,) + group_key(r.loc, lvl), r.wid)
        plan = self.plans[r.plan_key]
        row, again = plan.parents(str(r.wid), self.now)
        by_rid = {c.replica_id: c for c in self._candidates()}
        if r.plan_key[0] == WAN:  # the root's stripes from its own datacenter's plan (_state.acquire_lease)
            row = relayed(row, plan.root, self.plans.get((by_rid[plan.root].locality.datacenter, plan.root)))
        r.plan, r.plan_refresh = row, again
        if not r.leased:
            by_rid.setdefault(self._rid_of(r.wid), None)
        wanted = [x for x in dict.fromkeys(row) if x != NONE] or [plan.root]
        self._take(r, [(by_rid[x], 0) for x in wanted if by_rid.get(x) is not None])
        return True

    def _take(self, r: MapReader, fresh: list) -> None:
        """A lease answer's sources (those of earlier answers stay usable under the same
        lease); its partial replica registered with the first; loads as the coordinator counts."""
        ids = {c.worker_id for c, _ in fresh}
        r.sources = fresh + [p for p in r.sources if p[0].worker_id not in ids]
        r.dirty = True
        if not r.leased:
            r.leased, self._cands = True, None
        for c, _ in fresh:
            w = int(c.worker_id)
            if w not in r.named:
                r.named.add(w)
                self.load[w] = self.load.get(w, 0) + 1
                self._cands = None

    def _lease(self, r: MapReader) -> None:
        r.calls += 1
        if self._planned(r):
            return
        keys = {lvl: (lvl,) + group_key(r.loc, lvl) for lvl in LEVELS}
        seeders = {lvl: (str(self.seeders[k]), True) for lvl, k in keys.items() if k in self.seeders}
        ch = choose_sources(r.loc, str(r.wid), self._candidates(), max_sources=self.k, pipelined=True,
                            seeders=seeders, policy=self.policy, have=frozenset())
        for lvl in ch.seed_levels:
            self.seeders[keys[lvl]] = r.wid
        self._take(r, [(c, cost) for c, cost in ch.sources])

    def _spillable(self, r: MapReader) -> list:
        """``PipelinedReader._spillable``: the chunks still needed of the stripes whose
        (partial) parent's map showed the whole stripe."""
        d = len(r.plan)
        by = {c.replica_id: c for c, _ in r.sources}
        done = set()
        for t, rid in enumerate(r.plan):
            p = by.get(rid)
            if p is not None and p.chunks is not None and \
                    r.avail.get(int(p.worker_id), frozenset()).issuperset(range(t, self.n, d)):
                done.add(t)
        return [x for x in r.need if x % d in done] if done else []

    def _held(self, r: MapReader, c: Candidate) -> Optional[frozenset]:
        return None if c.chunks is None else r.avail.get(int(c.worker_id), frozenset())

    def _submit_step(self, r: MapReader, now: float, busy: dict) -> None:
        stalled = not r.inflight and now - r.last_progress > CLAIM_PATIENCE
        if not r.dirty and stalled == r.stalled:
            return  # (a speed-up only: the same inputs pick the same nothing)
        r.dirty, r.stalled = False, stalled
        progressed = True
        while r.need and progressed:
            progressed = False
            for c, _ in sorted(r.sources, key=lambda p: (p[1], p[0].chunks is None, busy[int(p[0].worker_id)])):
                s = int(c.worker_id)
                if not r.need or busy[s] >= self.depth:
                    continue
                held = self._held(r, c)
                if r.plan is not None and not stalled:  # its plan: each stripe from its parent first
                    d = len(r.plan)
                    ch = pick_chunk([x for x in r.need if r.plan[x % d] == c.replica_id], held, [], set())
                    if ch is None and held is not None and SPILL:  # a member: what it holds of the
                        # stripes whose parent already holds all of theirs (as PipelinedReader._spillable)
                        others = [self._held(r, o) for o, _ in r.sources if o is not c]
                        ch = pick_chunk(self._spillable(r), held, others, set())
                else:
                    others = [self._held(r, o) for o, _ in r.sources if o is not c]
                    coming = frozenset().union(*(r.mcoming.get(int(o.worker_id), frozenset()) for o, _ in r.sources))
                    if stalled:
                        coming = frozenset()
                    ch = pick_chunk(r.need, held, others, set(), coming)
                if ch is None:
                    continue
                r.need.remove(ch)
                r.inflight[ch] = s
                self.flows.append([r.wid, s, ch, self.chunk, self._path(s, r.wid)])
                busy[s] += 1
                progressed = True

    def _intake(self, r: MapReader) -> None:
        """Take in the chunk maps whose reads completed (``PipelinedReader._take_maps``)."""
        for s, (ready, coming) in list(r.map_result.items()):
            del r.map_result[s]
            old = r.avail.get(s, frozenset())
            got = (ready | old, coming - old)
            if got != (old, r.mcoming.get(s, frozenset())):
                r.dirty = True
            r.avail[s], r.mcoming[s] = got

    def _maps_step(self, r: MapReader, now: float, busy: dict) -> None:
        self._intake(r)
        if not r.need:
            return
        for c, _ in r.sources:
            s = int(c.worker_id)
            if c.chunks is None or s in r.map_pending or busy[s] >= self.depth:
                continue
            if s in r.avail and now - r.map_last.get(s, 0.0) < (STATUS_INTERVAL if r.plan is None else PLAN_STATUS_INTERVAL):
                continue
            r.map_pending[s] = now + self.rtt
            r.map_last[s] = now
            r.map_reads += 1
            self._pending.append((now + self.rtt, r.wid, s))

    def _refresh_step(self, r: MapReader, now: float, busy: dict) -> None:
        if r.plan_refresh and now >= r.plan_refresh and r.need:  # the plan's layout is fixed now
            r.last_refresh, r.refreshes = now, r.refreshes + 1
            self._lease(r)
            return
        if r.plan is not None and not r.plan_refresh:  # a fixed plan: nothing to learn, unless stalled
            if r.need and not any(busy.values()) and now - r.last_progress > CLAIM_PATIENCE and \
                    now - r.last_refresh >= REFRESH:
                r.last_refresh, r.stalls = now, r.stalls + 1
                self._lease(r)
            return
        idle = not r.sources or any(busy[int(c.worker_id)] < self.depth for c, _ in r.sources)
        if not r.need or now - r.last_refresh < REFRESH * (1 if idle else 2):
            return
        trouble = not any(busy.values()) and now - r.last_progress > CLAIM_PATIENCE
        if r.sources and not trouble and (r.refreshes >= MAX_REFRESHES or now - r.t0 < FIRST_REFRESH):
            return
        r.last_refresh = now
        if r.sources and not trouble:
            r.refreshes += 1
        else:
            r.stalls += 1
        self._lease(r)

    def _turn(self, r: MapReader, now: float) -> None:
        """One turn of the reader's loop (twice when a read was seen complete: no sleep)."""
        for _ in range(2):
            busy = {int(c.worker_id): 0 for c, _ in r.sources}
            for s in r.inflight.values():
                if s in busy:
                    busy[s] += 1
            if r.plan is not None:
                self._intake(r)
            self._submit_step(r, now, busy)
            self._maps_step(r, now, busy)
            self._refresh_step(r, now, busy)
            done = [x for x in r.landed if x[2] <= now]
            if done:
                r.landed = [x for x in r.landed if x[2] > now]
                for ch, s, _ in done:
                    r.have.add(ch)
                    r.inflight.pop(ch, None)
                r.last_progress, r.dirty = now, True
            if done or len(r.marked_coming) != len(r.inflight):  # tick: READY for what completed,
                r.marked = frozenset(r.have)  # COMING for what it receives
                r.marked_coming = frozenset(r.inflight)
            if len(r.have) == self.n:
                r.done_t = now
                r.calls += 1  # release + register the complete replica, one call
                self.complete[r.wid] = r.loc
                for w in r.named:
                    self.load[w] -= 1
                self._cands = None
                return
            if not done:
                break
            r.sleep = POLL / 8
        r.wake = now + r.sleep
        if r.plan is not None and r.map_pending:
            r.wake = min(r.wake, now + max(self.tick, POLL / 8))
        r.sleep = min(r.sleep * 2, POLL if r.inflight or r.plan is not None else IDLE_CAP)
        if r.plan_refresh:
            r.wake = min(r.wake, max(now + self.tick, r.plan_refresh))

    def run(self, t_max: float = 3600.0) -> dict:
        now = 0.0
        self._pending: list[tuple] = []
        for r in self.mreaders.values():
            self._lease(r)  # the lease that registers its partial replica
            r.last_refresh = now
        while any(r.done_t is None for r in self.mreaders.values()) and now < t_max:
            self._cands, self._groups, self.now = None, {}, now
            for r in self.mreaders.values():
                if r.done_t is None and r.wake <= now + 1e-12:
                    self._turn(r, now)
            nxt = min((r.wake for r in self.mreaders.values() if r.done_t is None), default=now + self.tick)
            if self.flows:
                rates = self._rates()
                rem = np.array([f[3] for f in self.flows])
                nxt = min(nxt, now + float((rem / rates).min()))
            step = max(self.tick, nxt - now)
            if self.flows:
                left = rem - rates * step
                keep = []
                for i, f in enumerate(self.flows):
                    if left[i] <= 1e-6 * self.chunk:
                        r = self.mreaders[f[0]]
                        r.landed.append((f[2], f[1], now + float(rem[i] / rates[i])))
                        if f[1] == -1:
                            self.from_trainer += self.chunk
                        if self.cl.locality(f[1]).datacenter != r.loc.datacenter:
                            self.crossed += self.chunk
                    else:
                        f[3] = left[i]
                        keep.append(f)
                self.flows = keep
            now += step
            if self._pending:  # map reads that completed: what the holder's map said then
                due = [p for p in self._pending if p[0] <= now]
                self._pending = [p for p in self._pending if p[0] > now]
                for _, rw, s in due:
                    r = self.mreaders[rw]
                    h = self.mreaders.get(s)
                    r.map_pending.pop(s, None)
                    full = frozenset(range(self.n))
                    r.map_result[s] = (full, frozenset()) if h is None or h.done_t is not None else \
                        (h.marked, h.marked_coming)
        rs = list(self.mreaders.values())
        times = [r.done_t if r.done_t is not None else float("inf") for r in rs]
        calls = [self.fixed_calls + r.calls + int((r.done_t or 0) // max(0.1, LEASE_TTL / 3)) for r in rs]
        return {"seconds": max(times), "crossed_bytes": self.crossed, "from_trainer_bytes": self.from_trainer,
                "calls_mean": float(np.mean(calls)), "calls_max": max(calls),
                "refreshes_mean": float(np.mean([r.refreshes for r in rs])),
                "stall_refreshes_mean": float(np.mean([r.stalls for r in rs])),
                "map_reads_mean": float(np.mean([r.map_reads for r in rs]))}


# ---------------------------------------------------------------- analytic baselines
def ring(cl: Cluster, nbytes: float, n: int, chunk: float = 4 << 20) -> float:
    """Pipelined ring broadcast (NCCL style, ``chunk``-sized steps) over n GPUs + the trainer,
    already set up as one communicator: every hop carries the whole version; the slowest
    link of the ring sets the pace, plus the pipeline fill."""
    link = cl.nic if cl.dcs == 1 else min(cl.nic, cl.wan)
    return nbytes / link + n * chunk / cl.nic


def push_pull(cl: Cluster, nbytes: float, n: int, storage_gbps: float) -> float:
    """The trainer writes the version to storage (in datacenter 0), then every GPU reads it."""
    st = storage_gbps * 1e9 / 8
    push = nbytes / min(cl.nic, st)
    local = n // cl.dcs
    pull = max(nbytes * n / st, nbytes / cl.nic)
    if cl.dcs > 1:
        pull = max(pull, nbytes * (n - local) / (cl.wan * (cl.dcs - 1)))
    return push + pull


def lower_bound(cl: Cluster, nbytes: float, dcs: int, host_source: bool = False) -> float:
    """Every reader receives the version through its NIC (through NVLink when a GPU of its
    own node already holds it), the trainer sends it at least once, every other datacenter
    receives it at least once over its slow links (one from each other datacenter: with
    more than two, a datacenter can take parts of it from the others at once)."""
    lb = nbytes / (cl.nvlink if host_source else cl.nic)
    if dcs > 1:
        lb = max(lb, nbytes / (cl.wan * (dcs - 1)))
    return lb


# ---------------------------------------------------------------- workloads
def make_sim(args: argparse.Namespace, cl: Cluster, nbytes: float, chunks: int, fixed_calls: int = FIXED_CALLS,
             **kw) -> Sim:
    """The control loop asked for: ``chunkmap`` (as implemented) or ``reports`` (before chunk maps)."""
    if args.protocol == "reports":
        return Sim(cl, nbytes, chunks, **kw)
    return MapSim(cl, nbytes, chunks, rtt=args.rtt_us * 1e-6, tick=args.tick_ms / 1e3, fixed_calls=fixed_calls,
                  plans=getattr(args, "plans", True), **kw)


def workload(name: str, args: argparse.Namespace, dcs: int) -> dict:
    cl = Cluster(nodes=args.nodes, dcs=dcs, nic=args.nic_gbps * 1e9 / 8, nvlink=args.nvlink_gbps * 1e9 / 8,
                 wan=args.wan_gbps * 1e9 / 8)
    n_gpu = cl.nodes * cl.gpus_per_node
    nbytes = args.gib * GiB
    every = list(range(n_gpu))
    if name == "elastic":
        newcomers = every[:: 8]  # one GPU per node joins
        holders = tuple(w for w in every if w % 8)
    else:
        newcomers, holders = every, ()
    kw = dict(max_sources=args.stripe, report_s=args.report_ms / 1e3, refresh_s=args.refresh_ms / 1e3)
    chunks = args.chunks or -(-int(nbytes) // grid_chunk_bytes(int(nbytes)))
    t0 = time.monotonic()
    th = make_sim(args, cl, nbytes, chunks, holders=holders, readers=tuple(newcomers), **kw).run()
    wall = time.monotonic() - t0
    n = len(newcomers)
    # single-source: everyone reads from the trainer: the trainer's NIC (and the slow link) bound it
    single = nbytes * n / cl.nic
    if dcs > 1:
        remote = sum(1 for w in newcomers if cl.locality(w).datacenter != "dc0")
        single = max(single, nbytes * remote / (cl.wan * (dcs - 1)))
    out = {
        "workload": name, "gpus": n_gpu, "datacenters": dcs, "readers": n, "gib": args.gib,
        "tensorhub": th["seconds"], "single_source": single, "ring": ring(cl, nbytes, n),
        "push_pull": push_pull(cl, nbytes, n, args.storage_gbps), "lower_bound": lower_bound(cl, nbytes, dcs, host_source=bool(holders)),
        "crossed_x": th["crossed_bytes"] / nbytes, "trainer_x": th["from_trainer_bytes"] / nbytes,
        "sim_wall_s": wall, "chunks": chunks, "protocol": args.protocol,
        "calls_per_reader": th.get("calls_mean"), "calls_max": th.get("calls_max"),
        "refreshes_per_reader": th.get("refreshes_mean"),
        "stall_refreshes_per_reader": th.get("stall_refreshes_mean"), "map_reads_per_reader": th.get("map_reads_mean"),
    }
    out["vs_bound"] = out["tensorhub"] / out["lower_bound"]
    out["vs_ring"] = out["ring"] / out["tensorhub"]
    best = min(out["single_source"], out["ring"], out["push_pull"])
    out["vs_best_baseline"] = best / out["tensorhub"]
    out["vs_single_source"] = out["single_source"] / out["tensorhub"]
    return out


def _cpu_rows(meas: dict, n: int) -> list:
    return [x for x in meas["rows"] if x["readers"] >= 2 and x["readers"] != n and "tensorhub_reader_cpu_s" in x]


def cpu_floor(meas: dict, n: int) -> Optional[float]:
    """The least time the testbed's cores allow a round of ``n`` readers: the CPU such a round
    takes over the cores the hosts share (``bench_topology.py fanout`` measures each round's:
    every reader's process during its fetch, the publisher's meanwhile). Leave-one-out: from
    the other rows of two or more readers (CPU per reader, the publisher's), never from the
    row it bounds. None without such rows (older files, or no CPU count)."""
    cores, others = meas.get("cores"), _cpu_rows(meas, n)
    if not cores or not others:
        return None
    per_reader = sum(x["tensorhub_reader_cpu_s"] for x in others) / len(others)
    pub = sum(x["tensorhub_publisher_cpu_s"] for x in others) / len(others)
    return (n * per_reader + pub) / cores


def cpu_rate(meas: dict, n: int, nbytes: float) -> float:
    """The bytes per second the testbed's cores can move for a round of ``n`` readers, all
    transfers together (each reader takes in one version): the cores over the CPU-seconds
    per byte of the file's other rows (leave-one-out, as :func:`cpu_floor`); inf without them."""
    cores, others = meas.get("cores"), _cpu_rows(meas, n)
    if not cores or not others:
        return float("inf")
    per_byte = sum((x["readers"] * x["tensorhub_reader_cpu_s"] + x["tensorhub_publisher_cpu_s"])
                   / (x["readers"] * nbytes) for x in others) / len(others)
    return cores / per_byte


def validate(path: Path, args: argparse.Namespace) -> list[dict]:
    """The model at the testbed's size against the testbed's measurements: the network and
    control-loop model, and that or the cores' floor (:func:`cpu_floor`), whichever is longer:
    the testbed's hosts share two cores, which the network model does not know."""
    meas = json.loads(path.read_text())
    rate = {"1gbit": 1e9, "100mbit": 1e8}.get(meas.get("host_rate", "1gbit"), 1e9) / 8
    mib = meas["mib"]
    n1 = next(r for r in meas["rows"] if r["readers"] == 1)
    eff = (mib * (1 << 20) / rate) / n1["single-source"]  # link efficiency measured at N=1
    rows = []
    for r in meas["rows"]:
        n = r["readers"]
        cl = Cluster(nodes=n + 1, gpus_per_node=1, dcs=1, nic=rate * eff, nvlink=rate * eff, nodes_per_zone=64)
        readers = tuple(range(1, n + 1))
        # the testbed's publisher is host a0: model it as the trainer on its own host
        nbytes = mib * (1 << 20)
        chunks = -(-nbytes // grid_chunk_bytes(nbytes))
        a = argparse.Namespace(**dict(vars(args), rtt_us=args.testbed_rtt_us))
        # (the testbed's readers name the version: no resolve call)
        sim = make_sim(a, cl, nbytes, chunks, fixed_calls=1, readers=readers, max_sources=4, report_s=0.05,
                       refresh_s=0.05).run()
        cores = Cluster(nodes=n + 1, gpus_per_node=1, dcs=1, nic=rate * eff, nvlink=rate * eff, nodes_per_zone=64,
                        cpu=cpu_rate(meas, n, nbytes))
        with_cores = sim if cores.cpu == float("inf") else \
            make_sim(a, cores, nbytes, chunks, fixed_calls=1, readers=readers, max_sources=4, report_s=0.05,
                     refresh_s=0.05).run()
        single = Sim(cl, nbytes, chunks, readers=readers, policy="single-source", pipelined=False,
                     report_s=0.05, refresh_s=0.05).run()
        floor = cpu_floor(meas, n)
        model = with_cores["seconds"]
        rows.append({"readers": n, "measured_tensorhub": r["tensorhub"], "model_network": sim["seconds"],
                     "err_network": sim["seconds"] / r["tensorhub"] - 1, "cpu_floor": floor,
                     "model_tensorhub": model, "err_tensorhub": model / r["tensorhub"] - 1,
                     "measured_calls": r.get("tensorhub_calls_per_reader"), "model_calls": sim.get("calls_mean"),
                     "measured_pub_x": r.get("tensorhub_from_publisher_x"),
                     "model_pub_x": sim["from_trainer_bytes"] / nbytes,
                     "measured_single": r["single-source"], "model_single": single["seconds"],
                     "err_single": single["seconds"] / r["single-source"] - 1})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=16.0, help="version size per GPU (GiB)")
    ap.add_argument("--nodes", type=int, default=128)
    ap.add_argument("--dcs", default="1,2,4", help="datacenter counts for crossdc")
    ap.add_argument("--nic-gbps", type=float, default=400.0)
    ap.add_argument("--nvlink-gbps", type=float, default=3600.0)
    ap.add_argument("--wan-gbps", type=float, default=100.0)
    ap.add_argument("--storage-gbps", type=float, default=800.0, help="aggregate storage bandwidth")
    ap.add_argument("--chunks", type=int, default=0,
                    help="chunks per version (default: the client's grid, tensorhub._grid: 256 of 64 MiB at 16 GiB)")
    ap.add_argument("--protocol", choices=["chunkmap", "reports"], default="chunkmap",
                    help="the control loop: chunk maps (as implemented) or the chunk reports / refreshes before them")
    ap.add_argument("--plans", action=argparse.BooleanOptionalAction, default=True,
                    help="chunkmap: the coordinator's striped plans (tensorhub/_stripes.py); --no-plans: without")
    ap.add_argument("--rtt-us", type=float, default=50.0, help="a chunk-map read (one small one-sided read), us")
    ap.add_argument("--testbed-rtt-us", type=float, default=200.0, help="the same on the netns testbed (--validate)")
    ap.add_argument("--tick-ms", type=float, default=0.25, help="chunkmap model: least time step")
    ap.add_argument("--stripe", type=int, default=4)
    ap.add_argument("--report-ms", type=float, default=50.0, help="reports protocol only")
    ap.add_argument("--refresh-ms", type=float, default=50.0, help="reports protocol only")
    ap.add_argument("--validate", type=Path, default=None, help="bench_fanout.json from the testbed")
    ap.add_argument("--only", choices=["standalone", "elastic", "crossdc", "none"], default=None,
                    help="one workload ('none': only --validate)")
    ap.add_argument("--json", default="out/simulate.json")
    args = ap.parse_args()
    results: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": []}
    if args.validate is not None:
        rows = validate(args.validate, args)
        results["validation"] = rows
        print("model vs testbed (fan-out, same sizes and link rates):")
        print(f"{'N':>3} {'TH meas':>8} {'net model':>10} {'err':>7} {'CPU floor':>10} {'TH model':>9} {'err':>7} "
              f"{'single meas':>12} {'single model':>13} {'err':>7}"
              f" {'calls meas':>10} {'calls model':>11} {'pub x meas':>10} {'pub x model':>11}")
        for r in rows:
            mc, cm = r["measured_calls"], r["model_calls"]
            mc = "-" if mc is None else f"{mc:.1f}"
            cm = "-" if cm is None else f"{cm:.1f}"
            px = "-" if r["measured_pub_x"] is None else f"{r['measured_pub_x']:.2f}"
            fl = "-" if r["cpu_floor"] is None else f"{r['cpu_floor']:.2f}"
            print(f"{r['readers']:>3} {r['measured_tensorhub']:>8.2f} {r['model_network']:>10.2f} "
                  f"{r['err_network']:>+7.1%} {fl:>10} {r['model_tensorhub']:>9.2f} "
                  f"{r['err_tensorhub']:>+7.1%} {r['measured_single']:>12.2f} {r['model_single']:>13.2f} "
                  f"{r['err_single']:>+7.1%} {mc:>10} {cm:>11} {px:>10} {r['model_pub_x']:>11.2f}")
        errs = [abs(r["err_tensorhub"]) for r in rows]
        net = [abs(r["err_network"]) for r in rows]
        print(f"TensorHub: largest |error| {max(errs):.1%}, mean {sum(errs) / len(errs):.1%} (target within 10%); "
              f"the network model alone: largest {max(net):.1%}, mean {sum(net) / len(net):.1%}; "
              "'CPU floor' = the CPU a round of N readers takes over the shared cores, from the file's other "
              "rows (leave-one-out); 'pub x' = bytes the publisher sent / version")
    plan = [("standalone", 1), ("elastic", 1)] + [("crossdc", int(d)) for d in args.dcs.split(",") if int(d) > 1]
    if args.only:
        plan = [p for p in plan if p[0] == args.only]
    print(f"\n{args.nodes * 8} GPUs on {args.nodes} nodes, {args.gib:g} GiB per GPU, NIC {args.nic_gbps:g} Gbit/s, "
          f"WAN {args.wan_gbps:g} Gbit/s, storage {args.storage_gbps:g} Gbit/s")
    print(f"control loop: {args.protocol}" + (f" (chunk-map read {args.rtt_us:g} us)" if args.protocol == "chunkmap"
                                              else f" (reports {args.report_ms:g} ms, refresh {args.refresh_ms:g} ms)"))
    print(f"{'workload':>11} {'DCs':>3} {'readers':>7} {'TensorHub':>9} {'single':>8} {'ring':>7} {'push-pull':>9} "
          f"{'bound':>7} {'/bound':>6} {'ring/TH':>7} {'pub (x)':>7} {'xDC (x)':>7} {'vs best':>7} {'vs single':>9} "
          f"{'paper':>6} "
          f"{'calls/rdr':>9}")
    for name, dcs in plan:
        o = workload(name, args, dcs)
        results["runs"].append(o)
        calls = "-" if o["calls_per_reader"] is None else f"{o['calls_per_reader']:.2f}"
        print(f"{name:>11} {dcs:>3} {o['readers']:>7} {o['tensorhub']:>9.2f} {o['single_source']:>8.2f} "
              f"{o['ring']:>7.2f} {o['push_pull']:>9.2f} {o['lower_bound']:>7.2f} {o['vs_bound']:>6.2f} "
              f"{o['vs_ring']:>7.2f} {o['trainer_x']:>7.2f} {o['crossed_x']:>7.2f} {o['vs_best_baseline']:>7.1f} "
              f"{o['vs_single_source']:>9.1f} "
              f"{PAPER[name]:>6.1f} {calls:>9}", flush=True)
    print("(seconds until every reader holds the version; '/bound' = TensorHub / lower bound (target <= 1.3); "
          "'ring/TH' = pre-formed ring / TensorHub (target > 1); 'pub (x)' = bytes the trainer sent / version; "
          "'vs best' = best baseline / TensorHub; "
          "'paper' = the ratio the paper reports for that workload; 'calls/rdr' = coordinator calls per reader "
          "(resolve, manifest, lease, refreshes, release+register))")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
