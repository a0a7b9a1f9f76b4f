"""Helpers for the SGLang adapter tests: SGLang worker processes (see _sgl_worker.py), a
tiny-Llama trainer that publishes HF weights, and the CI rule for a missing SGLang.

Without SGLang these tests skip, except in CI (``CI`` set), where they fail: a skipped
adapter suite must never count as a pass there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import pytest

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
ENGINE = ROOT / "tests" / "engine"  # the tiny Llama (_tiny.py) the vLLM tests use
if str(ENGINE) not in sys.path:
    sys.path.append(str(ENGINE))
ENV = {"GLOG_minloglevel": "2", "TOKENIZERS_PARALLELISM": "false", "TENSORHUB_HEARTBEAT_INTERVAL": "0.5",
       "SGLANG_PLUGINS": "tensorhub", "OMP_NUM_THREADS": "1"}


def _sglang_missing() -> Optional[str]:
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed (scripts/setup.sh installs sglang==0.5.23 --no-deps for CPU tests)"
    return None


def require_sglang() -> None:
    """Skip (fail in CI) when SGLang cannot be imported."""
    why = _sglang_missing()
    if why is None:
        return
    if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
        pytest.fail(f"SGLang adapter tests need sglang in CI: {why}")
    pytest.skip(why)


def env(extra: Optional[dict] = None) -> dict:
    e = {**os.environ, **ENV, **(extra or {})}
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(ENGINE), e.get("PYTHONPATH")]))
    return e


def run_py(code: str, timeout: float = 300, extra_env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (shim available as ``_torchvision_shim``)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env=env({"PYTHONPATH": str(HERE), **(extra_env or {})}), cwd=str(HERE))


class SGLangError(Exception):
    pass


class SGLangWorker:
    """``_sgl_worker.py`` in a child process: a real SGLang model on CPU."""

    def __init__(self, log: Path, model_dir: Path, load_format: str, extra: Optional[dict] = None,
                 timeout: float = 300) -> None:
        self.log_path = log
        self._log = open(log, "w")
        cfg = {"model_dir": str(model_dir), "load_format": load_format, "extra": extra or {}}
        self.proc = subprocess.Popen([sys.executable, str(HERE / "_sgl_worker.py"), json.dumps(cfg)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     env=env(), cwd=str(HERE))
        msg = self._read(timeout)
        if "error" in msg:
            self.close()
            raise SGLangError(msg["error"])
        self.ready = msg["ready"]

    def _read(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise SGLangError(f"worker exited (rc {self.proc.poll()}); log {self.log_path}:\n{self.log_tail()}")
            if line.startswith("@@"):
                return json.loads(line[2:])
            self._log.write(line)
        raise SGLangError("worker did not answer in time")

    def call(self, op: str, timeout: float = 300, **kw: Any) -> Any:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        msg = self._read(timeout)
        if "error" in msg:
            raise SGLangError(msg["error"])
        return msg["ok"]

    def log_tail(self, n: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text()[-n:]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("exit", timeout=30)
                self.proc.wait(30)
            except Exception:
                self.proc.kill()
                self.proc.wait(30)
        self._log.close()


_PUBLISHER = r"""
import sys, time
import tensorhub
from _tiny import make_weights
hub = tensorhub.connect(sys.argv[1], worker_id=sys.argv[3])
print("@@", hub.publish("policy", make_weights(int(sys.argv[2]))), flush=True)
time.sleep(3600)
"""


class Trainer:
    """A process that publishes the tiny Llama's HF weights of ``seed`` as a new version of
    ``policy`` and holds them until killed."""

    def __init__(self, url: str, seed: int, worker_id: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _PUBLISHER, url, str(seed), worker_id],
                                     stdout=subprocess.PIPE, text=True, env=env())
        line = self.proc.stdout.readline()
        if not line.startswith("@@"):
            self.kill()
            raise RuntimeError(f"trainer failed: {line!r}")
        self.version = int(line.split()[1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


def status(url: str) -> dict:
    import httpx

    return httpx.get(f"{url}/v1/status", timeout=10).json()


def replicas(url: str, version: int) -> list[dict]:
    for m in status(url)["models"]:
        if m["model"] == "policy":
            for v in m["versions"]:
                if v["version"] == version:
                    return v["replicas"]
    return []
