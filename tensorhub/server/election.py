"""Leader election of highly available coordinators, on an etcd lease.

Each coordinator process runs one :class:`Election` (a background thread):

* it holds an etcd lease of ``ttl`` seconds (default 2) for its whole life, renewed every
  ``ttl / 5``, and keeps ``{prefix}members/{id}`` = its advertised URL on it (``status``
  lists the followers from these keys);
* **campaign**: when ``{prefix}leader`` is absent, one transaction creates it on the lease
  (``create_revision == 0`` -> put). The winner's key revision is its *fence*: every
  durable commit compares it (``server.store_etcd``), so writes stop the moment the key goes;
* **validity on the local monotonic clock**: a leader trusts its leadership only until
  ``sent + ttl * SAFETY``, where ``sent`` is when it sent the last keep-alive that etcd
  answered. etcd expires the lease no earlier than ``sent + ttl`` (it started counting
  when the request arrived), so a leader that was paused (SIGSTOP), starved or cut off
  knows it may be deposed before anyone else can have been elected, and
  :meth:`leading` says so before the coordinator answers anything;
* **followers** read the leader key every ``poll`` seconds (a range read; cheaper to get
  right than a watch stream through the HTTP gateway, and bounded the same way) and
  campaign as soon as it is gone.

``on_elected(fence_revision)`` and ``on_deposed(reason)`` are called on the election
thread; the coordinator rebuilds its state from etcd in the first (a new epoch: clients
re-register, as after a restart) and drops it in the second.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from typing import Callable, Optional

from .._exceptions import ConfigError
from .store_etcd import EtcdEndpoints, EtcdUnavailable, _b64, _put, prefix_end

__all__ = ["Election", "SAFETY"]

logger = logging.getLogger(__name__)

#: Fraction of the lease ttl a leader trusts after its last answered keep-alive.
SAFETY = 0.9


class Election:
    """Campaign, keep-alive, step-down; see the module docstring. Thread-safe."""

    def __init__(self, etcd: EtcdEndpoints, prefix: str, url: str, *, ttl: float = 2.0,
                 poll: float = 0.1, on_elected: Callable[[int], None] = lambda rev: None,
                 on_deposed: Callable[[str], None] = lambda why: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if ttl < 2:
            raise ConfigError(f"--election-ttl {ttl:g}: etcd leases last whole seconds, at least 2 "
                              "(etcd's minimum lease ttl is ~1.5 s)")
        self.etcd, self.prefix, self.url = etcd, prefix, url
        self.ttl = int(ttl)
        self.poll = poll
        self.on_elected, self.on_deposed, self.clock = on_elected, on_deposed, clock
        self.id = secrets.token_hex(6)
        self.leader_key = f"{prefix}leader"
        self.member_key = f"{prefix}members/{self.id}"
        self._lock = threading.Lock()
        self._lease: Optional[int] = None
        self._lease_until = float("-inf")  # local monotonic time our lease is trusted until
        self._fence: Optional[int] = None  # create_revision of our leader key while we lead
        self._leader_url: Optional[str] = None  # who leads, as last read
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        #: elections won by this process / times it stepped down (``/metrics``).
        self.won = 0
        self.lost = 0
        #: leader changes this process saw (another or itself took over).
        self.changes = 0

    # ------------------------------------------------------------------ queries
    def leading(self, now: Optional[float] = None) -> bool:
        """Is this process the leader right now (judged on the local monotonic clock)?
        The coordinator asks before it answers any request."""
        now = self.clock() if now is None else now
        with self._lock:
            return self._fence is not None and now < self._lease_until

    def fence(self) -> Optional[dict]:
        """The etcd compare that holds only while our leader key stands (None: not leading)."""
        with self._lock:
            if self._fence is None or self.clock() >= self._lease_until:
                return None
            return {"key": _b64(self.leader_key), "target": "CREATE", "result": "EQUAL",
                    "create_revision": str(self._fence)}

    def leader_url(self) -> Optional[str]:
        """The leader's advertised URL as last read (ours while leading); None if unknown."""
        if self.leading():
            return self.url
        with self._lock:
            return self._leader_url if self._leader_url != self.url else None

    def members(self) -> list[str]:
        """Advertised URLs of every running coordinator (from their member keys)."""
        base = f"{self.prefix}members/"
        return sorted({EtcdEndpoints.value(kv) for kv in self.etcd.range(base, prefix_end(base))})

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Grant the lease and announce this member (raises if etcd does not answer),
        then campaign and keep alive on a background thread."""
        self._grant()
        self._thread = threading.Thread(target=self._run, name="tensorhub-election", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Leave: revoke the lease (the leader key goes at once: a follower takes over
        without waiting out the ttl)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._step_down("stopped")
        lease = self._lease
        if lease is not None:
            try:
                self.etcd.post("/lease/revoke", {"ID": str(lease)})
            except Exception:  # the lease lapses by itself
                pass

    def resign(self, why: str) -> None:
        """Give up leadership now (a refused commit): delete our key if it still stands."""
        with self._lock:
            fence = self._fence
        self._step_down(why)
        if fence is not None:
            try:
                self.etcd.txn([{"key": _b64(self.leader_key), "target": "CREATE", "result": "EQUAL",
                                "create_revision": str(fence)}],
                              [{"request_delete_range": {"key": _b64(self.leader_key)}}])
            except Exception:
                pass

    # ------------------------------------------------------------------ internals
    def _grant(self) -> None:
        sent = self.clock()
        out = self.etcd.post("/lease/grant", {"TTL": str(self.ttl), "ID": "0"})
        lease = int(out["ID"])
        self.etcd.post("/kv/put", _put(self.member_key, self.url, lease)["request_put"])
        with self._lock:
            self._lease = lease
            self._lease_until = sent + int(out.get("TTL", self.ttl)) * SAFETY

    def _keepalive(self) -> bool:
        """Renew the lease; False if etcd says it is gone."""
        with self._lock:
            lease = self._lease
        sent = self.clock()
        out = self.etcd.post("/lease/keepalive", {"ID": str(lease)})
        ttl = int(out.get("result", {}).get("TTL", 0))
        if ttl <= 0:
            return False
        with self._lock:
            if self._lease == lease:
                self._lease_until = max(self._lease_until, sent + ttl * SAFETY)
        return True

    def _step_down(self, why: str) -> None:
        with self._lock:
            was = self._fence is not None
            self._fence = None
        if was:
            self.lost += 1
            logger.warning("coordinator %s stepped down: %s", self.url, why)
            self.on_deposed(why)

    def _campaign(self) -> None:
        with self._lock:
            lease = self._lease
        value = json.dumps({"url": self.url, "id": self.id})
        out = self.etcd.txn(
            [{"key": _b64(self.leader_key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
            [_put(self.leader_key, value, lease)],
            [{"request_range": {"key": _b64(self.leader_key)}}],
        )
        if out.get("succeeded"):
            rev = int(out["header"]["revision"])
            if not self.leading_lease():
                return  # our lease lapsed while campaigning: the key goes with it
            with self._lock:
                self._fence = rev
                self._leader_url = self.url
            self.won += 1
            self.changes += 1
            logger.warning("coordinator %s elected leader (fence revision %d)", self.url, rev)
            try:
                self.on_elected(rev)
            except Exception as e:  # could not load the durable state: let another try
                logger.exception("taking over failed")
                self.resign(f"taking over failed: {e}")
        else:
            kvs = out.get("responses", [{}])[0].get("response_range", {}).get("kvs", [])
            self._saw(kvs[0] if kvs else None)

    def leading_lease(self) -> bool:
        with self._lock:
            return self.clock() < self._lease_until

    def _saw(self, kv: Optional[dict]) -> None:
        url = None
        if kv is not None:
            try:
                url = json.loads(EtcdEndpoints.value(kv))["url"]
            except (ValueError, KeyError, TypeError):
                url = None
        with self._lock:
            if url != self._leader_url and url is not None:
                self.changes += 1
            self._leader_url = url

    def _mine(self, kv: dict) -> bool:
        try:
            return json.loads(EtcdEndpoints.value(kv)).get("id") == self.id
        except (ValueError, AttributeError):
            return False

    def _drop(self, kv: dict) -> None:
        rev = str(kv.get("create_revision", "0"))
        self.etcd.txn([{"key": _b64(self.leader_key), "target": "CREATE", "result": "EQUAL", "create_revision": rev}],
                      [{"request_delete_range": {"key": _b64(self.leader_key)}}])
        logger.warning("coordinator %s freed the leader key it no longer trusts", self.url)

    def _run(self) -> None:
        renew_every = self.ttl / 5
        next_renew = self.clock() + renew_every
        while not self._stop.is_set():
            now = self.clock()
            try:
                # 1. our lease: renew it; a lapsed one means we lost everything on it
                if not self.leading_lease():
                    self._step_down("lease not renewed within its ttl")
                if now >= next_renew:
                    next_renew = now + renew_every
                    if not self._keepalive():
                        self._step_down("lease expired in etcd")
                        self._grant()
                # 2. leader key
                if self._fence is None:
                    kv = self.etcd.get(self.leader_key)
                    if kv is None:
                        self._campaign()
                    elif self._mine(kv):
                        # Our own key, but we stepped down (our lease lapsed on our clock
                        # while etcd kept it, e.g. across an etcd leader change, which
                        # extends every lease): free it, or nobody would ever campaign.
                        self._drop(kv)
                    else:
                        self._saw(kv)
            except EtcdUnavailable as e:
                logger.warning("etcd: %s", e)
            except Exception:  # pragma: no cover - keep campaigning
                logger.exception("election step failed")
            if not self.leading_lease():
                self._step_down("lease not renewed within its ttl")
            self._stop.wait(self.poll if self._fence is None else min(self.poll, renew_every))
