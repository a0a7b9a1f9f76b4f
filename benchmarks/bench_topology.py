"""Topology benchmarks on the emulated testbed (benchmarks/testbed.py): real coordinator,
publisher and reader processes in network namespaces, over shaped links, real Mooncake.

* ``fanout``  -- one publisher, N = 1, 2, 4, 8 readers on other hosts of one datacenter,
  a 256 MiB version, 1 Gbit/s host links: time until every reader holds the version,
  TensorHub (pipelined, topology-aware) versus single-source (every reader reads from
  the publisher), measured side by side (interleaved) in one run.
* ``crossdc`` -- publisher in datacenter A, 4 readers in B, 100 Mbit/s between them:
  bytes that crossed the slow link (interface counters) and time until all hold it,
  TensorHub versus naive (each reader reads from the publisher).
* ``crossdc --dcs 4`` -- publisher and ``--far-readers`` readers in A, as many in each of
  B, C, D; every datacenter has its own slow WAN port (``--xdc-rate`` up and down, the
  testbed's ``wan="star"``): time against the bound (one version through one port) and
  the bytes through each port, TensorHub versus the same round on a coordinator started
  with ``--no-plans`` (the seeders' choice before plans across datacenters: several
  sources each, no striping between them) versus naive, side by side in one run.
* ``elastic`` -- 4 engines follow a publisher that keeps publishing; 4 more join; their
  time until they serve the newest version, TensorHub versus a baseline where every
  newcomer reads from the publisher.

Each prints a table, writes JSON and a PNG (``--out``, default ``out/``).

    sudo python benchmarks/bench_topology.py fanout [--mib 256] [--readers 1,2,4,8]
    sudo python benchmarks/bench_topology.py crossdc [--mib 64] [--dcs 4 --far-readers 2]
    sudo python benchmarks/bench_topology.py elastic [--mib 64]
    sudo python benchmarks/bench_topology.py all

A worker process is this file with ``worker`` as first argument (JSON lines on stdin/stdout).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("GLOG_minloglevel", "2")

MiB = 1 << 20


# ---------------------------------------------------------------- worker (inside a namespace)
def worker(argv: list[str]) -> int:  # pragma: no cover - runs in a child process
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--locality", required=True)
    a = ap.parse_args(argv)
    import torch

    import tensorhub

    hub = tensorhub.connect(a.url, worker_id=a.name, locality=a.locality, heartbeat_interval=1.0)
    hub.endpoint  # start the data plane now, not inside a timed fetch
    held: dict[int, dict] = {}

    def say(**kw: Any) -> None:
        sys.stdout.write(json.dumps(kw) + "\n")
        sys.stdout.flush()

    say(ok="ready")
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            op = cmd["op"]
            if op == "publish":
                w = _weights(torch, cmd["mib"], cmd["seed"])
                v = hub.publish("policy", w)
                held[v] = w
                say(ok=v)
            elif op == "fetch":
                hub.pipelined = cmd["pipelined"]
                t0, c0 = time.time(), time.process_time()
                f = hub.fetch("policy", cmd.get("version"), serve=cmd["serve"])
                t1, c1 = time.time(), time.process_time()  # (CPU of every thread: the data plane's too)
                if cmd["serve"]:
                    held[f.version] = f
                want = _weights(torch, cmd["mib"], cmd["seed"])  # every byte checked
                good = want.keys() == f.keys() and all(torch.equal(f[k], want[k]) for k in want)
                say(ok={"version": f.version, "start": t0, "end": t1, "cpu": c1 - c0, "sources": f.sources,
                        "nbytes": f.nbytes, "bytes_ok": good, "failed": list(f.failed_sources)})
            elif op == "fetch_next":  # subscribe ahead (``Hub.fetch_next``): asked before the version exists
                t0, c0 = time.time(), time.process_time()
                f = hub.fetch_next("policy", cmd["after"], wait=120.0)
                t1, c1 = time.time(), time.process_time()
                held[f.version] = f
                want = _weights(torch, cmd["mib"], cmd["seed"])
                good = want.keys() == f.keys() and all(torch.equal(f[k], want[k]) for k in want)
                say(ok={"version": f.version, "start": t0, "end": t1, "cpu": c1 - c0, "sources": f.sources,
                        "nbytes": f.nbytes, "bytes_ok": good, "failed": list(f.failed_sources),
                        "read_s": f.seconds})
            elif op == "subscribers":  # leases held ahead now (``/v1/status``)
                import httpx

                say(ok=len(httpx.get(a.url.split(",")[0] + "/v1/status", timeout=10).json()["subscribers"]))
            elif op == "unpublish":
                for v in [v for v in held if v in cmd["versions"]]:
                    try:
                        hub.unpublish("policy", v, timeout=30)
                    except tensorhub.TensorHubError:
                        pass
                    held.pop(v, None)
                say(ok=True)
            elif op == "latest":
                say(ok=hub.latest("policy"))
            elif op == "requests":  # the coordinator's request counts by route (/metrics)
                import httpx

                say(ok=_requests(httpx.get(a.url.split(",")[0] + "/metrics", timeout=10).text))
            elif op == "exit":
                hub.close()
                say(ok=True)
                return 0
        except Exception as e:  # noqa: BLE001 - reported to the driver
            say(error=f"{type(e).__name__}: {e}")
    return 0


def _requests(text: str) -> dict:
    """``tensorhub_requests_total{route="..."}`` of a ``/metrics`` page: route -> count."""
    out = {}
    for line in text.splitlines():
        if line.startswith("tensorhub_requests_total{"):
            route = line.split('route="', 1)[1].split('"', 1)[0]
            out[route] = float(line.rsplit(" ", 1)[1])
    return out


def _reader_calls(before: dict, after: dict, n: int) -> float:
    """The coordinator's requests per reader in a round, heartbeats aside (they come every
    second whatever happens; fetch reports ride on them) and the driver's own scrape."""
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    pub = d.get("POST /v1/models/{model}/versions", 0)  # the publisher's allocation ...
    keep = {k: v for k, v in d.items() if "heartbeat" not in k and "/metrics" not in k}
    # ... and its replica registration (one): both the publisher's, not the readers'
    return (sum(keep.values()) - pub - 1) / max(1, n)


