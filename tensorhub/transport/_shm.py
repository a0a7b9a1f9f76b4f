"""Same-host reads at memory speed: a transport that copies from memory it maps.

The holdings it maps are arenas (``_arena``: memfd-backed memory the Hub allocates).

**The fd server and the copying transport.** :class:`SameHostTransport` wraps the real
  transport (Mooncake). Once started it listens on an abstract Unix socket named after its
  endpoint (abstract names are per network namespace: a reader in another namespace cannot
  reach it). A reader that was granted a lease naming one of our replicas, on its own host
  by the locality labels, asks over that socket for the arenas backing it, with a proof of
  its lease (``protocol.lease_proof``, keyed by the lease's secret, which only the reader was
  answered; never the API token). The holder asks the coordinator that the lease is valid,
  is the asker's, names that replica and that the proof is right (``authorize``); only then
  it sends read-only fds (``SCM_RIGHTS``) of the arenas covering the replica, with the
  arena addresses and its host identity (hostname, boot id, locality host label). The
  reader checks that identity against its own, maps each arena read-only
  (``MAP_POPULATE``; kept, by file identity, for later leases on the same memory, dropped
  after 30 s unused) and copies every batch whose remote ranges lie
  in those arenas with a tensor copy on a small thread pool (memcpy speed once mapped;
  ``preadv`` from the fd measured 6-8 GB/s against 11-16 GB/s here, the first mapping of a
  GiB ~0.1 s).
  Memory the Hub did not allocate (the user's own tensors, ``torch.empty_like``
  snapshots) is read with ``process_vm_readv`` instead (``_vm``: the holder answers
  ``vm`` rather than fds and, where Yama restricts ptrace, lets same-uid readers in; the
  reader probes one byte first and, if the kernel refuses, reads over the wrapped
  transport). A partial replica (a reader still receiving) is served the same way, for the
  chunks its chunk map says are ready: the reader's loop only asks for those.
  CUDA memory (caching-allocator blocks included) is read through CUDA IPC handles
  (``_cudaipc``: the holder answers ``cuda``, its blocks, to a reader that can use CUDA,
  which opens each once, copies with ``cudaMemcpyAsync`` and closes them when its read run
  ends; or, where it cannot open them, reads over the wrapped transport).
  Batches it cannot serve so (other hosts, ``samehost_vm`` off for user memory)
  go to the wrapped transport unchanged.

Trust (docs/concepts/samehost.md, "Trust model"): both ends check the other's uid with
``SO_PEERCRED`` before anything is sent or read -- only our own uid or root, who can read
this process's memory anyway -- so a local user of another uid who binds a holder's socket
name first learns nothing (and the holder refuses to start: :meth:`SameHostTransport.start`),
and one who connects gets nothing. The server's threads are fixed (one that accepts, four
that answer); waiting connections are bounded and time out (``_fdserver``).

Leases, drains, fencing and checksums are untouched: the reader still reads chunk by chunk
under the lease, verifies checksums on the landed chunk and releases the lease after its
copies ended, so the holder's ``unpublish`` waits for same-host readers exactly as for
remote ones. The fds a reader received are closed when its read run ends
(:meth:`SameHostTransport.forget`); a new lease asks again (an address may be a new arena
by then).

Lifecycle: the Session creates the wrapper with the inner transport (holder and reader);
``start()`` starts the inner transport and the server's threads; ``close()`` stops both.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import json
import logging
import os
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence

from .._exceptions import TransferError
from ..protocol import lease_proof
from . import _cudaipc, _vm
from ._arena import _Mapped, _Maps, host_identity, peer_creds, socket_name, trusted_uid
from ._base import DONE, PENDING, ReadOp, Transport
from ._fdserver import _MAX_FDS, Authorize, FdServer, Tensors

__all__ = ["SameHostTransport"]

logger = logging.getLogger(__name__)

#: One read of an answer on the fd socket, and the largest answer (CUDA block descriptions:
#: read until the holder closes).
_MAX_MSG, _MAX_ANSWER = 1 << 16, 16 << 20
#: Handles of same-host reads start here (the wrapped transport's are small integers).
_HANDLE_BASE = 1 << 48


#: Bytes a fused copy-and-hash moves before hashing them (``_fused``): small enough that
#: the hash reads them from cache, large enough that the calls cost little.
_SEGMENT = 1 << 20


def _fused(ops: Sequence[ReadOp], hasher: Callable[[], Any], move: Callable[[int, int, int], int],
           count: Callable[[int], None]) -> int:
    """Copy ``ops`` with ``move(local, remote, n)`` (bytes copied) a segment at a time,
    hashing each landed segment right after it (in op order: the stream the reader's
    checksum of the chunk hashes); returns the digest."""
    h = hasher()
    for op in ops:
        dst = memoryview((ctypes.c_char * op.length).from_address(op.local_addr)).cast("B")
        for o in range(0, op.length, _SEGMENT):
            n = min(_SEGMENT, op.length - o)
            move(op.local_addr + o, op.remote_addr + o, n)
            h.update(dst[o:o + n])
            count(n)
    return h.intdigest()


# ---------------------------------------------------------------------- the transport


class SameHostTransport(Transport):
    """Wraps a transport; copies from same-host holders' arenas (module docstring).

    ``token`` is accepted for older callers and unused: nothing on the fd socket carries
    the coordinator's API token (a reader proves its lease with the lease's secret).
    ``tensors`` (holder): the tensors of a replica, for CUDA IPC; None: CUDA memory is read
    over ``inner``. ``vm``: memory not in arenas (the user's own tensors) is served and read
    with ``process_vm_readv`` (``HubConfig.samehost_vm``); False: over ``inner``."""

    def __init__(self, inner: Transport, *, host_label: str, authorize: Authorize, worker_id: str,
                 token: Optional[str] = None, threads: int = 4, tensors: Optional[Tensors] = None,
                 vm: bool = True) -> None:
        super().__init__()
        self.inner = inner
        self.max_batch_entries = inner.max_batch_entries
        self.max_entry_bytes = inner.max_entry_bytes
        self._label = host_label
        self._authorize = authorize
        self._tensors = tensors
        self._vm = vm
        self._worker_id = worker_id
        self._ident = dict(host_identity(), label=host_label)
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="tensorhub-shm")
        self._jobs: dict[int, Future] = {}
        self._digests: dict[int, int] = {}  # handle -> hash of the bytes its copy landed (digest())
        self._ids = itertools.count(_HANDLE_BASE)
        self._mapped: dict[tuple[str, str], _Mapped] = {}  # (lease, replica) -> arenas
        self.maps = _Maps()
        self._sweeper: Optional[threading.Thread] = None
        self._mlock = threading.Lock()
        self._server: Optional[FdServer] = None
        self._start_error: Optional[str] = None
        #: Counters (tests, benchmarks): bytes copied same-host, batches sent to ``inner``.
        self.copied_bytes = 0
        self.inner_batches = 0
        #: Of ``copied_bytes``, those read with ``process_vm_readv`` (memory not in arenas).
        self.vm_bytes = 0
        self._vm_refused: set[str] = set()  # holders whose memory the kernel would not let us read
        #: Of ``copied_bytes``, those copied from holders' CUDA memory (CUDA IPC); the blocks
        #: this reader has open (``_cudaipc.Opened``).
        self.cuda_bytes = 0
        self.cuda = _cudaipc.Opened()
        #: Of ``copied_bytes``, those hashed by the copy that landed them (``submit_from``'s
        #: ``hasher``): the reader's checksums of them cost it no pass of its own.
        self.hashed_bytes = 0
        self._cuda_said: set[tuple[str, str]] = set()  # (holder, kind) already logged
        self._count_lock = threading.Lock()
        #: Tests: seconds each same-host copy waits before it starts (a slow reader).
        self.copy_delay = 0.0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> str:
        """Start ``inner`` and the fd server (holder side); idempotent. The server's socket
        name taken by another process is an error (:class:`TransferError`, naming it and
        ``TENSORHUB_SAMEHOST=0``), raised again at every later call: readers on this host
        would ask that process for our memory. Other bind failures (a sandbox without
        abstract sockets) only log: same-host readers then read over ``inner``."""
        if self._start_error is not None:
            raise TransferError("start", "", -errno.EADDRINUSE, self._start_error)
        ep = self.inner.start()
        self._endpoint = ep
        if self._server is not None:
            return ep
        srv = FdServer(socket_name(ep), ep, self._ident, self._authorize, self._tensors, vm=self._vm)
        try:
            srv.start()
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                logger.warning("same-host fd server not started on %s: %s (same-host readers use %s)",
                               ep, e, type(self.inner).__name__)
                return ep
            self._start_error = srv.taken()
            self.inner.close()  # nothing started is left running (the Session never saw it start)
            raise TransferError("start", "", -errno.EADDRINUSE, self._start_error) from None
        self._server = srv
        return ep

    def _shutdown(self) -> None:
        srv, self._server = self._server, None
        if srv is not None:
            srv.stop()
        self._pool.shutdown(wait=True)
        with self._mlock:
            self._mapped = {}
        self.cuda.close()
        self.maps.sweep(everything=True)
        self.inner.close()

    def _register_region(self, addr: int, nbytes: int) -> None:
        self.inner.register(addr, nbytes)

    def _unregister_region(self, addr: int, nbytes: int) -> None:
        self.inner.unregister(addr, nbytes)


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
        """The holder's arenas behind ``src`` (a ``_reader.Source``), asked over its fd
        socket; empty: read over ``inner``. Asked only for a source on this host by its
        locality label and with its lease's secret; a socket held by a process of another
        uid (not root) is sent nothing (``SO_PEERCRED``, checked right after connect)."""
        secret, host = getattr(src, "secret", ""), getattr(src, "host", None)
        if not secret or host is None or host != self._label:
            return _Mapped([])  # another host (or no secret: an older coordinator): never connected to
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        fds: list[int] = []
        try:
            s.settimeout(5.0)
            s.connect(socket_name(src.endpoint))
            peer, uid, _ = peer_creds(s)
            pid = peer
            if not trusted_uid(uid):
                logger.warning("same-host socket of %s is held by pid %d of uid %d (not this process's uid %d, "
                               "not root): asked it nothing; reading over %s", src.endpoint, pid, uid, os.geteuid(),
                               type(self.inner).__name__)
                return _Mapped([])
            proof = lease_proof(secret, src.lease_id, src.replica_id, src.endpoint)
            req = {"lease_id": src.lease_id, "replica_id": src.replica_id, "proof": proof,
                   "worker_id": self._worker_id, "host": self._ident}  # + "cuda": we can open CUDA memory
            s.sendall(json.dumps(dict(req, cuda=True) if _cudaipc.available() else req).encode())
            data, fds, _, _ = socket.recv_fds(s, _MAX_MSG, _MAX_FDS)
            while data and len(data) <= _MAX_ANSWER:  # the rest of a long answer, up to EOF
                more = s.recv(_MAX_MSG)
                if not more:
                    break
                data += more
            ans = json.loads(data.decode())
            if not isinstance(ans, dict):
                raise ValueError("not an object")
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
        if same and not fds and not arenas and "cuda" in ans:  # (opened on a copy thread: ``_cudaipc.copy``)
            blocks, why = self._pool.submit(self.cuda.open, f"{src.endpoint}#{peer}", ans["cuda"], src.lease_id,
                                            _cudaipc.preferred_device()).result()
            if blocks is None:
                self._cuda_fallback(src.endpoint, "open", f"cannot open its CUDA memory ({why})")
                return _Mapped([])
            return _Mapped([], cuda=blocks)
        if same and not fds and not arenas and ans.get("vm") is True and self._vm:
            return _Mapped([], pid=peer)
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
        self.cuda.forget(lease_ids)  # CUDA blocks no other lease of ours names: closed

    def local(self, src: Any) -> bool:
        """Whether reads from ``src`` are copied here (its arenas mapped, its memory
        cross-read, or its CUDA blocks opened), as far as this lease has asked; the reader
        keeps more of them in flight."""
        with self._mlock:
            m = self._mapped.get((src.lease_id, src.replica_id))
        return m is not None and (bool(m.arenas) or bool(m.pid) or m.cuda is not None)

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

    def submit_from(self, src: Any, ops: Sequence[ReadOp], hasher: Optional[Callable[[], Any]] = None) -> int:
        """Read ``ops`` from source ``src`` (a ``_reader.Source``): copied from the holder's
        arenas when it is on this host and they cover every op, else by ``inner``.

        ``hasher`` (a new streaming hasher, ``_checksum.ALGORITHMS``): a copy made here also
        hashes the bytes it landed, in op order, a segment at a time right after copying it
        (still in cache: the reader's checksum then costs no second pass over memory and no
        time on its loop's thread); :meth:`digest` gives the result. Reads over ``inner``
        ignore it (the reader hashes them itself)."""
        self._check_batch(src.endpoint, ops)
        m = self._arenas(src)
        if m.cuda is not None:
            cplan = m.cuda.plan(ops)
            if cplan is not None:
                h = next(self._ids)
                self._jobs[h] = self._pool.submit(self._cuda_copy, cplan)
                return h
            self._cuda_fallback(src.endpoint, "plan", "a batch outside the CUDA blocks it exported")
        plan = [(op, m.find(op.remote_addr, op.length)) for op in ops] if m.arenas else []
        if plan and all(a is not None for _, a in plan):
            h = next(self._ids)
            self._jobs[h] = self._pool.submit(self._copy, plan, hasher)
            return h
        if m.pid and ops and self._vm_ok(m, src, ops[0]):
            h = next(self._ids)
            self._jobs[h] = self._pool.submit(self._vm_copy, m.pid, ops, hasher)
            return h
        self.inner_batches += 1
        return self.inner.submit_read(src.endpoint, ops)

    def digest(self, handle: int) -> Optional[int]:
        """The hash a finished copy computed of the bytes it landed (``submit_from``'s
        ``hasher``), once; None when it computed none (or the batch went over ``inner``)."""
        return self._digests.pop(handle, None)

    def _vm_ok(self, m: _Mapped, src: Any, op: ReadOp) -> bool:
        """Whether the kernel lets us read the holder's memory (``_vm.probe``, once per
        lease and replica, before the first op; a refusal reads over ``inner``)."""
        if not m.probed:
            why = _vm.probe(m.pid, op.remote_addr)
            m.probed = True
            if why is not None:
                if src.endpoint not in self._vm_refused:
                    self._vm_refused.add(src.endpoint)
                    logger.info("same-host read from %s (pid %d): the kernel refuses process_vm_readv (%s); "
                                "reading over %s", src.endpoint, m.pid, why, type(self.inner).__name__)
                m.pid = 0
        return m.pid != 0

    def _cuda_fallback(self, endpoint: str, kind: str, why: str) -> None:
        """Say once per holder and kind (open, plan) why its CUDA memory is read over ``inner``."""
        if (endpoint, kind) not in self._cuda_said:
            self._cuda_said.add((endpoint, kind))
            logger.info("same-host read from %s: %s; reading over %s", endpoint, why, type(self.inner).__name__)

    def _cuda_copy(self, plan: Any) -> None:
        if self.copy_delay:
            time.sleep(self.copy_delay)
        n = _cudaipc.copy(plan)
        with self._count_lock:
            self.copied_bytes += n
            self.cuda_bytes += n

    def _count(self, n: int, vm: bool = False, hashed: bool = False) -> None:
        with self._count_lock:
            self.copied_bytes += n
            if vm:
                self.vm_bytes += n
            if hashed:
                self.hashed_bytes += n

    def _vm_copy(self, pid: int, ops: Sequence[ReadOp], hasher: Optional[Callable[[], Any]] = None) -> Optional[int]:
        if self.copy_delay:
            time.sleep(self.copy_delay)
        if hasher is None:
            self._count(_vm.read_into(pid, ops), vm=True)
            return None
        return _fused(ops, hasher, lambda l, r, n: _vm.read_into(pid, [ReadOp(l, r, n)]),
                      lambda n: self._count(n, vm=True, hashed=True))

    def _copy(self, plan: list, hasher: Optional[Callable[[], Any]] = None) -> Optional[int]:
        if self.copy_delay:
            time.sleep(self.copy_delay)
        ops = []
        for op, (base, _, view) in plan:  # the holder's address -> ours (our mapping of its arena)
            ops.append(ReadOp(op.local_addr, view.data_ptr() + (op.remote_addr - base), op.length))
        if hasher is None:
            for op in ops:
                ctypes.memmove(op.local_addr, op.remote_addr, op.length)  # releases the GIL (ctypes)
                self._count(op.length)
            return None

        def move(l: int, r: int, n: int) -> int:
            ctypes.memmove(l, r, n)
            return n
        return _fused(ops, hasher, move, lambda n: self._count(n, hashed=True))

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
        d = job.result()
        if d is not None:
            self._digests[handle] = d
        return DONE

    def cancel(self, handle: int) -> bool:
        job = self._jobs.get(handle)
        if job is None:
            return self.inner.cancel(handle)
        if job.cancel():
            del self._jobs[handle]
            return True
        return False
