"""What this process holds: its replicas, the memory they pin, and memory nobody may write.

One :class:`Holdings` per Hub, shared by the holder calls (publish, unpublish), every fetch
(which checks its destination here and adds what it serves) and the session's
re-registration (which announces every held replica again). Thread-safe: ``lock`` guards
the table; the heartbeat thread reads it while fetches write it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from ._exceptions import ConfigError, TensorHubError
from ._fencing import Quarantine
from ._metrics import hub_metrics
from .protocol import Manifest
from .transport import Transport

__all__ = ["Held", "Holdings", "Key", "register_regions", "unregister_regions"]

logger = logging.getLogger(__name__)

#: (model, version, layout, shard)
Key = tuple[str, int, str, int]


@dataclass
class Held:
    """A replica this process holds: what it needs to re-register after a restart."""

    model: str
    version: int
    layout: str
    shard: int
    num_shards: int
    manifest: Manifest
    addresses: list[int]
    regions: list[tuple[int, int]]
    tensors: Any  # keeps the memory alive
    replica_id: str = ""
    extra: list[Any] = field(default_factory=list)
    #: A replica that served while it was still receiving: its chunk map (``_chunkmap``),
    #: retired before the memory is released or reused.
    chunkmap: Any = None
    #: (addresses, their ``AddressRuns`` or None): the compact form, encoded once (``Session``).
    runs: Any = None

    def retire_map(self) -> None:
        if self.chunkmap is not None:
            self.chunkmap.retire()

    @property
    def key(self) -> Key:
        return (self.model, self.version, self.layout, self.shard)


class Holdings:
    """The held replicas of one Hub, its quarantined memory and its overwrite fences."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.held: dict[Key, Held] = {}
        #: Memory fetches must not write (docs/consistency.md); lifted on heartbeats.
        self.quarantine = Quarantine()
        #: Held replica -> monotonic time before which unpublish does not let it be
        #: overwritten: set when this worker learns it was expired or the coordinator restarted.
        self.fence_until: dict[Key, float] = {}
        #: Replicas an ``unpublish`` is withdrawing: never announced again by a re-registration
        #: (else a reader could lease them while the holder waits out its fence, then read
        #: overwritten bytes).
        self.withdrawing: set[Key] = set()
        #: Partial replica id -> the replica a fetch is still receiving (served to same-host
        #: readers, chunk by chunk, like any partial replica: ``find``). Removed when the
        #: fetch ends, before its memory is withdrawn, quarantined or freed.
        self.receiving: dict[str, Held] = {}

    def find(self, replica_id: str) -> Optional[Held]:
        """The held (or still receiving) replica registered as ``replica_id``."""
        if not replica_id:
            return None
        with self.lock:
            h = self.receiving.get(replica_id)
            return h if h is not None else next((x for x in self.held.values() if x.replica_id == replica_id), None)

    def done_receiving(self, h: Optional[Held]) -> None:
        with self.lock:
            for rid in [rid for rid, x in self.receiving.items() if x is h]:
                del self.receiving[rid]

    def get(self, key: Key) -> Optional[Held]:
        with self.lock:
            return self.held.get(key)

    def of_version(self, model: str, version: int) -> list[Held]:
        with self.lock:
            return [h for k, h in self.held.items() if k[0] == model and k[1] == version]

    def all(self) -> list[Held]:
        with self.lock:
            return list(self.held.values())

    def announced(self) -> list[Held]:
        """What a re-registration announces: every held replica not being withdrawn."""
        with self.lock:
            return [h for k, h in self.held.items() if k not in self.withdrawing]

    def hold(self, h: Held) -> None:
        """Record a replica this process now holds."""
        with self.lock:
            if h.key in self.held:
                self.drop(h.key)
            self.held[h.key] = h
        m = hub_metrics()
        m.held_replicas.labels(h.model).inc()
        m.held_bytes.labels(h.model).inc(h.manifest.nbytes)

    def drop(self, key: Key) -> Optional[Held]:
        """Forget a held replica (and its fence)."""
        with self.lock:
            h = self.held.pop(key, None)
            self.fence_until.pop(key, None)
            self.withdrawing.discard(key)
        if h is not None:
            m = hub_metrics()
            m.held_replicas.labels(h.model).dec()
            m.held_bytes.labels(h.model).dec(h.manifest.nbytes)
        return h

    def fence_all(self, until: float) -> None:
        """Everything held now stays untouched until ``until`` (monotonic)."""
        with self.lock:
            for key in self.held:
                self.fence_until[key] = max(self.fence_until.get(key, 0.0), until)

    def fence_of(self, mine: list[Held]) -> float:
        with self.lock:
            return max((self.fence_until.get(h.key, 0.0) for h in mine), default=0.0)

    def check_not_served(self, into: Mapping[str, Any]) -> None:
        """Refuse to write into memory this hub still serves (invariant 3: unpublish first)
        or that is quarantined (a peer may still read it, or a hung transfer write it)."""
        self.quarantine.check(into)
        with self.lock:
            served = [(a, n, h) for h in self.held.values() for a, n in h.regions]
        for name, t in into.items():
            lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
            for a, n, h in served:
                if lo < a + n and a < hi:
                    raise ConfigError(
                        f"into[{name!r}] lies in memory this hub serves as {h.model!r} v{h.version}; "
                        f"unpublish({h.model!r}, {h.version}) first")


def register_regions(transport: Transport, regions: list[tuple[int, int]]) -> None:
    """Register memory with the transport, all or none."""
    done: list[tuple[int, int]] = []
    try:
        for a, n in regions:
            transport.register(a, n)
            done.append((a, n))
    except BaseException:
        unregister_regions(transport, done)
        raise


def unregister_regions(transport: Transport, regions: list[tuple[int, int]]) -> None:
    for a, n in regions:
        try:
            transport.unregister(a, n)
        except TensorHubError as e:  # pragma: no cover
            logger.warning("unregister %#x failed: %s", a, e)
