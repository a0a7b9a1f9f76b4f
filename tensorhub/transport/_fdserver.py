"""The holder's side of same-host reads: the fd server :class:`SameHostTransport`
(``_shm``) starts on an abstract Unix socket named after its endpoint. It answers a reader
that proves its lease with read-only fds of the arenas behind the replica, or ``vm`` (user
memory: ``process_vm_readv``), or ``cuda`` (IPC handles of CUDA blocks); the module
docstring of ``_shm`` says when, and how peers of another uid are kept out.

Threads do not grow with connections: one accepts and watches connections until their
request arrives; ``_HANDLERS`` threads answer requests. A peer of another uid is closed at
once, before anything is read; at most ``_MAX_PENDING`` connections wait for their request,
each at most ``_RECV_TIMEOUT`` seconds (a new one closes the oldest, so idle connections
cannot keep a reader out: its request is sent with its connect); at most ``_MAX_READY``
requests wait for a handler (more are closed).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import selectors
import socket
import threading
import time
from typing import Any, Callable, Optional

from . import _cudaipc, _vm
from ._arena import _shown, arena_of, peer_creds, trusted_uid

__all__ = ["FdServer", "Authorize", "Tensors"]

logger = logging.getLogger("tensorhub.transport._shm")  # (its records as before the split)

#: ``authorize(lease_id, replica_id, worker_id, proof, endpoint) -> regions of that replica
#: or None (refused)``: the holder's question to the coordinator (``_samehost.wrap``), with
#: the reader's ``lease_proof`` and the holder's own endpoint.
Authorize = Callable[[str, str, str, str, str], Optional[list[tuple[int, int]]]]
#: ``tensors(replica_id) -> the replica's tensors``: asked only after ``authorize`` said yes,
#: for the CUDA ones among them (``_cudaipc.export``).
Tensors = Callable[[str], Any]

#: Largest request, and most arenas (fds) in one answer.
_MAX_MSG, _MAX_FDS = 1 << 16, 250
#: The server's bounds: threads that answer requests; connections accepted and waiting
#: for their request (past this the oldest is closed); requests waiting for a thread (past
#: this a new one is closed); seconds a connection has to send its request.
_HANDLERS = 4
_MAX_PENDING = 64
_MAX_READY = 16
_RECV_TIMEOUT = 2.0


class FdServer:
    """The fd server of one holder (module docstring). ``ident``: its host identity, sent
    with every answer and compared with the reader's."""

    def __init__(self, name: bytes, endpoint: str, ident: dict, authorize: Authorize,
                 tensors: Optional[Tensors], *, vm: bool = True) -> None:
        self.name = name
        self._endpoint = endpoint
        self._ident = ident
        self._authorize = authorize
        self._tensors = tensors
        self._vm = vm  # memory not in arenas: answered "vm" (process_vm_readv)
        self._server: Optional[socket.socket] = None
        self._thread: Optional[threading.Thread] = None
        self._ready: "queue.Queue[Optional[socket.socket]]" = queue.Queue(_MAX_READY)
        self._handlers: list[threading.Thread] = []
        self._refused_uids: set[int] = set()  # peers refused (logged once per uid)

    def start(self) -> None:
        """Bind the socket (``OSError`` as the kernel said it: ``EADDRINUSE`` when the name
        is taken, :meth:`taken` says by whom) and start the threads."""
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            srv.bind(self.name)
            srv.listen(64)
        except OSError:
            srv.close()
            raise
        srv.setblocking(False)
        self._server = srv
        self._thread = threading.Thread(target=self._serve, args=(srv,), name="tensorhub-samehost", daemon=True)
        self._thread.start()
        self._handlers = [threading.Thread(target=self._handle, name=f"tensorhub-samehost-{i}", daemon=True)
                          for i in range(_HANDLERS)]
        for t in self._handlers:
            t.start()

    def taken(self) -> str:
        """Why the fd server cannot start: its name is bound; by whom (``SO_PEERCRED`` of
        a connection to it; nothing is sent)."""
        who = "a process this one cannot identify"
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(2.0)
            probe.connect(self.name)
            pid, uid, _ = peer_creds(probe)
            who = f"pid {pid} (uid {uid}{', another user' if not trusted_uid(uid) else ''})"
        except OSError as e:
            who += f" ({e})"
        finally:
            probe.close()
        return (f"the same-host socket {_shown(self.name)} is already bound by {who}; this process is pid {os.getpid()} "
                f"(uid {os.geteuid()}). Same-host readers would ask it for this worker's memory, so this worker "
                "does not start. Stop that process, or set TENSORHUB_SAMEHOST=0 to run without same-host reads "
                "(readers then read over the network transport)")

    def stop(self) -> None:
        """Close the socket; requests still waiting are closed; then the handlers stop."""
        srv, self._server = self._server, None
        if srv is None:
            return
        try:
            srv.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(timeout=5.0)  # it closes what it holds, then the socket
        else:
            srv.close()
        while True:
            try:
                conn = self._ready.get_nowait()
            except queue.Empty:
                break
            if conn is not None:
                conn.close()
        for _ in self._handlers:
            try:
                self._ready.put_nowait(None)
            except queue.Full:  # pragma: no cover - only the server thread puts requests
                break

    def _serve(self, srv: socket.socket) -> None:
        sel = selectors.DefaultSelector()
        pending: dict[socket.socket, float] = {}  # connection -> deadline, oldest first
        try:
            sel.register(srv, selectors.EVENT_READ)
            while self._server is srv:
                wait = 1.0 if not pending else min(1.0, max(0.0, next(iter(pending.values())) - time.monotonic()))
                for key, _ in sel.select(wait):
                    conn = key.fileobj
                    if conn is srv:
                        if not self._accept(srv, sel, pending):
                            return
                        continue
                    sel.unregister(conn)
                    del pending[conn]
                    try:
                        self._ready.put_nowait(conn)
                    except queue.Full:  # every handler busy and the queue full: no room
                        conn.close()
                now = time.monotonic()
                while pending and next(iter(pending.values())) <= now:  # sent nothing in time
                    conn = next(iter(pending))
                    sel.unregister(conn)
                    del pending[conn]
                    conn.close()
        except (OSError, ValueError) as e:  # the socket went away under us (close)
            if self._server is srv:
                logger.warning("same-host fd server stopped: %s", e)
        finally:
            for conn in pending:
                conn.close()
            sel.close()
            srv.close()

    def _accept(self, srv: socket.socket, sel: selectors.BaseSelector, pending: dict) -> bool:
        """Accept one connection; False when the server socket is closed."""
        try:
            conn, _ = srv.accept()
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False
        try:
            pid, uid, _ = peer_creds(conn)
        except OSError:
            conn.close()
            return True
        if not trusted_uid(uid):  # before anything is read
            conn.close()
            log = logger.debug if uid in self._refused_uids else logger.warning
            self._refused_uids.add(uid)
            log("same-host fd server %s: refused pid %d of uid %d (not this process's uid %d, not root)",
                self._endpoint, pid, uid, os.geteuid())
            return True
        if len(pending) >= _MAX_PENDING:
            oldest = next(iter(pending))
            sel.unregister(oldest)
            del pending[oldest]
            oldest.close()
        conn.setblocking(False)
        sel.register(conn, selectors.EVENT_READ)
        pending[conn] = time.monotonic() + _RECV_TIMEOUT
        return True

    def _handle(self) -> None:
        while True:
            conn = self._ready.get()
            if conn is None:
                return
            self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        fds: list[int] = []
        try:
            conn.settimeout(_RECV_TIMEOUT)
            raw = conn.recv(_MAX_MSG)
            req = json.loads(raw.decode())
            if not isinstance(req, dict):
                raise ValueError("not an object")
            answer: dict[str, Any] = dict(self._ident, arenas=[])
            proof = req.get("proof")
            if not (isinstance(proof, str) and len(proof) == 64 and all(c in "0123456789abcdef" for c in proof)):
                answer["why"] = "no lease proof"
            elif not isinstance(req.get("host"), dict) or any(req["host"].get(k) != v for k, v in self._ident.items()):
                answer["why"] = "not on this host"
            else:
                regions = self._authorize(str(req["lease_id"]), str(req["replica_id"]), str(req["worker_id"]),
                                          proof, self._endpoint or "")
                if regions is None:
                    answer["why"] = "no valid lease on that replica, or a wrong lease proof"
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
                    cuda = self._cuda_blocks(req, regions) if not fds and regions else []
                    if cuda:  # CUDA memory: IPC handles of its blocks (``_cudaipc``)
                        _vm.allow_readers()  # (expandable segments: the reader takes their fds by pidfd)
                        answer["cuda"] = cuda
                    elif not fds and regions and self._vm:
                        _vm.allow_readers()  # memory of the user's: read in place (process_vm_readv)
                        answer["vm"] = True
            data = json.dumps(answer).encode()
            sent = socket.send_fds(conn, [data], fds)
            if sent < len(data):  # a long answer (many CUDA blocks): the rest follows, then EOF
                conn.sendall(data[sent:])
        except Exception as e:  # a bad request ends its connection, never the server
            logger.debug("same-host request refused: %s", e)
        finally:
            for fd in fds:
                os.close(fd)
            conn.close()

    def _cuda_blocks(self, req: dict, regions: list[tuple[int, int]]) -> list[dict]:
        """The CUDA blocks behind the replica (``_cudaipc.export``), for a reader that can open them."""
        ok = req.get("cuda") is True and self._tensors is not None and _cudaipc.available()
        return _cudaipc.export(self._tensors(str(req["replica_id"])) or (), regions) if ok else []
