"""Sliced publishing in place vs a gather to rank 0: trainer-side memory and publish time.

A model of ``--layers`` Linear(``--dim``, ``--dim``) float32 layers is built on the meta
device, sharded with FSDP2 ``fully_shard`` over a gloo group of N CPU ranks
(``torch.multiprocessing`` spawn), then materialized shard by shard (no rank ever holds the
full model before the publish). Per N (default 2 and 4), in one run, on the same ranks:

* ``in place``: every rank snapshots its own shards (``{n: p.detach().clone()}``: DTensors,
  one shard-sized copy) and registers them with ``Hub.publish(..., key=...)``; no bytes move.
* ``gather``: the usual full publish: ``get_model_state_dict(full_state_dict=True,
  cpu_offload=True)`` gathers the full tensors onto rank 0 (its snapshot), which publishes
  them with ``Hub.publish``.

Each mode is measured per rank: the peak RSS above the rank's RSS just before the mode
(sampled every millisecond by a thread), the bytes of tensors the mode leaves allocated
(the snapshot), and the publish time (from the start of the snapshot until the version is
registered: the gather included; every rank waits at a barrier so the slowest rank counts).
Then one reader fetches each version (``hf``) and the bytes are compared, so a mode that
published something else would show. Printed side by side with ratios gather / in place.
A real coordinator process and real Mooncake (TCP on loopback) throughout.

    python benchmarks/bench_sharded.py [--ranks 2 4] [--layers 16] [--dim 2048] [--json out/bench_sharded.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("GLOG_minloglevel", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class PeakRSS:
    """Peak RSS above the RSS at ``start`` (a sampling thread, every ``interval`` seconds)."""

    def __init__(self, interval: float = 0.001) -> None:
        self.interval, self.base, self.peak = interval, 0, 0
        self._stop = threading.Event()

    def __enter__(self) -> "PeakRSS":
        self.base = self.peak = _rss()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(self.interval)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss())

    @property
    def delta(self) -> int:
        return self.peak - self.base


def _nbytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _rank(rank: int, world: int, init: str, url: str, layers: int, dim: int, out: "object") -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import tensorhub

    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (world,))
    for m in model:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(1000 + rank)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().copy_(torch.randn(p.to_local().shape, generator=g))
    hub = tensorhub.connect(url, worker_id=f"bench-{world}-rank{rank}")
    hub.endpoint  # start the transport before timing (both modes need it)
    res: dict = {"rank": rank}
    keep = []

    dist.barrier()
    with PeakRSS() as m:
        t0 = time.perf_counter()
        snap = {n: p.detach().clone() for n, p in model.state_dict().items()}
        v = hub.publish("sliced", snap, key=f"w{world}")
        mine = time.perf_counter() - t0
        dist.barrier()
        res["inplace"] = {"seconds": time.perf_counter() - t0, "own_seconds": mine, "rss": 0,
                          "tracked": _nbytes({n: t.to_local() for n, t in snap.items()}), "version": v}
    res["inplace"]["rss"] = m.delta
    keep.append(snap)

    dist.barrier()
    with PeakRSS() as m:
        t0 = time.perf_counter()
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        v = hub.publish("gathered", {n: t.contiguous() for n, t in full.items()}) if rank == 0 else None
        mine = time.perf_counter() - t0
        dist.barrier()
        res["gather"] = {"seconds": time.perf_counter() - t0, "own_seconds": mine, "rss": 0,
                         "tracked": _nbytes(full) if rank == 0 else 0, "version": v}
    res["gather"]["rss"] = m.delta
    keep.append(full)
    out.put(res)
    dist.barrier()  # the parent read both versions before anyone unpublishes
    _wait_file(init + ".done")
    hub.close()
    dist.destroy_process_group()


def _wait_file(init: str) -> None:
    path = init.removeprefix("file://")
    while not os.path.exists(path):
        time.sleep(0.1)


def run(world: int, url: str, layers: int, dim: int, tmp: str) -> dict:
    import torch
    import torch.multiprocessing as mp

    import tensorhub

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{tmp}/init{world}"
    procs = mp.start_processes(_rank, args=(world, init, url, layers, dim, out), nprocs=world, join=False,
                               start_method="spawn")
    results = sorted((out.get(timeout=1200) for _ in range(world)), key=lambda r: r["rank"])
    with tensorhub.connect(url, worker_id=f"bench-reader-{world}") as hub:
        a = hub.fetch("sliced", results[0]["inplace"]["version"], serve=False)
        b = hub.fetch("gathered", results[0]["gather"]["version"], serve=False)
        same = set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
        fetch = {"sliced": a.seconds, "gathered": b.seconds, "sources_sliced": len(a.sources)}
    Path(init.removeprefix("file://") + ".done").touch()
    procs.join(120)
    return {"world": world, "ranks": results, "same_bytes": same, "fetch": fetch,
            "model_bytes": layers * (dim * dim + dim) * 4}


def _mb(n: int) -> str:
    return f"{n / 1e6:8.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    from tensorhub.testing import CoordinatorProcess

    tmp = tempfile.mkdtemp(prefix="bench_sharded_")
    coord = CoordinatorProcess(Path(tmp) / "state")
    coord.start()
    runs = []
    try:
        for w in a.ranks:
            runs.append(run(w, coord.url, a.layers, a.dim, tmp))
    finally:
        coord.stop()
    print(f"model: {a.layers} x Linear({a.dim}, {a.dim}) float32 = {runs[0]['model_bytes'] / 1e6:.1f} MB; "
          "per rank: peak RSS above the start of the mode, tensor bytes the snapshot holds, publish time "
          "(snapshot/gather + register, slowest rank)")
    print(f"{'ranks':>5} {'mode':>8} | {'rank0 RSS MB':>12} {'max other RSS MB':>16} | {'rank0 tensors MB':>16} "
          f"{'max other MB':>12} | {'publish s':>9}")
    for r in runs:
        rows = {}
        for mode in ("inplace", "gather"):
            per = [x[mode] for x in r["ranks"]]
            rows[mode] = (per[0]["rss"], max(p["rss"] for p in per[1:]), per[0]["tracked"],
                          max(p["tracked"] for p in per[1:]), max(p["seconds"] for p in per))
            print(f"{r['world']:>5} {'in place' if mode == 'inplace' else 'gather':>8} | {_mb(rows[mode][0]):>12} "
                  f"{_mb(rows[mode][1]):>16} | {_mb(rows[mode][2]):>16} {_mb(rows[mode][3]):>12} | "
                  f"{rows[mode][4]:9.3f}")
        i, g = rows["inplace"], rows["gather"]
        r["ratios"] = {"rank0_rss": g[0] / max(1, i[0]), "rank0_tensors": g[2] / max(1, i[2]),
                       "publish_time": g[4] / max(1e-9, i[4])}
        print(f"{r['world']:>5} {'ratio':>8} | gather / in place: rank-0 peak RSS x{r['ratios']['rank0_rss']:.2f}, "
              f"rank-0 snapshot bytes x{r['ratios']['rank0_tensors']:.2f}, publish time "
              f"x{r['ratios']['publish_time']:.2f}; same bytes read back: {r['same_bytes']}; reader fetch "
              f"{r['fetch']['sliced']:.2f}s from {r['fetch']['sources_sliced']} slice holders vs "
              f"{r['fetch']['gathered']:.2f}s from rank 0")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"args": vars(a), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
