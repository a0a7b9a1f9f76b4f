"""The Mooncake Transfer Engine transport: one-sided reads over TCP or RDMA.

This is the only module that calls ``mooncake.engine``; every negative return
code becomes a :class:`~tensorhub.TransferError` here. ``mooncake`` is imported
by :meth:`MooncakeTransport.start`, never at import time.

Facts about the engine (Mooncake 0.3.13) this module is built around:

* ``transfer_check_status(batch_id)`` looks at the batch's *first* entry only
  (``getTransferStatus(batch_id, 0)``): it answers 1 as soon as entry 0 landed
  while later entries are still in flight, and then leaks the batch. So every
  :class:`ReadOp` is submitted as its own one-entry engine batch and a handle
  is done only when all of them are.
* The TCP transport admits at most ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``
  (1024) transfers per peer at once; the next 1024 wait at most
  ``MC_TCP_ADMISSION_TIMEOUT_MS`` (1 s) and then fail, and past 2048 the engine
  rejects them and can wedge that peer. A handle therefore keeps at most
  :attr:`MooncakeTransport.max_inflight_per_peer` entries in flight per peer
  (counted over all handles) and submits the rest from :meth:`poll`.
* A hung peer fails an in-flight read after ``MC_TCP_PROGRESS_TIMEOUT_SEC``
  seconds without progress (default 30). The engine reads that variable with
  ``getenv`` each time a session re-arms its deadline, so it is process-wide;
  :meth:`start` sets it (only when unset) before the first engine exists,
  because changing the environment while engine threads read it is a data race.
* Batch ids are raw C++ pointers; checking one after the engine freed it is a
  use-after-free. Callers only ever see small integer handles.
* Over TCP the engine does not check that a read's local destination is
  registered (RDMA would fail); this transport checks it, as the contract asks.
* The first read from a peer runs the P2P handshake inside
  ``batch_transfer_async_read``, synchronously (the GIL released): a peer that
  accepts the connection but never answers (stopped, wedged) blocks the caller
  for about a minute. So the first contact with a peer happens on a connector
  thread, with a one-byte read into the transport's own scratch buffer; the
  batches submitted meanwhile wait (``poll`` says ``PENDING``) and, having sent
  nothing, can be cancelled by a reader that gives up on that peer.
"""

from __future__ import annotations

import bisect
import ctypes
import importlib
import itertools
import logging
import math
import os
import socket
import struct
import threading
import time
from typing import Any, Sequence

from .. import envs
from .._exceptions import ConfigError, TransferError, TransportUnavailableError
from ._base import DONE, PENDING, ReadOp, Transport

__all__ = ["MooncakeTransport", "mooncake_available"]

logger = logging.getLogger(__name__)

#: Engines a close() could not destroy (a connector thread was still inside one).
_LEAKED: list[Any] = []

#: Mooncake's own variable: seconds a TCP read may make no progress before it fails.
PROGRESS_TIMEOUT_VAR = "MC_TCP_PROGRESS_TIMEOUT_SEC"

_FIX = (
    "install the data plane with `pip install 'tensorhub-ros[cpu]'` "
    "(or `pip install 'tensorhub-ros[cuda]'` on CUDA hosts), "
    "and its system library with `apt-get install -y libibverbs1`"
)


def _unavailable_reason(exc: BaseException) -> str:
    text = str(exc)
    if "libibverbs" in text:
        what = f"Mooncake Transfer Engine is installed but cannot load libibverbs.so.1 ({text})"
    elif isinstance(exc, ModuleNotFoundError) and (exc.name or "").startswith("mooncake"):
        what = "Mooncake Transfer Engine (module `mooncake.engine`) is not installed"
    else:
        what = f"Mooncake Transfer Engine cannot be imported ({type(exc).__name__}: {text})"
    return f"{what}; to fix it, {_FIX}."


def _import_engine_module() -> Any:
    """Import ``mooncake.engine`` or raise one TransportUnavailableError naming the fix."""
    try:
        return importlib.import_module("mooncake.engine")
    except (ImportError, OSError) as exc:
        raise TransportUnavailableError(_unavailable_reason(exc)) from exc


