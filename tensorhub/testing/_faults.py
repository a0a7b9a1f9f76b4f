"""Fault injection: kill (SIGKILL), hang (SIGSTOP) or slow (tc, in a network namespace)
a source, a reader or the coordinator, at a chosen or a random point of a transfer; or cut
one process's control plane only (its route to the coordinator) while its data plane works.

::

    faults = Faults(coordinator_url, seed=7)
    faults.hang(source.pid)                     # now
    t = faults.during_read("reader-1", lambda: faults.kill(source.pid), after="random")
    reader.call("fetch", version=v)             # the kill lands while reader-1 holds a lease
    assert t.fired.is_set()
    faults.slow("host3", "veth-h3", "100mbit")  # shape a host's link inside its namespace
    faults.cut("host3", "10.77.255.1")          # host3 loses the coordinator, keeps its peers
    faults.heal("host3", "10.77.255.1")

"During a read" is observed from the coordinator: the reader holds an open lease (on
``source_worker``'s replica, if given). Every action is recorded in ``faults.log``.

A control-plane cut is a blackhole route to the coordinator's address (/32) inside the
holder's network namespace: packets to the coordinator are dropped there, while the
routes to other hosts (the Mooncake data plane) stay as they were. It is the kernel's own
view of a partition, with no process in the path: a request on an open keep-alive
connection hangs (TCP retransmits) until the route heals or the client gives up, and new
connections fail at once (EINVAL). ``reset=True`` also destroys the namespace's open TCP
connections to that address (``ss -K``), so that every call fails at once: a partition
the local stack noticed. (A pausable TCP proxy would need each process pointed at its own
URL and only ever shows the proxy's behaviour, never the client's real TCP stack.)

A coordinator in a namespace of its own (``benchmarks/testbed.py``) is out of reach of
the root namespace: ``Faults(url, netns=...)`` watches it from there, and
:func:`in_netns` runs any call (e.g. a status request) from there.
"""

from __future__ import annotations

import contextlib

import os
import random
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

__all__ = ["Faults", "Trigger", "in_netns"]

_NETNS_THREADS: dict[tuple[str, int], ThreadPoolExecutor] = {}
_NETNS_LOCK = threading.Lock()


