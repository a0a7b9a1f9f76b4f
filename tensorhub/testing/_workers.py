"""Scriptable worker processes and a coordinator process, for tests, soaks and benchmarks.

:class:`Worker` spawns a process with a real Hub over real Mooncake that runs a command
loop over a pipe (publish, fetch, unpublish, ...), so a test can script several
processes step by step and fault them (:mod:`tensorhub.testing._faults`).
:class:`CoordinatorProcess` runs ``tensorhub coordinator`` on a free port and can kill
and restart it on the same port and state dir. Weights are deterministic per seed
(:func:`make_weights`) and checked with per-tensor sha256 (:func:`digest`).
torch is imported inside functions.

Worker commands (``worker.call(cmd, **kw)``; the keyword arguments in brackets are optional):

* ``publish(seed, nbytes, [version, layout, shard, num_shards, base, frac])`` -> version (``base=b``: a
  ``frac`` change of the v``b`` this worker published, published with its delta against it);
* ``fetch([version, serve, fetch_timeout, layout, shard, into, wait_newer_than])`` -> version, digest,
  sources, ...; ``wait_newer_than=v`` waits for a complete version newer than v and fetches it at
  once (what an engine's prefetcher does);
  ``into={"nbytes": n}`` fetches into new caller-shaped buffers, ``"name": key`` keeps them
  in the worker, and a later ``into={"name": key}`` fetches into that same memory again;
* ``unpublish(version, [drain_timeout, refill])`` -> seconds waited; the version's published
  tensors are zeroed once it returns (the memory is reused), or with ``refill=seed``, the
  version after is written into that same memory and published from it at once (a
  double-buffered trainer): -> ``{"waited": s, "version": v}``;
* ``latest``, ``held``, ``pid``, ``exit``.
"""

from __future__ import annotations

import ctypes
import hashlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

__all__ = ["CoordinatorProcess", "Worker", "WorkerError", "make_weights", "digest", "enter_netns"]

MODEL = "policy"