def mooncake_available() -> str | None:
    """``None`` if Mooncake can be imported here, else the reason and the fix."""
    try:
        _import_engine_module()
    except TransportUnavailableError as exc:
        return str(exc)
    return None


def _wake_handshake_listener(host: str, port: int) -> None:
    """Best effort: let the engine's destructor return in milliseconds instead of ~1 s.

    The P2P handshake listener blocks in ``accept()`` with a 1 s ``SO_RCVTIMEO``
    and the destructor joins it while holding the GIL, so every close() would
    freeze all Python threads for up to a second. Shorten that timeout on the
    listening socket (found in ``/proc/self/fd`` by its port) and wake the
    pending ``accept()`` with one empty connection, which the listener drops.
    """
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in fds:
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            dup = os.dup(fd)
        except OSError:
            continue
        try:
            sock = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            continue
        try:
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) and sock.getsockname()[1] == port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 2000))
                break
        except (OSError, IndexError, TypeError):
            pass
        finally:
            sock.close()
    else:
        return
    try:
        with socket.create_connection((host, port), timeout=0.5):
            pass
        time.sleep(0.005)  # the listener takes the connection and re-enters accept()
    except OSError as exc:
        logger.debug("could not wake the handshake listener on port %d: %s", port, exc)


class _Batch:
    """One handle: its ops, submitted in order as one-entry engine batches.

    ``ops[checked:submitted]`` are in flight (engine ids in ``bids``),
    ``ops[submitted:]`` wait for a free per-peer slot.
    """

    __slots__ = ("peer", "ops", "bids", "submitted", "checked", "code", "lock", "finished",
                 "connecting", "connected")

    def __init__(self, peer: str, ops: list[ReadOp]) -> None:
        self.peer = peer
        self.ops = ops
        self.bids: list[int] = []
        self.submitted = 0
        self.checked = 0
        self.code = 0  # first negative code seen; 0 while none
        self.lock = threading.Lock()
        self.finished = False
        #: Waiting for the peer's handshake: nothing submitted yet.
        self.connecting = False
        self.connected = threading.Event()  # set when connecting ends, either way