def _weights(torch: Any, mib: int, seed: int) -> dict:
    """The benchmark's version: 16 tensors, contents fixed by ``seed`` (cheap to make and check)."""
    n = mib * MiB // 16 // 4
    return {f"layers.{i}.weight": torch.arange(n, dtype=torch.int32).add_(seed * 131 + i).view(torch.float32)
            for i in range(16)}


class Proc:
    """Driver-side handle of a worker in the testbed."""

    def __init__(self, tb: Any, host: str, url: str, log: Path) -> None:
        self.name = host
        loc = f"dc={tb.hosts[host]['dc']},zone=z,host={host}"
        self.p = tb.spawn(host, [sys.executable, __file__, "worker", "--url", url, "--name", host,
                                 "--locality", loc], stderr=open(log / f"{host}.log", "a"),
                          # Baselines put 8-16 reads on one shaped link: each runs far below the
                          # reader's 10 MB/s hang heuristic, which must not fire on them.
                          env={"TENSORHUB_PROGRESS_TIMEOUT": "120"})
        self.recv(120)

    def send(self, **cmd: Any) -> None:
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()

    def recv(self, timeout: float = 600) -> Any:
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.name} exited")
        msg = json.loads(line)
        if "error" in msg:
            raise RuntimeError(f"worker {self.name}: {msg['error']}")
        return msg["ok"]

    def call(self, **cmd: Any) -> Any:
        self.send(**cmd)
        return self.recv()


