"""Test helpers shipped with TensorHub: an in-process transport with fault injection.

:class:`InMemoryTransport` passes the same contract tests as the Mooncake
transport, so code built on :class:`tensorhub.transport.Transport` can be tested
in one process, without RDMA, Mooncake or torch::

    from tensorhub.testing import InMemoryTransport

    holder, reader = InMemoryTransport(), InMemoryTransport()
    src = holder.start()
    ...
    InMemoryTransport.hang(src)    # reads from it stay PENDING
    InMemoryTransport.resume(src)  # ... and continue
    InMemoryTransport.kill(src)    # pending and later reads from it fail

Endpoints (``memory://<n>``) live in a process-wide registry and are never
reused. A read copies bytes with ``ctypes.memmove`` on a background thread, in
chunks; between chunks it checks faults, so a test can act in the middle of a
read (throttle the source with ``bandwidth`` to make reads slow). Like
Mooncake's server, the source checks that every remote range lies inside one of
its registered regions, and fails the read (-1) otherwise; the destination must
lie inside a registered region of the reader. All failures answer -1, as
Mooncake does.

This module imports neither torch nor mooncake.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import logging
import threading
import time
import weakref
from typing import Sequence

from .._exceptions import ConfigError, TransferError
from ._base import DONE, PENDING, ReadOp, Transport

__all__ = ["InMemoryTransport"]

logger = logging.getLogger(__name__)

#: Guards the registry and the fault sets; notified whenever a fault changes.
_STATE = threading.Condition()
_REGISTRY: "weakref.WeakValueDictionary[str, InMemoryTransport]" = weakref.WeakValueDictionary()
_KILLED: set[str] = set()
_HUNG: set[str] = set()
_SEQ = itertools.count(1)

_FAILED = -1
_MAX_CHUNK = 1 << 20


class _MemBatch:
    __slots__ = ("peer", "ops", "state", "thread")

    def __init__(self, peer: str, ops: list[ReadOp]) -> None:
        self.peer = peer
        self.ops = ops
        self.state = PENDING
        self.thread: threading.Thread | None = None


def _inside(regions: Sequence[tuple[int, int]], addr: int, n: int) -> bool:
    """Whether ``[addr, addr + n)`` lies inside one of the sorted ``(start, end)`` regions."""
    i = bisect.bisect_right(regions, (addr, float("inf"))) - 1
    return i >= 0 and addr + n <= regions[i][1]


class InMemoryTransport(Transport):
    """A :class:`Transport` whose peers are other instances in this process.

    ``bandwidth`` (bytes/s, optional, may be changed at any time) throttles
    what this transport *serves*, shared by all readers: a slow source.
    ``progress_timeout`` (seconds, optional) makes a read blocked on a hung
    source fail with -1 after that long, as Mooncake does; by default such a
    read stays ``PENDING`` until the source is resumed, killed or closed.
    ``bytes_served`` counts the bytes readers copied out of this transport.

    Fault controls are static and name endpoints: :meth:`kill`, :meth:`hang`,
    :meth:`resume`. ``close()`` fails and joins this transport's own reads,
    makes reads from it fail, and unregisters everything.
    """

    def __init__(self, *, bandwidth: float | None = None, progress_timeout: float | None = None) -> None:
        super().__init__()
        if bandwidth is not None and not bandwidth > 0:
            raise ConfigError(f"bandwidth must be > 0 bytes/s, got {bandwidth!r}")
        if progress_timeout is not None and not progress_timeout > 0:
            raise ConfigError(f"progress_timeout must be > 0 seconds, got {progress_timeout!r}")
        self.bandwidth = bandwidth
        self.progress_timeout = progress_timeout
        self.bytes_served = 0
        self._seq = next(_SEQ)  # endpoint number and lock order
        self._endpoint: str | None = None
        self._batches: dict[int, _MemBatch] = {}
        self._handles = itertools.count(1)
        self._closing = False
        self._bw_lock = threading.Lock()
        self._bw_next = 0.0

    # ------------------------------------------------------------------ faults
    @staticmethod
    def kill(endpoint: str) -> None:
        """Make every pending and later read from ``endpoint`` fail (-1), as if its process died."""
        with _STATE:
            _KILLED.add(endpoint)
            _STATE.notify_all()

    @staticmethod
    def hang(endpoint: str) -> None:
        """Stall reads from ``endpoint``: they stay ``PENDING`` (or time out) until :meth:`resume`."""
        with _STATE:
            _HUNG.add(endpoint)
            _STATE.notify_all()

    @staticmethod
    def resume(endpoint: str) -> None:
        """Undo :meth:`hang`: stalled reads from ``endpoint`` continue."""
        with _STATE:
            _HUNG.discard(endpoint)
            _STATE.notify_all()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> str:
        """Publish this transport as ``memory://<n>``; idempotent."""
        with _STATE:
            if self._closing or self._closed:
                raise TransferError("start", "", -1, "start() after close()")
            if self._endpoint is None:
                self._endpoint = f"memory://{self._seq}"
                _REGISTRY[self._endpoint] = self
            return self._endpoint

    def close(self) -> None:
        """Fail and join pending reads, leave the registry, unregister everything. Idempotent."""
        if self._closed:
            return
        with _STATE:
            self._closing = True
            if self._endpoint is not None and _REGISTRY.get(self._endpoint) is self:
                del _REGISTRY[self._endpoint]
            _STATE.notify_all()
        for rec in list(self._batches.values()):
            if rec.thread is not None:
                rec.thread.join(timeout=10)
        self._batches.clear()
        super().close()

    # ------------------------------------------------------------------ memory
    def _register_region(self, addr: int, nbytes: int) -> None:
        if self._endpoint is None:
            raise TransferError("register", "", -1, "start() the transport first")

    def _unregister_region(self, addr: int, nbytes: int) -> None:
        pass

    def _sorted_regions(self) -> list[tuple[int, int]]:
        """``(start, end)`` of live regions; call with ``_regions_lock`` held."""
        return sorted((r.addr, r.addr + r.nbytes) for r in self._regions.values())

    # ------------------------------------------------------------------ reads
    def submit_read(self, peer: str, ops: Sequence[ReadOp]) -> int:
        """Start copying ``ops`` from the transport at ``peer`` on a background thread."""
        self._check_batch(peer, ops)
        if self._closing:
            raise TransferError("read", peer, -1, "transport is closed")
        if self._endpoint is None:
            raise TransferError("read", peer, -1, "start() the transport first")
        with self._regions_lock:
            local = self._sorted_regions()
        for op in ops:
            if op.local_addr < 0 or op.remote_addr < 0:
                raise TransferError("read", peer, -1, f"negative address in {op}")
            if not _inside(local, op.local_addr, op.length):
                raise TransferError(
                    "read",
                    peer,
                    -1,
                    f"destination [{op.local_addr:#x}, +{op.length}) is not inside a registered region",
                )
        with _STATE:
            src = _REGISTRY.get(peer)
        if src is None or src._closing or src._closed:
            raise TransferError("read", peer, -1, "no transport listens at this endpoint")
        rec = _MemBatch(peer, list(ops))
        handle = next(self._handles)
        self._batches[handle] = rec
        rec.thread = threading.Thread(
            target=self._run, args=(rec, src), name=f"tensorhub-memread-{handle}", daemon=True
        )
        rec.thread.start()
        return handle

    def poll(self, handle: int) -> int:
        """``PENDING``, ``DONE`` or -1; a terminal answer frees ``handle``."""
        if self._closing or self._closed:
            raise TransferError("poll", "", -1, "transport is closed")
        rec = self._batches.get(handle)
        if rec is None:
            raise TransferError("poll", "", -1, f"unknown read handle {handle}")
        state = rec.state
        if state == PENDING:
            return PENDING
        if self._batches.pop(handle, None) is None:  # another thread got the answer first
            raise TransferError("poll", rec.peer, -1, f"unknown read handle {handle}")
        return state

    # ------------------------------------------------------------------ worker
    def _run(self, rec: _MemBatch, src: InMemoryTransport) -> None:
        state = DONE
        try:
            for op in rec.ops:
                state = self._copy(op, src)
                if state != DONE:
                    break
        except Exception:  # pragma: no cover - a bug in the double, not a user error
            logger.exception("in-memory read from %s crashed", rec.peer)
            state = _FAILED
        rec.state = state

    def _copy(self, op: ReadOp, src: InMemoryTransport) -> int:
        done = 0
        while done < op.length:
            if not self._wait_source(src):
                return _FAILED
            bw = src.bandwidth
            chunk = _MAX_CHUNK if not bw else max(4096, min(_MAX_CHUNK, int(bw * 0.01)))
            n = min(chunk, op.length - done)
            src._throttle(n)
            if not self._wait_source(src):
                return _FAILED
            # Hold both region locks (in a fixed order) so neither side can
            # unregister and free the memory during the copy.
            pair = sorted({self, src}, key=lambda t: t._seq)
            first, second = pair[0], (pair[1] if len(pair) > 1 else None)
            with first._regions_lock:
                if second is not None:
                    second._regions_lock.acquire()
                try:
                    if not _inside(src._sorted_regions(), op.remote_addr, op.length):
                        logger.debug("%s: remote range %s is not registered", src._endpoint, op)
                        return _FAILED
                    if not _inside(self._sorted_regions(), op.local_addr, op.length):
                        return _FAILED
                    ctypes.memmove(op.local_addr + done, op.remote_addr + done, n)
                    src.bytes_served += n
                finally:
                    if second is not None:
                        second._regions_lock.release()
            done += n
        return DONE

    def _wait_source(self, src: InMemoryTransport) -> bool:
        """Block while ``src`` is hung; False if the read must fail."""
        started: float | None = None
        with _STATE:
            while True:
                if self._closing or self._closed:
                    return False
                if src._closing or src._closed or src._endpoint in _KILLED:
                    return False
                if src._endpoint not in _HUNG:
                    return True
                if started is None:
                    started = time.monotonic()
                timeout = None
                if self.progress_timeout is not None:
                    timeout = started + self.progress_timeout - time.monotonic()
                    if timeout <= 0:
                        logger.debug("no progress from hung %s in %.1f s", src._endpoint, self.progress_timeout)
                        return False
                _STATE.wait(timeout)

    def _throttle(self, n: int) -> None:
        """Sleep until ``n`` more served bytes fit the bandwidth (shared by all readers)."""
        bw = self.bandwidth
        if not bw:
            return
        with self._bw_lock:
            now = time.monotonic()
            end = max(now, self._bw_next) + n / bw
            self._bw_next = end
        if end > now:
            time.sleep(end - now)
