"""LoRA adapter versions: what ``Hub.publish(kind="lora", ...)`` checks before anything is
published, and how an adapter's base is named.

An adapter version is an ordinary version of its own model (e.g. ``policy-lora``): its
tensors are the PEFT checkpoint's (``...q_proj.lora_A.weight``, ``...q_proj.lora_B.weight``),
served, checksummed and delta-encoded like any version's; its manifest carries a
:class:`~tensorhub.protocol.VersionMeta` with ``kind="lora"``, the base model it adapts and
the PEFT config. Pure functions: no I/O, torch only through the tensors' attributes.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Optional

from ._exceptions import ConfigError
from .protocol import VersionMeta, parse_base

__all__ = ["version_meta", "parse_base", "module_of"]

#: ``<module>.lora_A.weight`` / ``lora_B`` (PEFT may put the adapter's name before
#: ``.weight``: ``lora_A.default.weight``) and the embedding forms.
_NAME = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_embedding_A|lora_embedding_B)(\.[^.]+)?(\.weight)?$")


def module_of(name: str) -> Optional[tuple[str, str]]:
    """``(module, part)`` of a PEFT LoRA tensor name (part: ``lora_A``, ``lora_B``,
    ``lora_embedding_A``, ``lora_embedding_B``); None for any other name."""
    m = _NAME.match(name)
    return (m["module"], m["part"]) if m else None


def version_meta(kind: str, base_model: Optional[str], config: Optional[Mapping[str, Any]],
                 tensors: Mapping[str, Any]) -> Optional[VersionMeta]:
    """The manifest's meta for ``Hub.publish(kind=, base_model=, config=)``, or None for
    full weights; refuses (``ConfigError``, one line naming the first problem) a LoRA
    adapter whose tensors are not PEFT LoRA pairs of the config's rank."""
    if kind not in ("full", "lora"):
        raise ConfigError(f"kind must be 'full' or 'lora', got {kind!r}")
    if kind == "full":
        if base_model is not None or config is not None:
            raise ConfigError("base_model and config describe a LoRA adapter: publish it with kind='lora'")
        return None
    if not isinstance(base_model, str) or not base_model:
        raise ConfigError("kind='lora' needs base_model='<model>' or '<model>@v<N>' (the model it adapts)")
    parse_base(base_model)
    if not isinstance(tensors, Mapping) or not tensors:
        raise ConfigError("a LoRA adapter's tensors must be a non-empty mapping of name -> torch.Tensor")
    if not isinstance(config, Mapping):
        raise ConfigError("kind='lora' needs config= (the PEFT adapter config: a dict or peft's LoraConfig.to_dict())")
    try:
        meta = VersionMeta(kind="lora", base=base_model, config=_plain(dict(config)))
    except ValueError as e:
        raise ConfigError(f"LoRA adapter: {_first_error(e)}") from None
    _check_tensors(tensors, meta.config)
    return meta


def _plain(config: dict) -> dict:
    """``peft``'s ``to_dict()`` holds sets (``target_modules``) and enums: JSON them."""
    out: dict = {}
    for k, v in config.items():
        if isinstance(v, (set, frozenset, tuple)):
            v = sorted(v) if isinstance(v, (set, frozenset)) else list(v)
        elif hasattr(v, "value") and not isinstance(v, (str, int, float, bool)):
            v = v.value  # an enum (peft_type, task_type)
        out[str(k)] = v
    return out


def _first_error(e: ValueError) -> str:
    errors = getattr(e, "errors", None)
    if callable(errors):
        first = errors()[0]
        return str(first.get("msg", e)).removeprefix("Value error, ")
    return str(e)


def _check_tensors(tensors: Mapping[str, Any], config: dict) -> None:
    ranks = {int(config["r"])} | {int(v) for v in (config.get("rank_pattern") or {}).values()}
    pairs: dict[str, dict[str, Any]] = {}
    for name, t in tensors.items():
        mp = module_of(name) if isinstance(name, str) else None
        if mp is None:
            raise ConfigError(f"LoRA adapter: tensor {name!r} is not a PEFT LoRA weight "
                              "('<module>.lora_A.weight' / '<module>.lora_B.weight')")
        shape = tuple(getattr(t, "shape", ()))
        if len(shape) != 2:
            raise ConfigError(f"LoRA adapter: tensor {name!r} has shape {list(shape)}; LoRA weights are matrices")
        pairs.setdefault(mp[0], {})[mp[1]] = shape
    for module, parts in pairs.items():
        a, b = (parts.get("lora_A"), parts.get("lora_B")) if "lora_A" in parts or "lora_B" in parts else \
            (parts.get("lora_embedding_A"), parts.get("lora_embedding_B"))
        if a is None or b is None:
            raise ConfigError(f"LoRA adapter: module {module!r} has {' and '.join(sorted(parts))} only; "
                              "each module needs its A and B")
        if a[0] != b[1]:
            raise ConfigError(f"LoRA adapter: module {module!r}: A is {list(a)} and B {list(b)}; "
                              "A's rows and B's columns are the rank and must agree")
        if a[0] not in ranks:
            raise ConfigError(f"LoRA adapter: module {module!r} has rank {a[0]}, the config's r is {config['r']}"
                              + (f" (rank_pattern: {sorted(ranks)})" if len(ranks) > 1 else ""))