def _cpu_s(pid: int) -> float:
    """CPU seconds a process used so far (all its threads)."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def _round(pub: Proc, readers: list[Proc], mib: int, seed: int, tensorhub_mode: bool) -> dict:
    """Publish a fresh version, let every reader fetch it at once, time it. Also the CPU it
    took: each reader's process during its fetch and the publisher's meanwhile, against the
    machine's cores over the round (``cpu_busy``: 1.0 = every core busy the whole time; the
    netns hosts share this machine's cores)."""
    before = pub.call(op="requests")
    v = pub.call(op="publish", mib=mib, seed=seed)
    p0 = _cpu_s(pub.p.pid)
    t0 = time.time()
    for r in readers:
        r.send(op="fetch", version=v, pipelined=tensorhub_mode, serve=tensorhub_mode, mib=mib, seed=seed)
    res = {r.name: r.recv() for r in readers}
    pub_cpu = _cpu_s(pub.p.pid) - p0  # (idle after the last fetch: the readers check bytes after it)
    t_all = max(x["end"] for x in res.values()) - t0
    reader_cpu = sum(x["cpu"] for x in res.values())
    calls = _reader_calls(before, pub.call(op="requests"), len(readers))
    bad = [k for k, x in res.items() if not x["bytes_ok"]]
    assert not bad, f"readers {bad} got wrong bytes"
    for r in readers:
        r.call(op="unpublish", versions=[v])
    pub.call(op="unpublish", versions=[v - 1]) if v > 1 else None
    return {"version": v, "seconds": t_all, "per_reader": {k: x["end"] - t0 for k, x in res.items()},
            "sources": {k: x["sources"] for k, x in res.items()}, "failed": {k: x.get("failed") for k, x in res.items()},
            "started": {k: x["start"] - t0 for k, x in res.items()},
            "calls_per_reader": calls, "reader_cpu_s": reader_cpu, "publisher_cpu_s": pub_cpu,
            "cpu_busy": (reader_cpu + pub_cpu) / ((os.cpu_count() or 1) * t_all),
            "from_publisher": sum(x["sources"].get(pub.name, 0) for x in res.values()) / (mib * MiB)}


def _round_ahead(pub: Proc, readers: list[Proc], mib: int, seed: int, after: dict) -> dict:
    """As :func:`_round`, the readers subscribed ahead (``Hub.fetch_next`` after the version
    each holds, ``after``): held before the publish; the clock starts before the publish (its
    registration is what answers them)."""
    before = pub.call(op="requests")
    for r in readers:
        r.send(op="fetch_next", after=after[r.name], mib=mib, seed=seed)
    deadline = time.time() + 60
    while pub.call(op="subscribers") < len(readers):
        assert time.time() < deadline, "the readers did not subscribe"
        time.sleep(0.05)
    before = pub.call(op="requests")  # (their held polls: counted below as one call each)
    p0 = _cpu_s(pub.p.pid)
    t0 = time.time()
    v = pub.call(op="publish", mib=mib, seed=seed)
    res = {r.name: r.recv() for r in readers}
    pub_cpu = _cpu_s(pub.p.pid) - p0
    t_all = max(x["end"] for x in res.values()) - t0
    reader_cpu = sum(x["cpu"] for x in res.values())
    calls = _reader_calls(before, pub.call(op="requests"), len(readers)) + 1  # + the held lease
    bad = [k for k, x in res.items() if not x["bytes_ok"] or x["version"] != v]
    assert not bad, f"readers {bad} got wrong bytes"
    for r in readers:
        after[r.name] = v
        r.call(op="unpublish", versions=[v])
    pub.call(op="unpublish", versions=[v - 1]) if v > 1 else None
    return {"version": v, "seconds": t_all, "per_reader": {k: x["end"] - t0 for k, x in res.items()},
            "sources": {k: x["sources"] for k, x in res.items()}, "failed": {k: x.get("failed") for k, x in res.items()},
            "started": {k: x["end"] - x["read_s"] - t0 for k, x in res.items()},
            "calls_per_reader": calls, "reader_cpu_s": reader_cpu, "publisher_cpu_s": pub_cpu,
            "cpu_busy": (reader_cpu + pub_cpu) / ((os.cpu_count() or 1) * t_all),
            "from_publisher": sum(x["sources"].get(pub.name, 0) for x in res.values()) / (mib * MiB)}


