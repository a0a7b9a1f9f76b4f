"""Tensors <-> manifests: specs, address ranges, destination buffers, ``into`` checks.

torch is imported inside functions, so ``import tensorhub`` works without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from ._checksum import compute
from ._exceptions import ConfigError, TensorMismatchError
from .protocol import DTYPE_SIZES, Manifest, TensorSpec

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["dtype_name", "manifest_of", "coalesce", "allocate_like", "empty_like", "check_into"]

#: Offsets of tensors inside a buffer TensorHub allocates are aligned to this.
ALIGN = 64


def dtype_name(dtype: "torch.dtype") -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise ConfigError(f"dtype {dtype} is not supported; supported: {', '.join(sorted(DTYPE_SIZES))}")
    return name


def _torch_dtype(name: str) -> "torch.dtype":
    import torch

    return getattr(torch, name)


def manifest_of(tensors: Mapping[str, Any], checksum: str = "off", *, shapes_only: bool = False
                ) -> tuple[Manifest, list[int]]:
    """The manifest of ``tensors`` (in their order) and each tensor's address; with the
    per-chunk checksums ``checksum`` (a ``_checksum.MODES`` setting) calls for.
    ``shapes_only``: only names, dtypes and shapes are read (``meta`` tensors will do).

    Refuses non-tensors, non-contiguous tensors and unsupported dtypes, naming the tensor."""
    import torch

    if not isinstance(tensors, Mapping) or not tensors:
        raise ConfigError("tensors must be a non-empty mapping of name -> torch.Tensor")
    specs, addrs = [], []
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise ConfigError(f"tensor names must be str, got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
        if not t.is_contiguous():
            raise ConfigError(f"tensor {name!r} is not contiguous; publish t.contiguous() instead")
        if not shapes_only and t.device.type not in ("cpu", "cuda"):
            raise ConfigError(f"tensor {name!r} is on {t.device}; only cpu and cuda memory can be served")
        specs.append(TensorSpec(name=name, dtype=dtype_name(t.dtype), shape=tuple(t.shape),
                                nbytes=t.numel() * t.element_size()))
        addrs.append(0 if shapes_only else t.data_ptr())
    try:
        manifest = Manifest(tensors=specs)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    sums = compute(list(tensors.values()), checksum)
    if sums is not None:
        manifest = Manifest.model_construct(tensors=manifest.tensors, checksum=sums[0], checksums=sums[1])
    return manifest, addrs


def coalesce(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge overlapping or touching ``(addr, nbytes)`` ranges into few regions."""
    out: list[list[int]] = []
    for addr, n in sorted(r for r in ranges if r[1] > 0):
        if out and addr <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], addr + n - out[-1][0])
        else:
            out.append([addr, n])
    return [(a, n) for a, n in out]


def allocate_like(manifest: Manifest, device: str = "cpu", *, arena: bool = True) -> tuple[Any, dict[str, Any]]:
    """One flat buffer for the whole manifest and a view per tensor into it. ``arena``: CPU
    memory comes from the memfd arenas same-host readers map (``HubConfig.samehost``)."""
    import torch

    offsets, total = [], 0
    for spec in manifest.tensors:
        total = -(-total // ALIGN) * ALIGN
        offsets.append(total)
        total += spec.nbytes
    buf = _empty_bytes(max(total, 1), device, arena)
    out: dict[str, Any] = {}
    for spec, off in zip(manifest.tensors, offsets):
        dt = _torch_dtype(spec.dtype)
        if spec.nbytes == 0:
            out[spec.name] = torch.empty(spec.shape, dtype=dt, device=device)
        else:
            out[spec.name] = buf[off:off + spec.nbytes].view(dt).view(spec.shape)
    return buf, out


def _empty_bytes(nbytes: int, device: str, arena: bool) -> Any:
    """Bytes the Hub allocates: on CPU a memfd arena that same-host readers can copy from
    (``transport/_arena``; pooled, so a reuse pays no page faults), else ``torch.empty``."""
    import torch

    if device == "cpu" and arena:
        from .transport import _arena

        return _arena.empty(nbytes)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def empty_like(tensors: Mapping[str, Any], *, arena: bool = True) -> dict[str, Any]:
    """New CPU tensors with the names, dtypes and shapes of ``tensors`` (``meta`` tensors
    will do), in one buffer the Hub allocates (same-host readers copy from it at memory
    speed once it is published). Refuses what ``publish`` would refuse (non-contiguous,
    unsupported dtype)."""
    manifest, _ = manifest_of(tensors, shapes_only=True)
    return allocate_like(manifest, device="cpu", arena=arena)[1]


def check_into(manifest: Manifest, into: Mapping[str, Any]) -> list[int]:
    """Addresses of ``into``'s tensors in manifest order; the error names the first misfit."""
    import torch

    if not isinstance(into, Mapping):
        raise TensorMismatchError(f"into must be a mapping of name -> torch.Tensor, got {type(into).__name__}")
    addrs = []
    for spec in manifest.tensors:
        t = into.get(spec.name)
        if t is None:
            raise TensorMismatchError(f"into has no tensor {spec.name!r} (the version has {len(manifest.tensors)})")
        if not isinstance(t, torch.Tensor):
            raise TensorMismatchError(f"into[{spec.name!r}] is a {type(t).__name__}, not a torch.Tensor")
        got = str(t.dtype).removeprefix("torch.")
        if got != spec.dtype:
            raise TensorMismatchError(f"into[{spec.name!r}] has dtype {got}, the version has {spec.dtype}")
        if tuple(t.shape) != spec.shape:
            raise TensorMismatchError(
                f"into[{spec.name!r}] has shape {list(t.shape)}, the version has {list(spec.shape)}"
            )
        if not t.is_contiguous():
            raise TensorMismatchError(f"into[{spec.name!r}] is not contiguous")
        addrs.append(t.data_ptr())
    extra = [n for n in into if n not in {s.name for s in manifest.tensors}]
    if extra:
        raise TensorMismatchError(f"into has tensor {extra[0]!r}, which the version does not have")
    return addrs
