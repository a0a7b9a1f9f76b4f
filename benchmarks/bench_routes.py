"""The coordinator's own CPU per request, route by route, against the real coordinator process.

``bench_fleet.py`` drives a whole fleet at once; on a shared machine its latencies measure
the machine as much as the coordinator. This one asks for one kind of request at a time
(a few in flight, so the coordinator never waits on this generator) and divides the
coordinator's CPU-seconds (``/proc``, user + system) by the requests answered: a figure
the machine's other load hardly moves, and what sizes a host. The coordinator is one
Python process (one core for its event loop), so ``1 / (CPU per request)`` is about the
most requests per second it answers, whatever the host.

The setup is the fleet's: ``--readers`` workers and a trainer; the trainer publishes one
version of a ``--tensors`` MoE manifest (``bench_fleet.moe_manifest``). Then, in order:
heartbeats without and with a fetch report, resolves, the manifest GET (gzip, as httpx
asks; the first one encodes it), each reader's serving lease (it registers the reader's
partial replica: the k-th lease sees k-1 of them), one refresh each, and each reader's
complete + release.

    python benchmarks/bench_routes.py                       # 1,024 readers, 50,000 tensors
    python benchmarks/bench_routes.py --readers 256 --tensors 5000

Compare two trees by running it from each (the coordinator is ``python -m tensorhub`` in
the current directory), e.g. ``cd OTHER && python /path/to/bench_routes.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_fleet import _fetch_report, _replica_body, moe_manifest  # noqa: E402
from bench_load import CoordinatorProc, _cpu, _Pool, _run_loop  # noqa: E402


async def _measure(pid: int, n: int, make: Callable[[int], tuple[str, str, Optional[bytes]]], pool: _Pool,
                   inflight: int = 8) -> dict:
    """``n`` requests (``make(i)`` -> method, path, body), ``inflight`` at a time: the
    coordinator's CPU-ms per request, wall ms per request, and the statuses."""
    sem = asyncio.Semaphore(inflight)
    statuses: dict[int, int] = {}
    answers: list = [None] * n

    async def one(i: int) -> None:
        async with sem:
            method, path, body = make(i)
            st, data = await pool.request(method, path, body)
            statuses[st] = statuses.get(st, 0) + 1
            answers[i] = data

    c0, t0 = _cpu(pid), time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    cpu, wall = _cpu(pid) - c0, time.perf_counter() - t0
    size = sum(len(a or b"") for a in answers) / n
    return {"n": n, "cpu_ms": cpu / n * 1e3, "wall_ms": wall / n * 1e3, "bytes": round(size), "statuses": statuses,
            "answers": answers}


