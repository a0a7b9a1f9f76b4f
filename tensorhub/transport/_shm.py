"""Same-host reads at memory speed: memfd-backed holdings and a transport that copies.

Two halves, both in every process that uses a Hub:

* **Arenas (holder side).** CPU memory the Hub allocates (fetched copies, the retained
  copy, snapshot buffers from ``Hub.empty_like``) is a ``memfd_create`` file mapped
  shared: an *arena*. ``empty(nbytes)`` returns a uint8 tensor over one. When the last
  tensor viewing an arena dies, the arena goes back to a small pool (its pages already
  faulted in) instead of being unmapped, so the next fetch into new memory of a similar
  size pays no first-touch page faults (these cost ~1 s/GiB on the test VMs, more than
  the copy). ``TENSORHUB_SHM_POOL_BYTES`` caps what the pool keeps (default: the largest
  arena made, i.e. one model's worth).
* **The fd server and the copying transport.** :class:`SameHostTransport` wraps the real
  transport (Mooncake). Once started it listens on an abstract Unix socket named after its
  endpoint (abstract names are per network namespace: a reader in another namespace cannot
  reach it). A reader that was granted a lease naming one of our replicas asks, over that
  socket, for the arenas backing it: the holder checks the API token (when one is
  configured) and asks the coordinator that the lease is valid, is the asker's, and names
  that replica (``authorize``); only then it sends read-only fds (``SCM_RIGHTS``) of the
  arenas covering the replica, with the arena addresses and its host identity (hostname,
  boot id, locality host label). The reader checks that identity against its own, maps
  each arena read-only (``MAP_POPULATE``; kept, by file identity, for later leases on the
  same memory, dropped after 30 s unused) and copies every batch whose remote ranges lie
  in those arenas with a tensor copy on a small thread pool (memcpy speed once mapped;
  ``preadv`` from the fd measured 6-8 GB/s against 11-16 GB/s here, the first mapping of a
  GiB ~0.1 s).
  Batches it cannot serve so (user tensors published without ``empty_like``, partial
  replicas, other hosts) go to the wrapped transport unchanged.

Leases, drains, fencing and checksums are untouched: the reader still reads chunk by chunk
under the lease, verifies checksums on the landed chunk and releases the lease after its
copies ended, so the holder's ``unpublish`` waits for same-host readers exactly as for
remote ones. The fds a reader received are closed when its read run ends
(:meth:`SameHostTransport.forget`); a new lease asks again (an address may be a new arena
by then).

Lifecycle: the Session creates the wrapper with the inner transport (holder and reader);
``start()`` starts the inner transport and the server thread; ``close()`` stops both.
"""

from __future__ import annotations

import errno
import hmac
import itertools
import json
import logging
import mmap
import os
import socket
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from .. import envs
from ._base import DONE, PENDING, ReadOp, Transport

__all__ = ["SameHostTransport", "empty", "arena_of", "host_identity", "pool_bytes", "trim", "socket_name"]

logger = logging.getLogger(__name__)

_PAGE = mmap.PAGESIZE
#: Largest request / answer on the fd socket, and most arenas (fds) in one answer.
_MAX_MSG = 1 << 16
_MAX_FDS = 250
#: Handles of same-host reads start here (the wrapped transport's are small integers).
_HANDLE_BASE = 1 << 48


# ---------------------------------------------------------------------- arenas
@dataclass
class _Arena:
    fd: int
    mm: mmap.mmap
    base: int
    size: int


_lock = threading.Lock()
_live: dict[int, _Arena] = {}  # base address -> arena with tensors alive
_pool: list[_Arena] = []  # freed arenas, pages faulted in, ready for reuse
#: Arenas created (not taken from the pool) since the process started (tests, benchmarks).
created = 0


#: The largest arena made so far: what the pool keeps by default (one model's worth, so an
#: engine that frees version v after loading v+1 fetches v+2 into v's faulted-in pages).
_largest = 0


