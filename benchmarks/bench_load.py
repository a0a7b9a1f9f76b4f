"""Coordinator under load: thousands of heart-beating workers plus a stream of read leases.

Starts a real coordinator process (``python -m tensorhub coordinator --port 0``) and drives
it from this process (asyncio, a minimal HTTP/1.1 keep-alive client over a few connections,
so the generator costs less CPU than the service it measures):

1. setup: ``--workers`` simulated workers register (``POST /v1/workers``); ``--holders``
   of them publish a replica (small manifest, fake addresses) of one of ``--models``
   models (``POST /v1/models/{m}/versions`` + ``POST /v1/replicas``). The coordinator's
   RSS before and after the replicas gives the memory per replica.
2. load, for ``--seconds``: every worker heart-beats every ``--heartbeat`` seconds
   (``POST /v1/workers/{id}/heartbeat``, phases spread evenly), and ``--lease-rate`` times
   a second a random worker acquires a read lease on a random model
   (``POST /v1/leases``) and releases it (``POST /v1/leases/{id}/release``).

Open loop: requests are sent on schedule whether or not earlier ones have answered.
Latency is measured from the moment a request is handed to the client to its answer;
``late`` says how far behind schedule the generator itself fell (if large, the numbers
measure this machine, not the coordinator). Prints p50/p99/max per request kind,
achieved rates, errors, and memory per replica; ``--json`` writes them.

    python benchmarks/bench_load.py                       # 2,000 workers, 200 leases/s, 30 s
    python benchmarks/bench_load.py --workers 200 --lease-rate 20 --seconds 3   # quick

Fleet mode (``--fleet``, issue 13's figures) lives in ``benchmarks/bench_fleet.py`` (see
there); ``bench_load.py --fleet`` runs it with the same arguments.

    python benchmarks/bench_load.py --fleet               # 10,000 workers, 1,024 readers, 50,000 tensors
    python benchmarks/bench_load.py --fleet --workers 300 --readers 12 --fleet-tensors 300 --chunks 64 128 --history 3 30

``run(...)`` is what ``tests/test_load.py`` calls (shortened, no timing assertions).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

KINDS = ("register", "publish", "heartbeat", "acquire", "release")


@dataclass
class Kind:
    lat: list[float] = field(default_factory=list)  # seconds, answered requests
    errors: dict[str, int] = field(default_factory=dict)  # "HTTP 409" / exception name -> count

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _cpu(pid: int) -> float:
    """CPU seconds (user + system) the process has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far (all cores)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(v) - idle) / tick, sum(v) / tick


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


