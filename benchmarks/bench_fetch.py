"""Fetch throughput on loopback, side by side with raw Mooncake and memcpy.

One publisher process holds a version (default 1 GiB); this process reads it, in the
same run and interleaved round by round:

* ``memcpy``   -- a local tensor copy of the same size (the machine's ceiling),
* ``mooncake`` -- raw Mooncake driven as our reader drives it (one-entry async batches,
  a few in flight, polled with a short sleep), tuned: the best chunk size x depth of a
  small sweep, measured before the rounds,
* ``mooncake-sync`` -- one synchronous batch of 64 MiB entries (the old baseline),
* ``tensorhub``-- ``hub.fetch(..., into=preallocated, serve=False)`` through the
  coordinator (lease, chunked reads, release), over Mooncake's loopback (a reader Hub
  with ``TENSORHUB_SAMEHOST=0``),
* ``tensorhub-new`` -- ``hub.fetch`` into freshly allocated tensors (page faults included),
* ``user`` / ``user-new`` -- the publisher's own tensors (allocated by torch, as the
  README's RL loop does: not Hub memory) read by a same-host reader in place with
  ``process_vm_readv`` (issue 34), into preallocated / into new (Hub, pooled) memory,
* ``samehost`` / ``samehost-new`` -- the same, of a version the publisher holds in
  Hub-allocated memory (``hub.empty_like``): copied through its memfd, no Mooncake; new
  memory is a pooled arena the previous round freed (no page faults),
* ``samehost-cold`` -- into new memory never touched before (the pool emptied first),
* ``memcpy-new`` -- ``torch.empty_like(src).copy_(src)`` (memcpy with page faults),
* ``vm-raw`` -- ``process_vm_readv`` alone from the publisher's tensors, two threads, 16 MiB
  a call, no lease and no checksum: the mechanism's ceiling on this machine,
* ``user-thp`` / ``user-thp-new`` / ``vm-raw-thp`` -- the same user tensors in a publisher
  started with torch's ``THP_MEM_ALLOC_ENABLE=1`` (its large CPU allocations on transparent
  huge pages): the kernel pins a huge page at a time instead of 512 small ones.

Prints GB/s (median of the rounds) and the ratios, writes JSON.

    python benchmarks/bench_fetch.py [--gib 1] [--rounds 5] [--json out/bench_fetch.json]

``--remote`` (root, iproute2): across a shaped link instead. The publisher (a Hub holding
the version) runs on one host of the emulated testbed (``benchmarks/testbed.py``: network
namespaces, veth links shaped with ``tc tbf`` at ``--rate`` both ways), the reader on
another, the coordinator in the testbed's core namespace (reachable from both). The
reader runs, interleaved round by round (the order rotating):

* ``tensorhub`` -- ``hub.fetch(..., into=preallocated, serve=False)`` across the link,
* ``mooncake`` -- raw Mooncake across the same link, tuned as above (the same sweep,
  which includes our reader's chunk size and depth), from the publisher's memory,
* ``tcp`` -- one plain TCP socket streaming the same bytes (``sendall`` / ``recv_into``).

Every read is checked byte for byte after it (the destination zeroed before it). Prints
GB/s medians and tensorhub / tuned raw Mooncake, writes JSON (default
``out/bench_fetch_remote.json``); the testbed is removed at the end.

    sudo python benchmarks/bench_fetch.py --remote [--rate 2gbit] [--gib 0.25] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

os.environ.setdefault("GLOG_minloglevel", "2")


MiB = 1 << 20


def _weights(torch, nbytes: int) -> dict:
    """The benchmark's version: 16 tensors, contents fixed (cheap to make and to check)."""
    per = nbytes // 16 // 4
    return {f"layers.{i}.weight": torch.arange(per, dtype=torch.int32).add_(i * 7919).view(torch.float32)
            for i in range(16)}


def _size(gib: float) -> int:
    return int(gib * (1 << 30)) // (16 * 4) * 16 * 4


