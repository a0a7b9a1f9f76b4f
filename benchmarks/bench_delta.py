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

With ``--testbed`` (root, iproute2: ``benchmarks/testbed.py``) the fetch side runs on the
emulated cluster instead: network namespaces as hosts in two datacenters joined by a
``tc``-shaped link of ``--link-mbps``, a real coordinator process, and the trainer and
readers as processes over real Mooncake. The trainer (datacenter a) publishes each version
with its delta; in datacenter b a *full* reader swaps by reading the whole version into the
copy it keeps (what an engine without deltas does), then two *delta* readers holding the
previous version swap at once through the delta. Per version it prints the bytes over the
inter-datacenter link (interface counters: data and control plane) and the swap stall (the
fetch, with the delta applied and verified; the engine's own load is the same for both),
delta vs full, side by side; every reader checks every byte it got.

    python benchmarks/bench_delta.py [--steps 300] [--every 25] [--lr 1e-5] [--master fp32|bf16]
                                     [--link-mbps 1000] [--testbed [--logs DIR]] [--json out.json]

A worker process of ``--testbed`` is this file with ``worker`` as first argument (JSON lines
on stdin/stdout).
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
sys.path.insert(0, str(Path(__file__).resolve().parent))  # testbed.py


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


# ---------------------------------------------------------------- fetch sides
def _same(got: dict, want: dict) -> bool:
    return got.keys() == want.keys() and all(bytes(_raw(got[k])) == bytes(_raw(want[k])) for k in want)


class MemorySide:
    """Embedded coordinator, in-memory transport throttled at ``link`` B/s on the trainer's
    side: a reader in datacenter b holding the previous version (through deltas), one in
    datacenter c reading in full; every source of b and c is across the slow link."""

    def __init__(self, tmp: Path, link: float) -> None:
        import tensorhub
        from tensorhub.server.state import StateConfig
        from tensorhub.coordinator import EmbeddedCoordinator
        from tensorhub.testing import InMemoryTransport

        self.what = "in-memory transport, embedded coordinator"
        self.coord = EmbeddedCoordinator(tmp / "state", config=StateConfig(lease_ttl=10.0, worker_ttl=5.0))
        self.coord.__enter__()

        def hub(name, where):
            return tensorhub.connect(self.coord.url, worker_id=name, locality=where, heartbeat_interval=0.5,
                                     transport=InMemoryTransport(bandwidth=link if where.startswith("dc=a") else None))

        self.pub, self.near, self.far = hub("trainer", "dc=a,zone=z,host=t"), hub("delta-reader", "dc=b,zone=z,host=d"), \
            hub("full-reader", "dc=c,zone=z,host=f")

    def first(self, snap: dict) -> int:
        v = self.pub.publish("policy", snap)
        self.near.fetch("policy", v)
        return v

    def publish(self, snap: dict, base: int) -> tuple[int, bool]:
        from tensorhub import _delta_path

        nv = self.pub.publish("policy", snap, base=base)
        return nv, ("policy", nv, _delta_path.delta_layout(base), 0) in self.pub.held()

    def round(self, nv: int, snap: dict) -> dict:
        t0 = time.perf_counter()
        fd = self.near.fetch("policy", nv)
        td = time.perf_counter() - t0
        assert _same(fd, snap)
        t0 = time.perf_counter()
        ff = self.far.fetch("policy", nv, serve=False)
        tf = time.perf_counter() - t0
        assert ff.delta is None and _same(ff, snap)
        return {"td": td, "tf": tf, "x_delta": fd.nbytes, "x_full": ff.nbytes, "delta_used": fd.delta is not None}

    def retire(self, v: int) -> None:
        self.near.unpublish("policy", v)
        self.pub.unpublish("policy", v)

    def close(self) -> None:
        for h in (self.near, self.far, self.pub):
            h.close()
        self.coord.__exit__(None, None, None)


class TestbedSide:
    """The netns testbed (see the module docstring): trainer in datacenter a; in b a full
    reader and two delta readers; a real coordinator process; Mooncake between processes."""

    def __init__(self, tmp: Path, link_mbps: float) -> None:
        import testbed

        ok, why = testbed.available()
        if not ok:
            raise SystemExit(f"--testbed: {why}")
        self.tmp = tmp
        self.tb = testbed.Testbed({"a": 1, "b": 3}, host_rate="1gbit", xdc_rate=f"{link_mbps:g}mbit")
        self.tb.up()
        (tmp / "state").mkdir()
        url = self.tb.start_coordinator(str(tmp / "state"))
        self.trainer = _Proc(self.tb, "a0", url, tmp)
        self.full = _Proc(self.tb, "b0", url, tmp)
        self.deltas = [_Proc(self.tb, f"b{k}", url, tmp) for k in (1, 2)]
        self.what = (f"netns testbed: trainer in dc a, 1 full + 2 delta readers in dc b, {link_mbps:g} Mbit/s "
                     f"between, 1 Gbit/s hosts; logs in {tmp}")

    def _save(self, v: int, snap: dict) -> str:
        from safetensors.torch import save_file

        path = str(self.tmp / f"v{v}.safetensors")
        save_file(snap, path)
        return path

    def first(self, snap: dict) -> int:
        path = self._save(0, snap)
        v = self.trainer.call(op="publish", path=path)["version"]
        for r in [self.full, *self.deltas]:  # the base every delta reader holds; the full reader's kept copy
            assert r.call(op="fetch", version=v, path=path, mode="full" if r is self.full else "delta")["bytes_ok"]
        return v

    def publish(self, snap: dict, base: int) -> tuple[int, bool]:
        self.path = self._save(base + 1, snap)
        r = self.trainer.call(op="publish", path=self.path, base=base)
        return r["version"], r["delta"]

    def _xdc(self) -> int:
        return self.tb.xdc_bytes()["forward"]

    def round(self, nv: int, snap: dict) -> dict:
        x0 = self._xdc()
        f = self.full.call(op="fetch", version=nv, path=self.path, mode="full")
        x1 = self._xdc()
        for r in self.deltas:  # both at once: the delta crosses once, the second reader reads it in b
            r.send(op="fetch", version=nv, path=self.path, mode="delta")
        ds = [r.recv() for r in self.deltas]
        x2 = self._xdc()
        assert f["bytes_ok"] and all(d["bytes_ok"] for d in ds), "a reader got wrong bytes"
        assert f["delta"] is None
        used = all(d["delta"] is not None for d in ds)
        return {"td": max(d["seconds"] for d in ds), "tf": f["seconds"], "x_delta": x2 - x1, "x_full": x1 - x0,
                "delta_used": used}

    def retire(self, v: int) -> None:
        for r in [self.trainer, *self.deltas]:
            r.call(op="unpublish", versions=[v])
        (self.tmp / f"v{v}.safetensors").unlink(missing_ok=True)

    def close(self) -> None:
        for r in [self.trainer, self.full, *self.deltas]:
            try:
                r.call(op="exit")
            except Exception:  # noqa: BLE001 - the testbed kills what is left
                pass
        self.tb.close()


class _Proc:
    """Driver-side handle of a worker process in the testbed."""

    def __init__(self, tb, host: str, url: str, logs: Path) -> None:
        self.name = host
        loc = f"dc={tb.hosts[host]['dc']},zone=z,host={host}"
        self.p = tb.spawn(host, [sys.executable, __file__, "worker", "--url", url, "--name", host, "--locality", loc],
                          stderr=open(logs / f"{host}.log", "a"))
        self.recv()

    def send(self, **cmd) -> None:
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()

    def recv(self):
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.name} exited")
        msg = json.loads(line)
        if "error" in msg:
            raise RuntimeError(f"worker {self.name}: {msg['error']}")
        return msg["ok"]

    def call(self, **cmd):
        self.send(**cmd)
        return self.recv()


