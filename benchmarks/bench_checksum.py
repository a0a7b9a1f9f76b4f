"""What end-to-end checksums cost: hash speed, publish cost, and fetch time with and without.

In one run:

1. **Hash candidates**: GB/s of one core over a CPU buffer read in place (the way
   ``tensorhub._checksum`` reads it: a memoryview over the address, one call per grid
   chunk): xxh3_64 (the default), xxh64, CRC32C (``crc32c``), ``google-crc32c`` (it only
   takes ``bytes``: the copy is counted), ``zlib.crc32``; memcpy for scale. Packages not
   installed are skipped.
2. **Publish cost**: ``_checksum.compute`` over the version's tensors (what ``Hub.publish``
   adds). With a CUDA device, the same tensors in GPU memory under ``checksum="on"`` (each
   piece copied to a pinned host buffer, then hashed); without one, that line says so.
3. **Fetch, checksums on vs off**: one publisher process holds a version (default 1 GiB)
   with checksums; two readers in this process fetch it ``into`` preallocated tensors,
   interleaved round by round: ``checksum="auto"`` (verifies every chunk) and
   ``checksum="off"`` (ignores the checksums). Prints GB/s (medians), the time spent
   hashing as a share of the verified fetch, and the slowdown.

    python benchmarks/bench_checksum.py [--gib 1] [--rounds 5] [--plain] [--json out/bench_checksum.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
import zlib
from pathlib import Path

os.environ.setdefault("GLOG_minloglevel", "2")


def weights_of(nbytes: int) -> dict:
    import torch

    n = 16
    per = nbytes // n // 4
    return {f"layers.{i}.weight": torch.arange(per, dtype=torch.int32).add_(i * 7919).view(torch.float32)
            for i in range(n)}


def publisher(url: str, nbytes: int, conn) -> None:  # pragma: no cover - child process
    os.environ.setdefault("GLOG_minloglevel", "2")
    import tensorhub

    weights = weights_of(nbytes)
    hub = tensorhub.connect(url, worker_id="bench-publisher", checksum="auto")
    t0 = time.perf_counter()
    v = hub.publish("bench", weights)
    conn.send((v, time.perf_counter() - t0))
    conn.recv()  # wait until the reader is done
    hub.close()


def hash_table(nbytes: int, chunk: int, rounds: int) -> dict[str, float]:
    """GB/s per candidate over ``nbytes`` of CPU memory, ``chunk`` bytes per call."""
    import numpy as np

    buf = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    mv = memoryview((ctypes.c_char * nbytes).from_address(buf.ctypes.data)).cast("B")
    scratch = np.empty(chunk, dtype=np.uint8)
    cands = {}
    try:
        import xxhash

        cands["xxh3_64"] = xxhash.xxh3_64_intdigest
        cands["xxh64"] = xxhash.xxh64_intdigest
    except ImportError:
        pass
    try:
        import crc32c

        cands["crc32c"] = crc32c.crc32c
    except ImportError:
        pass
    try:
        import google_crc32c

        cands["google-crc32c (+copy)"] = lambda b: google_crc32c.value(bytes(b))
    except ImportError:
        pass
    cands["zlib.crc32"] = zlib.crc32
    cands["memcpy (scale)"] = lambda b: np.copyto(scratch[:len(b)], np.frombuffer(b, dtype=np.uint8))
    out = {}
    for name, fn in cands.items():
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            for o in range(0, nbytes, chunk):
                fn(mv[o:o + chunk])
            best = min(best, time.perf_counter() - t0)
        out[name] = nbytes / best / 1e9
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="version size in GiB")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--plain", action="store_true", help="plain reads (default: pipelined, the Hub's default)")
    ap.add_argument("--json", default="out/bench_checksum.json")
    args = ap.parse_args()

    import torch

    import tensorhub
    from tensorhub import _checksum
    from tensorhub._planner import grid_chunk_bytes
    from tensorhub.coordinator import EmbeddedCoordinator

    nbytes = int(args.gib * (1 << 30)) // (16 * 4) * 16 * 4
    grid = grid_chunk_bytes(nbytes)

    # 1. candidates
    table = hash_table(min(nbytes, 256 << 20), grid, 3)
    print(f"hash speed, one core, {grid >> 20} MiB per call (best of 3), GB/s:")
    for k, g in table.items():
        print(f"  {k:<24}{g:>7.2f}")

    # 2. publish cost (in this process, on the same tensors the publisher holds)
    w = weights_of(nbytes)
    t0 = time.perf_counter()
    _checksum.compute(list(w.values()), "on")
    t_compute = time.perf_counter() - t0
    sizes = [t.nbytes for t in w.values()]
    print(f"publish: checksums of {nbytes / 1e9:.2f} GB of CPU tensors in {t_compute:.3f}s "
          f"({nbytes / t_compute / 1e9:.2f} GB/s)")
    cuda_gbps = None
    if torch.cuda.is_available():
        wc = [t.cuda() for t in w.values()]
        _checksum.compute(wc, "on")  # warm up (pinned staging buffer)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        cuda_sums = _checksum.compute(wc, "on")
        cuda_gbps = nbytes / (time.perf_counter() - t0) / 1e9
        assert cuda_sums == _checksum.compute(list(w.values()), "on"), "CUDA and CPU checksums differ"
        print(f"publish: the same in CUDA memory (checksum='on', device-to-host copy + hash): {cuda_gbps:.2f} GB/s")
        del wc
    else:
        print("publish: no CUDA device here: the CUDA path (checksum='on') is not measured")
    del w

    # 3. fetch on vs off, interleaved
    checks: list = []
    real = _checksum.verifier

    def spy(*a, **kw):
        v = real(*a, **kw)
        if v is not None:
            checks.append(v)
        return v

    import tensorhub._fetch as fetch_mod

    fetch_mod.verifier = spy  # count the verified bytes and seconds (the one read path)
    pipelined = not args.plain
    with tempfile.TemporaryDirectory() as state, EmbeddedCoordinator(state) as coord:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=publisher, args=(coord.url, nbytes, child), daemon=True)
        proc.start()
        version, t_publish = parent.recv()
        on = tensorhub.connect(coord.url, worker_id="reader-on", checksum="auto", pipelined=pipelined)
        off = tensorhub.connect(coord.url, worker_id="reader-off", checksum="off", pipelined=pipelined)
        dst = {f"layers.{i}.weight": torch.zeros(s // 4, dtype=torch.float32) for i, s in enumerate(sizes)}
        dst_off = {k: torch.zeros_like(t) for k, t in dst.items()}

        def t_fetch(hub, into) -> float:
            t0 = time.perf_counter()
            hub.fetch("bench", version, into=into, serve=False)
            return time.perf_counter() - t0

        cases = {"checksums off": lambda: t_fetch(off, dst_off), "checksums on": lambda: t_fetch(on, dst)}
        for fn in cases.values():  # warm up connections and page tables
            fn()
        checks.clear()
        times: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(args.rounds):
            for k, fn in cases.items():
                times[k].append(fn())
        want = weights_of(nbytes)
        for k in want:  # the bytes really moved
            assert torch.equal(dst[k].view(torch.int32), want[k].view(torch.int32)), k
            assert torch.equal(dst_off[k].view(torch.int32), want[k].view(torch.int32)), k
        parent.send("done")
        proc.join(30)
        on.close()
        off.close()

    med = {k: statistics.median(v) for k, v in times.items()}
    gbps = {k: nbytes / s / 1e9 for k, s in med.items()}
    hashed = sum(v.nbytes for v in checks)
    hash_s = sum(v.seconds for v in checks)
    assert hashed == args.rounds * nbytes, (hashed, args.rounds * nbytes)
    per_fetch = hash_s / args.rounds
    share = per_fetch / med["checksums on"]
    slowdown = med["checksums on"] / med["checksums off"] - 1
    print(f"fetch ({'plain' if args.plain else 'pipelined'}) of {nbytes / (1 << 30):.2f} GiB over loopback "
          f"Mooncake, {args.rounds} rounds interleaved, medians:")
    for k, g in gbps.items():
        print(f"  {k:<16}{g:>7.2f} GB/s  {med[k]:.3f}s")
    print(f"  verifying: {per_fetch:.3f}s per fetch ({nbytes / per_fetch / 1e9 if per_fetch else 0:.1f} GB/s) "
          f"= {share:.1%} of the verified fetch; fetch time {slowdown:+.1%} vs off")
    print(f"  publish with checksums (publisher process, incl. registration): {t_publish:.3f}s")
    result = {
        "bytes": nbytes, "grid_chunk_bytes": grid, "rounds": args.rounds, "pipelined": pipelined,
        "hash_gbps": table, "publish_compute_seconds": t_compute, "publish_compute_gbps": nbytes / t_compute / 1e9,
        "cuda_compute_gbps": cuda_gbps, "publish_seconds": t_publish,
        "fetch_gbps": gbps, "fetch_seconds": times, "verify_seconds_per_fetch": per_fetch,
        "verify_share_of_fetch": share, "fetch_slowdown": slowdown,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
