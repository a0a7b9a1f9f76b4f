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

Addresses (``--addresses``): every replica's memory is laid out as the Hub lays it out
(``hub.empty_like`` snapshots, fetched copies), and clients send it either as plain lists,
one address per tensor, as clients before ``AddressRuns`` did (``plain``), or as runs and
ask for runs in lease answers (``runs``). ``both`` (the default) runs the whole sequence
twice, each on a fresh coordinator, plain first, and prints the two side by side with the
coordinator's CPU per reader-version (resolve, manifest GET, serving lease, refresh,
complete + release).

    python benchmarks/bench_routes.py                       # 1,024 readers, 50,000 tensors
    python benchmarks/bench_routes.py --readers 256 --tensors 5000
    python benchmarks/bench_routes.py --readers 256 --addresses runs
    python benchmarks/bench_routes.py --only ahead --reps 5   # subscribe ahead: bind per subscriber

Subscribing ahead (``--ahead``, on by default; ``--only ahead`` runs just it): the coordinator's
state machine alone (``tensorhub.server.state.CoordinatorState``, no HTTP, no process), as
``server.core.Coordinator._apply`` runs it. ``--readers`` workers on hosts of 8 GPUs each
subscribe for v+1 (``subscribe``: an ``ahead`` lease with the serve offer the client sends,
address runs + chunk map), the publisher registers v+1, and the call that completes it binds
every subscriber (``bind_ahead``: offers registered, one plan fixed, every grant made) and
encodes every grant as ``Subscribers.stream`` does (``LeaseAnswers.encode``). Printed: the
CPU per subscriber of the subscribe and of the bind (+ encode), the median of ``--reps``
rounds (each on a fresh state), beside the serving lease and manifest rows above.

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

from bench_fleet import _checksummed, _fetch_report, moe_manifest  # noqa: E402
from bench_load import CoordinatorProc, _cpu, _Pool, _run_loop  # noqa: E402


async def _measure(pid: int, n: int, make: Callable[[int], tuple[str, str, Optional[bytes]]], pool: _Pool,
                   inflight: int = 8) -> dict:
    """``n`` requests (``make(i)`` -> method, path, body), ``inflight`` at a time: the
    coordinator's CPU-ms per request, wall ms per request, and the statuses."""
    sem = asyncio.Semaphore(inflight)
    statuses: dict[int, int] = {}
    answers: list = [None] * n
    sent = [0]

    async def one(i: int) -> None:
        async with sem:
            method, path, body = make(i)
            sent[0] += len(body or b"")
            st, data = await pool.request(method, path, body)
            statuses[st] = statuses.get(st, 0) + 1
            answers[i] = data

    c0, t0 = _cpu(pid), time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    cpu, wall = _cpu(pid) - c0, time.perf_counter() - t0
    size = sum(len(a or b"") for a in answers) / n
    return {"n": n, "cpu_ms": cpu / n * 1e3, "wall_ms": wall / n * 1e3, "bytes": round(size),
            "request_bytes": round(sent[0] / n), "statuses": statuses, "answers": answers}


