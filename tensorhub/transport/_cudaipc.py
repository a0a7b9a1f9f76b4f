"""Same-host reads of a holder's CUDA memory through CUDA IPC handles (issue 34).

Used by :class:`~tensorhub.transport._shm.SameHostTransport` on both sides; importable
without CUDA (torch is imported inside the functions that need it). Any CUDA tensor a
holder serves qualifies, torch's caching-allocator blocks included: a tensor's bytes lie in
a *block* (a storage) inside a *segment* (one ``cudaMalloc``, or an expandable segment),
and an IPC handle names the segment; torch's ``storage._share_cuda_()`` gives the handle
and the storage's offset in it, ``UntypedStorage._new_shared_cuda(...)`` opens it in
another process (the driver maps each segment once per process: torch caches the opened
handle) and returns a storage at that offset (``torch/multiprocessing/reductions.py``,
``reduce_tensor`` / ``rebuild_cuda_tensor``).

* **holder** (:func:`export`): after the coordinator confirmed the reader's lease
  (``_samehost.wrap``'s ``authorize``), describes the blocks behind the replica's CUDA
  tensors, clipped to the replica's regions, as JSON: device (index and UUID), handle,
  offset of the first byte in the segment, its remote address, size, and the IPC events
  torch recorded when the block was first shared (the reader waits on them once, at open:
  what the holder had queued on its default stream then is done). Touching pieces of one
  segment are one description: many tensors in one block (or in adjacent blocks) are
  listed once.
* **reader** (:class:`Opened`): opens each description once per holder (cached by
  holder, handle and range) -- in the context of the device the reader works on when it
  can (no new CUDA context; a peer mapping when the holder's GPU is another, even one this
  process cannot see, as with one GPU per process), else on its own index of the holder's
  GPU (by UUID) --, maps a remote range to a local device pointer (local address of the
  block + (remote - remote address of the block)), probes one byte, and drops the
  opened storage -- which unmaps the segment once nothing else of ours uses it -- when no
  lease of its own is left (:meth:`Opened.forget`, from the transport's ``forget`` at the
  end of a read run). :func:`copy` then copies every op with ``cudaMemcpyAsync`` and
  ``cudaMemcpyDefault`` on a stream of our own, and synchronizes before the op is done.

**Reference counts.** ``_share_cuda_`` wraps the storage's memory in torch's
``CudaIPCSentData`` with a counter (in a shared-memory file) set to 1, and expects exactly
one consumer to decrement it when its opened storage dies; while the counter is above 0 a
freed block is kept in torch's limbo instead of going back to the allocator. A holder here
serves many readers, each opening (and closing) a block once per lease, so that scheme
would need one share -- one more ``CudaIPCSentData``, counter slot and IPC event, kept until
the storage dies -- per answer, and would pin the holder's freed memory forever after a
reader crashed before releasing. Instead each storage is shared **once** (cached while it
lives), the holder drops the counter to 0 at once (``_release_ipc_counter_cuda``), so the
block's lifetime stays the storage's, and readers open with a counter name no process can
create (``/tensorhub/none``: ``shm_open`` refuses names with an inner ``/``), so their
release touches no counter -- the path torch takes, silently, when a producer exited
before its consumer. What keeps the bytes valid is the lease, as for every other read
(DESIGN.md invariant 3): the holder keeps the tensors (``Held``) until ``unpublish``
drained the readers' leases, and a reader drops its opened blocks when its read run ends.
One side effect is torch's, as for any tensor sent through ``torch.multiprocessing``: once
a storage was shared, ``record_stream`` on it is a no-op (the caching allocator skips memory
behind a ``CudaIPCSentData``), so a holder that frees a published tensor still used on a
side stream synchronizes that stream first.

**The copy.** The reader knows its destinations only as addresses: host memory (Hub
arenas, the user's tensors; pageable or pinned) or its own device memory, on any of its
devices. Under unified addressing (every 64-bit CUDA process) ``cudaMemcpyDefault`` lets
the runtime infer each side's kind and device from the pointer, so one call covers all of
them (D2D on one GPU, peer, D2H); a torch copy would need a tensor over a raw destination
address (``__cuda_array_interface__`` copies silently under ``torch.set_default_device``
and refuses host pointers). The runtime is the ``libcudart`` torch loaded (found in
``/proc/self/maps``), called through ctypes on a non-blocking stream created here per
device (pooled), then ``cudaStreamSynchronize`` before the batch is reported done. These
calls, the open and its probe run on the transport's copy threads, never the caller's,
whose current device they would change.

Only a reader that can use CUDA asks for it (``"cuda": true`` in its request); the holder
answers ``cuda`` only when ``torch.cuda`` is available there. A holder's GPU the reader can
neither map peer to peer nor see, a block the driver will not open (a pluggable allocator,
expandable segments where torch does not share them, a storage received from another
process), or a failed probe: the reader reads that lease over the wrapped transport, and
says so once. Not yet run on a GPU in CI: ``scripts/gpu_check.sh`` exercises it on a device
(``benchmarks/gpu_check.py``, step "same-host CUDA IPC"); ``tests/test_samehost_cuda.py``
covers the protocol around it with a fake backend (the ``_share`` / ``_open`` /
``_set_device`` / ``_stream`` / ``_memcpy`` / ``_sync`` seams below).
"""

