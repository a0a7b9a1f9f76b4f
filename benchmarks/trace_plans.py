"""Where the time goes under striped plans: ``benchmarks/simulate.py``'s chunk-map model
(standalone workload, the same code) with every chunk read traced.

Prints the time against the lower bound; the publisher's uplink (its first and last chunk,
how long it was busy); the tail after its last chunk; how many reads were spill-over (a
chunk read from a member that is not the reader's parent for that stripe); the wait
between a parent receiving a chunk and its child asking for it (the chunk-map and loop
delays, paid once per hop); when readers finished; and the path of the last chunk to the
last reader (reader, source, start, end, spill).

    python benchmarks/trace_plans.py --nodes 16      # 128 GPUs (~10 s); --nodes 128: 1,024
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import numpy as np

_here = Path(__file__).resolve().parent
sys.path.insert(0, str(_here.parent))
_spec = importlib.util.spec_from_file_location("simulate", _here / "simulate.py")
S = importlib.util.module_from_spec(_spec)
sys.modules["simulate"] = S  # (dataclasses look their module up)
_spec.loader.exec_module(S)


class Traced(S.MapSim):
    """The model, logging each read's start (reader, source, chunk, time, spill) and end."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.starts: dict = {}  # (reader, chunk) -> (start, source, spill)
        self.got: dict = {}  # (reader, chunk) -> end

    def _turn(self, r, now: float) -> None:
        for c, _, t in r.landed:
            self.got.setdefault((r.wid, c), t)
        super()._turn(r, now)

    def _submit_step(self, r, now: float, busy: dict) -> None:
        n0 = len(self.flows)
        super()._submit_step(r, now, busy)
        for f in self.flows[n0:]:
            spill = r.plan is not None and r.plan[f[2] % len(r.plan)] != self._rid_of(f[1])
            self.starts[(r.wid, f[2])] = (now, f[1], spill)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=16, help="nodes of 8 GPUs")
    ap.add_argument("--gib", type=float, default=16.0)
    ap.add_argument("--no-spill", action="store_true", help="members never read other stripes (SPILL off)")
    ap.add_argument("--no-hosts", action="store_true",
                    help="plans without host labels (the layout for one reader per host)")
    args = ap.parse_args()
    S.SPILL = not args.no_spill
    if args.no_hosts:
        join = S.Plan.join
        S.Plan.join = lambda self, w, rid, now, host=None: join(self, w, rid, now)
    cl = S.Cluster(nodes=args.nodes)
    nbytes = args.gib * S.GiB
    chunks = -(-int(nbytes) // S.grid_chunk_bytes(int(nbytes)))
    t0 = time.monotonic()
    sim = Traced(cl, nbytes, chunks, readers=tuple(range(cl.nodes * cl.gpus_per_node)), max_sources=4)
    out = sim.run()
    lb = S.lower_bound(cl, nbytes, 1)
    print(f"{len(sim.mreaders)} GPUs, {chunks} chunks: {out['seconds']:.4f} s, bound {lb:.4f} s "
          f"({out['seconds'] / lb:.3f}x), publisher sent {out['from_trainer_bytes'] / nbytes:.2f}x "
          f"({time.monotonic() - t0:.0f} s wall)")
    root = sorted((t, sim.got[k]) for k, (t, s, _) in sim.starts.items() if s == -1)
    busy, cur = 0.0, None
    for a, b in root:
        if cur is None or a > cur[1]:
            busy += 0 if cur is None else cur[1] - cur[0]
            cur = [a, b]
        else:
            cur[1] = max(cur[1], b)
    busy += cur[1] - cur[0]
    last = max(b for _, b in root)
    print(f"publisher: first chunk asked at {root[0][0]:.4f} s, last one done at {last:.4f} s, "
          f"busy {busy / last:.0%} of that ({nbytes / cl.nic:.4f} s of bytes)")
    print(f"tail after the publisher's last chunk: {out['seconds'] - last:.4f} s")
    spills = sum(sp for _, _, sp in sim.starts.values())
    print(f"reads {len(sim.starts)}, spill-over {spills} ({spills / len(sim.starts):.1%})")
    waits = [t - sim.got[(s, c)] for (w, c), (t, s, sp) in sim.starts.items()
             if s >= 0 and not sp and (s, c) in sim.got]
    print(f"hop wait (parent has it -> child asks): mean {np.mean(waits) * 1e3:.2f} ms, "
          f"p50 {np.median(waits) * 1e3:.2f}, p90 {np.percentile(waits, 90) * 1e3:.2f}")
    done = sorted(r.done_t for r in sim.mreaders.values())
    print("readers done at (min, p10, p50, p90, max) s:",
          ", ".join(f"{done[int(q * (len(done) - 1))]:.4f}" for q in (0, .1, .5, .9, 1)))
    lastr = max(sim.mreaders.values(), key=lambda r: r.done_t)
    c = max(range(chunks), key=lambda x: sim.got[(lastr.wid, x)])
    print(f"the last chunk ({c}, stripe {c % S.STRIPES}) to the last reader (reader, source, start, end, spill):")
    w = lastr.wid
    while w >= 0:
        t, s, sp = sim.starts[(w, c)]
        print(f"    {w:>5} <- {s:>5}  {t:.4f} {sim.got[(w, c)]:.4f}  {'spill' if sp else ''}")
        w = s
    return 0


if __name__ == "__main__":
    sys.exit(main())
