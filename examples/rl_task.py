"""The toy RL task, the tiny Llama and its trainer, shared by ``demo.py`` and ``rl_loop_vllm.py``.

* The task: counting in steps. After ``w5 w7 w9`` comes ``w11`` (stride 1-5, read from the
  prompt; mod ``WORDS``). A rollout is a greedy continuation of 4 tokens after 3 given;
  its score is the fraction of right tokens.
* The model: a tiny Llama (made locally, no download): ``make_model_dir`` writes the
  directory an engine starts from (``config.json`` and a WordLevel tokenizer, no weights:
  the weights come from the trainer over TensorHub).
* The trainer (``python examples/rl_task.py trainer URL``, a process of its own): trains
  the model (transformers + torch, AdamW), and every ``--steps`` optimizer steps copies
  the parameters into a snapshot and publishes it in the ``hf`` layout (in place, no
  further copy). It talks to its parent over stdout (``@@ {json}`` per published
  version: version, loss, step, bytes, and the snapshot's own greedy rollouts with their
  logprobs, so the parent can check that an engine really runs that version) and
  stdin (``swapped V`` once the rollout engines run V: the trainer then unpublishes the
  versions before V, which returns once no reader holds a lease on them, and publishes
  the next one; the next version's training overlaps the engines' swap).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

MODEL = "policy"
WORDS = 60            # the task counts modulo WORDS
SPECIAL = 4           # <unk> <s> </s> <pad>
VOCAB = SPECIAL + WORDS
SEQ = 8
STRIDES = 5
NEW_TOKENS = 4        # tokens a rollout generates
BATCH = 64            # sequences per optimizer step
LR = 3e-4
TIE = 1e-3            # probe tokens whose top-2 logits are closer than this may differ between engines
LOGPROB_TOL = 1e-3    # an engine's logprobs vs the trainer's (float32 both; ~1e-5 apart here)


def config_dict() -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
        "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,  # 9.6 MB in float32
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,  # CPU attention: head_dim >= 32
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


def counting(starts: list, strides: list, length: int) -> list:
    """Token ids of ``w{s} w{s+d} w{s+2d} ...`` (mod WORDS) per start s and stride d."""
    return [[SPECIAL + (s + i * d) % WORDS for i in range(length)] for s, d in zip(starts, strides)]


def probes(n: int = 24) -> tuple[list, list, list]:
    """The rollout prompts (3 tokens each): ``(starts, strides, prompt token ids)``."""
    starts = list(range(0, WORDS, WORDS // n))[:n]
    strides = [1 + i % STRIDES for i in range(n)]
    return starts, strides, counting(starts, strides, 3)


def score(outputs: list) -> float:
    """Fraction of right tokens in greedy rollouts of :func:`probes` (token id lists)."""
    starts, strides, _ = probes(len(outputs))
    right = total = 0
    for s, d, got in zip(starts, strides, outputs):
        exp = counting([s], [d], 3 + NEW_TOKENS)[0][3:]
        right += sum(a == b for a, b in zip(got, exp))
        total += len(exp)
    return right / total


def words(ids: list) -> str:
    return " ".join(f"w{t - SPECIAL}" if t >= SPECIAL else f"<{t}>" for t in ids)


def check(ids: list, logprobs: list, pub: dict, prev: Optional[dict] = None) -> dict:
    """Does an engine run the version the trainer published as ``pub``?

    ``ids``, ``logprobs``: the engine's greedy rollouts of :func:`probes` and the logprob of
    each generated token. They must equal the trainer's own rollouts of that snapshot, and
    their logprobs must be within ``LOGPROB_TOL`` of the trainer's (rollouts that pass a near
    tie, top-2 logits within ``TIE``, are skipped: float32 kernels may break it either way).
    Returns ``problem`` (None when it runs ``pub``), ``logprob_err``, and how far the version
    before (``prev``) is from what the engine runs (``prev_differ``: rollouts that differ,
    ``prev_off``: largest logprob gap on the others), which shows the check tells the two
    apart; ``note`` says it in words."""
    def distance(ref: dict) -> tuple[list[int], float]:
        wrong, worst = [], 0.0
        for i, (a, la, b, lb, m) in enumerate(zip(ids, logprobs, ref["reference"], ref["logprobs"], pub["margins"])):
            if m < TIE:
                continue
            if a != b:
                wrong.append(i)
            else:
                worst = max([worst] + [abs(x - y) for x, y in zip(la, lb)])
        return wrong, worst

    wrong, worst = distance(pub)
    out: dict = {"problem": None, "logprob_err": worst, "prev_differ": None, "prev_off": None}
    if wrong:
        _, _, prompts = probes(len(ids))
        i = wrong[0]
        out["problem"] = (f"{len(wrong)} rollout(s) differ from the trainer's v{pub['version']}, e.g. "
                          f"{words(prompts[i])} -> {words(ids[i])}, trainer {words(pub['reference'][i])}")
    elif worst > LOGPROB_TOL:
        out["problem"] = f"logprobs differ from the trainer's v{pub['version']} by up to {worst:.2g}"
    note = f"logprobs within {worst:.0e}"
    if prev is not None:
        pw, pd = distance(prev)
        out["prev_differ"], out["prev_off"] = len(pw), pd
        note += f"; v{prev['version']}'s: " + (f"{len(pw)} rollouts differ" if pw else f"logprobs {pd:.2g} off")
        if not pw and pd <= LOGPROB_TOL:
            note += " (too close to tell apart)"
    out["note"] = note
    return out


def reference(model, prompts: list) -> tuple[list, list, list]:
    """The snapshot's own greedy rollouts (transformers, no cache), the logprob of each of
    their tokens and, per rollout, the smallest gap between the top-2 logits along it."""
    import torch

    ids = torch.tensor(prompts)
    margin = torch.full((len(prompts),), float("inf"))
    lps = []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(input_ids=ids).logits[:, -1].float()
            top = logits.topk(2, dim=-1).values
            margin = torch.minimum(margin, top[:, 0] - top[:, 1])
            nxt = logits.argmax(-1, keepdim=True)
            lps.append(torch.log_softmax(logits, -1).gather(1, nxt))
            ids = torch.cat([ids, nxt], dim=1)
    return ids[:, -NEW_TOKENS:].tolist(), torch.cat(lps, 1).tolist(), margin.tolist()


# ---------------------------------------------------------------- trainer process

def train_steps(model, opt, g, steps: int) -> float:
    """``steps`` AdamW steps on random counting sequences; the last loss."""
    import torch

    model.train()
    loss = float("nan")
    for _ in range(steps):
        starts = torch.randint(0, WORDS, (BATCH,), generator=g).tolist()
        strides = torch.randint(1, STRIDES + 1, (BATCH,), generator=g).tolist()
        batch = torch.tensor(counting(starts, strides, SEQ))
        out = model(input_ids=batch, labels=batch)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        loss = out.loss.item()
    return loss


def trainer(url: str, versions: int, steps: int) -> None:
    """Train, publish each version, unpublish old ones once the engines moved on (see the
    module docstring for the protocol with the parent)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import tensorhub

    torch.set_num_threads(1)  # two cores: leave one to the engines
    torch.manual_seed(0)
    cfg = LlamaConfig(**{k: v for k, v in config_dict().items() if k not in ("architectures", "dtype")})
    model = LlamaForCausalLM(cfg).to(torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    g = torch.Generator().manual_seed(1)
    held: dict = {}  # version -> the snapshot TensorHub serves from (must not change while published)
    _, _, prompts = probes()
    with tensorhub.connect(url, worker_id="trainer") as hub:
        loss = float("nan")
        for k in range(versions):
            if k > 0:
                loss = train_steps(model, opt, g, steps)
                last = max(held)
                line = sys.stdin.readline()  # wait until the engines run the last version
                if line.strip() != f"swapped {last}":
                    raise SystemExit(f"trainer: expected 'swapped {last}', got {line!r}")
                for old in [v for v in held if v < last]:
                    hub.unpublish(MODEL, old, timeout=60)  # returns once no reader holds a lease
                    del held[old]
            model.eval()
            snap = {n: t.detach().clone().contiguous() for n, t in model.state_dict().items()}
            ref, lps, margins = reference(model, prompts)
            v = hub.publish(MODEL, snap)  # hf layout: HF checkpoint names, full tensors
            held[v] = snap
            nbytes = sum(t.numel() * t.element_size() for t in snap.values())
            print("@@ " + json.dumps({"version": v, "loss": loss, "step": k * steps, "nbytes": nbytes,
                                      "reference": ref, "logprobs": lps, "margins": margins}), flush=True)
        sys.stdin.readline()  # the engines fetched the last version: keep serving until told to stop


def trainer_command(url: str, versions: int, steps: int) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "trainer", url, "--versions", str(versions),
            "--steps", str(steps)]


def read_published(proc: subprocess.Popen) -> dict:
    """The trainer's next ``@@`` message (what it published)."""
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"trainer exited (rc {proc.poll()})")
        if line.startswith("@@ "):
            return json.loads(line[3:])


def main() -> int:
    import argparse

    p = argparse.ArgumentParser(description="The trainer process of the examples (started by them).")
    p.add_argument("role", choices=["trainer"])
    p.add_argument("url", help="coordinator URL")
    p.add_argument("--versions", type=int, default=8)
    p.add_argument("--steps", type=int, default=15)
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    trainer(args.url, args.versions, args.steps)
    return 0


if __name__ == "__main__":
    import os

    os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's log chatter
    sys.exit(main())
