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
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's log chatter

MODEL = "policy"
MiB = 1 << 20
TRAINER_LOCALITY = "dc=dc1,zone=train,host=trainer"


def weights_for(version_seed: int, mib: int) -> dict:
    """A version's tensors: fixed by the seed, so every process can tell right bytes from wrong."""
    import torch

    g = torch.Generator().manual_seed(version_seed)
    n = 8
    per = (mib * MiB) // n // 4
    return {f"model.layers.{i}.mlp.weight": torch.randn(per, generator=g).view(64, -1) for i in range(n)}


def checksum(tensors: dict) -> str:
    import torch

    h = hashlib.sha256()
    for k in sorted(tensors):
        h.update(k.encode())
        h.update(tensors[k].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ------------------------------------------------------------------ one process: trainer or engine
def worker(name: str, url: str, locality: str) -> int:
    """A trainer (``publish``) or an engine (``follow``), driven by JSON lines on stdin."""
    import tensorhub

    hub = tensorhub.connect(url, worker_id=name, locality=locality)
    hub.endpoint  # start the data plane now rather than in the first timed call
    published: list[int] = []   # trainer: versions it serves, oldest first
    seen: Optional[int] = None  # engine: the version it runs
    params: Optional[dict] = None

    def say(**kw: Any) -> None:
        print(json.dumps(kw), flush=True)

    say(ok="ready")
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "publish":  # trainer: a new version, in place; keep the last two
                w = weights_for(cmd["seed"], cmd["mib"])
                v = hub.publish(MODEL, w)
                published.append(v)
                if len(published) > 2:
                    hub.unpublish(MODEL, published.pop(0), timeout=60)  # waits for its readers
                say(ok={"version": v, "sha256": checksum(w)})
            elif cmd["op"] == "follow":  # engine: move to the newest version
                v = hub.wait_for_version(MODEL, newer_than=seen, timeout=60)
                if params is not None:
                    hub.unpublish(MODEL, seen, timeout=60)  # our readers drain; then we may overwrite
                f = hub.fetch(MODEL, v, into=params)     # serve=True: we become a source of v
                params, seen = dict(f), v
                say(ok={"version": v, "sha256": checksum(f), "seconds": f.seconds, "sources": f.sources})
            elif cmd["op"] == "leave":
                hub.close()                              # drops our replicas; readers go elsewhere
                say(ok=True)
                return 0
        except Exception as e:  # noqa: BLE001 - reported to the driver
            say(error=f"{type(e).__name__}: {e}")
    hub.close()
    return 0


class Proc:
    """The driver's handle on one worker process."""

    def __init__(self, name: str, url: str, locality: str, log_dir: Path) -> None:
        self.name, self.locality = name, locality
        self.log = log_dir / f"{name}.log"
        self.p = subprocess.Popen([sys.executable, __file__, "worker", name, url, locality],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(self.log, "w"),
                                  text=True)
        self.recv()  # "ready"

    def send(self, **cmd: Any) -> None:
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()

    def recv(self) -> Any:
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} exited; its log:\n{self.log.read_text()[-3000:]}")
        msg = json.loads(line)
        if "error" in msg:
            raise RuntimeError(f"{self.name}: {msg['error']}")
        return msg["ok"]

    def call(self, **cmd: Any) -> Any:
        self.send(**cmd)
        return self.recv()

    def stop(self) -> None:
        if self.p.poll() is None:
            try:
                self.p.stdin.close()
                self.p.wait(20)
            except (OSError, subprocess.TimeoutExpired):
                self.p.kill()
                self.p.wait(10)


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
            trainer = Proc("trainer", coord.url, TRAINER_LOCALITY, logs)
            procs.append(trainer)

            def engine(k: int) -> Proc:
                p = Proc(f"engine-{k}", coord.url, f"dc=dc1,zone=rollout,host=engine-{k}", logs)
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
