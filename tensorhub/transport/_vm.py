"""Cross-memory reads of a same-host holder's memory (``process_vm_readv``), for any CPU
tensor it published -- not only memory the Hub allocated (``_shm``'s memfd arenas).

Used by :class:`~tensorhub.transport._shm.SameHostTransport` on both sides:

* **holder** (:func:`allow_readers`): when the kernel's Yama LSM restricts ptrace to
  descendants (``/proc/sys/kernel/yama/ptrace_scope`` = 1), the holder opts in with
  ``prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)`` the first time an authorized same-host
  reader asks (same uid or root only ever gets that far: ``SO_PEERCRED``). Scope 0 needs
  nothing; scopes 2 and 3 refuse non-root readers whatever the holder does.
* **reader** (:func:`probe`, :func:`read_into`): reads the holder's pages straight into
  its own memory with ``process_vm_readv`` -- one kernel copy, no mapping, no fds. A
  refusal (Yama, a non-dumpable holder, seccomp, ``ENOSYS``) is found by :func:`probe`
  before the first chunk, and the reader reads over the wrapped transport instead.

Measured on the test VM (2 cores; ``benchmarks/bench_fetch.py``): one thread ~4 GB/s
against memcpy ~9 GB/s; the transport's copy pool (several chunks at once) reaches
0.7-0.85x of torch's parallel memcpy.

What it does not change: leases, drains, fencing and checksums. The reader issues the
same ops, chunk by chunk, under the same lease, and verifies checksums on the landed
bytes; the holder's memory cannot change before the lease is released or lapsed.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
from typing import Optional, Sequence

from ._base import ReadOp

__all__ = ["allow_readers", "probe", "read_into", "yama_scope"]

logger = logging.getLogger(__name__)

#: Most iovecs per call (the kernel's UIO_MAXIOV).
_IOV_MAX = 1024
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc: Optional[ctypes.CDLL] = None
_allowed = False
_lock = threading.Lock()


def _c() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.process_vm_readv.restype = ctypes.c_ssize_t
        _libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                                           ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
    return _libc


def yama_scope() -> Optional[int]:
    """The Yama ptrace scope (None: no Yama on this kernel)."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def allow_readers() -> None:
    """Holder side: let same-uid readers cross-read this process where Yama restricts
    ptrace to descendants (scope 1). Once per process; best effort (logged)."""
    global _allowed
    with _lock:
        if _allowed:
            return
        _allowed = True
    if yama_scope() != 1:
        return
    r = _c().prctl(_PR_SET_PTRACER, ctypes.c_ulong(_PR_SET_PTRACER_ANY), 0, 0, 0)
    if r != 0:
        logger.info("same-host reads: prctl(PR_SET_PTRACER) failed (%s); readers will use the data plane",
                    os.strerror(ctypes.get_errno()))


def _call(pid: int, local: list[tuple[int, int]], remote: list[tuple[int, int]]) -> int:
    n = len(local)
    lv, rv = (_Iovec * n)(*[_Iovec(a, m) for a, m in local]), (_Iovec * len(remote))(*[_Iovec(a, m) for a, m in remote])
    got = _c().process_vm_readv(pid, lv, n, rv, len(remote), 0)
    if got < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"process_vm_readv from pid {pid}: {os.strerror(e)}")
    return got


def probe(pid: int, addr: int) -> Optional[str]:
    """Reader side: can this process read one byte at ``addr`` of process ``pid``? None if
    so, else why not (the kernel's refusal, as text)."""
    buf = ctypes.create_string_buffer(1)
    try:
        _call(pid, [(ctypes.addressof(buf), 1)], [(addr, 1)])
    except OSError as e:
        return e.strerror or str(e)
    except (AttributeError, TypeError) as e:  # pragma: no cover - no such call in this libc
        return f"no process_vm_readv: {e}"
    return None


def read_into(pid: int, ops: Sequence[ReadOp]) -> int:
    """Copy every op's ``remote_addr`` range of process ``pid`` to its ``local_addr``;
    returns the bytes copied. Raises OSError (EFAULT: an address not mapped any more; ESRCH:
    the holder is gone) -- the caller's read then fails over like any failed transfer."""
    total = 0
    pending = [(op.local_addr, op.remote_addr, op.length) for op in ops if op.length]
    while pending:
        batch, pending = pending[:_IOV_MAX], pending[_IOV_MAX:]
        want = sum(n for _, _, n in batch)
        got = _call(pid, [(l, n) for l, _, n in batch], [(r, n) for _, r, n in batch])
        total += got
        if got < want:  # partial: continue after the last byte copied
            rest, skip = [], got
            for l, r, n in batch:
                if skip >= n:
                    skip -= n
                    continue
                rest.append((l + skip, r + skip, n - skip))
                skip = 0
            if got == 0:
                raise OSError(errno.EFAULT, f"process_vm_readv from pid {pid} copied nothing")
            pending = rest + pending
    return total
