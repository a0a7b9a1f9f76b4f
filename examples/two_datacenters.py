"""Two datacenters: a version crosses the slow link once, then fans out on the far side.

The trainer is in datacenter ``a`` next to one engine; three engines are in datacenter
``b``, behind a slow link. All four engines fetch each new version at the same time. The
coordinator lets exactly one reader of ``b`` (its *seeder*) read across the link; the other
two read from the seeder while it is still receiving (pipelined replication), so the
version crosses the slow link once instead of three times.

By default (as root, with iproute2) the hosts are real network namespaces from
``benchmarks/testbed.py``: a veth pair per host into a bridge per datacenter, every host
link shaped to ``--host-rate`` and the link between the datacenters to ``--xdc-rate``
with ``tc tbf``. The example then counts the bytes that crossed on that link's interface
counters. ``--net loopback`` runs the same processes on this machine's loopback instead,
with the datacenters as locality labels only; then only TensorHub's own accounting (the
bytes each reader got from each source) tells what crossed.

Every fetch is checked against the trainer's sha256. The example ends with ``all bytes
verified`` and exits 0, or exits 1.

    sudo python examples/two_datacenters.py [--mib 32] [--versions 2] [--net auto|netns|loopback]
        [--compare] [--json out/two_datacenters.json]

``--compare`` adds a baseline round: a fresh version that each engine of ``b`` reads on its
own from the complete replicas in ``a`` (no pipelining, nobody serves what it read), so
each copy crosses the link.

Each process is this file: ``worker`` as the first argument runs one Hub client that
takes JSON commands on stdin.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from _fleet import MiB, Proc, worker  # examples/_fleet.py: what the two fleet examples share

ROOT = Path(__file__).resolve().parent.parent
#: host name -> datacenter. The trainer is a0.
HOSTS = {"a0": "a", "a1": "a", "b0": "b", "b1": "b", "b2": "b"}


def run(args: argparse.Namespace, tb: Any, url: str, logs: Path) -> dict:
    procs: list[Proc] = []
    result: dict = {"mib": args.mib, "net": "netns" if tb is not None else "loopback", "versions": []}
    try:
        for name in HOSTS:
            procs.append(Proc(__file__, name, url, f"dc={HOSTS[name]},zone=z,host={name}", logs, tb))
        trainer, engines = procs[0], procs[1:]
        for seed in range(1, args.versions + 1):
            pub = trainer.call(op="publish", seed=seed, mib=args.mib)
            v, want = pub["version"], pub["sha256"]
            print(f"trainer (a0) published v{v} ({args.mib} MiB, sha256 {want[:12]})", flush=True)
            link0 = tb.xdc_bytes()["forward"] if tb is not None else None
            for e in engines:  # all at once, as engines notified of a new version would
                e.send(op="follow")
            row: dict = {"version": v, "fetches": {}, "accounted_crossing": 0}
            for e in engines:
                r = e.recv()
                good = r["version"] == v and r["sha256"] == want
                far = sum(n for w, n in r["sources"].items() if HOSTS[w] != HOSTS[e.name])
                row["fetches"][e.name] = {**r, "bytes_ok": good, "from_other_dc": far}
                row["accounted_crossing"] += far
                src = ", ".join(f"{w} {n / MiB:.1f} MiB" for w, n in sorted(r["sources"].items()))
                print(f"  {e.name} (dc {HOSTS[e.name]}) fetched v{r['version']} in {r['seconds']:.2f}s "
                      f"from [{src}]  bytes {'OK' if good else 'WRONG'}", flush=True)
            size = args.mib * MiB
            row["accounted_x"] = row["accounted_crossing"] / size
            line = f"  crossed a->b: {row['accounted_x']:.2f}x the version (readers' accounting)"
            if tb is not None:
                row["link_bytes"] = tb.xdc_bytes()["forward"] - link0
                row["link_x"] = row["link_bytes"] / size
                line += f", {row['link_x']:.2f}x on the link's counters (TCP/IP headers included)"
            print(line, flush=True)
            result["versions"].append(row)
        if args.compare:
            # Baseline: a fresh version, and every engine of b reads it on its own from complete
            # replicas (no pipelining, nobody serves what it read): each copy crosses the link.
            pub = trainer.call(op="publish", seed=1000, mib=args.mib)
            v, want = pub["version"], pub["sha256"]
            far_engines = [e for e in engines if HOSTS[e.name] != "a"]
            link0 = tb.xdc_bytes()["forward"] if tb is not None else None
            for e in far_engines:
                e.send(op="direct", version=v)
            naive = {"version": v, "accounted_crossing": 0, "bytes_ok": True, "seconds": 0.0}
            for e in far_engines:
                r = e.recv()
                naive["bytes_ok"] &= r["sha256"] == want
                naive["seconds"] = max(naive["seconds"], r["seconds"])
                naive["accounted_crossing"] += sum(n for w, n in r["sources"].items() if HOSTS[w] != "b")
            naive["accounted_x"] = naive["accounted_crossing"] / (args.mib * MiB)
            line = (f"baseline v{v}: each of {len(far_engines)} engines of b reads on its own: slowest "
                    f"{naive['seconds']:.2f}s, crossed {naive['accounted_x']:.2f}x (readers' accounting)")
            if tb is not None:
                naive["link_x"] = (tb.xdc_bytes()["forward"] - link0) / (args.mib * MiB)
                line += f", {naive['link_x']:.2f}x on the link's counters"
            print(line + f"  bytes {'OK' if naive['bytes_ok'] else 'WRONG'}", flush=True)
            result["naive"] = naive
    finally:
        for p in reversed(procs):
            p.stop()
    result["all_bytes_ok"] = all(f["bytes_ok"] for row in result["versions"] for f in row["fetches"].values()) \
        and result.get("naive", {}).get("bytes_ok", True)
    return result


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        return worker(*sys.argv[2:5])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=32, help="size of each version in MiB")
    ap.add_argument("--versions", type=int, default=2)
    ap.add_argument("--net", choices=["auto", "netns", "loopback"], default="auto",
                    help="netns: emulated hosts and shaped links (root); loopback: labels only; "
                         "auto: netns when this machine can")
    ap.add_argument("--host-rate", default="1gbit", help="each host's link (netns only)")
    ap.add_argument("--xdc-rate", default="100mbit", help="the link between the datacenters (netns only)")
    ap.add_argument("--compare", action="store_true",
                    help="then a baseline version that every engine of b reads on its own")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import testbed  # benchmarks/testbed.py

    use_netns = args.net == "netns"
    if args.net == "auto":
        use_netns, why = testbed.available()
        if not use_netns:
            print(f"(no network namespaces here: {why}; running on loopback, datacenters as labels)")
    elif use_netns:
        ok, why = testbed.available()
        if not ok:
            print(f"testbed unavailable: {why}", file=sys.stderr)
            return 2

    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)
        if use_netns:
            with testbed.Testbed({"a": 2, "b": 3}, host_rate=args.host_rate, xdc_rate=args.xdc_rate) as tb:
                url = tb.start_coordinator(str(logs / "state"))
                print(f"testbed: datacenter a = a0 (trainer), a1; datacenter b = b0, b1, b2; hosts at "
                      f"{args.host_rate}, a<->b at {args.xdc_rate}; coordinator {url}", flush=True)
                result = run(args, tb, url, logs)
                result["testbed_namespaces"] = list(tb.namespaces)
        else:
            from tensorhub.coordinator import EmbeddedCoordinator

            with EmbeddedCoordinator(logs / "state") as coord:
                print(f"loopback: datacenter labels a = a0 (trainer), a1; b = b0, b1, b2; "
                      f"coordinator {coord.url}", flush=True)
                result = run(args, None, coord.url, logs)
    ok = result["all_bytes_ok"]
    print("all bytes verified" if ok else "BYTE MISMATCH")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