async def _drive(url: str, pid: int, readers: int, tensors: int, chunks: int, beats: int) -> list[tuple[str, dict]]:
    from tensorhub._grid import grid_chunk_bytes
    from tensorhub._wire import Manifest, manifest_digest

    pool = _Pool(url, 8, headers={"Accept-Encoding": "gzip, deflate"})
    enc = lambda d: json.dumps(d).encode()  # noqa: E731
    ids = [f"sim-{i:05d}" for i in range(readers + 1)]
    trainer, rids = ids[0], ids[1:]
    zones = ["z1", "z2", "z3", "z4"]
    out: list[tuple[str, dict]] = []
    r = await _measure(pid, len(ids), lambda i: ("POST", "/v1/workers", enc({
        "worker_id": ids[i], "endpoint": f"127.0.0.1:{20000 + i}",
        "locality": {"datacenter": "dc1", "zone": zones[i % 4], "host": f"h{i // 8}"}})), pool)
    out.append(("register worker", r))
    man = moe_manifest(tensors, chunks)
    man_json = json.dumps(man).encode()
    addrs = [(1 << 40) + k * (1 << 28) for k in range(tensors)]
    digest = manifest_digest(Manifest.model_validate(man))
    chunk_bytes = grid_chunk_bytes(sum(t["nbytes"] for t in man["tensors"]))
    st, data = await pool.request("POST", "/v1/models/policy/versions", b"{}")
    v = json.loads(data)["version"]
    r = await _measure(pid, 1, lambda i: ("POST", "/v1/replicas", _replica_body(trainer, "policy", v, man_json,
                                                                                json.dumps(addrs).encode())), pool)
    out.append((f"publish: register the {tensors:,}-tensor replica", r))
    hb = lambda i: ("POST", f"/v1/workers/{ids[i % len(ids)]}/heartbeat", None)  # noqa: E731
    out.append(("heartbeat", await _measure(pid, beats, hb, pool)))
    rep = lambda i: ("POST", f"/v1/workers/{rids[i % readers]}/heartbeat", enc({"fetches": [_fetch_report(  # noqa: E731
        rids[i % readers], "policy", v, "running", 1 << 30, 1 << 31, 1.0)]}))
    out.append(("heartbeat + fetch report", await _measure(pid, beats // 2, rep, pool)))
    out.append(("resolve", await _measure(pid, readers, lambda i: (
        "POST", "/v1/models/policy/resolve", enc({"group": None})), pool)))
    path = f"/v1/models/policy/versions/{v}/manifest?layout=hf&shard=0"
    out.append(("GET manifest: the first (encodes)", await _measure(pid, 1, lambda i: ("GET", path, None), pool)))
    out.append(("GET manifest: the others", await _measure(pid, readers, lambda i: ("GET", path, None), pool)))

    def lease(i: int, lease_id: Optional[str] = None) -> dict:
        base = (1 << 44) + (i << 32)
        body = {"worker_id": rids[i], "model": "policy", "version": v, "layout": "hf", "shard": 0, "max_sources": 4,
                "exclude": [], "pipelined": True, "lease_id": lease_id, "manifest": False}
        if lease_id is None:
            body["request_id"] = f"req-{i}"
            body["serve"] = {"manifest_digest": digest, "addresses": [base + k for k in range(tensors)],
                             "chunk_bytes": chunk_bytes, "num_chunks": chunks, "status_addr": base - 4096,
                             "status_tag": i + 1}
        return body

    grants: list[dict] = []
    for lo, hi in ((0, readers // 2), (readers // 2, readers)):
        r = await _measure(pid, hi - lo, lambda i, lo=lo: ("POST", "/v1/leases", enc(lease(lo + i))), pool)
        grants += [json.loads(a) if a else {} for a in r.pop("answers")]
        out.append((f"lease, serving (readers {lo + 1}-{hi} of {readers})", r))
    out.append(("lease refresh", await _measure(pid, readers, lambda i: (
        "POST", "/v1/leases", enc(lease(i, grants[i].get("lease_id")))), pool)))
    out.append(("complete + release", await _measure(pid, readers, lambda i: ("POST", "/v1/replicas", enc({
        "worker_id": rids[i], "model": "policy", "version": v, "layout": "hf", "shard": 0, "num_shards": 1,
        "manifest_digest": digest, "addresses": [(1 << 44) + (i << 32) + k for k in range(tensors)],
        "release": [grants[i].get("lease_id", "none")]})), pool)))
    await pool.close()
    for _, r in out:
        r.pop("answers", None)
    out.append(("(the manifest's JSON, as sent by the trainer)", {"n": 0, "cpu_ms": 0.0, "wall_ms": 0.0,
                                                                "bytes": len(man_json), "statuses": {}}))
    return out


def run_routes(*, readers: int = 1024, tensors: int = 50_000, chunks: int = 256, beats: int = 4000) -> dict:
    with tempfile.TemporaryDirectory(prefix="th-routes-") as tmp:
        coord = CoordinatorProc(Path(tmp) / "state", worker_ttl=600.0, extra=("--lease-ttl", "600"))
        try:
            rows = _run_loop(_drive(coord.url, coord.proc.pid, readers, tensors, chunks, beats))
            alive = coord.alive
        finally:
            coord.stop()
    return {"readers": readers, "tensors": tensors, "chunks": chunks, "alive": alive,
            "routes": [{"route": k, **{f: (round(x, 3) if isinstance(x, float) else x) for f, x in r.items()}}
                       for k, r in rows]}


def report_routes(out: dict) -> str:
    lines = [f"coordinator CPU per request, route by route ({out['readers']} readers, "
             f"{out['tensors']:,}-tensor manifest, {out['chunks']} chunks)",
             f"{'request':<44} {'n':>6} {'CPU ms/req':>11} {'req/s per core':>15} {'wall ms/req':>12} "
             f"{'answer B':>10}  statuses"]
    for r in out["routes"]:
        per_core = 1e3 / r["cpu_ms"] if r["cpu_ms"] > 0 else float("inf")
        lines.append(f"{r['route']:<44} {r['n']:>6} {r['cpu_ms']:>11.3f} {per_core:>15,.0f} {r['wall_ms']:>12.3f} "
                     f"{r['bytes']:>10,}  {r['statuses']}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--readers", type=int, default=1024)
    p.add_argument("--tensors", type=int, default=50_000)
    p.add_argument("--chunks", type=int, default=256)
    p.add_argument("--beats", type=int, default=4000, help="heartbeats measured (half as many with a report)")
    p.add_argument("--json", help="also write the figures here")
    a = p.parse_args(argv)
    out = run_routes(readers=a.readers, tensors=a.tensors, chunks=a.chunks, beats=a.beats)
    print(report_routes(out))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
    bad = sum(n for r in out["routes"] for st, n in r["statuses"].items() if st != 200)
    return 0 if out["alive"] and not bad else 1


if __name__ == "__main__":
    sys.exit(main())
