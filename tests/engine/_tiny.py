"""A tiny Llama made locally (no download): config, a WordLevel tokenizer, seeded weights.

``make_model_dir(path, seed, weights=True)`` writes a directory vLLM can serve with
``--model path``; with ``weights=False`` it holds only ``config.json`` and the tokenizer
(what an engine that loads from peers gets). float32 throughout (bf16 crashes on these
CPUs).
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 512
WORDS = [f"w{i}" for i in range(VOCAB - 4)]
PROMPTS = ["w1 w2 w3", "w10 w20 w30 w40", "w7", "w100 w200 w300 w400 w5"]


def _tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3}
    for i, w in enumerate(WORDS):
        vocab[w] = i + 4
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(str(path))


def config_dict() -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "float32", "dtype": "float32",
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3, "hidden_act": "silu",
    }


def make_weights(seed: int) -> dict:
    """HF-named float32 tensors of the tiny Llama, seeded (std 0.5 so greedy outputs vary)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**{k: v for k, v in config_dict().items() if k not in ("architectures", "dtype")})
    model = LlamaForCausalLM(cfg).to(torch.float32)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.state_dict().items():
        if name.endswith("norm.weight") or "layernorm" in name:
            t = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
        else:
            t = 0.5 * torch.randn(p.shape, generator=g)
        out[name] = t.to(torch.float32).contiguous()
    return out


def make_model_dir(path: Path, seed: int = 0, weights: bool = True) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config_dict(), indent=1))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    _tokenizer(path)
    if weights:
        save_file(make_weights(seed), str(path / "model.safetensors"))
    return path


def save_model_dir(path: Path, weights: dict) -> Path:
    """A model directory (config, tokenizer) with ``weights`` as its weight file."""
    from safetensors.torch import save_file

    d = make_model_dir(path, weights=False)
    save_file(weights, str(d / "model.safetensors"))
    return d


def changed_weights(prev: dict, seed: int, frac: float = 0.03) -> dict:
    """``prev`` with ``frac`` of each tensor's elements changed (seeded): what one training
    step does to a policy, for the delta tests."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, t in prev.items():
        t = t.clone()
        flat = t.view(-1)
        idx = torch.randperm(flat.numel(), generator=g)[: max(1, int(frac * flat.numel()))]
        flat[idx] += 0.5 * torch.randn(idx.numel(), generator=g)
        out[k] = t
    return out
