"""LoRA adapter versions on a real vLLM CPU engine: an OpenAI server started with
``--enable-lora`` and ``--load-format tensorhub`` loads adapter versions a trainer published
with ``kind="lora"`` through vLLM's own ``/v1/load_lora_adapter`` (named ``<model>@v<N>``,
path ``tensorhub://<model>/<N>``), read from the trainer's memory, no file written.

Greedy tokens with adapter vN equal those of a fresh engine given vN's files (a second,
offline engine: vLLM's own file loader on its own engine, so nothing of the served engine's
state can make them agree) and, on the same server, of vN's files loaded under another name
(both paths in one engine); they differ from the base model's. The fresh engine, a plain one
(weights from its files, the plug-in only), then loads vN offline through
``LoRARequest(..., "tensorhub://...")`` and gives the same tokens. A second version loads as
``@v<N+1>`` (read through a delta against v1 held by the engine). Bad input gets one clear
error each: an adapter for another base, a rank above ``--max-lora-rank``, an unknown
version, a version of full weights. A request running with a version when its name is
unloaded finishes with that adapter. ``tensorhub follow --lora 2`` then keeps the newest
two adapter versions loaded and unloads older ones."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from _engines import Coordinator, ServerEngine, engine_env, require_vllm
from _tiny import PROMPTS, make_model_dir, make_weights

pytestmark = pytest.mark.engine

RANK = 8
TARGETS = {"q_proj": ("self_attn", 128, 128), "v_proj": ("self_attn", 128, 64), "down_proj": ("mlp", 256, 128)}


def lora_config(r: int = RANK) -> dict:
    return {"r": r, "lora_alpha": 2 * r, "target_modules": sorted(TARGETS), "peft_type": "LORA", "bias": "none",
            "task_type": "CAUSAL_LM", "base_model_name_or_path": "policy"}


def make_adapter(seed: int, r: int = RANK) -> dict:
    """A seeded random PEFT LoRA adapter of the tiny Llama (scaled so greedy tokens change)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(2):
        for m, (block, n_in, n_out) in TARGETS.items():
            p = f"base_model.model.model.layers.{layer}.{block}.{m}"
            out[f"{p}.lora_A.weight"] = (0.3 * torch.randn(r, n_in, generator=g)).contiguous()
            out[f"{p}.lora_B.weight"] = (0.3 * torch.randn(n_out, r, generator=g)).contiguous()
    return out


def next_step(prev: dict, seed: int) -> dict:
    """The next training step's adapter: layer 1's B matrices new, the rest as they were
    (so its delta against ``prev`` is published: far fewer bytes than the adapter)."""
    new = make_adapter(seed)
    return {k: (new[k] if ".layers.1." in k and "lora_B" in k else v.clone()) for k, v in prev.items()}


def write_adapter(path: Path, tensors: dict, config: dict) -> Path:
    """The adapter as PEFT writes it: ``adapter_model.safetensors`` + ``adapter_config.json``."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


_REFERENCE = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
def main():
    model, adapters, prompts = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    llm = LLM(model=model, served_model_name="policy", dtype="float32", enforce_eager=True, max_model_len=128,
              enable_lora=True, max_lora_rank=%d, max_loras=2)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = {}
    for i, (name, path) in enumerate(adapters.items()):
        got = llm.generate(prompts, sp, lora_request=LoRARequest(name, i + 1, path), use_tqdm=False)
        out[name] = [o.outputs[0].text for o in got]
    print("@@" + json.dumps(out), flush=True)
if __name__ == "__main__":
    main()
""" % RANK


def _completions(srv: ServerEngine, model: str) -> list[str]:
    r = srv.post("/v1/completions", {"model": model, "prompt": PROMPTS, "max_tokens": 8, "temperature": 0,
                                     "ignore_eos": True})
    assert r.status_code == 200, r.text
    return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


def _load(srv: ServerEngine, name: str, path: str) -> httpx.Response:
    return srv.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})


def _in_flight(srv: ServerEngine) -> int:
    """Requests the engine holds now (running + waiting, from its Prometheus metrics)."""
    n = 0.0
    for line in httpx.get(f"{srv.url}/metrics", timeout=30).text.splitlines():
        if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")):
            n += float(line.rsplit(" ", 1)[1])
    return int(n)