def raw_read(engine, peer: str, base: int, addrs: list[int], sizes: list[int], chunk: int, depth: int) -> float:
    """Raw Mooncake as our reader drives it: one-entry async batches of ``chunk`` bytes,
    ``depth`` in flight, completion polled with a short growing sleep; reads the tensors at
    ``addrs`` on ``peer`` into local memory from ``base`` on. Returns the seconds it took."""
    todo, off = [], 0
    for a, s in zip(addrs, sizes):
        for o in range(0, s, chunk):
            todo.append((base + off + o, a + o, min(chunk, s - o)))
        off += s
    todo.reverse()
    inflight: list[int] = []
    t0 = time.perf_counter()
    sleep = 0.00025
    while todo or inflight:
        while todo and len(inflight) < depth:
            loc, rem, n = todo.pop()
            bid = engine.batch_transfer_async_read(peer, [loc], [rem], [n])
            if bid <= 0:
                raise RuntimeError("raw Mooncake submit failed")
            inflight.append(bid)
        done = False
        for bid in list(inflight):
            st = engine.transfer_check_status(bid)
            if st == 1:
                inflight.remove(bid)
                done = True
            elif st < 0 and st != -2:
                raise RuntimeError(f"raw Mooncake read failed: {st}")
        if done:
            sleep = 0.00025
        else:
            time.sleep(sleep)
            sleep = min(sleep * 2, 0.002)
    return time.perf_counter() - t0


def tune(engine, peer: str, base: int, addrs: list[int], sizes: list[int], say=print,
         sweep_out: Optional[dict] = None) -> tuple[int, int]:
    """The baseline's settings: the best (chunk bytes, depth) of a small sweep, each tried
    twice: 16 and 64 MiB and our reader's chunk (the shard's grid) x depth 2, 4, 8.
    ``sweep_out`` gets each setting's best seconds ("<MiB>x<depth>")."""
    from tensorhub._grid import grid_chunk_bytes

    chunks = sorted({16 * MiB, 64 * MiB, grid_chunk_bytes(sum(sizes))})
    best = {(c, d): min(raw_read(engine, peer, base, addrs, sizes, c, d) for _ in range(2))
            for c in chunks for d in (2, 4, 8)}
    tuned = min(best, key=best.__getitem__)
    if sweep_out is not None:
        sweep_out.update({f"{c >> 20}x{d}": t for (c, d), t in best.items()})
    say(f"raw Mooncake tuned: {tuned[0] >> 20} MiB chunks, depth {tuned[1]} (sweep, GB/s: "
        + ", ".join(f"{c >> 20}x{d} {sum(sizes) / t / 1e9:.3f}" for (c, d), t in best.items())
        + f"; our reader: {grid_chunk_bytes(sum(sizes)) >> 20} MiB x 2)")
    return tuned


def publisher(url: str, nbytes: int, conn) -> None:  # pragma: no cover - child process
    os.environ.setdefault("GLOG_minloglevel", "2")
    import torch

    import tensorhub

    weights = _weights(torch, nbytes)
    hub = tensorhub.connect(url, worker_id="bench-publisher")
    v = hub.publish("bench", weights)
    # The same bytes in Hub-allocated memory (hub.empty_like): same-host readers copy them.
    snap = hub.empty_like(weights)
    for k, t in weights.items():
        snap[k].copy_(t)
    vs = hub.publish("bench-shm", snap)
    conn.send((v, vs, hub.endpoint, [t.data_ptr() for t in weights.values()], [t.nbytes for t in weights.values()]))
    conn.recv()  # wait until the reader is done
    hub.close()


def publisher_thp(url: str, nbytes: int, conn) -> None:  # pragma: no cover - child process
    """The same user tensors, in a process started with torch's ``THP_MEM_ALLOC_ENABLE=1``
    (its CPU allocations of >= 2 MiB 2 MiB-aligned and ``madvise(MADV_HUGEPAGE)``): what a
    trainer gets by that one variable. Says how much of its memory is on huge pages."""
    os.environ.setdefault("GLOG_minloglevel", "2")
    import torch

    import tensorhub

    weights = _weights(torch, nbytes)
    hub = tensorhub.connect(url, worker_id="bench-publisher-thp")
    v = hub.publish("bench-thp", weights)
    huge = 0
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                huge = int(line.split()[1]) * 1024
    conn.send((v, huge, [t.data_ptr() for t in weights.values()], [t.nbytes for t in weights.values()]))
    conn.recv()
    hub.close()