from __future__ import annotations

import base64
import bisect
import ctypes
import logging
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

from ._base import ReadOp

__all__ = ["available", "preferred_device", "export", "copy", "Opened", "Blocks", "Plan", "NO_REF_COUNTER"]

logger = logging.getLogger(__name__)

#: The ref-counter name readers open with: invalid for ``shm_open`` (an inner ``/``), so
#: the opened storage's release decrements nothing (module docstring, "Reference counts").
NO_REF_COUNTER = b"/tensorhub/none"
#: Most descriptions one answer may carry (the reader refuses more).
MAX_BLOCKS = 65536
_CUDA_MEMCPY_DEFAULT = 4
_CUDA_STREAM_NON_BLOCKING = 1


# ---------------------------------------------------------------------- seams (tests replace these)
_avail: Optional[bool] = None


def available() -> bool:
    """Whether this process can share (holder) or open (reader) CUDA memory: torch with a
    usable CUDA device. Checked once per process."""
    global _avail
    if _avail is None:
        try:
            import torch

            _avail = bool(torch.cuda.is_available())
        except Exception:  # pragma: no cover - torch missing or broken
            _avail = False
    return _avail


@dataclass(frozen=True)
class Shared:
    """One storage (caching-allocator block) as ``_share_cuda_`` describes it (holder)."""

    device: int
    uuid: str
    handle: bytes  # names the segment
    offset: int  # of the storage's first byte in the segment
    addr: int  # the storage's first byte in the holder's address space
    size: int
    event: bytes = b""  # an IPC event recorded after the holder's writes (empty: none)


_share_lock = threading.Lock()
_shared: dict[int, tuple[Any, Shared]] = {}  # StorageImpl address -> (weak ref, what it shared)


def _uuid(device: int) -> str:
    import torch

    u = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    if u is None:  # pragma: no cover - an old torch
        return ""
    try:
        return bytes(u.bytes).hex()
    except (AttributeError, TypeError, ValueError):  # pragma: no cover
        return str(u)


def _share(tensor: Any) -> Optional[Shared]:
    """The block behind a CUDA ``tensor`` (None for any other tensor). Each storage is
    shared once while it lives (``_share_cuda_``), and torch's counter is dropped to 0 at
    once: its memory goes back to the allocator when the storage dies, as if never shared."""
    if getattr(getattr(tensor, "device", None), "type", None) != "cuda":
        return None
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef

    st = tensor.untyped_storage()
    if st.nbytes() == 0 or st.data_ptr() == 0:
        return None
    key = st._cdata
    with _share_lock:
        hit = _shared.get(key)
        if hit is not None and not hit[0].expired() and hit[1].addr == st.data_ptr() and hit[1].size == st.nbytes():
            return hit[1]
        device, handle, size, offset, ref, ref_offset, event, sync = st._share_cuda_()
        torch.UntypedStorage._release_ipc_counter_cuda(ref, ref_offset)  # no reader holds torch's count
        s = Shared(int(device), _uuid(int(device)), bytes(handle), int(offset), st.data_ptr(), int(size),
                   bytes(event) if sync else b"")
        for k in [k for k, (w, _) in _shared.items() if w.expired()]:
            del _shared[k]
        _shared[key] = (StorageWeakRef(st), s)
    return s


