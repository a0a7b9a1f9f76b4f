"""A real etcd cluster on loopback ports, for the HA tests and ``bench_failover.py``.

``EtcdCluster(dir, members=3).start()`` runs ``members`` etcd processes (``/usr/bin/etcd``,
Debian's ``etcd-server``, installed by scripts/setup.sh); ``store_url`` is the
``--store`` value naming all of them; ``kill(i)`` SIGKILLs one member. Ports are picked
free at start (none hard-coded).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Optional

import httpx

__all__ = ["EtcdCluster", "etcd_binary"]


def etcd_binary() -> Optional[str]:
    """Path of the etcd server binary, or None."""
    return shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EtcdCluster:
    """``members`` etcd processes forming one cluster on 127.0.0.1."""

    def __init__(self, base_dir: str | os.PathLike, members: int = 1) -> None:
        self.dir = Path(base_dir)
        self.n = members
        self.client_ports = [_free_port() for _ in range(members)]
        self.peer_ports = [_free_port() for _ in range(members)]
        self.procs: list[Optional[subprocess.Popen]] = [None] * members

    @property
    def store_url(self) -> str:
        return "etcd://" + ",".join(f"127.0.0.1:{p}" for p in self.client_ports)

    def _cmd(self, i: int) -> list[str]:
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError("no etcd binary: apt-get install etcd-server (scripts/setup.sh does)")
        cluster = ",".join(f"e{k}=http://127.0.0.1:{self.peer_ports[k]}" for k in range(self.n))
        return [binary, "--name", f"e{i}", "--data-dir", str(self.dir / f"e{i}"),
                "--listen-client-urls", f"http://127.0.0.1:{self.client_ports[i]}",
                "--advertise-client-urls", f"http://127.0.0.1:{self.client_ports[i]}",
                "--listen-peer-urls", f"http://127.0.0.1:{self.peer_ports[i]}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_ports[i]}",
                "--initial-cluster", cluster, "--initial-cluster-state", "new",
                "--initial-cluster-token", f"tensorhub-{os.getpid()}",
                "--log-level", "error", "--logger", "zap"]

    def start(self, timeout: float = 30.0) -> "EtcdCluster":
        self.dir.mkdir(parents=True, exist_ok=True)
        for i in range(self.n):
            log = open(self.dir / f"e{i}.log", "a")
            self.procs[i] = subprocess.Popen(self._cmd(i), stdout=log, stderr=log)
            log.close()
        deadline = time.monotonic() + timeout
        for i in range(self.n):
            while not self.healthy(i):
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"etcd member {i} did not become healthy; see {self.dir}/e{i}.log")
                time.sleep(0.1)
        return self

    def healthy(self, i: int) -> bool:
        try:
            r = httpx.get(f"http://127.0.0.1:{self.client_ports[i]}/health", timeout=1.0)
            return r.status_code == 200 and r.json().get("health") == "true"
        except (httpx.HTTPError, ValueError):
            return False

    def kill(self, i: int) -> None:
        p = self.procs[i]
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait(10)

    def stop(self) -> None:
        for p in self.procs:
            if p is not None and p.poll() is None:
                p.terminate()
        for i, p in enumerate(self.procs):
            if p is not None:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    self.kill(i)

    def __enter__(self) -> "EtcdCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
