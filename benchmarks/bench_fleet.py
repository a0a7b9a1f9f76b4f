"""Control plane at fleet scale (issue 13's figures), against the real coordinator process.

``--workers`` (10,000) simulated workers heart-beat while ``--readers`` (1,024) simulated
pipelined readers fetch one version of a ``--fleet-tensors`` (50,000) MoE manifest, each
speaking the protocol as ``tensorhub._sources.PipelinedSources`` does, with the data plane
replaced by a clock (a reader completes chunks at ``--link-gbps`` from the chunks its
sources hold). Three phases on one coordinator (``--keep-versions`` keeps them all): a
base (``--chunks`` and ``--history`` firsts), more chunks per shard, more retained
versions; printed side by side with the ratio to the base and issue 13's targets marked
PASS/MISS.

Two protocols (``--protocol``):

* ``chunkmap`` (default, what the Hub does now): resolve; the manifest GET once; one
  pipelined lease that also registers the reader's partial replica (``serve``: manifest by
  digest, its chunk map's address); what partial sources hold is read from the sources'
  chunk maps (``_chunkmap``: one-sided reads, no coordinator call -- simulated here by
  looking at the other simulated readers' chunks); at most one lease refresh (to learn
  partial replicas registered since); the release and the complete replica in one call;
  fetch progress rides on the worker's heartbeats (its body).
* ``reports`` (the protocol before chunk maps, for comparison): partial replica and
  complete replica registered with the whole manifest, each after an allocation; chunk
  reports and lease refreshes every 50-100 ms; progress and the final fetch report posted.

    python benchmarks/bench_fleet.py                # 10,000 workers, 1,024 readers, 50,000 tensors
    python benchmarks/bench_fleet.py --workers 300 --readers 12 --fleet-tensors 300 --chunks 64 128 --history 3 30
    python benchmarks/bench_load.py --fleet ...     # the same (bench_load's fleet mode lives here)
    python benchmarks/bench_fleet.py --burst --repeat 3   # issue 31's lease burst: 1,024 leases asked ahead vs the usual way

``--burst`` (``run_burst``): N followers answered at one publish, their leases asked ahead
(``tensorhub.server.ahead``) against the usual way side by side; see the section's comment.

``run_fleet(...)`` is what ``tests/test_load.py`` calls (shortened, no timing assertions).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import os
import secrets
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_load import CoordinatorProc, _cpu, _machine_busy, _manifest, _pct, _Pool, _run_loop  # noqa: E402

#: ``PipelinedReader.first_refresh``: the one refresh comes no sooner than this.
FIRST_REFRESH = 0.1

# N workers heart-beating and R simulated pipelined readers fetching one version, each
# speaking the protocol exactly as ``tensorhub._sources.PipelinedSources`` and
# ``tensorhub._pipeline.PipelinedReader`` do today (their constants below), with the data
# plane replaced by a clock: a reader completes chunks at ``link_gbps`` from the chunks its
# lease's sources hold. Three phases on one coordinator, side by side: a base size, more
# chunks per shard, more retained versions; the per-reader figures and their ratios show
# whether the coordinator's work grows with either.

#: ``_sources.DEPTH``, ``PipelinedReader.refresh_interval`` (idle; twice that when busy),
#: the chunk-report interval before chunk maps, ``claim_patience``, ``TENSORHUB_PROGRESS_INTERVAL``.
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
    #: How late this generator's heartbeat loop was (seconds) at each heartbeat it sent: its
    #: own event loop's lag, which every latency measured here includes.
    late: list[float] = field(default_factory=list)
    completed: int = 0
    fetch_seconds: list[float] = field(default_factory=list)
    seconds: float = 0.0
    cpu: float = 0.0  # coordinator CPU-seconds over the phase
    gen_cpu: float = 0.0  # this generator's CPU-seconds over the phase (it shares the machine)
    beat_cpu: float = 0.0  # the heartbeat processes' CPU-seconds over the phase (``_Beaters``)
    machine_cpu: float = 0.0  # the whole machine's busy CPU-seconds over the phase
    idle_cpu_rate: float = 0.0  # coordinator cores with heartbeats only, just before the phase
    manifest_bytes: int = 0
    chunk_bytes: int = 0
    #: A reader's addresses as runs at address 0 (``_addresses.encode`` of the Hub's layout;
    #: each reader shifts them to its own base), or None: plain lists, one per tensor.
    runs0: Optional[dict] = None


class _Fleet:
    """The generator: one coordinator, two keep-alive pools (heartbeats, readers)."""

    def __init__(self, url: str, pid: int, connections: int, seed: int) -> None:
        self.pid = pid
        self.hb = _Pool(url, max(2, connections // 4))
        # As the Hub's client (httpx) asks: large manifests come back gzipped.
        self.http = _Pool(url, connections, headers={"Accept-Encoding": "gzip, deflate"})
        self.rng = random.Random(seed)
        self.phase: Optional[Phase] = None
        self.setup_errors: dict[str, int] = {}
        self.lease_ttl = 30.0
        self.holding: dict[str, bytes] = {}  # worker -> its replica's registration (re-sent after expiry)
        self.hb_skipped = 0  # heartbeats not sent: 4,096 already waiting for an answer
        self.expired = 0  # heartbeats answered 404: the coordinator had dropped the worker
        #: Fetch reports waiting for their worker's next heartbeat (chunkmap protocol).
        self.beats: dict[str, list[dict]] = {}
        #: Chunks each simulated reader holds (what its chunk map says), by worker.
        #: chunkmap readers: the chunks each holds, as a bitmask (bit c: chunk c) -- its chunk
        #: map, which the others read (an int: a union of four sources is one OR, not four
        #: 1,024-element set unions per reader per tick, which left the generator late)
        self.have: dict[str, int] = {}
        self.protocol = "chunkmap"

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
            reports = self.beats.pop(w, None)  # progress rides on the heartbeat (``Session``)
            st, _ = await self.call("heartbeat", "POST", f"/v1/workers/{w}/heartbeat",
                                    {"fetches": reports} if reports else {}, pool=self.hb,
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
                    self.phase.late.append(late[-1])
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

    # ---- one simulated pipelined reader, chunk maps (the Hub now)
    async def reader(self, wid: str, model: str, ph: Phase, man_json: bytes, addrs_json: bytes,
                     link_bps: float, digest: str, tensors: int) -> None:
        if self.protocol == "reports":
            return await self.reader_reports(wid, model, ph, man_json, addrs_json, link_bps)
        from tensorhub._planner import order_start
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        m = model
        _, r = await self.call("POST resolve", "POST", f"/v1/models/{m}/resolve", {"group": None})
        if not r:
            return
        v = int(r["version"])
        st, _ = await self.call("GET manifest", "GET", f"/v1/models/{m}/versions/{v}/manifest?layout=hf&shard=0",
                                parse=False)
        n = ph.chunks
        chunk_bytes = ph.chunk_bytes
        base = (1 << 44) + (int(wid.rsplit("-", 1)[1]) << 32)
        if ph.runs0 is not None:  # as the Hub sends its copy's addresses: runs (``AddressRuns``)
            where: dict = {"address_runs": {"align": ph.runs0["align"],
                                            "runs": [[a + base, c] for a, c in ph.runs0["runs"]]}}
        else:
            where = {"addresses": [base + k * (1 << 20) for k in range(tensors)]}
        offer = {"manifest_digest": digest, **where,
                 "chunk_bytes": chunk_bytes, "num_chunks": n, "status_addr": base - 4096,
                 "status_tag": self.rng.getrandbits(63) | 1}
        lease_body = {"worker_id": wid, "model": m, "version": v, "layout": "hf", "shard": 0, "max_sources": 4,
                      "exclude": [], "pipelined": True, "lease_id": None, "manifest": False,
                      "address_runs": ph.runs0 is not None}
        delay = 0.05
        while True:
            st, g = await self.call("POST leases (new, serving)", "POST", "/v1/leases",
                                    dict(lease_body, request_id=secrets.token_hex(12), serve=offer), lat=ph.lease)
            if st == 409 and g and g.get("code") == "no_replica" and loop.time() - t0 < 60:
                await asyncio.sleep(delay * self.rng.uniform(0.5, 1.0))
                delay = min(delay * 2, 1.0)
                continue
            break
        if st != 200 or not g:
            return
        cur = g["lease_id"]
        if not g.get("partial_replica_id"):
            self._error("POST leases (new, serving)", f"partial replica refused: {g.get('serve_refused')}")
        # its order: ``chunk_order(n, start, reverse)``, a rotation from s0
        s0, rev = order_start(n, float(g.get("start", 0.0))), bool(g.get("reverse", False))
        self.have.setdefault(wid, 0)
        full = (1 << n) - 1
        receiving: list[int] = []
        sources = g["replicas"]
        refreshed = False
        now = loop.time()
        last_renew, next_progress = now, t0 + PROGRESS
        credit, last_tick, tick = 0.0, now, REFRESH / 2

        def readable() -> int:
            out = 0
            for s in sources:
                if s.get("status_addr") is not None:  # its chunk map, read from the source
                    out |= self.have.get(s["worker_id"], 0)
                elif s.get("chunks") is None:
                    return full & ~self.have[wid]
                else:
                    for c in s["chunks"]:
                        out |= 1 << c
            return out & ~self.have[wid]

        while self.have[wid] != full:
            now = loop.time()
            if now - t0 > 600:
                self._error("fetch", "timed out")
                return
            can = readable()
            credit = min(credit + (now - last_tick) * link_bps, link_bps) if receiving else 0.0
            last_tick = now
            moved, credit = _move_bits(n, s0, rev, can, receiving, DEPTH * max(1, len(sources)), credit, chunk_bytes)
            for c in moved:  # marked in its own chunk map: others see it at once
                self.have[wid] |= 1 << c
            done = self.have[wid].bit_count()
            if not refreshed and now - t0 >= FIRST_REFRESH and done < n:
                refreshed = True  # ``PipelinedReader.max_refreshes``: one
                st, g2 = await self.call("POST leases (refresh)", "POST", "/v1/leases",
                                         dict(lease_body, lease_id=cur), lat=ph.lease)
                if st == 200 and g2:
                    sources = g2["replicas"]
            if now - last_renew >= max(0.1, self.lease_ttl / 3):
                last_renew = now
                await self.call("POST renew", "POST", f"/v1/leases/{cur}/renew", {})
            if now >= next_progress:  # rides on the next heartbeat
                next_progress = now + PROGRESS
                self.beats.setdefault(wid, []).append(_fetch_report(
                    wid, m, v, "running", done * chunk_bytes, n * chunk_bytes, now - t0))
            if done < n:
                await asyncio.sleep(tick)
        st, rr = await self.call("POST replicas (complete + release)", "POST", "/v1/replicas", {
            "worker_id": wid, "model": m, "version": v, "layout": "hf", "shard": 0, "num_shards": 1,
            "manifest_digest": digest, **where, "release": [cur]})
        seconds = loop.time() - t0
        self.beats.setdefault(wid, []).append(
            _fetch_report(wid, m, v, "ok", n * chunk_bytes, n * chunk_bytes, seconds))
        if st == 200 and rr and rr.get("replica_id"):
            ph.completed += 1
            ph.fetch_seconds.append(seconds)
        elif st == 200:
            self._error("POST replicas (complete + release)", "lease lapsed")

    # ---- one simulated pipelined reader, chunk reports (before chunk maps)
    async def reader_reports(self, wid: str, model: str, ph: Phase, man_json: bytes, addrs_json: bytes,
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
            moved, credit = _move(order, can, receiving, DEPTH * max(1, len(sources)), credit, chunk_bytes)
            done.update(moved)
            completed.extend((c, cur or "") for c in moved)
            if moved:
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


def _move(order: list[int], can: set[int], receiving: list[int], slots: int, credit: float,
          chunk_bytes: int) -> tuple[list[int], float]:
    """One tick of a simulated reader's link: ``slots`` chunks (DEPTH batches per source) in
    flight, the link the only limit. The chunks that landed, and the credit left."""
    moved: list[int] = []
    while True:
        for c in order:
            if len(receiving) >= slots:
                break
            if c in can and c not in receiving:
                receiving.append(c)
        if not receiving or credit < chunk_bytes:
            break
        c = receiving.pop(0)
        credit -= chunk_bytes
        can.discard(c)
        moved.append(c)
    return moved, credit


def _in_order(mask: int, n: int, s: int, reverse: bool, k: int) -> list[int]:
    """The first ``k`` chunks of ``mask`` (bit c: chunk c) in ``chunk_order(n, s / n, reverse)``
    (a rotation of 0..n-1 starting at ``s``, downwards when ``reverse``), by bit operations on
    the two halves of the rotation: no per-chunk scan of the order (a scan with a shift of a
    1,024-bit int per chunk was most of the generator and left its event loop seconds late)."""
    out: list[int] = []
    if reverse:  # s, s-1, .., 0, then n-1, .., s+1: highest bits first
        for part in (mask & ((1 << (s + 1)) - 1), mask >> (s + 1) << (s + 1)):
            while part and len(out) < k:
                c = part.bit_length() - 1
                out.append(c)
                part ^= 1 << c
    else:  # s, .., n-1, then 0, .., s-1: lowest bits first
        for part in (mask >> s << s, mask & ((1 << s) - 1)):
            while part and len(out) < k:
                low = part & -part
                out.append(low.bit_length() - 1)
                part ^= low
    return out


def _move_bits(n: int, s: int, reverse: bool, can: int, receiving: list[int], slots: int,
               credit: float, chunk_bytes: int) -> tuple[list[int], float]:
    """:func:`_move` with ``can`` a bitmask (bit c: chunk c may be read now) and the order a
    rotation (``chunk_order``): the next chunks come from :func:`_in_order`."""
    moved: list[int] = []
    while True:
        if len(receiving) < slots:
            cand = can
            for c in receiving:
                cand &= ~(1 << c)
            receiving += _in_order(cand, n, s, reverse, slots - len(receiving))
        if not receiving or credit < chunk_bytes:
            break
        c = receiving.pop(0)
        credit -= chunk_bytes
        can &= ~(1 << c)
        moved.append(c)
    return moved, credit


def _replica_body(wid: str, model: str, v: int, man_json: bytes, addrs_json: bytes, extra: str = "") -> bytes:
    """``Session.replica_body`` (+ ``extra`` fields), spliced from pre-encoded parts."""
    return (f'{{"worker_id":"{wid}","model":"{model}","version":{v},"layout":"hf","shard":0,"num_shards":1,'
            f'"manifest":').encode() + man_json + b',"addresses":' + addrs_json + extra.encode() + b"}"


def _fetch_report(wid: str, model: str, v: int, state: str, nbytes: int, total: int, seconds: float) -> dict:
    return {"worker_id": wid, "model": model, "version": v, "layout": "hf", "shard": 0, "state": state,
            "nbytes": nbytes, "total": total, "seconds": round(seconds, 6), "sources": {}, "failed_sources": 0}


class _Beaters:
    """Heartbeats of the workers that neither read nor publish, sent by ``procs`` processes of
    their own (this file with ``--beat``): the readers' simulation (chunk choice, answers
    parsed) cannot make them late, so their latency is the coordinator's and the machine's,
    as for a fleet whose workers each run on their own host. Phases are told over stdin;
    each process answers with its figures (one JSON line) when told to stop."""

    def __init__(self, url: str, ids: range, every: float, connections: int, procs: int, seed: int) -> None:
        self.procs = []
        for k in range(procs):
            part = ids[k::procs]
            if not part:
                continue
            cmd = [sys.executable, str(Path(__file__).resolve()), "--beat", url, str(part.start), str(part.stop),
                   str(part.step), str(every), str(max(2, connections)), str(seed + k)]
            self.procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))

    def tell(self, what: str) -> None:
        for p in self.procs:
            p.stdin.write(what + "\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]

    def finish(self) -> list[dict]:
        self.tell("stop")
        outs = []
        for p in self.procs:
            line = p.stdout.readline()  # type: ignore[union-attr]
            p.wait(60)
            if line:
                outs.append(json.loads(line))
        return outs


async def _beat_main(url: str, ids: list[str], every: float, connections: int, seed: int) -> dict:
    """One ``--beat`` process: heartbeats of ``ids`` every ``every`` s until told ``stop``;
    ``phase NAME`` / ``idle`` lines on stdin say which phase its figures belong to."""
    fl = _Fleet(url, 0, connections * 4, seed)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    phases: dict[str, Phase] = {}
    cpu: dict[str, float] = {}
    buf = b""

    def on_stdin() -> None:
        nonlocal buf
        data = os.read(sys.stdin.fileno(), 65536)
        buf += data
        if not data:
            stop.set()
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            word, _, name = line.decode().strip().partition(" ")
            if fl.phase is not None:
                cpu[fl.phase.name] = cpu.get(fl.phase.name, 0.0) + time.process_time()
            if word == "phase":
                fl.phase = phases.setdefault(name, Phase(name, 0, 0))
                cpu[name] = cpu.get(name, 0.0) - time.process_time()
            else:
                fl.phase = None
                if word == "stop":
                    stop.set()

    loop.add_reader(sys.stdin.fileno(), on_stdin)
    try:
        await fl.heartbeats(ids, every, stop, [])
    finally:
        loop.remove_reader(sys.stdin.fileno())
        await fl.hb.close()
        await fl.http.close()
    return {"phases": {n: {"heartbeat": ph.heartbeat, "late": ph.late, "errors": ph.errors, "cpu": cpu.get(n, 0.0)}
                       for n, ph in phases.items()},
            "setup_errors": fl.setup_errors, "expired": fl.expired, "skipped": fl.hb_skipped}


async def _drive_fleet(url: str, pid: int, *, workers: int, readers: int, tensors: int, chunks: tuple[int, int],
                       history: tuple[int, int], history_tensors: int, heartbeat: float, link_gbps: float,
                       connections: int, idle_seconds: float, seed: int, protocol: str = "chunkmap",
                       runs: bool = True, beat_procs: int = 1) -> dict:
    from tensorhub._addresses import encode
    from tensorhub._grid import grid_chunk_bytes
    from tensorhub.protocol import Manifest, manifest_digest

    fl = _Fleet(url, pid, connections, seed)
    fl.protocol = protocol
    model = "policy"
    ids = [f"sim-{i:05d}" for i in range(max(workers, readers + 1))]
    trainer, reader_ids = ids[0], ids[1:readers + 1]
    t_setup = time.perf_counter()
    await fl.register(ids)
    # Each reader's connection is open before the first version (a Hub's client connects when
    # its worker registers and keeps the connection): the base phase measures leases, not
    # hundreds of TCP handshakes at once.
    await fl.http.warm(min(connections, readers))
    # A warm-up version first, read by every reader as the others are, reported apart: what a
    # coordinator does once after it starts (its threads, the first collections of a grown
    # heap) made the base phase, and every ratio to it, a measure of the start.
    phases = [Phase("warm-up", chunks[0], max(1, history[0] - 1)),
              Phase("base", chunks[0], history[0]), Phase("chunks", chunks[1], history[0]),
              Phase("history", chunks[0], history[1])]
    # Retained versions before the measured ones: small manifests (their number is the cost measured).
    hist_man = json.dumps(_manifest(history_tensors)).encode()
    hist_addrs = json.dumps([(1 << 32) + k * (8 << 20) for k in range(history_tensors)]).encode()
    published = 0
    publishes: dict[str, Phase] = {}
    stop = asyncio.Event()
    late: list[float] = []
    # The trainer's and the readers' heartbeats (progress rides on them) from here; the
    # others' from processes of their own (``_Beaters``), unless ``beat_procs`` is 0.
    own = ids[: readers + 1] if beat_procs > 0 else ids
    beaters = _Beaters(url, range(len(own), len(ids)), heartbeat,
                       max(2, connections // 4), beat_procs, seed) if beat_procs > 0 else None
    hb = asyncio.ensure_future(fl.heartbeats(own, heartbeat, stop, late))

    def measure(ph: Optional[Phase]) -> None:
        """What the figures from now on belong to (here and in the heartbeat processes)."""
        fl.phase = ph
        if beaters is not None:
            beaters.tell("idle" if ph is None else f"phase {ph.name}")
    try:
        for ph in phases:
            while published < ph.history - 1:
                await fl.publish(model, trainer, hist_man, hist_addrs)
                published += 1
            man = moe_manifest(tensors, ph.chunks)
            man_json = json.dumps(man).encode()
            addrs_json = json.dumps([(1 << 40) + k * (1 << 28) for k in range(tensors)]).encode()
            ph.manifest_bytes = len(man_json)
            ph.chunk_bytes = grid_chunk_bytes(sum(t["nbytes"] for t in man["tensors"]))
            manifest = Manifest.model_validate(man)
            digest = manifest_digest(manifest)
            if runs and protocol == "chunkmap":  # the Hub's layout: in order, 64-byte aligned
                offs, off = [], 0
                for t in man["tensors"]:
                    offs.append(off)
                    off += -(-t["nbytes"] // 64) * 64
                enc = encode(offs, manifest)
                ph.runs0 = None if enc is None else enc.model_dump(mode="json")
            fl.have.clear()
            # The publish itself, measured apart: the heartbeats answered while the coordinator
            # takes the trainer's 6 MB registration (and 0.3 s later, whatever it still does).
            pub = publishes[ph.name] = Phase(f"publish-{ph.name}", ph.chunks, ph.history)
            measure(pub)
            t_pub = time.perf_counter()
            ph.version = await fl.publish(model, trainer, man_json, addrs_json)
            await asyncio.sleep(0.3)
            pub.seconds = time.perf_counter() - t_pub
            measure(None)
            published += 1
            c0, t0 = _cpu(pid), time.perf_counter()
            await asyncio.sleep(idle_seconds)  # heartbeats only: the baseline this phase's CPU is net of
            ph.idle_cpu_rate = (_cpu(pid) - c0) / (time.perf_counter() - t0)
            measure(ph)
            c0, t0, g0, m0 = _cpu(pid), time.perf_counter(), time.process_time(), _machine_busy()[0]
            link = link_gbps * 1e9

            async def one(w: str) -> None:
                await asyncio.sleep(fl.rng.uniform(0, 0.1))  # woken by one publish, not in lockstep
                await fl.reader(w, model, ph, man_json, addrs_json, link, digest, tensors)

            await asyncio.gather(*(one(w) for w in reader_ids))
            ph.seconds = time.perf_counter() - t0
            ph.cpu = _cpu(pid) - c0
            ph.gen_cpu, ph.machine_cpu = time.process_time() - g0, _machine_busy()[0] - m0
            measure(None)
    finally:
        stop.set()
        await hb
        beat_outs = await asyncio.to_thread(beaters.finish) if beaters is not None else []
        await fl.http.close()
        await fl.hb.close()
    for b in beat_outs:  # the heartbeat processes' figures, into the phases'
        fl.expired += b["expired"]
        fl.hb_skipped += b["skipped"]
        for k, v in b["setup_errors"].items():
            fl.setup_errors[k] = fl.setup_errors.get(k, 0) + v
        for ph in (*phases, *publishes.values()):
            got = b["phases"].get(ph.name)
            if got is not None:
                ph.heartbeat += got["heartbeat"]
                ph.late += got["late"]
                ph.beat_cpu += got["cpu"]
                for k, v in got["errors"].items():
                    ph.errors[k] = ph.errors.get(k, 0) + v
    alive = True
    try:
        alive = (await _Pool(url, 1).request("GET", "/v1/info"))[0] == 200
    except Exception:
        alive = False
    out: dict = {"protocol": protocol, "addresses": "runs" if runs and protocol == "chunkmap" else "plain", "workers": len(ids), "readers": readers, "tensors": tensors, "heartbeat_interval": heartbeat,
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
            "generator_late_ms": {q: round(_pct(ph.late, x) * 1e3, 2) for q, x in (("p50", 0.5), ("p99", 0.99))},
            "lease_ms": {q: round(_pct(ph.lease, x) * 1e3, 2) for q, x in (("p50", 0.5), ("p99", 0.99))}
            | {"max": round(max(ph.lease, default=float("nan")) * 1e3, 2)},
            "coordinator_cpu_s": round(ph.cpu, 2), "idle_cores": round(ph.idle_cpu_rate, 3),
            "coordinator_cores": round(ph.cpu / ph.seconds, 2) if ph.seconds else 0.0,
            "generator_cores": round(ph.gen_cpu / ph.seconds, 2) if ph.seconds else 0.0,
            "heartbeat_proc_cores": round(ph.beat_cpu / ph.seconds, 2) if ph.seconds else 0.0,
            "machine_cores": round(ph.machine_cpu / ph.seconds, 2) if ph.seconds else 0.0,
            "requests": sum(ph.calls.values()) + len(ph.heartbeat),
            "cpu_ms_per_request": round(ph.cpu / max(1, sum(ph.calls.values()) + len(ph.heartbeat)) * 1e3, 3),
            "cpu_s_per_reader_version": round(net / r, 4),
        }
    out["warmup"] = out["phases"].pop("warm-up")
    out["publishes"] = {n: {"seconds": round(p.seconds, 2), "heartbeats": len(p.heartbeat),
                            "heartbeat_ms": {q: round(_pct(p.heartbeat, x) * 1e3, 2) for q, x in (("p50", 0.5), ("p99", 0.99))}
                            | {"max": round(max(p.heartbeat, default=float("nan")) * 1e3, 2)},
                            "errors": p.errors} for n, p in publishes.items() if n != "warm-up"}
    out["errors"] = (sum(sum(p["errors"].values()) for p in (*out["phases"].values(), out["warmup"],
                                                             *out["publishes"].values()))
                     + sum(fl.setup_errors.values()))
    return out


def run_fleet(*, workers: int = 10_000, readers: int = 1024, tensors: int = 50_000, chunks: tuple[int, int] = (256, 1024),
              history: tuple[int, int] = (10, 1000), history_tensors: int = 16, heartbeat: float = 2.0,
              link_gbps: float = 25.0, connections: int = 32, idle_seconds: float = 2.0, seed: int = 0,
              protocol: str = "chunkmap", runs: bool = True, beat_procs: int = 1,
              call_slots: Optional[int] = None) -> dict:
    """Fleet mode (see the section's comment): start a coordinator that keeps every
    version, drive the three phases, stop it; return the figures. ``runs``: readers send
    their copies' addresses as runs and ask for runs in lease answers, as the Hub does
    (False: one address per tensor, as clients before ``AddressRuns``)."""
    kw = dict(workers=workers, readers=readers, tensors=tensors, chunks=chunks, history=history,
              history_tensors=history_tensors, heartbeat=heartbeat, link_gbps=link_gbps,
              connections=connections, idle_seconds=idle_seconds, seed=seed, protocol=protocol, runs=runs,
              beat_procs=beat_procs)
    keep = str(max(history) + 16)
    with tempfile.TemporaryDirectory(prefix="th-fleet-") as tmp:
        coord = CoordinatorProc(Path(tmp) / "state", worker_ttl=max(10.0, 5 * heartbeat),
                                extra=("--keep-versions", keep)
                                + (("--call-slots", str(call_slots)) if call_slots is not None else ()))
        try:
            out = _run_loop(_drive_fleet(coord.url, coord.proc.pid, **kw))
            out["coordinator_alive"] = coord.alive
        finally:
            coord.stop()
    out["keep_versions"] = int(keep)
    out["call_slots"] = call_slots
    return out


# ---------------------------------------------------------------------- lease burst (issue 31)
# ``--burst``: N followers of a model on the real coordinator process, the data plane left
# out (nothing is read: the figure is the control plane's). The publisher registers v2 and
# the clock runs from the moment its registration is sent:
#
# * ``ahead`` (``tensorhub.server.ahead``, what ``Hub.fetch_next`` does): every reader holds its
#   lease for v2 asked ahead (``POST /v1/leases?wait=``, its serve offer named by the
#   ``shape_digest`` of v1's manifest, addresses as runs, chunk map fields), polled again
#   with the same request id if a poll lapses (``PipelinedSources._acquire``). Once
#   ``/v1/status`` lists all N subscribers, v2 is registered: the coordinator binds them all
#   into one fixed plan in that call and answers them in plan order. Then each reader GETs
#   v2's manifest (its checksums: ``Fetch._bind``), after its plan is known.
# * ``baseline`` (the usual way, ``_next.fetch_next``'s ``usual``, bench_fleet's chunkmap
#   reader): every reader holds ``GET .../latest?newer_than=1&wait=`` (``wait_for_version``);
#   woken by the registration, it GETs the manifest, asks for its pipelined serving lease
#   and refreshes it after ``refresh_after`` while the plan forms (``follow_plan``); its
#   plan answer is the first with ``refresh_after == 0`` (the fixed layout, or a late
#   joiner's place).
#
# Nobody heart-beats during the window (the workers' TTL outlasts the run): the CPU measured
# is the burst's. Each mode runs on a fresh coordinator of the same configuration.

BURST_MODES = ("ahead", "baseline")
#: Readers on one host label (a host of 8 GPUs).
BURST_PER_HOST = 8


@dataclass
class _Burst:
    """One reader's answers in a burst (seconds from sending the registration)."""

    first: Optional[float] = None  # its first lease answer
    plan: Optional[float] = None  # its answer with refresh_after == 0
    ready: Optional[float] = None  # plan known and manifest read
    polls: int = 0  # held polls answered "pending" (asked again)
    grant: Optional[dict] = None  # the plan answer
    leases: int = 0  # lease answers (new + refreshes)


def _checksummed(man: dict, seed: int) -> dict:
    """``man`` with one xxh3_64 checksum per chunk of its grid (random values: a new
    version, the same tensors), as the Hub publishes."""
    from tensorhub._checksum import count

    rng = random.Random(seed)
    n = count([t["nbytes"] for t in man["tensors"]])
    return dict(man, checksum="xxh3_64", checksums=[rng.getrandbits(64) for _ in range(n)])


async def _drive_burst(url: str, pid: int, *, mode: str, readers: int, tensors: int, chunks: int,
                       wait: float, seed: int) -> dict:
    from tensorhub._addresses import encode
    from tensorhub._grid import grid_chunk_bytes
    from tensorhub.protocol import Manifest, manifest_digest, shape_digest

    fl = _Fleet(url, pid, readers + 32, seed)
    model = "policy"
    trainer = "sim-00000"
    reader_ids = [f"sim-{i:05d}" for i in range(1, readers + 1)]
    t_setup = time.perf_counter()
    await fl.register([trainer])  # its own host (h0)
    # readers: BURST_PER_HOST per host label (h1, h2, ...)
    await fl.register(reader_ids, start=BURST_PER_HOST)
    await fl.http.warm(readers + 1)  # each reader's connection (a Hub's client keeps its own)
    base_man = moe_manifest(tensors, chunks)
    m1, m2 = _checksummed(base_man, seed), _checksummed(base_man, seed + 1)
    j1, j2 = json.dumps(m1).encode(), json.dumps(m2).encode()
    addrs_json = json.dumps([(1 << 40) + k * (1 << 28) for k in range(tensors)]).encode()
    v1 = await fl.publish(model, trainer, j1, addrs_json)
    man1, man2 = Manifest.model_validate(m1), Manifest.model_validate(m2)
    chunk_bytes = grid_chunk_bytes(man1.nbytes)
    offs, off = [], 0
    for t in base_man["tensors"]:  # the Hub's layout of a reader's copy: in order, 64-byte aligned
        offs.append(off)
        off += -(-t["nbytes"] // 64) * 64
    enc = encode(offs, man1)
    runs0 = None if enc is None else enc.model_dump(mode="json")
    digest = shape_digest(man1) if mode == "ahead" else manifest_digest(man2)

    def offer(wid: str) -> dict:
        base = (1 << 44) + (int(wid.rsplit("-", 1)[1]) << 32)
        where = ({"address_runs": {"align": runs0["align"], "runs": [[a + base, c] for a, c in runs0["runs"]]}}
                 if runs0 is not None else {"addresses": [base + o for o in offs]})
        return {"manifest_digest": digest, **where, "chunk_bytes": chunk_bytes, "num_chunks": chunks,
                "status_addr": base - 4096, "status_tag": fl.rng.getrandbits(63) | 1}

    def lease_body(wid: str, v: int) -> dict:  # ``PipelinedSources._acquire`` via ``Session.lease``
        return {"worker_id": wid, "model": model, "version": v, "layout": "hf", "shard": 0, "max_sources": 4,
                "exclude": [], "pipelined": True, "lease_id": None, "manifest": False,
                "address_runs": True, "lease_secret": True}

    res = {w: _Burst() for w in reader_ids}
    t0 = 0.0  # set when the registration is sent
    go = asyncio.Event()  # the registration was sent (nobody's answer counts before)
    cpu_at: dict[str, float] = {}
    counts = {"plan": 0, "ready": 0}
    mpath = "/v1/models/{m}/versions/{v}/manifest?layout=hf&shard=0"

    def landed(what: str, r: _Burst, at: float) -> None:
        setattr(r, what, at - t0)
        counts[what] += 1
        if what == "plan" and counts[what] == 1:
            cpu_at["first"] = _cpu(pid)
        if counts[what] == readers:
            cpu_at[what] = _cpu(pid)

    async def subscriber(wid: str) -> None:
        r = res[wid]
        body = json.dumps(dict(lease_body(wid, v1 + 1), request_id=secrets.token_hex(12), serve=offer(wid),
                               ahead=True)).encode()
        while True:
            st, data = await fl.call("POST leases?wait (ahead)", "POST", f"/v1/leases?wait={wait:g}", raw=body,
                                     parse=False)
            at = time.perf_counter()
            if st == 200 and data and json.loads(data).get("pending"):
                r.polls += 1
                continue  # asked again, same request id: keeps its place
            break
        if st != 200 or not data:
            return
        if not go.is_set():
            fl._error("POST leases?wait (ahead)", "answered before the publish")
            return
        g = json.loads(data)
        r.grant, r.leases = g, 1
        r.first = at - t0
        landed("plan", r, at)
        if g.get("sums") is not None:  # the grant carries the checksums: no manifest (``VersionSums``)
            landed("ready", r, at)
            return
        st, _ = await fl.call("GET manifest", "GET", mpath.format(m=model, v=g["version"]), parse=False)
        if st == 200:
            landed("ready", r, time.perf_counter())

    async def follower(wid: str) -> None:
        r = res[wid]
        while True:  # ``Hub.wait_for_version``
            st, a = await fl.call("GET latest?wait (held)", "GET",
                                  f"/v1/models/{model}/latest?newer_than={v1}&wait={wait:g}")
            if st == 200 and a and a.get("version") is None:
                r.polls += 1
                continue
            break
        if st != 200 or not a:
            return
        v = int(a["version"])
        st, _ = await fl.call("GET manifest", "GET", mpath.format(m=model, v=v), parse=False)
        if st != 200:
            return
        lb = lease_body(wid, v)
        st, g = await fl.call("POST leases (new, serving)", "POST", "/v1/leases",
                              dict(lb, request_id=secrets.token_hex(12), serve=offer(wid)))
        r.first = time.perf_counter() - t0
        r.leases = 1
        for _ in range(4):  # ``PipelinedReader.follow_plan``: once at refresh_after (an early member: twice)
            if st != 200 or not g:
                return
            if not (g.get("stripes") and g.get("refresh_after", 0.0) > 0):
                break
            await asyncio.sleep(g["refresh_after"])
            st, g = await fl.call("POST leases (refresh)", "POST", "/v1/leases", dict(lb, lease_id=g["lease_id"]))
            r.leases += 1
        if st == 200 and g:
            r.grant = g
            at = time.perf_counter()
            landed("plan", r, at)
            landed("ready", r, at)

    tasks = [asyncio.ensure_future((subscriber if mode == "ahead" else follower)(w)) for w in reader_ids]
    # every reader held: the subscriptions (ahead) or the latest polls (baseline) are in
    deadline = time.perf_counter() + 300
    held = 0
    while time.perf_counter() < deadline:
        if mode == "ahead":
            st, s = await fl.call("GET status", "GET", "/v1/status", pool=fl.hb)
            held = len((s or {}).get("subscribers", ()))
        else:  # (the latest polls: one open request each; their count is not in status)
            await asyncio.sleep(0.5)
            held = readers if fl.http.idle.qsize() <= 1 else 0
        if held >= readers:
            break
        await asyncio.sleep(0.25)
    if held < readers:
        raise RuntimeError(f"{mode}: only {held} of {readers} readers held after 300 s: {fl.setup_errors}")
    await asyncio.sleep(0.5)
    c_idle, t_idle = _cpu(pid), time.perf_counter()
    await asyncio.sleep(1.0)  # the coordinator with N held requests and nothing else
    idle_rate = (_cpu(pid) - c_idle) / (time.perf_counter() - t_idle)
    setup_s = time.perf_counter() - t_setup
    _, a = await fl.call("publish", "POST", f"/v1/models/{model}/versions", {})
    v2 = int(a["version"])
    body = _replica_body(trainer, model, v2, j2, addrs_json)
    load = os.getloadavg()
    ph = fl.phase = Phase("burst", chunks, 2)
    c0, m0, g0 = _cpu(pid), _machine_busy()[0], time.process_time()
    t0 = time.perf_counter()
    go.set()
    st, reg = await fl.call("POST replicas (publisher)", "POST", "/v1/replicas", raw=body, pool=fl.hb)
    t_reg, c_reg = time.perf_counter() - t0, _cpu(pid)
    if st != 200 or not reg:
        raise RuntimeError(f"the publisher's registration failed: {st} {reg}")
    await asyncio.wait(tasks, timeout=wait + 60)
    t_end = time.perf_counter() - t0
    c_end, m_end, g_end = _cpu(pid), _machine_busy()[0], time.process_time()
    await asyncio.sleep(1.0)  # what the coordinator still did after the last answer (group commit, ...)
    c_tail = _cpu(pid)
    fl.phase = None
    for t in tasks:
        if not t.done():
            t.cancel()
    await fl.http.close()
    await fl.hb.close()

    rs = list(res.values())
    plans = [r.plan for r in rs if r.plan is not None]
    firsts = [r.first for r in rs if r.first is not None]
    readies = [r.ready for r in rs if r.ready is not None]
    grants = [r.grant for r in rs if r.grant is not None]
    pub = reg["replica_id"]
    bad = []  # ahead: grants that are not a fixed plan's answer for v2
    reasons: dict[str, int] = {}
    for w, r in res.items():
        g = r.grant
        if g is None:
            bad.append(f"{w}: no grant")
            continue
        why = g.get("reason", "")
        kind = ("late carrier" if "late carrier" in why else "late" if "late" in why else
                "forming" if "forming" in why else "member" if "member" in why else why[:40] or "(none)")
        reasons[kind] = reasons.get(kind, 0) + 1
        if mode == "ahead":
            checks = (("version", g.get("version") == v2), ("refresh_after", g.get("refresh_after", 0) == 0),
                      ("stripes", g.get("stripes", 0) > 0), ("partial_replica_id", bool(g.get("partial_replica_id"))),
                      ("reason", "forming" not in why and "late" not in why))
            faults = [x for x, ok in checks if not ok]
            if faults:
                bad.append(f"{w}: {faults} {why!r} {g.get('serve_refused', '')!r}")
    stripes = max((g.get("stripes", 0) for g in grants), default=0)
    root_per_stripe = [sum(1 for g in grants if (g.get("stripe_sources") or [""] * stripes)[s:s + 1] == [pub])
                       for s in range(stripes)]
    cpu_plan = cpu_at.get("plan", c_end) - c0
    cpu_ready = cpu_at.get("ready", c_end) - c0
    # from the first plan answer to the last: ahead, the wake-ups alone (every grant was
    # made and encoded before the first was sent)
    cpu_spread = cpu_at.get("plan", c_end) - cpu_at.get("first", c0)
    spread = max(plans, default=float("nan")) - min(plans, default=float("nan"))
    return {"mode": mode, "readers": readers, "tensors": tensors, "chunks": chunks, "version": v2,
            "manifest_mb": round(len(j2) / 1e6, 2), "setup_s": round(setup_s, 1), "loadavg": [round(x, 2) for x in load],
            "idle_cores": round(idle_rate, 4), "registration_s": t_reg,
            "first_s": min(firsts, default=float("nan")), "plan_p50_s": _pct(plans, 0.5),
            "plan_p99_s": _pct(plans, 0.99), "last_plan_s": max(plans, default=float("nan")),
            "last_ready_s": max(readies, default=float("nan")), "window_s": t_end,
            "spread_per_reader_us": spread / max(1, readers) * 1e6,
            "cpu_spread_per_reader_us": cpu_spread / max(1, readers) * 1e6,
            "planned": len(plans), "ready": len(readies),
            "cpu_registration_s": c_reg - c0, "cpu_plan_s": cpu_plan, "cpu_ready_s": cpu_ready,
            "cpu_tail_s": c_tail - c_end, "cpu_per_reader_ms": cpu_plan / max(1, readers) * 1e3,
            "cpu_ready_per_reader_ms": cpu_ready / max(1, readers) * 1e3,
            "generator_cpu_s": g_end - g0, "machine_cores": (m_end - m0) / t_end if t_end else 0.0,
            "calls": dict(sorted(ph.calls.items())),
            # (the held poll was sent before the window: counted here, with any poll asked again)
            "calls_per_reader": round((sum(ph.calls.values()) + readers + sum(r.polls for r in rs)) / max(1, readers), 2),
            "lease_answers_per_reader": round(sum(r.leases for r in rs) / max(1, readers), 2),
            "repolls": sum(r.polls for r in rs), "reasons": reasons, "stripes": stripes,
            "publisher_replica": pub, "publisher_per_stripe": root_per_stripe,
            "bad": bad, "errors": {**fl.setup_errors, **ph.errors},
            "grants": grants}


def run_burst(*, readers: int = 1024, tensors: int = 50_000, chunks: int = 256, wait: float = 60.0,
              modes: tuple[str, ...] = BURST_MODES, repeat: int = 1, seed: int = 0,
              keep_grants: bool = False) -> dict:
    """The lease burst (see the section's comment): for each of ``repeat`` rounds, each mode
    on a fresh coordinator process (same configuration); returns {"runs": [{mode: figures}]}
    and the medians per mode. ``keep_grants``: the plan answers stay in the figures."""
    import resource
    import statistics

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * readers + 512  # the generator's connections, and the coordinator's (it inherits the limit)
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need if hard == resource.RLIM_INFINITY else min(need, hard), hard))
    runs: list[dict] = []
    for k in range(repeat):
        one: dict = {}
        for mode in modes:
            with tempfile.TemporaryDirectory(prefix="th-burst-") as tmp:
                coord = CoordinatorProc(Path(tmp) / "state", worker_ttl=600.0)
                try:
                    out = _run_loop(_drive_burst(coord.url, coord.proc.pid, mode=mode, readers=readers,
                                                 tensors=tensors, chunks=chunks, wait=wait, seed=seed + k))
                    out["coordinator_alive"] = coord.alive
                finally:
                    coord.stop()
            if not keep_grants:
                out.pop("grants")
            one[mode] = out
        runs.append(one)
    med: dict = {}
    for mode in modes:
        rows = [r[mode] for r in runs]
        med[mode] = {k: statistics.median(r[k] for r in rows) for k, v in rows[0].items()
                     if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return {"runs": runs, "median": med, "modes": list(modes), "readers": readers, "tensors": tensors,
            "chunks": chunks, "repeat": repeat}


def report_burst(out: dict) -> str:
    modes = out["modes"]
    med = out["median"]
    first = out["runs"][0][modes[0]]
    lines = [f"lease burst: {out['readers']} readers ({BURST_PER_HOST} per host label), {out['tensors']} tensors "
             f"({first['manifest_mb']} MB manifest with checksums), {out['chunks']} chunks; each mode on a fresh "
             f"coordinator; medians of {out['repeat']} run(s); times from sending the publisher's registration"]
    both = "ahead" in med and "baseline" in med
    lines.append(f"{'figure':<46}" + "".join(f"{m:>11}" for m in modes) + (f"{'ahead/base':>12}" if both else ""))

    def row(label: str, key: str, scale: float = 1.0, fmt: str = "{:.1f}") -> None:
        vals = [med[m][key] * scale for m in modes]
        s = f"{label:<46}" + "".join(f"{fmt.format(v):>11}" for v in vals)
        if both:
            a, b = med["ahead"][key], med["baseline"][key]
            s += f"{(a / b if b else float('nan')):>12.2f}"
        lines.append(s)

    row("publisher's registration answered, ms", "registration_s", 1e3)
    row("first lease answer, ms", "first_s", 1e3)
    row("plan answer p50, ms", "plan_p50_s", 1e3)
    row("last plan answer (refresh_after 0), ms", "last_plan_s", 1e3)
    row("last reader with plan + manifest, ms", "last_ready_s", 1e3)
    row("first to last plan answer, per reader, us", "spread_per_reader_us", fmt="{:.0f}")
    row("  coordinator CPU in it, per reader, us", "cpu_spread_per_reader_us", fmt="{:.0f}")
    row("coordinator CPU to last plan answer, s", "cpu_plan_s", fmt="{:.3f}")
    row("  per reader, ms", "cpu_per_reader_ms", fmt="{:.3f}")
    row("coordinator CPU to plan + manifest, s", "cpu_ready_s", fmt="{:.3f}")
    row("  per reader, ms", "cpu_ready_per_reader_ms", fmt="{:.3f}")
    row("  of which the registration (to its answer), s", "cpu_registration_s", fmt="{:.3f}")
    row("coordinator CPU in the 1 s after, s", "cpu_tail_s", fmt="{:.3f}")
    row("coordinator cores while N held (idle), cores", "idle_cores", fmt="{:.3f}")
    row("HTTP calls per reader in the window", "calls_per_reader", fmt="{:.2f}")
    row("lease answers per reader", "lease_answers_per_reader", fmt="{:.2f}")
    row("readers with a plan answer", "planned", fmt="{:.0f}")
    row("generator CPU (this process), s", "generator_cpu_s", fmt="{:.2f}")
    row("machine cores busy in the window", "machine_cores", fmt="{:.2f}")
    for k, r in enumerate(out["runs"]):
        parts = []
        for m in modes:
            x = r[m]
            parts.append(f"{m}: last plan {x['last_plan_s'] * 1e3:.0f} ms, CPU {x['cpu_plan_s']:.3f} s, "
                         f"load {x['loadavg'][0]}, reasons {x['reasons']}, publisher per stripe "
                         f"{x['publisher_per_stripe']}, re-polls {x['repolls']}"
                         + (f", BAD {len(x['bad'])}: {x['bad'][:3]}" if x["bad"] else "")
                         + (f", errors {x['errors']}" if x["errors"] else ""))
        lines.append(f"run {k + 1}: " + "; ".join(parts))
    return "\n".join(lines)


def run_burst_main(a: argparse.Namespace) -> int:
    out = run_burst(readers=a.readers, tensors=a.fleet_tensors, chunks=a.chunks[0], wait=a.burst_wait,
                    modes=tuple(a.burst_modes), repeat=a.repeat, seed=a.seed)
    print(report_burst(out))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=2))
    ok = all(not x["bad"] and not x["errors"] and x["coordinator_alive"] and x["planned"] == x["readers"]
             for r in out["runs"] for x in r.values())
    return 0 if ok else 1