def _local_device(uuid: str, index: int) -> int:
    """Our index of the holder's GPU (by UUID when it sent one)."""
    import torch

    n = torch.cuda.device_count()
    if uuid:
        for i in range(n):
            if _uuid(i) == uuid:
                return i
        raise LookupError(f"the holder's GPU {uuid} is not visible to this process ({n} visible)")
    if not 0 <= index < n:
        raise LookupError(f"the holder's GPU {index} is not visible to this process ({n} visible)")
    return index


def preferred_device() -> Optional[int]:
    """The device the calling (reader's) thread works on, when it uses CUDA already: blocks
    are opened there first (no new CUDA context; a peer mapping when the holder's GPU is
    another one, or one this process cannot see)."""
    try:
        import torch

        return int(torch.cuda.current_device()) if torch.cuda.is_initialized() else None
    except Exception:  # pragma: no cover - a broken CUDA setup: the holder's device is tried
        return None


def _open(desc: dict, prefer: Optional[int] = None) -> tuple[Any, int, int]:
    """Open one description (reader): ``(opened storage, its local address, our device
    index)``; the storage keeps the mapping, dropping it closes it. Opened in the context of
    ``prefer`` (the reader's device: peer access is enabled lazily, as torch does), else,
    or if that fails, of our index of the holder's GPU (found by UUID)."""
    import torch

    torch.cuda.init()
    tried: list[str] = []
    candidates = [] if prefer is None else [prefer]
    try:
        own = _local_device(str(desc.get("uuid") or ""), int(desc["device"]))
        candidates += [own] if own != prefer else []
    except LookupError as e:
        tried.append(str(e))
    handle = base64.b64decode(desc["handle"])
    for dev in candidates:
        try:
            with torch.cuda.device(dev):
                st = torch.UntypedStorage._new_shared_cuda(dev, handle, int(desc["size"]), int(desc["offset"]),
                                                           NO_REF_COUNTER, 0, b"", False)
        except Exception as e:  # (torch raises RuntimeError, or its subclass AcceleratorError)
            tried.append(f"on device {dev}: {e}".split("\n")[0])
            continue
        for ev in desc.get("events", ()):  # what the holder queued before it shared the block is done
            try:
                torch.cuda.Event.from_ipc_handle(torch.device("cuda", dev), base64.b64decode(ev)).synchronize()
            except Exception as e:  # (best effort: a published tensor is complete, as for Mooncake's reads)
                logger.debug("cannot wait on the holder's IPC event on device %d: %s", dev, e)
        return st, st.data_ptr(), dev
    raise LookupError("; ".join(tried) or "no CUDA device to open it on")


_rt: Optional[ctypes.CDLL] = None
_rt_lock = threading.Lock()


