"""The GPU check (issue 18): CUDA memory through Mooncake, the engine-native layout, figures.

Run through ``scripts/gpu_check.sh`` (which installs the carried wheels and finds the
libraries first); by hand: ``python benchmarks/gpu_check.py run --out DIR``.

What it does, on one CUDA GPU (on a machine without one, the same steps on CPU tensors,
after saying so; exit 0 when they pass):

1. **Wheels**: when ``gpu_wheels/`` exists, pip resolves the requirements offline from it
   for every CPython the device may have (``--dry-run``), and the slim Mooncake wheel of
   this Python is unpacked and ``ldd``-checked (only CUDA's own libraries may be missing).
2. **Data plane**, per Mooncake protocol (TCP with ``MC_FORCE_TCP=1``; the intra-node
   NVLink transport with ``MC_INTRANODE_NVLINK=1`` when the wheel has it): a real coordinator
   process; holder A publishes tensors of float32, bfloat16, float16, int64, float8_e4m3fn
   and float8_e5m2 from device memory; reader B fetches them into preallocated device
   tensors, into host memory (the default destination) and into new device tensors (and
   then serves them); reader C reads from A and B at once (striped). Every fetch is
   compared byte for byte on the device (``torch.equal`` on uint8 views).
3. **Engine-native layout** (``tensorhub/integrations/vllm/_native.py`` on a small torch module, no
   vLLM): a trainer publishes ``hf`` v1; engine E1 loads it and registers its parameters in
   place; engine E2 starts raw from E1's native shard; the trainer publishes v2; E2 holds a
   lease on E1's v1 while E1 swaps, and E1 must not write its parameters before E2
   released it (the drain rule); E2 then swaps raw to v2. Bytes checked on the device.
4. **Same-host CUDA IPC** (``tensorhub/transport/_cudaipc.py``; GPU only, skipped with the
   reason on CPU): holder H publishes many CUDA tensors allocated one by one by torch's
   caching allocator (hundreds of small ones share each 2 MiB block segment, medium ones
   share 20 MiB segments, large ones have their own); reader R on the same host (its Hub's
   own transport: the same-host wrapper is on) fetches them into preallocated device
   tensors and into host memory. Bytes compared on the device; R's transport must have
   copied every byte through CUDA IPC (``cuda_bytes``), none over Mooncake, and have
   closed every block once the reads ended. The other steps run with
   ``TENSORHUB_SAMEHOST=0``, so their figures stay Mooncake's.
5. **Figures**: GB/s of every path next to torch's device-to-device, host-to-device and
   device-to-host copies (CPU: a host memcpy), as ``gpu_check.json`` and ``gpu_check.txt``;
   the CUDA IPC paths next to torch's device-to-device copy of the same bytes.

Any failed step ends with ``GPU CHECK FAILED: ...`` and exit 1. The NVLink transport is a
probe: when the wheel lacks it, or TensorHub's transport cannot run on it, the reason is
printed and recorded, and the check goes on.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from _gpu_carry import (MOONCAKE_DIST, MOONCAKE_VERSION, REQUIREMENTS, CheckFailed, check_wheels,  # noqa: E402
                        library_path, require)

MODEL = "policy"
MiB = 1 << 20


# ---------------------------------------------------------------------------- tensors
def weights(seed: int, nbytes: int, device: str) -> dict:
    """Deterministic weights of about ``nbytes`` (tensorhub.testing.make_weights: float32,
    bfloat16, int64, float16; plus float8_e4m3fn and float8_e5m2), on ``device``."""
    import torch

    from tensorhub.testing import make_weights

    w = make_weights(seed, max(4096, nbytes * 2 // 3 // 4096 * 4096))  # whole words per tensor
    g = torch.Generator().manual_seed(5000 + seed)
    per = max(16, (nbytes // 6) // 16 * 16)
    for i, dt in enumerate((torch.float8_e4m3fn, torch.float8_e5m2)):
        w[f"fp8.{i}.weight"] = torch.randint(0, 256, (per,), generator=g, dtype=torch.uint8).view(dt).view(16, -1)
    return {k: v.to(device) for k, v in w.items()}


def ipc_weights(seed: int, nbytes: int, device: str) -> dict:
    """Tensors of about ``nbytes`` for the CUDA IPC step, allocated one by one by torch's
    caching allocator before any is filled (nothing else allocates between them): 256 small
    ones of 4-64 KiB (packed into the small pool's 2 MiB segments, many per segment), 8 of
    3 MiB (carved from 20 MiB segments, several per segment), the rest 32 MiB ones (a segment
    each). Values: a pattern of ``seed`` and the tensor's index, the same in every process."""
    import torch

    small = [(4096, 8192, 16384, 65536)[i % 4] for i in range(256)]
    medium = [3 * MiB] * 8
    rest = max(0, nbytes - sum(small) - sum(medium))
    sizes = small + medium + [32 * MiB] * (rest // (32 * MiB)) + ([rest % (32 * MiB)] if rest % (32 * MiB) else [])
    raw = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
    dtypes = (torch.bfloat16, torch.float32, torch.uint8, torch.int64)
    out = {}
    for i, t in enumerate(raw):
        t.copy_((torch.arange(t.numel(), dtype=torch.int32, device=device) * (i % 13 + 1) + seed * 7919 + i)
                .remainder_(251).to(torch.uint8))  # (int32: no overflow up to 2**31 / 13 bytes a tensor)
        out[f"ipc.{i}"] = t.view(dtypes[i % 4]) if t.numel() % 8 == 0 else t
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return out


MAKE = {"weights": weights, "ipc": ipc_weights}


def differing(got: dict, want: dict) -> list[str]:
    """Names whose bytes differ, compared where ``want`` lives (the device)."""
    import torch

    bad = [k for k in want if k not in got] + [k for k in got if k not in want]
    for k, w in want.items():
        g = got.get(k)
        if g is None:
            continue
        if g.dtype != w.dtype or tuple(g.shape) != tuple(w.shape):
            bad.append(k)
        elif not torch.equal(g.contiguous().to(w.device).view(torch.uint8), w.view(torch.uint8)):
            bad.append(k)
    if want and next(iter(want.values())).is_cuda:
        torch.cuda.synchronize()
    return bad


def toy_model(seed: int, hidden: int, layers: int, device: str) -> Any:
    """A small module standing in for a vLLM model: bfloat16 parameters and a float8 buffer."""
    import torch

    torch.manual_seed(seed)
    vocab = 4 * hidden
    m = torch.nn.Sequential(torch.nn.Embedding(vocab, hidden), *[torch.nn.Linear(hidden, hidden) for _ in range(layers)],
                            torch.nn.Linear(hidden, vocab, bias=False))
    m = m.to(dtype=torch.bfloat16)
    m.register_buffer("scales", torch.randint(0, 256, (hidden,), dtype=torch.uint8).view(torch.float8_e4m3fn),
                      persistent=False)
    m.config = SimpleNamespace(to_dict=lambda: {"hidden": hidden, "layers": layers})
    return m.to(device).requires_grad_(False)


# ---------------------------------------------------------------------------- processes
class Role:
    """What one spawned process does on command (holder, reader, engine, trainer)."""

    def __init__(self, hub: Any, device: str) -> None:
        self.hub, self.device = hub, device
        self.kept: dict[str, Any] = {}  # published tensors, preallocated buffers, models

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()

    def publish(self, seed: int, nbytes: int, kind: str = "weights") -> dict:
        w = MAKE[kind](seed, nbytes, self.device)
        v = self.hub.publish(MODEL, w)
        self.kept[f"v{v}"] = w
        return {"version": v, "nbytes": sum(t.numel() * t.element_size() for t in w.values()), "tensors": len(w)}

    def transport_stats(self) -> dict:
        """The same-host wrapper's counters (``transport/_shm``): bytes copied same-host, of
        them through CUDA IPC, batches over Mooncake, CUDA blocks opened / open now."""
        t = self.hub._session._transport
        opened = getattr(t, "cuda", None)
        return {"copied_bytes": getattr(t, "copied_bytes", 0), "cuda_bytes": getattr(t, "cuda_bytes", 0),
                "inner_batches": getattr(t, "inner_batches", 0),
                "cuda_opens": opened.opens if opened is not None else 0,
                "cuda_open_now": len(opened) if opened is not None else 0}

    def _empty(self, version: int, names: Optional[list] = None) -> dict:
        import torch

        return {s.name: torch.empty(s.shape, dtype=getattr(torch, s.dtype), device=self.device)
                for s in self.hub.manifest(MODEL, version) if names is None or s.name in names}

    def alloc(self, version: int) -> None:
        """Preallocated destination (the caller's existing tensors), touched once."""
        import torch

        bufs = self._empty(version)
        for t in bufs.values():
            t.view(-1).view(torch.uint8).fill_(0xAB)
        self._sync()
        self.kept["prealloc"] = bufs

    def fetch(self, version: int, seed: int, nbytes: int, dest: str, serve: bool,
              names: Optional[list] = None, kind: str = "weights") -> dict:
        into = None if dest == "host" else self.kept["prealloc"] if dest == "prealloc" else self._empty(version, names)
        t0 = time.perf_counter()
        f = self.hub.fetch(MODEL, version, into=into, serve=serve, names=names)
        wall = time.perf_counter() - t0
        self._sync()
        want = MAKE[kind](seed, nbytes, self.device)
        if names is not None:
            want = {k: v for k, v in want.items() if k in names}
        bad = differing(dict(f), want)
        if serve:
            self.kept[f"v{version}"] = dict(f)
        on = {t.device.type for t in dict(f).values()}
        return {"dest": dest, "lands_on": sorted(on), "nbytes": f.nbytes, "seconds": f.seconds, "wall": wall,
                "gbps": f.nbytes / f.seconds / 1e9 if f.seconds else None, "wall_gbps": f.nbytes / wall / 1e9,
                "sources": dict(f.sources), "bytes_verified": not bad, "differing": bad[:5]}

    # -- leases (the drain rule)
    def hold_lease(self, version: int, layout: str, shard: int = 0) -> dict:
        g = self.hub._acquire(MODEL, version, layout, shard, set(), time.monotonic() + 30)
        return {"lease_id": g.lease_id, "replicas": [r.worker_id for r in g.replicas], "ttl": g.ttl,
                "at": time.time()}

    def release_lease(self, lease_id: str) -> dict:
        t = time.time()
        return {"valid": bool(self.hub._release(lease_id)), "at": t}

    # -- engine-native layout (tensorhub/integrations/vllm/_native.py without vLLM)
    def native_trainer_publish(self, seed: int, hidden: int, layers: int) -> dict:
        m = toy_model(seed, hidden, layers, self.device)
        hf = {k: t.clone() for k, t in _native().native_tensors(m).items()}  # the trainer's snapshot
        v = self.hub.publish(MODEL, hf)
        self.kept[f"v{v}"] = hf
        return {"version": v}

    def _state(self, model: Any, version: int) -> SimpleNamespace:
        nat = _native()
        layout = nat.fingerprint(model, SimpleNamespace(dtype="bfloat16", quantization=None),
                                 engine_version="gpu-check")
        settings = SimpleNamespace(native=True, model=MODEL, drain_timeout=60.0)
        return SimpleNamespace(settings=settings, hub=self.hub, rank=0, tp_size=1, pp_rank=0, pp_size=1,
                               version=version, layout=layout, native=False, native_refused=False, copy=None)

    def native_load_hf(self, version: int, seed: int, hidden: int, layers: int) -> dict:
        """Engine E1: start from the hf layout (load_weights: copy by name), then register the
        parameters in place as the native layout."""
        nat = _native()
        model = toy_model(1000 + seed, hidden, layers, self.device)  # other values: loading must overwrite them
        if self.device == "cpu":  # vLLM's CPU prepacking does not apply to a plain module (as the unit tests)
            nat.CPU_PREPACKS = False
        params = nat.native_tensors(model)
        why = nat.servable(params)
        require(why is None, f"servable() refuses the module's parameters: {why}")
        got = self.hub.fetch(MODEL, version, serve=False)
        for k, p in params.items():
            p.copy_(got[k])
        st = self._state(model, version)
        require(nat.publish(st, model), "_native.publish() did not register the parameters in place")
        require(nat.available(self.hub, MODEL, version, st.layout, 0), "the native layout is not available")
        self.kept.update(model=model, st=st)
        bad = differing(nat.native_tensors(model), nat.native_tensors(toy_model(seed, hidden, layers, self.device)))
        addrs = {k: t.data_ptr() for k, t in nat.native_tensors(model).items()}
        self.kept["addrs"] = addrs
        return {"layout": st.layout, "bytes_verified": not bad, "differing": bad[:5],
                "nbytes": sum(t.numel() * t.element_size() for t in params.values())}

    def native_raw(self, version: int, seed: int, hidden: int, layers: int) -> dict:
        """Engine E2: start (or swap) raw from the native layout: fetch the shard (host memory,
        as the adapter), copy it over the parameters, no load_weights."""
        nat = _native()
        if "model" not in self.kept:
            self.kept["model"] = toy_model(2000 + seed, hidden, layers, self.device)
        model = self.kept["model"]
        if self.device == "cpu":
            nat.CPU_PREPACKS = False
        st = self._state(model, version)
        require(nat.available(self.hub, MODEL, version, st.layout, 0),
                f"v{version} is not available in the native layout {st.layout} (fingerprints differ?)")
        t0 = time.perf_counter()
        got = self.hub.fetch(MODEL, version, layout=st.layout, shard=0, serve=False)
        t1 = time.perf_counter()
        n = _copy_into(model, got)
        self._sync()
        t2 = time.perf_counter()
        bad = differing(nat.native_tensors(model), nat.native_tensors(toy_model(seed, hidden, layers, self.device)))
        return {"layout": st.layout, "nbytes": n, "fetch_s": t1 - t0, "copy_s": t2 - t1, "seconds": t2 - t0,
                "gbps": n / (t2 - t0) / 1e9, "sources": dict(got.sources), "bytes_verified": not bad,
                "differing": bad[:5]}

    def native_swap(self, version: int, seed: int, hidden: int, layers: int) -> dict:
        """Engine E1: swap to ``version`` in place: withdraw the running one (waits for its
        readers), then write the parameters, then serve the new version natively."""
        nat = _native()
        model, st = self.kept["model"], self.kept["st"]
        before = {k: t.clone() for k, t in nat.native_tensors(model).items()}
        t0 = time.time()
        nat.withdraw(st)
        t_withdrawn = time.time()
        unchanged = not differing(nat.native_tensors(model), before)  # nothing wrote them meanwhile
        got = self.hub.fetch(MODEL, version, serve=False)
        t_write = time.time()
        for k, p in nat.native_tensors(model).items():
            p.copy_(got[k])
        self._sync()
        st.version, st.native = version, False
        require(nat.publish(st, model), f"_native.publish() did not register v{version} in place")
        same_place = {k: t.data_ptr() for k, t in nat.native_tensors(model).items()} == self.kept["addrs"]
        bad = differing(nat.native_tensors(model), nat.native_tensors(toy_model(seed, hidden, layers, self.device)))
        return {"withdraw_started": t0, "withdrawn": t_withdrawn, "first_write": t_write,
                "waited": t_withdrawn - t0, "unchanged_while_draining": unchanged, "in_place": same_place,
                "bytes_verified": not bad, "differing": bad[:5]}


def _native() -> Any:
    from tensorhub.integrations.vllm import _native as nat

    return nat


def _copy_into(model: Any, got: Any) -> int:
    """What the vLLM adapter does with a fetched native shard (names, shapes, dtypes checked first)."""
    from tensorhub.integrations._core.load import copy_into

    return copy_into(_native().native_tensors(model), got)


def _child(conn: Any, url: str, name: str, device: str, env: dict, options: dict) -> None:
    os.environ.update(env)
    os.environ.setdefault("GLOG_minloglevel", "2")
    try:
        import torch

        import tensorhub

        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        hub = tensorhub.connect(url, worker_id=name, **options)
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    role = Role(hub, device)
    conn.send(("ready", None))
    while True:
        cmd, kw = conn.recv()
        if cmd == "exit":
            hub.close()
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(role, cmd)(**kw)))
        except BaseException as e:
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


