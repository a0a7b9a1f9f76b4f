"""Randomized soak: publish, fetch, unpublish, kill, hang, coordinator restarts, and faults
of the control plane only (a holder or a reader cut off from the coordinator, a paused
coordinator).

Real processes throughout: a coordinator process (SIGKILLed and restarted on its state
dir, or SIGSTOPped), a trainer and readers (each a Hub over real Mooncake over TCP; r2
reads with ``pipelined=False``, the others pipelined; only r1 verifies per-chunk checksums,
r0 and r2 rely on the protocol alone). Where network namespaces work
(root, iproute2) every process is a host of an emulated cluster (``testbed.py``: own
namespace, links shaped with tc, the coordinator in the core namespace); elsewhere all run
on loopback and the control-plane kinds (cut, pause, reader-cut) are skipped (said in the output).

Faults, each during a read (the reader holds a lease):

* kill / hang -- SIGKILL or SIGSTOP another worker; coordinator -- SIGKILL it and restart it;
* cut -- the trainer, the only holder of a (larger) version read over its slowed uplink, loses
  its route to the coordinator (a blackhole route in its namespace; half the time its open
  connections are reset too) for longer than ``worker_ttl``: it is expired, heals and
  re-registers by itself, then does a double-buffered step: publishes the next version and
  unpublishes the one being read, writing the version after into that memory at once;
* pause -- the coordinator is SIGSTOPped for longer than ``worker_ttl`` during such a read,
  then resumed (no live worker may be expired at resume), then the same double-buffered step;
* reader-cut -- the READER loses its route to the coordinator (blackholed in its namespace,
  half the time its connections reset) for 1.3-2 x ``worker_ttl`` during such a read, while
  its data path to the holder keeps working. The holder is a second trainer process on a
  host of its own that publishes with ``checksum="off"`` (so nothing but the fencing protects
  the reader; the trainer's own publishes keep their checksums for r1). While the reader is
  cut the holder does the double-buffered step: publishes the next version, unpublishes the
  one being read (at once, or once the coordinator has expired the reader; with a timeout)
  and writes the version after into that memory the moment unpublish returns. Then the
  route heals. Per trial: whether the coordinator expired the reader during the cut (and
  still listed its lease then), and how long unpublish waited; summarized in one line.

Every fetch is checked tensor by tensor (sha256) against the bytes published for that version:

* torn    -- some tensor matches no published version's bytes,
* mixed   -- every tensor matches some version, but not all the same one (or not the one asked),
* lost    -- a version whose publish returned is later unknown, or a number handed out twice,
* late    -- a fetch that failed after its deadline (plus slack), or without a clear error,
* expired -- live workers expired by a coordinator that resumed from a pause,
* early   -- (reader-cut) an unpublish that drained while the cut-off reader's lease had not
  yet lapsed on the coordinator (it cannot have been released: rule 3), shown as ``early drain``.

All must be 0. Prints the counts of every action and, per fault kind, of every outcome;
exits 1 otherwise.

``--store etcd`` runs the coordinator on a real etcd (``/usr/bin/etcd``, one member,
loopback only): every restart is then a new election and a restore from etcd, and the
counts are the same. (Failover between several coordinators: ``bench_failover.py``.)

    python benchmarks/soak.py --trials 300 [--seed 1] [--mib 16] [--weight cut=4] [--only reader-cut]
                              [--no-netns] [--store etcd] [--json out/soak.json]

``--only KIND`` runs only that fault kind's trials (``none``: plain fetches).
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
from collections import Counter, defaultdict
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Optional

os.environ.setdefault("GLOG_minloglevel", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tensorhub.server.state import StateConfig  # noqa: E402  (retention: which versions may be retired)

#: Errors a user may see from a fetch/unpublish under faults; anything else is a defect.
CLEAR_ERRORS = {"FetchError", "NotFoundError", "HubTimeoutError", "ConflictError", "RetentionError",
                "CoordinatorUnavailableError", "LeaseLapsedError", "TransferError"}
FETCH_TIMEOUT = 12.0
#: The reads of the control-plane kinds span the fault: a version of 3x --mib (at least
#: CP_MIB MiB) over the holder's uplink slowed to CP_RATE (~10 s for the default 16 MiB;
#: 1 MiB chunks, two in flight, still land well within the readers' 2 s progress timeout).
CP_FETCH_TIMEOUT = 30.0
CP_MIB, CP_RATE = 24, "40mbit"
SLACK = 8.0  # release/retry after the deadline, process scheduling on 2 cores
WORKER_TTL, LEASE_TTL = 2.0, 5.0
KINDS = ("none", "kill", "hang", "coordinator", "cut", "pause", "reader-cut")
#: The kinds that need network namespaces (skipped on loopback).
CONTROL_KINDS = ("cut", "pause", "reader-cut")
OUTCOMES = ("ok", "clear", "torn", "mixed", "late", "lost", "not fired")


#: How often each action is drawn (``--weight NAME=W`` changes one; 0 leaves it out).
DEFAULT_WEIGHTS = {"publish": 3, "fetch": 6, "kill": 2, "hang": 2, "coordinator": 1, "unpublish": 3,
                   "kill-idle": 1, "hang-idle": 1, "restart": 1, "cut": 1, "pause": 1, "reader-cut": 1}
#: The action that draws each fault kind's trials (``--only KIND``).
KIND_ACTION = {"none": "fetch", **{k: k for k in KINDS if k != "none"}}


def run(trials: int, seed: int = 1, mib: int = 16, log=print, netns: Optional[bool] = None,
        weights: Optional[dict[str, float]] = None, store: str = "sqlite", only: Optional[str] = None) -> dict:
    import testbed

    from tensorhub.testing import CoordinatorProcess, Faults, Worker, WorkerError, digest, make_weights

    rng = random.Random(seed)
    counts: Counter = Counter()
    by_kind: dict[str, Counter] = defaultdict(Counter)
    bad: list[tuple[str, str, str]] = []  # (problem, fault kind, what)
    clear: list[str] = []  # the clear errors seen, for the record
    size = mib << 20
    expected: dict[int, dict] = {}  # version -> tensor digests
    by_digest: dict[str, int] = {}  # tensor digest -> version
    issued: list[int] = []
    issued_during: dict[int, str] = {}  # version -> the fault kind under way when it was published
    names = ["trainer", "r0", "r1", "r2"]
    opts = dict(progress_timeout=2.0, heartbeat_interval=0.5, chunk_bytes=1 << 20)
    # r2 reads plain (the others pipelined); only r1 verifies per-chunk checksums: r0 and r2
    # rely on the protocol alone, so a fencing defect shows as torn/mixed, not a clear error.
    per_worker = {"r0": dict(checksum="off"), "r2": dict(pipelined=False, checksum="off"),
                  "holder": dict(checksum="off")}
    reader_cuts: list[dict] = []  # per reader-cut trial that fired: expiry, unpublish's wait, outcome
    if store == "etcd":
        if netns:
            raise SystemExit("--store etcd runs on loopback only (pass --no-netns)")
        netns, why = False, "--store etcd: etcd runs on loopback"
    elif netns is None:
        netns, why = testbed.available()
    else:
        why = "" if netns else "--no-netns"
    if not netns:
        log(f"soak on loopback: the control-plane kinds ({', '.join(CONTROL_KINDS)}) are skipped ({why})")
    if only is not None:
        if only not in KIND_ACTION:
            raise ValueError(f"unknown fault kind {only!r}; known: {list(KINDS)}")
        if only in CONTROL_KINDS and not netns:
            raise SystemExit(f"--only {only} needs network namespaces ({why})")
        weights = {KIND_ACTION[only]: 1}  # that kind's trials and nothing else
    w8 = dict({a: 0 for a in DEFAULT_WEIGHTS} if only else DEFAULT_WEIGHTS, **(weights or {}))
    if not netns:
        for k in CONTROL_KINDS:
            w8[k] = 0

    def problem(what: str, kind: str, msg: str) -> None:
        bad.append((what, kind, msg))
        by_kind[kind][what] += 1

    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        if netns:
            # one host more: the reader-cut kind's holder (a trainer that publishes without checksums)
            tb = stack.enter_context(testbed.Testbed({"a": len(names) + 1}, host_rate="1gbit",
                                                     tag=f"sk{os.getpid() % 100000}"))
            hosts = {n: f"a{i}" for i, n in enumerate(names + ["holder"])}
            coord = CoordinatorProcess(Path(tmp) / "state", netns=tb.core, host=tb.coordinator_ip,
                                       extra=("--worker-ttl", str(WORKER_TTL), "--lease-ttl", str(LEASE_TTL)))
        else:
            tb = None
            extra: tuple = ("--worker-ttl", str(WORKER_TTL), "--lease-ttl", str(LEASE_TTL))
            if store == "etcd":
                from tensorhub.testing._etcd import EtcdCluster

                etcd = stack.enter_context(EtcdCluster(Path(tmp) / "etcd", members=1))
                extra += ("--store", etcd.store_url)
            coord = CoordinatorProcess(Path(tmp) / "state", extra=extra)
        coord.start()
        faults = Faults(coord.url, seed=seed, netns=tb.core if tb else None)
        gen = Counter()
        workers: dict[str, Worker] = {}
        hung_until: dict[str, float] = {}

        def ns(name: str) -> str:
            return tb.hosts[hosts[name]]["ns"]

        def spawn(name: str) -> None:
            gen[name] += 1
            where = {}
            if tb is not None:
                h = tb.hosts[hosts[name]]
                where = dict(netns=h["ns"], data_host=h["ip"], locality=f"dc=a,zone=z,host={hosts[name]}")
            workers[name] = Worker(coord.url, f"{name}.{gen[name]}", **opts, **per_worker.get(name, {}), **where)

        def ready(name: str) -> bool:
            return time.monotonic() >= hung_until.get(name, 0.0)

        def respawn_dead() -> None:
            for n in names:
                if not workers[n].proc.is_alive():
                    workers[n].kill()
                    spawn(n)
                    counts["respawn"] += 1

        def record(v: int, s: int, kind: str, nbytes: int = size, digests: Optional[dict] = None) -> None:
            if issued and v <= max(issued):
                problem("lost", kind, f"version {v} handed out again (had {max(issued)})")
            issued.append(v)
            issued_during[v] = kind
            expected[v] = digests if digests is not None else digest(make_weights(s, nbytes))
            for d in expected[v].values():
                by_digest[d] = v

        def publish(kind: str = "none", nbytes: int = size) -> Optional[int]:
            if not ready("trainer"):
                return None
            s = rng.randrange(1 << 30)
            v = workers["trainer"].call("publish", timeout=60, seed=s, nbytes=nbytes)
            record(v, s, kind, nbytes)
            counts["publish"] += 1
            return v

        def check(got: dict, asked: Optional[int], kind: str) -> None:
            v = got["version"]
            seen = {by_digest.get(d) for d in got["digest"].values()}
            if None in seen:
                problem("torn", kind, f"fetch of v{v} returned bytes of no published version")
            elif seen != {v} or (asked is not None and asked != v):
                problem("mixed", kind, f"fetch of v{asked or v} returned tensors of versions {sorted(seen)}")
            else:
                counts["fetch ok"] += 1
                by_kind[kind]["ok"] += 1

        def failed(e: WorkerError, took: float, timeout: float, kind: str, what: str = "fetch", who: str = "") -> None:
            if e.kind not in CLEAR_ERRORS:
                problem("late", kind, f"{what}: unclear error {e.kind}: {e.message.splitlines()[0]}")
            elif took > timeout + SLACK:
                problem("late", kind, f"{what} failed after {took:.1f}s: {e.message.splitlines()[0]}")
            else:
                counts[f"{what} failed clearly: {e.kind}"] += 1
                if what == "fetch":
                    by_kind[kind]["clear"] += 1
                clear.append(f"[{kind}] {what} by {who} after {took:.1f}s: {e.kind}: {e.message.splitlines()[0][:300]}")

        def stuck(name: str, what: str, kind: str, waited: float) -> None:
            problem("late", kind, f"{what} by {name} did not answer within {waited:.0f}s")
            os.kill(workers[name].pid, signal.SIGUSR1)  # its stacks go to stderr, for the diagnosis
            time.sleep(0.5)
            workers[name].kill()  # its pipe is out of step now: replace it

        def fetch(fault: Optional[str] = None) -> None:
            readers = [n for n in names[1:] if ready(n)]
            if not readers or not issued:
                return
            name = rng.choice(readers)
            w = workers[name]
            asked = rng.choice([None, None, rng.choice(issued[-4:])])
            trig = None
            kind = "none"
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
                    kind = fault
                    trig = faults.during_read(w.worker_id, action, after="random", max_after=0.3, timeout=10)
                    counts[f"fault during fetch: {fault}"] += 1
            by_kind[kind]["fetches"] += 1
            t0 = time.monotonic()
            w.send("fetch", version=asked, fetch_timeout=FETCH_TIMEOUT, serve=rng.random() < 0.5)
            try:
                if fault == "coordinator":
                    # restart it after a random outage, while the reader keeps going
                    if trig.wait(10) and coord.proc.poll() is not None:
                        time.sleep(rng.uniform(0.1, 1.5))
                        coord.start()
                got = w.result(timeout=FETCH_TIMEOUT + SLACK + 30)
                check(got, asked, kind)
            except WorkerError as e:
                failed(e, time.monotonic() - t0, FETCH_TIMEOUT, kind, who=name)
            except TimeoutError:
                stuck(name, "fetch", kind, FETCH_TIMEOUT + SLACK + 30)
            finally:
                if trig is not None and trig.cancel():
                    counts[f"fault not fired (read too short): {fault}"] += 1
                    by_kind[kind]["not fired"] += 1
                if fault == "coordinator" and coord.proc.poll() is not None:
                    coord.start()
                if fault == "hang" and victim:
                    faults.resume(workers[victim].pid)
                    hung_until[victim] = 0.0

        def registered() -> set[str]:
            return {x["worker_id"] for x in faults.status()["workers"]}

        def wait_until(pred, timeout: float) -> bool:
            end = time.monotonic() + timeout
            while time.monotonic() < end:
                try:
                    if pred():
                        return True
                except Exception:  # the coordinator may be busy or restarting
                    pass
                time.sleep(0.05)
            return False

        def control_fault(kind: str) -> None:
            """A read of a version only the trainer holds, over its slowed uplink; the fault
            (cut or pause) while it runs; then the trainer's double-buffered step."""
            readers = [n for n in names[1:] if ready(n)]
            if tb is None or not readers or not ready("trainer"):
                return
            big = max(CP_MIB << 20, 3 * size)
            try:
                v = publish(kind, big)
            except WorkerError as e:
                failed(e, 0.0, 60, kind, "publish", "trainer")
                return
            trainer, name = workers["trainer"], rng.choice(readers)
            w = workers[name]
            by_kind[kind]["fetches"] += 1
            counts[f"{kind}: read by a {'plain' if name == 'r2' else 'pipelined'} reader"] += 1
            faults.slow(ns("trainer"), "eth0", CP_RATE)
            answers: dict[str, Any] = {}
            try:
                t0 = time.monotonic()
                w.send("fetch", version=v, fetch_timeout=CP_FETCH_TIMEOUT, serve=rng.random() < 0.5)
                if not wait_until(lambda: Faults._reading(faults.status(), w.worker_id, trainer.worker_id), 10):
                    counts[f"fault not fired (read too short): {kind}"] += 1
                    by_kind[kind]["not fired"] += 1
                else:
                    counts[f"fault during fetch: {kind}"] += 1
                    hold = WORKER_TTL * rng.uniform(1.3, 2.0)
                    if kind == "cut":
                        reset = rng.random() < 0.5
                        faults.cut(ns("trainer"), tb.coordinator_ip, reset=reset)
                        time.sleep(hold)
                        if trainer.worker_id not in registered():
                            counts["cut: holder expired"] += 1
                        faults.heal(ns("trainer"), tb.coordinator_ip)
                        if not wait_until(lambda: trainer.worker_id in registered(), 20):
                            problem("late", kind, f"{trainer.worker_id} did not re-register within 20s of healing")
                    else:
                        before = registered()
                        faults.hang(coord.pid)
                        time.sleep(hold)
                        faults.resume(coord.pid)
                        gone = before - registered()
                        if gone:
                            problem("expired", kind, f"the coordinator resumed after {hold:.1f}s and expired live "
                                                     f"workers {sorted(gone)}")
                    # the double-buffered step, while the reader may still be reading v
                    if not w.conn.poll():
                        counts[f"{kind}: unpublished mid-read"] += 1
                    s2, s3 = rng.randrange(1 << 30), rng.randrange(1 << 30)
                    try:
                        v2 = trainer.call("publish", timeout=60, seed=s2, nbytes=big)
                        record(v2, s2, kind, big)
                        # known before the read is checked, so that bytes of it count as mixed, not torn
                        for d in digest(make_weights(s3, big)).values():
                            by_digest[d] = v2 + 1
                        trainer.send("unpublish", version=v, refill=s3, drain_timeout=CP_FETCH_TIMEOUT + LEASE_TTL)
                        answers["trainer"] = None
                    except WorkerError as e:
                        failed(e, 0.0, 60, kind, "publish", "trainer")
                got = w.result(timeout=CP_FETCH_TIMEOUT + SLACK + 30)
                check(got, v, kind)
            except WorkerError as e:
                failed(e, time.monotonic() - t0, CP_FETCH_TIMEOUT, kind, who=name)
            except TimeoutError:
                stuck(name, "fetch", kind, CP_FETCH_TIMEOUT + SLACK + 30)
            finally:
                faults.heal_all()
                faults.resume(coord.pid)
                if "trainer" in answers:
                    t1 = time.monotonic()
                    try:
                        r = trainer.result(timeout=CP_FETCH_TIMEOUT + LEASE_TTL + SLACK + 30)
                        record(r["version"], s3, kind, big)
                        counts["unpublish ok"] += 1
                    except WorkerError as e:
                        if e.kind in CLEAR_ERRORS:
                            counts[f"unpublish refused: {e.kind}"] += 1
                        else:
                            problem("late", kind, f"unpublish: unclear error {e.kind}")
                    except TimeoutError:
                        stuck("trainer", "unpublish", kind, time.monotonic() - t1)
                faults.slow(ns("trainer"), "eth0", tb.host_rate)  # back to the testbed's link

        def status_or_none() -> tuple[Optional[dict], float]:
            """The coordinator's status, and when it was asked (before its answer was made)."""
            sent = time.monotonic()
            try:
                return faults.status(timeout=2.0), sent
            except Exception:  # busy: the next poll
                return None, sent

        def reader_cut() -> None:
            """A read of a version only the holder holds (published with checksums off), over
            its slowed uplink; the reader's route to the coordinator cut for 1.3-2 x worker_ttl
            while it reads; during the cut the holder's double-buffered step: publish the next
            version, unpublish the one being read, write the version after into its memory the
            moment unpublish returns. Only the fencing keeps those bytes out of the read."""
            kind = "reader-cut"
            readers = [n for n in names[1:] if ready(n)]
            if tb is None or not readers or "holder" not in workers:
                return
            if not workers["holder"].proc.is_alive():
                workers["holder"].kill()
                spawn("holder")
                counts["respawn"] += 1
            holder = workers["holder"]
            big = max(CP_MIB << 20, 3 * size)
            s, s2, s3 = (rng.randrange(1 << 30) for _ in range(3))
            d1, d2, d3 = (digest(make_weights(x, big)) for x in (s, s2, s3))  # ahead: none while the cut runs
            try:
                old = [h[1] for h in holder.call("held", timeout=30)]
                v = holder.call("publish", timeout=60, seed=s, nbytes=big)
            except WorkerError as e:
                failed(e, 0.0, 60, kind, "publish", "holder")
                return
            except TimeoutError:
                stuck("holder", "publish", kind, 60)
                return
            record(v, s, kind, big, d1)
            counts["publish"] += 1
            for ov in old:  # what the holder kept from earlier trials (older than v): free its memory
                try:
                    holder.call("unpublish", timeout=30 + SLACK, version=ov, drain_timeout=5.0)
                except WorkerError as e:
                    counts[f"reader-cut: freeing an old version refused: {e.kind}"] += 1
                except TimeoutError:
                    stuck("holder", "unpublish", kind, 30 + SLACK)
                    return
            name = rng.choice(readers)
            w = workers[name]
            by_kind[kind]["fetches"] += 1
            counts[f"{kind}: read by a {'plain' if name == 'r2' else 'pipelined'} reader"] += 1
            faults.slow(ns("holder"), "eth0", CP_RATE)
            trial: dict[str, Any] = {"reader": name, "version": v}
            sent_unpublish = False
            lease_until: Optional[float] = None  # no earlier than this, the coordinator lets the reader's lease lapse
            t_ret: Optional[float] = None  # unpublish was seen answered by then, the reader still cut off
            before = Counter(by_kind[kind])
            t0 = t_unp = time.monotonic()
            try:
                w.send("fetch", version=v, fetch_timeout=CP_FETCH_TIMEOUT, serve=rng.random() < 0.5)
                if not wait_until(lambda: Faults._reading(faults.status(), w.worker_id, holder.worker_id), 10):
                    counts[f"fault not fired (read too short): {kind}"] += 1
                    by_kind[kind]["not fired"] += 1
                else:
                    counts[f"fault during fetch: {kind}"] += 1
                    hold = WORKER_TTL * rng.uniform(1.3, 2.0)
                    reset = rng.random() < 0.5
                    early = rng.random() < 0.5  # unpublish at once (waiting across the expiry), or once expired
                    trial.update(hold=round(hold, 2), reset=reset, unpublish_at="cut" if early else "expiry",
                                 expired=False, lease_kept=None)
                    faults.cut(ns(name), tb.coordinator_ip, reset=reset)
                    t_cut = time.monotonic()

                    def watch() -> None:
                        """One look at the coordinator while the reader is cut off: its lease on v
                        (nothing of the reader reaches the coordinator now, so only the lease's
                        lapse may end it) and its registration."""
                        nonlocal lease_until
                        st, sent = status_or_none()
                        if st is None:
                            return
                        mine = [l for l in st["leases"] if l["worker_id"] == w.worker_id and l["version"] == v]
                        for l in mine:
                            lease_until = max(lease_until or 0.0, sent + l["expires_in"])
                        if not trial["expired"] and w.worker_id not in {x["worker_id"] for x in st["workers"]}:
                            # the coordinator expired the reader: does it still count its lease?
                            trial.update(expired=True, expired_after=round(time.monotonic() - t_cut, 2),
                                         lease_kept=bool(mine))
                            if not sent_unpublish:
                                send_unpublish()

                    try:
                        v2 = holder.call("publish", timeout=60, seed=s2, nbytes=big)
                        record(v2, s2, kind, big, d2)
                        counts["publish"] += 1
                        # known before the read is checked, so that bytes of it count as mixed, not torn
                        for dg in d3.values():
                            by_digest[dg] = v2 + 1
                    except WorkerError as e:
                        failed(e, 0.0, 60, kind, "publish", "holder")
                        v2 = None
                    except TimeoutError:
                        stuck("holder", "publish", kind, 60)
                        v2 = None

                    def send_unpublish() -> None:
                        nonlocal sent_unpublish, t_unp
                        if v2 is None:
                            return  # no next version: the step is skipped
                        if not w.conn.poll():
                            counts[f"{kind}: unpublished mid-read"] += 1
                        holder.send("unpublish", version=v, refill=s3, drain_timeout=CP_FETCH_TIMEOUT + LEASE_TTL)
                        sent_unpublish, t_unp = True, time.monotonic()

                    watch()  # the reader's lease, once the cut is in place
                    if early:
                        send_unpublish()
                    while time.monotonic() < t_cut + hold:
                        watch()
                        if sent_unpublish and t_ret is None and holder.conn.poll():
                            t_ret = time.monotonic()  # answered (drained or not) while the reader is cut off
                            trial["unpublish_returned_after"] = round(t_ret - t_cut, 2)
                        time.sleep(0.1)
                    if lease_until is not None:
                        trial["lease_lapses_after"] = round(lease_until - t_cut, 2)
                    if not sent_unpublish:
                        send_unpublish()  # never seen expired: unpublish anyway, as the cut ends
                    faults.heal(ns(name), tb.coordinator_ip)
                    t_heal = time.monotonic()
                    if not wait_until(lambda: w.worker_id in registered(), 20):
                        problem("late", kind, f"{w.worker_id} did not re-register within 20s of healing")
                    else:
                        trial["reregistered_after_heal"] = round(time.monotonic() - t_heal, 2)
                got = w.result(timeout=CP_FETCH_TIMEOUT + SLACK + 30)
                trial["fetch_s"] = round(time.monotonic() - t0, 1)
                check(got, v, kind)
            except WorkerError as e:
                trial["fetch_s"] = round(time.monotonic() - t0, 1)
                failed(e, time.monotonic() - t0, CP_FETCH_TIMEOUT, kind, who=name)
            except TimeoutError:
                stuck(name, "fetch", kind, CP_FETCH_TIMEOUT + SLACK + 30)
            finally:
                faults.heal_all()
                if sent_unpublish:
                    try:
                        r = holder.result(timeout=CP_FETCH_TIMEOUT + LEASE_TTL + SLACK + 30)
                        record(r["version"], s3, kind, big, d3)
                        counts["unpublish ok"] += 1
                        trial.update(unpublish="drained", unpublish_waited=round(r["waited"], 2))
                        if t_ret is not None and lease_until is not None and t_ret < lease_until - 0.2:
                            # invariant 3: the reader could not release (cut off), its lease had not lapsed
                            problem("early", kind, f"unpublish of v{v} drained {lease_until - t_ret:.1f}s before "
                                                   f"the lease of {w.worker_id} (cut off, expired: {trial['expired']}) "
                                                   f"lapsed on the coordinator; v{v}'s memory was overwritten then")
                            trial["early"] = True
                    except WorkerError as e:
                        trial.update(unpublish=e.kind, unpublish_waited=round(time.monotonic() - t_unp, 2))
                        if e.kind in CLEAR_ERRORS:
                            counts[f"unpublish refused: {e.kind}"] += 1
                        else:
                            problem("late", kind, f"unpublish: unclear error {e.kind}")
                    except TimeoutError:
                        stuck("holder", "unpublish", kind, time.monotonic() - t_unp)
                faults.slow(ns("holder"), "eth0", tb.host_rate)  # back to the testbed's link
                if "hold" in trial:
                    trial["outcome"] = ",".join(sorted((Counter(by_kind[kind]) - before) - Counter(fetches=1))) or "?"
                    reader_cuts.append(trial)

        def unpublish() -> None:
            cands = [n for n in names if ready(n)]
            name = rng.choice(cands)
            try:
                held = workers[name].call("held", timeout=30)
            except TimeoutError:
                problem("late", "none", f"{name} did not answer 'held' within 30s")
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
                    problem("late", "none", f"unpublish: unclear error {e.kind}")

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
        if tb is not None and w8.get("reader-cut", 0) > 0:
            spawn("holder")
        publish()
        actions = {"publish": publish, "fetch": lambda: fetch(), "kill": lambda: fetch("kill"),
                   "hang": lambda: fetch("hang"), "coordinator": lambda: fetch("coordinator"),
                   "unpublish": unpublish, "kill-idle": kill, "hang-idle": hang, "restart": restart,
                   "cut": lambda: control_fault("cut"), "pause": lambda: control_fault("pause"),
                   "reader-cut": reader_cut}
        unknown = set(w8) - set(actions)
        if unknown:
            raise ValueError(f"unknown soak actions {sorted(unknown)}; known: {sorted(actions)}")
        fns, wts = zip(*[(guarded(actions[a]), wt) for a, wt in w8.items() if wt > 0])
        t_start = time.monotonic()
        try:
            for i in range(trials):
                respawn_dead()
                rng.choices(fns, wts)[0]()
                counts["trials"] += 1
                if (i + 1) % 20 == 0:
                    log(f"  {i + 1}/{trials} trials, {time.monotonic() - t_start:.0f}s, problems so far: {len(bad)}")
            # every version whose publish returned is still known (unless retention retired
            # it: older than the newest KEEP_VERSIONS, held by no one), numbers never reused
            time.sleep(0.5)
            st = faults.status()
            known = {v["version"] for m in st["models"] for v in m["versions"]}
            retirable = set(sorted(set(issued))[:-StateConfig.keep_versions])
            for v in issued:
                if v not in known and v not in retirable:
                    problem("lost", issued_during.get(v, "none"), f"v{v} is unknown to the coordinator")
            counter = max((m["counter"] for m in st["models"]), default=0)
            if issued and counter < max(issued):
                problem("lost", "none", f"the version counter {counter} went below v{max(issued)}")
            if len(set(issued)) != len(issued):
                problem("lost", "none", "a version number was handed out twice")
        finally:
            faults.resume_all()
            faults.heal_all()
            for w in workers.values():
                w.kill()
            coord.stop()

    kinds = Counter(what for what, _, _ in bad)
    return {"trials": trials, "seed": seed, "store": store, "seconds": time.monotonic() - t_start, "counts": dict(counts),
            "netns": bool(tb), "by_kind": {k: dict(by_kind[k]) for k in KINDS if k in by_kind},
            "torn": kinds["torn"], "mixed": kinds["mixed"], "lost": kinds["lost"], "late": kinds["late"],
            "expired": kinds["expired"], "early": kinds["early"], "problems": [f"{what} [{kind}]: {msg}" for what, kind, msg in bad],
            "versions": len(issued), "clear_errors": clear, "reader_cut": reader_cuts}


