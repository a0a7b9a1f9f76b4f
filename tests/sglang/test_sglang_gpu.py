"""End to end on a GPU host with a CUDA build of SGLang: two real SGLang servers.

Server A starts with ``on_missing="disk"`` (publishes its weight files as v1); server B
starts from peers (``--load-format tensorhub``, config-only model dir) and must answer
greedy prompts like A. A trainer publishes v2; ``tensorhub follow --engine
sglang+http://B`` swaps B (pause, begin, update_weights_from_tensor with the pull function,
end, continue), and B must then answer like a third server started on v2's safetensors.

Skipped cleanly unless CUDA, SGLang and Mooncake are all present (the CPU suite covers
the same code against SGLang's modules: test_sglang_adapter.py).
"""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.engine]


def _gpu_ready() -> str | None:
    for mod in ("sglang", "mooncake", "torch"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU"
    return None


@pytest.fixture(scope="module", autouse=True)
def _need_gpu():
    why = _gpu_ready()
    if why:
        pytest.skip(f"SGLang GPU end-to-end test: {why}")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, log: Path, model_dir: Path, args: list[str], env: dict) -> None:
        import httpx

        self.port = _port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log, "w")
        self.log = log
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--host", "127.0.0.1",
               "--port", str(self.port), "--mem-fraction-static", "0.2", "--disable-cuda-graph",
               "--custom-weight-loader", "tensorhub.integrations.sglang.pull.pull", *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {log.read_text()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"server not ready: {log.read_text()[-4000:]}")

    def generate(self, prompts: list[str]) -> list[str]:
        import httpx

        out = []
        for p in prompts:
            r = httpx.post(f"{self.url}/generate", json={"text": p, "sampling_params": {
                "temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}, timeout=120)
            r.raise_for_status()
            out.append(r.json()["text"])
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


def test_two_sglang_servers_start_from_peers_and_hot_swap(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent.parent / "engine"))
    from _tiny import PROMPTS, make_model_dir

    from _sglang_procs import Trainer, env
    from tensorhub.testing import CoordinatorProcess

    coord = CoordinatorProcess(tmp_path / "state")
    url = coord.start()
    e = env({"TENSORHUB_COORDINATOR": url})
    disk1 = make_model_dir(tmp_path / "v1", seed=1)
    disk2 = make_model_dir(tmp_path / "v2", seed=2)
    cfg = make_model_dir(tmp_path / "cfg", seed=0, weights=False)
    servers: list[Server] = []
    trainer = None
    try:
        a = Server(tmp_path / "a.log", disk1, ["--load-format", "tensorhub", "--model-loader-extra-config",
                                               json.dumps({"model": "policy", "on_missing": "disk"})], e)
        servers.append(a)
        b = Server(tmp_path / "b.log", cfg, ["--load-format", "tensorhub", "--model-loader-extra-config",
                                             json.dumps({"model": "policy"})], e)
        servers.append(b)
        assert b.generate(PROMPTS) == a.generate(PROMPTS)
        trainer = Trainer(url, 2, "trainer-2")
        f = subprocess.run([sys.executable, "-m", "tensorhub", "follow", "--engine", f"sglang+{b.url}",
                            "--model", "policy", "--coordinator", url, "--max-swaps", "1"],
                           capture_output=True, text=True, timeout=600, env=e)
        assert f.returncode == 0 and f.stdout.splitlines()[-1].startswith(f"v{trainer.version}: stall"), \
            f.stdout + f.stderr
        ref = Server(tmp_path / "ref.log", disk2, [], e)
        servers.append(ref)
        assert b.generate(PROMPTS) == ref.generate(PROMPTS)
    finally:
        for s in servers:
            s.close()
        if trainer is not None:
            trainer.kill()
        coord.stop()
