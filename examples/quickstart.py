"""TensorHub in one minute, no inference engine: an embedded coordinator, a publisher, two readers.

The publisher (think: trainer) publishes a new version of ``policy`` every round; two
reader processes (think: rollout engines) wait for each version, fetch it over Mooncake
(TCP on loopback) from whoever holds it, check every byte, and serve it onward. Before
reusing its buffer the publisher unpublishes the version before last (which waits for
readers to drain). The demo prints, per version and reader, where the bytes came from
and how fast, then the coordinator's view.

    python examples/quickstart.py [--versions 3] [--mib 256]
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import sys
import tempfile
import time

os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's log chatter

MODEL = "policy"


def weights_for(version_seed: int, mib: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(version_seed)
    n = 8
    per = (mib << 20) // n // 4
    return {f"model.layers.{i}.mlp.weight": torch.randn(per, generator=g).view(64, -1) for i in range(n)}


def checksum(tensors: dict) -> str:
    import torch

    h = hashlib.sha256()
    for k in sorted(tensors):
        h.update(tensors[k].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def publisher(url: str, versions: int, mib: int, q, done) -> None:
    os.environ.setdefault("GLOG_minloglevel", "2")
    import tensorhub

    with tensorhub.connect(url, worker_id="trainer") as hub:
        live: list[int] = []
        for step in range(versions):
            w = weights_for(step, mib)  # "a few optimizer steps" later
            v = hub.publish(MODEL, w)
            q.put(("published", v, checksum(w)))
            live.append(v)
            if len(live) > 2:  # keep two versions in memory; unpublish waits for readers
                old = live.pop(0)
                t0 = time.monotonic()
                hub.unpublish(MODEL, old, timeout=60)
                q.put(("unpublished", old, time.monotonic() - t0))
            time.sleep(1.0)  # training time between versions
        q.put(("trainer-done", None, None))
        done.wait(300)  # stay a source until every reader has its versions (a slow machine may take long)


def reader(url: str, name: str, versions: int, delay: float, q, done) -> None:
    os.environ.setdefault("GLOG_minloglevel", "2")
    import tensorhub

    with tensorhub.connect(url, worker_id=name) as hub:
        seen, params = 0, None
        for _ in range(versions):
            v = hub.wait_for_version(MODEL, newer_than=seen, timeout=120)
            time.sleep(delay)  # engines notice at different times; latecomers read from peers too
            if params is not None:
                hub.unpublish(MODEL, seen, timeout=60)  # readers of our copy drain first...
            # ... then overwrite our weights in place; serve=True makes us a source of v
            out = hub.fetch(MODEL, v, into=params)
            params = dict(out)
            q.put(("fetched", name, (v, checksum(out), out.nbytes, out.seconds, dict(out.sources))))
            seen = v
        done.wait(300)  # and serve our copies to the other reader until it is done too


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--mib", type=int, default=256, help="size of each version in MiB")
    args = ap.parse_args()

    from tensorhub.cli import format_status
    from tensorhub.coordinator import EmbeddedCoordinator

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    done = ctx.Event()  # set once every fetch was reported: then the workers may leave
    with tempfile.TemporaryDirectory() as state, EmbeddedCoordinator(state) as coord:
        print(f"coordinator (embedded) on {coord.url}")
        procs = [ctx.Process(target=publisher, args=(coord.url, args.versions, args.mib, q, done))]
        procs += [ctx.Process(target=reader, args=(coord.url, f"engine-{i}", args.versions, 0.4 * i, q, done))
                  for i in range(2)]
        for p in procs:
            p.start()
        sums: dict[int, str] = {}
        rows = []
        ok = True
        pending = 1 + 2 * args.versions
        try:
            while pending:
                kind, a, b = q.get(timeout=300)
                if kind == "published":
                    sums[a] = b
                    print(f"trainer  published v{a} ({args.mib} MiB, sha256 {b})")
                elif kind == "unpublished":
                    print(f"trainer  unpublished v{a} after {b:.2f}s drain")
                elif kind == "trainer-done":
                    pending -= 1
                elif kind == "fetched":
                    v, digest, nbytes, secs, sources = b
                    good = digest == sums.get(v)
                    ok &= good
                    src = ", ".join(f"{w} {n / 2**20:.0f} MiB" for w, n in sources.items())
                    print(f"{a} fetched  v{v} {nbytes / 2**20:.0f} MiB in {secs:.2f}s "
                          f"({nbytes / secs / 1e9:.2f} GB/s) from [{src}] bytes {'OK' if good else 'WRONG'}")
                    rows.append((v, a, nbytes, secs, src))
                    pending -= 1
            print()
            print(format_status(coord.coordinator.state.status(time.time())))
        finally:
            done.set()
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
    print()
    print(f"{'version':<9}{'reader':<10}{'MiB':>6}{'GB/s':>7}  sources")
    for v, name, nbytes, secs, src in rows:
        print(f"v{v:<8}{name:<10}{nbytes / 2**20:>6.0f}{nbytes / secs / 1e9:>7.2f}  {src}")
    print("all bytes verified" if ok else "BYTE MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