def worker(argv: list[str]) -> int:  # pragma: no cover - runs in a testbed namespace
    """A trainer or reader of ``--testbed``: JSON lines on stdin, answers on stdout."""
    ap = argparse.ArgumentParser()
    for k in ("--url", "--name", "--locality"):
        ap.add_argument(k, required=True)
    a = ap.parse_args(argv)
    import logging

    from safetensors.torch import load_file

    import tensorhub
    from tensorhub import _delta_path

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    hub = tensorhub.connect(a.url, worker_id=a.name, locality=a.locality, heartbeat_interval=1.0)
    hub.endpoint  # start the data plane now, not inside a timed fetch
    held: dict[int, dict] = {}
    spare = None

    def say(**kw) -> None:
        sys.stdout.write(json.dumps(kw) + "\n")
        sys.stdout.flush()

    say(ok="ready")
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            op = cmd["op"]
            if op == "publish":
                w = {k: t.contiguous() for k, t in load_file(cmd["path"]).items()}
                base = cmd.get("base")
                v = hub.publish("policy", w, base=base)
                held[v] = w
                say(ok={"version": v, "delta": base is not None and
                        ("policy", v, _delta_path.delta_layout(base), 0) in hub.held()})
            elif op == "fetch":
                t0 = time.perf_counter()
                if cmd["mode"] == "delta":  # holds the previous version: the Hub reads through its delta
                    f = hub.fetch("policy", cmd["version"])
                    held[f.version] = f
                else:  # read in full into the copy this reader keeps (serves nothing)
                    f = hub.fetch("policy", cmd["version"], serve=False, into=spare)
                    spare = f if spare is None else spare
                seconds = time.perf_counter() - t0
                want = load_file(cmd["path"])
                say(ok={"seconds": seconds, "nbytes": f.nbytes, "sources": f.sources, "bytes_ok": _same(f, want),
                        "delta": None if f.delta is None else f.delta.steps, "skipped": f.delta_skipped})
            elif op == "unpublish":
                for v in [v for v in held if v in cmd["versions"]]:
                    hub.unpublish("policy", v, timeout=30)
                    held.pop(v, None)
                say(ok=True)
            elif op == "exit":
                hub.close()
                say(ok=True)
                return 0
        except Exception as e:  # noqa: BLE001 - reported to the driver
            say(error=f"{type(e).__name__}: {e}")
    return 0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        return worker(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=25)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--master", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--link-mbps", type=float, default=1000.0, help="inter-datacenter link (Mbit/s)")
    p.add_argument("--testbed", action="store_true",
                   help="fetch side on the netns testbed (root): real coordinator, processes, Mooncake, tc link")
    p.add_argument("--logs", type=Path, help="--testbed: keep the workers' logs in this (existing, empty) folder")
    p.add_argument("--json", type=Path)
    a = p.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import rl_task
    from tensorhub import _delta, _delta_path

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
    with tempfile.TemporaryDirectory() as tmp:
        side = TestbedSide(a.logs or Path(tmp), a.link_mbps) if a.testbed else MemorySide(Path(tmp), link)
        try:
            snap = snapshot()
            v = side.first(snap)
            full = sum(t.numel() * t.element_size() for t in snap.values())
            print(f"tiny Llama: {full / 1e6:.2f} MB in bf16, {len(snap)} tensors; AdamW lr {a.lr:g}, "
                  f"{a.master} master weights; publish every {a.every} steps; link {a.link_mbps:g} Mbit/s; "
                  f"{side.what}")
            print(f"{'ver':>4} {'step':>5} {'loss':>6} {'changed':>8} {'delta/full':>10} {'sparse':>8} "
                  f"{'sp+zlib':>8} {'xor+zlib':>8} {'enc GB/s':>8} {'app GB/s':>8} {'stall delta':>11} "
                  f"{'stall full':>10} {'x-dc delta':>10} {'x-dc full':>10}")
            step, loss = 0, float("nan")
            prev = snap
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
                snap = snapshot()
                changed = sum(int(_delta.changed(_raw(prev[k]), _raw(snap[k]), 2).size) for k in snap)
                elems = sum(t.numel() for t in snap.values())
                modes = modes_of(prev, snap)
                ordered = {k: prev[k] for k in snap}
                base = _delta_path.BaseCopy(v, ordered, _delta_path._sums(list(ordered.values())))
                t0 = time.perf_counter()
                blobs, _, st = _delta_path.encode_tensors(snap, base, model="policy", version=v + 1, layout="hf",
                                                          shard=0, num_shards=1)
                enc = time.perf_counter() - t0
                # apply speed: the delta's blobs applied to a copy of the base, one core
                work = {k: t.clone() for k, t in prev.items()}
                t0 = time.perf_counter()
                for k in snap:
                    _delta.apply(_raw(work[k]), _raw(blobs[k]))
                app = time.perf_counter() - t0
                assert all(bytes(_raw(work[k])) == bytes(_raw(snap[k])) for k in snap)
                nv, published = side.publish(snap, v)
                r = side.round(nv, snap)
                assert r["delta_used"] == published, "a published delta was not used, or none was"
                side.retire(v)
                row = {"version": nv, "step": step, "loss": loss, "changed": changed / elems,
                       "delta": st.nbytes / full, "modes": {m: n / full for m, n in modes.items()},
                       "encode_gbps": full / enc / 1e9, "apply_gbps": full / app / 1e9,
                       "delta_fetch_s": r["td"], "full_fetch_s": r["tf"], "xdc_delta": r["x_delta"] / full,
                       "xdc_full": r["x_full"] / full, "chosen": st.modes}
                rows.append(row)
                print(f"{nv:>4} {step:>5} {loss:>6.3f} {100 * row['changed']:>7.2f}% {100 * row['delta']:>9.2f}% "
                      + " ".join(f"{100 * modes[m] / full:>7.2f}%" for m in ("sparse", "sparse+zlib", "xor+zlib"))
                      + f" {row['encode_gbps']:>8.2f} {row['apply_gbps']:>8.2f} {1000 * r['td']:>9.1f}ms "
                      + f"{1000 * r['tf']:>8.1f}ms {100 * row['xdc_delta']:>9.2f}% {100 * row['xdc_full']:>9.2f}%",
                      flush=True)
                v, prev = nv, snap
        finally:
            side.close()
    med = {k: statistics.median(r[k] for r in rows) for k in ("changed", "delta", "encode_gbps", "apply_gbps",
                                                              "delta_fetch_s", "full_fetch_s", "xdc_delta", "xdc_full")}
    print(f"median over {len(rows)} versions: {100 * med['changed']:.2f}% of elements changed, delta "
          f"{100 * med['delta']:.2f}% of full, encode {med['encode_gbps']:.2f} GB/s, apply {med['apply_gbps']:.2f} "
          f"GB/s, swap stall {1000 * med['delta_fetch_s']:.1f} ms (delta) vs {1000 * med['full_fetch_s']:.1f} ms (full), "
          f"inter-datacenter bytes {med['xdc_delta']:.3f}x the version (full: {med['xdc_full']:.3f}x)")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "rows": rows,
                                      "median": med}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