class Proc:
    """A spawned process running :class:`Role` commands (``call``, or ``send`` + ``result``)."""

    def __init__(self, url: str, name: str, device: str, env: dict, timeout: float, **options: Any) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.name, self.timeout = name, timeout
        self.proc = ctx.Process(target=_child, args=(child, url, name, device, env, options), daemon=True)
        self.proc.start()

    def ready(self) -> "Proc":
        """Wait for the Hub to be connected (processes start in parallel, then each is awaited)."""
        kind, msg = self._recv(self.timeout)
        if kind == "error":
            self.close()
            raise CheckFailed(f"{self.name} did not start: {msg}")
        return self

    def _recv(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise CheckFailed(f"{self.name} did not answer within {timeout:.0f}s")
        try:
            return self.conn.recv()
        except EOFError:
            raise CheckFailed(f"{self.name} died (exit code {self.proc.exitcode})") from None

    def send(self, cmd: str, **kw: Any) -> None:
        self.conn.send((cmd, kw))

    def result(self, what: str = "") -> Any:
        kind, msg = self._recv(self.timeout)
        if kind == "error":
            raise CheckFailed(f"{self.name} {what}: {msg}")
        return msg

    def call(self, cmd: str, **kw: Any) -> Any:
        self.send(cmd, **kw)
        return self.result(cmd)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.send("exit")
                self._recv(20)
            except Exception:
                pass
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)


