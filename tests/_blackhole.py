"""A TCP relay in front of the coordinator that can blackhole one client's control plane.

A worker given ``relay.url`` instead of the coordinator's talks to it through this relay;
``cut()`` stops relaying (bytes already sent and new connections are held, never answered:
what a blackhole route does, not a reset), ``heal()`` drops the held connections (the
client's calls fail and are retried on new ones) and relays again. The worker's data plane
(Mooncake, the same-host socket) does not pass here: only its control plane is cut.
"""

from __future__ import annotations

import socket
import threading
import time
from urllib.parse import urlparse


class Blackhole:
    def __init__(self, target_url: str) -> None:
        u = urlparse(target_url)
        self._target = (u.hostname, u.port)
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._srv.getsockname()[1]}"
        self._cut = threading.Event()
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                c, _ = self._srv.accept()
            except OSError:
                return
            with self._lock:
                self._conns.append(c)
            if self._cut.is_set():
                continue  # held: never answered until heal() drops it
            try:
                up = socket.create_connection(self._target, timeout=5)
            except OSError:
                c.close()
                continue
            with self._lock:
                self._conns.append(up)
            for a, b in ((c, up), (up, c)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                while self._cut.is_set() and not self._closed:  # a blackhole: nothing gets through
                    time.sleep(0.05)
                if self._closed:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> None:
        self._cut.set()

    def heal(self) -> None:
        """Relay again; connections opened or stalled during the cut are dropped."""
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self._cut.clear()

    def close(self) -> None:
        self._closed = True
        self._srv.close()
        self.heal()