# ---------------------------------------------------------------- scenarios
def fanout(args: argparse.Namespace, out: Path) -> dict:
    from testbed import Testbed

    ns = [int(x) for x in args.readers.split(",")]
    rows = []
    with Testbed({"a": 1 + max(ns)}, host_rate=args.host_rate) as tb, tempfile.TemporaryDirectory() as d:
        url = tb.start_coordinator(d)
        pub = Proc(tb, "a0", url, out)
        readers = [Proc(tb, f"a{k + 1}", url, out) for k in range(max(ns))]
        modes = [("tensorhub", True, pub, readers), ("single-source", False, pub, readers)]
        if args.compare_plans:  # the same workers on a second coordinator that makes no striped plans
            os.makedirs(f"{d}/noplans", exist_ok=True)
            url2 = tb.start_coordinator(f"{d}/noplans", plans=False)
            pub2 = Proc(tb, "a0", url2, out)
            readers2 = [Proc(tb, f"a{k + 1}", url2, out) for k in range(max(ns))]
            modes.insert(1, ("no-plans", True, pub2, readers2))
        if args.ahead:  # followers: each asks the next version's lease ahead (after the round before)
            modes.insert(1, ("ahead", True, pub, readers))
        seed = 0
        held: dict = {}  # reader -> the version it read last (what it subscribes after)
        for n in ns:
            row = {"readers": n}
            for mode, flag, p_, rs in modes:
                seed += 1
                if mode == "ahead":
                    r = _round_ahead(p_, rs[:n], args.mib, seed, held)
                else:
                    r = _round(p_, rs[:n], args.mib, seed, flag)
                    if mode == "tensorhub":
                        held.update({x.name: r["version"] for x in rs[:n]})
                row[mode] = r["seconds"]
                row[f"{mode}_calls_per_reader"] = r["calls_per_reader"]
                row[f"{mode}_from_publisher_x"] = r["from_publisher"]
                row[f"{mode}_cpu_busy"] = r["cpu_busy"]
                row[f"{mode}_reader_cpu_s"] = r["reader_cpu_s"] / n
                row[f"{mode}_publisher_cpu_s"] = r["publisher_cpu_s"]
                row[f"{mode}_per_reader_s"] = r["per_reader"]
                row[f"{mode}_detail"] = {k: r[k] for k in ("sources", "failed", "started")}
            rows.append(row)
            print(f"  N={n}: tensorhub {row['tensorhub']:.2f}s ({row['tensorhub_calls_per_reader']:.1f} "
                  f"coordinator calls per reader)  single-source {row['single-source']:.2f}s", flush=True)
        for p in {id(p): p for _, _, p_, rs in modes for p in (p_, *rs)}.values():
            p.call(op="exit")
    base = rows[0]["tensorhub"]
    for row in rows:
        row["tensorhub_vs_own_n1"] = row["tensorhub"] / base
        row["speedup_vs_single"] = row["single-source"] / row["tensorhub"]
        if args.compare_plans:
            row["no-plans_vs_own_n1"] = row["no-plans"] / rows[0]["no-plans"]
            row["plans_vs_no_plans"] = row["tensorhub"] / row["no-plans"]
    print(f"\nfan-out: {args.mib} MiB version, {args.host_rate} host links, 1 publisher")
    print(f"{'N':>3} {'tensorhub s':>12} {'single s':>10} {'TH/TH(N=1)':>11} {'speedup':>8} {'pub bytes (x)':>14} "
          f"{'calls/reader':>13} {'CPU busy':>9} {'CPU s/reader':>13}")
    for row in rows:
        print(f"{row['readers']:>3} {row['tensorhub']:>12.2f} {row['single-source']:>10.2f} "
              f"{row['tensorhub_vs_own_n1']:>11.2f} {row['speedup_vs_single']:>8.2f} "
              f"{row['tensorhub_from_publisher_x']:>14.2f} {row['tensorhub_calls_per_reader']:>13.1f} "
              f"{row['tensorhub_cpu_busy']:>9.0%} {row['tensorhub_reader_cpu_s']:>13.2f}")
    print("calls/reader: the coordinator's requests during a TensorHub round (tensorhub_requests_total), "
          "less heartbeats and the publisher's two, over the readers; CPU busy: the readers' processes during "
          f"their fetches and the publisher's, over {os.cpu_count()} cores x the round (the hosts share them); "
          "CPU s/reader: one reader's process during its fetch, data plane included")
    if args.ahead:
        print(f"\nthe same rounds, the readers subscribed ahead (hub.fetch_next; interleaved; clock from before the "
              f"publish):\n{'N':>3} {'ahead s':>8} {'AH/AH(N=1)':>11} {'ahead/asked after':>18} {'pub bytes (x)':>14} "
              f"{'calls/reader':>13} {'CPU busy':>9}")
        for row in rows:
            print(f"{row['readers']:>3} {row['ahead']:>8.2f} {row['ahead'] / rows[0]['ahead']:>11.2f} "
                  f"{row['ahead'] / row['tensorhub']:>18.2f} {row['ahead_from_publisher_x']:>14.2f} "
                  f"{row['ahead_calls_per_reader']:>13.1f} {row['ahead_cpu_busy']:>9.0%}")
            row["ahead_vs_own_n1"] = row["ahead"] / rows[0]["ahead"]
    if args.compare_plans:
        print(f"\nthe same rounds on a coordinator with --no-plans (interleaved):\n{'N':>3} {'no-plans s':>11} "
              f"{'NP/NP(N=1)':>11} {'pub bytes (x)':>14} {'plans/no-plans':>15} {'CPU busy':>9} {'CPU s/reader':>13}")
        for row in rows:
            print(f"{row['readers']:>3} {row['no-plans']:>11.2f} {row['no-plans_vs_own_n1']:>11.2f} "
                  f"{row['no-plans_from_publisher_x']:>14.2f} {row['plans_vs_no_plans']:>15.2f} "
                  f"{row['no-plans_cpu_busy']:>9.0%} {row['no-plans_reader_cpu_s']:>13.2f}")
    last = rows[-1]
    print(f"issue 13 target at N={last['readers']}: within 1.3x of N=1 -> {last['tensorhub_vs_own_n1']:.2f}x "
          f"({'met' if last['tensorhub_vs_own_n1'] <= 1.3 else 'MISSED'})")
    print(f"targets at N={last['readers']}: within 2x of N=1 -> {last['tensorhub_vs_own_n1']:.2f}x "
          f"({'met' if last['tensorhub_vs_own_n1'] <= 2 else 'MISSED'}); >= 3.5x faster than single-source -> "
          f"{last['speedup_vs_single']:.2f}x ({'met' if last['speedup_vs_single'] >= 3.5 else 'MISSED'})")
    res = {"scenario": "fanout", "mib": args.mib, "host_rate": args.host_rate, "cores": os.cpu_count(), "rows": rows}
    _plot(out / "bench_fanout.png", "fan-out: time until every reader holds the version",
          "readers", [r["readers"] for r in rows],
          {"tensorhub": [r["tensorhub"] for r in rows], "single-source": [r["single-source"] for r in rows]})
    return res


