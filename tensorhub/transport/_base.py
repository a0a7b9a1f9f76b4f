"""The one data-plane interface every transport implements.

A transport moves bytes between registered memory of two processes with
one-sided reads: the reader pulls, the source does no work per read.

Lifecycle (who calls what):

* ``start()`` -- once, by the process that owns the transport (holder or reader);
  returns the endpoint string other processes use as ``peer``.
* ``register(addr, nbytes)`` -- a holder, before announcing a replica whose bytes
  lie in that range; a reader, for its destination buffers. Registrations are
  reference counted: registering a range that lies inside an already registered
  region only bumps that region's count. A range that partly overlaps a
  registered region is refused (Mooncake rejects overlapping regions).
* ``unregister(addr, nbytes)`` -- drops one reference taken by ``register`` with
  the same arguments; the region is released when its count reaches zero. A
  holder calls it only after ``unpublish`` returned (no reader holds a lease).
* ``submit_read(peer, ops)`` / ``poll(handle)`` -- a reader. ``submit_read``
  queues one asynchronous batch (at most ``max_batch_entries`` entries, each at
  most ``max_entry_bytes``); ``poll`` returns ``PENDING``, ``DONE`` or a negative
  error code, and frees the handle once it returned anything but ``PENDING``.
  A batch that has not reached a terminal state may still write into its
  destination: the caller must not reuse that memory until ``poll`` says so.
* ``cancel(handle)`` -- a reader that gave up on a pending batch: ``True`` frees the
  handle and guarantees the batch never writes into its destination (it had not
  started); ``False`` changes nothing (keep polling). A transport may always say
  ``False``.
* ``close()`` -- once; unregisters everything. Idempotent.

Errors are raised as :class:`tensorhub.TransferError` (op, peer, code).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

from .._exceptions import TransferError

__all__ = ["ReadOp", "Transport", "PENDING", "DONE", "MAX_BATCH_ENTRIES", "MAX_ENTRY_BYTES"]

PENDING = 0
DONE = 1
#: Mooncake rejects (and may wedge a peer on) larger batches to one peer.
MAX_BATCH_ENTRIES = 2048
#: One entry's deadline grows with its size; keep single reads at or under 1 GiB.
MAX_ENTRY_BYTES = 1 << 30


@dataclass(frozen=True)
class ReadOp:
    """Copy ``length`` bytes from ``remote_addr`` on the peer to ``local_addr`` here."""

    local_addr: int
    remote_addr: int
    length: int


@dataclass
class _Region:
    addr: int
    nbytes: int
    refs: int


class Transport(ABC):
    """Base class: reference-counted region bookkeeping plus the abstract data path."""

    max_batch_entries: int = MAX_BATCH_ENTRIES
    max_entry_bytes: int = MAX_ENTRY_BYTES

    def __init__(self) -> None:
        self._regions: dict[int, _Region] = {}  # start address -> region
        self._regions_lock = threading.Lock()
        self._closed = False
        self._endpoint: str | None = None  # set by start()

    # ------------------------------------------------------------------ lifecycle
    @abstractmethod
    def start(self) -> str:
        """Bring the transport up; return this process's endpoint (``host:port``)."""

    @property
    def endpoint(self) -> str:
        """The name other processes pass as ``peer`` to read from this one (after ``start``)."""
        if self._endpoint is None:
            raise TransferError("endpoint", "", -1, "start() the transport first")
        return self._endpoint

    def close(self) -> None:
        """Unregister every region and shut the transport down. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with self._regions_lock:
            regions = list(self._regions.values())
            self._regions.clear()
        for r in regions:
            try:
                self._unregister_region(r.addr, r.nbytes)
            except TransferError:
                pass
        self._shutdown()

    def _shutdown(self) -> None:  # pragma: no cover - optional hook
        """Release transport resources after all regions are gone."""

    # ------------------------------------------------------------------ memory
    def register(self, addr: int, nbytes: int) -> None:
        """Make ``[addr, addr + nbytes)`` readable by peers / writable by reads."""
        if self._closed:
            raise TransferError("register", "", -1, "transport is closed")
        if nbytes <= 0:
            raise TransferError("register", "", -1, f"cannot register {nbytes} bytes")
        with self._regions_lock:
            for r in self._regions.values():
                if r.addr <= addr and addr + nbytes <= r.addr + r.nbytes:
                    r.refs += 1
                    return
                if addr < r.addr + r.nbytes and r.addr < addr + nbytes:
                    raise TransferError(
                        "register",
                        "",
                        -7,
                        f"range [{addr:#x}, +{nbytes}) partly overlaps registered region "
                        f"[{r.addr:#x}, +{r.nbytes})",
                    )
            self._register_region(addr, nbytes)
            self._regions[addr] = _Region(addr, nbytes, 1)

    def unregister(self, addr: int, nbytes: int) -> None:
        """Drop one reference taken by ``register(addr, nbytes)``."""
        with self._regions_lock:
            for start, r in self._regions.items():
                if r.addr <= addr and addr + nbytes <= r.addr + r.nbytes:
                    r.refs -= 1
                    if r.refs > 0:
                        return
                    del self._regions[start]
                    break
            else:
                raise TransferError("unregister", "", -3, f"no registered region holds {addr:#x}")
        if not self._closed:
            self._unregister_region(r.addr, r.nbytes)

    def registered_regions(self) -> list[tuple[int, int]]:
        """``(addr, nbytes)`` of every live region (for tests and status)."""
        with self._regions_lock:
            return sorted((r.addr, r.nbytes) for r in self._regions.values())

    @abstractmethod
    def _register_region(self, addr: int, nbytes: int) -> None:
        """Register one region with the underlying engine (raise TransferError)."""

    @abstractmethod
    def _unregister_region(self, addr: int, nbytes: int) -> None:
        """Unregister one region from the underlying engine (raise TransferError)."""

    # ------------------------------------------------------------------ reads
    @abstractmethod
    def submit_read(self, peer: str, ops: Sequence[ReadOp]) -> int:
        """Queue one asynchronous read batch from ``peer``; return its handle."""

    @abstractmethod
    def poll(self, handle: int) -> int:
        """``PENDING`` (0), ``DONE`` (1) or a negative error code; frees the handle when terminal."""

    def cancel(self, handle: int) -> bool:
        """Withdraw a pending batch that has not started writing; ``True`` if it was
        (the handle is freed and nothing will land), ``False`` to keep polling it."""
        return False

    def _check_batch(self, peer: str, ops: Sequence[ReadOp]) -> None:
        if self._closed:
            raise TransferError("read", peer, -1, "transport is closed")
        if not ops:
            raise TransferError("read", peer, -1, "empty batch")
        if len(ops) > self.max_batch_entries:
            raise TransferError(
                "read", peer, -1, f"{len(ops)} entries > max {self.max_batch_entries} per batch"
            )
        for op in ops:
            if op.length <= 0 or op.length > self.max_entry_bytes:
                raise TransferError(
                    "read", peer, -1, f"entry of {op.length} bytes outside (0, {self.max_entry_bytes}]"
                )