def reader_cut_summary(trials: list[dict]) -> str:
    """One line for the reader-cut kind: trials fired, readers the coordinator expired during
    the cut (and how many of their leases it still listed then), unpublish's wait."""
    waited = sorted(t["unpublish_waited"] for t in trials if "unpublish_waited" in t)
    expired = [t for t in trials if t.get("expired")]

    def pct(q: float) -> float:
        return waited[min(len(waited) - 1, int(q * len(waited)))]

    line = (f"reader-cut: {len(trials)} fired, reader expired during the cut in {len(expired)} "
            f"(its lease still listed in {sum(1 for t in expired if t.get('lease_kept'))}), ")
    if waited:
        line += (f"unpublish waited p50 {pct(0.5):.1f}s max {waited[-1]:.1f}s "
                 f"(drained in {sum(1 for t in trials if t.get('unpublish') == 'drained')}, "
                 f"answered during the cut in {sum(1 for t in trials if 'unpublish_returned_after' in t)}, "
                 f"before the lease lapsed in {sum(1 for t in trials if t.get('early'))})")
    else:
        line += "no unpublish"
    return line


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--mib", type=int, default=16, help="version size")
    ap.add_argument("--no-netns", action="store_true", help="run on loopback (no cut/pause/reader-cut kinds)")
    ap.add_argument("--weight", action="append", default=[], metavar="ACTION=W",
                    help=f"how often an action is drawn (defaults: {DEFAULT_WEIGHTS}); 0 leaves it out")
    ap.add_argument("--store", choices=["sqlite", "etcd"], default="sqlite",
                    help="the coordinator's store (etcd: a real etcd member on loopback; implies --no-netns)")
    ap.add_argument("--only", choices=KINDS, metavar="KIND",
                    help=f"run only that fault kind's trials (one of {', '.join(KINDS)}; none: plain fetches)")
    ap.add_argument("--json", default="out/soak.json")
    args = ap.parse_args(argv)
    weights = {}
    for item in args.weight:
        name, _, w = item.partition("=")
        weights[name.strip()] = float(w)
    r = run(args.trials, args.seed, args.mib, netns=False if args.no_netns or args.store == "etcd" else None,
            weights=weights, store=args.store, only=args.only)
    print(f"soak: {r['trials']} trials, {r['versions']} versions, {r['seconds']:.0f}s (seed {r['seed']}, "
          f"{'network namespaces' if r['netns'] else 'loopback'}, {r['store']} store)")
    for k, n in sorted(r["counts"].items()):
        print(f"  {k:<45}{n:>6}")
    print("fetches by fault kind:")
    print(f"  {'kind':<12}" + "".join(f"{o:>10}" for o in ("fetches",) + OUTCOMES))
    for kind, c in r["by_kind"].items():
        print(f"  {kind:<12}" + "".join(f"{c.get(o, 0):>10}" for o in ("fetches",) + OUTCOMES))
    if r["reader_cut"]:
        print(reader_cut_summary(r["reader_cut"]))
    print(f"torn {r['torn']}  mixed {r['mixed']}  lost {r['lost']}  late/unclear {r['late']}  "
          f"expired at resume {r['expired']}  early drain {r['early']}")
    for p in r["problems"][:20]:
        print(f"  PROBLEM {p}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(r, indent=2))
    return 0 if not r["problems"] else 1


if __name__ == "__main__":
    sys.exit(main())