def in_netns(netns: Optional[str], fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """Call ``fn(*args, **kw)`` on a thread of this process that lives in network namespace
    ``netns`` (``None``: here), and return its result. A network namespace belongs to a
    thread, and sockets to the namespace of the thread that made them: use it for the
    whole of a connection's life (e.g. ``in_netns(ns, httpx.get, url)``). One thread per
    namespace, kept for the process's life; calls into one namespace run one at a time."""
    if netns is None:
        return fn(*args, **kw)
    from ._workers import enter_netns

    key = (netns, os.stat(f"/var/run/netns/{netns}").st_ino)  # a namespace made again is another one
    with _NETNS_LOCK:
        pool = _NETNS_THREADS.get(key)
        if pool is None:
            for old in [k for k in _NETNS_THREADS if k[0] == netns]:
                _NETNS_THREADS.pop(old).shutdown(wait=False)
            pool = _NETNS_THREADS[key] = ThreadPoolExecutor(1, thread_name_prefix=f"netns-{netns}",
                                                            initializer=enter_netns, initargs=(netns,))
    return pool.submit(fn, *args, **kw).result()


@dataclass
class Trigger:
    """A pending fault: ``fired`` is set when the action ran (``error`` if it raised)."""

    fired: threading.Event = field(default_factory=threading.Event)
    cancelled: threading.Event = field(default_factory=threading.Event)
    error: Optional[BaseException] = None
    fired_at: float = 0.0
    thread: Optional[threading.Thread] = None

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self.fired.wait(timeout)

    def cancel(self) -> bool:
        """Stop waiting; True if the action had not fired (and now never will)."""
        self.cancelled.set()
        if self.thread is not None:
            self.thread.join(timeout=10)
        return not self.fired.is_set()


class Faults:
    """Fault actions on processes and links, with a log of what was done and when."""

    def __init__(self, coordinator_url: Optional[str] = None, *, token: Optional[str] = None,
                 seed: Optional[int] = None, netns: Optional[str] = None) -> None:
        self.url = coordinator_url
        self.token = token
        #: The network namespace the coordinator is reached from (None: this one).
        self.netns = netns
        self.rng = random.Random(seed)
        self.log: list[tuple[float, str]] = []
        self._stopped: set[int] = set()
        self._cuts: set[tuple[str, str]] = set()

    def _note(self, what: str) -> None:
        self.log.append((time.monotonic(), what))

    # ------------------------------------------------------------------ processes
    def kill(self, pid: int) -> None:
        """SIGKILL ``pid`` (a hung process too)."""
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._stopped.discard(pid)
        self._note(f"kill {pid}")

    def hang(self, pid: int) -> None:
        """SIGSTOP ``pid``: its sockets stay open but nothing answers (a hung peer)."""
        os.kill(pid, signal.SIGSTOP)
        self._stopped.add(pid)
        self._note(f"hang {pid}")

    def resume(self, pid: int) -> None:
        """SIGCONT a process stopped by :meth:`hang`."""
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        self._stopped.discard(pid)
        self._note(f"resume {pid}")

    def resume_all(self) -> None:
        for pid in list(self._stopped):
            self.resume(pid)

    # ------------------------------------------------------------------ links
    @staticmethod
    def _tc(netns: str, *args: str) -> None:
        subprocess.run(["ip", "netns", "exec", netns, "tc", *args], check=True, capture_output=True)

    def slow(self, netns: str, dev: str, rate: str = "100mbit", *, delay: Optional[str] = None) -> None:
        """Shape ``dev`` inside namespace ``netns`` to ``rate`` (token bucket), with an optional
        added ``delay`` (netem, e.g. ``"20ms"``). Only namespaces the caller created."""
        if self._has_qdisc(netns, dev):
            self._tc(netns, "qdisc", "del", "dev", dev, "root")
        if delay:
            self._tc(netns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", delay)
            self._tc(netns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "tbf",
                     "rate", rate, "burst", "256kb", "latency", "400ms")
        else:
            self._tc(netns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "256kb",
                     "latency", "400ms")
        self._note(f"slow {netns}/{dev} to {rate}" + (f" +{delay}" if delay else ""))

    def unslow(self, netns: str, dev: str) -> None:
        if self._has_qdisc(netns, dev):
            self._tc(netns, "qdisc", "del", "dev", dev, "root")
        self._note(f"unslow {netns}/{dev}")

    @staticmethod
    def _has_qdisc(netns: str, dev: str) -> bool:
        out = subprocess.run(["ip", "netns", "exec", netns, "tc", "qdisc", "show", "dev", dev],
                             capture_output=True, text=True).stdout
        return "tbf" in out or "netem" in out

    # ------------------------------------------------------------------ control plane
    def cut(self, netns: str, address: str, *, reset: bool = False) -> None:
        """Cut namespace ``netns``'s route to ``address`` (the coordinator): a blackhole
        route to ``address``/32 there, so only traffic to that one address is dropped (the
        data plane to other hosts keeps flowing). ``reset``: also destroy the namespace's
        open TCP connections to it, so calls fail at once instead of hanging until the
        client's timeout. Only namespaces the caller created; undo with :meth:`heal`."""
        subprocess.run(["ip", "-n", netns, "route", "replace", "blackhole", f"{address}/32"], check=True,
                       capture_output=True)
        self._cuts.add((netns, address))
        if reset:
            # ss exits 0 even when the kernel cannot destroy sockets; the cut holds anyway
            subprocess.run(["ip", "netns", "exec", netns, "ss", "-K", "-t", "dst", address], capture_output=True)
        self._note(f"cut {netns} from {address}" + (" (connections reset)" if reset else ""))

    def heal(self, netns: str, address: str) -> None:
        """Undo :meth:`cut` (idempotent)."""
        subprocess.run(["ip", "-n", netns, "route", "del", "blackhole", f"{address}/32"], capture_output=True)
        self._cuts.discard((netns, address))
        self._note(f"heal {netns} to {address}")

    def heal_all(self) -> None:
        for netns, address in list(self._cuts):
            self.heal(netns, address)

    def status(self, timeout: float = 10.0) -> dict:
        """The coordinator's ``/v1/status`` (read from ``netns``, if given)."""
        import httpx

        if self.url is None:
            raise ValueError("status needs the coordinator URL")
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        return in_netns(self.netns, lambda: httpx.get(f"{self.url}/v1/status", headers=headers,
                                                      timeout=timeout).json())

    # ------------------------------------------------------------------ timing
    def during_read(self, reader_worker: str, action: Callable[[], None], *,
                    source_worker: Optional[str] = None, after: Union[float, str] = 0.0,
                    max_after: float = 0.5, timeout: float = 60.0) -> Trigger:
        """Run ``action`` once ``reader_worker`` holds a read lease (naming a replica of
        ``source_worker``, if given), ``after`` seconds later (``"random"``: uniform in
        ``[0, max_after]``). Returns at once; the returned Trigger tells when it fired."""
        if self.url is None:
            raise ValueError("during_read needs the coordinator URL")
        delay = self.rng.uniform(0.0, max_after) if after == "random" else float(after)
        trig = Trigger()

        def watch() -> None:
            from .._client import CoordinatorClient
            from .._exceptions import TensorHubError

            if self.netns is not None:
                from ._workers import enter_netns

                enter_netns(self.netns)  # this thread only
            end = time.monotonic() + timeout
            c = CoordinatorClient(self.url, self.token, timeout=5, retry_timeout=0.0)
            try:
                with contextlib.closing(c):
                    while time.monotonic() < end and not trig.cancelled.is_set():
                        try:
                            reading = self._reading(c.status(), reader_worker, source_worker)
                        except TensorHubError:
                            reading = False  # the coordinator may be down: keep watching
                        if reading:
                            if trig.cancelled.wait(delay):
                                return
                            action()
                            trig.fired_at = time.monotonic()
                            self._note(f"fired during read by {reader_worker} after {delay:.3f}s")
                            trig.fired.set()
                            return
                        time.sleep(0.003)
                if not trig.cancelled.is_set():
                    raise TimeoutError(f"{reader_worker} never started reading within {timeout}s")
            except BaseException as e:  # surfaced through the trigger
                trig.error = e

        trig.thread = threading.Thread(target=watch, name="tensorhub-fault", daemon=True)
        trig.thread.start()
        return trig

    @staticmethod
    def _reading(status: dict, reader: str, source: Optional[str]) -> bool:
        if source is None:
            return any(l["worker_id"] == reader for l in status["leases"])
        src_replicas = {
            r["replica_id"]
            for m in status["models"] for v in m["versions"] for r in v["replicas"] if r["worker_id"] == source
        }
        return any(l["worker_id"] == reader and src_replicas.intersection(l["replicas"]) for l in status["leases"])