def _bits(rate: str) -> float:
    """``tc`` rate text (``100mbit``, ``1gbit``) in bits per second."""
    for unit, f in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * f
    raise ValueError(f"unknown rate {rate!r}")


def crossdc_star(args: argparse.Namespace, out: Path) -> dict:
    """Publisher in A, readers in A..D, one slow WAN port per datacenter (module docstring)."""
    from testbed import Testbed

    n, dcs = args.far_readers, [chr(ord("a") + k) for k in range(args.dcs)]
    size = args.mib * MiB
    bound = size * 8 / _bits(args.xdc_rate)  # every other datacenter takes in one version through its port
    res: dict = {"scenario": "crossdc", "wan": "star", "dcs": args.dcs, "mib": args.mib, "xdc_rate": args.xdc_rate,
                 "readers_per_dc": n, "bound_s": bound}
    hosts = {dc: n + (1 if dc == "a" else 0) for dc in dcs}
    names = [f"{dc}{k + (1 if dc == 'a' else 0)}" for dc in dcs for k in range(n)]
    with Testbed(hosts, host_rate=args.host_rate, xdc_rate=args.xdc_rate, wan="star") as tb, \
            tempfile.TemporaryDirectory() as d:
        url = tb.start_coordinator(d)
        os.makedirs(f"{d}/noplans", exist_ok=True)
        url2 = tb.start_coordinator(f"{d}/noplans", plans=False)
        sets = {u: (Proc(tb, "a0", u, out), [Proc(tb, h, u, out) for h in names]) for u in (url, url2)}
        seed = 20
        for mode, flag, u in (("tensorhub", True, url), ("no-plans", True, url2), ("naive", False, url)):
            pub, readers = sets[u]
            before = tb.wan_bytes()
            seed += 1
            r = _round(pub, readers, args.mib, seed, flag)
            after = tb.wan_bytes()
            ports = {dc: {k: (after[dc][k] - before[dc][k]) / size for k in ("up", "down")} for dc in dcs}
            into = {dc: {} for dc in dcs[1:]}  # bytes each datacenter took from each other one (readers' counts)
            for name, srcs in r["sources"].items():
                for src, nb in srcs.items():
                    if src[0] != name[0] and name[0] in into:
                        into[name[0]][src[0]] = into[name[0]].get(src[0], 0) + nb / size
            res[mode] = {"seconds": r["seconds"], "vs_bound": r["seconds"] / bound, "ports_x": ports,
                         "busiest_port_x": max(v for p in ports.values() for v in p.values()),
                         "into_x": into, "from_publisher_x": r["from_publisher"],
                         "calls_per_reader": r["calls_per_reader"]}
            print(f"  {mode}: {r['seconds']:.2f}s = {r['seconds'] / bound:.2f}x the bound, busiest WAN port "
                  f"{res[mode]['busiest_port_x']:.2f}x the version", flush=True)
        for pub, readers in sets.values():
            for p in [pub, *readers]:
                p.call(op="exit")
    th = res["tensorhub"]
    res["vs_no_plans"] = th["seconds"] / res["no-plans"]["seconds"]
    res["vs_naive"] = th["seconds"] / res["naive"]["seconds"]
    print(f"\ncross-datacenter, {args.dcs} datacenters on a {args.xdc_rate} WAN port each: {args.mib} MiB version, "
          f"publisher and {n} readers in a, {n} in each other; bound {bound:.2f}s (one version through one port)")
    print(f"{'mode':>10} {'seconds':>8} {'/bound':>7} {'a up (x)':>9} "
          + " ".join(f"{dc + ' down':>7}" for dc in dcs[1:]) + f" {'pub (x)':>8}  taken from (x version)")
    for mode in ("tensorhub", "no-plans", "naive"):
        m = res[mode]
        took = "; ".join(f"{dc}<-" + ",".join(f"{k}:{v:.2f}" for k, v in sorted(m["into_x"][dc].items()))
                         for dc in dcs[1:])
        print(f"{mode:>10} {m['seconds']:>8.2f} {m['vs_bound']:>7.2f} {m['ports_x']['a']['up']:>9.2f} "
              + " ".join(f"{m['ports_x'][dc]['down']:>7.2f}" for dc in dcs[1:]) + f" {m['from_publisher_x']:>8.2f}  {took}")
    print(f"TensorHub / --no-plans {res['vs_no_plans']:.2f}, / naive {res['vs_naive']:.2f}; issue 13 target "
          f"within 1.3x of the bound -> {th['vs_bound']:.2f}x ({'met' if th['vs_bound'] <= 1.3 else 'MISSED'})")
    return res


