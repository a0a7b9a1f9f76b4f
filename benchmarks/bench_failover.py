"""Coordinator failover as clients see it, and what the etcd store costs per request.

1. **Failover.** A real etcd (``/usr/bin/etcd``) and ``--coordinators`` coordinator
   processes on it (``--store etcd://...``, default election ttl 2 s). A holder (real
   Mooncake worker with a replica) and a client polling ``latest`` every 10 ms through all
   the URLs stay connected while the leader is SIGKILLed ``--kills`` times (restarted as a
   follower after each). Per kill: the outage the polling client saw (last answer before
   the kill to the first answer to a request sent after it), when the holder's replica was registered again on the
   new leader, and a check that the next published version is the previous one + 1.
2. **Latency, etcd vs SQLite**, side by side: ``publish`` of a 4 KiB tensor (allocate +
   register replica: two durable commits) and a lease round trip (``acquire`` + ``release``
   through a tiny ``fetch(serve=False)``), ``--ops`` times each, on one coordinator process
   of each store (both running, the operations interleaved), in-memory transport.

    python benchmarks/bench_failover.py [--kills 10] [--ops 200] [--json out/bench_failover.json]
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


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def failover(tmp: Path, kills: int, n: int) -> dict:
    import httpx

    import tensorhub
    from tensorhub.testing import CoordinatorProcess, Worker
    from tensorhub.testing._etcd import EtcdCluster

    rows = []
    with EtcdCluster(tmp / "etcd", members=1) as etcd:
        coords = [CoordinatorProcess(tmp / f"c{i}" / "state", extra=("--store", etcd.store_url))
                  for i in range(n)]
        for c in coords:
            c.start()
        urls = ",".join(c.url for c in coords)

        def leader() -> CoordinatorProcess:
            while True:
                for c in coords:
                    try:
                        if c.proc.poll() is None and httpx.get(f"{c.url}/healthz", timeout=1).json()["role"] == "leader":
                            return c
                    except httpx.HTTPError:
                        pass
                time.sleep(0.02)

        holder = Worker(urls, "holder", heartbeat_interval=0.2)
        versions = [holder.call("publish", seed=1, nbytes=1 << 20)]
        poller = tensorhub.connect(urls, worker_id="poller")
        answers: list[tuple[float, float]] = []  # (sent, answered)
        stop = threading.Event()

        def poll() -> None:
            while not stop.is_set():
                try:
                    sent = time.monotonic()
                    poller.api.latest("policy", retry_timeout=1.0)
                    answers.append((sent, time.monotonic()))
                except tensorhub.TensorHubError:
                    pass
                time.sleep(0.01)

        t = threading.Thread(target=poll, daemon=True)
        t.start()
        try:
            for i in range(kills):
                time.sleep(1.0)
                old = leader()
                old.kill()
                killed = time.monotonic()
                # outage: last answer before the kill -> first answer to a request sent after it
                # (an answer that was on its way at the kill does not count)
                while not answers or answers[-1][0] < killed:
                    time.sleep(0.005)
                before = max(a for _, a in answers if a < killed)
                after = min(a for s, a in answers if s > killed)
                new = leader()
                while True:  # the holder's replica re-registered on the new leader
                    try:
                        st = httpx.get(f"{new.url}/v1/status", timeout=5).json()
                        if any(r["worker_id"] == "holder" for m in st["models"] for v in m["versions"]
                               for r in v["replicas"]):
                            break
                    except (httpx.HTTPError, KeyError):
                        pass
                    time.sleep(0.01)
                rereg = time.monotonic() - killed
                old.start()  # back as a follower, same port
                v = holder.call("publish", seed=i + 2, nbytes=1 << 20)
                if v != versions[-1] + 1:
                    raise SystemExit(f"version {v} after {versions[-1]}: lost or reused")
                versions.append(v)
                rows.append({"outage_s": after - before, "reregistered_after_s": rereg})
                print(f"kill {i + 1}: outage seen by a polling client {after - before:.2f}s, "
                      f"replicas back on the new leader after {rereg:.2f}s, next version {v}", flush=True)
        finally:
            stop.set()
            t.join(5)
            poller.close()
            holder.close()
            for c in coords:
                c.stop()
    outs = [r["outage_s"] for r in rows]
    rer = [r["reregistered_after_s"] for r in rows]
    return {"kills": len(rows), "coordinators": n, "outage_median_s": statistics.median(outs),
            "outage_max_s": max(outs), "reregistered_median_s": statistics.median(rer),
            "versions": versions, "rows": rows}


def latency(tmp: Path, ops: int) -> dict:
    import torch

    import tensorhub
    from tensorhub.testing import CoordinatorProcess, InMemoryTransport
    from tensorhub.testing._etcd import EtcdCluster

    out = {}
    with EtcdCluster(tmp / "etcd-lat", members=1) as etcd:
        coords, hubs = {}, {}
        try:
            for name, extra in (("sqlite", ()), ("etcd", ("--store", etcd.store_url + "/lat"))):
                coords[name] = c = CoordinatorProcess(tmp / f"lat-{name}" / "state", extra=extra)
                c.start()
                hubs[name] = (tensorhub.connect(c.url, worker_id="pub", transport=InMemoryTransport()),
                              tensorhub.connect(c.url, worker_id="rd", transport=InMemoryTransport()))
            w = {"w": torch.zeros(1024)}
            pubs: dict = {n: [] for n in coords}
            leases: dict = {n: [] for n in coords}
            for i in range(ops):  # interleaved: background noise hits both stores alike
                for name, (pub, rd) in hubs.items():
                    t0 = time.perf_counter()
                    v = pub.publish("lat", w)
                    pubs[name].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    rd.fetch("lat", v, serve=False)
                    leases[name].append(time.perf_counter() - t0)
                    if i >= 2:
                        pub.unpublish("lat", v - 2)
        finally:
            for pub, rd in hubs.values():
                pub.close(), rd.close()
            for c in coords.values():
                c.stop()
        for name in coords:
            p, l = pubs[name], leases[name]
            out[name] = {"publish_ms_median": 1e3 * statistics.median(p), "publish_ms_p99": 1e3 * _pct(p, 0.99),
                         "lease_ms_median": 1e3 * statistics.median(l), "lease_ms_p99": 1e3 * _pct(l, 0.99)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--coordinators", type=int, default=3)
    ap.add_argument("--ops", type=int, default=200)
    ap.add_argument("--json", default="out/bench_failover.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fo = failover(Path(tmp), args.kills, args.coordinators)
        lat = latency(Path(tmp), args.ops)
    print(f"\nfailover over {fo['kills']} leader kills ({fo['coordinators']} coordinators, election ttl 2 s): "
          f"client-visible outage median {fo['outage_median_s']:.2f}s, max {fo['outage_max_s']:.2f}s "
          f"(target < 3 s); replicas back in median {fo['reregistered_median_s']:.2f}s; "
          f"versions {fo['versions'][0]}..{fo['versions'][-1]}, none lost or reused")
    print(f"\n{'':24}{'sqlite':>12}{'etcd':>12}")
    for key, label in (("publish_ms_median", "publish median (ms)"), ("publish_ms_p99", "publish p99 (ms)"),
                       ("lease_ms_median", "lease rt median (ms)"), ("lease_ms_p99", "lease rt p99 (ms)")):
        print(f"{label:24}{lat['sqlite'][key]:12.2f}{lat['etcd'][key]:12.2f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"failover": fo, "latency": lat}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
