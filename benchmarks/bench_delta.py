"""Delta versions on a real training run: how much changes, what a delta costs, what it saves.

A tiny Llama (examples/rl_task.py's config and counting task; random init, seeded, no
download) trains with AdamW; every ``--every`` optimizer steps the trainer publishes the
weights in bf16 with ``base=`` the previous version (``Hub.publish(..., base=v)``). Two
weight regimes (``--master``): ``fp32`` (default; fp32 master weights, bf16 copies
published, as mixed-precision trainers do) and ``bf16`` (the parameters themselves are
bf16, AdamW updates them in bf16).

Per version it prints: the fraction of bytes (bf16 elements) that changed bit-wise; the
delta's size / the full size; what each encoding would have cost (plain sparse indices +
values, sparse + zlib, XOR + zlib: ``tensorhub._delta``'s measurement behind its choice);
encode and apply GB/s (over the full version's bytes, one core); and, side by side, the
fetch time of a reader in datacenter b holding the previous version (delta path) and of
one in datacenter c without it (full read), with the bytes each moved over the inter-datacenter
link (throttled in-memory transport, ``--link-mbps``; embedded coordinator).

    python benchmarks/bench_delta.py [--steps 300] [--every 25] [--lr 1e-5] [--master fp32|bf16]
                                     [--link-mbps 1000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GLOG_minloglevel", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


def _raw(t):
    return t.reshape(-1).view(__import__("torch").uint8).numpy()


def modes_of(prev: dict, snap: dict) -> dict:
    """Bytes of each encoding mode alone, over all tensors (the measurement behind the choice)."""
    from tensorhub import _delta

    out = {}
    for mode in (_delta.SPARSE, _delta.SPARSE_Z, _delta.XOR_Z):
        out[_delta.MODES[mode]] = sum(len(_delta.encode(_raw(prev[k]), _raw(snap[k]), 2, modes=(mode,)).blob)
                                      for k in snap)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=25)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--master", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--link-mbps", type=float, default=1000.0, help="inter-datacenter link (Mbit/s)")
    p.add_argument("--json", type=Path)
    a = p.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import rl_task
    import tensorhub
    from tensorhub import _delta, _delta_path
    from tensorhub._state import StateConfig
    from tensorhub.coordinator import EmbeddedCoordinator
    from tensorhub.testing import InMemoryTransport

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = LlamaConfig(**{k: v for k, v in rl_task.config_dict().items() if k not in ("architectures", "dtype")})
    model = LlamaForCausalLM(cfg).to(torch.float32 if a.master == "fp32" else torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    g = torch.Generator().manual_seed(1)
    link = a.link_mbps * 1e6 / 8

    def snapshot() -> dict:
        return {n: t.detach().to(torch.bfloat16).clone().contiguous() for n, t in model.state_dict().items()}

    rows = []
    with tempfile.TemporaryDirectory() as tmp, \
            EmbeddedCoordinator(Path(tmp) / "state", config=StateConfig(lease_ttl=10.0, worker_ttl=5.0)) as coord:
        def hub(name, where):
            return tensorhub.connect(coord.url, worker_id=name, locality=where, heartbeat_interval=0.5,
                                     transport=InMemoryTransport(bandwidth=link if where.startswith("dc=a") else None))

        pub, near, far = hub("trainer", "dc=a,zone=z,host=t"), hub("delta-reader", "dc=b,zone=z,host=d"), \
            hub("full-reader", "dc=c,zone=z,host=f")
        held = {}
        snap = snapshot()
        v = pub.publish("policy", snap)
        held[v] = snap
        near.fetch("policy", v)
        full = sum(t.numel() * t.element_size() for t in snap.values())
        print(f"tiny Llama: {full / 1e6:.2f} MB in bf16, {len(snap)} tensors; AdamW lr {a.lr:g}, "
              f"{a.master} master weights; publish every {a.every} steps; link {a.link_mbps:g} Mbit/s")
        hdr = (f"{'ver':>4} {'step':>5} {'loss':>6} {'changed':>8} {'delta/full':>10} {'sparse':>8} {'sp+zlib':>8} "
               f"{'xor+zlib':>8} {'enc GB/s':>8} {'app GB/s':>8} {'delta fetch':>11} {'full fetch':>10} "
               f"{'x-dc delta':>10} {'x-dc full':>10}")
        print(hdr)
        step, loss = 0, float("nan")
        while step < a.steps:
            model.train()
            for _ in range(a.every):
                starts = torch.randint(0, rl_task.WORDS, (rl_task.BATCH,), generator=g).tolist()
                strides = torch.randint(1, rl_task.STRIDES + 1, (rl_task.BATCH,), generator=g).tolist()
                batch = torch.tensor(rl_task.counting(starts, strides, rl_task.SEQ))
                out = model(input_ids=batch, labels=batch)
                opt.zero_grad()
                out.loss.backward()
                opt.step()
                loss = out.loss.item()
                step += 1
            prev = held[v]
            snap = snapshot()
            changed = sum(int(_delta.changed(_raw(prev[k]), _raw(snap[k]), 2).size) for k in snap)
            elems = sum(t.numel() for t in snap.values())
            modes = modes_of(prev, snap)
            base = _delta_path.check_base(pub._session, pub._holdings, "policy", snap, v, None, "hf", 0)
            t0 = time.perf_counter()
            _, _, st = _delta_path.encode_tensors(snap, base, model="policy", version=v + 1, layout="hf", shard=0,
                                                  num_shards=1)
            enc = time.perf_counter() - t0
            nv = pub.publish("policy", snap, base=v)
            held[nv] = snap
            published = ("policy", nv, _delta_path.delta_layout(v), 0) in pub.held()
            dbytes = st.nbytes  # what the delta is (published only below MAX_FRACTION of the version)
            # apply speed: the delta's blobs applied to a copy of the base, one core
            blobs, _, _ = _delta_path.encode_tensors(snap, base, model="policy", version=nv, layout="hf", shard=0,
                                                     num_shards=1)
            work = {k: t.clone() for k, t in prev.items()}
            t0 = time.perf_counter()
            for k in snap:
                _delta.apply(_raw(work[k]), _raw(blobs[k]))
            app = time.perf_counter() - t0
            assert all(bytes(_raw(work[k])) == bytes(_raw(snap[k])) for k in snap)
            t0 = time.perf_counter()
            fd = near.fetch("policy", nv)
            td = time.perf_counter() - t0
            assert (fd.delta is not None) == published, "a published delta was not used, or none was"
            assert all(bytes(_raw(fd[k])) == bytes(_raw(snap[k])) for k in snap)
            t0 = time.perf_counter()
            ff = far.fetch("policy", nv, serve=False)
            tf = time.perf_counter() - t0
            assert ff.delta is None
            x_delta, x_full = fd.nbytes, ff.nbytes  # every source of b and c is in another datacenter
            near.unpublish("policy", v)
            if v in held and v != nv:
                pub.unpublish("policy", v)
                del held[v]
            row = {"version": nv, "step": step, "loss": loss, "changed": changed / elems, "delta": dbytes / full,
                   "modes": {m: n / full for m, n in modes.items()}, "encode_gbps": full / enc / 1e9,
                   "apply_gbps": full / app / 1e9, "delta_fetch_s": td, "full_fetch_s": tf,
                   "xdc_delta": x_delta / full, "xdc_full": x_full / full, "chosen": st.modes}
            rows.append(row)
            print(f"{nv:>4} {step:>5} {loss:>6.3f} {100 * row['changed']:>7.2f}% {100 * row['delta']:>9.2f}% "
                  + " ".join(f"{100 * modes[m] / full:>7.2f}%" for m in ("sparse", "sparse+zlib", "xor+zlib"))
                  + f" {row['encode_gbps']:>8.2f} {row['apply_gbps']:>8.2f} {1000 * td:>9.1f}ms {1000 * tf:>8.1f}ms"
                  + f" {100 * row['xdc_delta']:>9.2f}% {100 * row['xdc_full']:>9.2f}%")
            v = nv
        for h in (near, far, pub):
            h.close()
    med = {k: statistics.median(r[k] for r in rows) for k in ("changed", "delta", "encode_gbps", "apply_gbps",
                                                              "delta_fetch_s", "full_fetch_s", "xdc_delta")}
    print(f"median over {len(rows)} versions: {100 * med['changed']:.2f}% of elements changed, delta "
          f"{100 * med['delta']:.2f}% of full, encode {med['encode_gbps']:.2f} GB/s, apply {med['apply_gbps']:.2f} "
          f"GB/s, fetch {1000 * med['delta_fetch_s']:.1f} ms (delta) vs {1000 * med['full_fetch_s']:.1f} ms (full), "
          f"inter-datacenter bytes {med['xdc_delta']:.3f}x the version")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "rows": rows,
                                      "median": med}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