def crossdc(args: argparse.Namespace, out: Path) -> dict:
    from testbed import Testbed

    if args.dcs > 2:
        return crossdc_star(args, out)
    n = args.far_readers
    res: dict = {"scenario": "crossdc", "mib": args.mib, "xdc_rate": args.xdc_rate, "readers": n}
    with Testbed({"a": 1, "b": n}, host_rate=args.host_rate, xdc_rate=args.xdc_rate) as tb, \
            tempfile.TemporaryDirectory() as d:
        url = tb.start_coordinator(d)
        pub = Proc(tb, "a0", url, out)
        readers = [Proc(tb, f"b{k}", url, out) for k in range(n)]
        size = args.mib * MiB
        for mode, flag in (("tensorhub", True), ("naive", False)):
            before = tb.xdc_bytes()
            r = _round(pub, readers, args.mib, 7 if flag else 8, flag)
            after = tb.xdc_bytes()
            crossed = after["forward"] - before["forward"]
            res[mode] = {"seconds": r["seconds"], "crossed_bytes": crossed, "crossed_x": crossed / size,
                         "back_bytes": after["back"] - before["back"]}
            print(f"  {mode}: {r['seconds']:.2f}s, {crossed / size:.2f}x crossed", flush=True)
        for p in [pub, *readers]:
            p.call(op="exit")
    th, nv = res["tensorhub"], res["naive"]
    res["time_ratio"] = nv["seconds"] / th["seconds"]
    print(f"\ncross-datacenter: {args.mib} MiB version, publisher in A, {n} readers in B, {args.xdc_rate} between")
    print(f"{'mode':>10} {'seconds':>8} {'crossed MiB':>12} {'x version':>10}")
    for mode in ("tensorhub", "naive"):
        m = res[mode]
        print(f"{mode:>10} {m['seconds']:>8.2f} {m['crossed_bytes'] / MiB:>12.1f} {m['crossed_x']:>10.2f}")
    print(f"targets: crossed <= 1.1x -> {th['crossed_x']:.2f}x ({'met' if th['crossed_x'] <= 1.1 else 'MISSED'}); "
          f">= 3x less time than naive -> {res['time_ratio']:.2f}x ({'met' if res['time_ratio'] >= 3 else 'MISSED'})")
    _plot(out / "bench_crossdc.png", "cross-datacenter", "mode", ["tensorhub", "naive"],
          {"seconds": [th["seconds"], nv["seconds"]], "crossed (x version)": [th["crossed_x"], nv["crossed_x"]]},
          bars=True)
    return res