def _cap() -> int:
    cap = envs.TENSORHUB_SHM_POOL_BYTES
    return _largest if cap < 0 else cap


def pool_bytes() -> int:
    """Bytes the pool keeps (freed arenas awaiting reuse)."""
    with _lock:
        return sum(a.size for a in _pool)


def _destroy(a: _Arena) -> None:
    try:
        a.mm.close()
    except (BufferError, ValueError):  # pragma: no cover - a view still exported
        return
    os.close(a.fd)


def trim(keep: int = 0) -> None:
    """Free pooled arenas until the pool holds at most ``keep`` bytes."""
    with _lock:
        drop = []
        while _pool and sum(a.size for a in _pool) > keep:
            drop.append(_pool.pop(0))
    for a in drop:
        _destroy(a)


def _recycle(base: int) -> None:
    """The last tensor over the arena at ``base`` died: pool it (or free it past the cap)."""
    with _lock:
        a = _live.pop(base, None)
        if a is None:
            return
        _pool.append(a)
    trim(_cap())


def _new_arena(size: int) -> _Arena:
    global created, _largest
    created += 1
    _largest = max(_largest, size)
    fd = os.memfd_create("tensorhub", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    import ctypes

    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    return _Arena(fd, mm, base, size)


def _fits(a: _Arena, size: int) -> bool:
    return size <= a.size <= size + size // 4 + (2 << 20)


def _from_pool(size: int) -> Optional[_Arena]:
    with _lock:
        fit = [a for a in _pool if _fits(a, size)]
        a = min(fit, key=lambda x: x.size) if fit else None
        if a is not None:
            _pool.remove(a)
    return a


def empty(nbytes: int) -> Any:
    """A uint8 CPU tensor of ``nbytes`` over a memfd arena (a pooled one when one fits:
    no page faults), serveable to same-host readers. Freed (pooled) when its last view dies."""
    import numpy as np
    import torch

    size = max(_PAGE, -(-nbytes // _PAGE) * _PAGE)
    a = _from_pool(size)
    if a is None:
        a = _new_arena(size)
    arr = np.frombuffer(a.mm, dtype=np.uint8, count=size)
    with _lock:
        _live[a.base] = a
    weakref.finalize(arr, _recycle, a.base)
    return torch.from_numpy(arr)[:nbytes]


def arena_of(addr: int, nbytes: int) -> Optional[_Arena]:
    """The live arena holding ``[addr, addr + nbytes)``, if any."""
    with _lock:
        for a in _live.values():
            if a.base <= addr and addr + nbytes <= a.base + a.size:
                return a
    return None


def host_identity() -> dict:
    """What two processes compare to know they share this host's memory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:  # pragma: no cover - not Linux
        boot = ""
    return {"hostname": socket.gethostname(), "boot_id": boot}


def socket_name(endpoint: str) -> bytes:
    """The abstract Unix socket of the holder whose data-plane endpoint is ``endpoint``."""
    return b"\0tensorhub-samehost:" + endpoint.encode()[:80]


# ---------------------------------------------------------------------- the transport
@dataclass
class _Mapped:
    """Arenas of one (lease, replica) on a holder: ``(base, size, view)``, ``view`` a
    read-only uint8 tensor over our mapping of it; empty: not readable same-host."""

    arenas: list[tuple[int, int, Any]]

    def find(self, addr: int, n: int) -> Optional[tuple[int, int, Any]]:
        for a in self.arenas:
            if a[0] <= addr and addr + n <= a[0] + a[1]:
                return a
        return None


class _Maps:
    """The reader's read-only mappings of holders' arenas, by file identity (a memfd's
    device and inode): a later lease on the same memory reuses the mapping, whose page
    tables are already filled (MAP_POPULATE costs ~0.1 s/GiB; the copy then runs at memcpy
    speed). A mapping keeps its memfd alive, so one unused for ``idle`` seconds is dropped
    (by the next lookup or the sweeper thread), and at most ``cap`` bytes stay mapped."""

    def __init__(self, idle: float = 30.0, cap: int = 64 << 30) -> None:
        self.idle, self.cap = idle, cap
        self._by_file: dict[tuple[int, int], list] = {}  # (dev, ino) -> [view, size, last used]
        self._lock = threading.Lock()

    def view(self, fd: int, size: int) -> Any:
        """A read-only tensor over ``fd`` (closed here), mapped once per file."""
        import time
        import warnings

        import torch

        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        now = time.monotonic()
        with self._lock:
            hit = self._by_file.get(key)
            if hit is not None and hit[1] == size:
                hit[2] = now
                os.close(fd)
                return hit[0]
        try:
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        with warnings.catch_warnings():  # read-only on purpose: we never write through it
            warnings.simplefilter("ignore")
            view = torch.frombuffer(mm, dtype=torch.uint8)
        with self._lock:
            self._by_file[key] = [view, size, now]
        self.sweep()
        return view

    def sweep(self, everything: bool = False) -> None:
        """Drop mappings idle too long, then the oldest past the cap. (Copies in flight keep
        their view, so the mapping itself goes when they end.)"""
        import time

        now = time.monotonic()
        with self._lock:
            items = sorted(self._by_file.items(), key=lambda kv: kv[1][2])
            total = sum(v[1] for _, v in items)
            for k, v in items:
                if everything or now - v[2] > self.idle or total > self.cap:
                    total -= v[1]
                    del self._by_file[k]

    def mapped_bytes(self) -> int:
        with self._lock:
            return sum(v[1] for v in self._by_file.values())


#: ``authorize(lease_id, replica_id, worker_id) -> regions of that replica or None (refused)``.
Authorize = Callable[[str, str, str], Optional[list[tuple[int, int]]]]


class SameHostTransport(Transport):
    """Wraps a transport; copies from same-host holders' arenas (module docstring)."""

    def __init__(self, inner: Transport, *, token: Optional[str], host_label: str,
                 authorize: Authorize, worker_id: str, threads: int = 4) -> None:
        super().__init__()
        self.inner = inner
        self.max_batch_entries = inner.max_batch_entries
        self.max_entry_bytes = inner.max_entry_bytes
        self._token = token or ""
        self._label = host_label
        self._authorize = authorize
        self._worker_id = worker_id
        self._ident = dict(host_identity(), label=host_label)
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="tensorhub-shm")
        self._jobs: dict[int, Future] = {}
        self._ids = itertools.count(_HANDLE_BASE)
        self._mapped: dict[tuple[str, str], _Mapped] = {}  # (lease, replica) -> arenas
        self.maps = _Maps()
        self._sweeper: Optional[threading.Thread] = None
        self._mlock = threading.Lock()
        self._server: Optional[socket.socket] = None
        self._thread: Optional[threading.Thread] = None
        #: Counters (tests, benchmarks): bytes copied same-host, batches sent to ``inner``.
        self.copied_bytes = 0
        self.inner_batches = 0
        #: Tests: seconds each same-host copy waits before it starts (a slow reader).
        self.copy_delay = 0.0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> str:
        ep = self.inner.start()
        self._endpoint = ep
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            srv.bind(socket_name(ep))
            srv.listen(64)
        except OSError as e:
            srv.close()
            logger.warning("same-host fd server not started on %s: %s (same-host readers use %s)",
                           ep, e, type(self.inner).__name__)
            return ep
        self._server = srv
        self._thread = threading.Thread(target=self._serve, name="tensorhub-samehost", daemon=True)
        self._thread.start()
        return ep

    def _shutdown(self) -> None:
        srv, self._server = self._server, None
        if srv is not None:
            try:
                srv.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            srv.close()
        self._pool.shutdown(wait=True)
        with self._mlock:
            self._mapped = {}
        self.maps.sweep(everything=True)
        self.inner.close()

    def _register_region(self, addr: int, nbytes: int) -> None:
        self.inner.register(addr, nbytes)

    def _unregister_region(self, addr: int, nbytes: int) -> None:
        self.inner.unregister(addr, nbytes)

    # ------------------------------------------------------------------ holder: the fd server
    def _serve(self) -> None:
        srv = self._server
        while srv is not None and self._server is srv:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        fds: list[int] = []
        try:
            conn.settimeout(10.0)
            raw = conn.recv(_MAX_MSG)
            req = json.loads(raw.decode())
            answer: dict[str, Any] = dict(self._ident, arenas=[])
            if self._token and not hmac.compare_digest(str(req.get("token", "")).encode(), self._token.encode()):
                answer["why"] = "token refused"
            elif any(req.get("host", {}).get(k) != v for k, v in self._ident.items()):
                answer["why"] = "not on this host"
            else:
                regions = self._authorize(str(req["lease_id"]), str(req["replica_id"]), str(req["worker_id"]))
                if regions is None:
                    answer["why"] = "no valid lease on that replica"
                else:
                    arenas = []
                    for addr, n in regions:
                        a = arena_of(addr, n)
                        if a is None:  # part of it is not ours to map: the reader uses Mooncake
                            arenas = []
                            break
                        if all(x.base != a.base for x in arenas):
                            arenas.append(a)
                    for a in arenas[:_MAX_FDS]:
                        fds.append(os.open(f"/proc/self/fd/{a.fd}", os.O_RDONLY | os.O_CLOEXEC))
                    answer["arenas"] = [[a.base, a.size] for a in arenas[:len(fds)]]
            socket.send_fds(conn, [json.dumps(answer).encode()], fds)
        except Exception as e:  # a bad request ends its connection, never the server
            logger.debug("same-host request refused: %s", e)
        finally:
            for fd in fds:
                os.close(fd)
            conn.close()

    # ------------------------------------------------------------------ reader
    def _arenas(self, src: Any) -> _Mapped:
        key = (src.lease_id, src.replica_id)
        with self._mlock:
            m = self._mapped.get(key)
        if m is not None:
            return m
        m = self._ask(src)
        with self._mlock:
            old = self._mapped.setdefault(key, m)
        return old

    def _ask(self, src: Any) -> _Mapped:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        fds: list[int] = []
        try:
            s.settimeout(5.0)
            s.connect(socket_name(src.endpoint))
            s.sendall(json.dumps({"token": self._token, "lease_id": src.lease_id, "replica_id": src.replica_id,
                                  "worker_id": self._worker_id, "host": self._ident}).encode())
            data, fds, _, _ = socket.recv_fds(s, _MAX_MSG, _MAX_FDS)
            ans = json.loads(data.decode())
        except (OSError, ValueError) as e:
            for fd in fds:
                os.close(fd)
            if not (isinstance(e, OSError) and e.errno in (errno.ECONNREFUSED, errno.ENOENT)):
                logger.debug("same-host ask to %s failed: %s", src.endpoint, e)
            return _Mapped([])
        finally:
            s.close()
        same = all(ans.get(k) == v for k, v in self._ident.items())
        arenas = ans.get("arenas", [])
        if not same or len(arenas) != len(fds) or not fds:
            for fd in fds:
                os.close(fd)
            if ans.get("why"):
                logger.info("same-host read from %s refused (%s): reading over %s", src.endpoint, ans["why"],
                            type(self.inner).__name__)
            return _Mapped([])
        views = []
        try:
            for i, ((_, n), fd) in enumerate(zip(arenas, fds)):
                views.append(self.maps.view(fd, int(n)))  # closes fd
        except (OSError, ValueError) as e:
            for fd in fds[i + 1:]:
                os.close(fd)
            logger.info("cannot map %s's memory (%s): reading over %s", src.endpoint, e, type(self.inner).__name__)
            return _Mapped([])
        self._start_sweeper()
        return _Mapped([(int(b), int(n), v) for (b, n), v in zip(arenas, views)])

    def _start_sweeper(self) -> None:
        if self._sweeper is not None:
            return

        def loop() -> None:
            import time

            while not self._closed:
                time.sleep(min(5.0, self.maps.idle / 2))
                self.maps.sweep()

        self._sweeper = threading.Thread(target=loop, name="tensorhub-shm-sweep", daemon=True)
        self._sweeper.start()

    def forget(self, lease_ids: set[str]) -> None:
        """A read run ended: forget what ``lease_ids`` allowed (a reader's call); a new lease
        asks the holder again (an address may then be another arena; the file identity
        tells whether our mapping still fits)."""
        with self._mlock:
            for k in [k for k in self._mapped if k[0] in lease_ids]:
                del self._mapped[k]

    def map_regions(self, src: Any, regions: Sequence[tuple[int, int]]) -> Optional[list[Any]]:
        """Read-only uint8 views of ``regions`` (``(address, nbytes)`` in source ``src``'s
        memory, a ``_reader.Source`` under its lease) in our mapping of its arenas, for
        ``Hub.borrow`` (``_borrow``); a zero-byte region gives None. None when ``src`` is
        not on this host or any region lies outside its arenas. Valid while the lease is."""
        m = self._arenas(src)
        if not m.arenas:
            return None
        out: list[Any] = []
        for addr, n in regions:
            if n == 0:
                out.append(None)
                continue
            a = m.find(addr, n)
            if a is None:
                return None
            base, _, view = a
            out.append(view[addr - base:addr - base + n])
        return out

    def mapped_ranges(self, src: Any) -> list[tuple[int, int]]:
        """``(local address, nbytes)`` of our mappings of ``src``'s arenas (``map_regions``)."""
        with self._mlock:
            m = self._mapped.get((src.lease_id, src.replica_id))
        return [] if m is None else [(v.data_ptr(), v.numel()) for _, _, v in m.arenas]

    def submit_from(self, src: Any, ops: Sequence[ReadOp]) -> int:
        """Read ``ops`` from source ``src`` (a ``_reader.Source``): copied from the holder's
        arenas when it is on this host and they cover every op, else by ``inner``."""
        self._check_batch(src.endpoint, ops)
        m = self._arenas(src)
        plan = [(op, m.find(op.remote_addr, op.length)) for op in ops] if m.arenas else []
        if not plan or any(a is None for _, a in plan):
            self.inner_batches += 1
            return self.inner.submit_read(src.endpoint, ops)
        h = next(self._ids)
        self._jobs[h] = self._pool.submit(self._copy, plan)
        return h

    def _copy(self, plan: list) -> None:
        import ctypes
        import time

        import torch

        if self.copy_delay:
            time.sleep(self.copy_delay)
        for op, (base, _, view) in plan:
            dst = torch.frombuffer((ctypes.c_char * op.length).from_address(op.local_addr), dtype=torch.uint8)
            off = op.remote_addr - base
            dst.copy_(view[off:off + op.length])
            self.copied_bytes += op.length

    def submit_read(self, peer: str, ops: Sequence[ReadOp]) -> int:
        self.inner_batches += 1
        return self.inner.submit_read(peer, ops)

    def poll(self, handle: int) -> int:
        job = self._jobs.get(handle)
        if job is None:
            return self.inner.poll(handle)
        if not job.done():
            return PENDING
        del self._jobs[handle]
        e = job.exception()
        if e is not None:
            logger.warning("same-host copy failed: %s", e)
            return -5
        return DONE

    def cancel(self, handle: int) -> bool:
        job = self._jobs.get(handle)
        if job is None:
            return self.inner.cancel(handle)
        if job.cancel():
            del self._jobs[handle]
            return True
        return False
