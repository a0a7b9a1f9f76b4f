"""The client's half of the fencing rules (docs/consistency.md), used by the Hub.

* :class:`LeaseClock` (reader process): a lease is trusted only up to the moment its
  reader *sent* the last request that the coordinator answered with a grant or renewal,
  plus the lease ttl (times ``SAFETY``), on the reader's own monotonic clock. Release
  answering "valid" is necessary but not enough: bytes read past that bound are re-read.
  The coordinator's expiry (grant time + ttl on its clock) is never earlier, so a holder
  the coordinator lets drain can only overwrite bytes no reader still trusts, whatever
  happened to the coordinator (restart, pause) in between.
* :class:`Quarantine` (reader process): destination memory that a peer may still read
  (a failed pipelined fetch whose partial replica could not be confirmed drained) or that
  a hung transfer may still write. ``fetch(into=...)`` refuses it; a partial replica's
  quarantine is lifted once the coordinator confirms it drained (retried on heartbeats).
* holders: a Hub that learns it was expired or that the coordinator restarted treats every
  replica it held then as possibly leased for one more lease ttl (``Hub.unpublish`` waits
  it out): see ``Hub._reregister``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from ._exceptions import ConfigError, TensorHubError

__all__ = ["LeaseClock", "Quarantine", "SAFETY", "renew_leases"]

logger = logging.getLogger(__name__)

#: Fraction of the ttl a reader trusts: covers clock-rate differences between hosts
#: (crystal drift is ~1e-4; 2% is far beyond it and costs little).
SAFETY = 0.98


class LeaseClock:
    """Per-read bookkeeping of how long each lease may be trusted (reader side)."""

    def __init__(self) -> None:
        self._until: dict[str, float] = {}
        self._lock = threading.Lock()

    def granted(self, lease_id: str, sent: float, ttl: float) -> None:
        """A grant for ``lease_id`` answered a request sent at ``sent`` (monotonic). A
        refresh of a known lease does not extend it (the coordinator does not either)."""
        with self._lock:
            self._until.setdefault(lease_id, sent + ttl * SAFETY)

    def renewed(self, lease_id: str, sent: float, ttl: float) -> None:
        with self._lock:
            if lease_id in self._until:
                self._until[lease_id] = max(self._until[lease_id], sent + ttl * SAFETY)

    def trusted(self, lease_id: str, now: Optional[float] = None) -> bool:
        now = time.monotonic() if now is None else now
        with self._lock:
            return now <= self._until.get(lease_id, float("-inf"))

    def until(self, lease_id: str) -> float:
        with self._lock:
            return self._until.get(lease_id, float("-inf"))


def renew_leases(api: Any, leases: list[str], clock: LeaseClock, ttl: float) -> None:
    """Renew a read's leases; each success moves its trust bound (best effort: a lease
    that could not be renewed lapses on the reader's clock and its bytes are re-read)."""
    for lid in list(leases):
        sent = time.monotonic()
        try:
            got = api.renew_lease(lid, retry_timeout=2.0)
        except TensorHubError:
            continue
        clock.renewed(lid, sent, got)


@dataclass
class _Fenced:
    ranges: list[tuple[int, int]]
    why: str
    keep: Any  # keeps the memory alive: never freed while quarantined
    #: Called on heartbeats: True once no peer can read it any more (lifts the quarantine).
    withdraw: Optional[Callable[[], bool]] = None
    regions: list[tuple[int, int]] = field(default_factory=list)  # still registered with the transport


class Quarantine:
    """Memory of this process that must not be written (see the module docstring)."""

    def __init__(self) -> None:
        self._items: list[_Fenced] = []
        self._lock = threading.Lock()

    def add(self, tensors: Mapping[str, Any], keep: Any, why: str,
            withdraw: Optional[Callable[[], bool]] = None, regions: Optional[list[tuple[int, int]]] = None) -> None:
        ranges = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors.values()]
        with self._lock:
            self._items.append(_Fenced(ranges, why, keep, withdraw, list(regions or [])))

    def check(self, into: Mapping[str, Any]) -> None:
        """Raise ConfigError if a tensor of ``into`` overlaps quarantined memory."""
        with self._lock:
            items = list(self._items)
        for name, t in into.items():
            lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
            for f in items:
                if any(lo < b and a < hi for a, b in f.ranges):
                    raise ConfigError(f"into[{name!r}] is quarantined and must not be reused: {f.why}")

    def retry(self, unregister: Callable[[list[tuple[int, int]]], None]) -> int:
        """Try to lift each withdrawable quarantine (heartbeat thread). Returns how many are left."""
        with self._lock:
            items = [f for f in self._items if f.withdraw is not None]
        for f in items:
            try:
                done = f.withdraw()
            except Exception as e:  # pragma: no cover - retried next time
                logger.debug("lifting quarantine failed: %s", e)
                continue
            if done:
                with self._lock:
                    self._items.remove(f)
                unregister(f.regions)
                logger.info("quarantine lifted: %s", f.why)
        with self._lock:
            return len(self._items)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