def raw_vm(pid: int, addrs: list[int], sizes: list[int], base: int, threads: int = 2, seg: int = 16 << 20) -> float:
    """The mechanism alone: ``process_vm_readv`` of the holder's tensors into local memory
    from ``base`` on, ``seg`` bytes a call, ``threads`` threads (no lease, no checksum):
    the ceiling of a same-host read of memory the Hub did not allocate."""
    import threading

    from tensorhub.transport import _vm
    from tensorhub.transport._base import ReadOp

    ops, off = [], 0
    for a, n in zip(addrs, sizes):
        ops += [ReadOp(base + off + o, a + o, min(seg, n - o)) for o in range(0, n, seg)]
        off += n
    parts = [ops[i::threads] for i in range(threads)]
    t0 = time.perf_counter()
    th = [threading.Thread(target=_vm.read_into, args=(pid, p)) for p in parts]
    for t in th:
        t.start()
    for t in th:
        t.join()
    return time.perf_counter() - t0


def loopback(args: argparse.Namespace) -> int:
    import torch

    import tensorhub
    from tensorhub.coordinator import EmbeddedCoordinator

    nbytes = _size(args.gib)
    with tempfile.TemporaryDirectory() as state, EmbeddedCoordinator(state) as coord:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=publisher, args=(coord.url, nbytes, child), daemon=True)
        proc.start()
        version, version_shm, endpoint, addrs, sizes = parent.recv()
        parent_thp, child_thp = ctx.Pipe()
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"  # the THP publisher's environment only
        try:
            proc_thp = ctx.Process(target=publisher_thp, args=(coord.url, nbytes, child_thp), daemon=True)
            proc_thp.start()
        finally:
            del os.environ["THP_MEM_ALLOC_ENABLE"]
        version_thp, thp_huge, thp_addrs, thp_sizes = parent_thp.recv()

        # Over Mooncake's loopback: a reader without the same-host path (its transport made now).
        os.environ["TENSORHUB_SAMEHOST"] = "0"
        try:
            hub_mc = tensorhub.connect(coord.url, worker_id="bench-reader-mooncake")
            hub_mc._session.transport()
        finally:
            del os.environ["TENSORHUB_SAMEHOST"]
        hub = tensorhub.connect(coord.url, worker_id="bench-reader")
        dst = {f"layers.{i}.weight": torch.zeros(s // 4, dtype=torch.float32) for i, s in enumerate(sizes)}
        flat_src = torch.ones(nbytes // 4, dtype=torch.float32)
        flat_dst = torch.zeros(nbytes // 4, dtype=torch.float32)
        # Raw Mooncake: its own engine, one batch of 64 MiB entries, the engine's sync batch call.
        from mooncake.engine import TransferEngine

        raw = TransferEngine()
        if raw.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("raw Mooncake engine did not initialize")
        raw_dst = torch.zeros(nbytes // 4, dtype=torch.float32)
        if raw.register_memory(raw_dst.data_ptr(), raw_dst.nbytes) != 0:
            raise RuntimeError("raw Mooncake register_memory failed")
        entry = 64 << 20
        locs, rems, lens, off = [], [], [], 0
        for a, s in zip(addrs, sizes):
            for o in range(0, s, entry):
                n = min(entry, s - o)
                locs.append(raw_dst.data_ptr() + off + o)
                rems.append(a + o)
                lens.append(n)
            off += s

        def t_memcpy() -> float:
            t0 = time.perf_counter()
            flat_dst.copy_(flat_src)
            return time.perf_counter() - t0

        # Tune the baseline: best of a small sweep of chunk size x depth (ours: the grid x 2).
        tuned = tune(raw, endpoint, raw_dst.data_ptr(), addrs, sizes)

        def t_mooncake() -> float:
            return raw_read(raw, endpoint, raw_dst.data_ptr(), addrs, sizes, *tuned)

        def t_mooncake_sync() -> float:
            t0 = time.perf_counter()
            rc = raw.batch_transfer_sync_read(endpoint, locs, rems, lens)
            if rc != 0:
                raise RuntimeError(f"raw Mooncake batch read failed: {rc}")
            return time.perf_counter() - t0

        def t_fetch() -> float:
            t0 = time.perf_counter()
            hub_mc.fetch("bench", version, into=dst, serve=False)
            return time.perf_counter() - t0

        def t_fetch_new() -> float:
            t0 = time.perf_counter()
            out = hub_mc.fetch("bench", version, serve=False)
            dt = time.perf_counter() - t0
            del out
            return dt

        def t_user() -> float:  # the publisher's own torch tensors, same host: process_vm_readv
            t0 = time.perf_counter()
            hub.fetch("bench", version, into=dst, serve=False)
            return time.perf_counter() - t0

        def t_user_new() -> float:
            t0 = time.perf_counter()
            out = hub.fetch("bench", version, serve=False)
            dt = time.perf_counter() - t0
            del out
            return dt

        def t_user_thp() -> float:  # the same, the publisher's tensors on huge pages
            t0 = time.perf_counter()
            hub.fetch("bench-thp", version_thp, into=dst, serve=False)
            return time.perf_counter() - t0

        def t_user_thp_new() -> float:
            t0 = time.perf_counter()
            out = hub.fetch("bench-thp", version_thp, serve=False)
            dt = time.perf_counter() - t0
            del out
            return dt

        def t_vm_raw() -> float:
            return raw_vm(proc.pid, addrs, sizes, flat_dst.data_ptr())

        def t_vm_raw_thp() -> float:
            return raw_vm(proc_thp.pid, thp_addrs, thp_sizes, flat_dst.data_ptr())

        def t_memcpy_new() -> float:
            t0 = time.perf_counter()
            out = torch.empty_like(flat_src).copy_(flat_src)
            dt = time.perf_counter() - t0
            del out
            return dt

        from tensorhub.transport import _arena

        def t_same() -> float:
            t0 = time.perf_counter()
            hub.fetch("bench-shm", version_shm, into=dst, serve=False)
            return time.perf_counter() - t0

        def t_same_new() -> float:  # new memory: a pooled arena (freed by the round before)
            t0 = time.perf_counter()
            out = hub.fetch("bench-shm", version_shm, serve=False)
            dt = time.perf_counter() - t0
            del out
            return dt

        def t_same_cold() -> float:  # new memory never touched before: every page faults
            _arena.trim(0)
            return t_same_new()

        cases = {"memcpy": t_memcpy, "memcpy-new": t_memcpy_new, "mooncake": t_mooncake,
                 "mooncake-sync": t_mooncake_sync, "tensorhub": t_fetch, "tensorhub-new": t_fetch_new,
                 "samehost": t_same, "samehost-new": t_same_new, "samehost-cold": t_same_cold,
                 "user": t_user, "user-new": t_user_new, "vm-raw": t_vm_raw,
                 "user-thp": t_user_thp, "user-thp-new": t_user_thp_new, "vm-raw-thp": t_vm_raw_thp}
        for fn in cases.values():  # warm up connections and page tables
            fn()
        times: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(args.rounds):
            for k, fn in cases.items():
                times[k].append(fn())
        # the bytes really moved, and the same-host fetches did not go over Mooncake
        tr = hub._session.transport()
        copied = getattr(tr, "copied_bytes", 0)
        t_same()
        assert getattr(tr, "copied_bytes", 0) - copied == nbytes, "the same-host fetch did not copy"
        vm = getattr(tr, "vm_bytes", 0)
        t_user()
        assert getattr(tr, "vm_bytes", 0) - vm == nbytes, "the fetch of user tensors was not read in place"
        mc = hub_mc._session.transport()
        assert getattr(mc, "copied_bytes", None) is None, "the Mooncake reader has a same-host path"
        for i, t in enumerate(dst.values()):
            want = torch.arange(t.numel(), dtype=torch.int32).add_(i * 7919).view(torch.float32)
            assert torch.equal(t.view(torch.int32), want.view(torch.int32)), f"tensor {i} differs"
        assert torch.equal(raw_dst.view(torch.int32)[: sizes[0] // 4], torch.arange(sizes[0] // 4, dtype=torch.int32))
        parent.send("done")
        parent_thp.send("done")
        proc.join(30)
        proc_thp.join(30)
        hub.close()
        hub_mc.close()

    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    result = {
        "bytes": nbytes,
        "rounds": args.rounds,
        "gbps": gbps,
        "seconds": times,
        "ratio_tensorhub_vs_mooncake": gbps["tensorhub"] / gbps["mooncake"],
        "ratio_tensorhub_new_vs_mooncake": gbps["tensorhub-new"] / gbps["mooncake"],
        "ratio_mooncake_vs_memcpy": gbps["mooncake"] / gbps["memcpy"],
        "ratio_samehost_vs_memcpy": gbps["samehost"] / gbps["memcpy"],
        "ratio_samehost_new_vs_memcpy": gbps["samehost-new"] / gbps["memcpy"],
        "ratio_samehost_cold_vs_memcpy": gbps["samehost-cold"] / gbps["memcpy"],
        "ratio_user_vs_memcpy": gbps["user"] / gbps["memcpy"],
        "ratio_user_new_vs_memcpy": gbps["user-new"] / gbps["memcpy"],
        "ratio_user_vs_mooncake_fetch": gbps["user"] / gbps["tensorhub"],
        "ratio_user_vs_vm_raw": gbps["user"] / gbps["vm-raw"],
        "ratio_vm_raw_vs_memcpy": gbps["vm-raw"] / gbps["memcpy"],
        "ratio_user_thp_vs_memcpy": gbps["user-thp"] / gbps["memcpy"],
        "ratio_user_thp_new_vs_memcpy": gbps["user-thp-new"] / gbps["memcpy"],
        "thp_publisher_huge_bytes": thp_huge,
    }
    print(f"version size: {nbytes / (1 << 30):.2f} GiB, {args.rounds} rounds, medians")
    print(f"{'path':<15}{'GB/s':>8}{'vs raw mooncake':>18}{'vs memcpy':>12}")
    for k, g in gbps.items():
        print(f"{k:<15}{g:>8.2f}{g / gbps['mooncake']:>17.2f}x{g / gbps['memcpy']:>11.2f}x")
    checks = [("tensorhub fetch / tuned raw Mooncake", result["ratio_tensorhub_vs_mooncake"], 0.95),
              ("same-host fetch into preallocated / memcpy", result["ratio_samehost_vs_memcpy"], 0.6),
              ("same-host fetch into new memory / memcpy", result["ratio_samehost_new_vs_memcpy"], 0.6),
              ("same-host fetch of user tensors into preallocated / memcpy", result["ratio_user_vs_memcpy"], 0.6),
              ("same-host fetch of user tensors into new memory / memcpy", result["ratio_user_new_vs_memcpy"], 0.6),
              ("same-host fetch of user tensors on huge pages (THP_MEM_ALLOC_ENABLE=1) into preallocated / memcpy",
               result["ratio_user_thp_vs_memcpy"], 0.6),
              ("same-host fetch of user tensors on huge pages into new memory / memcpy",
               result["ratio_user_thp_new_vs_memcpy"], 0.6)]
    for what, r, want in checks:
        print(f"{what} = {r:.2f}x (target >= {want:.2f}x): {'PASS' if r >= want else 'MISS'}")
    print(f"user tensors / raw process_vm_readv (2 threads, no lease, no checksum) = "
          f"{result['ratio_user_vs_vm_raw']:.2f}x; raw process_vm_readv / memcpy = {result['ratio_vm_raw_vs_memcpy']:.2f}x "
          f"(the kernel pins the holder's pages one by one: on 4 KiB pages that is the mechanism's ceiling); "
          f"THP publisher: {thp_huge / (1 << 30):.2f} GiB on huge pages")
    print("(samehost-new reuses freed Hub memory, pages already faulted in; samehost-cold is new memory "
          "never touched, every page faulting: the machine's page-fault cost, compare memcpy-new)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return 0



# ---------------------------------------------------------------- --remote (the testbed)
def _say(**kw) -> None:
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()


def remote_publisher(argv: list[str]) -> int:  # pragma: no cover - runs in a testbed namespace
    """Holds the version in a Hub, and streams the same bytes to whoever connects to its
    TCP port (the socket baseline). Says where both are, then waits for a line on stdin."""
    import socket
    import threading

    import torch

    import tensorhub

    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--bytes", type=int, required=True)
    a = ap.parse_args(argv)
    weights = _weights(torch, a.bytes)
    hub = tensorhub.connect(a.url, worker_id="bench-publisher", locality="dc=a,zone=z,host=publisher")
    v = hub.publish("bench", weights)
    host = hub.endpoint.rsplit(":", 1)[0]
    srv = socket.create_server((host, 0))

    def stream() -> None:
        while True:
            c, _ = srv.accept()
            with c:
                for t in weights.values():
                    c.sendall(memoryview(t.numpy()).cast("B"))

    threading.Thread(target=stream, daemon=True).start()
    _say(version=v, endpoint=hub.endpoint, tcp=[host, srv.getsockname()[1]],
         addrs=[t.data_ptr() for t in weights.values()], sizes=[t.nbytes for t in weights.values()])
    sys.stdin.readline()
    hub.close()
    return 0


def remote_reader(argv: list[str]) -> int:  # pragma: no cover - runs in a testbed namespace
    """Tunes raw Mooncake, then reads the version ``--rounds`` times each way, interleaved,
    checking every read's bytes. Says the seconds (and whether every read matched)."""
    import socket

    import torch

    import tensorhub
    from mooncake.engine import TransferEngine

    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--ip", required=True)
    ap.add_argument("--rounds", type=int, required=True)
    ap.add_argument("--pub", required=True, help="the publisher's answer (JSON)")
    a = ap.parse_args(argv)
    pub = json.loads(a.pub)
    addrs, sizes, endpoint = pub["addrs"], pub["sizes"], pub["endpoint"]
    nbytes = sum(sizes)
    want = torch.cat([t.view(torch.int32) for t in _weights(torch, nbytes).values()])

    hub = tensorhub.connect(a.url, worker_id="bench-reader", locality="dc=a,zone=z,host=reader")
    hub.endpoint  # the data plane up now, not inside a timed fetch
    dst = {f"layers.{i}.weight": torch.zeros(s // 4, dtype=torch.float32) for i, s in enumerate(sizes)}
    raw = TransferEngine()
    if raw.initialize(a.ip, "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("raw Mooncake engine did not initialize")
    raw_dst = torch.zeros(nbytes // 4, dtype=torch.int32)
    if raw.register_memory(raw_dst.data_ptr(), raw_dst.nbytes) != 0:
        raise RuntimeError("raw Mooncake register_memory failed")
    tcp_dst = torch.zeros(nbytes // 4, dtype=torch.int32)
    tcp_view = memoryview(tcp_dst.numpy()).cast("B")

    loop: list[float] = []  # of each fetch: the seconds in its chunk loop (the rest: lease, release, setup)

    def t_fetch() -> float:
        t0 = time.perf_counter()
        f = hub.fetch("bench", pub["version"], into=dst, serve=False)
        dt = time.perf_counter() - t0
        loop.append(f.seconds)
        return dt

    def t_mooncake() -> float:
        return raw_read(raw, endpoint, raw_dst.data_ptr(), addrs, sizes, *tuned)

    def t_tcp() -> float:
        t0 = time.perf_counter()
        with socket.create_connection(tuple(pub["tcp"])) as c:
            got = 0
            while got < nbytes:
                n = c.recv_into(tcp_view[got:], min(nbytes - got, 8 * MiB))
                if n == 0:
                    raise RuntimeError(f"the publisher's stream ended after {got} of {nbytes} bytes")
                got += n
        return time.perf_counter() - t0

    def fetched():
        return torch.cat([t.view(torch.int32) for t in dst.values()])

    def zero_dst():
        for t in dst.values():
            t.zero_()

    flat = {"tensorhub": fetched, "mooncake": lambda: raw_dst, "tcp": lambda: tcp_dst}
    zero = {"tensorhub": zero_dst, "mooncake": raw_dst.zero_, "tcp": tcp_dst.zero_}
    cases = {"tensorhub": t_fetch, "mooncake": t_mooncake, "tcp": t_tcp}
    sweep: dict[str, float] = {}
    tuned = tune(raw, endpoint, raw_dst.data_ptr(), addrs, sizes, say=lambda m: _say(progress=m), sweep_out=sweep)
    for fn in cases.values():  # warm up connections
        fn()
    times: dict[str, list[float]] = {k: [] for k in cases}
    bad: dict[str, int] = {k: 0 for k in cases}
    names = list(cases)
    tr = hub._session.transport()
    for r in range(a.rounds):
        for k in names[r % len(names):] + names[: r % len(names)]:  # the order rotates
            zero[k]()
            times[k].append(cases[k]())
            bad[k] += not torch.equal(flat[k](), want)
        _say(progress=f"round {r + 1}: " + ", ".join(f"{k} {nbytes / times[k][-1] / 1e9:.3f} GB/s"
                                                     for k in names))
    _say(seconds=times, bad_reads=bad, tuned=list(tuned), tensorhub_loop_seconds=loop[-a.rounds:], sweep=sweep,
         samehost_copied=getattr(tr, "copied_bytes", 0))  # 0: every fetch went over the link
    hub.close()
    return 0


def remote(args: argparse.Namespace) -> int:
    """The driver: builds a two-host testbed, runs the publisher and the reader in it."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import testbed

    ok, why = testbed.available()
    if not ok:
        print(f"testbed unavailable: {why}")
        return 2
    nbytes = _size(args.gib)
    me = str(Path(__file__).resolve())
    logs = Path(args.json).parent
    logs.mkdir(parents=True, exist_ok=True)
    with testbed.Testbed({"a": 2}, host_rate=args.rate) as tb, tempfile.TemporaryDirectory() as state:
        url = tb.start_coordinator(state)
        pub_p = tb.spawn("a0", [sys.executable, me, "remote-publisher", "--url", url, "--bytes", str(nbytes)],
                         stderr=open(logs / "bench_fetch_remote.publisher.log", "w"))
        line = pub_p.stdout.readline()
        if not line:
            raise RuntimeError("the publisher exited before it published")
        pub = json.loads(line)
        rd = tb.spawn("a1", [sys.executable, me, "remote-reader", "--url", url, "--ip", tb.hosts["a1"]["ip"],
                             "--rounds", str(args.rounds), "--pub", line.strip()],
                      stderr=open(logs / "bench_fetch_remote.reader.log", "w"))
        while True:
            out = rd.stdout.readline()
            if not out:
                raise RuntimeError(f"the reader exited before it answered (see {logs}/bench_fetch_remote.reader.log)")
            got = json.loads(out)
            if "progress" not in got:
                break
            print(f"  {got['progress']}", flush=True)
        pub_p.stdin.write("done\n")
        pub_p.stdin.flush()
        pub_p.wait(30)
        rd.wait(30)
    times = got["seconds"]
    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    result = {
        "mode": "remote", "bytes": nbytes, "rounds": args.rounds, "rate": args.rate,
        "tuned": {"chunk_bytes": got["tuned"][0], "depth": got["tuned"][1]},
        "gbps": gbps, "seconds": times, "bad_reads": got["bad_reads"],
        "tensorhub_loop_seconds": got["tensorhub_loop_seconds"], "sweep_seconds": got["sweep"],
        "bytes_ok": not any(got["bad_reads"].values()),
        "over_the_link": got["samehost_copied"] == 0 and pub["endpoint"].split(":")[0] != "127.0.0.1",
        "ratio_tensorhub_vs_mooncake": gbps["tensorhub"] / gbps["mooncake"],
        "ratio_tcp_vs_mooncake": gbps["tcp"] / gbps["mooncake"],
    }
    print(f"remote: {nbytes / MiB:.0f} MiB across a {args.rate} link (tc tbf, both ways), {args.rounds} rounds, "
          f"medians; raw Mooncake tuned to {got['tuned'][0] >> 20} MiB x depth {got['tuned'][1]}")
    print(f"{'path':<18}{'GB/s':>8}{'vs raw mooncake':>18}")
    for k, g in gbps.items():
        print(f"{k:<18}{g:>8.3f}{g / gbps['mooncake']:>17.3f}x")
    lo = statistics.median(got["tensorhub_loop_seconds"])
    print(f"tensorhub: {statistics.median(times['tensorhub']) * 1e3:.1f} ms per fetch (median), {lo * 1e3:.1f} ms of "
          f"it in the chunk loop (the rest: lease, memory registration, release)")
    r = result["ratio_tensorhub_vs_mooncake"]
    print(f"tensorhub fetch / tuned raw Mooncake = {r:.3f}x (target >= 0.95x): {'PASS' if r >= 0.95 else 'MISS'}")
    print(f"bytes checked after every read: {'all matched' if result['bytes_ok'] else got['bad_reads']}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return 0 if result["bytes_ok"] and result["over_the_link"] else 1


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] in ("remote-publisher", "remote-reader"):
        return {"remote-publisher": remote_publisher, "remote-reader": remote_reader}[sys.argv[1]](sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=None, help="version size in GiB (default 1; --remote 0.25)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--remote", action="store_true",
                    help="publisher and reader on two hosts of the netns testbed, joined by a shaped link")
    ap.add_argument("--rate", default="2gbit", help="--remote: the link's rate (tc tbf), both ways")
    ap.add_argument("--json", default=None, help="default out/bench_fetch.json (--remote: bench_fetch_remote.json)")
    args = ap.parse_args()
    if args.gib is None:
        args.gib = 0.25 if args.remote else 1.0
    if args.json is None:
        args.json = "out/bench_fetch_remote.json" if args.remote else "out/bench_fetch.json"
    return remote(args) if args.remote else loopback(args)


if __name__ == "__main__":
    sys.exit(main())