def elastic(args: argparse.Namespace, out: Path) -> dict:
    """4 engines follow the publisher; 4 newcomers join; time until they serve the newest version."""
    from testbed import Testbed

    res: dict = {"scenario": "elastic", "mib": args.mib}
    with Testbed({"a": 9}, host_rate=args.host_rate) as tb, tempfile.TemporaryDirectory() as d:
        url = tb.start_coordinator(d)
        pub = Proc(tb, "a0", url, out)
        old = [Proc(tb, f"a{k}", url, out) for k in range(1, 5)]
        new = [Proc(tb, f"a{k}", url, out) for k in range(5, 9)]
        seed = 100
        for mode, flag in (("tensorhub", True), ("publisher-only", False)):
            # steady state: a version is published and the running engines follow it
            seed += 1
            v = pub.call(op="publish", mib=args.mib, seed=seed)
            for r in old:
                r.send(op="fetch", version=v, pipelined=True, serve=True, mib=args.mib, seed=seed)
            for r in old:
                assert r.recv()["bytes_ok"]
            # the next version is published; running engines and newcomers fetch it at once
            seed += 1
            v2 = pub.call(op="publish", mib=args.mib, seed=seed)
            t0 = time.time()
            for r in old:
                r.send(op="fetch", version=v2, pipelined=True, serve=True, mib=args.mib, seed=seed)
            for r in new:
                r.send(op="fetch", version=v2, pipelined=flag, serve=flag, mib=args.mib, seed=seed)
            got_old = [r.recv() for r in old]
            got_new = [r.recv() for r in new]
            assert all(x["bytes_ok"] for x in got_old + got_new)
            res[mode] = {"newcomers_seconds": max(x["end"] for x in got_new) - t0,
                         "engines_seconds": max(x["end"] for x in got_old) - t0}
            print(f"  {mode}: newcomers serving after {res[mode]['newcomers_seconds']:.2f}s", flush=True)
            for r in old + new:
                r.call(op="unpublish", versions=[v, v2])
            pub.call(op="unpublish", versions=[v])
        for p in [pub, *old, *new]:
            p.call(op="exit")
    res["speedup"] = res["publisher-only"]["newcomers_seconds"] / res["tensorhub"]["newcomers_seconds"]
    print(f"\nelastic: {args.mib} MiB, 4 engines following, 4 newcomers join at a new version")
    print(f"{'mode':>15} {'newcomers s':>12} {'engines s':>10}")
    for mode in ("tensorhub", "publisher-only"):
        print(f"{mode:>15} {res[mode]['newcomers_seconds']:>12.2f} {res[mode]['engines_seconds']:>10.2f}")
    print(f"newcomers serving {res['speedup']:.2f}x sooner with TensorHub")
    _plot(out / "bench_elastic.png", "elastic: newcomers' time to serving", "mode", ["tensorhub", "publisher-only"],
          {"seconds": [res["tensorhub"]["newcomers_seconds"], res["publisher-only"]["newcomers_seconds"]]},
          bars=True)
    return res


