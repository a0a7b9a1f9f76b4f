"""Worker processes for the multi-process tests (spawned; real Hub, real Mooncake).

Each worker runs a command loop over a pipe, so a test can script several processes
step by step: publish, fetch, unpublish, and report what happened.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import time
import traceback
from typing import Any, Optional

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


def worker_main(conn: Any, url: str, name: str, token: Optional[str], gate: Any, first_done: Any,
                options: dict) -> None:
    os.environ.setdefault("GLOG_minloglevel", "2")
    import tensorhub
    from tensorhub.transport import MooncakeTransport

    transport = MooncakeTransport(host="127.0.0.1")
    if gate is not None:
        transport.start()
        gated = _Gated(transport, first_done, gate)
        # The Hub only calls start/endpoint/register/unregister/submit_read/poll/close.
        gated.start = lambda: transport.endpoint  # already started
        transport_for_hub: Any = gated
    else:
        transport_for_hub = transport
    try:
        hub = tensorhub.connect(url, worker_id=name, token=token, transport=transport_for_hub, **options)
    except Exception as e:
        conn.send(("error", type(e).__name__, str(e)))
        return
    published: dict[int, dict] = {}
    conn.send(("ready", hub.worker_id))
    while True:
        cmd, kw = conn.recv()
        try:
            if cmd == "publish":
                w = make_weights(kw["seed"], kw["nbytes"])
                v = hub.publish(MODEL, w, version=kw.get("version"))
                published[v] = w
                conn.send(("ok", v))
            elif cmd == "fetch":
                into = None
                if kw.get("into") is not None:
                    into = make_weights(0, kw["into"]["nbytes"])  # caller-shaped buffers
                    if kw["into"].get("break"):
                        import torch

                        k = next(iter(into))
                        if kw["into"]["break"] == "shape":
                            into[k] = torch.zeros(3, dtype=into[k].dtype)
                        else:
                            into[k] = torch.zeros(into[k].shape, dtype=torch.float64)
                f = hub.fetch(MODEL, kw.get("version"), serve=kw.get("serve", True), into=into)
                conn.send(("ok", {"version": f.version, "digest": digest(f), "sources": f.sources,
                                  "failed_sources": f.failed_sources, "nbytes": f.nbytes,
                                  "seconds": f.seconds}))
            elif cmd == "unpublish":
                t0 = time.monotonic()
                hub.unpublish(MODEL, kw["version"], timeout=kw.get("timeout"))
                waited = time.monotonic() - t0
                for t in published.pop(kw["version"], {}).values():
                    t.zero_()  # reuse the memory, as a trainer would
                conn.send(("ok", waited))
            elif cmd == "latest":
                conn.send(("ok", hub.latest(MODEL)))
            elif cmd == "held":
                conn.send(("ok", hub.held()))
            elif cmd == "exit":
                hub.close()
                conn.send(("ok", None))
                return
            else:
                conn.send(("error", "ValueError", f"unknown command {cmd}"))
        except Exception as e:  # report to the test, keep serving
            conn.send(("error", type(e).__name__, f"{e}\n{traceback.format_exc()}"))


class Worker:
    """Parent-side handle of a worker process."""

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
