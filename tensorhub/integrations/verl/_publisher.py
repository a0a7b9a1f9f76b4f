"""The trainer side: copy the weights verl hands over into a snapshot and publish it.

Runs in the trainer rank that gathered full tensors (verl's ``is_master``, rank 0). verl
yields ``(name, tensor)`` one at a time (FSDP gathers each on the fly), so each tensor is
copied into a CPU snapshot buffer as it comes, and the whole snapshot is published once as
one version: readers read it in place, the trainer keeps no other copy. A snapshot buffer
is reused only after ``unpublish`` of the version it served returned (its readers
drained); with ``keep=2`` rollouts can still read v while v+1 is published.

Sharded trainers (FSDP2, no gather): when verl yields ``DTensor`` shards, *every* trainer
rank runs :meth:`Publisher.publish_slices`: it copies its own local shard of each tensor
into its snapshot and publishes it as a :class:`tensorhub.Slice` (full shape and offsets
from the DTensor's placement) under the version the topology handed every rank. The
coordinator completes the version once the slices of all ranks cover every tensor; a rank
that never registers leaves it incomplete (readers wait, then time out; they never see a
mix). Trainer memory: one shard-sized snapshot per kept version per rank.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

__all__ = ["Publisher"]

logger = logging.getLogger(__name__)


class Publisher:
    """Snapshot buffers and the versions they serve, for one trainer process (holder)."""

    def __init__(self, hub: Any, model: str, keep: int, dtype: Optional[str]) -> None:
        self.hub = hub
        self.model = model
        self.keep = keep
        self.dtype = dtype
        self._slots: list[Optional[dict]] = [None] * keep  # name -> CPU tensor
        self._serving: list[Optional[int]] = [None] * keep  # the version each slot serves
        self._turn = 0

    def _cast(self, t: Any) -> Any:
        import torch

        if self.dtype is not None and t.is_floating_point():
            return getattr(torch, self.dtype)
        return t.dtype

    def _slot(self, timeout: Optional[float]) -> int:
        """The next slot, free to overwrite: the version it served is unpublished first."""
        i = self._turn % self.keep
        self._turn += 1
        old = self._serving[i]
        if old is not None:
            self.hub.unpublish(self.model, old, timeout=timeout)  # returns once its readers drained
            self._serving[i] = None
        return i

    def snapshot(self, i: int, name: str, t: Any) -> int:
        """Copy ``t`` into slot ``i`` under ``name`` (reusing a buffer of the same shape and
        dtype, else allocating one); returns its bytes."""
        import torch

        slot = self._slots[i]
        if slot is None:
            slot = self._slots[i] = {}
        dtype = self._cast(t)
        buf = slot.get(name)
        if buf is None or tuple(buf.shape) != tuple(t.shape) or buf.dtype != dtype:
            buf = slot[name] = torch.empty(tuple(t.shape), dtype=dtype, device="cpu")
        with torch.no_grad():
            buf.copy_(t.detach())
        return buf.numel() * buf.element_size()

    async def publish(self, weights: Any, version: Optional[int], timeout: Optional[float]) -> dict:
        """Snapshot every ``(name, tensor)`` of ``weights`` (sync or async iterable), publish
        the snapshot as ``version`` (a new one when None); returns verl metrics."""
        import asyncio

        t0 = time.monotonic()
        i = await asyncio.to_thread(self._slot, timeout)
        seen: dict[str, None] = {}
        nbytes = 0
        async for name, t in _aiter(weights):
            if name in seen:
                raise ValueError(f"tensorhub: the weights name {name!r} twice")
            seen[name] = None
            nbytes += self.snapshot(i, name, t)
        slot = self._slots[i] or {}
        for stale in set(slot) - set(seen):  # a tensor the model no longer has
            del slot[stale]
        if not seen:
            raise ValueError("tensorhub: send_weights got no tensors")
        ordered = {name: slot[name] for name in seen}
        t1 = time.monotonic()
        v = await asyncio.to_thread(self.hub.publish, self.model, ordered, version=version)
        self._serving[i] = v
        t2 = time.monotonic()
        logger.info("tensorhub: published %s v%d: %d tensors, %.1f MB (snapshot %.2fs, register %.2fs)",
                    self.model, v, len(seen), nbytes / 1e6, t1 - t0, t2 - t1)
        return {"tensorhub/version": v, "tensorhub/bytes": nbytes, "tensorhub/snapshot_s": t1 - t0,
                "tensorhub/publish_s": t2 - t1}

    async def publish_slices(self, first: tuple, rest: Any, version: Optional[int], timeout: Optional[float],
                             master: bool) -> dict:
        """This rank's part of a sliced version: ``first`` then ``rest`` (``(name, DTensor)``;
        a plain tensor is taken whole from the master only) copied into a snapshot of the
        local shards and published in place as ``version`` (the number every rank got from
        the topology). Returns verl metrics."""
        import asyncio

        import tensorhub

        if version is None:
            raise tensorhub.ConfigError(
                "tensorhub: sliced weights (DTensor shards) need the step's version on every trainer rank; "
                "verl's build_topology/init_process_group hands it over (was the topology skipped?)")
        t0 = time.monotonic()
        i = await asyncio.to_thread(self._slot, timeout)
        seen: dict[str, None] = {}
        slices: dict[str, Any] = {}
        nbytes = 0
        mesh_rank: Optional[tuple[int, int]] = None

        async def items():
            yield first
            async for item in rest:
                yield item

        async for name, t in items():
            if name in seen:
                raise ValueError(f"tensorhub: the weights name {name!r} twice")
            seen[name] = None
            if _is_dtensor(t):
                local, shape, offsets, r = _local_part(name, t)
                if mesh_rank is not None and r != mesh_rank:
                    raise ValueError(f"tensorhub: tensor {name!r} is on another device mesh than the others "
                                     f"(rank {r[0]} of {r[1]} there, {mesh_rank[0]} of {mesh_rank[1]} before)")
                mesh_rank = r
            elif master:  # replicated on every rank: one rank publishes it whole
                local, shape, offsets = t, tuple(t.shape), (0,) * t.dim()
            else:
                continue
            nbytes += self.snapshot(i, name, local)
            slices[name] = tensorhub.Slice(self._slots[i][name], shape, offsets)
        slot = self._slots[i] or {}
        for stale in set(slot) - set(slices):
            del slot[stale]
        if mesh_rank is None:
            raise ValueError("tensorhub: send_weights got no DTensor on this rank")
        t1 = time.monotonic()
        v = await asyncio.to_thread(self.hub.publish, self.model, slices, version=version, shard=mesh_rank[0],
                                    num_shards=mesh_rank[1])
        self._serving[i] = v
        t2 = time.monotonic()
        logger.info("tensorhub: published %s v%d slices (rank %d of %d): %d tensors, %.1f MB (snapshot %.2fs, "
                    "register %.2fs)", self.model, v, mesh_rank[0], mesh_rank[1], len(slices), nbytes / 1e6,
                    t1 - t0, t2 - t1)
        return {"tensorhub/version": v, "tensorhub/bytes": nbytes, "tensorhub/snapshot_s": t1 - t0,
                "tensorhub/publish_s": t2 - t1, "tensorhub/sliced": 1}

    def serving(self) -> list[int]:
        return sorted(v for v in self._serving if v is not None)


async def _aiter(weights: Any):
    """Iterate a sync or async iterable of ``(name, tensor)`` (verl hands either)."""
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


def _is_dtensor(t: Any) -> bool:
    cls = type(t)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed")


def _local_part(name: str, dt: Any) -> tuple[Any, tuple[int, ...], tuple[int, ...], tuple[int, int]]:
    """(local shard, full shape, offsets, (rank in the mesh, mesh size)) of a DTensor. Only
    ``Shard`` placements: on a replicated dimension every replica would publish the same
    slice (HSDP's replicate groups are not supported here)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for d, p in enumerate(dt.placements):
        if not isinstance(p, Shard):
            raise ValueError(f"tensorhub: tensor {name!r}: placement {p!r} on mesh dimension {d}: sliced publishing "
                             "takes Shard placements only (FSDP2 fully_shard); gather or reduce it first")
    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError(f"tensorhub: tensor {name!r}: this rank is not in its device mesh")
    rank = 0
    for c, n in zip(coord, mesh.shape):
        rank = rank * n + c
    shape, offsets = compute_local_shape_and_global_offset(dt.shape, mesh, dt.placements)
    local = dt.to_local()
    if tuple(local.shape) != tuple(shape):
        raise ValueError(f"tensorhub: tensor {name!r}: local shard {list(local.shape)}, placement says {list(shape)}")
    return local, tuple(dt.shape), tuple(int(o) for o in offsets), (rank, mesh.size())