async def _drive(url: str, pid: int, readers: int, tensors: int, chunks: int, beats: int,
                 runs: bool = False) -> list[tuple[str, dict]]:
    from tensorhub._addresses import encode
    from tensorhub._grid import grid_chunk_bytes
    from tensorhub.protocol import Manifest, manifest_digest, shape_digest

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
    manifest = Manifest.model_validate(man)
    offsets, off = [], 0
    for t in man["tensors"]:  # the Hub's layout (``_tensors.allocate_like``): in order, 64-byte aligned
        offsets.append(off)
        off += -(-t["nbytes"] // 64) * 64

    def where(base: int) -> dict:
        """A replica at ``base`` as the client sends it: runs (encoded as a client does) or the list."""
        addrs = [base + o for o in offsets]
        if runs:
            return {"address_runs": encode(addrs, manifest).model_dump(mode="json")}
        return {"addresses": addrs}

    digest = manifest_digest(manifest)
    chunk_bytes = grid_chunk_bytes(sum(t["nbytes"] for t in man["tensors"]))
    st, data = await pool.request("POST", "/v1/models/policy/versions", b"{}")
    v = json.loads(data)["version"]
    trainer_body = json.dumps({"worker_id": trainer, "model": "policy", "version": v, "layout": "hf", "shard": 0,
                               "num_shards": 1, "manifest": man, **where(1 << 40)}).encode()
    r = await _measure(pid, 1, lambda i: ("POST", "/v1/replicas", trainer_body), pool)
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
        if runs:
            body["address_runs"] = True
        if lease_id is None:
            body["request_id"] = f"req-{i}"
            body["serve"] = {"manifest_digest": digest, **where(base),
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
        "manifest_digest": digest, **where((1 << 44) + (i << 32)),
        "release": [grants[i].get("lease_id", "none")]})), pool)))
    # The next versions of the same tensors, each published as the one before's tensors with
    # its own sums (``RegisterReplica.like``, what a Hub does for a model trained in place),
    # one after the other: beside "publish: register the replica" above.
    shape = shape_digest(manifest)
    likes = []
    for _ in range(LIKES):
        st, data = await pool.request("POST", "/v1/models/policy/versions", b"{}")
        likes.append(json.loads(data)["version"])
    out.append((f"publish: register v+1 like v (the same {tensors:,} tensors)", await _measure(
        pid, LIKES, lambda i: ("POST", "/v1/replicas", enc({
            "worker_id": trainer, "model": "policy", "version": likes[i], "layout": "hf", "shard": 0,
            "num_shards": 1, "like": {"version": likes[i - 1] if i else v, "shape_digest": shape},
            **where(1 << 40)})), pool, inflight=1)))
    await pool.close()
    for _, r in out:
        r.pop("answers", None)
    out.append(("(the manifest's JSON, as sent by the trainer)", {"n": 0, "cpu_ms": 0.0, "wall_ms": 0.0,
                                                                "bytes": len(man_json), "request_bytes": 0,
                                                                "statuses": {}}))
    return out


def run_routes(*, readers: int = 1024, tensors: int = 50_000, chunks: int = 256, beats: int = 4000,
               runs: bool = False) -> dict:
    with tempfile.TemporaryDirectory(prefix="th-routes-") as tmp:
        coord = CoordinatorProc(Path(tmp) / "state", worker_ttl=600.0, extra=("--lease-ttl", "600"))
        try:
            rows = _run_loop(_drive(coord.url, coord.proc.pid, readers, tensors, chunks, beats, runs))
            alive = coord.alive
        finally:
            coord.stop()
    return {"readers": readers, "tensors": tensors, "chunks": chunks, "alive": alive,
            "addresses": "runs" if runs else "plain",
            "routes": [{"route": k, **{f: (round(x, 3) if isinstance(x, float) else x) for f, x in r.items()}}
                       for k, r in rows]}


#: Versions published by ``like`` after the first (``_drive``).
LIKES = 8

#: The routes one reader calls per version (the serving lease: the mean of its two halves).
PER_READER = ("resolve", "GET manifest: the others", "lease, serving", "lease refresh", "complete + release")


def per_reader_version(out: dict) -> float:
    """The coordinator's CPU-ms per reader-version: the sum of :data:`PER_READER`."""
    total = 0.0
    for name in PER_READER:
        ms = [r["cpu_ms"] for r in out["routes"] if r["route"].startswith(name)]
        total += sum(ms) / len(ms)
    return total


