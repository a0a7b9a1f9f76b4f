from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx
import pytest

# Mooncake's glog chatter goes to stderr of every process; keep test output readable.
os.environ.setdefault("GLOG_minloglevel", "2")
os.environ.setdefault("TENSORHUB_HEARTBEAT_INTERVAL", "0.5")


class CoordinatorProcess:
    """A real ``tensorhub coordinator`` process on a free port, restartable on the same port."""

    def __init__(self, state_dir: Path, token_file: Optional[Path] = None, extra: tuple[str, ...] = ()):
        self.state_dir = state_dir
        self.token_file = token_file
        self.extra = extra
        self.log_level = "warning"
        self.port = 0
        self.proc: Optional[subprocess.Popen] = None
        self.url = ""

    def start(self) -> str:
        cmd = [sys.executable, "-m", "tensorhub", "coordinator", "--host", "127.0.0.1",
               "--port", str(self.port), "--state-dir", str(self.state_dir), "--log-level", self.log_level,
               *self.extra]
        if self.token_file is not None:
            cmd += ["--token-file", str(self.token_file)]
        self.log_path = self.state_dir.parent / "coordinator.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
        deadline = time.monotonic() + 30
        line = ""
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if "serving on" in line or self.proc.poll() is not None:
                break
        if "serving on" not in line:
            raise RuntimeError(f"coordinator did not start: {line!r}")
        self.url = line.split("serving on", 1)[1].strip()
        self.port = int(self.url.rsplit(":", 1)[1])
        httpx.get(f"{self.url}/healthz", timeout=5).raise_for_status()
        return self.url

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


@pytest.fixture
def coordinator(tmp_path):
    c = CoordinatorProcess(tmp_path / "state")
    c.start()
    yield c
    c.stop()


@pytest.fixture
def embedded(tmp_path):
    """An in-process coordinator (real HTTP on loopback) for fast client tests."""
    from tensorhub._state import StateConfig
    from tensorhub.coordinator import EmbeddedCoordinator

    with EmbeddedCoordinator(tmp_path / "state", config=StateConfig(lease_ttl=5.0, worker_ttl=3.0)) as c:
        yield c
