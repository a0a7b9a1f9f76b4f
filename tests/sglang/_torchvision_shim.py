"""A stand-in ``torchvision`` for SGLang's CPU test processes only.

``sglang.srt.configs`` imports ``torchvision.transforms`` at module level (InternVL /
DeepSeek-OCR image preprocessing). PyPI's torchvision is a CUDA build that cannot be
imported next to torch 2.13.0+cpu (``operator torchvision::nms does not exist``), and it
breaks vLLM's imports in the same environment, so it is not installed. The test processes
that import SGLang install this shim first *only when no torchvision is importable*:
module attributes resolve to placeholders that raise when called. Nothing on the paths
under test (loader, plug-in, hooks, weight update, Llama) calls torchvision.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types

_MODULES = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional",
            "torchvision.transforms.v2", "torchvision.transforms.v2.functional", "torchvision.io",
            "torchvision.ops")


class _Missing:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> "_Missing":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(f"{self._name}: torchvision is not installed (SGLang CPU test shim)")


def _getattr(module: str):
    def get(attr: str) -> _Missing:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{module}.{attr}")

    return get


def install() -> bool:
    """Install the shim unless a real torchvision is importable; True when installed."""
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is not None:
        return False
    for name in _MODULES:
        m = types.ModuleType(name)
        m.__getattr__ = _getattr(name)  # type: ignore[method-assign]
        m.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        m.__path__ = []  # type: ignore[attr-defined]
        m.__version__ = "0.0.0"  # type: ignore[attr-defined]  # transformers parses it
        sys.modules[name] = m
    for name in _MODULES[1:]:
        parent, _, child = name.rpartition(".")
        setattr(sys.modules[parent], child, sys.modules[name])
    return True
