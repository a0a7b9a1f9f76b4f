"""Elastic join: rollout engines come and go while a trainer keeps publishing.

An embedded coordinator, a trainer process and engine processes, all real (Hub clients
over Mooncake TCP on loopback):

1. The trainer publishes v1; engines 0 and 1 follow it (one of them, the zone's seeder,
   reads from the trainer; the other reads from the seeder while it is still receiving).
2. Engines 2 and 3 **join** the running job. They ask for the newest version and read it
   from engines 0 and 1, not from the trainer: the engines are in the trainer's
   datacenter but in their own zone (``locality``), and the coordinator prefers the
   nearest holders. The trainer's uplink carries nothing for them.
3. The trainer publishes v2; all four engines follow (each unpublishes its old copy,
   which waits for its readers, then fetches the new version into the same memory).
4. Engine 0 **leaves** (``hub.close()`` drops its replicas); the trainer publishes v3 and
   the three remaining engines follow.

Every fetched version is checked against the trainer's sha256. The example ends with
``all bytes verified`` and exits 0, or exits 1. On one machine the localities are only
labels; on a cluster each process gets its own from ``TENSORHUB_LOCALITY``.

    python examples/elastic_join.py [--mib 64] [--json out/elastic_join.json]

Each process is this file: ``worker`` as the first argument runs one Hub client that
takes JSON commands on stdin (what a trainer or an engine would do on its own).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from _fleet import MiB, Proc, worker  # examples/_fleet.py: what the two fleet examples share

TRAINER_LOCALITY = "dc=dc1,zone=train,host=trainer"


# ------------------------------------------------------------------ driver
def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        return worker(*sys.argv[2:5])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=64, help="size of each version in MiB")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()

    from tensorhub.coordinator import EmbeddedCoordinator

    sums: dict[int, str] = {}
    fetches: list[dict] = []
    procs: list[Proc] = []
    ok = True

    def follow(engines: list[Proc], phase: str) -> None:
        nonlocal ok
        for e in engines:  # all at once, as engines notified of a new version would
            e.send(op="follow")
        for e in engines:
            r = e.recv()
            good = r["sha256"] == sums[r["version"]]
            ok &= good
            fetches.append({"engine": e.name, "phase": phase, **r, "bytes_ok": good})
            src = ", ".join(f"{w} {n / MiB:.0f} MiB" for w, n in sorted(r["sources"].items()))
            print(f"{e.name:<9} {phase:<7} fetched v{r['version']} in {r['seconds']:.2f}s "
                  f"from [{src}]  bytes {'OK' if good else 'WRONG'}", flush=True)

    def publish(trainer: Proc, seed: int) -> None:
        r = trainer.call(op="publish", seed=seed, mib=args.mib)
        sums[r["version"]] = r["sha256"]
        print(f"{'trainer':<9} published v{r['version']} ({args.mib} MiB, sha256 {r['sha256'][:12]})", flush=True)

    with tempfile.TemporaryDirectory() as tmp, EmbeddedCoordinator(Path(tmp) / "state") as coord:
        print(f"coordinator (embedded) on {coord.url}", flush=True)
        logs = Path(tmp)
        try:
            trainer = Proc(__file__, "trainer", coord.url, TRAINER_LOCALITY, logs)
            procs.append(trainer)

            def engine(k: int) -> Proc:
                p = Proc(__file__, f"engine-{k}", coord.url, f"dc=dc1,zone=rollout,host=engine-{k}", logs)
                procs.append(p)
                return p

            running = [engine(0), engine(1)]
            publish(trainer, seed=1)
            follow(running, "running")

            print("-- engine-2 and engine-3 join", flush=True)
            newcomers = [engine(2), engine(3)]
            follow(newcomers, "joined")
            running += newcomers

            publish(trainer, seed=2)
            follow(running, "running")

            print("-- engine-0 leaves", flush=True)
            running[0].call(op="leave")
            running = running[1:]
            publish(trainer, seed=3)
            follow(running, "running")
        finally:
            for p in reversed(procs):
                p.stop()

    joined = [f for f in fetches if f["phase"] == "joined"]
    from_trainer = sum(f["sources"].get("trainer", 0) for f in joined)
    from_peers = sum(n for f in joined for w, n in f["sources"].items() if w != "trainer")
    print(f"newcomers' first fetch: {from_peers / MiB:.0f} MiB from peers, {from_trainer / MiB:.0f} MiB "
          f"from the trainer")
    print("all bytes verified" if ok else "BYTE MISMATCH")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "mib": args.mib, "published": sums, "fetches": fetches, "all_bytes_ok": ok,
            "newcomers_from_trainer": from_trainer, "newcomers_from_peers": from_peers}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
