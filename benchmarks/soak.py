"""Randomized soak: publish, fetch, unpublish, kill, hang and coordinator restarts.

Real processes throughout: a coordinator process (SIGKILLed and restarted on its state
dir), a trainer and readers (each a Hub over real Mooncake, loopback TCP). Every fetch
is checked tensor by tensor (sha256) against the bytes published for that version:

* torn   -- some tensor matches no published version's bytes,
* mixed  -- every tensor matches some version, but not all the same one (or not the one asked),
* lost   -- a version whose publish returned is later unknown, or a number handed out twice,
* late   -- a fetch that failed after its deadline (plus slack), or without a clear error.

All four must be 0. Prints the counts of every action and outcome; exits 1 otherwise.

    python benchmarks/soak.py --trials 200 [--seed 1] [--mib 16] [--json out/soak.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Optional

os.environ.setdefault("GLOG_minloglevel", "2")

#: Errors a user may see from a fetch/unpublish under faults; anything else is a defect.
CLEAR_ERRORS = {"FetchError", "NotFoundError", "HubTimeoutError", "ConflictError", "RetentionError",
                "CoordinatorUnavailableError", "LeaseLapsedError", "TransferError"}
FETCH_TIMEOUT = 12.0
SLACK = 8.0  # release/retry after the deadline, process scheduling on 2 cores


def run(trials: int, seed: int = 1, mib: int = 16, log=print) -> dict:
    from tensorhub.testing import CoordinatorProcess, Faults, Worker, WorkerError, digest, make_weights

    rng = random.Random(seed)
    counts: Counter = Counter()
    bad: list[str] = []
    size = mib << 20
    expected: dict[int, dict] = {}  # version -> tensor digests
    by_digest: dict[str, int] = {}  # tensor digest -> version
    issued: list[int] = []
    opts = dict(progress_timeout=2.0, heartbeat_interval=0.5)

    with tempfile.TemporaryDirectory() as tmp:
        coord = CoordinatorProcess(Path(tmp) / "state", extra=("--worker-ttl", "3", "--lease-ttl", "6"))
        coord.start()
        faults = Faults(coord.url, seed=seed)
        names = ["trainer", "r0", "r1", "r2"]
        gen = Counter()
        workers: dict[str, Worker] = {}
        hung_until: dict[str, float] = {}

        def spawn(name: str) -> None:
            gen[name] += 1
            workers[name] = Worker(coord.url, f"{name}.{gen[name]}", **opts)

        def ready(name: str) -> bool:
            return time.monotonic() >= hung_until.get(name, 0.0)

        def respawn_dead() -> None:
            for n in names:
                if not workers[n].proc.is_alive():
                    workers[n].kill()
                    spawn(n)
                    counts["respawn"] += 1

        def publish() -> None:
            if not ready("trainer"):
                return
            s = rng.randrange(1 << 30)
            v = workers["trainer"].call("publish", timeout=60, seed=s, nbytes=size)
            if issued and v <= max(issued):
                bad.append(f"lost: version {v} handed out again (had {max(issued)})")
            issued.append(v)
            expected[v] = digest(make_weights(s, size))
            for d in expected[v].values():
                by_digest[d] = v
            counts["publish"] += 1

        def check(got: dict, asked: Optional[int]) -> None:
            v = got["version"]
            seen = {by_digest.get(d) for d in got["digest"].values()}
            if None in seen:
                bad.append(f"torn: fetch of v{v} returned bytes of no published version")
            elif seen != {v} or (asked is not None and asked != v):
                bad.append(f"mixed: fetch of v{asked or v} returned tensors of versions {sorted(seen)}")
            else:
                counts["fetch ok"] += 1

        def fetch(fault: Optional[str] = None) -> None:
            readers = [n for n in names[1:] if ready(n)]
            if not readers or not issued:
                return
            name = rng.choice(readers)
            w = workers[name]
            asked = rng.choice([None, None, rng.choice(issued[-4:])])
            trig = None
            if fault:
                pool = [n for n in names if n != name and ready(n)]
                victim = rng.choice(pool) if pool else None
                if fault == "coordinator":
                    action = coord.kill
                elif fault == "kill" and victim:
                    action = lambda: faults.kill(workers[victim].pid)  # noqa: E731
                elif fault == "hang" and victim:
                    hung_until[victim] = time.monotonic() + 30  # until resumed below
                    action = lambda: faults.hang(workers[victim].pid)  # noqa: E731
                else:
                    fault = None
                if fault:
                    trig = faults.during_read(w.worker_id, action, after="random", max_after=0.3, timeout=10)
                    counts[f"fault during fetch: {fault}"] += 1
            t0 = time.monotonic()
            w.send("fetch", version=asked, fetch_timeout=FETCH_TIMEOUT, serve=rng.random() < 0.5)
            try:
                if fault == "coordinator":
                    # restart it after a random outage, while the reader keeps going
                    if trig.wait(10) and coord.proc.poll() is not None:
                        time.sleep(rng.uniform(0.1, 1.5))
                        coord.start()
                got = w.result(timeout=FETCH_TIMEOUT + SLACK + 30)
                check(got, asked)
            except WorkerError as e:
                took = time.monotonic() - t0
                if e.kind not in CLEAR_ERRORS:
                    bad.append(f"late: unclear error {e.kind}: {e.message.splitlines()[0]}")
                elif took > FETCH_TIMEOUT + SLACK:
                    bad.append(f"late: fetch failed after {took:.1f}s: {e.message.splitlines()[0]}")
                else:
                    counts[f"fetch failed clearly: {e.kind}"] += 1
            except TimeoutError:
                bad.append(f"late: fetch by {name} did not answer within {FETCH_TIMEOUT + SLACK + 30}s")
                os.kill(w.pid, signal.SIGUSR1)  # its stacks go to stderr, for the diagnosis
                time.sleep(0.5)
                w.kill()  # its pipe is out of step now: replace it
            finally:
                if trig is not None and trig.cancel():
                    counts[f"fault not fired (read too short): {fault}"] += 1
                if fault == "coordinator" and coord.proc.poll() is not None:
                    coord.start()
                if fault == "hang" and victim:
                    faults.resume(workers[victim].pid)
                    hung_until[victim] = 0.0

        def unpublish() -> None:
            cands = [n for n in names if ready(n)]
            name = rng.choice(cands)
            try:
                held = workers[name].call("held", timeout=30)
            except TimeoutError:
                bad.append(f"late: {name} did not answer 'held' within 30s")
                workers[name].kill()
                return
            if not held:
                return
            v = rng.choice(held)[1]
            try:
                workers[name].call("unpublish", timeout=30 + SLACK, version=v, drain_timeout=5.0)
                counts["unpublish ok"] += 1
            except WorkerError as e:
                if e.kind in CLEAR_ERRORS:
                    counts[f"unpublish refused: {e.kind}"] += 1
                else:
                    bad.append(f"unpublish: unclear error {e.kind}")

        def kill() -> None:
            name = rng.choice(names)
            faults.kill(workers[name].pid)
            counts["kill"] += 1

        def hang() -> None:
            name = rng.choice([n for n in names if ready(n)] or names)
            pid = workers[name].pid
            d = rng.uniform(0.5, 3.0)
            faults.hang(pid)
            hung_until[name] = time.monotonic() + d + 0.2
            threading.Timer(d, lambda: faults.resume(pid)).start()
            counts["hang"] += 1

        def restart() -> None:
            coord.kill()
            time.sleep(rng.uniform(0.0, 1.0))
            coord.start()
            counts["coordinator restart"] += 1

        def guarded(fn):
            def run_one() -> None:
                try:
                    fn()
                except (EOFError, ConnectionResetError, BrokenPipeError):
                    counts["worker died under a command (fault)"] += 1  # respawned next trial
            return run_one

        for n in names:
            spawn(n)
        publish()
        actions = [(publish, 3), (lambda: fetch(), 6), (lambda: fetch("kill"), 2), (lambda: fetch("hang"), 2),
                   (lambda: fetch("coordinator"), 1), (unpublish, 3), (kill, 1), (hang, 1), (restart, 1)]
        fns, weights = zip(*[(guarded(f), wt) for f, wt in actions])
        t_start = time.monotonic()
        try:
            for i in range(trials):
                respawn_dead()
                rng.choices(fns, weights)[0]()
                counts["trials"] += 1
                if (i + 1) % 20 == 0:
                    log(f"  {i + 1}/{trials} trials, {time.monotonic() - t_start:.0f}s, problems so far: {len(bad)}")
            # every version whose publish returned is still known, numbers never reused
            time.sleep(0.5)
            import httpx

            st = httpx.get(f"{coord.url}/v1/status", timeout=10).json()
            known = {v["version"] for m in st["models"] for v in m["versions"]}
            for v in issued:
                if v not in known:
                    bad.append(f"lost: v{v} is unknown to the coordinator")
            if len(set(issued)) != len(issued):
                bad.append("lost: a version number was handed out twice")
        finally:
            faults.resume_all()
            for w in workers.values():
                w.kill()
            coord.stop()

    kinds = Counter(b.split(":", 1)[0] for b in bad)
    return {"trials": trials, "seed": seed, "seconds": time.monotonic() - t_start, "counts": dict(counts),
            "torn": kinds["torn"], "mixed": kinds["mixed"], "lost": kinds["lost"],
            "late": kinds["late"] + kinds["unpublish"], "problems": bad, "versions": len(issued)}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--mib", type=int, default=16, help="version size")
    ap.add_argument("--json", default="out/soak.json")
    args = ap.parse_args(argv)
    r = run(args.trials, args.seed, args.mib)
    print(f"soak: {r['trials']} trials, {r['versions']} versions, {r['seconds']:.0f}s (seed {r['seed']})")
    for k, n in sorted(r["counts"].items()):
        print(f"  {k:<45}{n:>6}")
    print(f"torn {r['torn']}  mixed {r['mixed']}  lost {r['lost']}  late/unclear {r['late']}")
    for p in r["problems"][:20]:
        print(f"  PROBLEM {p}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(r, indent=2))
    return 0 if not r["problems"] else 1


if __name__ == "__main__":
    sys.exit(main())
