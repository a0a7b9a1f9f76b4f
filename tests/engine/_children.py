"""What the vLLM and SGLang engine tests share: the CI rule for a missing engine, the child
environment, a child process driven by JSON lines, and a trainer process that publishes
the tiny Llama's weights.

``_engines.py`` (vLLM) and ``tests/sglang/_sglang_procs.py`` (SGLang) build on these and
keep the names their tests import (``OfflineEngine``, ``SGLangWorker``, ``Publisher``,
``Trainer``, ``require_vllm``, ``require_sglang``, ...).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import pytest

HERE = Path(__file__).parent  # tests/engine: _tiny.py, the child scripts
ROOT = HERE.parent.parent


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def require(module: str, why: str, what: str) -> None:
    """Skip when ``module`` cannot be imported; fail instead in CI (``CI`` set and not false):
    a skipped engine suite must never count as a pass there. ``why`` says how to install
    it, ``what`` names the tests that need it."""
    if importlib.util.find_spec(module) is not None:
        return
    if in_ci():
        pytest.fail(f"{what} need {module} in CI: {why}")
    pytest.skip(why)


def child_env(base: dict, extra: Optional[dict] = None, paths: tuple = ()) -> dict:
    """This process's environment with ``base`` and ``extra`` on top; the checkout and
    ``paths`` lead PYTHONPATH."""
    env = {**os.environ, **base, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), *map(str, paths), env.get("PYTHONPATH")]))
    return env


def files_digest(model_dir: Path) -> str:
    """One digest of a model directory's config and weight files (what a reference engine's
    answer depends on): the key under which a reference answer is kept."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} has no weight files to take a reference from")
    h = hashlib.sha256()
    for f in [Path(model_dir) / "config.json", *files]:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


class ChildError(Exception):
    """A child did not start, exited, answered an error or did not answer in time."""


class LineChild:
    """A child process that answers ``@@<json>`` lines on stdout to commands sent as JSON
    lines on stdin (``{"op": ..., ...}`` -> ``{"ok": result}`` or ``{"error": ...}``); its
    first answer, within ``timeout``, says it is ready (or ``{"error": ...}``, then it exits);
    a command waits ``call_timeout`` (default: ``timeout``). Other stdout lines and stderr go
    to ``log``. ``close()`` sends ``exit`` and kills a child that does not go."""

    error: type[Exception] = ChildError
    what = "child"

    def __init__(self, log: Path, argv: list[str], env: dict, cwd: Path, timeout: float,
                 call_timeout: Optional[float] = None) -> None:
        self.log_path = log
        self._log = open(log, "w")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, env=env, cwd=str(cwd))
        self.call_timeout = timeout if call_timeout is None else call_timeout
        self.first = self._read(timeout)
        if "error" in self.first:
            self.close()
            raise self.error(self.first["error"])

    def _read(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise self.error(f"{self.what} exited (rc {self.proc.poll()}); log {self.log_path}:\n"
                                 f"{self.log_tail()}")
            if line.startswith("@@"):
                return json.loads(line[2:])
            self._log.write(line)  # the engines log to stdout too
        raise self.error(f"{self.what} did not answer in time")

    def call(self, op: str, timeout: Optional[float] = None, **kw: Any) -> Any:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        msg = self._read(self.call_timeout if timeout is None else timeout)
        if "error" in msg:
            raise self.error(msg["error"])
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
sys.path.insert(0, sys.argv[3])
import tensorhub
from _tiny import make_weights
hub = tensorhub.connect(sys.argv[1], worker_id=sys.argv[4])
print("@@", hub.publish("policy", make_weights(int(sys.argv[2]))), flush=True)
time.sleep(3600)
"""


class PublisherProcess:
    """A trainer process that publishes ``make_weights(seed)`` as a new version of ``policy``
    and holds it until killed (``kill()`` sends SIGKILL)."""

    def __init__(self, url: str, seed: int, worker_id: str, env: dict) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _PUBLISHER, url, str(seed), str(HERE), worker_id],
                                     stdout=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()
        if not line.startswith("@@"):
            self.kill()
            raise RuntimeError(f"{type(self).__name__.lower()} failed: {line!r}")
        self.version = int(line.split()[1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