def _mark(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def report_fleet(out: dict) -> str:
    ph = out["phases"]
    b, c, h = ph["base"], ph["chunks"], ph["history"]
    cols = [f"base C={b['chunks']} H={b['history']}", f"C={c['chunks']}", f"H={h['history']}"]
    lines = [
        f"fleet ({out['protocol']} protocol, addresses {out.get('addresses', 'plain')}): {out['workers']} workers heart-beating every {out['heartbeat_interval']} s, {out['readers']} pipelined "
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
    row("coordinator CPU ms per request", lambda p: p["cpu_ms_per_request"], fmt="{:.3f}")
    row("coordinator cores busy", lambda p: p["coordinator_cores"])
    row("generator cores busy (this proc.)", lambda p: p["generator_cores"])
    row("heartbeat processes' cores busy", lambda p: p.get("heartbeat_proc_cores", 0.0))
    row("generator lateness p99 ms", lambda p: p["generator_late_ms"]["p99"])
    row("machine cores busy (all)", lambda p: p["machine_cores"])
    row("manifest MB (JSON)", lambda p: p["manifest_mb"])
    row("phase seconds", lambda p: p["seconds"])
    row("fetch seconds p50", lambda p: p["fetch_s"]["p50"])
    row("readers completed", lambda p: p["completed"], fmt="{:.0f}")
    errs = {k: v for p in (b, c, h) for k, v in p["errors"].items()}
    lines.append("CPU per reader-version: the coordinator's CPU-seconds over the phase, less its heart-beat-only "
                 f"rate just before ({b['idle_cores']}/{c['idle_cores']}/{h['idle_cores']} cores), over readers")
    pubs = out.get("publishes") or {}
    if pubs:
        lines.append("heartbeats while the trainer publishes each phase's version (its 6 MB registration, "
                     "then 0.3 s): " + "; ".join(
                         f"{n} p50/p99/max {p['heartbeat_ms']['p50']}/{p['heartbeat_ms']['p99']}/"
                         f"{p['heartbeat_ms']['max']} ms over {p['seconds']} s" for n, p in pubs.items()))
    w = out.get("warmup")
    if w is not None:
        lines.append(f"warm-up version before the phases (not in the table): heartbeat p50/p99 {w['heartbeat_ms']['p50']}/"
                     f"{w['heartbeat_ms']['p99']} ms, lease p50/p99 {w['lease_ms']['p50']}/{w['lease_ms']['p99']} ms, "
                     f"{w['completed']} readers completed, {w['calls_per_reader']} calls per reader")
    lines.append(f"setup {out['setup_seconds']} s; generator lateness p50 {out['generator_late_ms']['p50']} ms, "
                 f"p99 {out['generator_late_ms']['p99']} ms; errors {out['errors']}"
                 + (f" {errs} {out['setup_errors']}" if out["errors"] else "")
                 + f"; workers expired and re-registered {out['expired']}; heartbeats not sent (4,096 unanswered) "
                 f"{out['heartbeats_skipped']}; coordinator alive: {out['coordinator_alive']}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--beat"]:  # one of ``_Beaters``' processes
        url, lo, hi, step, every, conns, seed = argv[1:8]
        out = _run_loop(_beat_main(url, [f"sim-{i:05d}" for i in range(int(lo), int(hi), int(step))],
                                   float(every), int(conns), int(seed)))
        print(json.dumps(out), flush=True)
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(p)
    a = p.parse_args(argv)
    return run_main(a)


def add_arguments(p: argparse.ArgumentParser, workers_default: int = 10_000) -> None:
    f = p.add_argument_group("fleet mode: pipelined readers of one version, at two sizes")
    if not any(o.dest == "workers" for o in p._actions):
        f.add_argument("--workers", type=int, default=workers_default, help="simulated workers heart-beating")
        f.add_argument("--heartbeat", type=float, default=2.0, help="seconds between one worker's heartbeats")
        f.add_argument("--connections", type=int, default=32)
        f.add_argument("--seed", type=int, default=0)
        f.add_argument("--json", help="also write the figures here")
    f.add_argument("--readers", type=int, default=1024, help="simulated pipelined readers per version")
    f.add_argument("--fleet-tensors", type=int, default=50_000, help="tensors of the measured versions' manifest")
    f.add_argument("--chunks", type=int, nargs=2, default=[256, 1024], metavar=("BASE", "MORE"),
                   help="chunks per shard: base and the larger size")
    f.add_argument("--history", type=int, nargs=2, default=[10, 1000], metavar=("BASE", "MORE"),
                   help="versions retained when a phase starts: base and the larger size")
    f.add_argument("--history-tensors", type=int, default=16, help="tensors of the older versions' manifests")
    f.add_argument("--link-gbps", type=float, default=25.0, help="each reader's simulated link, GB/s")
    f.add_argument("--protocol", choices=("chunkmap", "reports"), default="chunkmap",
                   help="chunkmap: the Hub now; reports: the protocol before chunk maps")
    f.add_argument("--heartbeat-procs", type=int, default=1,
                   help="processes that send the heartbeats of workers that neither read nor publish "
                        "(0: this generator sends them too, between the readers' steps)")
    f.add_argument("--call-slots", type=int, default=None,
                   help="the coordinator's --call-slots (default: its own default)")
    f.add_argument("--compare-gate", action="store_true",
                   help="run twice, the coordinator's gate for readers' calls off (--call-slots 0) then on")
    f.add_argument("--addresses", choices=("runs", "plain"), default="runs",
                   help="chunkmap readers' addresses: runs, as the Hub sends them (default), or plain lists")
    b = p.add_argument_group("lease burst (--burst, issue 31): N followers answered at one publish, leases asked "
                             "ahead vs the usual way (uses --readers, --fleet-tensors, the first --chunks, --seed, --json)")
    b.add_argument("--burst", action="store_true", help="run the lease burst instead of the fleet phases")
    b.add_argument("--burst-modes", nargs="+", choices=BURST_MODES, default=list(BURST_MODES))
    b.add_argument("--burst-wait", type=float, default=60.0, help="seconds one held poll lasts (?wait=)")
    b.add_argument("--repeat", type=int, default=1, help="rounds (each mode on a fresh coordinator); medians printed")


def report_gate(off: dict, on: dict) -> str:
    """``--compare-gate``: the same fleet on a coordinator without the gate for the readers'
    calls (``--call-slots 0``) and with it (the default), side by side."""
    lines = [f"the gate for readers' calls, side by side (off: --call-slots 0; on: the default)",
             f"{'figure':<22} {'phase':<8} {'off':>9} {'on':>9} {'on/off':>7}"]
    for name in ("base", "chunks", "history"):
        a, b = off["phases"][name], on["phases"][name]
        for label, get in (("heartbeat p50 ms", lambda p: p["heartbeat_ms"]["p50"]),
                           ("heartbeat p99 ms", lambda p: p["heartbeat_ms"]["p99"]),
                           ("heartbeat max ms", lambda p: p["heartbeat_ms"]["max"]),
                           ("lease p50 ms", lambda p: p["lease_ms"]["p50"]),
                           ("lease p99 ms", lambda p: p["lease_ms"]["p99"]),
                           ("phase seconds", lambda p: p["seconds"]),
                           ("readers completed", lambda p: p["completed"])):
            x, y = get(a), get(b)
            lines.append(f"{label:<22} {name:<8} {x:>9.2f} {y:>9.2f} {(y / x if x else float('nan')):>7.2f}")
    return "\n".join(lines)


def run_main(a: argparse.Namespace, workers: Optional[int] = None) -> int:
    if getattr(a, "burst", False):
        return run_burst_main(a)
    kw = dict(workers=a.workers if workers is None else workers, readers=a.readers, tensors=a.fleet_tensors,
              chunks=tuple(a.chunks), history=tuple(a.history), history_tensors=a.history_tensors,
              heartbeat=a.heartbeat, link_gbps=a.link_gbps, connections=max(a.connections, 32), seed=a.seed,
              protocol=a.protocol, runs=a.addresses == "runs", beat_procs=a.heartbeat_procs)
    outs = []
    if a.compare_gate:
        outs.append(run_fleet(**kw, call_slots=0))
        print(report_fleet(outs[-1]), flush=True)
    outs.append(run_fleet(**kw, call_slots=a.call_slots))
    print(report_fleet(outs[-1]))
    if a.compare_gate:
        print(report_gate(outs[0], outs[1]))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(outs[-1] if len(outs) == 1 else {"gate_off": outs[0], "gate_on": outs[1]},
                                           indent=2))
    return 0 if all(o["errors"] == 0 and o["coordinator_alive"] for o in outs) else 1


if __name__ == "__main__":
    sys.exit(main())
