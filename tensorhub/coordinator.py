"""The coordinator service, started: a server (``serve``, behind ``tensorhub coordinator``) or
one embedded in a process (:class:`EmbeddedCoordinator`), around :class:`Coordinator`
(``server.core``: the state machine, its store, lock, clock and leadership). Its routes
are ``tensorhub.server.app`` (``create_app``), the HTTP shell below them ``tensorhub.server.asgi``.

Run it as ``tensorhub coordinator --host 127.0.0.1 --port 0 --state-dir DIR``, or embed it
in a process with :class:`EmbeddedCoordinator` (the demo does). Every request takes one
lock, asks the state machine, commits the durable writes to SQLite, then answers.
Its clock is ``time.monotonic()``: a wall-clock step of either sign changes no lease,
liveness or drain answer (the state machine also never lets time move back). The API is versioned under ``/v1``; ``/openapi.json``
describes it. With a token configured every endpoint but ``/healthz`` needs
``Authorization: Bearer <token>`` (compared in constant time, never logged).

``GET /metrics`` serves Prometheus metrics (``tensorhub._metrics.CoordinatorMetrics``),
under the same token rule: a scraper sends the token as a bearer token (Prometheus:
``authorization: {credentials_file: FILE}`` in the scrape config). Metrics name models
and count workers, which the token keeps from whoever else reaches the port; with no
token configured it is open like every other route.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from .server.app import create_app
from .server.core import Coordinator, ha_coordinator
from ._exceptions import ConfigError
from .server.state import StateConfig

__all__ = ["Coordinator", "EmbeddedCoordinator", "StateConfig", "create_app", "serve", "ha_coordinator",
           "listen_socket", "socket_url"]

logger = logging.getLogger(__name__)

def listen_socket(host: str, port: int) -> socket.socket:
    """A listening, non-blocking TCP socket on ``host:port`` (port 0: a free one), for uvicorn
    (``sockets=[...]``): bound before the server starts, so its URL is known at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def socket_url(host: str, sock: socket.socket, tls: bool) -> str:
    """The URL a server on ``sock`` (``listen_socket``) answers at."""
    port = sock.getsockname()[1]
    h = f"[{host}]" if ":" in host else host
    return f"{'https' if tls else 'http'}://{h}:{port}"


class _Server:
    """uvicorn on a pre-bound socket, plus the expiry ticker."""

    def __init__(self, coord: Coordinator, host: str, port: int, token: Optional[str],
                 ssl_certfile: Optional[str] = None, ssl_keyfile: Optional[str] = None,
                 sock: Optional[socket.socket] = None, call_slots: Optional[int] = None) -> None:
        import uvicorn

        self.coord = coord
        self.sock = listen_socket(host, port) if sock is None else sock
        self.url = socket_url(host, self.sock, ssl_certfile is not None)
        cfg = uvicorn.Config(
            create_app(coord, token, call_slots), log_level="warning", access_log=False,
            ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile, timeout_keep_alive=30,
        )
        self.server = uvicorn.Server(cfg)
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="tensorhub-expiry", daemon=True)

    def _tick(self) -> None:
        period = min(1.0, self.coord.config.worker_ttl / 4)
        while not self._stop.wait(period):
            try:
                self.coord.expire()
            except Exception:  # pragma: no cover - keep serving
                logger.exception("expiry tick failed")

    def run(self) -> None:
        self._ticker.start()
        try:
            self.server.run(sockets=[self.sock])
        finally:
            self._stop.set()


def serve(host: str, port: int, state_dir: Optional[str | os.PathLike], *, token: Optional[str] = None,
          config: StateConfig = StateConfig(), ssl_certfile: Optional[str] = None,
          ssl_keyfile: Optional[str] = None, on_ready: Callable[[str], None] = print,
          store: Optional[str] = None, advertise_url: Optional[str] = None, election_ttl: float = 2.0,
          etcd_ca_file: Optional[str] = None, etcd_cert_file: Optional[str] = None,
          etcd_key_file: Optional[str] = None, call_slots: Optional[int] = None) -> None:
    """Run the coordinator in the foreground until SIGINT/SIGTERM.

    ``store``: ``None``/``"sqlite"`` (a file in ``state_dir``) or ``etcd://h:p[,h:p...]``
    (highly available: one of several coordinators leads; ``advertise_url`` is how
    clients reach this one, default the URL it serves on)."""
    if store is None or store == "sqlite":
        if state_dir is None:
            raise ConfigError("the SQLite store needs --state-dir")
        coord = Coordinator(state_dir, config)
        srv = _Server(coord, host, port, token, ssl_certfile, ssl_keyfile, call_slots=call_slots)
    else:
        sock = listen_socket(host, port)
        url = advertise_url or socket_url(host, sock, ssl_certfile is not None)
        if advertise_url is None and host in ("0.0.0.0", "::", ""):
            raise ConfigError(f"listening on {host!r}: pass --advertise-url (the URL clients reach this one at)")
        coord = ha_coordinator(store, url, config, election_ttl=election_ttl, etcd_ca_file=etcd_ca_file,
                               etcd_cert_file=etcd_cert_file, etcd_key_file=etcd_key_file)
        srv = _Server(coord, host, port, token, ssl_certfile, ssl_keyfile, sock=sock, call_slots=call_slots)
    # This process is ours: keep what exists now (modules, the app, restored state) out of
    # the cycle collector's scans, and collect young objects less often. Full collections
    # otherwise stall every request for 20-80 ms every few seconds under load.
    # Our own process: leave out prometheus_client's *_created series (one per counter, noise
    # for a scraper that already sees the process start time metric).
    from prometheus_client import disable_created_metrics

    disable_created_metrics()
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)
    if coord.election is not None:
        # uvicorn re-raises SIGTERM once it has shut down; with the default handler the process
        # would die before ``close()`` revokes the leader's lease (a follower would then wait
        # out the ttl instead of taking over at once). Exit through ``finally`` instead.
        import signal

        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    on_ready(srv.url)
    try:
        srv.run()
    finally:
        coord.close()


class EmbeddedCoordinator:
    """A coordinator on a background thread of this process (demos, tests, single-node jobs).

    ``start()`` returns the URL; ``stop()`` shuts it down. Also a context manager.
    """

    def __init__(self, state_dir: str | os.PathLike, *, host: str = "127.0.0.1", port: int = 0,
                 token: Optional[str] = None, config: StateConfig = StateConfig()) -> None:
        self.state_dir = Path(state_dir)
        self.host, self.port, self.token, self.config = host, port, token, config
        self.url: Optional[str] = None
        self._srv: Optional[_Server] = None
        self._thread: Optional[threading.Thread] = None

    def start(self) -> str:
        coord = Coordinator(self.state_dir, self.config)
        self._srv = _Server(coord, self.host, self.port, self.token)
        self._thread = threading.Thread(target=self._srv.run, name="tensorhub-coordinator", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._srv.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("embedded coordinator did not start")
            time.sleep(0.01)
        self.url = self._srv.url
        return self.url

    @property
    def coordinator(self) -> Coordinator:
        assert self._srv is not None, "start() first"
        return self._srv.coord

    def stop(self) -> None:
        if self._srv is None:
            return
        self._srv.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._srv.coord.close()
        self._srv = None

    def __enter__(self) -> "EmbeddedCoordinator":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