def _cudart() -> ctypes.CDLL:
    """The CUDA runtime torch loaded (its path in /proc/self/maps), else one by name."""
    global _rt
    with _rt_lock:
        if _rt is not None:
            return _rt
        names: list[str] = []
        try:  # (torch's wheels load libcudart.so.<major>, older ones a renamed libcudart-<hash>.so.<v>)
            with open("/proc/self/maps") as f:
                names += sorted({ln.split()[-1] for ln in f if re.search(r"/libcudart[^/]*\.so[^/]*$", ln.strip())})
        except OSError:  # pragma: no cover - not Linux
            pass
        names += ["libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"]
        errors = []
        for name in names:
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError as e:
                errors.append(str(e))
        else:
            raise OSError(f"no CUDA runtime library: {'; '.join(errors[-2:])}")
        lib.cudaSetDevice.argtypes = [ctypes.c_int]
        lib.cudaStreamCreateWithFlags.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                        ctypes.c_void_p]
        lib.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetLastError.argtypes = []
        for fn in (lib.cudaSetDevice, lib.cudaStreamCreateWithFlags, lib.cudaMemcpyAsync, lib.cudaStreamSynchronize,
                   lib.cudaGetLastError):
            fn.restype = ctypes.c_int
        _rt = lib
        return lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        rt = _cudart()
        rt.cudaGetLastError()  # (a non-sticky error must not surface in torch's next check on this thread)
        msg = rt.cudaGetErrorString(rc)
        raise RuntimeError(f"{what}: CUDA error {rc} ({msg.decode() if msg else '?'})")


def _set_device(device: int) -> None:
    """Make ``device`` current on this (copy) thread: its context, where the copies run."""
    _check(_cudart().cudaSetDevice(device), f"cudaSetDevice({device})")


def _stream(device: int) -> int:
    """A new non-blocking stream on ``device`` (current: :func:`copy` set it; pooled)."""
    rt = _cudart()
    s = ctypes.c_void_p()
    _check(rt.cudaStreamCreateWithFlags(ctypes.byref(s), _CUDA_STREAM_NON_BLOCKING), "cudaStreamCreateWithFlags")
    return int(s.value or 0)


def _memcpy(dst: int, src: int, n: int, stream: int) -> None:
    """Queue a copy of ``n`` bytes; each side's kind and device come from its address."""
    _check(_cudart().cudaMemcpyAsync(dst, src, n, _CUDA_MEMCPY_DEFAULT, stream), "cudaMemcpyAsync")


def _sync(stream: int) -> None:
    _check(_cudart().cudaStreamSynchronize(stream), "cudaStreamSynchronize")


# ---------------------------------------------------------------------- holder
_warned: set[str] = set()


def export(tensors: Iterable[Any], regions: Optional[Sequence[tuple[int, int]]] = None) -> list[dict]:
    """JSON-safe descriptions of the CUDA blocks behind ``tensors``, clipped to ``regions``
    (``(addr, nbytes)``; None: whole blocks). One per distinct block: tensors sharing a
    storage, or in touching blocks of one segment, give one description. Tensors not on
    CUDA, or whose storage torch will not share, are left out (readers read those bytes over
    the wrapped transport). Called by the holder's fd server after the lease was confirmed;
    the holder keeps the tensors (``Held``) for as long as any lease may read them."""
    shares: dict[tuple[int, int], Shared] = {}
    for t in tensors:
        try:
            s = _share(t)
        except Exception as e:  # a pluggable allocator, a received storage, expandable segments off
            why = f"{type(e).__name__}: {e}"
            if why not in _warned:
                _warned.add(why)
                logger.info("same-host reads: a CUDA tensor cannot be shared by IPC (%s); readers read it over "
                            "the data plane", why)
            continue
        if s is not None:
            shares[(s.addr, s.size)] = s
    pieces: list[list[Any]] = []  # [device, uuid, handle, offset, addr, size, events]
    for s in shares.values():
        spans = [(s.addr, s.addr + s.size)] if regions is None else \
            [(max(s.addr, a), min(s.addr + s.size, a + n)) for a, n in regions]
        for lo, hi in spans:
            if lo < hi:
                pieces.append([s.device, s.uuid, s.handle, s.offset + (lo - s.addr), lo, hi - lo,
                               {s.event} if s.event else set()])
    pieces.sort(key=lambda p: (p[0], p[2], p[4]))
    merged: list[list[Any]] = []
    for p in pieces:
        q = merged[-1] if merged else None
        if q is not None and q[0] == p[0] and q[2] == p[2] and q[4] - q[3] == p[4] - p[3] and p[4] <= q[4] + q[5]:
            q[5] = max(q[4] + q[5], p[4] + p[5]) - q[4]  # same segment, touching: one description
            q[6] |= p[6]
        else:
            merged.append(p)
    return [{"device": d, "uuid": u, "handle": base64.b64encode(h).decode(), "offset": off, "addr": a, "size": n,
             "events": sorted(base64.b64encode(e).decode() for e in ev)} for d, u, h, off, a, n, ev in merged]


