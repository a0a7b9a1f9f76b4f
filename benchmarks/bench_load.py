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

Fleet mode (``--fleet``, issue 13's figures): ``--workers`` (10,000) heart-beat while
``--readers`` (1,024) simulated pipelined readers fetch one version of a ``--fleet-tensors``
(50,000) MoE manifest, each speaking the protocol as ``tensorhub._fetch.PipelinedSources``
does (resolve, a pipelined lease asked with ``"manifest": false``, the manifest GET once,
its partial replica, chunk reports and lease refreshes on the reader's cadence as simulated
chunks complete at ``--link-gbps``, release, the complete replica, the fetch report). Three
phases on one coordinator (``--keep-versions`` keeps them all): a base (``--chunks`` and
``--history`` firsts), more chunks per shard, more retained versions; printed side by side
with the ratio to the base and issue 13's targets marked PASS/MISS.

    python benchmarks/bench_load.py --fleet               # 10,000 workers, 1,024 readers, 50,000 tensors
    python benchmarks/bench_load.py --fleet --workers 300 --readers 12 --fleet-tensors 300 --chunks 64 128 --history 3 30

``run(...)`` and ``run_fleet(...)`` are what ``tests/test_load.py`` calls (shortened, no
timing assertions).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

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



# ---------------------------------------------------------------------- fleet mode
# N workers heart-beating and R simulated pipelined readers fetching one version, each
# speaking the protocol exactly as ``tensorhub._fetch.PipelinedSources`` and
# ``tensorhub._pipeline.PipelinedReader`` do today (their constants below), with the data
# plane replaced by a clock: a reader completes chunks at ``link_gbps`` from the chunks its
# lease's sources hold. Three phases on one coordinator, side by side: a base size, more
# chunks per shard, more retained versions; the per-reader figures and their ratios show
# whether the coordinator's work grows with either.

#: ``_fetch.DEPTH``, ``PipelinedReader.refresh_interval`` (idle; twice that when busy),
#: ``PipelinedSources.report_interval``, ``claim_patience``, ``TENSORHUB_PROGRESS_INTERVAL``.
DEPTH, REFRESH, REPORT, CLAIM_PATIENCE, PROGRESS = 2, 0.05, 0.05, 0.5, 1.0
#: Targets of issue 13 ("Figures").
TARGET_P99_MS, TARGET_CALLS, TARGET_GROWTH = 50.0, 6.0, 1.25


def moe_manifest(tensors: int, chunks: int) -> dict:
    """A MoE checkpoint's manifest (hidden 2048, 128 experts of gate/up/down per layer, the
    attention and norms, the embedding last) of ``tensors`` tensors, sized so its shard has
    exactly ``chunks`` chunks on the grid (``tensorhub._grid``)."""
    from tensorhub._grid import GRID_CHUNKS, grid_chunk_bytes

    hidden, experts, bf16 = 2048, 128, 2
    per = (1 << 20) if chunks <= GRID_CHUNKS else 64 << 20
    target = chunks * per
    shapes: list[tuple[str, list[int], bool]] = []  # name, shape ([rows] expert dim is filled in), expert?
    layer = 0
    while len(shapes) < tensors - 1:
        pre = f"model.layers.{layer}."
        shapes += [(pre + "self_attn.q_proj.weight", [hidden, hidden], False),
                   (pre + "self_attn.k_proj.weight", [512, hidden], False),
                   (pre + "self_attn.v_proj.weight", [512, hidden], False),
                   (pre + "self_attn.o_proj.weight", [hidden, hidden], False),
                   (pre + "input_layernorm.weight", [hidden], False),
                   (pre + "post_attention_layernorm.weight", [hidden], False),
                   (pre + "mlp.gate.weight", [experts, hidden], False)]
        for e in range(experts):
            for w in ("gate_proj", "up_proj", "down_proj"):
                shapes.append((f"{pre}mlp.experts.{e}.{w}.weight", [0, hidden], True))
        layer += 1
    shapes = shapes[:tensors - 1]

    def size(shape: list[int]) -> int:
        n = bf16
        for d in shape:
            n *= d
        return n

    fixed = sum(size(s) for _, s, e in shapes if not e)
    n_exp = sum(1 for _, _, e in shapes if e)
    room = target - fixed - 2 * hidden * bf16  # leave at least 2 embedding rows
    inter = max(8, (room * 9 // 10) // max(1, n_exp * hidden * bf16) // 8 * 8) if n_exp else 0
    rows = (target - fixed - n_exp * inter * hidden * bf16) // (hidden * bf16)
    if rows < 1:
        raise ValueError(f"{tensors} tensors do not fit in {chunks} chunks of {per >> 20} MiB")
    out = [{"name": n, "dtype": "bfloat16", "shape": [inter, s[1]] if e else s,
            "nbytes": size([inter, s[1]] if e else s)} for n, s, e in shapes]
    out.append({"name": "model.embed_tokens.weight", "dtype": "bfloat16", "shape": [rows, hidden],
                "nbytes": rows * hidden * bf16})
    total = sum(t["nbytes"] for t in out)
    chunk = grid_chunk_bytes(total)
    assert chunk == per and -(-total // chunk) == chunks, (total, chunk, chunks)
    return {"tensors": out}


@dataclass
class Phase:
    """One measured version: what the readers did and how the coordinator answered."""

    name: str
    chunks: int
    history: int  # versions of the model the coordinator retains when the phase starts
    version: int = 0
    calls: dict[str, int] = field(default_factory=dict)  # route -> count over all readers
    errors: dict[str, int] = field(default_factory=dict)  # route: what -> count
    heartbeat: list[float] = field(default_factory=list)
    lease: list[float] = field(default_factory=list)
    completed: int = 0
    fetch_seconds: list[float] = field(default_factory=list)
    seconds: float = 0.0
    cpu: float = 0.0  # coordinator CPU-seconds over the phase
    idle_cpu_rate: float = 0.0  # coordinator cores with heartbeats only, just before the phase
    manifest_bytes: int = 0


class _Fleet:
    """The generator: one coordinator, two keep-alive pools (heartbeats, readers)."""

    def __init__(self, url: str, pid: int, connections: int, seed: int) -> None:
        self.pid = pid
        self.hb = _Pool(url, max(2, connections // 4))
        self.http = _Pool(url, connections)
        self.rng = random.Random(seed)
        self.phase: Optional[Phase] = None
        self.setup_errors: dict[str, int] = {}
        self.lease_ttl = 30.0
        self.holding: dict[str, bytes] = {}  # worker -> its replica's registration (re-sent after expiry)
        self.hb_skipped = 0  # heartbeats not sent: 4,096 already waiting for an answer
        self.expired = 0  # heartbeats answered 404: the coordinator had dropped the worker

    async def call(self, route: str, method: str, path: str, body: Optional[dict] = None, *,
                   raw: Optional[bytes] = None, lat: Optional[list] = None, parse: bool = True,
                   pool: Optional[_Pool] = None) -> tuple[int, Any]:
        """One request, counted under ``route`` in the current phase (or as setup)."""
        ph = self.phase
        if ph is not None and pool is None:
            ph.calls[route] = ph.calls.get(route, 0) + 1
        payload = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        t0 = time.perf_counter()
        try:
            status, data = await asyncio.wait_for((pool or self.http).request(method, path, payload), 120)
        except Exception as e:
            self._error(route, type(e).__name__)
            return 0, None
        if lat is not None:
            lat.append(time.perf_counter() - t0)
        if status >= 400:
            code = ""
            try:
                code = json.loads(data).get("code", "")
            except Exception:
                pass
            self._error(route, f"HTTP {status} {code}".strip())
            return status, (json.loads(data) if data and parse else None)
        return status, (json.loads(data) if data and parse else data)

    def _error(self, route: str, what: str) -> None:
        errs = self.phase.errors if self.phase is not None else self.setup_errors
        k = f"{route}: {what}"
        errs[k] = errs.get(k, 0) + 1

    # ---- setup
    async def register(self, ids: list[str], start: int = 0, pool: Optional[_Pool] = None) -> None:
        sem = asyncio.Semaphore(64)
        zones = ["z1", "z2", "z3", "z4"]

        async def one(i: int, w: str) -> None:
            async with sem:
                _, r = await self.call("register", "POST", "/v1/workers", pool=pool, body={
                    "worker_id": w, "endpoint": f"127.0.0.1:{20000 + i % 40000}",
                    "locality": {"datacenter": "dc1", "zone": zones[i % len(zones)], "host": f"h{i // 8}"}})
                if r:
                    self.lease_ttl = float(r.get("lease_ttl", self.lease_ttl))

        await asyncio.gather(*(one(i, w) for i, w in enumerate(ids, start)))

    async def publish(self, model: str, trainer: str, manifest_json: bytes, addresses_json: bytes) -> int:
        """The trainer publishes a new complete version (one replica); its number."""
        _, r = await self.call("publish", "POST", f"/v1/models/{model}/versions", {})
        if not r or "version" not in r:
            raise RuntimeError(f"the trainer could not publish: {self.setup_errors}")
        v = int(r["version"])
        body = _replica_body(trainer, model, v, manifest_json, addresses_json)
        await self.call("publish", "POST", "/v1/replicas", raw=body)
        self.holding[trainer] = body
        return v

    # ---- heartbeats, all phases long
    async def heartbeats(self, ids: list[str], every: float, stop: asyncio.Event, late: list[float]) -> None:
        loop = asyncio.get_running_loop()
        pending: set[asyncio.Task] = set()
        period = every / max(1, len(ids))
        start, i = loop.time(), 0

        async def beat(k: int) -> None:
            w = ids[k]
            ph = self.phase
            st, _ = await self.call("heartbeat", "POST", f"/v1/workers/{w}/heartbeat", {}, pool=self.hb,
                                    lat=ph.heartbeat if ph is not None else None, parse=False)
            if st == 404:  # expired (heartbeats answered too late): register again, as the Hub does,
                self.expired += 1  # the trainer with its replica of the measured version
                await self.register([w], start=k, pool=self.hb)  # not a reader's call
                again = self.holding.get(w)
                if again is not None:
                    await self.call("publish", "POST", "/v1/replicas", raw=again, pool=self.hb)

        while not stop.is_set():
            now = loop.time()
            while start + i * period <= now:
                if self.phase is not None:
                    late.append(now - (start + i * period))
                if len(pending) < 4096:
                    t = asyncio.ensure_future(beat(i % len(ids)))
                    pending.add(t)
                    t.add_done_callback(pending.discard)
                else:  # the coordinator is this far behind: bounded memory here, counted
                    self.hb_skipped += 1
                i += 1
            await asyncio.sleep(max(0.002, start + i * period - loop.time()))
        if pending:
            await asyncio.wait(pending, timeout=60)

    # ---- one simulated pipelined reader
    async def reader(self, wid: str, model: str, ph: Phase, man_json: bytes, addrs_json: bytes,
                     link_bps: float) -> None:
        from tensorhub._planner import chunk_order

        loop = asyncio.get_running_loop()
        t0 = loop.time()
        m = model
        _, r = await self.call("POST resolve", "POST", f"/v1/models/{m}/resolve", {"group": None})
        if not r:
            return
        v = int(r["version"])
        lease_body = {"worker_id": wid, "model": m, "version": v, "layout": "hf", "shard": 0, "max_sources": 4,
                      "exclude": [], "pipelined": True, "lease_id": None, "manifest": False}

        async def new_lease() -> Optional[dict]:
            body = dict(lease_body, request_id=secrets.token_hex(12))
            delay = 0.05
            while True:
                st, g = await self.call("POST leases (new)", "POST", "/v1/leases", body, lat=ph.lease)
                if st == 409 and g and g.get("code") == "no_replica" and loop.time() - t0 < 60:
                    await asyncio.sleep(delay * self.rng.uniform(0.5, 1.0))
                    delay = min(delay * 2, 1.0)
                    continue
                return g if st == 200 else None

        g = await new_lease()
        if g is None or not g.get("chunk_bytes"):
            return
        leases = [g["lease_id"]]
        cur: Optional[str] = g["lease_id"]
        st, _ = await self.call("GET manifest", "GET", f"/v1/models/{m}/versions/{v}/manifest?layout=hf&shard=0",
                                parse=False)
        chunk_bytes = int(g["chunk_bytes"])
        n = ph.chunks
        await self.call("POST versions", "POST", f"/v1/models/{m}/versions", {"version": v})
        st, rr = await self.call("POST replicas (partial)", "POST", "/v1/replicas",
                                 raw=_replica_body(wid, m, v, man_json, addrs_json,
                                                   f',"partial":true,"chunk_bytes":{chunk_bytes},"num_chunks":{n}'))
        pid = rr["replica_id"] if st == 200 and rr else None  # not serving while receiving, as the Hub goes on
        order = chunk_order(n, float(g.get("start", 0.0)), bool(g.get("reverse", False)))
        everything = frozenset(range(n))
        done: set[int] = set()
        completed: list[tuple[int, str]] = []  # (chunk, lease) not reported yet
        receiving: list[int] = []
        said_coming: list[int] = []
        sources, claimed, reserved = g["replicas"], frozenset(g.get("claimed") or ()), g.get("reserved")
        now = loop.time()
        last_refresh, last_report, last_renew, last_progress = now, float("-inf"), now, now
        next_progress = t0 + PROGRESS
        credit = 0.0  # bytes the link could have moved since the last tick
        tick = REFRESH / 2  # ``PipelinedReader._idle_cap``
        last_tick = now

        def readable(stalled: bool) -> set[int]:
            coming = set(claimed)
            for s in sources:
                coming.update(s.get("coming") or ())
            out: set[int] = set()
            for s in sources:
                ch = s.get("chunks")
                if ch is not None:
                    out.update(ch)
                elif reserved is not None and not stalled:
                    out.update(reserved)
                else:
                    out.update(everything if stalled else everything - coming)
            return out - done

        while len(done) < n:
            now = loop.time()
            if now - t0 > 600:  # the Hub's fetch_timeout: the fetch fails
                self._error("fetch", "timed out")
                return
            stalled = not receiving and now - last_progress > CLAIM_PATIENCE
            can = readable(stalled)
            # the link moves bytes only while something is in flight
            credit = min(credit + (now - last_tick) * link_bps, link_bps) if receiving else 0.0
            last_tick = now
            while True:  # DEPTH batches per source in flight, the link the only limit
                for c in order:
                    if len(receiving) >= DEPTH * max(1, len(sources)):
                        break
                    if c in can and c not in receiving:
                        receiving.append(c)
                if not receiving or credit < chunk_bytes:
                    break
                c = receiving.pop(0)
                credit -= chunk_bytes
                done.add(c)
                can.discard(c)
                completed.append((c, cur or ""))
                last_progress = now
            idle = not sources or len(receiving) < DEPTH * len(sources)
            if len(done) < n and now - last_refresh >= REFRESH * (1 if idle else 2):
                last_refresh = now
                if cur is not None:
                    st, g2 = await self.call("POST leases (refresh)", "POST", "/v1/leases",
                                             dict(lease_body, lease_id=cur), lat=ph.lease)
                    if st == 409:  # lease_lapsed: a new one (``PipelinedSources._acquire``)
                        cur = None
                    elif st != 200:
                        g2 = None
                else:
                    g2 = None
                if cur is None:
                    g2 = await new_lease()
                    if g2 is not None:
                        cur = g2["lease_id"]
                        leases.append(cur)
                if g2:
                    sources, claimed, reserved = g2["replicas"], frozenset(g2.get("claimed") or ()), g2.get("reserved")
            now = loop.time()
            if pid is not None and (completed or receiving != said_coming) and now - last_report >= REPORT:
                last_report = now
                await self._report(pid, wid, completed, receiving)
                completed, said_coming = [], list(receiving)
            if now - last_renew >= max(0.1, self.lease_ttl / 3):
                last_renew = now
                for lid in leases:
                    await self.call("POST renew", "POST", f"/v1/leases/{lid}/renew", {})
            if now >= next_progress:
                next_progress = now + PROGRESS
                await self.call("POST fetches (running)", "POST", "/v1/fetches", _fetch_report(
                    wid, m, v, "running", len(done) * chunk_bytes, n * chunk_bytes, now - t0))
            if len(done) < n:
                await asyncio.sleep(tick)
        if pid is not None and (completed or said_coming):  # ``attempt_done``: a forced report
            await self._report(pid, wid, completed, [])
        for lid in leases:
            await self.call("POST release", "POST", f"/v1/leases/{lid}/release", {})
        await self.call("POST versions", "POST", f"/v1/models/{m}/versions", {"version": v})
        st, _ = await self.call("POST replicas (complete)", "POST", "/v1/replicas",
                                raw=_replica_body(wid, m, v, man_json, addrs_json))
        seconds = loop.time() - t0
        await self.call("POST fetches (ok)", "POST", "/v1/fetches",
                        _fetch_report(wid, m, v, "ok", n * chunk_bytes, n * chunk_bytes, seconds))
        if st == 200:
            ph.completed += 1
            ph.fetch_seconds.append(seconds)

    async def _report(self, pid: str, wid: str, completed: list[tuple[int, str]], coming: list[int]) -> None:
        by_lease: dict[str, list[int]] = {}
        for c, lid in completed:
            by_lease.setdefault(lid, []).append(c)
        for lid, cs in (by_lease or {"": []}).items():
            await self.call("POST chunks", "POST", f"/v1/replicas/{pid}/chunks", {
                "worker_id": wid, "chunks": cs, "lease_ids": [lid] if lid else [], "coming": sorted(coming)})


def _replica_body(wid: str, model: str, v: int, man_json: bytes, addrs_json: bytes, extra: str = "") -> bytes:
    """``Session.replica_body`` (+ ``extra`` fields), spliced from pre-encoded parts."""
    return (f'{{"worker_id":"{wid}","model":"{model}","version":{v},"layout":"hf","shard":0,"num_shards":1,'
            f'"manifest":').encode() + man_json + b',"addresses":' + addrs_json + extra.encode() + b"}"


def _fetch_report(wid: str, model: str, v: int, state: str, nbytes: int, total: int, seconds: float) -> dict:
    return {"worker_id": wid, "model": model, "version": v, "layout": "hf", "shard": 0, "state": state,
            "nbytes": nbytes, "total": total, "seconds": round(seconds, 6), "sources": {}, "failed_sources": 0}


async def _drive_fleet(url: str, pid: int, *, workers: int, readers: int, tensors: int, chunks: tuple[int, int],
                       history: tuple[int, int], history_tensors: int, heartbeat: float, link_gbps: float,
                       connections: int, idle_seconds: float, seed: int) -> dict:
    fl = _Fleet(url, pid, connections, seed)
    model = "policy"
    ids = [f"sim-{i:05d}" for i in range(max(workers, readers + 1))]
    trainer, reader_ids = ids[0], ids[1:readers + 1]
    t_setup = time.perf_counter()
    await fl.register(ids)
    phases = [Phase("base", chunks[0], history[0]), Phase("chunks", chunks[1], history[0]),
              Phase("history", chunks[0], history[1])]
    # Retained versions before the measured ones: small manifests (their number is the cost measured).
    hist_man = json.dumps(_manifest(history_tensors)).encode()
    hist_addrs = json.dumps([(1 << 32) + k * (8 << 20) for k in range(history_tensors)]).encode()
    published = 0
    stop = asyncio.Event()
    late: list[float] = []
    hb = asyncio.ensure_future(fl.heartbeats(ids, heartbeat, stop, late))
    try:
        for ph in phases:
            while published < ph.history - 1:
                await fl.publish(model, trainer, hist_man, hist_addrs)
                published += 1
            man = moe_manifest(tensors, ph.chunks)
            man_json = json.dumps(man).encode()
            addrs_json = json.dumps([(1 << 40) + k * (1 << 28) for k in range(tensors)]).encode()
            ph.manifest_bytes = len(man_json)
            ph.version = await fl.publish(model, trainer, man_json, addrs_json)
            published += 1
            c0, t0 = _cpu(pid), time.perf_counter()
            await asyncio.sleep(idle_seconds)  # heartbeats only: the baseline this phase's CPU is net of
            ph.idle_cpu_rate = (_cpu(pid) - c0) / (time.perf_counter() - t0)
            fl.phase = ph
            c0, t0 = _cpu(pid), time.perf_counter()
            link = link_gbps * 1e9

            async def one(w: str) -> None:
                await asyncio.sleep(fl.rng.uniform(0, 0.1))  # woken by one publish, not in lockstep
                await fl.reader(w, model, ph, man_json, addrs_json, link)

            await asyncio.gather(*(one(w) for w in reader_ids))
            ph.seconds = time.perf_counter() - t0
            ph.cpu = _cpu(pid) - c0
            fl.phase = None
    finally:
        stop.set()
        await hb
        await fl.http.close()
        await fl.hb.close()
    alive = True
    try:
        alive = (await _Pool(url, 1).request("GET", "/v1/info"))[0] == 200
    except Exception:
        alive = False
    out: dict = {"workers": len(ids), "readers": readers, "tensors": tensors, "heartbeat_interval": heartbeat,
                 "link_gbps": link_gbps, "history_tensors": history_tensors, "alive_after": alive,
                 "setup_seconds": round(time.perf_counter() - t_setup, 1), "setup_errors": fl.setup_errors,
                 "expired": fl.expired, "heartbeats_skipped": fl.hb_skipped,
                 "generator_late_ms": {"p50": round(_pct(late, 0.5) * 1e3, 2), "p99": round(_pct(late, 0.99) * 1e3, 2)},
                 "phases": {}}
    for ph in phases:
        r = max(1, readers)
        net = max(0.0, ph.cpu - ph.idle_cpu_rate * ph.seconds)
        out["phases"][ph.name] = {
            "chunks": ph.chunks, "history": ph.history, "version": ph.version, "manifest_mb": round(ph.manifest_bytes / 1e6, 2),
            "seconds": round(ph.seconds, 2), "completed": ph.completed,
            "fetch_s": {"p50": round(_pct(ph.fetch_seconds, 0.5), 2), "max": round(max(ph.fetch_seconds, default=float("nan")), 2)},
            "calls": dict(sorted(ph.calls.items())), "calls_per_reader": round(sum(ph.calls.values()) / r, 2),
            "calls_per_reader_by_route": {k: round(c / r, 2) for k, c in sorted(ph.calls.items())},
            "errors": ph.errors, "heartbeats": len(ph.heartbeat), "leases": len(ph.lease),
            "heartbeat_ms": {q: round(_pct(ph.heartbeat, x) * 1e3, 2) for q, x in (("p50", 0.5), ("p99", 0.99))}
            | {"max": round(max(ph.heartbeat, default=float("nan")) * 1e3, 2)},
            "lease_ms": {q: round(_pct(ph.lease, x) * 1e3, 2) for q, x in (("p50", 0.5), ("p99", 0.99))}
            | {"max": round(max(ph.lease, default=float("nan")) * 1e3, 2)},
            "coordinator_cpu_s": round(ph.cpu, 2), "idle_cores": round(ph.idle_cpu_rate, 3),
            "cpu_s_per_reader_version": round(net / r, 4),
        }
    out["errors"] = sum(sum(p["errors"].values()) for p in out["phases"].values()) + sum(fl.setup_errors.values())
    return out


def run_fleet(*, workers: int = 10_000, readers: int = 1024, tensors: int = 50_000, chunks: tuple[int, int] = (256, 1024),
              history: tuple[int, int] = (10, 1000), history_tensors: int = 16, heartbeat: float = 2.0,
              link_gbps: float = 25.0, connections: int = 32, idle_seconds: float = 2.0, seed: int = 0) -> dict:
    """Fleet mode (see the section's comment): start a coordinator that keeps every
    version, drive the three phases, stop it; return the figures."""
    kw = dict(workers=workers, readers=readers, tensors=tensors, chunks=chunks, history=history,
              history_tensors=history_tensors, heartbeat=heartbeat, link_gbps=link_gbps,
              connections=connections, idle_seconds=idle_seconds, seed=seed)
    keep = str(max(history) + 16)
    with tempfile.TemporaryDirectory(prefix="th-fleet-") as tmp:
        coord = CoordinatorProc(Path(tmp) / "state", worker_ttl=max(10.0, 5 * heartbeat),
                                extra=("--keep-versions", keep))
        try:
            out = _run_loop(_drive_fleet(coord.url, coord.proc.pid, **kw))
            out["coordinator_alive"] = coord.alive
        finally:
            coord.stop()
    out["keep_versions"] = int(keep)
    return out


def _mark(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def report_fleet(out: dict) -> str:
    ph = out["phases"]
    b, c, h = ph["base"], ph["chunks"], ph["history"]
    cols = [f"base C={b['chunks']} H={b['history']}", f"C={c['chunks']}", f"H={h['history']}"]
    lines = [
        f"fleet: {out['workers']} workers heart-beating every {out['heartbeat_interval']} s, {out['readers']} pipelined "
        f"readers per version, {out['tensors']} tensors, link {out['link_gbps']} GB/s per reader, "
        f"--keep-versions {out['keep_versions']} (older versions' manifests: {out['history_tensors']} tensors)",
        f"{'figure':<34} {cols[0]:>18} {cols[1]:>12} {'x base':>7} {cols[2]:>12} {'x base':>7}  target",
    ]

    def row(label: str, get, target: str = "", fmt: str = "{:.2f}") -> None:
        vb, vc, vh = get(b), get(c), get(h)

        def ratio(x: float) -> str:
            return f"{x / vb:.2f}" if vb else "-"

        lines.append(f"{label:<34} {fmt.format(vb):>18} {fmt.format(vc):>12} {ratio(vc):>7} "
                     f"{fmt.format(vh):>12} {ratio(vh):>7}  {target}")

    def p99s(key: str) -> str:
        return " ".join(_mark(p[key]["p99"] < TARGET_P99_MS) for p in (b, c, h))

    row("heartbeat p50 ms", lambda p: p["heartbeat_ms"]["p50"])
    row("heartbeat p99 ms", lambda p: p["heartbeat_ms"]["p99"], f"< {TARGET_P99_MS:.0f}: {p99s('heartbeat_ms')}")
    row("heartbeat max ms", lambda p: p["heartbeat_ms"]["max"])
    row("lease p50 ms", lambda p: p["lease_ms"]["p50"])
    row("lease p99 ms", lambda p: p["lease_ms"]["p99"], f"< {TARGET_P99_MS:.0f}: {p99s('lease_ms')}")
    row("lease max ms", lambda p: p["lease_ms"]["max"])
    calls_ok = " ".join(_mark(p["calls_per_reader"] <= TARGET_CALLS) for p in (b, c, h))
    row("HTTP calls per reader-version", lambda p: p["calls_per_reader"], f"<= {TARGET_CALLS:.0f}: {calls_ok}")
    for route in sorted(set(b["calls"]) | set(c["calls"]) | set(h["calls"])):
        row(f"  {route}", lambda p, r=route: p["calls_per_reader_by_route"].get(r, 0.0))
    growth = [c["cpu_s_per_reader_version"] / b["cpu_s_per_reader_version"] if b["cpu_s_per_reader_version"] else float("inf"),
              h["cpu_s_per_reader_version"] / b["cpu_s_per_reader_version"] if b["cpu_s_per_reader_version"] else float("inf")]
    row("coordinator CPU-s per reader-ver.", lambda p: p["cpu_s_per_reader_version"],
        f"no growth (x <= {TARGET_GROWTH}): chunks {_mark(growth[0] <= TARGET_GROWTH)}, "
        f"history {_mark(growth[1] <= TARGET_GROWTH)}", fmt="{:.4f}")
    row("manifest MB (JSON)", lambda p: p["manifest_mb"])
    row("phase seconds", lambda p: p["seconds"])
    row("fetch seconds p50", lambda p: p["fetch_s"]["p50"])
    row("readers completed", lambda p: p["completed"], fmt="{:.0f}")
    errs = {k: v for p in (b, c, h) for k, v in p["errors"].items()}
    lines.append("CPU per reader-version: the coordinator's CPU-seconds over the phase, less its heart-beat-only "
                 f"rate just before ({b['idle_cores']}/{c['idle_cores']}/{h['idle_cores']} cores), over readers")
    lines.append(f"setup {out['setup_seconds']} s; generator lateness p50 {out['generator_late_ms']['p50']} ms, "
                 f"p99 {out['generator_late_ms']['p99']} ms; errors {out['errors']}"
                 + (f" {errs} {out['setup_errors']}" if out["errors"] else "")
                 + f"; workers expired and re-registered {out['expired']}; heartbeats not sent (4,096 unanswered) "
                 f"{out['heartbeats_skipped']}; coordinator alive: {out['coordinator_alive']}")
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
    f = p.add_argument_group("fleet mode (--fleet): pipelined readers of one version, at two sizes")
    f.add_argument("--fleet", action="store_true", help="run the fleet mode instead (--workers default 10,000)")
    f.add_argument("--readers", type=int, default=1024, help="simulated pipelined readers per version")
    f.add_argument("--fleet-tensors", type=int, default=50_000, help="tensors of the measured versions' manifest")
    f.add_argument("--chunks", type=int, nargs=2, default=[256, 1024], metavar=("BASE", "MORE"),
                   help="chunks per shard: base and the larger size")
    f.add_argument("--history", type=int, nargs=2, default=[10, 1000], metavar=("BASE", "MORE"),
                   help="versions retained when a phase starts: base and the larger size")
    f.add_argument("--history-tensors", type=int, default=16, help="tensors of the older versions' manifests")
    f.add_argument("--link-gbps", type=float, default=25.0, help="each reader's simulated link, GB/s")
    a = p.parse_args(argv)
    if a.fleet:
        out = run_fleet(workers=10_000 if a.workers == 2000 and "--workers" not in (argv or sys.argv) else a.workers,
                        readers=a.readers, tensors=a.fleet_tensors, chunks=tuple(a.chunks),
                        history=tuple(a.history), history_tensors=a.history_tensors, heartbeat=a.heartbeat,
                        link_gbps=a.link_gbps, connections=max(a.connections, 32), seed=a.seed)
        print(report_fleet(out))
        if a.json:
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            Path(a.json).write_text(json.dumps(out, indent=2))
        return 0 if out["errors"] == 0 and out["coordinator_alive"] else 1
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