def _models(srv: ServerEngine) -> set:
    return {m["id"] for m in httpx.get(f"{srv.url}/v1/models", timeout=30).json()["data"]}


def test_lora_versions_load_from_peers_and_equal_the_adapter_files(tmp_path):
    require_vllm()
    import tensorhub

    coord = Coordinator(tmp_path / "state")
    trainer = tensorhub.connect(coord.url, worker_id="trainer")
    srv = ref = follow = None
    try:
        trainer.publish("policy", make_weights(0))
        a1 = make_adapter(1)
        a2 = next_step(a1, 2)
        d1 = write_adapter(tmp_path / "a1", a1, lora_config())
        d2 = write_adapter(tmp_path / "a2", a2, lora_config())
        v1 = trainer.publish("policy-lora", a1, kind="lora", base_model="policy", config=lora_config())
        full = make_model_dir(tmp_path / "full", seed=0)
        bare = make_model_dir(tmp_path / "bare", weights=False)
        srv = ServerEngine(tmp_path / "server.log", bare, [
            "--load-format", "tensorhub", "--model-loader-extra-config", json.dumps({"model": "policy", "worker_id": "engine"}),
            "--enable-lora", "--max-lora-rank", str(RANK), "--max-loras", "2", "--max-cpu-loras", "4"],
            env={"TENSORHUB_COORDINATOR": coord.url, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}, wait=False)
        # The fresh reference engine starts beside it: vLLM's own loader on the adapter's files
        # first; then, offline, the same version through the plug-in on this plain engine (its
        # weights from its files, its Hub from TENSORHUB_COORDINATOR, its base by --served-model-name).
        ref = subprocess.Popen([sys.executable, "-c", _REFERENCE, str(full),
                                json.dumps({"ref-v1": str(d1), f"policy-lora@v{v1}": f"tensorhub://policy-lora/{v1}"}),
                                json.dumps(PROMPTS)], stdout=subprocess.PIPE, stderr=open(tmp_path / "ref.log", "w"),
                               text=True, env=engine_env({"TENSORHUB_COORDINATOR": coord.url}))
        srv.wait_ready()
        base = srv.generate(PROMPTS)

        r = _load(srv, f"policy-lora@v{v1}", f"tensorhub://policy-lora/{v1}")
        assert r.status_code == 200, r.text
        assert _load(srv, "files-v1", str(d1)).status_code == 200
        with_v1 = _completions(srv, f"policy-lora@v{v1}")
        assert with_v1 == _completions(srv, "files-v1")
        assert with_v1 != base
        # The engine's worker serves the adapter it read, like any version it fetched.
        holders = {x.worker_id for x in trainer.version_info("policy-lora", v1).replicas}
        assert {"trainer", "engine"} <= holders, holders

        # The next version, published as a delta against v1: a new name, never reused.
        v2 = trainer.publish("policy-lora", a2, kind="lora", base_model="policy", config=lora_config(), base=v1)
        assert _load(srv, f"policy-lora@v{v2}", f"tensorhub://policy-lora/{v2}").status_code == 200
        assert _load(srv, "files-v2", str(d2)).status_code == 200
        with_v2 = _completions(srv, f"policy-lora@v{v2}")
        assert with_v2 == _completions(srv, "files-v2") and with_v2 != with_v1
        assert _completions(srv, f"policy-lora@v{v1}") == with_v1  # v1 still serves its own tokens
        assert f"tensorhub://policy-lora/{v2} (policy-lora@v{v2}): " in srv.log_tail(400_000)
        assert "through delta(s) [(1, 2)]" in srv.log_tail(400_000)

        # Bad input: one clear error each.
        trainer.publish("other-lora", a1, kind="lora", base_model="other", config=lora_config())
        trainer.publish("wide-lora", make_adapter(3, r=16), kind="lora", base_model="policy", config=lora_config(16))
        for name, path, why in [
            ("other-lora@v1", "tensorhub://other-lora/1", "is for base model 'other'; this engine serves 'policy'"),
            ("wide-lora@v1", "tensorhub://wide-lora/1", "has rank 16; this engine was started with --max-lora-rank 8"),
            ("policy-lora@v9", "tensorhub://policy-lora/9", "'policy-lora' has no version 9 (newest complete: 2)"),
            ("policy@v1", "tensorhub://policy/1", "holds full weights, not a LoRA adapter"),
            ("bad", "tensorhub://policy-lora/x", "expected tensorhub://<model>/<version>"),
        ]:
            r = _load(srv, name, path)
            assert r.status_code >= 400 and why in r.text, (path, r.status_code, r.text)
            assert r.text.count(why) == 1, r.text
            assert name not in _models(srv)
        assert _completions(srv, f"policy-lora@v{v2}") == with_v2  # the engine is unharmed

        # The fresh engine given v1's files gives v1's tokens.
        out, _ = ref.communicate(timeout=400)
        line = next(x for x in out.splitlines() if x.startswith("@@"))
        fresh = json.loads(line[2:])
        assert fresh["ref-v1"] == with_v1
        assert fresh[f"policy-lora@v{v1}"] == with_v1  # offline, plain engine, through the plug-in

        # Unloading a name while a request runs with it: the request finishes with that adapter.
        # (Held in flight deterministically: the engine is paused with mode=keep -- vLLM's dev
        # route, which freezes running requests -- while the name is unloaded.)
        long = {"model": f"policy-lora@v{v1}", "prompt": PROMPTS[0], "max_tokens": 110, "temperature": 0,
                "ignore_eos": True}
        whole = srv.post("/v1/completions", long).json()["choices"][0]["text"]
        pieces, in_flight = [], None
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=dict(long, stream=True), timeout=240) as resp:
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
                if in_flight is None:  # the first token is out: pause, unload, resume
                    assert srv.post("/pause?mode=keep").status_code == 200
                    in_flight = _in_flight(srv)
                    assert srv.post("/v1/unload_lora_adapter", {"lora_name": f"policy-lora@v{v1}"}).status_code == 200
                    assert f"policy-lora@v{v1}" not in _models(srv)
                    assert srv.post("/resume").status_code == 200
        assert in_flight == 1, "the request was not running while its adapter was unloaded"
        assert "".join(pieces) == whole
        assert srv.post("/v1/completions", dict(long, max_tokens=2)).status_code == 404  # no new request takes it

        # tensorhub follow --lora 2: loads each new version as <model>@v<N>, keeps the newest 2.
        follow = subprocess.Popen(
            [sys.executable, "-m", "tensorhub", "follow", "--engine", srv.url, "--model", "policy-lora",
             "--coordinator", coord.url, "--lora", "2", "--max-swaps", "2"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=engine_env())
        time.sleep(3)
        v3 = trainer.publish("policy-lora", make_adapter(4), kind="lora", base_model="policy", config=lora_config())
        deadline = time.monotonic() + 120
        while f"policy-lora@v{v3}" not in _models(srv):
            assert time.monotonic() < deadline and follow.poll() is None, follow.stdout.read() if follow.poll() else ""
            time.sleep(0.5)
        v4 = trainer.publish("policy-lora", make_adapter(5), kind="lora", base_model="policy", config=lora_config())
        out, _ = follow.communicate(timeout=120)
        assert follow.returncode == 0, out
        names = _models(srv)
        assert {f"policy-lora@v{v3}", f"policy-lora@v{v4}"} <= names, (names, out)
        assert not {f"policy-lora@v{v1}", f"policy-lora@v{v2}"} & names, (names, out)
        assert _completions(srv, f"policy-lora@v{v4}") != _completions(srv, f"policy-lora@v{v3}")
        assert f"loaded policy-lora@v{v4}" in out and f"unloaded policy-lora@v{v2}" in out, out
        assert f"unloaded policy-lora@v{v1}" not in out  # unloaded by hand above
    except BaseException:
        if srv is not None:
            print(srv.log_tail(20_000))
        raise
    finally:
        for p in (ref, follow):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(30)
        if srv is not None:
            srv.close()
        trainer.close()
        coord.stop()
