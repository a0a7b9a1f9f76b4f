"""Arenas (the holder side of same-host reads, ``_shm``). CPU memory the Hub allocates
(fetched copies, the retained copy, snapshot buffers from ``Hub.empty_like``) is a
``memfd_create`` file mapped shared: an *arena*. ``empty(nbytes)`` returns a uint8 tensor over one. When the last
tensor viewing an arena dies, the arena goes back to a small pool (its pages already
faulted in) instead of being unmapped, so the next fetch into new memory of a similar
size pays no first-touch page faults (these cost ~1 s/GiB on the test VMs, more than
the copy). ``TENSORHUB_SHM_POOL_BYTES`` caps what the pool keeps (default: the largest
arena made, i.e. one model's worth).

Also here: a reader's read-only mappings of holders' arenas (``_Maps``, ``_Mapped``), and
what both ends of a same-host read use to know each other -- the host's
identity, the holder's socket name, the peer's credentials and whom to trust.
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Optional

from .. import envs

__all__ = ["empty", "arena_of", "host_identity", "pool_bytes", "trim", "socket_name", "peer_creds", "trusted_uid"]

_PAGE = mmap.PAGESIZE


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


def _shown(name: bytes) -> str:
    """An abstract socket name as ``ss -x`` shows it (``@`` for the leading NUL)."""
    return "@" + name[1:].decode(errors="replace")


def peer_creds(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of the Unix socket ``sock``
    (``SO_PEERCRED``: for a listening socket, who called ``listen``)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def trusted_uid(uid: int) -> bool:
    """Whether a peer of that uid may take part in same-host reads with this process: our
    own (effective) uid or root, the processes that can read our memory anyway (ptrace,
    /proc/<pid>/mem). Anyone else gets nothing and is sent nothing."""
    return uid == os.geteuid() or uid == 0


# ---------------------------------------------------------------------- a reader's mappings of holders' arenas
@dataclass
class _Mapped:
    """Arenas of one (lease, replica) on a holder: ``(base, size, view)``, ``view`` a
    read-only uint8 tensor over our mapping of it; empty: not readable same-host."""

    arenas: list[tuple[int, int, Any]]
    #: The holder's pid as this process sees it (``SO_PEERCRED``): its memory is read with
    #: ``process_vm_readv`` (``_vm``) where no arena covers an op; 0: not so readable.
    pid: int = 0
    #: ``_vm.probe`` ran (and, if it failed, ``pid`` was reset).
    probed: bool = False
    #: The holder's CUDA blocks opened for this lease (``_cudaipc.Blocks``); None: none.
    cuda: Any = None

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
