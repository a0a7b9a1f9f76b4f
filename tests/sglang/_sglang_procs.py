"""Helpers for the SGLang adapter tests: SGLang worker processes (see _sgl_worker.py), a
tiny-Llama trainer that publishes HF weights, and the CI rule for a missing SGLang; the
parts the vLLM tests share live in tests/engine/_children.py.

Without SGLang these tests skip, except in CI (``CI`` set and not false), where they fail:
a skipped adapter suite must never count as a pass there.
"""

from __future__ import annotations

import atexit
import json
import subprocess
import sys
from pathlib import Path
from typing import Optional

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
ENGINE = ROOT / "tests" / "engine"  # the tiny Llama (_tiny.py) the vLLM tests use
if str(ENGINE) not in sys.path:
    sys.path.append(str(ENGINE))
from _children import ChildError, LineChild, PublisherProcess, child_env, files_digest, require  # noqa: E402

ENV = {"GLOG_minloglevel": "2", "TOKENIZERS_PARALLELISM": "false", "TENSORHUB_HEARTBEAT_INTERVAL": "0.5",
       "SGLANG_PLUGINS": "tensorhub", "OMP_NUM_THREADS": "1"}


def require_sglang() -> None:
    """Skip (fail in CI) when SGLang cannot be imported."""
    require("sglang", "sglang is not installed (scripts/setup.sh installs sglang==0.5.23 --no-deps for CPU tests)",
            "SGLang adapter tests")


def env(extra: Optional[dict] = None) -> dict:
    return child_env(ENV, extra, paths=(ENGINE,))


def run_py(code: str, timeout: float = 300, extra_env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (shim available as ``_torchvision_shim``)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env=env({"PYTHONPATH": str(HERE), **(extra_env or {})}), cwd=str(HERE))


class SGLangError(ChildError):
    pass


class SGLangWorker(LineChild):
    """``_sgl_worker.py`` in a child process: a real SGLang model on CPU."""

    error, what = SGLangError, "worker"

    def __init__(self, log: Path, model_dir: Path, load_format: str, extra: Optional[dict] = None,
                 timeout: float = 300) -> None:
        cfg = {"model_dir": str(model_dir), "load_format": load_format, "extra": extra or {}}
        super().__init__(log, [sys.executable, str(HERE / "_sgl_worker.py"), json.dumps(cfg)], env(), HERE,
                         timeout=timeout, call_timeout=300)
        self.ready = self.first["ready"]


class _References:
    """Parameter digests of SGLang's own default loader (``auto``) on a model directory's
    weight files, without a worker start each time: one ``auto`` worker per model config
    serves the test process; it starts on the first directory asked about and reads each
    later one's weight files in place with the same loader (``reload``). Answers are kept by
    the files' digest, so the same bytes are loaded once. The workers are closed when the test
    process exits (``atexit``)."""

    def __init__(self) -> None:
        self.workers: dict[str, SGLangWorker] = {}  # config.json text -> worker
        self.loaded: dict[str, str] = {}  # config.json text -> files digest loaded now
        self.answers: dict[str, dict] = {}

    def digest(self, model_dir: Path) -> dict:
        model_dir = Path(model_dir)
        config, key = (model_dir / "config.json").read_text(), files_digest(model_dir)
        if key not in self.answers:
            w = self.workers.get(config)
            if w is None or w.proc.poll() is not None:
                if not self.workers:
                    atexit.register(self.close)
                w = self.workers[config] = SGLangWorker(model_dir / "reference.log", model_dir, "auto")
            elif self.loaded[config] != key:
                w.call("reload", path=str(model_dir))
            self.loaded[config] = key
            self.answers[key] = w.call("digest")
        return dict(self.answers[key])

    def close(self) -> None:
        for w in self.workers.values():
            w.close()
        self.workers.clear()


_REFERENCES = _References()


def reference_digest(model_dir: Path) -> dict:
    """Parameter digests of SGLang's own default loader on ``model_dir``'s weight files: what
    ``SGLangWorker(log, model_dir, "auto").call("digest")`` answers, from one worker shared by
    the test process (_References)."""
    return _REFERENCES.digest(model_dir)


class Trainer(PublisherProcess):
    """A process that publishes the tiny Llama's HF weights of ``seed`` as a new version of
    ``policy`` and holds them until killed."""

    def __init__(self, url: str, seed: int, worker_id: str) -> None:
        super().__init__(url, seed, worker_id, env())


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
