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
* readers report completed chunks every ``--report-ms`` and refresh their sources when
  idle every ``--refresh-ms`` (twice that when busy), like the client (50 ms / 100 ms).

Workloads (1,024 GPUs on 128 nodes in 1-4 datacenters by default):

* ``standalone``: a trainer publishes; every GPU fetches the new version.
* ``elastic``: 7/8 of the GPUs already serve the version; 1/8 join and fetch it.
* ``crossdc``: the trainer is in datacenter 0; GPUs are spread over D datacenters.

Compared with: single-source (the planner's ``single-source`` policy, simulated), ring
broadcast (NCCL style, pipelined, analytic), push-then-pull through storage (analytic),
and the lower bound (bytes / bottleneck bandwidth). ``--validate out/bench_fanout.json``
runs the model at the testbed's size (N <= 8, 1 Gbit/s links) and prints its error against
the measurement.

    python benchmarks/simulate.py                       # the three workloads at 1,024 GPUs
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
    LEVELS, Candidate, chunk_order, choose_sources, claims, group_key, locality_cost, pick_chunk, reserve_chunks,
    start_fraction, start_reverse,
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

    def run(self, t_max: float = 3600.0) -> dict:
        now = 0.0
        dt_min = self.chunk / self.cl.nic / 16
        for r in self.readers.values():
            self._refresh(r, now)
            self._submit(r, now)
        while any(r.done_t is None for r in self.readers.values()) and now < t_max:
            if self.flows:
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
                rates = share[idx].min(axis=1)
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
    receives it at least once over the slow link."""
    lb = nbytes / (cl.nvlink if host_source else cl.nic)
    if dcs > 1:
        lb = max(lb, nbytes / cl.wan)
    return lb


# ---------------------------------------------------------------- workloads
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
    t0 = time.monotonic()
    th = Sim(cl, nbytes, args.chunks, holders=holders, readers=tuple(newcomers), **kw).run()
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
        "sim_wall_s": wall,
    }
    best = min(out["single_source"], out["ring"], out["push_pull"])
    out["vs_best_baseline"] = best / out["tensorhub"]
    out["vs_single_source"] = out["single_source"] / out["tensorhub"]
    return out


def validate(path: Path, args: argparse.Namespace) -> list[dict]:
    """The model at the testbed's size against the testbed's measurements."""
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
        sim = Sim(cl, mib * (1 << 20), 64, readers=readers, max_sources=4,
                  report_s=0.05, refresh_s=0.05).run()
        single = Sim(cl, mib * (1 << 20), 64, readers=readers, policy="single-source", pipelined=False,
                     report_s=0.05, refresh_s=0.05).run()
        rows.append({"readers": n, "measured_tensorhub": r["tensorhub"], "model_tensorhub": sim["seconds"],
                     "err_tensorhub": sim["seconds"] / r["tensorhub"] - 1,
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
    ap.add_argument("--chunks", type=int, default=64, help="chunks per version (the client's grid aims at 64)")
    ap.add_argument("--stripe", type=int, default=4)
    ap.add_argument("--report-ms", type=float, default=50.0)
    ap.add_argument("--refresh-ms", type=float, default=50.0)
    ap.add_argument("--validate", type=Path, default=None, help="bench_fanout.json from the testbed")
    ap.add_argument("--only", choices=["standalone", "elastic", "crossdc"], default=None)
    ap.add_argument("--json", default="out/simulate.json")
    args = ap.parse_args()
    results: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": []}
    if args.validate is not None:
        rows = validate(args.validate, args)
        results["validation"] = rows
        print("model vs testbed (fan-out, same sizes and link rates):")
        print(f"{'N':>3} {'TH meas':>8} {'TH model':>9} {'err':>7} {'single meas':>12} {'single model':>13} {'err':>7}")
        for r in rows:
            print(f"{r['readers']:>3} {r['measured_tensorhub']:>8.2f} {r['model_tensorhub']:>9.2f} "
                  f"{r['err_tensorhub']:>+7.1%} {r['measured_single']:>12.2f} {r['model_single']:>13.2f} "
                  f"{r['err_single']:>+7.1%}")
    plan = [("standalone", 1), ("elastic", 1)] + [("crossdc", int(d)) for d in args.dcs.split(",") if int(d) > 1]
    if args.only:
        plan = [p for p in plan if p[0] == args.only]
    print(f"\n{args.nodes * 8} GPUs on {args.nodes} nodes, {args.gib:g} GiB per GPU, NIC {args.nic_gbps:g} Gbit/s, "
          f"WAN {args.wan_gbps:g} Gbit/s, storage {args.storage_gbps:g} Gbit/s")
    print(f"{'workload':>11} {'DCs':>3} {'readers':>7} {'TensorHub':>9} {'single':>8} {'ring':>7} {'push-pull':>9} "
          f"{'bound':>7} {'xDC (x)':>7} {'vs best':>7} {'vs single':>9} {'paper':>6}")
    for name, dcs in plan:
        o = workload(name, args, dcs)
        results["runs"].append(o)
        print(f"{name:>11} {dcs:>3} {o['readers']:>7} {o['tensorhub']:>9.2f} {o['single_source']:>8.2f} "
              f"{o['ring']:>7.2f} {o['push_pull']:>9.2f} {o['lower_bound']:>7.2f} {o['crossed_x']:>7.2f} "
              f"{o['vs_best_baseline']:>7.1f} {o['vs_single_source']:>9.1f} {PAPER[name]:>6.1f}", flush=True)
    print("(seconds until every reader holds the version; 'vs best' = best baseline / TensorHub; "
          "'paper' = the ratio the paper reports for that workload)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