def report_both(plain: dict, runs: dict) -> str:
    """The two runs side by side: CPU ms and answer bytes per route, and per reader-version."""
    lines = [f"plain address lists vs address runs ({plain['readers']} readers, {plain['tensors']:,} tensors, "
             f"{plain['chunks']} chunks; each on its own coordinator, plain first)",
             f"{'request':<44} {'plain CPU ms':>12} {'runs CPU ms':>12} {'x plain':>8} "
             f"{'plain sent B':>13} {'runs sent B':>12} {'plain answer B':>15} {'runs answer B':>14}"]
    for a, b in zip(plain["routes"], runs["routes"]):
        x = f"{b['cpu_ms'] / a['cpu_ms']:.2f}" if a["cpu_ms"] > 0 else "-"
        lines.append(f"{a['route']:<44} {a['cpu_ms']:>12.3f} {b['cpu_ms']:>12.3f} {x:>8} "
                     f"{a['request_bytes']:>13,} {b['request_bytes']:>12,} {a['bytes']:>15,} {b['bytes']:>14,}")
    p, r = per_reader_version(plain), per_reader_version(runs)
    lines.append(f"{'CPU ms per reader-version':<44} {p:>12.2f} {r:>12.2f} {r / p if p else 0:>8.2f}")
    return "\n".join(lines)


def report_routes(out: dict) -> str:
    lines = [f"coordinator CPU per request, route by route ({out['readers']} readers, "
             f"{out['tensors']:,}-tensor manifest, {out['chunks']} chunks, addresses: {out.get('addresses', 'plain')})",
             f"{'request':<44} {'n':>6} {'CPU ms/req':>11} {'req/s per core':>15} {'wall ms/req':>12} "
             f"{'answer B':>10}  statuses"]
    for r in out["routes"]:
        per_core = 1e3 / r["cpu_ms"] if r["cpu_ms"] > 0 else float("inf")
        lines.append(f"{r['route']:<44} {r['n']:>6} {r['cpu_ms']:>11.3f} {per_core:>15,.0f} {r['wall_ms']:>12.3f} "
                     f"{r['bytes']:>10,}  {r['statuses']}")
    return "\n".join(lines)


