"""Coordinator restarts as clients see them.

A real coordinator process is SIGKILLed and restarted on its state dir ``--restarts``
times, while a holder (with replicas), and a client polling ``latest`` every 10 ms, stay
connected. For each restart it prints the outage seen by the polling client (last answer
before the kill to first answer after it), the time until the holder's replicas were
registered again, and checks that no committed version was lost or reused.

    python benchmarks/bench_restart.py [--restarts 10] [--down 0.5] [--json out/bench_restart.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("GLOG_minloglevel", "2")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--restarts", type=int, default=10)
    ap.add_argument("--down", type=float, default=0.5, help="seconds the coordinator stays dead")
    ap.add_argument("--json", default="out/bench_restart.json")
    args = ap.parse_args()

    import httpx

    import tensorhub
    from tensorhub.testing import CoordinatorProcess, Worker

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        coord = CoordinatorProcess(Path(tmp) / "state")
        coord.start()
        holder = Worker(coord.url, "holder", heartbeat_interval=0.2)
        versions = [holder.call("publish", seed=1, nbytes=1 << 20)]
        poller = tensorhub.connect(coord.url, worker_id="poller")
        answers: list[float] = []
        stop = threading.Event()

        def poll() -> None:
            while not stop.is_set():
                try:
                    poller.api.latest("policy", retry_timeout=0.0)
                    answers.append(time.monotonic())
                except tensorhub.TensorHubError:
                    pass
                time.sleep(0.01)

        t = threading.Thread(target=poll, daemon=True)
        t.start()
        try:
            for i in range(args.restarts):
                time.sleep(0.5)
                coord.kill()
                killed = time.monotonic()
                time.sleep(args.down)
                coord.start()
                # outage: last answer before the kill -> first answer after the restart
                while not answers or answers[-1] < killed:
                    time.sleep(0.005)
                before = max(a for a in answers if a < killed)
                after = min(a for a in answers if a > killed)
                while True:  # the holder's replicas re-registered by themselves
                    st = httpx.get(f"{coord.url}/v1/status", timeout=5).json()
                    if any(r["worker_id"] == "holder" for m in st["models"] for v in m["versions"]
                           for r in v["replicas"]):
                        break
                    time.sleep(0.01)
                rereg = time.monotonic() - killed
                v = holder.call("publish", seed=i + 2, nbytes=1 << 20)
                if v != versions[-1] + 1:
                    raise SystemExit(f"version {v} after {versions[-1]}: lost or reused")
                versions.append(v)
                rows.append({"outage_s": after - before, "reregistered_after_s": rereg})
                print(f"restart {i + 1}: outage seen by a polling client {after - before:.2f}s "
                      f"(coordinator down {args.down:.2f}s), replicas back after {rereg:.2f}s, next version {v}")
        finally:
            stop.set()
            t.join(5)
            poller.close()
            holder.close()
            coord.stop()
    outs = [r["outage_s"] for r in rows]
    rer = [r["reregistered_after_s"] for r in rows]
    summary = {"restarts": len(rows), "down_s": args.down, "outage_median_s": statistics.median(outs),
               "outage_max_s": max(outs), "reregistered_median_s": statistics.median(rer),
               "versions": versions, "rows": rows}
    print(f"outage median {summary['outage_median_s']:.2f}s, max {summary['outage_max_s']:.2f}s "
          f"(of which {args.down:.2f}s the coordinator was down); replicas back in median "
          f"{summary['reregistered_median_s']:.2f}s; versions {versions[0]}..{versions[-1]}, none lost or reused")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
