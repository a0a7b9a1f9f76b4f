"""An emulated cluster on one machine: network namespaces as hosts, shaped links.

    with Testbed({"a": 1, "b": 4}, host_rate="1gbit", xdc_rate="100mbit") as tb:
        url = tb.start_coordinator()
        p = tb.spawn("a0", [sys.executable, "worker.py", ...])
        ...
        tb.xdc_bytes()   # bytes that crossed between datacenters (interface counters)

Topology (everything lives in namespaces this object creates; the root namespace is
never touched, so deleting the namespaces removes every link and bridge):

* one *core* namespace ``thb<id>c`` holding a bridge per datacenter (``br-<dc>``) and,
  between consecutive datacenters, a veth pair shaped with ``tc tbf`` at ``xdc_rate``
  in both directions (the slow link); the coordinator runs here on 10.77.255.1 (bridge
  of the first datacenter);
* or, with ``wan="star"``, one more bridge (the WAN) and one slow link per datacenter
  between its bridge and the WAN, shaped at ``xdc_rate`` both ways: every datacenter's
  traffic to all others shares its own uplink and downlink (a datacenter's WAN port), the
  shape in which a version crossing to three datacenters from one is limited by that
  one's uplink;
* one namespace per host ``thb<id>h<k>`` with ``eth0`` = 10.77.<dc index>.<k+1>/16, a veth
  into its datacenter's bridge, shaped at ``host_rate`` in both directions (uplink and
  downlink), and ``lo`` up.

Only addresses inside these namespaces (10.77.0.0/16) are used. ``close()`` (also on
exit, on SIGINT and SIGTERM) kills the processes it started and deletes the namespaces.
Needs root and iproute2 (``ip``, ``tc``); :func:`available` says whether this machine can.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import time
from typing import Optional

__all__ = ["Testbed", "available"]

_LIVE: list["Testbed"] = []


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(args), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {r.stderr.strip()}")
    return r


def available() -> tuple[bool, str]:
    """(True, "") if network namespaces, veth, bridges and tc work here, else (False, why)."""
    if os.geteuid() != 0:
        return False, "needs root for network namespaces"
    for tool in ("ip", "tc"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            return False, f"`{tool}` (iproute2) is not installed"
    name = f"thbprobe{os.getpid()}"
    try:
        _sh("ip", "netns", "add", name)
        _sh("ip", "-n", name, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
        _sh("ip", "-n", name, "link", "add", "b0", "type", "bridge")
        _sh("ip", "-n", name, "link", "set", "p0", "up")
        _sh("tc", "-n", name, "qdisc", "add", "dev", "p0", "root", "tbf", "rate", "1gbit", "burst", "256kb",
            "latency", "20ms")
        return True, ""
    except RuntimeError as e:
        return False, f"network namespaces unusable here: {e}"
    finally:
        _sh("ip", "netns", "del", name, check=False)


def _cleanup_all(*_: object) -> None:
    for tb in list(_LIVE):
        tb.close()


def _on_signal(signum: int, frame: object) -> None:
    _cleanup_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


class Testbed:
    """N hosts in D datacenters; see the module docstring."""

    def __init__(self, hosts_per_dc: dict[str, int], *, host_rate: str = "1gbit", xdc_rate: str = "100mbit",
                 tag: Optional[str] = None, wan: str = "chain") -> None:
        if wan not in ("chain", "star"):
            raise ValueError(f"wan must be 'chain' or 'star', not {wan!r}")
        self.wan = wan
        self.hosts_per_dc = dict(hosts_per_dc)
        self.host_rate, self.xdc_rate = host_rate, xdc_rate
        self.id = tag or f"{os.getpid() % 100000}"
        self.core = f"thb{self.id}c"
        self.namespaces: list[str] = []
        self.hosts: dict[str, dict] = {}  # name -> {ns, ip, dc}
        self.procs: list[subprocess.Popen] = []
        self.coordinator_ip = "10.77.255.1"
        self.xdc_links: list[str] = []
        #: star: datacenter -> (its device towards the WAN, the WAN's device towards it)
        self.wan_ports: dict[str, tuple[str, str]] = {}

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "Testbed":
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _tbf(self, ns: str, dev: str, rate: str) -> None:
        burst = "1mb" if rate.endswith("gbit") else "128kb"
        _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", burst,
            "latency", "50ms")

    def up(self) -> None:
        if not _LIVE:
            atexit.register(_cleanup_all)
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, _on_signal)
        _LIVE.append(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        core = self.core
        _sh("ip", "netns", "add", core)
        self.namespaces.append(core)
        _sh("ip", "-n", core, "link", "set", "lo", "up")
        dcs = list(self.hosts_per_dc)
        for d, dc in enumerate(dcs):
            br = f"br{d}"
            _sh("ip", "-n", core, "link", "add", br, "type", "bridge")
            _sh("ip", "-n", core, "link", "set", br, "up")
            if d == 0:
                _sh("ip", "-n", core, "addr", "add", f"{self.coordinator_ip}/16", "dev", br)
            if self.wan == "star":  # its own slow link to the WAN bridge
                if d == 0:
                    _sh("ip", "-n", core, "link", "add", "brw", "type", "bridge")
                    _sh("ip", "-n", core, "link", "set", "brw", "up")
                a, b = f"x{d}up", f"w{d}dn"
                _sh("ip", "-n", core, "link", "add", a, "type", "veth", "peer", "name", b)
                _sh("ip", "-n", core, "link", "set", a, "master", br)
                _sh("ip", "-n", core, "link", "set", b, "master", "brw")
                for dev in (a, b):
                    _sh("ip", "-n", core, "link", "set", dev, "up")
                    self._tbf(core, dev, self.xdc_rate)
                self.wan_ports[dc] = (a, b)
            elif d > 0:  # the slow link between consecutive datacenters
                a, b = f"x{d - 1}to{d}", f"x{d}to{d - 1}"
                _sh("ip", "-n", core, "link", "add", a, "type", "veth", "peer", "name", b)
                _sh("ip", "-n", core, "link", "set", a, "master", f"br{d - 1}")
                _sh("ip", "-n", core, "link", "set", b, "master", br)
                for dev in (a, b):
                    _sh("ip", "-n", core, "link", "set", dev, "up")
                    self._tbf(core, dev, self.xdc_rate)
                self.xdc_links.append(a)
            for k in range(self.hosts_per_dc[dc]):
                name = f"{dc}{k}"
                ns = f"thb{self.id}h{d}x{k}"
                ip = f"10.77.{d}.{k + 1}"
                _sh("ip", "netns", "add", ns)
                self.namespaces.append(ns)
                port = f"v{d}x{k}"
                _sh("ip", "-n", core, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _sh("ip", "-n", core, "link", "set", port, "master", br)
                _sh("ip", "-n", core, "link", "set", port, "up")
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
                _sh("ip", "-n", ns, "addr", "add", f"{ip}/16", "dev", "eth0")
                _sh("ip", "-n", ns, "link", "set", "eth0", "up")
                self._tbf(core, port, self.host_rate)   # downlink to the host
                self._tbf(ns, "eth0", self.host_rate)   # uplink from the host
                self.hosts[name] = {"ns": ns, "ip": ip, "dc": dc, "port": port}

    def close(self) -> None:
        """Kill every process started here, delete every namespace (and so every link). Idempotent."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    p.kill()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()
        for ns in reversed(self.namespaces):
            _sh("ip", "netns", "del", ns, check=False)
        self.namespaces.clear()
        if self in _LIVE:
            _LIVE.remove(self)

    # ------------------------------------------------------------------ use
    def spawn(self, ns: str, argv: list[str], *, env: Optional[dict] = None, stderr=None) -> subprocess.Popen:
        """Run ``argv`` inside namespace ``ns`` (a host name, or ``"core"``), with pipes on
        stdin/stdout, in its own process group (so ``close`` kills all of it)."""
        where = self.core if ns == "core" else self.hosts[ns]["ns"]
        e = dict(os.environ, **(env or {}))
        p = subprocess.Popen(["ip", "netns", "exec", where, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=stderr if stderr is not None else subprocess.DEVNULL, text=True, env=e,
                             start_new_session=True)
        self.procs.append(p)
        return p

    def downlink(self, host: str) -> tuple[str, str]:
        """(namespace, device) whose egress is ``host``'s downlink: its port on the bridge, in
        the core namespace (shape it with ``Faults.slow(*tb.downlink(h), rate)``). Its uplink
        is ``(tb.hosts[host]["ns"], "eth0")``."""
        return self.core, self.hosts[host]["port"]

    def start_coordinator(self, state_dir: str, *, planner: str = "topology", plans: bool = True) -> str:
        p = self.spawn("core", [sys.executable, "-m", "tensorhub", "coordinator", "--host", self.coordinator_ip,
                                "--port", "0", "--state-dir", state_dir, "--planner", planner,
                                "--log-level", "warning"] + ([] if plans else ["--no-plans"]))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = p.stdout.readline()
            if "serving on" in line:
                return line.split("serving on", 1)[1].strip()
            if p.poll() is not None:
                break
        raise RuntimeError("coordinator did not start in the testbed")

    def wan_bytes(self) -> dict[str, dict[str, int]]:
        """star: bytes each datacenter sent to the WAN (``up``) and received from it
        (``down``) so far, by datacenter."""
        out = {}
        for dc, (a, b) in self.wan_ports.items():
            up = json.loads(_sh("ip", "-n", self.core, "-s", "-j", "link", "show", a).stdout)[0]["stats64"]
            dn = json.loads(_sh("ip", "-n", self.core, "-s", "-j", "link", "show", b).stdout)[0]["stats64"]
            out[dc] = {"up": up["tx"]["bytes"], "down": dn["tx"]["bytes"]}  # (each end's egress, shaped)
        return out

    def xdc_bytes(self) -> dict:
        """Bytes that crossed between datacenters so far, over all slow links: ``forward``
        (from datacenter d-1 to d, where the publisher is upstream; star: into every
        datacenter) and ``back``."""
        if self.wan == "star":
            w = self.wan_bytes()
            return {"forward": sum(x["down"] for x in w.values()), "back": sum(x["up"] for x in w.values())}
        fwd = back = 0
        for dev in self.xdc_links:
            out = _sh("ip", "-n", self.core, "-s", "-j", "link", "show", dev).stdout
            st = json.loads(out)[0]["stats64"]
            fwd += st["tx"]["bytes"]
            back += st["rx"]["bytes"]
        return {"forward": fwd, "back": back}