# ---------------------------------------------------------------------- reader
@dataclass(eq=False)
class _Block:
    """One opened description: remote ``[addr, addr + size)`` is local ``[local, local + size)``."""

    addr: int
    size: int
    local: int
    device: int
    keep: Any  # the opened storage: the mapping lives while it does
    leases: set[str] = field(default_factory=set)


@dataclass
class Plan:
    """One batch as copies ``(dst, src, n, device)``; holds the blocks it reads."""

    copies: list[tuple[int, int, int, int]]
    keep: list[_Block]

    @property
    def nbytes(self) -> int:
        return sum(c[2] for c in self.copies)


class Blocks:
    """The opened blocks of one (lease, replica), sorted by remote address."""

    def __init__(self, blocks: Sequence[_Block]) -> None:
        self.blocks = sorted(blocks, key=lambda b: b.addr)
        self._starts = [b.addr for b in self.blocks]

    def local(self, addr: int) -> Optional[tuple[int, int, _Block]]:
        """``(local address, bytes left in its block, block)`` of remote ``addr``."""
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0:
            return None
        b = self.blocks[i]  # (descriptions never overlap: distinct segments, or disjoint pieces of one)
        if addr >= b.addr + b.size:
            return None
        return b.local + (addr - b.addr), b.addr + b.size - addr, b

    def plan(self, ops: Sequence[ReadOp]) -> Optional[Plan]:
        """Every op as copies from opened blocks (an op over touching blocks is split at
        their seams), or None when any byte lies outside them."""
        copies: list[tuple[int, int, int, int]] = []
        keep: dict[int, _Block] = {}
        for op in ops:
            dst, remote, left = op.local_addr, op.remote_addr, op.length
            while left > 0:
                hit = self.local(remote)
                if hit is None:
                    return None
                src, room, b = hit
                n = min(left, room)
                copies.append((dst, src, n, b.device))
                keep[id(b)] = b
                dst, remote, left = dst + n, remote + n, left - n
        return Plan(copies, list(keep.values()))


class _Streams:
    """Our copy streams, per device; one is taken per batch and given back after it."""

    def __init__(self) -> None:
        self._free: dict[int, list[int]] = {}
        self._lock = threading.Lock()

    def take(self, device: int) -> int:
        with self._lock:
            free = self._free.setdefault(device, [])
            if free:
                return free.pop()
        return _stream(device)

    def give(self, device: int, stream: int) -> None:
        with self._lock:
            self._free.setdefault(device, []).append(stream)


_streams = _Streams()


def copy(plan: Plan) -> int:
    """Run ``plan`` on one of the transport's copy threads (never a caller's: the device it
    makes current stays so): queue every copy on a stream of the device the source block was
    opened on, then wait for them all. Returns the bytes copied. On an error it still waits
    for what was queued (nothing lands after the batch failed), then raises."""
    by_dev: dict[int, list[tuple[int, int, int]]] = {}
    for dst, src, n, dev in plan.copies:
        by_dev.setdefault(dev, []).append((dst, src, n))
    taken: list[tuple[int, int]] = []
    try:
        for dev, copies in by_dev.items():
            _set_device(dev)
            s = _streams.take(dev)
            taken.append((dev, s))
            for dst, src, n in copies:
                _memcpy(dst, src, n, s)
        for _, s in taken:
            _sync(s)
    except BaseException:
        for _, s in taken:
            try:
                _sync(s)
            except Exception:  # pragma: no cover - the context is broken: nothing more to wait for
                pass
        raise
    finally:
        for dev, s in taken:
            _streams.give(dev, s)
    return plan.nbytes