def _ahead_round(readers: int, man: dict, chunks: int) -> dict:
    """One round of subscribe-ahead on a fresh ``CoordinatorState`` (module docstring):
    seconds (``time.process_time``: this process's CPU) of the subscribes, the publisher's
    registration of v+1, and the bind + encode, and what the bind answered."""
    from tensorhub._addresses import encode
    from tensorhub._grid import grid_chunk_bytes
    from tensorhub.server.manifest_cache import LeaseAnswers
    from tensorhub.server.state import CoordinatorState, StateConfig
    from tensorhub.server.ahead import warm
    from tensorhub.protocol import (AcquireLease, Locality, Manifest, RegisterReplica, ServeOffer, manifest_json,
                                    shape_digest)

    st = CoordinatorState(StateConfig(lease_ttl=600.0, worker_ttl=600.0), now=0.0)
    manifest = Manifest.model_validate(man)
    offsets, off = [], 0
    for t in man["tensors"]:  # the Hub's layout (``_tensors.allocate_like``): in order, 64-byte aligned
        offsets.append(off)
        off += -(-t["nbytes"] // 64) * 64

    def runs(base: int):  # a replica at ``base`` as the client sends it (``Session.addresses_of``)
        return encode([base + o for o in offsets], manifest)

    st.register_worker(0.0, "trainer", "127.0.0.1:20000", Locality(datacenter="dc1", zone="zt", host="ht"))
    ids = [f"sim-{i:05d}" for i in range(readers)]
    for i, w in enumerate(ids):  # hosts of 8 GPUs, 16 hosts to a zone, one datacenter
        st.register_worker(0.0, w, f"127.0.0.1:{20001 + i}",
                           Locality(datacenter="dc1", zone=f"z{i // 128}", host=f"h{i // 8}"))
    v1 = st.allocate_version(0.0, "policy")
    st.register_replica(0.0, RegisterReplica(worker_id="trainer", model="policy", version=v1, layout="hf", shard=0,
                                             num_shards=1, manifest=manifest, address_runs=runs(1 << 40)))
    st.catalog.take_completed()
    digest = shape_digest(manifest)  # the client's offer names the held version's tensors
    chunk_bytes = grid_chunk_bytes(manifest.nbytes)
    reqs = [AcquireLease(worker_id=w, model="policy", version=v1 + 1, layout="hf", shard=0, max_sources=4,
                         pipelined=True, manifest=False, request_id=f"ahead-{i}", ahead=True, address_runs=True,
                         serve=ServeOffer(manifest_digest=digest, address_runs=runs((1 << 44) + (i << 32)),
                                          chunk_bytes=chunk_bytes, num_chunks=chunks,
                                          status_addr=(1 << 44) + (i << 32) - 4096, status_tag=i + 1))
            for i, w in enumerate(ids)]  # (parsed beforehand: the HTTP shell's part, not the state's)
    c0 = time.process_time()
    for r in reqs:
        assert st.subscribe(1.0, r, 30.0) is None  # held
    subscribe = time.process_time() - c0
    v2 = st.allocate_version(2.0, "policy")
    manifest2 = Manifest.model_validate(man)  # (v2's manifest, as parsed from its registration: a new object)
    c0 = time.process_time()
    manifest_json(manifest2)  # what the registration's parse thread makes, off the event loop
    if st.ahead.waits_on("policy"):  # (``server.asgi._parse_registration``)
        warm(manifest2)
    thread = time.process_time() - c0
    c0 = time.process_time()
    st.register_replica(2.0, RegisterReplica(worker_id="trainer", model="policy", version=v2, layout="hf", shard=0,
                                             num_shards=1, manifest=manifest2, address_runs=runs(1 << 40)))
    completed = st.catalog.take_completed()
    publish = time.process_time() - c0
    answers = LeaseAnswers()
    c0 = time.process_time()
    bound = st.bind_ahead(2.0, completed)
    bind_call = time.process_time() - c0
    grants = [st.grant_ahead(2.0, *x) for _, _, x in bound]
    body = [answers.encode(g.model_copy(update={"granted_after": 1.0}))
            for g in grants]  # (as Subscribers.stream: each grant made, then encoded)
    bind = time.process_time() - c0
    return {"subscribe": subscribe, "thread": thread, "publish": publish, "bind": bind, "bind_call": bind_call,
            "bound": len(bound),
            "fixed": sum(1 for g in grants if getattr(g, "refresh_after", 1.0) == 0.0 and g.stripes),
            "answer_bytes": sum(map(len, body)) / max(1, len(body))}


def run_ahead(*, readers: int = 1024, tensors: int = 50_000, chunks: int = 256, reps: int = 5) -> dict:
    """:func:`_ahead_round` ``reps`` times; medians (ms) per subscriber."""
    import gc
    import statistics

    # (with one checksum per chunk, as a Hub publishes by default: a subscriber's grant
    # carries them, ``LeaseGrant.sums``)
    man = _checksummed(moe_manifest(tensors, chunks), 1)
    rounds = []
    for _ in range(reps):
        gc.collect()
        rounds.append(_ahead_round(readers, man, chunks))
    med = {k: statistics.median(r[k] for r in rounds) for k in ("subscribe", "publish", "bind", "bind_call")}
    return {"readers": readers, "tensors": tensors, "chunks": chunks, "reps": reps,
            "subscribe_ms": med["subscribe"] / readers * 1e3, "bind_ms": med["bind"] / readers * 1e3,
            "bind_total_ms": med["bind"] * 1e3, "publish_ms": med["publish"] * 1e3,
            "bind_call_ms": med["bind_call"] / readers * 1e3,
            "bind_ms_all": [round(r["bind"] / readers * 1e3, 4) for r in rounds],
            "subscribe_ms_all": [round(r["subscribe"] / readers * 1e3, 4) for r in rounds],
            "bound": rounds[-1]["bound"], "fixed": rounds[-1]["fixed"], "answer_bytes": round(rounds[-1]["answer_bytes"])}


def report_ahead(a: dict, beside: Optional[dict] = None) -> str:
    lines = [f"subscribe ahead, on the state machine (CoordinatorState, no HTTP; {a['readers']} subscribers on "
             f"hosts of 8, {a['tensors']:,}-tensor manifest, {a['chunks']} chunks, offers as address runs; median of "
             f"{a['reps']} rounds, CPU of this process)",
             f"{'request':<44} {'CPU ms/req':>11} {'rounds':>40}",
             f"{'subscribe (held; per subscriber)':<44} {a['subscribe_ms']:>11.3f} "
             f"{' '.join(f'{x:.3f}' for x in a['subscribe_ms_all']):>40}",
             f"{'bind + grant + encode (per subscriber)':<44} {a['bind_ms']:>11.3f} "
             f"{' '.join(f'{x:.3f}' for x in a['bind_ms_all']):>40}",
             f"  of which the bind in the publisher's call (offers, plans fixed): {a['bind_call_ms']:.3f} ms per "
             f"subscriber, the rest each grant made and encoded (streamed, once the version is durable); "
             f"all {a['bound']}: {a['bind_total_ms']:.0f} ms; "
             f"the publisher's registration of v+1 before it: {a['publish_ms']:.1f} ms; {a['fixed']} grants "
             f"from a fixed plan; answer {a['answer_bytes']:,} B each"]
    if beside:
        for r in beside["routes"]:
            if r["route"].startswith(("lease, serving", "GET manifest: the others")):
                lines.append(f"{'(HTTP) ' + r['route']:<44} {r['cpu_ms']:>11.3f}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--readers", type=int, default=1024)
    p.add_argument("--tensors", type=int, default=50_000)
    p.add_argument("--chunks", type=int, default=256)
    p.add_argument("--beats", type=int, default=4000, help="heartbeats measured (half as many with a report)")
    p.add_argument("--addresses", choices=("plain", "runs", "both"), default="both",
                   help="clients send replicas' addresses as plain lists, as runs, or both in turn (default)")
    p.add_argument("--ahead", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure subscribe ahead's bind on the state machine (module docstring)")
    p.add_argument("--only", choices=("routes", "ahead"), default=None, help="only the routes, or only the bind")
    p.add_argument("--reps", type=int, default=5, help="subscribe-ahead rounds (the median is printed)")
    p.add_argument("--json", help="also write the figures here")
    a = p.parse_args(argv)
    modes = {"plain": [False], "runs": [True], "both": [False, True]}[a.addresses]
    if a.only == "ahead":
        modes = []
    outs = []
    for runs in modes:
        out = run_routes(readers=a.readers, tensors=a.tensors, chunks=a.chunks, beats=a.beats, runs=runs)
        print(report_routes(out))
        print(f"CPU ms per reader-version ({out['addresses']}): {per_reader_version(out):.2f}\n")
        outs.append(out)
    if len(outs) == 2:
        print(report_both(*outs))
    ahead = None
    if a.ahead and a.only != "routes":
        ahead = run_ahead(readers=a.readers, tensors=a.tensors, chunks=a.chunks, reps=a.reps)
        print("\n" + report_ahead(ahead, outs[-1] if outs else None))
    if a.json:
        data: object = outs[0] if len(outs) == 1 else outs
        if ahead is not None:
            data = {"routes": data, "ahead": ahead}
        Path(a.json).write_text(json.dumps(data, indent=2))
    bad = sum(n for o in outs for r in o["routes"] for st, n in r["statuses"].items() if st != 200)
    return 0 if all(o["alive"] for o in outs) and not bad else 1


if __name__ == "__main__":
    sys.exit(main())
