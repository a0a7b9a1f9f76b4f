"""The trainer side: copy the weights verl hands over into a snapshot and publish it.

Runs in the trainer rank that gathered full tensors (verl's ``is_master``, rank 0). verl
yields ``(name, tensor)`` one at a time (FSDP gathers each on the fly), so each tensor is
copied into a CPU snapshot buffer as it comes, and the whole snapshot is published once as
one version: readers read it in place, the trainer keeps no other copy. A snapshot buffer
is reused only after ``unpublish`` of the version it served returned (its readers
drained); with ``keep=2`` rollouts can still read v while v+1 is published.

Sharded trainers: today rank 0 receives the gathered tensors (``get_per_tensor_param``)
and the other ranks only drain the generator. Publishing each rank's own slices in place
(``num_shards`` = the trainer world size, ``shard`` = the rank; the topology already hands
every rank the version) plugs in at :meth:`Publisher.publish`, once the Hub takes slices.
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