class MooncakeTransport(Transport):
    """Reads from peers' registered memory through Mooncake Transfer Engine.

    Constructed by any process that holds or reads weights (holder, reader); the
    constructor does no I/O. ``start()`` creates the engine in P2P-handshake
    mode, listening on ``host`` at a free port; ``close()`` waits for this
    transport's in-flight reads (bounded by the progress timeout), unregisters
    all memory and destroys the engine, after which peers' reads from it fail.

    ``protocol`` (``"tcp"``/``"rdma"``), ``devices`` (RDMA NIC filter) and
    ``progress_timeout`` (seconds without progress before a read from a hung
    peer fails) default to ``TENSORHUB_MOONCAKE_PROTOCOL``,
    ``TENSORHUB_MOONCAKE_DEVICES`` and ``TENSORHUB_PROGRESS_TIMEOUT``. The
    progress timeout is process-wide (it is Mooncake's
    ``MC_TCP_PROGRESS_TIMEOUT_SEC``): the first transport started in a process
    fixes it, and an already set variable wins.

    All methods may be called from several threads.
    """

    #: Entries one transport keeps in flight to one peer, over all its handles.
    max_inflight_per_peer: int = 1024
    #: Seconds ``submit_read`` waits for a first handshake with a peer before it returns
    #: a pending handle (so a refused peer still fails at submit, a hung one does not block).
    connect_wait: float = 0.5

    def __init__(
        self,
        host: str = "127.0.0.1",
        protocol: str | None = None,
        devices: str | None = None,
        progress_timeout: float | None = None,
    ) -> None:
        super().__init__()
        self._host = host
        self._protocol = protocol
        self._devices = devices
        self._progress_timeout_arg = progress_timeout
        self._progress_timeout = 30.0
        self._te: Any = None
        self._endpoint: str | None = None
        self._start_lock = threading.Lock()
        self._engine_lock = threading.Lock()  # register / unregister
        self._lock = threading.Lock()  # _inflight
        self._inflight: dict[str, int] = {}
        self._batches: dict[int, _Batch] = {}
        self._handles = itertools.count(1)
        self._closing = False
        self._contacted: set[str] = set()  # peers whose handshake succeeded
        self._connecting: dict[str, list[_Batch]] = {}  # peer -> batches waiting for it
        self._connectors: list[threading.Thread] = []
        self._scratch: Any = None  # the connectors' one-byte destination
        self._leak_engine = False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> str:
        """Create the engine (first call only) and return ``host:port``."""
        with self._start_lock:
            if self._closing or self._closed:
                raise TransferError("start", "", -1, "start() after close()")
            if self._endpoint is not None:
                return self._endpoint
            protocol = envs.pick(self._protocol, "TENSORHUB_MOONCAKE_PROTOCOL")
            devices = envs.pick(self._devices, "TENSORHUB_MOONCAKE_DEVICES")
            timeout = envs.pick(self._progress_timeout_arg, "TENSORHUB_PROGRESS_TIMEOUT")
            if not timeout > 0:
                raise ConfigError(f"progress timeout must be > 0 seconds, got {timeout!r}")
            engine_mod = _import_engine_module()
            self._progress_timeout = self._apply_progress_timeout(float(timeout))
            try:
                te = engine_mod.TransferEngine()
                # Positional arguments only: the binding has no keyword names.
                rc = te.initialize(self._host, "P2PHANDSHAKE", protocol or "tcp", devices or "")
            except RuntimeError as exc:  # e.g. "epoll: Too many open files"
                raise TransferError("start", "", -1, f"TransferEngine failed to start: {exc}") from exc
            if rc != 0:
                raise TransferError(
                    "start", "", rc, f"TransferEngine.initialize({self._host!r}, {protocol!r}) failed"
                )
            self._scratch = ctypes.create_string_buffer(64)
            rc = te.register_memory(ctypes.addressof(self._scratch), 64)
            if rc != 0:
                raise TransferError("register", "", rc, "could not register the handshake scratch buffer")
            self._te = te
            self._endpoint = f"{self._host}:{te.get_rpc_port()}"
            logger.info("Mooncake transport (%s) listening at %s", protocol, self._endpoint)
            return self._endpoint

    def _apply_progress_timeout(self, seconds: float) -> float:
        """Set MC_TCP_PROGRESS_TIMEOUT_SEC unless already set; return the value in force."""
        want = str(max(1, math.ceil(seconds)))
        current = os.environ.get(PROGRESS_TIMEOUT_VAR, "")
        if current == "":  # Mooncake treats empty as unset, too
            os.environ[PROGRESS_TIMEOUT_VAR] = want
            return float(want)
        if current != want and self._progress_timeout_arg is not None:
            logger.warning(
                "%s=%s is already set in this process and wins over progress_timeout=%s",
                PROGRESS_TIMEOUT_VAR,
                current,
                self._progress_timeout_arg,
            )
        try:  # Mooncake parses it with atoi and falls back to 30 unless positive
            value = int(current.strip())
        except ValueError:
            value = 0
        return float(value if value > 0 else 30)

    def close(self) -> None:
        """Wait for in-flight reads, unregister everything, destroy the engine. Idempotent."""
        if self._closed:
            return
        self._closing = True
        deadline = time.monotonic() + self._progress_timeout + 5.0
        for thread in list(self._connectors):  # no engine call may outlive the engine
            thread.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._connectors):
            logger.warning("close(): a handshake with a peer is still blocked in the engine; "
                           "the engine is left running")
            self._leak_engine = True  # destroying it under that call would crash the process
        for handle, rec in list(self._batches.items()):
            with rec.lock:
                del rec.ops[rec.submitted :]  # nothing new goes out
                while not self._check_inflight(rec):
                    if time.monotonic() > deadline:
                        logger.warning(
                            "close(): a read from %s is still in flight after %.0f s",
                            rec.peer,
                            self._progress_timeout + 5.0,
                        )
                        break
                    time.sleep(0.001)
                rec.finished = True
            self._batches.pop(handle, None)
        super().close()

    def _shutdown(self) -> None:
        te, self._te = self._te, None
        if te is None:
            return
        if self._leak_engine:
            _LEAKED.append(te)
            return
        if self._scratch is not None:
            te.unregister_memory(ctypes.addressof(self._scratch))
        _wake_handshake_listener(self._host, te.get_rpc_port())
        del te  # the engine's destructor stops its threads and closes its ports

    # ------------------------------------------------------------------ memory
    def _engine(self, op: str, peer: str = "") -> Any:
        te = self._te
        if te is None:
            if self._closing or self._closed:
                raise TransferError(op, peer, -1, "transport is closed")
            raise TransferError(op, peer, -1, "start() the transport first")
        return te

    def _register_region(self, addr: int, nbytes: int) -> None:
        te = self._engine("register")
        with self._engine_lock:
            rc = te.register_memory(addr, nbytes)
        if rc != 0:
            detail = "overlaps a region the engine already holds" if rc == -7 else ""
            raise TransferError("register", "", rc, f"[{addr:#x}, +{nbytes}) {detail}".rstrip())

    def _unregister_region(self, addr: int, nbytes: int) -> None:
        te = self._engine("unregister")
        with self._engine_lock:
            rc = te.unregister_memory(addr)
        if rc != 0:
            raise TransferError("unregister", "", rc, f"[{addr:#x}, +{nbytes})")

    def _check_local(self, peer: str, ops: Sequence[ReadOp]) -> None:
        with self._regions_lock:
            regions = sorted((r.addr, r.addr + r.nbytes) for r in self._regions.values())
        starts = [a for a, _ in regions]
        for op in ops:
            if op.local_addr < 0 or op.remote_addr < 0:
                raise TransferError("read", peer, -1, f"negative address in {op}")
            i = bisect.bisect_right(starts, op.local_addr) - 1
            if i < 0 or op.local_addr + op.length > regions[i][1]:
                raise TransferError(
                    "read",
                    peer,
                    -1,
                    f"destination [{op.local_addr:#x}, +{op.length}) is not inside a registered region",
                )

    # ------------------------------------------------------------------ reads
    def submit_read(self, peer: str, ops: Sequence[ReadOp]) -> int:
        """Queue ``ops`` from ``peer``; return a handle for :meth:`poll`.

        Raises TransferError when nothing could be submitted (peer unreachable:
        the handshake failed). If the engine refuses an entry after others went
        out, the handle is returned and ``poll`` reports the failure once the
        entries in flight are over, so no write into the destination outlives it.
        """
        self._check_batch(peer, ops)
        if self._closing:
            raise TransferError("read", peer, -1, "transport is closed")
        te = self._engine("read", peer)
        self._check_local(peer, ops)
        rec = _Batch(peer, list(ops))
        with self._lock:
            if peer not in self._contacted:
                rec.connecting = True
                waiting = self._connecting.setdefault(peer, [])
                waiting.append(rec)
                if len(waiting) == 1:
                    thread = threading.Thread(target=self._connect, args=(te, peer, ops[0].remote_addr),
                                              name=f"tensorhub-connect-{peer}", daemon=True)
                    self._connectors = [t for t in self._connectors if t.is_alive()] + [thread]
                    thread.start()
        if rec.connecting and rec is self._connecting_first(peer):
            rec.connected.wait(self.connect_wait)
        with rec.lock:
            if not rec.connecting:
                self._submit_more(te, rec)
            if not rec.connecting and rec.code < 0 and rec.submitted == 0:
                raise TransferError(
                    "read", peer, rec.code, "the engine refused the batch (peer unreachable?)"
                )
            handle = next(self._handles)
            self._batches[handle] = rec
        return handle

    def _connecting_first(self, peer: str) -> _Batch | None:
        with self._lock:
            waiting = self._connecting.get(peer)
            return waiting[0] if waiting else None

    def _connect(self, te: Any, peer: str, remote_addr: int) -> None:
        """Connector thread: the first (handshake-making) read from ``peer``, one byte into
        the scratch buffer; then hand the waiting batches over to normal submission."""
        t0 = time.monotonic()
        try:
            bid = te.batch_transfer_async_read(peer, [ctypes.addressof(self._scratch)], [remote_addr], [1])
        except Exception as exc:  # pragma: no cover - the binding raises nothing we know of
            logger.warning("handshake with %s raised %s", peer, exc)
            bid = 0
        with self._lock:
            if bid > 0:
                self._contacted.add(peer)
            waiting = self._connecting.pop(peer, [])
        if bid <= 0 or time.monotonic() - t0 > 1.0:
            logger.info("handshake with %s %s after %.1f s", peer, "succeeded" if bid > 0 else "failed",
                        time.monotonic() - t0)
        for rec in waiting:
            with rec.lock:
                rec.connecting = False
                if bid <= 0:
                    rec.code = rec.code or -1
                elif not rec.finished and not self._closing:
                    self._submit_more(te, rec)
            rec.connected.set()
        if bid > 0:  # reap the one-byte read (the engine frees it once terminal)
            end = time.monotonic() + self._progress_timeout + 5.0
            while te.transfer_check_status(bid) in (0, -2) and time.monotonic() < end:
                time.sleep(0.001)

    def _submit_more(self, te: Any, rec: _Batch) -> None:
        """Submit waiting entries of ``rec`` while the peer has free slots (rec.lock held)."""
        with self._lock:
            used = self._inflight.get(rec.peer, 0)
            n = min(self.max_inflight_per_peer - used, len(rec.ops) - rec.submitted)
            if n <= 0:
                return
            self._inflight[rec.peer] = used + n
        sent = 0
        try:
            for op in rec.ops[rec.submitted : rec.submitted + n]:
                bid = te.batch_transfer_async_read(
                    rec.peer, [op.local_addr], [op.remote_addr], [op.length]
                )
                if bid <= 0:  # 0 is the binding's failure sentinel
                    rec.code = rec.code or -1
                    break
                rec.bids.append(bid)
                rec.submitted += 1
                sent += 1
        finally:
            if sent < n:
                self._release(rec.peer, n - sent)

    def _release(self, peer: str, n: int) -> None:
        with self._lock:
            left = self._inflight[peer] - n
            if left:
                self._inflight[peer] = left
            else:
                del self._inflight[peer]

    def _check_inflight(self, rec: _Batch) -> bool:
        """Reap finished entries in order (rec.lock held); True when none is in flight."""
        te = self._te
        done = 0
        while rec.checked < rec.submitted:
            status = te.transfer_check_status(rec.bids[rec.checked])
            # 0: pending; -2: a slice outlived MC_SLICE_TIMEOUT but is still in
            # flight (the engine has not freed it), so keep waiting.
            if status == 0 or status == -2:
                break
            rec.bids[rec.checked] = 0  # freed by the engine; never touch it again
            rec.checked += 1
            done += 1
            if status < 0 and rec.code == 0:
                rec.code = status
        if done:
            self._release(rec.peer, done)
        return rec.checked == rec.submitted

    def poll(self, handle: int) -> int:
        """``PENDING``, ``DONE`` or a negative code; a terminal answer frees ``handle``."""
        rec = self._batches.get(handle)
        if rec is None:
            why = "transport is closed" if self._closing else f"unknown read handle {handle}"
            raise TransferError("poll", "", -1, why)
        with rec.lock:
            if rec.finished:
                raise TransferError("poll", rec.peer, -1, f"unknown read handle {handle}")
            if rec.connecting:
                return PENDING
            idle = self._check_inflight(rec)
            if rec.code == 0 and rec.submitted < len(rec.ops):
                self._submit_more(self._te, rec)
                return PENDING
            if not idle:
                return PENDING
            rec.finished = True
            self._batches.pop(handle, None)
        if rec.code < 0:
            logger.debug("read of %d entries from %s failed: %d", len(rec.ops), rec.peer, rec.code)
            return rec.code
        return DONE

    def cancel(self, handle: int) -> bool:
        """``True`` for a batch still waiting for its peer's handshake (it never goes out)."""
        rec = self._batches.get(handle)
        if rec is None:
            return False
        with rec.lock:
            if not rec.connecting or rec.finished:
                return False
            rec.finished = True
            self._batches.pop(handle, None)
        with self._lock:
            waiting = self._connecting.get(rec.peer, [])
            if rec in waiting:
                waiting.remove(rec)
        return True