class CoordinatorProc:
    """``tensorhub coordinator`` in a child process; prints its URL when ready."""

    def __init__(self, state_dir: Path, worker_ttl: float, extra: tuple[str, ...] = ()) -> None:
        cmd = [sys.executable, "-m", "tensorhub", "coordinator", "--host", "127.0.0.1", "--port", "0",
               "--state-dir", str(state_dir), "--log-level", "warning", "--worker-ttl", str(worker_ttl), *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if "serving on" not in line:
            self.proc.kill()
            raise RuntimeError(f"coordinator did not start: {line!r}")
        self.url = line.split("serving on", 1)[1].strip()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class _Pool:
    """A few keep-alive HTTP/1.1 connections to one host; JSON bodies; nothing else.

    The coordinator answers with Content-Length (no chunking) and keeps connections open,
    so a request is one write and a header parse; far cheaper than a general client."""

    def __init__(self, url: str, size: int, headers: Optional[dict] = None) -> None:
        from urllib.parse import urlsplit

        u = urlsplit(url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self.head = f"Host: {u.netloc}\r\n{extra}".encode()
        self.size = size
        self.idle: asyncio.LifoQueue = asyncio.LifoQueue()
        self.opened = 0

    async def _conn(self) -> tuple:
        if self.idle.empty() and self.opened < self.size:
            self.opened += 1
            try:
                return await asyncio.open_connection(self.host, self.port)
            except Exception:
                self.opened -= 1
                raise
        return await self.idle.get()

    async def warm(self, n: int) -> None:
        """Open up to ``n`` connections now (idle, for later requests)."""
        async def one() -> None:
            self.opened += 1
            try:
                self.idle.put_nowait(await asyncio.open_connection(self.host, self.port))
            except Exception:
                self.opened -= 1
                raise

        await asyncio.gather(*(one() for _ in range(max(0, min(n, self.size) - self.opened))))

    async def request(self, method: str, path: str, body: Optional[bytes] = None) -> tuple[int, bytes]:
        r, w = await self._conn()
        try:
            payload = body or b""
            w.write(f"{method} {path} HTTP/1.1\r\n".encode() + self.head
                    + (b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(payload)) + payload)
            status_line = await r.readline()
            status = int(status_line.split(b" ", 2)[1])
            length, close = 0, False
            while True:
                line = await r.readline()
                if line in (b"\r\n", b""):
                    break
                k, _, v = line.partition(b":")
                k = k.strip().lower()
                if k == b"content-length":
                    length = int(v)
                elif k == b"connection" and v.strip().lower() == b"close":
                    close = True
            data = await r.readexactly(length) if length else b""
        except BaseException:
            w.close()
            self.opened -= 1
            raise
        if close:
            w.close()
            self.opened -= 1
        else:
            self.idle.put_nowait((r, w))
        return status, data

    async def close(self) -> None:
        while not self.idle.empty():
            _, w = self.idle.get_nowait()
            w.close()


def _manifest(tensors: int) -> dict:
    return {"tensors": [
        {"name": f"model.layers.{i}.mlp.down_proj.weight", "dtype": "bfloat16",
         "shape": [4096, 1024], "nbytes": 4096 * 1024 * 2}
        for i in range(tensors)
    ]}


async def _drive(url: str, pid: int, *, workers: int, holders: int, models: int, tensors: int,
                 seconds: float, heartbeat: float, lease_rate: float, connections: int,
                 seed: int) -> dict:
    rng = random.Random(seed)
    stats = {k: Kind() for k in KINDS}
    late: list[float] = []
    slow: list[tuple] = []  # (seconds into the load phase, kind, ms) of answers over 50 ms
    t_start = time.perf_counter()
    pending: set[asyncio.Task] = set()
    http = _Pool(url, connections)
    try:

        async def call(kind: str, path: str, body: Optional[dict] = None) -> Optional[dict]:
            t0 = time.perf_counter()
            try:
                status, data = await asyncio.wait_for(
                    http.request("POST", path, json.dumps(body if body is not None else {}).encode()), 60)
                dt = time.perf_counter() - t0
                if status >= 400:
                    stats[kind].error(f"HTTP {status}")
                    return None
            except Exception as e:  # connection reset, timeout, ...
                stats[kind].error(type(e).__name__)
                return None
            stats[kind].lat.append(dt)
            if dt > 0.05 and kind in ("heartbeat", "acquire", "release"):
                slow.append((round(t0 - t_start, 3), kind, round(dt * 1e3, 1)))
            return json.loads(data)

        async def gather_limited(coros, limit: int = 64) -> None:
            sem = asyncio.Semaphore(limit)

            async def one(c):
                async with sem:
                    await c

            await asyncio.gather(*(one(c) for c in coros))

        # ---- setup: workers, versions, replicas
        ids = [f"sim-{i:05d}" for i in range(workers)]
        rss_empty = _rss(pid)
        zones = ["z1", "z2", "z3", "z4"]
        await gather_limited(call("register", "/v1/workers", {
            "worker_id": w, "endpoint": f"127.0.0.1:{20000 + i}",
            "locality": {"datacenter": "dc1", "zone": zones[i % len(zones)], "host": f"h{i // 8}"},
        }) for i, w in enumerate(ids))
        names = [f"policy-{j}" for j in range(models)]
        for m in names:
            await call("publish", f"/v1/models/{m}/versions", {})
        rss_before = _rss(pid)
        man = _manifest(tensors)
        holder_ids = ids[:holders]

        def replica_body(i: int, w: str) -> dict:
            return {"worker_id": w, "model": names[i % models], "version": 1, "manifest": man,
                    "addresses": [(1 << 32) + (i << 28) + k * (8 << 20) for k in range(tensors)]}

        await gather_limited(call("publish", "/v1/replicas", replica_body(i, w))
                             for i, w in enumerate(holder_ids))
        rss_after = _rss(pid)
        setup_errors = sum(sum(stats[k].errors.values()) for k in ("register", "publish"))

        # ---- load
        samples: list[tuple[float, float, float]] = []  # (t, machine busy cores, coordinator cores)

        async def sample() -> None:
            prev = (time.perf_counter(), _machine_busy()[0], _cpu(pid))
            while True:
                await asyncio.sleep(0.5)
                now = (time.perf_counter(), _machine_busy()[0], _cpu(pid))
                dt = now[0] - prev[0]
                samples.append((round(now[0] - t_start, 1), round((now[1] - prev[1]) / dt, 2),
                                round((now[2] - prev[2]) / dt, 2)))
                prev = now

        def spawn(coro) -> None:
            t = asyncio.ensure_future(coro)
            pending.add(t)
            t.add_done_callback(pending.discard)

        async def lease(reader: str, m: str) -> None:
            g = await call("acquire", "/v1/leases", {"worker_id": reader, "model": m, "version": 1})
            if g is not None:
                await call("release", f"/v1/leases/{g['lease_id']}/release")

        loop = asyncio.get_running_loop()
        cpu0, gen0 = _cpu(pid), time.process_time()
        t_start = time.perf_counter()
        m0 = _machine_busy()[0]
        sampler = asyncio.ensure_future(sample())
        start = loop.time() + 0.05
        end = start + seconds
        hb_period = heartbeat / max(workers, 1)
        lease_period = 1.0 / lease_rate if lease_rate > 0 else float("inf")
        next_hb, hb_i = start, 0
        next_lease = start if lease_rate > 0 else float("inf")
        sent = {"heartbeat": 0, "lease": 0}
        while True:
            now = loop.time()
            if now >= end:
                break
            while next_hb <= now and next_hb < end:
                late.append(now - next_hb)
                spawn(call("heartbeat", f"/v1/workers/{ids[hb_i % workers]}/heartbeat"))
                sent["heartbeat"] += 1
                hb_i += 1
                next_hb = start + hb_i * hb_period
            while next_lease <= now and next_lease < end:
                late.append(now - next_lease)
                spawn(lease(rng.choice(ids), rng.choice(names)))
                sent["lease"] += 1
                next_lease += lease_period
            # Fire whatever is due every 2 ms: a finer timer only spins (uvloop's clock is in ms).
            await asyncio.sleep(max(0.002, min(next_hb, next_lease, end) - loop.time()))
        elapsed = loop.time() - start
        sampler.cancel()
        machine = _machine_busy()[0] - m0
        if pending:
            await asyncio.wait(pending, timeout=60)
        cpu, gen = _cpu(pid) - cpu0, time.process_time() - gen0
        rss_end = _rss(pid)
        alive = (await http.request("GET", "/v1/info"))[0] == 200
    finally:
        await http.close()

    out: dict = {
        "workers": workers, "holders": holders, "models": models, "tensors_per_manifest": tensors,
        "seconds": round(elapsed, 2), "heartbeat_interval": heartbeat, "lease_rate_target": lease_rate,
        "sent": sent, "setup_errors": setup_errors, "alive_after": alive,
        "rss_mib": {"empty": round(rss_empty / 2**20, 1), "before_replicas": round(rss_before / 2**20, 1), "after_replicas": round(rss_after / 2**20, 1),
                    "end": round(rss_end / 2**20, 1)},
        "bytes_per_replica": round((rss_after - rss_before) / max(holders, 1)),
        "bytes_per_worker": round((rss_before - rss_empty) / max(workers, 1)),
        "coordinator_cpu": round(cpu / elapsed, 3),
        "coordinator_cpu_us_per_request": round(cpu / max(1, sum(len(stats[k].lat) for k in ("heartbeat", "acquire", "release"))) * 1e6),
        "generator_cpu": round(gen / elapsed, 3),
        # everything else on the machine (other users' jobs) in cores, over the load phase
        "others_cpu": round(max(0.0, machine - cpu - gen) / elapsed, 3),
        "cores": os.cpu_count(),
        # 0.5 s samples: when other processes kept every core busy, stalls are theirs
        "busiest_samples": sorted(samples, key=lambda x: -x[1])[:5],
        "generator_late_ms": {"p50": round(_pct(late, 0.5) * 1e3, 2), "p99": round(_pct(late, 0.99) * 1e3, 2)},
        "kinds": {},
        "slow": slow[:50],
    }
    for k, s in stats.items():
        out["kinds"][k] = {
            "ok": len(s.lat), "errors": dict(s.errors),
            "rate": round(len(s.lat) / elapsed, 1) if k in ("heartbeat", "acquire", "release") else None,
            "p50_ms": round(_pct(s.lat, 0.5) * 1e3, 2), "p99_ms": round(_pct(s.lat, 0.99) * 1e3, 2),
            "max_ms": round(max(s.lat, default=float("nan")) * 1e3, 2),
        }
    out["errors"] = sum(sum(s.errors.values()) for s in stats.values())
    return out


def _run_loop(coro):  # type: ignore[no-untyped-def]
    """asyncio.run on uvloop when installed (uvicorn[standard] brings it): half the CPU."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def run(*, workers: int = 2000, holders: Optional[int] = None, models: int = 4, tensors: int = 16,
        seconds: float = 30.0, heartbeat: float = 2.0, lease_rate: float = 200.0, connections: int = 16,
        seed: int = 0, url: Optional[str] = None, pid: Optional[int] = None) -> dict:
    """Start a coordinator (or use the one at ``url`` with process id ``pid``), load it,
    stop it; return the figures (see module docstring)."""
    holders = workers // 2 if holders is None else holders
    kw = dict(workers=workers, holders=holders, models=models, tensors=tensors, seconds=seconds,
              heartbeat=heartbeat, lease_rate=lease_rate, connections=connections, seed=seed)
    if url is not None:
        assert pid is not None, "pass the coordinator's pid with its url"
        out = _run_loop(_drive(url, pid, **kw))
        out["coordinator_alive"] = out["alive_after"]
        return out
    with tempfile.TemporaryDirectory(prefix="th-load-") as tmp:
        coord = CoordinatorProc(Path(tmp) / "state", worker_ttl=max(10.0, 5 * heartbeat))
        try:
            out = _run_loop(_drive(coord.url, coord.proc.pid, **kw))
            out["coordinator_alive"] = coord.alive
        finally:
            coord.stop()
    return out


def report(out: dict) -> str:
    lines = [
        f"{out['workers']} workers heart-beating every {out['heartbeat_interval']} s, "
        f"{out['holders']} replicas ({out['tensors_per_manifest']} tensors each) over {out['models']} models, "
        f"{out['lease_rate_target']:.0f} leases/s target, {out['seconds']} s",
        f"{'request':<10} {'ok':>7} {'errors':>7} {'rate/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}",
    ]
    for k, s in out["kinds"].items():
        rate = f"{s['rate']:.1f}" if s["rate"] is not None else "-"
        lines.append(f"{k:<10} {s['ok']:>7} {sum(s['errors'].values()):>7} {rate:>8} "
                     f"{s['p50_ms']:>8.2f} {s['p99_ms']:>8.2f} {s['max_ms']:>8.2f}"
                     + (f"  {s['errors']}" if s["errors"] else ""))
    r = out["rss_mib"]
    lines.append(f"coordinator RSS: {r['empty']} MiB empty, {r['before_replicas']} MiB with the workers, "
                 f"{r['after_replicas']} MiB with the replicas, {r['end']} MiB at the end; "
                 f"{out['bytes_per_replica']} bytes per replica, {out['bytes_per_worker']} per worker")
    lines.append(f"coordinator CPU during load: {out['coordinator_cpu'] * 100:.0f}% of a core, "
                 f"{out['coordinator_cpu_us_per_request']} us per request; generator CPU {out['generator_cpu'] * 100:.0f}%; "
                 f"other processes {out['others_cpu'] * 100:.0f}% (of {out['cores']} cores)")
    lines.append("busiest 0.5 s of the machine (s into load, cores busy, coordinator cores): "
                 f"{out['busiest_samples'][:3]}")
    lines.append(f"generator lateness p50 {out['generator_late_ms']['p50']} ms, "
                 f"p99 {out['generator_late_ms']['p99']} ms; errors {out['errors']}; "
                 f"coordinator alive: {out['coordinator_alive']}")
    if out["slow"]:
        lines.append(f"first answers over 50 ms (s into load, kind, ms): {out['slow'][:8]}")
    return "\n".join(lines)



def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2000)
    p.add_argument("--holders", type=int, default=None, help="workers that publish a replica (default half)")
    p.add_argument("--models", type=int, default=4)
    p.add_argument("--tensors", type=int, default=16, help="tensors per manifest")
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--heartbeat", type=float, default=2.0, help="seconds between one worker's heartbeats")
    p.add_argument("--lease-rate", type=float, default=200.0, help="lease acquire+release pairs per second")
    p.add_argument("--connections", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", help="load this running coordinator instead of starting one (needs --pid)")
    p.add_argument("--pid", type=int, help="process id of the coordinator at --url (for its RSS)")
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--fleet", action="store_true", help="run the fleet mode instead: benchmarks/bench_fleet.py "
                   "with the other arguments (--workers default 10,000; its --help lists its options)")
    args = list(sys.argv[1:] if argv is None else argv)
    if "--fleet" in args:  # a process of its own: bench_fleet builds on this module's helpers
        args.remove("--fleet")
        return subprocess.call([sys.executable, str(Path(__file__).resolve().parent / "bench_fleet.py"), *args])
    a = p.parse_args(args)
    out = run(workers=a.workers, holders=a.holders, models=a.models, tensors=a.tensors, seconds=a.seconds,
              heartbeat=a.heartbeat, lease_rate=a.lease_rate, connections=a.connections, seed=a.seed, url=a.url, pid=a.pid)
    print(report(out))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=2))
    p99 = max(out["kinds"][k]["p99_ms"] for k in ("heartbeat", "acquire", "release"))
    print(f"worst p99 {p99:.2f} ms (target < 50 ms): {'met' if p99 < 50 else 'NOT met'}")
    return 0 if out["errors"] == 0 and out["coordinator_alive"] else 1


if __name__ == "__main__":
    sys.exit(main())