# ---------------------------------------------------------------------------- steps
def protocol_env(protocol: str) -> dict:
    env = {k: "" for k in ("MC_FORCE_TCP", "MC_INTRANODE_NVLINK")}
    if protocol == "tcp":
        env["MC_FORCE_TCP"] = "1"  # the CUDA build would pick RDMA on a host with HCAs
    else:
        env["MC_INTRANODE_NVLINK"] = "1"
    return env


def data_plane(protocol: str, device: str, nbytes: int, work: Path, timeout: float) -> dict:
    """Publish, fetch into preallocated / host / new memory, then a striped read from two holders."""
    from tensorhub.testing import CoordinatorProcess

    env = protocol_env(protocol)
    # Mooncake reads "" as unset only for some variables: drop them instead. Same-host reads
    # off: these figures are Mooncake's (the CUDA IPC step measures the same-host path).
    child_env = {k: v for k, v in env.items() if v}
    child_env["TENSORHUB_SAMEHOST"] = "0"
    for k in env:
        os.environ.pop(k, None)
    coord = CoordinatorProcess(work / f"state-{protocol}")
    procs: list[Proc] = []
    out: dict[str, Any] = {"protocol": protocol, "paths": []}
    try:
        url = coord.start()
        opts = {"chunk_bytes": max(MiB, nbytes // 8)}

        procs += [Proc(url, name, device, child_env, timeout, **opts) for name in ("holder-a", "holder-b", "reader-c")]
        try:
            a, b, c = (p.ready() for p in procs)
        except CheckFailed as e:
            if protocol == "tcp":
                raise
            return {**out, "status": "unsupported", "reason": f"TensorHub's transport cannot start on it: {e}"}
        pub = a.call("publish", seed=1, nbytes=nbytes)
        v, total = pub["version"], pub["nbytes"]
        # A one-tensor read first: the P2P handshake is not part of any figure.
        b.call("fetch", version=v, seed=1, nbytes=nbytes, dest="fresh", serve=False, names=["layers.0.weight"])
        b.call("alloc", version=v)
        dests = [("prealloc", False)] + ([("host", False)] if protocol == "tcp" else []) + [("fresh", True)]
        for dest, serve in dests:
            r = b.call("fetch", version=v, seed=1, nbytes=nbytes, dest=dest, serve=serve)
            mem = "host" if device == "cpu" else "device"
            r["path"] = {"prealloc": f"B <- A into preallocated {mem} memory",
                         "host": "B <- A into host memory (fetch's default)",
                         "fresh": f"B <- A into new {mem} memory, then serves it"}[dest]
            out["paths"].append(r)
            require(r["bytes_verified"], f"{protocol}: fetch into {dest} memory: bytes differ in {r['differing']}")
            require(set(r["sources"]) == {"holder-a"}, f"{protocol}: B read from {r['sources']}, not holder A alone")
        r = c.call("fetch", version=v, seed=1, nbytes=nbytes, dest="fresh", serve=False)
        r["path"] = "C <- A + B striped, into new device memory" if device != "cpu" else "C <- A + B striped"
        out["paths"].append(r)
        require(r["bytes_verified"], f"{protocol}: striped fetch: bytes differ in {r['differing']}")
        used = {k for k, n in r["sources"].items() if n > 0}
        require(used == {"holder-a", "holder-b"}, f"{protocol}: the striped read used {r['sources']}, not both holders")
        out.update(status="ok", nbytes=total, bytes_verified=True)
        return out
    finally:
        for p in procs:
            p.close()
        coord.stop()


def native_layout(device: str, hidden: int, layers: int, work: Path, timeout: float, hold: float) -> dict:
    """In-place registration, raw start, swap with the drain rule (see the module docstring)."""
    from tensorhub.testing import CoordinatorProcess

    for k in ("MC_FORCE_TCP", "MC_INTRANODE_NVLINK"):
        os.environ.pop(k, None)
    env = {"MC_FORCE_TCP": "1", "TENSORHUB_SAMEHOST": "0"}  # over Mooncake, as the figures say
    coord = CoordinatorProcess(work / "state-native")
    procs: list[Proc] = []
    shape = {"hidden": hidden, "layers": layers}
    try:
        url = coord.start()
        procs += [Proc(url, n, device, env, timeout) for n in ("trainer", "engine-1", "engine-2")]
        trainer, e1, e2 = (p.ready() for p in procs)
        v1 = trainer.call("native_trainer_publish", seed=1, **shape)["version"]
        load = e1.call("native_load_hf", version=v1, seed=1, **shape)
        require(load["bytes_verified"], f"E1's parameters after loading hf v{v1} differ in {load['differing']}")
        start = e2.call("native_raw", version=v1, seed=1, **shape)
        require(start["layout"] == load["layout"], "E1 and E2 computed different fingerprints")
        require(start["bytes_verified"], f"E2's raw start: parameters differ in {start['differing']}")
        require(set(start["sources"]) == {"engine-1"}, f"E2's raw start read from {start['sources']}")
        v2 = trainer.call("native_trainer_publish", seed=2, **shape)["version"]
        lease = e2.call("hold_lease", version=v1, layout=load["layout"])
        require(lease["replicas"] == ["engine-1"], f"the lease names {lease['replicas']}, not engine-1")
        e1.send("native_swap", version=v2, seed=2, **shape)
        time.sleep(hold)
        require(not e1.conn.poll(0), f"E1's swap went on while E2 held a lease on v{v1} (drain rule broken)")
        rel = e2.call("release_lease", lease_id=lease["lease_id"])
        swap = e1.result("native_swap")
        require(rel["valid"], "E2's lease lapsed while it held it")
        require(swap["unchanged_while_draining"], "E1's parameters changed while draining")
        require(swap["first_write"] >= rel["at"], "E1 wrote its parameters before E2 released its lease")
        require(swap["in_place"], "E1's parameters moved (not in place)")
        require(swap["bytes_verified"], f"E1 after the swap: parameters differ in {swap['differing']}")
        raw_swap = e2.call("native_raw", version=v2, seed=2, **shape)
        require(raw_swap["bytes_verified"], f"E2's raw swap: parameters differ in {raw_swap['differing']}")
        return {"status": "ok", "layout": load["layout"], "nbytes": load["nbytes"], "raw_start": start,
                "drain": {"lease_held_s": rel["at"] - lease["at"], "swap_waited_s": swap["waited"],
                          "first_write_after_release_s": swap["first_write"] - rel["at"], "lease_valid": rel["valid"],
                          "unchanged_while_draining": swap["unchanged_while_draining"]},
                "swap": swap, "raw_swap": raw_swap, "bytes_verified": True}
    finally:
        for p in procs:
            p.close()
        coord.stop()


def d2d_gbps(device: str, nbytes: int) -> float:
    """torch's device-to-device copy of ``nbytes`` on ``device``, best of 3 after a warm-up."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    b = torch.empty_like(a)
    times = []
    for _ in range(4):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del a, b
    torch.cuda.empty_cache()
    return nbytes / min(times[1:]) / 1e9


def cuda_ipc(device: str, nbytes: int, work: Path, timeout: float) -> dict:
    """Same-host reads of CUDA memory through CUDA IPC handles (the module docstring, step 4)."""
    from tensorhub.testing import CoordinatorProcess

    if device == "cpu":
        return {"status": "skipped", "reason": "no GPU: CUDA IPC moves device memory only"}
    for k in ("MC_FORCE_TCP", "MC_INTRANODE_NVLINK", "TENSORHUB_SAMEHOST"):
        os.environ.pop(k, None)
    env = {"MC_FORCE_TCP": "1", "TENSORHUB_SAMEHOST": "1"}  # Mooncake only where CUDA IPC cannot go
    coord = CoordinatorProcess(work / "state-cuda-ipc")
    procs: list[Proc] = []
    try:
        url = coord.start()
        procs += [Proc(url, n, device, env, timeout, chunk_bytes=max(MiB, nbytes // 8))
                  for n in ("ipc-holder", "ipc-reader")]
        holder, reader = (p.ready() for p in procs)
        pub = holder.call("publish", seed=3, nbytes=nbytes, kind="ipc")
        v, total = pub["version"], pub["nbytes"]
        kw = {"version": v, "seed": 3, "nbytes": nbytes, "serve": False, "kind": "ipc"}
        first = reader.call("fetch", dest="fresh", names=["ipc.0"], **kw)  # (the reader's CUDA context, the handshake)
        require(first["bytes_verified"], f"CUDA IPC: the first tensor differs: {first['differing']}")
        reader.call("alloc", version=v)
        paths = []
        for dest, label in (("prealloc", "R <- H into preallocated device memory"),
                            ("host", "R <- H into host memory (fetch's default)")):
            before = reader.call("transport_stats")
            r = reader.call("fetch", dest=dest, **kw)
            after = reader.call("transport_stats")
            r.update(path=label, cuda_bytes=after["cuda_bytes"] - before["cuda_bytes"],
                     mooncake_batches=after["inner_batches"] - before["inner_batches"],
                     blocks_opened=after["cuda_opens"] - before["cuda_opens"], blocks_open_after=after["cuda_open_now"])
            paths.append(r)
            require(r["bytes_verified"], f"CUDA IPC into {dest} memory: bytes differ in {r['differing']}")
            require(set(r["sources"]) == {"ipc-holder"}, f"CUDA IPC into {dest}: read from {r['sources']}")
            require(r["cuda_bytes"] == r["nbytes"] == total,
                    f"CUDA IPC into {dest}: the transport copied {r['cuda_bytes']} bytes through CUDA IPC, "
                    f"not the {total} fetched ({r['mooncake_batches']} batches over Mooncake; see the reader's log)")
            require(r["mooncake_batches"] == 0, f"CUDA IPC into {dest}: {r['mooncake_batches']} batches over Mooncake")
            require(0 < r["blocks_opened"] < pub["tensors"],
                    f"CUDA IPC into {dest}: {r['blocks_opened']} blocks opened for {pub['tensors']} tensors "
                    "(each block should be opened once, many tensors share one)")
            require(r["blocks_open_after"] == 0, f"CUDA IPC: {r['blocks_open_after']} blocks still open after the read")
        d2d = d2d_gbps(device, total)
        for r in paths:
            r["vs_d2d"] = r["gbps"] / d2d if r["gbps"] else None
        return {"status": "ok", "nbytes": total, "tensors": pub["tensors"], "d2d_gbps": d2d, "paths": paths,
                "bytes_verified": True}
    finally:
        for p in procs:
            p.close()
        coord.stop()


def baselines(device: str, nbytes: int) -> list[dict]:
    """torch copies of ``nbytes``: the ceilings the data-plane paths are set against."""
    import torch

    def best(fn: Any, sync: bool) -> float:
        times = []
        for _ in range(4):
            t0 = time.perf_counter()
            fn()
            if sync:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return nbytes / min(times[1:]) / 1e9

    out = []
    host = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    host2 = torch.empty_like(host)
    out.append({"name": "torch host memcpy (pageable)", "gbps": best(lambda: host2.copy_(host), False)})
    if device != "cpu":
        d1 = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
        d2 = torch.empty_like(d1)
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
        out += [{"name": "torch device-to-device copy", "gbps": best(lambda: d2.copy_(d1), True)},
                {"name": "torch host-to-device copy (pinned)", "gbps": best(lambda: d1.copy_(pinned), True)},
                {"name": "torch host-to-device copy (pageable)", "gbps": best(lambda: d1.copy_(host), True)},
                {"name": "torch device-to-host copy (pinned)", "gbps": best(lambda: pinned.copy_(d1), True)}]
    return out


def _raw_peer(conn: Any, role: str, protocol: str, device: str, nbytes: int, env: dict) -> None:
    """One side of a raw Mooncake read (no TensorHub): the server registers a patterned
    buffer, the client reads it whole with ``transfer_sync_read`` and compares on ``device``."""
    os.environ.update(env)
    os.environ.setdefault("GLOG_minloglevel", "2")
    try:
        import ctypes

        import torch
        from mooncake.engine import TransferEngine

        if device != "cpu":
            torch.cuda.set_device(torch.device(device))
        te = TransferEngine()
        rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "")
        require(rc == 0, f"TransferEngine.initialize(..., {protocol!r}) returned {rc}")
        pattern = torch.Generator().manual_seed(7)
        want = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=pattern).to(device)
        buf = want if role == "server" else torch.zeros_like(want)
        rc = te.register_memory(buf.data_ptr(), nbytes)
        require(rc == 0, f"register_memory({device} memory) returned {rc}")
        scratch = ctypes.create_string_buffer(64)  # what TensorHub's transport registers first
        host_rc = te.register_memory(ctypes.addressof(scratch), 64) if device != "cpu" else 0
        if role == "server":
            conn.send(("ok", {"peer": f"127.0.0.1:{te.get_rpc_port()}", "addr": buf.data_ptr(), "host_rc": host_rc}))
            conn.recv()  # serve until the client is done
            conn.send(("ok", None))
            return
        peer, addr = conn.recv()
        times = []
        for _ in range(4):  # the first includes the handshake (and on NVLink the IPC mapping)
            buf.zero_()
            if device != "cpu":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            rc = te.transfer_sync_read(peer, buf.data_ptr(), addr, nbytes)
            if device != "cpu":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            require(rc == 0, f"transfer_sync_read returned {rc}")
        same = torch.equal(buf, want)
        conn.send(("ok", {"nbytes": nbytes, "seconds": min(times[1:]), "first_s": times[0],
                          "gbps": nbytes / min(times[1:]) / 1e9, "bytes_verified": same}))
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))


def raw_read(protocol: str, device: str, nbytes: int, timeout: float) -> dict:
    """Mooncake alone, one ``transfer_sync_read`` of ``nbytes`` between two processes: the
    ceiling TensorHub's fetch over ``protocol`` is set against (and, where TensorHub cannot
    use the protocol, what it would give)."""
    env = {k: v for k, v in protocol_env(protocol).items() if v}
    for k in protocol_env(protocol):
        os.environ.pop(k, None)
    ctx = mp.get_context("spawn")
    ends = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_raw_peer, args=(child, role, "tcp" if protocol == "tcp" else protocol, device,
                                                 nbytes, env), daemon=True)
             for (_, child), role in zip(ends, ("server", "client"))]
    (server, _), (client, _) = ends

    def recv(conn: Any, who: str) -> Any:
        if not conn.poll(timeout):
            raise CheckFailed(f"raw {protocol} read: the {who} did not answer within {timeout:.0f}s")
        kind, msg = conn.recv()
        if kind == "error":
            raise CheckFailed(f"raw {protocol} read, {who}: {msg}")
        return msg

    try:
        for p in procs:
            p.start()
        info = recv(server, "server")
        client.send((info["peer"], info["addr"]))
        res = recv(client, "client")
        server.send("done")
        recv(server, "server")
        require(res["bytes_verified"], f"raw {protocol} read: the bytes differ")
        res.update(protocol=protocol, status="ok", path=f"raw Mooncake read, one call ({nbytes // MiB} MiB)")
        if device != "cpu":
            res["host_register_rc"] = info["host_rc"]  # 0: host memory can be registered too
        return res
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()


def nvlink_probe(engine_so: Optional[str]) -> Optional[str]:
    """None when the Mooncake build has the intra-node NVLink transport, else why not."""
    if engine_so is None:
        return "mooncake.engine not found"
    data = Path(engine_so).read_bytes()
    if b"Using Intra-Node NVLink transport" not in data:
        return f"{engine_so} was built without USE_INTRA_NVLINK"
    return None


def environment(device: str) -> dict:
    import importlib.metadata as md

    import torch

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "torch_cuda": torch.version.cuda, "device": device}
    if device != "cpu":
        env["gpu"] = torch.cuda.get_device_name(0)
    for dist in (MOONCAKE_DIST, "mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda"):
        try:
            env["mooncake"] = f"{dist} {md.version(dist)}"
            break
        except md.PackageNotFoundError:
            continue
    try:  # torch is loaded, as in every worker: it brings the CUDA runtime Mooncake's CUDA build links
        import mooncake.engine as engine

        env["mooncake_engine"] = engine.__file__
    except (ImportError, OSError) as e:
        env["mooncake_engine"], env["mooncake_error"] = None, f"{type(e).__name__}: {e}"
    return env


# ---------------------------------------------------------------------------- report
def table(report: dict) -> str:
    rows = [f"TensorHub GPU check, {report['mode']} mode ({report['reason']}), {report['date']}",
            f"python {report['env']['python']}, torch {report['env']['torch']}, {report['env'].get('gpu', 'no GPU')}, "
            f"{report['env'].get('mooncake', 'mooncake ?')}", "",
            f"{'path':58} {'MB':>8} {'GB/s':>7} {'wall GB/s':>9}  bytes"]
    for flow in report["flows"]:
        if flow.get("status") != "ok":
            rows.append(f"[{flow['protocol']}] {flow.get('status')}: {flow.get('reason')}")
            continue
        for p in flow["paths"]:
            rows.append(f"{'[' + flow['protocol'] + '] ' + p['path']:58} {p['nbytes'] / 1e6:8.1f} {p['gbps'] or 0:7.2f} "
                        f"{p['wall_gbps']:9.2f}  {'verified' if p['bytes_verified'] else 'DIFFER'}")
    for r in report.get("raw", []):
        if r.get("status") == "ok":
            rows.append(f"{'[' + r['protocol'] + '] ' + r['path']:58} {r['nbytes'] / 1e6:8.1f} {r['gbps']:7.2f} {'':9}  "
                        f"{'verified' if r['bytes_verified'] else 'DIFFER'}")
        else:
            rows.append(f"[{r['protocol']}] raw Mooncake read {r.get('status')}: {r.get('reason')}")
    nat = report.get("native") or {}
    if nat.get("status") == "ok":
        for key, label in (("raw_start", "native raw start (fetch to host + copy in)"),
                           ("raw_swap", "native raw swap (fetch to host + copy in)")):
            p = nat[key]
            rows.append(f"{'[tcp] ' + label:58} {p['nbytes'] / 1e6:8.1f} {p['gbps']:7.2f} {'':9}  verified")
        d = nat["drain"]
        rows.append(f"native drain rule: E1's swap waited {d['swap_waited_s']:.2f}s for E2's lease "
                    f"(held {d['lease_held_s']:.2f}s), first write {d['first_write_after_release_s']:.3f}s after release")
    ipc = report.get("cuda_ipc") or {}
    if ipc.get("status") == "ok":
        for p in ipc["paths"]:
            rows.append(f"{'[cuda-ipc] ' + p['path']:58} {p['nbytes'] / 1e6:8.1f} {p['gbps'] or 0:7.2f} "
                        f"{p['wall_gbps']:9.2f}  {'verified' if p['bytes_verified'] else 'DIFFER'}")
        rows.append(f"{'[cuda-ipc] torch device-to-device copy, same bytes':58} {ipc['nbytes'] / 1e6:8.1f} "
                    f"{ipc['d2d_gbps']:7.2f}   (CUDA IPC / D2D: "
                    + ", ".join(f"{p['dest']} {p['vs_d2d'] or 0:.2f}x" for p in ipc["paths"]) + ")")
    elif ipc:
        rows.append(f"[cuda-ipc] same-host CUDA IPC {ipc.get('status')}: {ipc.get('reason')}")
    for b in report["baselines"]:
        rows.append(f"{b['name']:58} {report['baseline_bytes'] / 1e6:8.1f} {b['gbps']:7.2f}")
    w = report["wheels"]
    rows.append("wheels: " + ("ok for Python " + ", ".join(w["versions"]) if w.get("ok") else w.get("reason", "?")))
    rows.append(f"total {report['seconds']:.1f}s: {'OK' if report['ok'] else 'FAILED: ' + str(report.get('error'))}")
    return "\n".join(rows) + "\n"


def run(args: argparse.Namespace) -> int:
    import torch

    t0 = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.is_available()
    device = "cuda:0" if gpu else "cpu"
    reason = ("CUDA GPU found" if gpu else "no CUDA GPU here (torch.cuda.is_available() is False): "
              "running the CPU-possible parts on CPU tensors")
    print(f"gpu_check: {reason}", flush=True)
    nbytes = (args.mib or (512 if gpu else 16)) * MiB
    hidden, layers = (2048, 8) if gpu else (256, 2)
    report: dict[str, Any] = {"mode": "gpu" if gpu else "cpu", "reason": reason, "ok": False, "flows": [], "raw": [],
                              "baselines": [], "wheels": {}, "baseline_bytes": nbytes,
                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    work = Path(tempfile.mkdtemp(prefix="tensorhub-gpu-check-"))
    try:
        report["env"] = environment(device)
        print(f"gpu_check: {report['env']}", flush=True)
        require(report["env"]["mooncake_engine"] is not None,
                f"mooncake.engine does not import: {report['env'].get('mooncake_error')}")
        report["wheels"] = check_wheels(Path(args.wheels), work)
        print(f"gpu_check: wheels {report['wheels']}", flush=True)
        report["baselines"] = baselines(device, nbytes)
        protocols = ["tcp"]
        why_not = "no GPU: the NVLink transport moves device memory only" if not gpu else \
            nvlink_probe(report["env"]["mooncake_engine"])
        if why_not is None:
            protocols.append("nvlink_intra")
        else:
            report["flows"].append({"protocol": "nvlink_intra", "status": "skipped", "reason": why_not})
            print(f"gpu_check: NVLink transport skipped: {why_not}", flush=True)
        for proto in protocols:
            print(f"gpu_check: data plane over {proto} ({nbytes / MiB:.0f} MiB)", flush=True)
            try:
                report["flows"].append(data_plane(proto, device, nbytes, work, args.timeout))
            except CheckFailed as e:
                if proto == "tcp":
                    raise
                report["flows"].append({"protocol": proto, "status": "unsupported", "reason": str(e)})
                print(f"gpu_check: {proto}: TensorHub does not run on it: {e}", flush=True)
        for proto in protocols:
            print(f"gpu_check: raw Mooncake read over {proto}", flush=True)
            try:
                report["raw"].append(raw_read(proto, device, nbytes, args.timeout))
            except CheckFailed as e:
                if proto == "tcp":
                    raise
                report["raw"].append({"protocol": proto, "status": "failed", "reason": str(e)})
                print(f"gpu_check: {e}", flush=True)
        print("gpu_check: engine-native layout", flush=True)
        report["native"] = native_layout(device, hidden, layers, work, args.timeout, args.hold)
        print(f"gpu_check: same-host CUDA IPC ({nbytes / MiB:.0f} MiB)" if gpu else
              "gpu_check: same-host CUDA IPC skipped: no GPU: CUDA IPC moves device memory only", flush=True)
        try:
            report["cuda_ipc"] = cuda_ipc(device, nbytes, work, args.timeout)
        except CheckFailed as e:  # recorded beside the other figures, then the check fails
            report["cuda_ipc"] = {"status": "failed", "reason": str(e)}
        require(report["cuda_ipc"]["status"] in ("ok", "skipped"),
                f"same-host CUDA IPC: {report['cuda_ipc'].get('reason')}")
        report["ok"] = True
    except CheckFailed as e:
        report["error"] = str(e)
    except Exception as e:
        report["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    finally:
        shutil.rmtree(work, ignore_errors=True)
        report["seconds"] = time.monotonic() - t0
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
        text = table(report)
        (out / "gpu_check.txt").write_text(text)
        print(text, flush=True)
    if not report["ok"]:
        print(f"GPU CHECK FAILED: {report['error']}", file=sys.stderr, flush=True)
        return 1
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the check; figures to --out")
    r.add_argument("--out", default=os.environ.get("OUT") or "out/gpu_check")
    r.add_argument("--wheels", default=str(ROOT / "gpu_wheels"))
    r.add_argument("--mib", type=int, default=None, help="payload (default 512 on a GPU, 16 on CPU)")
    r.add_argument("--timeout", type=float, default=180.0, help="seconds one process command may take")
    r.add_argument("--hold", type=float, default=2.0, help="seconds E2 holds its lease during E1's swap")
    q = sub.add_parser("requirements", help="what scripts/fetch_gpu_wheels.sh downloads, one a line")
    q.add_argument("--mooncake", action="store_true", help="the Mooncake pin instead")
    lp = sub.add_parser("libpath", help="LD_LIBRARY_PATH entries for SITE's mooncake/engine.so")
    lp.add_argument("site")
    lp.add_argument("--wheels", default=str(ROOT / "gpu_wheels"))
    lp.add_argument("--work", required=True)
    args = ap.parse_args()
    if args.cmd == "requirements":
        print("\n".join([f"{MOONCAKE_DIST}=={MOONCAKE_VERSION}"] if args.mooncake else REQUIREMENTS))
        return 0
    if args.cmd == "libpath":
        dirs, missing = library_path(Path(args.site), Path(args.wheels), Path(args.work))
        if missing:
            print(f"gpu_check: mooncake/engine.so still lacks {', '.join(missing)}", file=sys.stderr)
        print(":".join(dirs))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