def _plot(path: Path, title: str, xlabel: str, xs: list, series: dict, bars: bool = False) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(matplotlib not installed: no {path.name}; pip install 'tensorhub-ros[bench]')")
        return
    fig, axes = plt.subplots(1, len(series) if bars else 1, figsize=(5 * (len(series) if bars else 1), 3.6))
    if bars:
        for ax, (name, ys) in zip(list(axes) if len(series) > 1 else [axes], series.items()):
            ax.bar([str(x) for x in xs], ys, color=["tab:blue", "tab:orange"][: len(ys)])
            ax.set_title(name)
    else:
        for name, ys in series.items():
            axes.plot(xs, ys, marker="o", label=name)
        axes.set_xlabel(xlabel)
        axes.set_ylabel("seconds")
        axes.set_xticks(xs)
        axes.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        return worker(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scenario", choices=["fanout", "crossdc", "elastic", "all"])
    ap.add_argument("--mib", type=int, default=None, help="version size (fanout 256, others 64)")
    ap.add_argument("--readers", default="1,2,4,8")
    ap.add_argument("--far-readers", type=int, default=4)
    ap.add_argument("--dcs", type=int, default=2,
                    help="crossdc: datacenters (2: A and B on one slow link; more: one slow WAN port each)")
    ap.add_argument("--host-rate", default="1gbit")
    ap.add_argument("--xdc-rate", default="100mbit")
    ap.add_argument("--out", default="out")
    ap.add_argument("--ahead", action=argparse.BooleanOptionalAction, default=True,
                    help="fanout: also rounds whose readers subscribe ahead (hub.fetch_next), interleaved")
    ap.add_argument("--compare-plans", action="store_true",
                    help="fanout: also the same round on a coordinator started with --no-plans, side by side")
    args = ap.parse_args()
    from testbed import available

    ok, why = available()
    if not ok:
        print(f"testbed unavailable: {why}")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for sc in (["fanout", "crossdc", "elastic"] if args.scenario == "all" else [args.scenario]):
        a = argparse.Namespace(**vars(args))
        if a.mib is None:
            a.mib = 256 if sc == "fanout" else 64
        print(f"== {sc}", flush=True)
        results[sc] = {"fanout": fanout, "crossdc": crossdc, "elastic": elastic}[sc](a, out)
        (out / f"bench_{sc}.json").write_text(json.dumps(results[sc], indent=2))
        print(f"wrote {out / f'bench_{sc}.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
