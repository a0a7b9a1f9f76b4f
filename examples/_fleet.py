"""What examples/elastic_join.py and examples/two_datacenters.py share: seeded versions,
their checksum, the trainer/engine process they script, and the driver's handle on it.

A worker process (``python examples/<example>.py worker NAME URL LOCALITY``) connects a Hub
and answers JSON lines on stdin: ``publish`` (trainer: a new version in place, keeping the
last two), ``follow`` (engine: move to the newest version in place and serve it),
``direct`` (read a version's complete replicas only, keep nothing: a baseline) and
``leave`` (close the Hub: its replicas go, readers go elsewhere).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's log chatter

MODEL = "policy"
MiB = 1 << 20


def weights_for(version_seed: int, mib: int) -> dict:
    """A version's tensors: fixed by the seed, so every process can tell right bytes from wrong."""
    import torch

    g = torch.Generator().manual_seed(version_seed)
    n = 8
    per = (mib * MiB) // n // 4
    return {f"model.layers.{i}.mlp.weight": torch.randn(per, generator=g).view(64, -1) for i in range(n)}


def checksum(tensors: dict) -> str:
    import torch

    h = hashlib.sha256()
    for k in sorted(tensors):
        h.update(k.encode())
        h.update(tensors[k].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def worker(name: str, url: str, locality: str) -> int:
    """A trainer or an engine, driven by JSON lines on stdin (see the module docstring)."""
    import tensorhub

    hub = tensorhub.connect(url, worker_id=name, locality=locality)
    hub.endpoint  # start the data plane now rather than in the first timed call
    published: list[int] = []   # trainer: versions it serves, oldest first
    seen: Optional[int] = None  # engine: the version it runs
    params: Optional[dict] = None

    def say(**kw: Any) -> None:
        print(json.dumps(kw), flush=True)

    def read(f: Any) -> dict:
        return {"version": f.version, "sha256": checksum(f), "seconds": f.seconds, "sources": f.sources}

    say(ok="ready")
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "publish":  # trainer: a new version, in place; keep the last two
                w = weights_for(cmd["seed"], cmd["mib"])
                v = hub.publish(MODEL, w)
                published.append(v)
                if len(published) > 2:
                    hub.unpublish(MODEL, published.pop(0), timeout=60)  # waits for its readers
                say(ok={"version": v, "sha256": checksum(w)})
            elif cmd["op"] == "follow":  # engine: move to the newest version
                v = hub.wait_for_version(MODEL, newer_than=seen, timeout=60)
                if params is not None:
                    hub.unpublish(MODEL, seen, timeout=60)  # our readers drain; then we may overwrite
                f = hub.fetch(MODEL, v, into=params)     # serve=True: we become a source of v
                params, seen = dict(f), v
                say(ok=read(f))
            elif cmd["op"] == "direct":  # the baseline: read complete replicas only, keep nothing
                hub.pipelined = False
                try:
                    f = hub.fetch(MODEL, cmd["version"], serve=False)
                finally:
                    hub.pipelined = True
                say(ok=read(f))
            elif cmd["op"] == "leave":
                hub.close()                              # drops our replicas; readers go elsewhere
                say(ok=True)
                return 0
        except Exception as e:  # noqa: BLE001 - reported to the driver
            say(error=f"{type(e).__name__}: {e}")
    hub.close()
    return 0


class Proc:
    """The driver's handle on one worker process: ``script worker NAME URL LOCALITY``, on
    loopback or, with ``tb`` (benchmarks/testbed.py), inside the namespace of host ``name``."""

    def __init__(self, script: str, name: str, url: str, locality: str, log_dir: Path, tb: Any = None) -> None:
        self.name = name
        self.log = log_dir / f"{name}.log"
        argv = [sys.executable, script, "worker", name, url, locality]
        if tb is not None:
            self.p = tb.spawn(name, argv, stderr=open(self.log, "w"))
        else:
            self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=open(self.log, "w"), text=True)
        self.recv()  # "ready"

    def send(self, **cmd: Any) -> None:
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()

    def recv(self) -> Any:
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} exited; its log:\n{self.log.read_text()[-3000:]}")
        msg = json.loads(line)
        if "error" in msg:
            raise RuntimeError(f"{self.name}: {msg['error']}")
        return msg["ok"]

    def call(self, **cmd: Any) -> Any:
        self.send(**cmd)
        return self.recv()

    def stop(self) -> None:
        if self.p.poll() is None:
            try:
                self.p.stdin.close()
                self.p.wait(20)
            except (OSError, subprocess.TimeoutExpired):
                self.p.kill()
                self.p.wait(10)