def make_weights(seed: int, nbytes: int, n: int = 8) -> dict:
    """Deterministic random weights of mixed dtypes, about ``nbytes`` in total."""
    import torch

    g = torch.Generator().manual_seed(1000 + seed)
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.float16]
    out = {}
    per = max(64, nbytes // n)
    for i in range(n):
        dt = dtypes[i % len(dtypes)]
        words = per // 4
        bits = torch.randint(-(2**31), 2**31 - 1, (words,), generator=g, dtype=torch.int32)
        t = bits.view(dt)
        if i % 2 == 0 and t.numel() % 16 == 0:
            t = t.view(16, -1)
        out[f"layers.{i}.weight"] = t.contiguous()
    return out


def changed_weights(prev: dict, seed: int, frac: float) -> dict:
    """A copy of ``prev`` with about ``frac`` of each tensor's bytes changed (the rest
    bit-identical): a next version a delta carries in a few % of the bytes."""
    import torch

    g = torch.Generator().manual_seed(2000 + seed)
    out = {}
    for k, t in prev.items():
        t = t.clone()
        raw = t.reshape(-1).view(torch.uint8)
        idx = torch.randint(0, raw.numel(), (max(1, int(frac * raw.numel())),), generator=g)
        raw[idx] += 1
        out[k] = t
    return out


def digest(tensors: dict) -> dict:
    import torch

    return {k: hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, v in tensors.items()}


class _Gated:
    """Wraps a transport's poll: after the first completed batch, hold every result as
    PENDING until the test opens the gate (bytes still move over the real transport)."""

    def __init__(self, inner: Any, first_done: Any, gate: Any) -> None:
        self._inner, self._first_done, self._gate = inner, first_done, gate
        self._held: dict[int, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def poll(self, handle: int) -> int:
        if handle in self._held:
            st = self._held[handle]
        else:
            st = self._inner.poll(handle)
        if st == 0:
            return 0
        if not self._gate.is_set():
            if self._first_done.is_set():
                self._held[handle] = st
                return 0
            self._first_done.set()
        self._held.pop(handle, None)
        return st


class _Traced:
    """Wraps a transport and writes what it did to ``path`` (JSON lines, times on the
    system-wide monotonic clock, so several processes' traces compare): each remote range
    a read asks for (``read``), each local range a batch completed into, when this process
    learned it (``complete``), and every chunk map this process made (``map``). With
    ``delay``, a batch's result reaches the Hub that long after the transport said so
    (reads overlap on a fast loopback). ``tests/test_chunkmap.py`` checks the traces."""

    def __init__(self, inner: Any, path: str, delay: float = 0.0) -> None:
        import json
        import threading

        self._inner, self._delay, self._json = inner, delay, json
        self._f = open(path, "a", buffering=1)
        self._lock = threading.Lock()
        self._ops: dict[int, list] = {}
        self._seen: dict[int, tuple[int, float]] = {}
        from .. import _chunkmap

        made = _chunkmap.ChunkMap.__init__
        me = self

        def init(cm: Any, n: int) -> None:
            made(cm, n)
            me.log("map", addr=cm.addr, n=cm.region[1])

        _chunkmap.ChunkMap.__init__ = init  # type: ignore[method-assign]

    def log(self, ev: str, **kw: Any) -> None:
        with self._lock:
            self._f.write(self._json.dumps(dict(kw, ev=ev, t=time.monotonic())) + "\n")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def start(self) -> str:
        ep = self._inner.start()
        self.log("endpoint", ep=ep)
        return ep

    def published(self, tensors: dict) -> None:
        for t in tensors.values():
            self.log("complete", addr=t.data_ptr(), n=t.numel() * t.element_size())

    def submit_read(self, peer: str, ops: Any) -> int:
        for op in ops:
            self.log("read", peer=peer, addr=op.remote_addr, n=op.length)
        h = self._inner.submit_read(peer, ops)
        self._ops[h] = [(op.local_addr, op.length) for op in ops]
        return h

    def poll(self, handle: int) -> int:
        if handle in self._seen:
            st, at = self._seen[handle]
        else:
            st, at = self._inner.poll(handle), time.monotonic()
            if st == 0:
                return 0
            self._seen[handle] = (st, at)
        if time.monotonic() < at + self._delay:
            return 0
        del self._seen[handle]
        ops = self._ops.pop(handle, [])
        if st == 1:
            for a, n in ops:
                self.log("complete", addr=a, n=n)
        return st


def enter_netns(name: str) -> None:
    """Move this process into network namespace ``name`` (``ip netns add`` made it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns into {name} failed")
    finally:
        os.close(fd)


def _drop_cap(cap: int) -> None:
    """Drop one capability from this process's effective and permitted sets (capset)."""
    import ctypes

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    libc = ctypes.CDLL(None, use_errno=True)
    hdr, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
    if libc.capget(ctypes.byref(hdr), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    i, bit = divmod(cap, 32)
    data[i].effective &= ~(1 << bit)
    data[i].permitted &= ~(1 << bit)
    if libc.capset(ctypes.byref(hdr), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def worker_main(conn: Any, url: str, name: str, token: Optional[str], gate: Any, first_done: Any,
                options: dict) -> None:
    os.environ.setdefault("GLOG_minloglevel", "2")
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID` dumps every stack
    options = dict(options)
    os.environ.update(options.pop("env", {}))  # (before tensorhub reads its settings)
    netns = options.pop("netns", None)
    data_host = options.pop("data_host", "127.0.0.1")
    if netns:
        enter_netns(netns)
    if options.pop("dumpable", True) is False:  # PR_SET_DUMPABLE 0: no ptrace / cross-memory reads of it
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
    if options.pop("no_ptrace_cap", False):  # root without CAP_SYS_PTRACE: the kernel's checks apply to it
        _drop_cap(19)
    import tensorhub
    from tensorhub.transport import MooncakeTransport

    own_transport = options.pop("own_transport", False)
    copy_delay = options.pop("copy_delay", 0.0)
    trace = options.pop("trace", None)  # (path, delay): trace the data plane (``_Traced``)
    transport_for_hub: Any = None
    transport = MooncakeTransport(host=data_host, progress_timeout=options.get("progress_timeout"))
    if own_transport:  # the Hub creates its transport, as in production (same-host reads included)
        os.environ["TENSORHUB_DATA_HOST"] = data_host
    elif gate is not None:
        transport.start()
        gated = _Gated(transport, first_done, gate)
        # The Hub only calls start/endpoint/register/unregister/submit_read/poll/close.
        gated.start = lambda: transport.endpoint  # already started
        transport_for_hub = gated
    elif trace is not None:
        transport_for_hub = _Traced(transport, trace[0], trace[1])
    else:
        transport_for_hub = transport
    try:
        hub = tensorhub.connect(url, worker_id=name, token=token, transport=transport_for_hub, **options)
    except Exception as e:
        conn.send(("error", type(e).__name__, str(e)))
        return
    if copy_delay:  # same-host copies wait first (tests: a reader that holds its lease a while)
        hub._session.transport().copy_delay = copy_delay
    if own_transport and trace is not None:  # the data plane under the same-host wrapper, traced / slowed
        t = hub._session.transport()
        t.inner = _Traced(t.inner, trace[0], trace[1])
    published: dict[int, list[tuple[dict, int]]] = {}  # version -> [(tensors, nbytes)], one per layout/shard
    buffers: dict[str, dict] = {}  # fetch(into={"name": ...}): caller buffers kept between commands
    conn.send(("ready", hub.worker_id))
    while True:
        cmd, kw = conn.recv()
        try:
            if cmd == "publish":
                base = kw.get("base")
                if base is not None:  # a small change of a version this worker holds, published as a delta
                    w = changed_weights(published[base][0][0], kw["seed"], kw.get("frac", 0.01))
                    v = hub.publish(MODEL, w, version=kw.get("version"), base=base)
                    published.setdefault(v, []).append((w, kw["nbytes"]))
                    conn.send(("ok", v))
                    continue
                w = make_weights(kw["seed"], kw["nbytes"])
                if kw.get("empty_like"):  # a snapshot in Hub-allocated memory (same-host readers copy it)
                    snap = hub.empty_like(w)
                    for k, t in w.items():
                        snap[k].copy_(t)
                    w = snap
                where = {k: kw[k] for k in ("layout", "shard", "num_shards") if k in kw}
                if isinstance(transport_for_hub, _Traced):  # complete before anyone may read it
                    transport_for_hub.published(w)
                v = hub.publish(MODEL, w, version=kw.get("version"), **where)
                published.setdefault(v, []).append((w, kw["nbytes"]))
                conn.send(("ok", v))
            elif cmd == "fetch":
                into = None
                spec = kw.get("into")
                if spec is not None and spec.get("name") in buffers:
                    into = buffers[spec["name"]]  # the same memory as an earlier fetch's
                elif spec is not None:
                    into = make_weights(0, spec["nbytes"])  # caller-shaped buffers
                    if spec.get("break"):
                        import torch

                        k = next(iter(into))
                        if spec["break"] == "shape":
                            into[k] = torch.zeros(3, dtype=into[k].dtype)
                        else:
                            into[k] = torch.zeros(into[k].shape, dtype=torch.float64)
                    if spec.get("name"):
                        buffers[spec["name"]] = into
                where = {k: kw[k] for k in ("layout", "shard") if k in kw}
                version = kw.get("version")
                if "wait_newer_than" in kw:  # as an engine's prefetcher: fetch the moment one is complete
                    version = hub.wait_for_version(MODEL, newer_than=kw["wait_newer_than"],
                                                   timeout=kw.get("wait_timeout", 60.0))
                t0 = time.monotonic()
                try:
                    f = hub.fetch(MODEL, version, serve=kw.get("serve", True), into=into,
                                  timeout=kw.get("fetch_timeout"), **where)
                except Exception as e:
                    e.args = (f"{e} (after {time.monotonic() - t0:.2f}s)",)
                    raise
                d = f.delta
                conn.send(("ok", {"version": f.version, "digest": digest(f), "sources": f.sources,
                                  "failed_sources": f.failed_sources, "nbytes": f.nbytes,
                                  "seconds": f.seconds, "delta": None if d is None else d.steps,
                                  "delta_skipped": f.delta_skipped}))
            elif cmd == "fetch_next":  # subscribe ahead: the next version after kw["after"]
                into = buffers.get(kw["into"]) if kw.get("into") else None
                t0 = time.monotonic()
                f = hub.fetch_next(MODEL, kw["after"], into=into, wait=kw.get("wait", 60.0),
                                   timeout=kw.get("fetch_timeout"))
                if f is None:
                    conn.send(("ok", None))
                    continue
                if kw.get("keep"):  # the fetched copy, as a later fetch_next's destination
                    buffers[kw["keep"]] = dict(f)
                conn.send(("ok", {"version": f.version, "digest": digest(f), "sources": f.sources,
                                  "nbytes": f.nbytes, "seconds": f.seconds, "waited": time.monotonic() - t0,
                                  "done_at": time.time()}))
            elif cmd == "borrow":  # read in place (same host): digest inside the block, then release
                b = hub.borrow(MODEL, kw["version"], timeout=kw.get("fetch_timeout"))
                if b is None:
                    conn.send(("ok", None))
                    continue
                if kw.get("drop"):  # misuse: never released; collected at once (no cycle holds it)
                    del b
                    conn.send(("ok", "dropped"))
                    continue
                lapsed = None
                with b:
                    d = digest(b)
                    kept = dict(b)  # views of the holder's memory: `sharing` must name them all
                    sharing = b.sharing(kept.items())
                    own = b.sharing([(k, t.clone()) for k, t in kept.items()])  # copies share nothing
                    del kept
                    time.sleep(kw.get("hold", 0.0))
                    after = digest(b) if kw.get("digest_after") else None  # the last use, past the hold
                    trusted_after = b.trusted()
                    try:
                        b.release()
                    except tensorhub.LeaseLapsedError as e:
                        lapsed = str(e)
                conn.send(("ok", {"digest": d, "worker_id": b.worker_id, "nbytes": b.nbytes, "sharing": len(sharing),
                                  "own": len(own), "lapsed": lapsed, "left": len(b), "digest_after": after,
                                  "trusted_after": trusted_after}))
            elif cmd == "unpublish":
                t0 = time.monotonic()
                hub.unpublish(MODEL, kw["version"], timeout=kw.get("drain_timeout"))
                waited = time.monotonic() - t0
                held = published.pop(kw["version"], [])
                if kw.get("refill") is None:
                    for w, _ in held:
                        for t in w.values():
                            t.zero_()  # reuse the memory, as a trainer would
                    conn.send(("ok", waited))
                    continue
                # The double-buffered loop: the moment unpublish returns, write the version
                # after into the same memory and publish it from there.
                w, nbytes = held[0]
                for k, t in make_weights(kw["refill"], nbytes).items():
                    w[k].copy_(t)
                v = hub.publish(MODEL, w)
                published.setdefault(v, []).append((w, nbytes))
                conn.send(("ok", {"waited": waited, "version": v}))
            elif cmd == "corrupt":
                import torch

                # Flip every bit of the version's held tensors in place (memory corruption
                # behind the Hub's back: the manifest and the registration stay as they were).
                held = [h for h in hub._holdings.all() if h.version == kw["version"]]
                for h in held:
                    for t in h.tensors.values():
                        t.view(torch.uint8).bitwise_not_()
                conn.send(("ok", None))
            elif cmd == "transport_stats":  # same-host reads: bytes copied, batches over the data plane
                t = hub._session._transport
                conn.send(("ok", {"copied_bytes": getattr(t, "copied_bytes", 0),
                                  "inner_batches": getattr(t, "inner_batches", None),
                                  "vm_bytes": getattr(t, "vm_bytes", 0),
                                  "hashed_bytes": getattr(t, "hashed_bytes", 0)}))
            elif cmd == "latest":
                conn.send(("ok", hub.latest(MODEL)))
            elif cmd == "held":
                conn.send(("ok", hub.held()))
            elif cmd == "pid":
                conn.send(("ok", os.getpid()))
            elif cmd == "exit":
                hub.close()
                conn.send(("ok", None))
                return
            else:
                conn.send(("error", "ValueError", f"unknown command {cmd}"))
        except Exception as e:  # report to the test, keep serving
            conn.send(("error", type(e).__name__, f"{e}\n{traceback.format_exc()}"))


class Worker:
    """Parent-side handle of a worker process (``options`` go to ``tensorhub.connect``;
    ``netns=NAME`` runs it in that network namespace, ``data_host`` is its data-plane address)."""

    def __init__(self, url: str, name: str, *, token: Optional[str] = None, gated: bool = False,
                 **options: Any) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.gate = ctx.Event() if gated else None
        self.first_done = ctx.Event() if gated else None
        self.proc = ctx.Process(target=worker_main, args=(child, url, name, token, self.gate, self.first_done,
                                                          options), daemon=True)
        self.proc.start()
        self.name = name
        self.pid = self.proc.pid
        msg = self._recv(120)
        if msg[0] == "error":
            self.proc.join(10)
            raise WorkerError(msg[1], msg[2])
        self.worker_id = msg[1]

    def _recv(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"worker {self.name} did not answer within {timeout}s")
        return self.conn.recv()

    def send(self, cmd: str, **kw: Any) -> None:
        self.conn.send((cmd, kw))

    def result(self, timeout: float = 120) -> Any:
        msg = self._recv(timeout)
        if msg[0] == "error":
            raise WorkerError(msg[1], msg[2])
        return msg[1]

    def call(self, cmd: str, timeout: float = 120, **kw: Any) -> Any:
        self.send(cmd, **kw)
        return self.result(timeout)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit", timeout=20)
            except Exception:
                pass
        self.kill()


class WorkerError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


class CoordinatorProcess:
    """A real ``tensorhub coordinator`` process on a free port, restartable on the same port.

    ``kill()`` is SIGKILL; ``start()`` again reuses the port and the state dir. stderr goes
    to ``log_path`` (next to the state dir)."""

    def __init__(self, state_dir: str | os.PathLike, token_file: Optional[str | os.PathLike] = None,
                 extra: tuple[str, ...] = (), host: str = "127.0.0.1", netns: Optional[str] = None):
        self.state_dir = Path(state_dir)
        self.token_file = token_file
        self.extra = extra
        self.host = host
        self.netns = netns
        self.log_level = "warning"
        self.port = 0
        self.proc: Optional[subprocess.Popen] = None
        self.url = ""
        self.log_path = self.state_dir.parent / "coordinator.log"

    def start(self, timeout: float = 30.0) -> str:
        cmd = [sys.executable, "-m", "tensorhub", "coordinator", "--host", self.host,
               "--port", str(self.port), "--state-dir", str(self.state_dir), "--log-level", self.log_level,
               *self.extra]
        if self.token_file is not None:
            cmd += ["--token-file", str(self.token_file)]
        if self.netns:
            cmd = ["ip", "netns", "exec", self.netns, *cmd]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
        deadline = time.monotonic() + timeout
        line = ""
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if "serving on" in line or self.proc.poll() is not None:
                break
        if "serving on" not in line:
            raise RuntimeError(f"coordinator did not start: {line!r}; see {self.log_path}")
        self.url = line.split("serving on", 1)[1].strip()
        self.port = int(self.url.rsplit(":", 1)[1])
        return self.url

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