def _valid(desc: Any) -> bool:
    if not isinstance(desc, dict):
        return False
    ints = ("device", "offset", "addr", "size")
    if not all(isinstance(desc.get(k), int) and not isinstance(desc.get(k), bool) for k in ints):
        return False
    return desc["size"] > 0 and desc["offset"] >= 0 and desc["addr"] > 0 and isinstance(desc.get("handle"), str) \
        and isinstance(desc.get("events", []), list) and isinstance(desc.get("uuid", ""), str)


class Opened:
    """The reader's opened blocks, across holders and leases (one per transport). A block is
    opened once per holder and range (``_open``), shared by every lease of ours that names
    it, and dropped -- its storage released, the segment unmapped once nothing of ours maps
    it -- when the last of those leases is forgotten."""

    def __init__(self) -> None:
        self._by_key: dict[tuple, _Block] = {}
        self._lock = threading.Lock()
        #: Descriptions opened (``_open`` calls) since this object was made (tests, benchmarks).
        self.opens = 0

    def open(self, holder: str, descs: Any, lease_id: str,
             prefer: Optional[int] = None) -> tuple[Optional[Blocks], str]:
        """Every one of ``descs`` (a holder's answer) opened for ``lease_id``: ``(blocks, "")``,
        or ``(None, why)`` when any cannot be (then nothing stays opened for this lease).
        ``holder`` names the holder process (its endpoint and pid); ``prefer``: the reader's
        device (:func:`preferred_device`). Run on a copy thread (it probes a fresh block)."""
        if not isinstance(descs, list) or not descs or len(descs) > MAX_BLOCKS or not all(_valid(d) for d in descs):
            return None, "a malformed answer"
        got: list[_Block] = []
        added: list[_Block] = []  # blocks this call put ``lease_id`` on (taken off again on failure)
        fresh: list[_Block] = []
        try:
            for d in descs:
                key = (holder, d["device"], d.get("uuid") or "", d["handle"], d["offset"], d["addr"], d["size"])
                with self._lock:
                    b = self._by_key.get(key)
                    if b is not None and lease_id not in b.leases:
                        b.leases.add(lease_id)
                        added.append(b)
                if b is None:
                    keep, local, dev = _open(d, prefer)
                    with self._lock:  # (another thread may have opened it meanwhile: theirs is kept)
                        self.opens += 1
                        b = self._by_key.setdefault(key, _Block(d["addr"], d["size"], int(local), int(dev), keep))
                        if lease_id not in b.leases:
                            b.leases.add(lease_id)
                            added.append(b)
                    if b.keep is keep:
                        fresh.append(b)
                got.append(b)
            if fresh:
                _probe(fresh[0])
        except Exception as e:
            self._drop(added, {lease_id})
            return None, f"{type(e).__name__}: {e}"
        return Blocks(got), ""

    def _drop(self, blocks: Iterable[_Block], lease_ids: set[str]) -> None:
        gone = []
        with self._lock:
            ids = set()
            for b in blocks:
                b.leases -= lease_ids
                if not b.leases:
                    ids.add(id(b))
            for k in [k for k, b in self._by_key.items() if id(b) in ids]:
                gone.append(self._by_key.pop(k))
        del gone  # the storages go here (outside the lock): torch closes the mappings

    def forget(self, lease_ids: set[str]) -> None:
        """A read run ended: blocks no other lease of ours names are closed."""
        with self._lock:
            blocks = [b for b in self._by_key.values() if b.leases & lease_ids]
        if blocks:
            self._drop(blocks, lease_ids)

    def close(self) -> None:
        with self._lock:
            gone, self._by_key = list(self._by_key.values()), {}
        del gone

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_key)


def _probe(b: _Block) -> None:
    """Read one byte of a freshly opened block into host memory: a reader whose runtime
    cannot copy from it finds out before the first chunk (and reads over the data plane)."""
    buf = ctypes.create_string_buffer(1)
    copy(Plan([(ctypes.addressof(buf), b.local, 1, b.device)], [b]))
