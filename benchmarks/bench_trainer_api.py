"""Trainer-side memory and time of ``send_weights`` through vLLM's trainer API with the
``tensorhub`` backend, beside gathering the whole model first and publishing that.

Each mode runs in a fresh process on the same model (``--layers`` decoder layers of equal
size, ``--mib`` in all, float32) held as the trainer's parameters; the source materializes
a fresh copy of every tensor as it is iterated (what FSDP's ``full_tensor()`` gather
makes). Peak memory is the process's high-water mark (``VmHWM``) above what it held before
the send; the engines' side is not run (a client that only records the calls), since it is
the same for both.

* ``tensorhub``: ``WeightTransferTrainerFactory.trainer_init(TensorHubTrainerInitInfo(...))``
  then ``send_weights()``: groups are copied into one snapshot buffer one at a time.
* ``gathered``: ``dict(source)`` (the whole model gathered), then copied into a snapshot
  (``hub.empty_like``) and published: what a trainer that gathers before it publishes holds.

    python benchmarks/bench_trainer_api.py [--mib 512] [--layers 16] [--json out/bench_trainer_api.json]

glibc's dynamic mmap threshold keeps some freed gathers resident (1.18x the model instead
of 1.07x at 512 MiB / 16 groups here); ``MALLOC_MMAP_THRESHOLD_=131072`` shows the bound
itself: one snapshot plus one group. Times are printed but this 2-core VM is shared: they
vary run to run more than they differ.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("GLOG_minloglevel", "2")


def _hwm() -> int:
    """This process's peak resident memory so far, bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_hwm() -> None:
    """Start the high-water mark afresh at the current resident size (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def child(mode: str, url: str, mib: int, layers: int) -> dict:
    import torch
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    import tensorhub
    from tensorhub.integrations.vllm.trainer import TensorHubTrainerInitInfo

    per = (mib << 20) // (layers * 4) // 4  # 4 tensors per layer, float32
    params = {f"model.layers.{i}.{w}": torch.randn(per) for i in range(layers) for w in ("q", "k", "v", "o")}

    class Gathering(WeightSource):
        def metadata(self):
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in params.items()]

        def __iter__(self):
            for n, t in params.items():
                yield n, t.clone()  # a gather makes a new full tensor

    class Recording:
        def __getattr__(self, name):
            return lambda *a, **k: None

    nbytes = sum(t.numel() * t.element_size() for t in params.values())
    if mode == "tensorhub":
        eng = WeightTransferTrainerFactory.trainer_init(TensorHubTrainerInitInfo(model="policy", coordinator=url,
                                                                                 rank=0, buffers=1),
                                                        client=Recording(), source=Gathering())
        _reset_hwm()
        base_rss, base_hwm = _rss(), _hwm()
        t0 = time.monotonic()
        eng.send_weights()
        seconds = time.monotonic() - t0
        peak = _hwm()
        eng.shutdown()
    else:
        hub = tensorhub.connect(url, worker_id="gathered")
        _reset_hwm()
        base_rss, base_hwm = _rss(), _hwm()
        t0 = time.monotonic()
        full = dict(Gathering())
        snap = hub.empty_like(full)
        for n, t in full.items():
            snap[n].copy_(t)
        del full
        hub.publish("policy-gathered", snap)
        seconds = time.monotonic() - t0
        peak = _hwm()
        hub.close()
    return {"mode": mode, "model_bytes": nbytes, "extra_peak_bytes": peak - base_rss,
            "hwm_before": base_hwm, "seconds": seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--json")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "URL"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("@@" + json.dumps(child(args.child[0], args.child[1], args.mib, args.layers)), flush=True)
        return 0

    from tensorhub.coordinator import EmbeddedCoordinator

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    res = {}
    with tempfile.TemporaryDirectory() as tmp, EmbeddedCoordinator(tmp) as coord:
        for mode in ("tensorhub", "gathered"):
            r = subprocess.run([sys.executable, __file__, "--mib", str(args.mib), "--layers", str(args.layers),
                                "--child", mode, coord.url], capture_output=True, text=True, env=env, timeout=900)
            if r.returncode != 0:
                raise SystemExit(f"{mode} failed:\n{r.stderr[-3000:]}")
            res[mode] = json.loads(next(l for l in r.stdout.splitlines() if l.startswith("@@"))[2:])
    model = res["tensorhub"]["model_bytes"]
    print(f"model {model / 2**20:.0f} MiB in {args.layers} layer groups (float32); peak memory of one send above "
          "what the trainer held before it, and its time:")
    for mode, what in (("tensorhub", "send_weights, tensorhub backend (group by group)"),
                       ("gathered", "gather the whole model, then snapshot + publish")):
        r = res[mode]
        print(f"  {what:<52} {r['extra_peak_bytes'] / 2**20:7.0f} MiB = {r['extra_peak_bytes'] / model:.2f}x the "
              f"model, {r['seconds']:.2f}s")
    ratio = res["tensorhub"]["extra_peak_bytes"] / res["gathered"]["extra_peak_bytes"]
    print(f"tensorhub / gathered peak: {ratio:.2f}x")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"mib": args.mib, "layers": args.layers, **res, "ratio": ratio},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
