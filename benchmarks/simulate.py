"""Flow-level simulation of weight distribution at scale, driving TensorHub's own planner.

The readers here follow the client's pipelined read loop (``tensorhub._pipeline``) and the
coordinator's choices come from the same functions it calls (``tensorhub._planner``:
``choose_sources`` for cost/load ordering, striping, partial replicas and cross-datacenter
seeding; ``pick_chunk`` for which chunk to read from which source; ``chunk_order``,
``start_fraction``, ``start_reverse`` for where concurrent readers start;
``tensorhub.server.stripes.Plan`` for striped plans, joined as ``server.grants._planned`` does).

**The model credits only what the code does** (issue 31; docs/operations/benchmarks.md):

* **readers follow the model and subscribe ahead** (``--ahead``, the default; what the code's
  followers do now: ``Hub.fetch_next``, ``tensorhub/server/ahead.py``): every reader's serving lease
  is held before the publish; the call that completes the version binds them all
  (:data:`COORD_MS` ``bind`` per subscriber, measured by ``bench_routes.py --only ahead``): the
  readers of the publisher's datacenter join its plan in arrival order and the layout is fixed
  with all of them (``Plan.join`` then ``Plan.fix``: none late, no refresh), the others get the
  usual grant right after; then, in plan order, each grant is made and encoded (``grant``)
  and its held request answered by the event loop (``wake``, bench_fleet --burst) before the
  next grant (``--ahead-deliver stream``, as ``server.core.Subscribers.stream``; ``batch``:
  every grant, then every answer, the code before); each reader reads at once (its grant carries the version's checksums: no manifest GET). ``--no-ahead``: leases asked
  after the publish (resolve, manifest, lease, queued), as below; ``--compare`` (default)
  prints both. ``elastic``'s newcomers hold no earlier version: never ahead;
* **the publisher's registration comes first** (``--publish``): the call that completes the
  version is served before anything else at t=0 (:data:`COORD_MS` ``publish_like``, what a
  Hub sends for a model trained in place: the version before's tensors and this one's sums,
  ``RegisterReplica.like``; ``manifest``: the whole manifest, a first version; ``none``: free,
  the model before 2026-12-07); the bind's fixed part (``bind_fixed``) follows;
* **the coordinator is one queue.** Every call (resolve, the manifest GET, the serving
  lease, refreshes, release+register, every worker's heartbeat) costs its service time
  measured by ``benchmarks/bench_routes.py`` (:data:`COORD_MS`; ``--coord-costs``,
  ``--coord-scale``) and is served first come first served by one server; what it decides
  takes effect when it is served. A reader joins a striped plan only if its lease is
  served inside the plan's forming window (``server.stripes.WINDOW``, 50 ms after the first
  member); a later one is a *late joiner*, a carrier at the bottom of the tree (``Plan.join``); once
  a reader registered a complete copy, later ones get no plan. The reader's loop waits for
  each call; a reader is done when its release+register is answered;
* **same-host reads go through the NIC** (``--samehost-path none``, the default): a replica
  on the reader's host -- partial or complete, in GPU memory -- is read through Mooncake,
  the source's NIC up and the reader's NIC down. ``memfd`` credits the code's memfd path
  (``transport/_shm``: complete replicas in Hub CPU memory only), ``nvlink`` a CUDA IPC path
  the code does not have (partial and complete replicas at NVLink speed). Every table says
  which path it models; ``--beside`` (default ``nvlink``) prints a second one beside;
* **chunk-map reads wait behind data**: behind the reader's own reads from that source
  still in flight (one peer's requests are served in order), and behind the bytes queued
  in the source's uplink where it has a queue (``--uplink-queue-ms``; ``--validate``: the
  testbed's ``tc tbf``, 50 ms), not only the RTT (``--rtt-us``);
* **the read loop costs CPU**: per chunk landed, the loop's own (:data:`LOOP_S`,
  :data:`LOOP_S_PER_CHUNK`) and, where the code verifies checksums (CPU destinations under
  ``auto``; ``--checksum``), the hash (:data:`CHECKSUM_BPS`); a chunk is READY in the
  reader's map only after that. ``--measure-cpu`` re-measures both.

The network: every GPU is a worker with its own NIC (``--nic-gbps`` up and down, default
400) and NVLink to the GPUs of its node (``--nvlink-gbps``, used only by
``--samehost-path nvlink``); a node has 8 GPUs; nodes are grouped 16 to a zone; the fabric
inside a datacenter is non-blocking; between two datacenters one link per direction
(``--wan-gbps``); a flow (one chunk read) runs at the equal share of its tightest link (a
conservative stand-in for max-min fairness).

The control loop, ``--protocol``:

* ``chunkmap`` (default; what the client does now, :class:`MapSim`): one lease per reader
  that also registers its partial replica (the coordinator never learns which chunks it
  holds); where one source is scarce the lease carries a striped plan (which replica to
  read each stripe from; ``--no-plans``: without); a reader learns what a partial source
  holds from its chunk map, read one-sided whenever the source has a free slot, at most
  every 10 ms (2 ms for a plan's parents); one refresh of the lease (under a plan: when its
  layout is fixed; else at the first loop turn 100 ms after the start; more only with no
  source or after a 0.5 s stall); the loop's sleeps (0.25 ms doubling to 2 ms with reads in
  flight or under a plan, to 25 ms without; under a plan a map answer is used in the turn
  it arrives, and the loop wakes 0.25 ms after a map read); one release+register at the end;
* ``reports`` (the loop before chunk maps, for comparison only; the old free coordinator,
  no loop or map-read costs; the network and same-host path as above): readers report
  completed chunks every ``--report-ms`` and refresh their sources every ``--refresh-ms``.

Workloads (``--sizes`` GPUs standalone, 1,024 GPUs on 128 nodes for the others):

* ``standalone``: a trainer publishes; every GPU fetches the new version (64, 256, 1,024).
* ``crossdc``: the trainer is in datacenter 0; GPUs are spread over D datacenters (with
  D > 2 the seeders of the others read by one plan across datacenters, scope
  ``tensorhub.server.stripes.WAN``, the trainer's stripes relayed by datacenter 0's readers).
* ``elastic``: 7/8 of the GPUs already serve the version; 1/8 join and fetch it.
* ``kimi`` (:func:`kimi`): a Kimi-K2-class update, 1 TB published sliced by 256 trainer
  ranks, 128 inference GPUs, as the code reads a sliced version today, printed beside
  vLLM's and checkpoint-engine's published figures.

Compared with the lower bound (bytes / bottleneck bandwidth); the JSON also has
single-source, a pre-formed ring and push-then-pull. ``--validate FILE`` runs the model at
the netns testbed's size against ``bench_topology.py fanout``'s file and prints its error
and the cores' busy share per row (the hosts' shared cores are one more link every flow
crosses, :func:`cpu_rate`, leave-one-out); ``--run-testbed`` first runs that benchmark at
``--testbed-rate`` (default 200 Mbit/s, where the links, not the bytes the cores move, are
the limit; needs root).

    python benchmarks/simulate.py                       # the tables + Kimi, both same-host paths
    python benchmarks/simulate.py --only standalone --sizes 1024 --beside off
    python benchmarks/simulate.py --coord-scale 0       # the old model's free coordinator
    python benchmarks/simulate.py --run-testbed --only none           # --validate at 200 Mbit/s
    python benchmarks/simulate.py --validate out/fanout200/bench_fanout.json --only none
    python benchmarks/simulate.py --measure-cpu --only none
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tensorhub._planner import (  # noqa: E402 - the planner the coordinator runs
    LEVELS, Candidate, chunk_order, choose_sources, claims, grid_chunk_bytes, group_key, locality_cost, pick_chunk,
    reserve_chunks, start_fraction, start_reverse,
)
from tensorhub.server.stripes import (  # noqa: E402 - the plans it grants
    HOSTS_IN_PLANS,
    MIN_CHUNKS, NONE, STRIPES, WAN, WINDOW, Plan, plan_root, relayed, wan_root, wan_stripes,
)
from tensorhub._reader import CAP_SHARE, busy_cap, next_gap  # noqa: E402 - the read loop's poll
from tensorhub.protocol import Locality  # noqa: E402

GB = 1e9
GiB = 1 << 30
#: What the paper behind TensorHub reports (TensorHub versus its baselines).
PAPER = {"standalone": 6.7, "elastic": 4.8, "crossdc": 19.0}
#: ``--samehost-path``: how a read from a replica on the reader's own host travels
#: (:attr:`Cluster.samehost`). ``none`` is what the code does for GPU memory and partial replicas.
SAMEHOST_PATHS = ("none", "memfd", "nvlink")
#: Bytes/s one reader copies from a same-host holder's memfd arena: the tensor copy of
#: ``transport/_shm`` measured 11-16 GB/s on this project's VMs (its module docstring).
MEMFD_BPS = 12e9


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
    #: How a read from a replica on the reader's own host travels (:data:`SAMEHOST_PATHS`):
    #: ``none`` (what the code does for GPU memory and for partial replicas: through Mooncake,
    #: i.e. the source's NIC up and the reader's NIC down), ``memfd`` (the code's memfd path,
    #: ``transport/_shm``: complete replicas in Hub CPU memory only, copied by the reader at
    #: ``memfd`` bytes/s; partial ones still over the NIC), ``nvlink`` (a CUDA IPC path the code
    #: does not have yet: partial and complete replicas at NVLink speed).
    samehost: str = "none"
    memfd: float = MEMFD_BPS  # bytes/s one reader copies from a same-host arena

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
        """The links a read from ``src`` into ``dst`` crosses; the first is always the one
        leaving the source (its NIC's uplink for a read through Mooncake)."""
        a, b = self.cl.locality(src), self.cl.locality(dst)
        if a.host == b.host:
            if self.cl.samehost == "nvlink":  # (a CUDA IPC path: not in the code yet)
                return [self._rid(("nvup", src), self.cl.nvlink), self._rid(("nvdn", dst), self.cl.nvlink)]
            if self.cl.samehost == "memfd" and src in self.complete:  # transport/_shm: complete only
                return [self._rid(("memup", src), float("inf")), self._rid(("memcp", dst), self.cl.memfd)]
            # else through Mooncake, like any other host: the source's NIC up, the reader's down
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
#: ``PipelinedReader`` / ``ShardReader`` constants (tensorhub/_pipeline.py, _reader.py, _sources.py).
DEPTH = 2  # reads in flight per source (_sources.DEPTH)
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
# ``ShardReader._busy_cap`` (2026-12-07): while reads are in flight the loop sleeps at most
# CAP_SHARE of the time between two chunks landing (the code's ``busy_cap`` and ``next_gap``:
# seen landed, the loop's lateness included; an idle spell is no gap); under a plan its
# parents' maps are read as often (at most PLAN_STATUS_INTERVAL apart). Before: POLL and
# PLAN_STATUS_INTERVAL (``--cap-share 0`` models that).
LEASE_TTL = 30.0  # renewals every max(0.1, ttl / 3): none in a read shorter than 10 s
FIXED_CALLS = 2  # resolve ("latest") and the manifest GET, before the lease (1: the version was named)

# ---- what the code costs, measured (issue 31: the model credits only what the code does)
#: The coordinator's service time per call, in ms of its one core: it is one Python process
#: whose one event loop answers every request, so a call waits for every call before it
#: (:class:`Coordinator`: one server, first come first served). Measured by
#: ``python benchmarks/bench_routes.py --readers 1024 --addresses runs --no-ahead`` (14 s) on
#: this project's shared 2-core VM, 2026-12-06, two runs on a quiet machine (load ~0.8), CPU
#: ms per request: resolve 0.107 / 0.117, GET manifest 0.137 / 0.127, serving lease 0.547 +
#: 0.430 / 0.547 + 0.508 (first and second half of the 1,024 readers), lease refresh 0.244 /
#: 0.303, complete + release 0.225 / 0.254, heartbeat 0.043 / 0.035, heartbeat + fetch report
#: 0.055 / 0.060. (An earlier session's runs on a busier machine were 1.3-2.4x these: resolve
#: 0.18, manifest 0.215, lease 0.85, refresh 0.355, release 0.55.) The defaults are the means;
#: ``--coord-costs name=ms,...`` sets any of them, ``--coord-scale`` multiplies all.
COORD_MS = {
    "resolve": 0.112,  # POST .../resolve: ``latest`` (or a woken ``wait``)
    "manifest": 0.132,  # GET .../manifest (gzip, encoded once)
    # 2026-12-07 (second session): ``POST /v1/leases`` answered without FastAPI's routing
    # (``server.asgi._Leases``): the lease and refresh rows of ``python benchmarks/bench_routes.py
    # --addresses runs --no-ahead --readers 256``, the tree before and after run one after the
    # other on one machine (a slower day: 3.05 -> 2.27-2.34 ms and 0.938 -> 0.469 ms), applied
    # as ratios (x0.75, x0.50) to the figures measured before (0.508, 0.274).
    "lease": 0.381,  # POST /v1/leases with ``serve``: the grant and the partial replica's registration
    "refresh": 0.137,  # POST /v1/leases, the same lease again (a plan's fixed layout, or a stall)
    "release": 0.240,  # POST /v1/replicas: the complete replica registered + the lease released, one call
    "heartbeat": 0.039,  # every worker, every HEARTBEAT_S
    "report": 0.058,  # the heartbeat of a worker that is reading (it carries a fetch report)
    # Subscribing ahead (tensorhub/server/ahead.py), measured on the state machine (no HTTP) by
    # ``python benchmarks/bench_routes.py --only ahead --reps 5``, 2026-12-06, quiet machine: the
    # bind in the publisher's call (each offer registered, each subscriber in its plan, the
    # layouts fixed) 0.108 ms per subscriber, then each grant made + encoded 0.105 ms
    # (0.213 in all, median of 5 rounds 0.203-0.338), streamed once the version is durable
    # (``server.core.Subscribers.stream``: each answered before the next is made).
    # 2026-12-07: that 0.108 ms was ~40 ms per publish (the new manifest's shape digest and
    # chunk grid, a layout quadratic in the members) spread over 1,024 subscribers; with those
    # made on the registration's parse thread (``server.ahead.warm``) and the layout from a heap, the
    # bind is a fixed 4.5 ms + 0.055 ms per subscriber (bench_routes --only ahead at 16, 64,
    # 256 and 1,024 subscribers: 5.3, 8.6, 18.4, 56.9 ms).
    "bind": 0.055,  # per subscriber, in the call that completes the version (all before any answer)
    "bind_fixed": 4.5,  # once per publish with subscribers, in that call
    # Per subscriber, its grant made from the fixed plan and encoded. 0.105 was measured on a
    # manifest without checksums; a Hub publishes them (on by default) and each grant carries
    # them (``LeaseGrant.sums``), which pydantic wrote at ~0.75 us per 64-bit sum: the code
    # before 2026-12-07 (second session) cost x1.62 that (``bench_routes.py --only ahead --reps
    # 3``, now with one checksum per chunk, 256 chunks, old and new trees alternating: grant +
    # encode 0.57-0.63 ms old, 0.36-0.38 ms new, on that slower day; ``--coord-costs
    # grant=0.170`` models the code before). Now the sums are encoded once per version and
    # spliced (``LeaseAnswers``) and a bound subscriber keeps the plan it joined: x0.62, i.e.
    # the 0.105 measured without sums holds with them.
    "grant": 0.105,
    # Earlier (before the grants were streamed), measured by
    # ``python benchmarks/bench_routes.py --only ahead --reps 5`` (1,024 subscribers on hosts of
    # 8, 50,000 tensors, offers as address runs; 15 s), this shared 2-core VM: ``bind_ahead`` +
    # encoding each grant (``LeaseAnswers.encode``, as ``Subscribers.deliver``; the grant carries
    # the version's checksums, ``LeaseGrant.sums``) per subscriber, median 0.166 ms (quiet
    # machine, 5 rounds 0.160-0.295; an earlier loaded run 0.176); 170 ms for all 1,024, one
    # state call under the lock; the subscribe itself 0.001 ms in the state (before the
    # publish: not modelled).
    # The event loop writing one woken held request's answer (the ASGI answer path; answers
    # encoded in the bind): coordinator CPU per answer between the first and the last answer,
    # measured on the real coordinator process by ``python benchmarks/bench_fleet.py --burst
    # --repeat 2`` (1,024 subscribers; docs/operations/benchmarks.md, "A lease burst"): 146 us
    # on a quiet machine (an earlier run under load: 107 us); issue 31's target ~0.02 ms.
    # 2026-12-07 (second session): the held request answered as two ASGI messages
    # (``server.asgi._Leases``), not through FastAPI's route and response: the coordinator's CPU
    # per subscriber between the first answer and the last, less its grant's make and encode
    # (``server.core.Subscribers._stream`` timed inside the real coordinator process under
    # ``bench_fleet.py --burst --burst-modes ahead``, old and new trees alternating, two rounds
    # each): ~190 -> ~128 us, applied as a ratio (x0.67) to 0.146.
    "wake": 0.098,
    # The publisher's registration of the new version, the call that completes it (before
    # anyone may read it), 50,000 tensors, ``python benchmarks/bench_routes.py`` ("publish"
    # rows): with its whole manifest (parsed and validated on a thread, then the state call)
    # and as the version before's tensors with its own sums (``RegisterReplica.like``: what a
    # Hub sends for a model trained in place, every version after its first). ``--publish``.
    "publish_manifest": 220.0,
    "publish_like": 25.0,
    "lease_plain": 0.178,  # a lease without ``serve`` (nothing registered): as a refresh (0.355 x0.50, above)
    "release_plain": 0.355,  # a release without a registration: as a refresh
    "renew": 0.052,  # a lease renewal: as a heartbeat
}
HEARTBEAT_S = 2.0  # config.heartbeat_interval's default
#: The read loop's own CPU per chunk landed (``ShardReader._loop`` with ``PipelinedReader``'s
#: hooks: pick, submit, poll, mark; its pick scans the chunks left, so it grows with the
#: shard's chunk count): LOOP_S + LOOP_S_PER_CHUNK x chunks. Measured by ``python
#: benchmarks/simulate.py --measure-cpu`` (the real PipelinedReader over a transport whose
#: reads end at once, two complete sources), this VM: 26 / 72 / 260 us at 64 / 256 / 1,024 chunks.
LOOP_S = 11e-6
LOOP_S_PER_CHUNK = 0.24e-6
#: Bytes/s one core verifies (``_checksum``'s xxh3_64, on the loop's thread, before a chunk
#: counts and is marked READY): measured by ``--measure-cpu``, 15-17 GB/s on this loaded VM
#: (the module's docstring: 19-35 GB/s on a quiet one). Under ``TENSORHUB_CHECKSUM=auto``, the
#: default, only destinations in CPU memory are verified: none on a GPU fleet (``--checksum``).
CHECKSUM_BPS = 16e9
#: The netns testbed's shaped queue (``testbed.Testbed._tbf``: ``tc tbf ... latency 50ms``): a
#: busy host's uplink holds up to this many seconds of data ahead of anything it sends.
TESTBED_QUEUE_S = 0.05


class Coordinator:
    """The coordinator as a single-server queue: a call waits for every call that came before
    it (first come, first served), then takes its service time (:data:`COORD_MS`)."""

    def __init__(self, costs_ms: Optional[dict] = None, scale: float = 1.0) -> None:
        self.cost = {k: v * scale / 1e3 for k, v in {**COORD_MS, **(costs_ms or {})}.items()}
        self.q: list = []  # (arrival, order, kind, who)
        self._seq = itertools.count()
        self.free = 0.0  # when the call it serves now ends
        self.busy = 0.0  # seconds served in all
        self.served: dict[str, int] = {}
        self.last: dict[str, float] = {}  # kind -> when the last one of it was answered
        self.waited = 0.0  # the longest wait in the queue

    def ask(self, t: float, kind: str, who: Any) -> None:
        heapq.heappush(self.q, (t, next(self._seq), kind, who))

    def next_end(self) -> float:
        if not self.q:
            return float("inf")
        t, _, kind, _ = self.q[0]
        return max(t, self.free) + self.cost[kind]

    def pop(self) -> tuple[float, str, Any]:
        t, _, kind, who = heapq.heappop(self.q)
        start = max(t, self.free)
        self.waited = max(self.waited, start - t)
        self.free = start + self.cost[kind]
        self.busy += self.cost[kind]
        self.served[kind] = self.served.get(kind, 0) + 1
        self.last[kind] = self.free
        return self.free, kind, who


@dataclass
class MapReader:
    wid: int
    loc: Locality
    need: list  # chunks not submitted yet, in the reader's order
    t0: float = 0.0
    have: set = field(default_factory=set)
    marked: frozenset = frozenset()  # READY bytes in its own chunk map
    marked_coming: frozenset = frozenset()  # COMING bytes
    mark_due: float = 0.0  # ... and what they become at mark_due (the loop verifies first)
    mark_next: Optional[tuple] = None
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
    map_wait: float = 0.0  # seconds its map reads waited behind data, in all
    wake: float = 0.0
    sleep: float = POLL / 8
    done_t: Optional[float] = None
    blocked: bool = True  # waiting for a coordinator answer (its loop is in ``get_sources``)
    start_t: Optional[float] = None  # when its lease was answered
    read_t: Optional[float] = None  # when its loop started reading (after the lease and, asked ahead, the manifest)
    data_t: Optional[float] = None  # when its last chunk landed (before its release+register)
    granted: bool = False  # asked ahead: its lease came with the bind (next: the version's manifest, then read)
    leased: bool = False  # its lease (and so its partial replica) registered
    plan_key: Optional[tuple] = None  # (datacenter, root) of the plan it is a member of
    plan: Optional[list] = None  # parent replica id per stripe (NONE: none yet)
    plan_refresh: float = 0.0  # when to ask again for the fixed plan (0: fixed)
    dirty: bool = True  # something a submit step looks at changed since the last one (else it picks nothing)
    stalled: bool = False
    parked: Optional[tuple] = None  # (next wake, its sleep, nap, sleep cap): its turns do nothing until an event
    rank: dict = field(default_factory=dict)  # chunk -> its place in the reader's order
    needset: set = field(default_factory=set)  # = set(need)
    busy: dict = field(default_factory=dict)  # source -> its reads in flight (from inflight)
    landed_at: Optional[float] = None  # the last chunk seen landed in a busy spell (``ShardReader._landed_at``)
    gap_s: Optional[float] = None  # seconds between two landings, smoothed (``ShardReader._gap_s``)


class MapSim(Sim):
    """The control loop as implemented with chunk maps (``_pipeline``, ``_chunkmap``, ``_fetch``):

    * every call to the coordinator (resolve, manifest, lease, refresh, release+register, and
      every worker's heartbeat) is a job of a single-server queue, first come first served
      (:class:`Coordinator`, service times :data:`COORD_MS`); its answer, and what it decides
      (a plan's membership, a complete replica), take effect when it is served. The reader's
      loop waits for each of its calls (``get_sources`` is synchronous): reads in flight go
      on, nothing new is submitted or marked meanwhile; a reader is done when its
      release+register is answered (only then are its bytes known good);
    * one pipelined lease per reader, which also registers its partial replica: the
      coordinator knows it holds *nothing* (it never hears of chunks), so partial
      candidates are ordered by load and registration only, and no reservations or claims
      are made (``server.state.acquire_lease``: ``own`` is None for a chunk-map replica); where
      one source is scarce the coordinator's striped plan (``server.stripes.Plan``, joined and
      asked exactly as ``server.grants._planned`` does, at the time the lease is *served*: inside
      the plan's forming window a member, after it a late joiner -- a carrier at the tree's bottom --
      and, once some reader registered a complete copy, no plan) names each stripe's parent
      instead, and the reader reads each stripe only from it (any source after a stall);
    * the reader loop of ``ShardReader._loop``: submit (sources by cost, partial first,
      least busy; ``pick_chunk`` over what each source's map said), then the chunk maps
      (take in reads that completed; read again the map of every partial source with a free
      slot, at most every ``STATUS_INTERVAL``), then the refresh rule, then poll; sleep
      0.25 ms doubling to 2 ms with reads in flight, to 25 ms without; a completed chunk
      costs the loop ``LOOP_S + LOOP_S_PER_CHUNK x chunks`` and, where checksums are
      verified, its hash (``checksum_bps``), and is marked READY in the reader's own map
      after that (what it receives is marked COMING); under a plan, maps whose read ended
      are taken in before the submit step too (``PipelinedReader._fill``) and the loop
      sleeps at most 0.25 ms while a map read is in flight (``PipelinedReader._nap``);
    * a chunk-map read takes ``rtt`` plus its wait behind data at the source: behind this
      reader's own reads from that source still in flight (one peer's requests are served
      in order, on one connection / queue pair), and, where the source's uplink has a
      queue (``queue_s``: the testbed's ``tc tbf``), behind the bytes in it;
    * the coordinator is asked again once, at the first loop turn ``FIRST_REFRESH`` after
      the start (if chunks are still to submit), beyond that only with no source or after a
      stall (nothing in flight, nothing landed for ``CLAIM_PATIENCE``); a refresh adds to
      the sources (those of the earlier answer stay usable under the same lease).

    Time advances in steps of at least ``tick`` seconds (rates held for a step; a read that
    ends inside a step frees its share at the step's end)."""

    @property
    def _hosts_in_plans(self) -> bool:
        """Plans lay out by host where a same-host path exists for partial replicas (the code:
        ``server.stripes.HOSTS_IN_PLANS``, none yet; ``--samehost-path nvlink`` models one)."""
        return HOSTS_IN_PLANS or self.cl.samehost == "nvlink"

    def __init__(self, cl: Cluster, nbytes: float, num_chunks: int, *, rtt: float = 50e-6,
                 tick: float = 0.25e-3, fixed_calls: int = FIXED_CALLS, plans: bool = True,
                 coord: Optional[Coordinator] = None, checksum_bps: float = 0.0, queue_s: float = 0.0,
                 loop_s: Optional[float] = None, heartbeats: bool = True, ahead: bool = False,
                 deliver: str = "stream", publish: Optional[str] = None, cap_share: float = CAP_SHARE,
                 **kw) -> None:
        super().__init__(cl, nbytes, num_chunks, **kw)
        self.cap_share = cap_share  # ``ShardReader.CAP_SHARE`` (0: the poll before it)
        #: The publisher's registration (a :data:`COORD_MS` call) that completes the version
        #: at t=0, before anything else the coordinator serves; None: not charged.
        self.publish = publish
        self.rtt, self.tick, self.fixed_calls = rtt, tick, fixed_calls
        #: Subscribed ahead (:meth:`_bind`): every reader's lease is held before the publish and
        #: bound by the call that completes the version; ``deliver``: ``stream`` (the code: then
        #: each grant made, encoded and its answer written by the event loop, one after the
        #: other) or ``batch`` (the code before: every grant made, then every answer written).
        self.ahead, self.deliver = ahead, deliver
        self.bind_order: list = []
        self._binds_left = 0
        self.plans_on, self.plans, self.now = plans, {}, 0.0
        self.coord = coord if coord is not None else Coordinator()
        self.queue_s, self.heartbeats = queue_s, heartbeats
        #: the loop's seconds per chunk landed: its own CPU and the checksum (0: not verified)
        self.per_chunk = (LOOP_S + LOOP_S_PER_CHUNK * num_chunks if loop_s is None else loop_s) + \
            (self.chunk / checksum_bps if checksum_bps else 0.0)
        self.mreaders: dict[int, MapReader] = {}
        for k, w in enumerate(self.readers):
            order = chunk_order(num_chunks, start_fraction(k), start_reverse(k))
            self.mreaders[w] = MapReader(w, self.cl.locality(w), list(order), rank={c: i for i, c in enumerate(order)},
                                         needset=set(order))
        self.ids = {w: k for k, w in enumerate([-1, *self.complete.keys() - {-1}, *self.readers])}  # registration order
        # flows (one chunk read each) as arrays: reader, source, chunk, bytes left, links crossed
        self.f_r = np.zeros(0, dtype=np.int64)
        self.f_s = np.zeros(0, dtype=np.int64)
        self.f_c = np.zeros(0, dtype=np.int64)
        self.f_rem = np.zeros(0)
        self.f_rate = np.zeros(0)
        self.f_idx = np.zeros((0, 4), dtype=np.int64)
        self._new: list = []
        self._map_req: list = []  # chunk-map reads asked in this step: (reader, source)
        self._wakes: list = []  # (time, reader id): the readers' next turns (stale entries skipped)
        self.ndone = 0

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
        """As ``server.grants._planned``: a plan (``tensorhub.server.stripes``) where one source is
        scarce; True when the reader's sources come from its plan. ``self.now`` is the time
        the coordinator serves the call."""
        if not self.plans_on:
            return False
        if r.plan_key is None:
            if r.leased or self.n < MIN_CHUNKS or self.policy != "topology":
                return False
            dc_key = (LEVELS[-1],) + group_key(r.loc, LEVELS[-1])
            seeder = self.seeders.get(dc_key)
            seeder_rid = self._rid_of(seeder) if seeder is not None and seeder != r.wid and \
                seeder in self.mreaders and self.mreaders[seeder].leased and seeder not in self.complete else None
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
            plan.join(str(r.wid), self._rid_of(r.wid), self.now, r.loc.host if self._hosts_in_plans else None)
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
        """What the coordinator answers a lease or a refresh (when it serves it)."""
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

    def _ask(self, r: MapReader, kind: str, t: float) -> None:
        """``r`` calls the coordinator at ``t`` and waits for the answer (:meth:`_serve`)."""
        r.blocked, r.wake, r.parked = True, float("inf"), None
        self.coord.ask(t, kind, r.wid)

    def _serve(self, now: float) -> None:
        """The coordinator's calls answered by ``now``, each taking effect when it ended."""
        co = self.coord
        while co.q and co.next_end() <= now + 1e-12:
            end, kind, who = co.pop()
            if kind in ("heartbeat", "report"):
                o = self.mreaders.get(who)
                co.ask(end + HEARTBEAT_S, "report" if o is not None and o.done_t is None and o.start_t is not None
                       else "heartbeat", who)
                continue
            self.now, self._cands = end, None
            if who == -1:  # the publisher's registration, the bind's fixed part: only the coordinator's time
                continue
            if kind == "bind":  # subscribed ahead: one per subscriber, back to back (the publisher's call)
                self._binds_left -= 1
                if self._binds_left == 0:
                    self._bind()  # offers registered, plans fixed; then the grants, in plan order
                    self._pos = {w: i for i, w in enumerate(self.bind_order)}
                    self._grants_left = len(self.bind_order)
                    for w in self.bind_order[:1] if self.deliver == "stream" else self.bind_order:
                        co.ask(end, "grant", w)
                continue
            r = self.mreaders[who]
            if kind == "grant":  # made and encoded (``server.core.Subscribers.stream``)
                self._grants_left -= 1
                if self.deliver == "stream":
                    co.ask(end, "wake", who)  # answered at once, before the next grant
                elif self._grants_left == 0:  # batch: every grant first, then the wake-ups
                    for w in self.bind_order:
                        co.ask(end, "wake", w)
            elif kind == "wake":
                self._answered(r, end)
                i = self._pos[who] + 1
                if self.deliver == "stream" and i < len(self.bind_order):
                    co.ask(end, "grant", self.bind_order[i])
            elif kind == "resolve":
                co.ask(end, "manifest", who)
            elif kind == "manifest":
                co.ask(end, "lease", who)
            elif kind in ("lease", "refresh"):
                self._lease(r)
                if kind == "lease":
                    r.start_t = r.read_t = r.t0 = r.last_refresh = r.last_progress = end
                r.blocked = False
                self._wake(r, end)
            elif kind == "release":
                r.done_t = end
                self.ndone += 1
                self.complete[r.wid] = r.loc  # registered as a complete replica
                for w in r.named:
                    self.load[w] -= 1
                self._cands = None
        self.now = now

    def _bind(self) -> None:
        """The call that completes the version binds every subscriber (``server.ahead.bind``): each
        one whose plan is in its own datacenter joins it in arrival order (``Grants.join_ahead``:
        the same ``server.stripes.Plan.join``), each such plan's layout is fixed (``Plan.fix``: all of
        them members, none late, no refresh), then every grant is made (``acquire_lease``:
        here :meth:`_lease`) -- the plans' members in plan order, then the others (readers
        that would seed their datacenter through a plan across datacenters, or readers of a
        datacenter that has no complete replica: the usual grant, a plan that forms as they
        come, and its refresh). :attr:`bind_order` is the order the answers leave in."""
        rs = list(self.mreaders.values())  # (arrival order: the readers' order)
        plans: dict = {}
        for r in rs:
            key = self._join_ahead(r)
            if key is not None:
                plans[key] = self.plans[key]
        for plan in plans.values():
            plan.fix()
        first = [r for r in rs if r.plan_key in plans]
        first.sort(key=lambda r: self.plans[r.plan_key].order[str(r.wid)])
        rest = [r for r in rs if r.plan_key not in plans]
        for r in first + rest:
            self._cands = None
            self._lease(r)
            r.granted = True
        self.bind_order = [r.wid for r in first + rest]

    def _join_ahead(self, r: MapReader) -> Optional[tuple]:
        """``Grants.join_ahead``: the plan of ``r``'s datacenter it joins before any grant is
        made (its offer registered), or None (no such plan now, or only one across datacenters)."""
        if not self.plans_on or self.n < MIN_CHUNKS or self.policy != "topology":
            return None
        root = plan_root(r.loc, str(r.wid), self._candidates(), None)  # (no seeder yet: no grant made)
        if root is None:
            return None  # (a plan across datacenters, or none: the usual grant after the home plans)
        key = (r.loc.datacenter, root)
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = Plan(root, STRIPES, self.now)
        elif plan.fixed is not None:
            return None
        r.plan_key = key
        plan.join(str(r.wid), self._rid_of(r.wid), self.now, r.loc.host if self._hosts_in_plans else None)
        r.leased, self._cands = True, None  # its offer registered (its partial replica): a parent from now
        return key

    def _answered(self, r: MapReader, t: float) -> None:
        """A held lease's answer reached its reader at ``t``: it reads at once (the grant
        carries the version's checksums, ``LeaseGrant.sums``: with the tensors it offered
        they make the manifest, so it reads none)."""
        r.start_t = r.read_t = r.t0 = r.last_refresh = r.last_progress = t
        r.blocked = False
        self._wake(r, t)

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

    def _add_flow(self, r: MapReader, s: int, ch: int) -> None:
        p = self._path(s, r.wid)
        self._new.append((r.wid, s, ch, p + [-1] * (4 - len(p))))

    def _submit_step(self, r: MapReader, now: float, busy: dict) -> None:
        stalled = not r.inflight and now - r.last_progress > CLAIM_PATIENCE
        if not r.dirty and stalled == r.stalled:
            return  # (a speed-up only: the same inputs pick the same nothing)
        r.dirty, r.stalled = False, stalled
        progressed = True
        spill: Optional[list] = None
        while r.need and progressed:
            progressed = False
            for c, _ in sorted(r.sources, key=lambda p: (p[1], p[0].chunks is None, busy.get(int(p[0].worker_id), 0))):
                s = int(c.worker_id)
                if not r.need or busy.get(s, 0) >= self.depth:
                    continue
                held = self._held(r, c)
                if r.plan is not None and not stalled:  # its plan: each stripe from its parent first
                    # (pick_chunk over the stripes it parents, with no other sources: the first
                    # such chunk in the reader's order that it holds)
                    plan, d, rid = r.plan, len(r.plan), c.replica_id
                    if held is None or len(held) >= len(r.need):
                        ch = next((x for x in r.need if plan[x % d] == rid and (held is None or x in held)), None)
                    else:
                        ch = min((x for x in held if x in r.needset and plan[x % d] == rid), key=r.rank.__getitem__,
                                 default=None)
                    if ch is None and held is not None and SPILL:  # a member: what it holds of the
                        # stripes whose parent already holds all of theirs (as PipelinedReader._spillable)
                        if spill is None:
                            spill = self._spillable(r)
                        if spill:
                            others = [self._held(r, o) for o, _ in r.sources if o is not c]
                            ch = pick_chunk(spill, held, others, set())
                else:
                    others = [self._held(r, o) for o, _ in r.sources if o is not c]
                    coming = frozenset().union(*(r.mcoming.get(int(o.worker_id), frozenset()) for o, _ in r.sources))
                    if stalled:
                        coming = frozenset()
                    ch = pick_chunk(r.need, held, others, set(), coming)
                if ch is None:
                    continue
                r.need.remove(ch)
                r.needset.discard(ch)
                spill = None
                if r.landed_at is None:
                    r.landed_at = now
                r.inflight[ch] = s
                self._add_flow(r, s, ch)
                busy[s] = busy.get(s, 0) + 1
                progressed = True

    def _busy_cap(self, r: MapReader) -> float:
        """``ShardReader._busy_cap``: the loop's longest sleep while reads are in flight."""
        return busy_cap(r.gap_s, POLL, self.cap_share)

    def _map_gap(self, r: MapReader) -> float:
        """Least seconds between two reads of one source's chunk map (``PipelinedReader._maps``)."""
        return STATUS_INTERVAL if r.plan is None else min(PLAN_STATUS_INTERVAL, self._busy_cap(r))

    def _intake(self, r: MapReader) -> None:
        """Take in the chunk maps whose reads completed (``PipelinedReader._take_maps``)."""
        if not r.map_result:
            return
        for s, (ready, coming) in list(r.map_result.items()):
            del r.map_result[s]
            old = r.avail.get(s, frozenset())
            got = (ready | old, coming - old)
            if got != (old, r.mcoming.get(s, frozenset())):
                r.dirty = True
            r.avail[s], r.mcoming[s] = got

    def _waits(self, req: list) -> list[float]:
        """How long each chunk-map read ``(reader, source)`` waits behind data (class
        docstring): behind that reader's reads from that source in flight (until they end,
        at this step's rates) and, with ``queue_s``, behind the bytes queued on the source's
        uplink (at most ``queue_s`` of them). One pass over the flows for all of a step's."""
        out = [0.0] * len(req)
        if not len(self.f_rem):
            return out
        big = 1_000_003
        rk = [r.wid * big + s + 1 for r, s in req]
        fk = self.f_r * big + self.f_s + 1
        sel = np.nonzero(np.isin(fk, np.asarray(rk, dtype=np.int64)))[0]
        if len(sel):
            eta: dict = {}
            for k, e in zip(fk[sel].tolist(), (self.f_rem[sel] / np.maximum(self.f_rate[sel], 1e-3)).tolist()):
                eta[k] = max(eta.get(k, 0.0), e)
            out = [eta.get(k, 0.0) for k in rk]
        if self.queue_s > 0:
            upq = np.bincount(self.f_idx[:, 0], weights=self.f_rem, minlength=len(self.cap))
            for i, (_, s) in enumerate(req):
                rid = self._res.get(("up", s))
                if rid is not None:
                    cap = self.cap[rid]
                    out[i] = max(out[i], min(float(upq[rid]), self.queue_s * cap) / cap)
        return out

    def _map_wait(self, r: MapReader, s: int) -> float:
        """:meth:`_waits` of one chunk-map read."""
        return self._waits([(r, s)])[0]

    def _send_maps(self, now: float) -> None:
        """The chunk-map reads asked in this step go out (their answers at rtt + wait)."""
        if not self._map_req:
            return
        req, self._map_req = self._map_req, []
        for (r, s), w in zip(req, self._waits(req)):
            r.map_wait += w
            r.map_pending[s] = now + self.rtt + w
            heapq.heappush(self._pending, (now + self.rtt + w, r.wid, s))

    def _maps_step(self, r: MapReader, now: float, busy: dict) -> None:
        self._intake(r)
        if not r.need:
            return
        for c, _ in r.sources:
            s = int(c.worker_id)
            if c.chunks is None or s in r.map_pending or busy.get(s, 0) >= self.depth:
                continue
            if s in r.avail and now - r.map_last.get(s, 0.0) < self._map_gap(r):
                continue
            r.map_pending[s] = float("inf")  # (sent at the end of the step: :meth:`_send_maps`)
            r.map_last[s] = now
            r.map_reads += 1
            self._map_req.append((r, s))

    def _refresh_step(self, r: MapReader, now: float, busy: dict) -> None:
        if r.plan_refresh and now >= r.plan_refresh and r.need:  # the plan's layout is fixed now
            r.last_refresh, r.refreshes = now, r.refreshes + 1
            self._ask(r, "refresh", now)
            return
        if r.plan is not None and not r.plan_refresh:  # a fixed plan: nothing to learn, unless stalled
            if r.need and not r.inflight and now - r.last_progress > CLAIM_PATIENCE and \
                    now - r.last_refresh >= REFRESH:
                r.last_refresh, r.stalls = now, r.stalls + 1
                self._ask(r, "refresh", now)
            return
        idle = not r.sources or any(busy.get(int(c.worker_id), 0) < self.depth for c, _ in r.sources)
        if not r.need or now - r.last_refresh < REFRESH * (1 if idle else 2):
            return
        trouble = not r.inflight and now - r.last_progress > CLAIM_PATIENCE
        if r.sources and not trouble and (r.refreshes >= MAX_REFRESHES or now - r.t0 < FIRST_REFRESH):
            return
        r.last_refresh = now
        if r.sources and not trouble:
            r.refreshes += 1
        else:
            r.stalls += 1
        self._ask(r, "refresh", now)

    def _marks(self, h: MapReader, t: float) -> tuple:
        """``h``'s chunk map as read at ``t``."""
        if h.mark_next is not None and t >= h.mark_due:
            h.marked, h.marked_coming = h.mark_next
            h.mark_next = None
        return h.marked, h.marked_coming

    def _turn(self, r: MapReader, now: float) -> None:
        """One turn of the reader's loop (twice when a read was seen complete: no sleep,
        unless verifying and marking what landed keeps the loop busy for a tick or more)."""
        self._marks(r, now)
        cpu = 0.0
        for _ in range(2):
            busy = r.busy  # (every source it has in flight from is one of its sources: they only grow)
            if r.plan is not None:
                self._intake(r)
            self._submit_step(r, now, busy)
            self._maps_step(r, now, busy)
            self._refresh_step(r, now, busy)
            if r.blocked:
                return  # in get_sources: the rest of the turn once the coordinator answered
            done = [x for x in r.landed if x[2] <= now]
            if done:
                r.landed = [x for x in r.landed if x[2] > now]
                for ch, s, _ in done:
                    r.have.add(ch)
                    if r.inflight.pop(ch, None) is not None:
                        busy[s] -= 1
                if r.landed_at is not None:
                    r.gap_s = next_gap(r.gap_s, now - r.landed_at, len(done))
                    r.landed_at = now
                r.last_progress, r.dirty = now, True
                cpu += len(done) * self.per_chunk  # verified and marked one by one, on the loop's thread
            if not r.inflight:
                r.landed_at = None  # (as ``ShardReader._landed``: an idle spell is no gap)
            if done or len(r.marked_coming) != len(r.inflight):  # tick: READY for what completed,
                # COMING for what it receives (once the loop got through them)
                if cpu > 0:
                    r.mark_due, r.mark_next = now + cpu, (frozenset(r.have), frozenset(r.inflight))
                else:
                    r.marked, r.marked_coming = frozenset(r.have), frozenset(r.inflight)
            if len(r.have) == self.n:
                r.calls += 1  # release + register the complete replica, one call
                r.data_t = now
                self._ask(r, "release", now + cpu)
                return
            if not done:
                break
            r.sleep = POLL / 8
            if cpu >= self.tick:
                self._wake(r, now + cpu)
                return
        wake = now + cpu + r.sleep
        if r.plan is not None and r.map_pending:
            wake = min(wake, now + cpu + max(self.tick, POLL / 8))
        r.sleep = min(r.sleep * 2, self._busy_cap(r) if r.inflight or r.plan is not None else IDLE_CAP)
        if r.plan_refresh:
            wake = min(wake, max(now + self.tick, r.plan_refresh))
        # (a speed-up only) turns that cannot change anything are skipped: the reader wakes at
        # the first of its would-be turns at or after the next thing that can change its state
        # (a map answer, a map read due, the plan's refresh, a stall) or after a read lands
        # (:meth:`_landed`): same sleeps, same turns that matter
        t = self._next_event(r, now, busy)
        if t > wake + 1e-12:
            nap = max(self.tick, POLL / 8) if r.plan is not None and r.map_pending else 0.0
            cap = self._busy_cap(r) if r.inflight or r.plan is not None else IDLE_CAP
            parked = (wake, r.sleep, nap, cap)
            w, r.sleep = self._advance(parked, t)
            self._wake(r, w)
            r.parked = parked
            return
        self._wake(r, wake)

    def _next_event(self, r: MapReader, now: float, busy: dict) -> float:
        """The earliest time something other than a landing read can change what ``r``'s
        loop does (``now``: at once)."""
        if r.dirty or r.landed or r.map_result or not r.sources:
            return now
        t = float("inf")
        for c, _ in r.sources:
            s = int(c.worker_id)
            if s in r.map_pending:
                t = min(t, r.map_pending[s])  # (inf: asked in this turn, answered after the step: no skip)
                if t == float("inf"):
                    return now
            elif c.chunks is not None and busy.get(s, 0) < self.depth and r.need:
                if s not in r.avail:
                    return now
                t = min(t, r.map_last.get(s, 0.0) + self._map_gap(r))
        if r.plan_refresh:
            t = min(t, r.plan_refresh)
        if not r.inflight:  # a stall: claims dropped, a refresh
            t = min(t, r.last_progress + CLAIM_PATIENCE, max(r.last_progress + CLAIM_PATIENCE,
                                                            r.last_refresh + REFRESH))
        if r.plan is None and r.need and r.refreshes < MAX_REFRESHES:
            t = min(t, max(r.last_refresh + REFRESH, r.t0 + FIRST_REFRESH))
        return max(t, now)

    def _advance(self, parked: tuple, t: float) -> tuple[float, float]:
        """The first of a parked reader's would-be turns at or after ``t``, and its sleep then."""
        w, sl, nap, cap = parked
        while w < t:
            step = min(sl, nap) if nap else sl
            if sl >= cap or (nap and sl >= nap):  # constant steps from here on
                w += max(1, -(-(t - w) // step)) * step
                sl = cap
                break
            w, sl = w + step, min(sl * 2, cap)
        return w, sl

    def _wake(self, r: MapReader, t: float) -> None:
        r.parked, r.wake = None, t
        heapq.heappush(self._wakes, (t, r.wid))

    def _landed(self, r: MapReader, t: float) -> None:
        """A read of a parked reader landed at ``t``: its next turn is the first of its
        would-be turns at or after ``t``, if that comes before the one it was parked for."""
        w, sl = self._advance(r.parked, t)
        if w < r.wake:
            parked = r.parked
            r.sleep = sl
            self._wake(r, w)
            r.parked = parked

    def _merge_new(self) -> None:
        if not self._new:
            return
        new = self._new
        self._new = []
        self.f_r = np.concatenate([self.f_r, np.fromiter((x[0] for x in new), np.int64, len(new))])
        self.f_s = np.concatenate([self.f_s, np.fromiter((x[1] for x in new), np.int64, len(new))])
        self.f_c = np.concatenate([self.f_c, np.fromiter((x[2] for x in new), np.int64, len(new))])
        self.f_rem = np.concatenate([self.f_rem, np.full(len(new), self.chunk)])
        self.f_idx = np.concatenate([self.f_idx, np.array([x[3] for x in new], dtype=np.int64)])

    def _flow_rates(self) -> np.ndarray:
        """Each flow's rate: the equal share of its tightest link."""
        ncap = len(self.cap)
        idx = np.where(self.f_idx < 0, ncap, self.f_idx)
        cap = np.append(np.asarray(self.cap), np.inf)
        counts = np.bincount(idx.ravel(), minlength=ncap + 1).astype(float)
        share = cap / np.maximum(counts, 1.0)
        share[ncap] = np.inf
        return share[idx].min(axis=1)

    def run(self, t_max: float = 3600.0) -> dict:
        now = 0.0
        self._pending: list[tuple] = []  # heap: (time a map read's answer arrives, reader, source)
        co = self.coord
        first = "resolve" if self.fixed_calls >= 2 else "manifest"
        rs = list(self.mreaders.values())
        if self.publish is not None:  # the version completes when the publisher's registration is answered
            co.ask(0.0, self.publish, -1)
        if self.ahead:  # every lease held since before the publish: bound in the publish's call
            co.ask(0.0, "bind_fixed", -1)
            self.bind_order = [r.wid for r in rs]  # (stream: the order is known before the grants)
            self._binds_left = len(rs)
            for k, r in enumerate(rs):
                r.blocked, r.wake = True, float("inf")
                co.ask(0.0, "bind", k)
        else:
            for r in rs:  # every reader asks at once (woken by the publish); its lease registers its partial replica
                self._ask(r, first, 0.0)
        if self.heartbeats:  # every worker's heartbeat, spread over the interval
            who = [-1, *self.complete.keys() - {-1}, *self.mreaders]
            for k, w in enumerate(who):
                co.ask(HEARTBEAT_S * (k + 0.5) / len(who), "heartbeat", w)
        wakes = self._wakes
        full = frozenset(range(self.n))
        while self.ndone < len(rs) and now < t_max:
            self._cands, self._groups, self.now = None, {}, now
            self._serve(now)
            due = []
            while wakes and wakes[0][0] <= now + 1e-12:
                t, w = heapq.heappop(wakes)
                r = self.mreaders[w]
                if t == r.wake and r.done_t is None and not r.blocked:
                    r.wake = float("inf")
                    due.append(r)
            for r in sorted(due, key=lambda x: self.ids[x.wid]):  # (in the readers' order, as before)
                self._turn(r, now)
            self._merge_new()
            m = len(self.f_rem)
            if m:
                rates = self.f_rate = self._flow_rates()
            self._send_maps(now)
            while wakes and (wakes[0][0] != self.mreaders[wakes[0][1]].wake):
                heapq.heappop(wakes)  # (stale)
            nxt = min(co.next_end(), wakes[0][0] if wakes else float("inf"),
                      self._pending[0][0] if self._pending else float("inf"))
            if m:
                nxt = min(nxt, now + float((self.f_rem / rates).min()))
            if nxt == float("inf"):
                break  # (nothing left to happen: a reader stuck for good)
            step = max(self.tick, nxt - now)
            if m:
                left = self.f_rem - rates * step
                fin = left <= 1e-6 * self.chunk
                for i in np.nonzero(fin)[0].tolist():
                    rw, s, c = int(self.f_r[i]), int(self.f_s[i]), int(self.f_c[i])
                    r = self.mreaders[rw]
                    t = now + float(self.f_rem[i] / rates[i])
                    r.landed.append((c, s, t))
                    if r.parked is not None:
                        self._landed(r, t)
                    if s == -1:
                        self.from_trainer += self.chunk
                    if self.cl.locality(s).datacenter != r.loc.datacenter:
                        self.crossed += self.chunk
                keep = ~fin
                self.f_rem = left[keep]
                self.f_r, self.f_s, self.f_c, self.f_idx = self.f_r[keep], self.f_s[keep], self.f_c[keep], \
                    self.f_idx[keep]
                self.f_rate = rates[keep]
            now += step
            while self._pending and self._pending[0][0] <= now:  # map reads that completed: what the
                t, rw, s = heapq.heappop(self._pending)  # holder's map said then
                r = self.mreaders[rw]
                h = self.mreaders.get(s)
                r.map_pending.pop(s, None)
                r.map_result[s] = (full, frozenset()) if h is None or h.done_t is not None else self._marks(h, t)
        times = [r.done_t if r.done_t is not None else float("inf") for r in rs]
        fixed = 0 if self.ahead else self.fixed_calls  # (asked ahead: no manifest; the held lease is r.calls)
        calls = [fixed + r.calls + int((r.done_t or 0) // max(0.1, LEASE_TTL / 3)) for r in rs]
        roles = {"member": 0, "late": 0, "none": 0}
        for r in rs:
            plan = self.plans.get(r.plan_key) if r.plan_key is not None else None
            roles["none" if plan is None else "late" if str(r.wid) in plan.late else "member"] += 1
        starts = [r.start_t for r in rs if r.start_t is not None]
        return {"seconds": max(times), "crossed_bytes": self.crossed, "from_trainer_bytes": self.from_trainer,
                "calls_mean": float(np.mean(calls)), "calls_max": max(calls),
                "refreshes_mean": float(np.mean([r.refreshes for r in rs])),
                "stall_refreshes_mean": float(np.mean([r.stalls for r in rs])),
                "map_reads_mean": float(np.mean([r.map_reads for r in rs])),
                "map_wait_ms_mean": 1e3 * float(np.mean([r.map_wait / max(1, r.map_reads) for r in rs])),
                "plan_members": roles["member"], "plan_late": roles["late"], "no_plan": roles["none"],
                "first_lease_s": min(starts, default=float("nan")), "last_lease_s": max(starts, default=float("nan")),
                "last_read_s": max((r.read_t for r in rs if r.read_t is not None), default=float("nan")),
                "last_data_s": max((r.data_t for r in rs if r.data_t is not None), default=float("nan")),
                "data_s_max": max((r.data_t - r.read_t for r in rs if r.data_t is not None and r.read_t is not None),
                                  default=float("nan")),
                "ahead": self.ahead, "deliver": self.deliver if self.ahead else "-",
                "coord_busy_s": co.busy, "coord_longest_wait_s": co.waited, "coord_served": dict(co.served)}


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
def coordinator(args: argparse.Namespace) -> Coordinator:
    """The coordinator queue with ``--coord-costs`` / ``--coord-scale`` applied."""
    costs = {}
    for item in filter(None, (getattr(args, "coord_costs", "") or "").split(",")):
        k, _, v = item.partition("=")
        if k.strip() not in COORD_MS:
            raise SystemExit(f"--coord-costs: unknown call {k.strip()!r} (one of {', '.join(COORD_MS)})")
        costs[k.strip()] = float(v)
    return Coordinator(costs, getattr(args, "coord_scale", 1.0))


def checksum_rate(args: argparse.Namespace, cpu_memory: bool) -> float:
    """Bytes/s the reader's loop verifies (0: no checksums): ``auto`` verifies CPU destinations only."""
    mode = getattr(args, "checksum", "auto")
    return CHECKSUM_BPS if mode == "on" or (mode == "auto" and cpu_memory) else 0.0


def make_sim(args: argparse.Namespace, cl: Cluster, nbytes: float, chunks: int, fixed_calls: int = FIXED_CALLS,
             cpu_memory: bool = False, queue_s: Optional[float] = None, **kw) -> Sim:
    """The control loop asked for: ``chunkmap`` (as implemented) or ``reports`` (before chunk maps)."""
    if args.protocol == "reports":
        return Sim(cl, nbytes, chunks, **kw)
    if queue_s is None:
        queue_s = getattr(args, "uplink_queue_ms", 0.0) / 1e3
    return MapSim(cl, nbytes, chunks, rtt=args.rtt_us * 1e-6, tick=args.tick_ms / 1e3, fixed_calls=fixed_calls,
                  plans=getattr(args, "plans", True), coord=coordinator(args),
                  checksum_bps=checksum_rate(args, cpu_memory), queue_s=queue_s, ahead=getattr(args, "ahead", False),
                  deliver=getattr(args, "ahead_deliver", "stream"),
                  publish=None if getattr(args, "publish", "none") == "none" else f"publish_{args.publish}",
                  cap_share=getattr(args, "cap_share", CAP_SHARE), **kw)


def workload(name: str, args: argparse.Namespace, dcs: int, nodes: Optional[int] = None,
             samehost: Optional[str] = None) -> dict:
    samehost = samehost or getattr(args, "samehost_path", "none")
    cl = Cluster(nodes=nodes or args.nodes, dcs=dcs, nic=args.nic_gbps * 1e9 / 8, nvlink=args.nvlink_gbps * 1e9 / 8,
                 wan=args.wan_gbps * 1e9 / 8, samehost=samehost,
                 memfd=getattr(args, "memfd_gbps", MEMFD_BPS * 8 / 1e9) * 1e9 / 8)
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
    if name == "elastic":  # newcomers hold no earlier version: nothing to subscribe ahead from (nor a publish)
        args = argparse.Namespace(**dict(vars(args), ahead=False, publish="none"))
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
        "workload": name, "gpus": n_gpu, "datacenters": dcs, "readers": n, "gib": args.gib, "samehost": samehost,
        "tensorhub": th["seconds"], "single_source": single, "ring": ring(cl, nbytes, n),
        "push_pull": push_pull(cl, nbytes, n, args.storage_gbps), "lower_bound": lower_bound(cl, nbytes, dcs, host_source=bool(holders)),
        "crossed_x": th["crossed_bytes"] / nbytes, "trainer_x": th["from_trainer_bytes"] / nbytes,
        "sim_wall_s": wall, "chunks": chunks, "protocol": args.protocol,
        "calls_per_reader": th.get("calls_mean"), "calls_max": th.get("calls_max"),
        "refreshes_per_reader": th.get("refreshes_mean"),
        "stall_refreshes_per_reader": th.get("stall_refreshes_mean"), "map_reads_per_reader": th.get("map_reads_mean"),
        **{k: th.get(k) for k in ("plan_members", "plan_late", "no_plan", "first_lease_s", "last_lease_s",
                                  "coord_busy_s", "coord_longest_wait_s", "map_wait_ms_mean", "last_read_s",
                                  "last_data_s", "data_s_max", "deliver")},
        "ahead": bool(th.get("ahead")),
    }
    out["vs_bound"] = out["tensorhub"] / out["lower_bound"]
    out["vs_ring"] = out["ring"] / out["tensorhub"]
    best = min(out["single_source"], out["ring"], out["push_pull"])
    out["vs_best_baseline"] = best / out["tensorhub"]
    out["vs_single_source"] = out["single_source"] / out["tensorhub"]
    return out


def _job(job: tuple) -> dict:
    name, args, dcs, nodes, samehost = job
    return workload(name, args, dcs, nodes, samehost)


# ---------------------------------------------------------------- the Kimi-K2-class scenario
#: Published figures the Kimi-K2-class scenario is printed beside (issue 31).
VLLM_SHARDED_RDT = "vLLM sharded_rdt (published): Kimi-K2 weights in 7.53 s on 48 nodes x 8 H100"
CHECKPOINT_ENGINE = "checkpoint-engine (published): ~16 s to update a 1T model on 256 GPUs"


def kimi(args: argparse.Namespace) -> dict:
    """A Kimi-K2-class update as the code reads a sliced publish today. ``--kimi-ranks``
    trainer ranks each hold their own slice of a ``--kimi-tb`` TB version and register it in
    place (``_sliced.publish``: layout ``hf.slices``, one shard per rank, nothing sent);
    ``--kimi-gpus`` inference GPUs (8 to a node, a ``--kimi-nic-gbps`` NIC each) each fetch the
    version in ``hf`` -- the whole of it: a hot-swap fetches every ``hf`` tensor on every rank
    (``tensorhub/integrations/_core/load.py``) -- and, no assembled copy serving yet, are told
    ``read_slices`` (``server.grants._check_sliced``) and land in ``_sliced.fetch``: a manifest GET
    per slice, then one thread per slice that leases it (no ``serve``: a slice being read is
    not offered to others), reads it straight from its holder (one source: no plan, no
    relaying) and releases it; at the end one call registers the assembled copy.

    The simulator cannot cut one version into slices read by different plans, so this is
    modelled as exactly that: ``ranks`` independent sources each holding 1/``ranks`` of the
    bytes, every GPU reading every one of them, each read one flow (the equal share of the
    tighter of the holder's uplink and the GPU's downlink), every call through the
    coordinator queue (:class:`Coordinator`; the sliced read's lease and release are not
    measured by bench_routes: proxies, :data:`COORD_MS`). Lease renewals every
    ``LEASE_TTL / 3`` per slice, heartbeats every ``HEARTBEAT_S`` per GPU. Checksums: none
    (GPU destinations under ``auto``)."""
    ranks, gpus = args.kimi_ranks, args.kimi_gpus
    nbytes = args.kimi_tb * 1e12
    part = nbytes / ranks
    nic = args.kimi_nic_gbps * 1e9 / 8
    co = coordinator(args)
    renew_s = max(0.1, LEASE_TTL / 3)
    t0 = time.monotonic()
    for i in range(gpus):
        co.ask(0.0, "resolve", (i, -1))
        co.ask(HEARTBEAT_S * (i + 0.5) / gpus, "report", (i, -1))
    # flows: reader, slice, bytes left
    f_i = np.zeros(0, dtype=np.int64)
    f_j = np.zeros(0, dtype=np.int64)
    f_rem = np.zeros(0)
    new: list[tuple[int, int]] = []
    reading: set = set()
    slices_done = [0] * gpus
    done_t = [None] * gpus
    ndone, now, tick = 0, 0.0, args.kimi_tick_ms / 1e3
    while ndone < gpus:
        while co.q and co.next_end() <= now + 1e-12:
            end, kind, (i, j) = co.pop()
            if kind in ("heartbeat", "report"):
                co.ask(end + HEARTBEAT_S, "report" if done_t[i] is None else "heartbeat", (i, j))
            elif kind == "resolve":
                co.ask(end, "lease_plain", (i, -1))  # the lease on hf: refused, "read_slices"
            elif kind == "lease_plain" and j < 0:
                co.ask(end, "manifest", (i, 0))
            elif kind == "manifest":  # one slice's manifest after the other (_sliced.fetch)
                if j + 1 < ranks:
                    co.ask(end, "manifest", (i, j + 1))
                else:
                    for s in range(ranks):  # a thread per slice, each asking for its lease
                        co.ask(end, "lease_plain", (i, s))
            elif kind == "lease_plain":
                new.append((i, j))
                reading.add((i, j))
                co.ask(end + renew_s, "renew", (i, j))
            elif kind == "renew":
                if (i, j) in reading:
                    co.ask(end + renew_s, "renew", (i, j))
            elif kind == "release_plain":
                slices_done[i] += 1
                if slices_done[i] == ranks:
                    co.ask(end, "release", (i, -1))  # the assembled copy registered
            elif kind == "release":
                done_t[i] = end
                ndone += 1
        if new:
            f_i = np.concatenate([f_i, np.array([x[0] for x in new], dtype=np.int64)])
            f_j = np.concatenate([f_j, np.array([x[1] for x in new], dtype=np.int64)])
            f_rem = np.concatenate([f_rem, np.full(len(new), part)])
            new = []
        nxt = co.next_end()
        if len(f_rem):
            down = np.bincount(f_i, minlength=gpus)[f_i]
            up = np.bincount(f_j, minlength=ranks)[f_j]
            rates = nic / np.maximum(down, up)
            nxt = min(nxt, now + float((f_rem / rates).min()))
        if nxt == float("inf"):
            break
        step = max(tick, nxt - now)
        if len(f_rem):
            left = f_rem - rates * step
            fin = left <= 1e-6 * part
            for k in np.nonzero(fin)[0].tolist():
                i, j = int(f_i[k]), int(f_j[k])
                reading.discard((i, j))
                co.ask(now + float(f_rem[k] / rates[k]), "release_plain", (i, j))
            keep = ~fin
            f_i, f_j, f_rem = f_i[keep], f_j[keep], left[keep]
        now += step
    seconds = max(t for t in done_t if t is not None) if ndone == gpus else float("inf")
    bound = nbytes / nic  # every GPU receives the whole version through its NIC
    calls = sum(co.served.get(k, 0) for k in co.served if k not in ("heartbeat", "report")) / gpus
    return {"tensorhub": seconds, "bound_whole": bound, "vs_bound": seconds / bound,
            "bound_own_share": nbytes / args.kimi_tp / nic, "tp": args.kimi_tp,
            "trainer_rank_x": gpus, "coord_busy_s": co.busy, "calls_per_gpu": calls,
            "coord_longest_wait_s": co.waited, "coord_served": dict(co.served),
            "last_lease_s": co.last.get("lease_plain"), "ranks": ranks, "gpus": gpus, "tb": args.kimi_tb,
            "nic_gbps": args.kimi_nic_gbps, "sim_wall_s": time.monotonic() - t0}


def print_kimi(k: dict) -> None:
    print(f"\nKimi-K2-class: {k['tb']:g} TB of weights, {k['ranks']} trainer ranks each holding its slices (sharded "
          f"publish), {k['gpus']} inference GPUs with {k['nic_gbps']:g} Gbit/s NICs")
    print(f"  modelled as {k['ranks']} independent sources each holding 1/{k['ranks']} of the bytes, every GPU "
          "reading all of them as the code's sliced read does (_sliced.fetch: a manifest GET, a lease and a "
          "release per slice, each slice straight from its holder, nothing relayed; a hot-swap reads the whole "
          "hf version on every rank)")
    print(f"  TensorHub (the code as it is):        {k['tensorhub']:7.2f} s  = {k['vs_bound']:.2f}x the bound; each "
          f"trainer rank sends its slice {k['trainer_rank_x']}x; coordinator busy {k['coord_busy_s']:.1f} s, "
          f"{k['calls_per_gpu']:.0f} calls per GPU (renewals included), the last lease answered at "
          f"{k['last_lease_s']:.1f} s, the longest wait in its queue {k['coord_longest_wait_s']:.1f} s")
    print(f"  bound, each GPU receives the version: {k['bound_whole']:7.2f} s  (what the code moves: every rank "
          "reads all of hf)")
    print(f"  bound, each GPU only its 1/{k['tp']} (TP{k['tp']}): {k['bound_own_share']:6.2f} s  (what a "
          "per-rank transfer moves)")
    print(f"  {VLLM_SHARDED_RDT}")
    print(f"  {CHECKPOINT_ENGINE}")
    print(f"  (simulated in {k['sim_wall_s']:.0f} s)")


# ---------------------------------------------------------------- --validate against the netns testbed
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


def tc_rate(text: str) -> float:
    """``tc`` rate text (``200mbit``, ``1gbit``, ``500kbit``) in bits per second."""
    t = str(text).strip().lower()
    for unit, mult in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if t.endswith(unit):
            return float(t[: -len(unit)]) * mult
    return float(t)


#: ``--run-testbed``'s link rate: ~25 MB/s per host, nine hosts ~0.23 GB/s, where the two
#: cores carry ~1.9 GB/s of socket traffic (docs: DESIGN.md). They can still be busy: the
#: readers' loops and Mooncake's threads also cost CPU per second of a round (printed per row).
TESTBED_RATE = "200mbit"


def run_testbed(args: argparse.Namespace) -> Path:
    """``bench_topology.py fanout`` at ``--testbed-rate`` (needs root and iproute2); returns
    the file it wrote."""
    out = Path(args.testbed_out)
    cmd = [sys.executable, str(Path(__file__).resolve().parent / "bench_topology.py"), "fanout",
           "--mib", str(args.testbed_mib), "--readers", args.testbed_readers, "--host-rate", args.testbed_rate,
           "--out", str(out)]
    print("running the testbed:", " ".join(cmd), flush=True)
    t0 = time.monotonic()
    subprocess.run(cmd, check=True)
    print(f"(testbed ran {time.monotonic() - t0:.0f} s)", flush=True)
    return out / "bench_fanout.json"


def validate(path: Path, args: argparse.Namespace) -> list[dict]:
    """The model at the testbed's size against the testbed's measurements: the network,
    control-loop and coordinator model (as at scale, plus the testbed's shaped uplink queue,
    :data:`TESTBED_QUEUE_S`, and checksums: its readers read into CPU memory), and the hosts'
    shared cores as one more link every flow crosses (:func:`cpu_rate`) -- the two cores the
    hosts share, which the network model does not know."""
    meas = json.loads(path.read_text())
    rate = tc_rate(meas.get("host_rate", "1gbit")) / 8
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
        # (the testbed's readers call hub.fetch: nothing asked ahead)
        # (the testbed's manifests are a few tensors: their registration, ~1-2 ms, is not charged)
        a = argparse.Namespace(**dict(vars(args), rtt_us=args.testbed_rtt_us, ahead=False, publish="none"))
        # (the testbed's readers name the version: no resolve call)
        kw = dict(fixed_calls=1, readers=readers, max_sources=4, report_s=0.05, refresh_s=0.05, cpu_memory=True,
                  queue_s=TESTBED_QUEUE_S)
        sim = make_sim(a, cl, nbytes, chunks, **kw).run()
        cores = Cluster(nodes=n + 1, gpus_per_node=1, dcs=1, nic=rate * eff, nvlink=rate * eff, nodes_per_zone=64,
                        cpu=cpu_rate(meas, n, nbytes))
        with_cores = sim if cores.cpu == float("inf") else make_sim(a, cores, nbytes, chunks, **kw).run()
        single = Sim(cl, nbytes, chunks, readers=readers, policy="single-source", pipelined=False,
                     report_s=0.05, refresh_s=0.05).run()
        ahead = None
        if r.get("ahead") is not None:  # the testbed's rounds whose readers subscribed ahead
            a2 = argparse.Namespace(**dict(vars(a), ahead=True))
            ahead = make_sim(a2, cores if cores.cpu != float("inf") else cl, nbytes, chunks, **kw).run()
        floor = cpu_floor(meas, n)
        model = with_cores["seconds"]
        rows.append({"readers": n, "measured_tensorhub": r["tensorhub"], "model_network": sim["seconds"],
                     "err_network": sim["seconds"] / r["tensorhub"] - 1, "cpu_floor": floor,
                     "model_tensorhub": model, "err_tensorhub": model / r["tensorhub"] - 1,
                     "cpu_busy": r.get("tensorhub_cpu_busy"),
                     "measured_calls": r.get("tensorhub_calls_per_reader"), "model_calls": sim.get("calls_mean"),
                     "measured_pub_x": r.get("tensorhub_from_publisher_x"),
                     "model_pub_x": sim["from_trainer_bytes"] / nbytes,
                     "measured_single": r["single-source"], "model_single": single["seconds"],
                     "err_single": single["seconds"] / r["single-source"] - 1,
                     "measured_ahead": r.get("ahead"), "model_ahead": None if ahead is None else ahead["seconds"],
                     "err_ahead": None if ahead is None else ahead["seconds"] / r["ahead"] - 1,
                     "measured_ahead_calls": r.get("ahead_calls_per_reader"),
                     "model_ahead_calls": None if ahead is None else ahead.get("calls_mean"),
                     "measured_ahead_pub_x": r.get("ahead_from_publisher_x"),
                     "model_ahead_pub_x": None if ahead is None else ahead["from_trainer_bytes"] / nbytes})
    return rows


def print_validation(rows: list[dict], meas: dict) -> None:
    print(f"model vs testbed (fan-out, {meas['mib']} MiB, {meas.get('host_rate', '1gbit')} host links, same sizes):")
    print(f"{'N':>3} {'TH meas':>8} {'CPU busy':>8} {'net model':>10} {'err':>7} {'CPU floor':>10} {'TH model':>9} "
          f"{'err':>7} {'single meas':>12} {'single model':>13} {'err':>7}"
          f" {'calls meas':>10} {'calls model':>11} {'pub x meas':>10} {'pub x model':>11}")
    for r in rows:
        mc, cm = r["measured_calls"], r["model_calls"]
        mc = "-" if mc is None else f"{mc:.1f}"
        cm = "-" if cm is None else f"{cm:.1f}"
        px = "-" if r["measured_pub_x"] is None else f"{r['measured_pub_x']:.2f}"
        fl = "-" if r["cpu_floor"] is None else f"{r['cpu_floor']:.2f}"
        busy = "-" if r.get("cpu_busy") is None else f"{r['cpu_busy']:.0%}"
        print(f"{r['readers']:>3} {r['measured_tensorhub']:>8.2f} {busy:>8} {r['model_network']:>10.2f} "
              f"{r['err_network']:>+7.1%} {fl:>10} {r['model_tensorhub']:>9.2f} "
              f"{r['err_tensorhub']:>+7.1%} {r['measured_single']:>12.2f} {r['model_single']:>13.2f} "
              f"{r['err_single']:>+7.1%} {mc:>10} {cm:>11} {px:>10} {r['model_pub_x']:>11.2f}")
    if any(r.get("measured_ahead") is not None for r in rows):
        print("the readers subscribed ahead (hub.fetch_next; the model with --ahead, the same cores):")
        print(f"{'N':>3} {'meas s':>8} {'model s':>8} {'err':>7} {'vs N=1 meas':>12} {'calls meas':>10} "
              f"{'calls model':>11} {'pub x meas':>10} {'pub x model':>11}")
        first = rows[0].get("measured_ahead") or 1.0
        for r in rows:
            if r.get("measured_ahead") is None:
                continue
            print(f"{r['readers']:>3} {r['measured_ahead']:>8.2f} {r['model_ahead']:>8.2f} {r['err_ahead']:>+7.1%} "
                  f"{r['measured_ahead'] / first:>12.2f} {r['measured_ahead_calls']:>10.1f} "
                  f"{r['model_ahead_calls']:>11.1f} {r['measured_ahead_pub_x']:>10.2f} {r['model_ahead_pub_x']:>11.2f}")
    errs = [abs(r["err_tensorhub"]) for r in rows]
    net = [abs(r["err_network"]) for r in rows]
    print(f"TensorHub: largest |error| {max(errs):.1%}, mean {sum(errs) / len(errs):.1%} (target within 10%); "
          f"the network model alone: largest {max(net):.1%}, mean {sum(net) / len(net):.1%}; "
          "'CPU busy' = the machine's cores busy during that round (readers' and publisher's processes); "
          "'CPU floor' = the CPU a round of N readers takes over the shared cores, from the file's other "
          "rows (leave-one-out); 'pub x' = bytes the publisher sent / version")


# ---------------------------------------------------------------- --measure-cpu
def measure_cpu(chunk_counts: tuple = (64, 256, 1024)) -> dict:
    """What :data:`LOOP_S`, :data:`LOOP_S_PER_CHUNK` and :data:`CHECKSUM_BPS` come from: the
    real ``PipelinedReader`` over a transport whose reads end at once (two complete sources,
    4 KiB chunks: the loop's own CPU, no bytes moved), CPU per chunk at each chunk count; and
    ``_checksum``'s default hash over 64 MiB, bytes per CPU-second."""
    from tensorhub._checksum import DEFAULT, hash_bytes
    from tensorhub._pipeline import PipelinedReader, PSource
    from tensorhub.transport import DONE, Transport

    class Instant(Transport):
        def __init__(self) -> None:
            super().__init__()
            self._ids = itertools.count(1)

        def start(self) -> str:
            return "instant://0"

        def submit_read(self, peer: str, ops: Any) -> int:
            return next(self._ids)

        def poll(self, h: int) -> int:
            return DONE

        def _register_region(self, addr: int, nbytes: int) -> None:
            pass

        def _unregister_region(self, addr: int, nbytes: int) -> None:
            pass

    out: dict = {"loop_us_per_chunk": {}}
    for n in chunk_counts:
        sizes = [4096] * n
        rd = PipelinedReader(Instant(), sizes, [(1 << 30) + 4096 * i for i in range(n)], chunk_bytes=4096)
        srcs = [PSource(f"r{k}", f"w{k}", f"instant://{k}", tuple((k << 40) + 4096 * i for i in range(n)), "l1")
                for k in (1, 2)]
        c0 = time.process_time()
        rd.run(lambda ex: list(srcs), lambda s, why: None)
        out["loop_us_per_chunk"][n] = (time.process_time() - c0) / n * 1e6
    buf = np.random.randint(0, 255, 64 << 20, dtype=np.uint8)
    view = memoryview(buf)
    hash_bytes(DEFAULT, view)
    c0, k = time.process_time(), 8
    for _ in range(k):
        hash_bytes(DEFAULT, view)
    out["checksum"] = DEFAULT
    out["checksum_gbps"] = k * (64 << 20) / (time.process_time() - c0) / 1e9
    xs = np.array(list(out["loop_us_per_chunk"]), dtype=float)
    ys = np.array(list(out["loop_us_per_chunk"].values()))
    slope, icpt = np.polyfit(xs, ys, 1)
    out["fit_us"] = (float(icpt), float(slope))
    return out


# ---------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=16.0, help="version size per GPU (GiB)")
    ap.add_argument("--nodes", type=int, default=128, help="nodes of 8 GPUs for crossdc and elastic")
    ap.add_argument("--sizes", default="64,256,1024", help="GPUs for standalone (multiples of 8)")
    ap.add_argument("--dcs", default="2,4", help="datacenter counts for crossdc")
    ap.add_argument("--nic-gbps", type=float, default=400.0)
    ap.add_argument("--nvlink-gbps", type=float, default=3600.0)
    ap.add_argument("--wan-gbps", type=float, default=100.0)
    ap.add_argument("--storage-gbps", type=float, default=800.0, help="aggregate storage bandwidth")
    ap.add_argument("--chunks", type=int, default=0,
                    help="chunks per version (default: the client's grid, tensorhub._grid: 256 of 64 MiB at 16 GiB)")
    ap.add_argument("--protocol", choices=["chunkmap", "reports"], default="chunkmap",
                    help="the control loop: chunk maps (as implemented) or the chunk reports / refreshes before them "
                         "(reports: the old model, free coordinator, for comparison only)")
    ap.add_argument("--plans", action=argparse.BooleanOptionalAction, default=True,
                    help="chunkmap: the coordinator's striped plans (tensorhub/server/stripes.py); --no-plans: without")
    ap.add_argument("--samehost-path", choices=SAMEHOST_PATHS, default="none",
                    help="same-host reads: none (default: through Mooncake, the NIC, as the code does for GPU memory "
                         "and partial replicas), memfd (the code's memfd path: complete Hub-memory replicas only), "
                         "nvlink (a CUDA IPC path the code does not have)")
    ap.add_argument("--ahead", action=argparse.BooleanOptionalAction, default=True,
                    help="chunkmap: readers follow the model and subscribe ahead (tensorhub/server/ahead.py: leases held "
                         "before the publish, bound in the publish's call, the plans fixed at once; the code's "
                         "followers do this now); --no-ahead: the leases asked after the publish, queued")
    ap.add_argument("--ahead-deliver", choices=("batch", "stream"), default="stream",
                    help="asked ahead: stream (the code: after the bind, each grant made and answered in turn) or "
                         "batch (the code before: every grant made, then every answer written)")
    ap.add_argument("--publish", choices=("like", "manifest", "none"), default="like",
                    help="the publisher's registration that completes the version, charged first at t=0: "
                         "like (the version before's tensors + its sums, what a Hub sends for a model trained "
                         "in place), manifest (the whole manifest: a first version, other tensors), none (free)")
    ap.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the other --ahead/--no-ahead model (same-host path of the table) and print both")
    ap.add_argument("--beside", choices=(*SAMEHOST_PATHS, "off"), default="nvlink",
                    help="the same workloads with this same-host path, printed beside (off: not run)")
    ap.add_argument("--memfd-gbps", type=float, default=MEMFD_BPS * 8 / 1e9, help="--samehost-path memfd: copy rate")
    ap.add_argument("--coord-costs", default="",
                    help="coordinator service times, ms, e.g. lease=0.85,refresh=0.355 (calls: "
                         f"{', '.join(COORD_MS)}; defaults: bench_routes, see COORD_MS)")
    ap.add_argument("--coord-scale", type=float, default=1.0, help="multiply every coordinator service time")
    ap.add_argument("--cap-share", type=float, default=CAP_SHARE,
                    help="the read loop's longest sleep while reads are in flight, as a share of the time between "
                         "two chunks landing (ShardReader.CAP_SHARE); 0: always POLL (the code before 2026-12-07)")
    ap.add_argument("--checksum", choices=("auto", "on", "off"), default="auto",
                    help="TENSORHUB_CHECKSUM: auto verifies CPU destinations only (none on a GPU fleet)")
    ap.add_argument("--uplink-queue-ms", type=float, default=0.0,
                    help="a source uplink's FIFO queue that chunk-map answers wait in behind data (0: none; the "
                         "testbed's tc tbf: 50)")
    ap.add_argument("--rtt-us", type=float, default=50.0, help="a chunk-map read (one small one-sided read), us")
    ap.add_argument("--testbed-rtt-us", type=float, default=200.0, help="the same on the netns testbed (--validate)")
    ap.add_argument("--tick-ms", type=float, default=0.25, help="chunkmap model: least time step")
    ap.add_argument("--stripe", type=int, default=4)
    ap.add_argument("--report-ms", type=float, default=50.0, help="reports protocol only")
    ap.add_argument("--refresh-ms", type=float, default=50.0, help="reports protocol only")
    ap.add_argument("--validate", type=Path, default=None, help="bench_fanout.json from the testbed")
    ap.add_argument("--run-testbed", action="store_true",
                    help="--validate: first run bench_topology.py fanout at --testbed-rate (root), then validate "
                         "its file")
    ap.add_argument("--testbed-rate", default=TESTBED_RATE, help="--run-testbed: host link rate (tc)")
    ap.add_argument("--testbed-readers", default="1,2,4,8")
    ap.add_argument("--testbed-mib", type=int, default=64)
    ap.add_argument("--testbed-out", default="out/fanout200")
    ap.add_argument("--only", choices=["standalone", "elastic", "crossdc", "kimi", "none"], default=None,
                    help="one workload ('none': only --validate / --measure-cpu)")
    ap.add_argument("--kimi", action=argparse.BooleanOptionalAction, default=True, help="the Kimi-K2-class scenario")
    ap.add_argument("--kimi-tb", type=float, default=1.0)
    ap.add_argument("--kimi-ranks", type=int, default=256)
    ap.add_argument("--kimi-gpus", type=int, default=128)
    ap.add_argument("--kimi-nic-gbps", type=float, default=400.0)
    ap.add_argument("--kimi-tp", type=int, default=16, help="GPUs one inference engine spreads the model over")
    ap.add_argument("--kimi-tick-ms", type=float, default=5.0)
    ap.add_argument("--measure-cpu", action="store_true", help="measure the loop's CPU per chunk and the checksum rate")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="simulations run at once")
    ap.add_argument("--json", default="out/simulate.json")
    args = ap.parse_args()
    t_start = time.monotonic()
    results: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": []}
    if args.measure_cpu:
        m = measure_cpu()
        results["measure_cpu"] = m
        print("the read loop's CPU per chunk landed (PipelinedReader, instant transport, 2 complete sources): " +
              ", ".join(f"{us:.0f} us at {n} chunks" for n, us in m["loop_us_per_chunk"].items()) +
              f"; fit {m['fit_us'][0]:.1f} us + {m['fit_us'][1]:.3f} us x chunks (LOOP_S, LOOP_S_PER_CHUNK)")
        print(f"checksum {m['checksum']}: {m['checksum_gbps']:.1f} GB per CPU-second (CHECKSUM_BPS)")
    if args.run_testbed:
        args.validate = run_testbed(args)
    if args.validate is not None:
        rows = validate(args.validate, args)
        results["validation"] = rows
        print_validation(rows, json.loads(args.validate.read_text()))
    if args.only == "none":
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))
        return 0
    plan = [("standalone", 1, int(g) // 8) for g in args.sizes.split(",") if g] + \
        [("crossdc", int(d), args.nodes) for d in args.dcs.split(",") if d and int(d) > 1] + \
        [("elastic", 1, args.nodes)]
    if args.only:
        plan = [p for p in plan if p[0] == args.only]
    if plan:
        run_table(args, plan, results)
    if args.kimi and args.only in (None, "kimi"):
        k = kimi(args)
        results["kimi"] = k
        print_kimi(k)
        print("  subscribe ahead (--ahead) changes nothing here: a sliced publish has no 'hf' layout, so the code "
              "answers a follower's held lease with unknown_layout (_ahead.at_version), not read_slices; the "
              "figures above are the sliced read, the same with --no-ahead")
    print(f"\n(simulated in {time.monotonic() - t_start:.0f} s wall, {args.jobs} process(es))")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {args.json}")
    return 0


def run_table(args: argparse.Namespace, plan: list, results: dict) -> None:
    """The workloads of ``plan`` with the same-host path asked for and the one ``--beside``."""
    paths = [args.samehost_path] + ([args.beside] if args.beside != "off" and args.beside != args.samehost_path
                                    and args.protocol == "chunkmap" else [])
    co = coordinator(args)
    print(f"{args.gib:g} GiB per GPU, 8 GPUs to a node, NIC {args.nic_gbps:g} Gbit/s per GPU, WAN {args.wan_gbps:g} "
          f"Gbit/s, storage {args.storage_gbps:g} Gbit/s; control loop: {args.protocol}")
    if args.protocol == "chunkmap":
        c = co.cost
        print("what the code costs (defaults: measured, see COORD_MS / LOOP_S / CHECKSUM_BPS): one coordinator, "
              f"first come first served: "
              + (f"the publisher's registration first ({args.publish}) "
                 f"{c['publish_' + args.publish] * 1e3:.1f} ms, " if args.publish != "none" else
                 "the publisher's registration free (--publish none), ")
              + f"resolve {c['resolve'] * 1e3:.3f} ms, manifest {c['manifest'] * 1e3:.3f}, "
              f"serving lease {c['lease'] * 1e3:.3f}, refresh {c['refresh'] * 1e3:.3f}, release+register "
              f"{c['release'] * 1e3:.3f}, heartbeats {c['heartbeat'] * 1e3:.3f} / {c['report'] * 1e3:.3f} every "
              f"{HEARTBEAT_S:g} s; "
              + (f"subscribed ahead (--ahead, the default): the publish's call binds every subscriber at "
                 f"{c['bind_fixed'] * 1e3:.1f} ms + {c['bind'] * 1e3:.3f} ms each, then ({args.ahead_deliver}: "
                 + ("every grant, then every answer: the code before" if args.ahead_deliver == "batch" else
                    "each grant and its answer in turn, as the code") + f") a grant {c['grant'] * 1e3:.3f} ms and "
                 f"a wake-up {c['wake'] * 1e3:.3f} ms "
                 "each, then each reader reads (no manifest GET: the grant carries the checksums); " if getattr(args, "ahead", False) else
                 "leases asked after the publish (--no-ahead); ")
              + f"the plan's forming window {WINDOW * 1e3:.0f} ms (tensorhub.server.stripes.WINDOW); "
              f"chunk-map reads {args.rtt_us:g} us + their wait behind the reader's reads from that source"
              + (f" and {args.uplink_queue_ms:g} ms of uplink queue" if args.uplink_queue_ms else "")
              + f"; the read loop {LOOP_S * 1e6:.0f} us + {LOOP_S_PER_CHUNK * 1e6:.2f} us x chunks per chunk; "
              f"checksums {args.checksum} ({'none on GPUs' if args.checksum == 'auto' else args.checksum})")
        print("same-host reads: " + "; ".join(f"'{p}' = " + {
            "none": "through Mooncake: the source's NIC up and the reader's NIC down (what the code does for GPU "
                    "memory and for partial replicas)",
            "memfd": "complete replicas in Hub CPU memory copied at memory speed, partial ones over the NIC (the "
                     "code's memfd path, transport/_shm; GPU engines' weights are not in Hub memory)",
            "nvlink": "partial and complete replicas at NVLink speed (a CUDA IPC path the code does NOT have)"}[p]
            for p in paths))
    jobs = [(name, args, dcs, nodes, p) for name, dcs, nodes in plan for p in paths]
    other = None  # --compare: the other --ahead / --no-ahead model, the table's same-host path
    if getattr(args, "compare", False) and args.protocol == "chunkmap":
        other = argparse.Namespace(**dict(vars(args), ahead=not args.ahead))
        jobs += [(name, other, dcs, nodes, paths[0]) for name, dcs, nodes in plan]
    if args.jobs > 1 and len(jobs) > 1:
        import multiprocessing as mp
        # the largest first, so the two processes end together
        order = sorted(range(len(jobs)), key=lambda i: -jobs[i][3] * (2 if jobs[i][0] == "crossdc" else 1))
        with mp.get_context("fork").Pool(args.jobs) as pool:
            done = pool.map(_job, [jobs[i] for i in order], chunksize=1)
        outs = [None] * len(jobs)
        for i, o in zip(order, done):
            outs[i] = o
    else:
        outs = [_job(j) for j in jobs]
    by = {(o["workload"], o["datacenters"], o["gpus"], o["samehost"], bool(o.get("ahead"))): o for o in outs}
    results["runs"] = outs
    head = f"{'workload':>10} {'DCs':>3} {'GPUs':>5} {'TH s':>6} {'bound':>6} {'/bound':>6} {'pub x':>5} " \
           f"{'xDC x':>5} {'in plan/late/none':>17} {'leases s':>10} {'coord s':>7} {'calls':>5}"
    if len(paths) > 1:
        head += f" | {paths[1] + ': TH s':>14} {'/bound':>6} {'pub x':>5}"
    print(f"\nsame-host path '{paths[0]}'" + (f", and '{paths[1]}' beside it" if len(paths) > 1 else ""))
    print(head)
    for name, dcs, nodes in plan:
        ah = bool(getattr(args, "ahead", False)) and name != "elastic"  # (elastic: never ahead)
        o = by[(name, dcs, nodes * 8, paths[0], ah)]
        calls = "-" if o["calls_per_reader"] is None else f"{o['calls_per_reader']:.2f}"
        roles = "-" if o.get("plan_members") is None else f"{o['plan_members']}/{o['plan_late']}/{o['no_plan']}"
        leases = "-" if o.get("first_lease_s") is None else f"{o['first_lease_s']:.2f}-{o['last_lease_s']:.2f}"
        busy = "-" if o.get("coord_busy_s") is None else f"{o['coord_busy_s']:.2f}"
        line = f"{name:>10} {dcs:>3} {o['gpus']:>5} {o['tensorhub']:>6.2f} {o['lower_bound']:>6.2f} " \
               f"{o['vs_bound']:>6.2f} {o['trainer_x']:>5.2f} {o['crossed_x']:>5.2f} {roles:>17} {leases:>10} " \
               f"{busy:>7} {calls:>5}"
        if len(paths) > 1:
            b = by[(name, dcs, nodes * 8, paths[1], ah)]
            line += f" | {b['tensorhub']:>14.2f} {b['vs_bound']:>6.2f} {b['trainer_x']:>5.2f}"
        print(line, flush=True)
    print("(TH s: seconds until every reader holds the version and its release+register was answered; bound: "
          "bytes / the reader's NIC (NVLink where a GPU of its node holds it: elastic), every other datacenter "
          "receiving it once; 'pub x' = bytes the trainer sent / version; 'xDC x' = bytes that crossed "
          "datacenters / version; 'in plan/late/none' = readers whose lease was served inside the plan's "
          "forming window / after it (late: carriers at the tree's bottom) / with no plan (a complete copy existed by then, or "
          "no scarce source); 'leases s' = when the first and the last reader's lease was answered; 'coord s' = "
          "the coordinator's busy seconds; 'calls' = coordinator calls per reader; targets (issue 31): /bound "
          "<= 1.3 with same-host reads over the NIC, <= 1.2 with a same-host path; pub x <= 1.05)")
    if other is not None:
        print_ahead(by, plan, paths[0], bool(args.ahead))


def print_ahead(by: dict, plan: list, path: str, main_ahead: bool) -> None:
    """Subscribed ahead beside asked after the publish (one run, same-host path ``path``), and
    where the time goes when asked ahead: when the last answer left the coordinator, when the
    last reader started reading (its answer came: no manifest GET), when the last chunk landed,
    when the last release+register was answered."""
    print(f"\nsubscribe ahead (the code's followers: Hub.fetch_next) vs leases after the publish (--no-ahead), "
          f"same-host path '{path}'")
    print(f"{'workload':>10} {'DCs':>3} {'GPUs':>5} | {'ahead /bound':>12} {'pub x':>5} {'plan/late/none':>14} "
          f"{'answers s':>9} {'reading s':>9} {'data s':>6} {'done s':>6} {'calls':>5} | {'no-ahead /bound':>15} "
          f"{'pub x':>5} {'plan/late/none':>14}")
    for name, dcs, nodes in plan:
        a = by.get((name, dcs, nodes * 8, path, True))
        b = by.get((name, dcs, nodes * 8, path, False))
        if a is None or b is None:
            continue
        ra = f"{a['plan_members']}/{a['plan_late']}/{a['no_plan']}"
        rb = f"{b['plan_members']}/{b['plan_late']}/{b['no_plan']}"
        print(f"{name:>10} {dcs:>3} {a['gpus']:>5} | {a['vs_bound']:>12.2f} {a['trainer_x']:>5.2f} {ra:>14} "
              f"{a['last_lease_s']:>9.3f} {a['last_read_s']:>9.3f} {a['last_data_s']:>6.3f} {a['tensorhub']:>6.3f} "
              f"{a['calls_per_reader']:>5.2f} | {b['vs_bound']:>15.2f} {b['trainer_x']:>5.2f} {rb:>14}")
    print("(asked ahead: 'answers s' = the last held lease answered (the bind of every subscriber, one state call, "
          "then the wake-ups: COORD_MS bind, wake); 'reading s' = the last reader reading (at its "
          "answer: no manifest GET); 'data s' = the last chunk landed; 'done s' = the last release+register answered; "
          "bound as above)")


if __name__ == "__main__":
    sys.exit(main())
