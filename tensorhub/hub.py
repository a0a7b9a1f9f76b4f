"""The Hub client: what a trainer or an engine process uses.

``hub = tensorhub.connect(url)`` registers this process as a worker (no data plane yet;
the transport starts on the first publish or fetch). A heartbeat thread keeps the
worker's replicas alive; when the coordinator restarts (new epoch, or "unknown worker")
it re-registers the worker and every replica it holds, by itself.

Who calls what:

* holder (trainer, engine): ``publish`` registers tensors in place; they must stay
  untouched until ``unpublish`` returns (that is when no reader holds a lease on them).
* reader (engine): ``latest`` / ``wait_for_version`` / ``fetch``; with ``serve=True`` a
  fetched shard becomes one more replica (the reader is then a holder of it).
* anyone: ``close()`` (or the context manager) drops every replica of this worker,
  unregisters its memory and stops the heartbeat. Any call after it raises
  :class:`HubClosedError`.

Observability: every fetch counts in this process's ``tensorhub_hub_*`` metrics
(``tensorhub._metrics``) and is reported to the coordinator (``POST /v1/fetches``: about
once a second while a fetch runs longer than a second, and when it ends) from a
background thread, best effort: telemetry never delays or fails a fetch. A fetch longer
than a second hands its progress to ``fetch(..., progress=callback)``, else logs it.
Engines report their swaps with :meth:`Hub.report_swap`.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import socket
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional
from urllib.parse import urlparse

from . import envs
from ._checksum import check_mode, verifier
from ._client import CoordinatorClient
from ._fencing import LeaseClock, Quarantine, renew_leases
from ._exceptions import (
    ConfigError,
    FetchError,
    HubClosedError,
    HubTimeoutError,
    LeaseLapsedError,
    TensorMismatchError,
    NotFoundError,
    ConflictError,
    RetentionError,
    TensorHubError,
)
from ._metrics import FetchProgress, Outbox, Track, hub_metrics
from ._reader import ShardReader, Source
from ._tensors import allocate_like, check_into, coalesce, manifest_of
from ._wire import LeaseGrant, Locality, Manifest, TensorSpec
from .transport import Transport, create_transport

__all__ = ["Hub", "Fetched", "connect", "parse_locality"]

logger = logging.getLogger(__name__)

#: Batches in flight per source, and the smallest chunk worth striping.
_DEPTH = 2
_MIN_CHUNK = 4 << 20

#: Seconds past a fetch's deadline its coordinator calls (release, register) may still retry.
_RELEASE_GRACE = 2.0

#: Destination buffers a hung transfer may still write into: never freed (see _reader).
_QUARANTINE: list[Any] = []


def parse_locality(text: Optional[str]) -> Locality:
    """``"dc=a,zone=z1,host=h3"`` -> Locality; missing labels default from the hostname."""
    labels = {"datacenter": "default", "zone": "default", "host": socket.gethostname()}
    aliases = {"dc": "datacenter", "datacenter": "datacenter", "zone": "zone", "host": "host"}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in aliases:
            raise ConfigError(f"bad locality label {part!r}; expected dc=..,zone=..,host=..")
        labels[aliases[key.strip()]] = value.strip()
    return Locality(**labels)


def _data_host(coordinator_url: str) -> str:
    """The address our data plane advertises: loopback if the coordinator is, else the
    local address of the route towards it (no packet is sent)."""
    host = urlparse(coordinator_url).hostname or "127.0.0.1"
    try:
        if ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
            return "127.0.0.1"
    except (OSError, ValueError):
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(host), 9))
        return s.getsockname()[0]


class Fetched(dict):
    """What ``fetch`` returns: ``name -> tensor``, plus where the bytes came from.

    Attributes: ``version``, ``layout``, ``shard``, ``nbytes``, ``seconds``, ``gbps``
    (GB/s), ``sources`` (worker id -> bytes read from it), ``failed_sources``.
    """

    version: int
    layout: str
    shard: int
    nbytes: int
    seconds: float
    sources: dict[str, int]
    failed_sources: list[str]

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


@dataclass
class _Held:
    """A replica this process holds: what it needs to re-register after a restart."""

    model: str
    version: int
    layout: str
    shard: int
    num_shards: int
    manifest: Manifest
    addresses: list[int]
    regions: list[tuple[int, int]]
    tensors: Any  # keeps the memory alive
    replica_id: str = ""
    extra: list[Any] = field(default_factory=list)


class Hub:
    """A connection to a coordinator; see the module docstring for the lifecycle."""

    def __init__(self, url: Optional[str] = None, *, worker_id: Optional[str] = None,
                 locality: Optional[Locality | str | Mapping[str, str]] = None, token: Optional[str] = None,
                 transport: Optional[Transport] = None, heartbeat_interval: Optional[float] = None,
                 progress_timeout: Optional[float] = None, chunk_bytes: Optional[int] = None,
                 max_sources: Optional[int] = None, fetch_timeout: float = 600.0,
                 retain_on_cpu: Optional[bool] = None,
                 pipelined: Optional[bool] = None, ca_file: Optional[str] = None,
                 checksum: Optional[str] = None) -> None:
        url = envs.pick(url, "TENSORHUB_COORDINATOR")
        if not url:
            raise ConfigError("no coordinator URL: pass one or set TENSORHUB_COORDINATOR")
        self.url = url
        self.worker_id = envs.pick(worker_id, "TENSORHUB_WORKER_ID") or \
            f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        if isinstance(locality, Locality):
            self.locality = locality
        elif isinstance(locality, Mapping):
            self.locality = parse_locality(",".join(f"{k}={v}" for k, v in locality.items()))
        else:
            self.locality = parse_locality(envs.pick(locality, "TENSORHUB_LOCALITY"))
        self._token = envs.pick(token, "TENSORHUB_TOKEN")
        #: CA bundle for an https coordinator (argument > TENSORHUB_CA_FILE > system CAs).
        self._ca_file = envs.pick(ca_file, "TENSORHUB_CA_FILE")
        self.heartbeat_interval = float(envs.pick(heartbeat_interval, "TENSORHUB_HEARTBEAT_INTERVAL"))
        self.progress_timeout = float(envs.pick(progress_timeout, "TENSORHUB_PROGRESS_TIMEOUT"))
        self.chunk_bytes = int(envs.pick(chunk_bytes, "TENSORHUB_CHUNK_BYTES"))
        self.max_sources = int(envs.pick(max_sources, "TENSORHUB_STRIPE"))
        #: Read from readers still receiving, serve while receiving, seed across datacenters.
        self.pipelined = bool(envs.pick(pipelined, "TENSORHUB_PIPELINED"))
        #: Per-chunk checksums: auto (CPU memory), on (CUDA too), off (_checksum).
        self.checksum = check_mode(envs.pick(checksum, "TENSORHUB_CHECKSUM"))
        self.fetch_timeout = fetch_timeout
        self.retain_on_cpu = bool(envs.pick(retain_on_cpu, "TENSORHUB_RETAIN_ON_CPU"))
        self._transport = transport
        self._transport_started = False
        self._api: Optional[CoordinatorClient] = None
        self._held: dict[tuple[str, int, str, int], _Held] = {}
        self._lock = threading.RLock()
        self._epoch: Optional[str] = None
        self._lease_ttl = 30.0
        self._closed = False
        self._stop = threading.Event()
        self._hb: Optional[threading.Thread] = None
        self._outbox = Outbox(self)
        #: (epoch, served leases, served bytes) last answered on a heartbeat.
        self._served_seen: tuple[Optional[str], int, int] = (None, 0, 0)
        #: Memory fetches must not write (docs/consistency.md); lifted on heartbeats.
        self._quarantine = Quarantine()
        #: Held replica -> monotonic time before which unpublish does not let it be
        #: overwritten: set when this worker learns it was expired or the coordinator restarted.
        self._fence_until: dict[tuple[str, int, str, int], float] = {}

    # ------------------------------------------------------------------ lifecycle
    def connect(self) -> "Hub":
        """Register with the coordinator and start heart-beating. Called by ``tensorhub.connect``."""
        self._check_open()
        self._api = CoordinatorClient(self.url, self._token, ca_file=self._ca_file)
        self._register_worker()
        self._hb = threading.Thread(target=self._heartbeat_loop, name=f"tensorhub-hb-{self.worker_id}", daemon=True)
        self._hb.start()
        weakref.finalize(self, self._stop.set)
        return self

    def close(self) -> None:
        """Drop this worker's replicas, unregister its memory, stop heart-beating. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._hb is not None:
            self._hb.join(timeout=5)
        self._outbox.close(timeout=2.0)
        if self._api is not None:
            try:
                self._api.delete(f"/v1/workers/{self.worker_id}", retry_timeout=2.0)
            except TensorHubError as e:
                logger.debug("worker %s: deregistration failed: %s", self.worker_id, e)
            self._api.close()
        with self._lock:
            for key in list(self._held):
                self._drop(key)
        if self._transport is not None and self._transport_started:
            self._transport.close()

    def __enter__(self) -> "Hub":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise HubClosedError(f"Hub {self.worker_id} is closed")

    @property
    def api(self) -> CoordinatorClient:
        self._check_open()
        if self._api is None:
            raise HubClosedError("Hub is not connected; use tensorhub.connect(url)")
        return self._api

    @property
    def endpoint(self) -> str:
        """This worker's data-plane endpoint (starts the transport)."""
        return self._ensure_transport().endpoint

    def _ensure_transport(self) -> Transport:
        with self._lock:
            if self._transport is None:
                host = envs.TENSORHUB_DATA_HOST or _data_host(self.url)
                self._transport = create_transport(host=host, progress_timeout=self.progress_timeout)
            if not self._transport_started:
                self._transport.start()
                self._transport_started = True
                self._register_worker()
            return self._transport

    def _register_worker(self, retry_timeout: Optional[float] = None) -> None:
        endpoint = self._transport.endpoint if self._transport_started else ""
        r = self.api.post("/v1/workers", {"worker_id": self.worker_id, "endpoint": endpoint,
                                          "locality": self.locality.model_dump()}, retry_timeout=retry_timeout)
        self._epoch = r["epoch"]
        self._lease_ttl = float(r["lease_ttl"])

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_interval):
            try:
                r = self.api.post(f"/v1/workers/{self.worker_id}/heartbeat",
                                  retry_timeout=self.heartbeat_interval)
                self._count_served(r)
                if len(self._quarantine) and self._transport is not None:
                    self._quarantine.retry(lambda regions: self._unregister_regions(self._transport, regions))
                if r.get("epoch") != self._epoch:
                    logger.warning("coordinator restarted (epoch %s -> %s); re-registering", self._epoch, r["epoch"])
                    self._reregister()
            except NotFoundError:
                logger.warning("coordinator forgot worker %s; re-registering its replicas", self.worker_id)
                self._reregister()
            except HubClosedError:
                return
            except TensorHubError as e:
                logger.warning("heartbeat to %s failed: %s", self.url, e)
            except Exception:  # pragma: no cover - never let the thread die
                logger.exception("heartbeat failed")

    def _count_served(self, answer: dict) -> None:
        """Turn the coordinator's totals of what this worker served (since it started, or
        since it re-registered us) into this process's ``served`` counter increments."""
        if "served_bytes" not in answer:
            return  # an older coordinator
        epoch, leases, nbytes = answer.get("epoch"), int(answer["served_leases"]), int(answer["served_bytes"])
        seen_epoch, seen_leases, seen_bytes = self._served_seen
        if epoch != seen_epoch or leases < seen_leases or nbytes < seen_bytes:
            seen_leases = seen_bytes = 0  # the coordinator counts afresh
        m = hub_metrics()
        if leases > seen_leases:
            m.served_leases.inc(leases - seen_leases)
        if nbytes > seen_bytes:
            m.served_bytes.inc(nbytes - seen_bytes)
        self._served_seen = (epoch, leases, nbytes)

    def _hold(self, h: "_Held") -> None:
        """Record a replica this process now holds (caller holds ``_lock``)."""
        key = (h.model, h.version, h.layout, h.shard)
        if key in self._held:
            self._drop(key)
        self._held[key] = h
        m = hub_metrics()
        m.held_replicas.labels(h.model).inc()
        m.held_bytes.labels(h.model).inc(h.manifest.nbytes)

    def _drop(self, key: tuple) -> Optional["_Held"]:
        """Forget a held replica (caller holds ``_lock``)."""
        h = self._held.pop(key, None)
        if h is not None:
            m = hub_metrics()
            m.held_replicas.labels(h.model).dec()
            m.held_bytes.labels(h.model).dec(h.manifest.nbytes)
        return h

    def _fetch_report(self, p: FetchProgress, state: str) -> dict:
        return {"worker_id": self.worker_id, "model": p.model, "version": p.version, "layout": p.layout,
                "shard": p.shard, "state": state, "nbytes": p.nbytes, "total": p.total,
                "seconds": round(p.seconds, 6), "sources": dict(list(p.sources.items())[:1024]),
                "failed_sources": p.failed_sources}

    def report_swap(self, model: str, version: int, stall: float, *, fetch_seconds: Optional[float] = None,
                    apply_seconds: Optional[float] = None, ok: bool = True) -> None:
        """An engine (this process) switched to ``model`` v``version`` (or failed to, ``ok=False``),
        not serving for ``stall`` seconds: counted in ``tensorhub_hub_swap_stall_seconds`` and
        sent to the coordinator's ``tensorhub_swap_stall_seconds`` (in the background)."""
        self._check_open()
        if ok:
            hub_metrics().swap_stall.labels(model).observe(stall)
        body: dict[str, Any] = {"worker_id": self.worker_id, "model": model, "version": version,
                                "stall": max(0.0, stall), "ok": ok}
        if fetch_seconds is not None:
            body["fetch_seconds"] = max(0.0, fetch_seconds)
        if apply_seconds is not None:
            body["apply_seconds"] = max(0.0, apply_seconds)
        self._outbox.put("/v1/swaps", body)

    def _reregister(self) -> None:
        """Register the worker and every held replica again. Holds the lock, so that no
        replica being unpublished is announced again, but with a short retry budget: a
        coordinator that is still down must not stall this process's fetches for long."""
        budget = max(1.0, 2 * self.heartbeat_interval)
        with self._lock:
            # Leases on what we held may still run (granted before the restart, or renewed
            # on our tombstones): overwriting any of it waits one more lease ttl.
            until = time.monotonic() + self._lease_ttl
            for key in self._held:
                self._fence_until[key] = max(self._fence_until.get(key, 0.0), until)
        try:
            with self._lock:
                self._register_worker(retry_timeout=budget)
                for h in list(self._held.values()):
                    self.api.post(f"/v1/models/{h.model}/versions", {"version": h.version}, retry_timeout=budget)
                    h.replica_id = self.api.post("/v1/replicas", self._replica_body(h),
                                                 retry_timeout=budget)["replica_id"]
        except TensorHubError as e:
            logger.warning("re-registration failed (will retry): %s", e)

    def _as_worker(self, path: str, body: Any, **kw: Any) -> Any:
        """POST a worker-scoped call; if the coordinator forgot us (it restarted), register
        again (with every held replica) and retry once."""
        try:
            return self.api.post(path, body, **kw)
        except NotFoundError as e:
            if e.code != "unknown_worker":
                raise
            logger.warning("coordinator forgot worker %s; re-registering", self.worker_id)
            self._reregister()
            return self.api.post(path, body, **kw)

    def _register_replica(self, h: _Held) -> str:
        self.api.post(f"/v1/models/{h.model}/versions", {"version": h.version})
        return self._as_worker("/v1/replicas", self._replica_body(h))["replica_id"]

    def _replica_body(self, h: _Held) -> dict:
        return {
            "worker_id": self.worker_id, "model": h.model, "version": h.version, "layout": h.layout,
            "shard": h.shard, "num_shards": h.num_shards,
            "manifest": h.manifest.model_dump(mode="json"), "addresses": h.addresses,
        }

    # ------------------------------------------------------------------ holder
    def publish(self, model: str, tensors: Mapping[str, Any], *, version: Optional[int] = None,
                layout: str = "hf", shard: int = 0, num_shards: int = 1) -> int:
        """Register ``tensors`` in place as ``model``'s version (new when ``version`` is None).

        No copy: the tensors must stay unchanged until ``unpublish`` returns. With several
        shards, one rank publishes with ``version=None`` and passes the number it got to the
        others (``version=v``). The version is complete once every shard has a replica."""
        manifest, addrs = manifest_of(tensors, self.checksum)
        if not 0 <= shard < num_shards:
            raise ConfigError(f"shard {shard} is not in [0, {num_shards})")
        # A retried allocation (the answer was lost) gets the same number: no skipped version.
        key_version = self.api.post(f"/v1/models/{model}/versions",
                                    {"version": version, "request_id": secrets.token_hex(12)})["version"]
        transport = self._ensure_transport()
        regions = coalesce([(a, s.nbytes) for a, s in zip(addrs, manifest.tensors)])
        h = _Held(model, key_version, layout, shard, num_shards, manifest, addrs, regions, dict(tensors))
        self._register_regions(transport, regions)
        try:
            h.replica_id = self._register_replica(h)
        except BaseException:
            self._unregister_regions(transport, regions)
            raise
        with self._lock:
            self._hold(h)
        logger.info("published %s v%d layout %s shard %d/%d as replica %s of worker %s: %d tensors, %.1f MB",
                    model, key_version, layout, shard, num_shards, h.replica_id, self.worker_id, len(addrs),
                    manifest.nbytes / 1e6)
        return key_version

    def unpublish(self, model: str, version: int, *, timeout: Optional[float] = None,
                  retain_on_cpu: Optional[bool] = None) -> None:
        """Stop serving ``model`` v``version``; return once no reader holds a lease on it.

        After it returns the caller may overwrite or free those tensors. If this worker holds
        the last replica of the newest complete version (retention), then with
        ``retain_on_cpu`` (default: the Hub's setting) it first copies the bytes into CPU
        memory it keeps serving from; without it, it waits (up to ``timeout``) for another
        holder, then raises RetentionError. If readers do not drain in time it raises
        HubTimeoutError, and the bytes must stay untouched."""
        retain = self.retain_on_cpu if retain_on_cpu is None else retain_on_cpu
        with self._lock:
            mine = [h for k, h in self._held.items() if k[0] == model and k[1] == version]
        if not mine:
            raise NotFoundError(404, f"this hub holds no replica of {model!r} v{version}", "not_held")
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.02
        body: dict[str, Any] = {"worker_id": self.worker_id}
        copies: list[_Held] = []
        while True:
            try:
                r = self._as_worker(f"/v1/models/{model}/versions/{version}/unpublish", body)
                if r["drained"]:
                    break
                why: TensorHubError = HubTimeoutError(
                    f"unpublish {model!r} v{version}: {r['open_leases']} reader lease(s) still open; "
                    "the tensors must stay untouched")
            except RetentionError as e:
                if retain and not copies:
                    copies = [self._retain_copy(h) for h in mine]
                    body["replica_ids"] = [h.replica_id for h in mine]
                    continue
                why = e
            if deadline is not None and time.monotonic() >= deadline:
                raise why
            time.sleep(delay)
            delay = min(delay * 1.5, 0.25)
        self._wait_fence(mine, deadline, model, version)
        transport = self._ensure_transport()
        with self._lock:
            for h in mine:
                self._drop((h.model, h.version, h.layout, h.shard))
                self._fence_until.pop((h.model, h.version, h.layout, h.shard), None)
                self._unregister_regions(transport, h.regions)
            for c in copies:
                self._hold(c)
        logger.info("worker %s unpublished %s v%d (replica(s) %s)%s", self.worker_id, model, version,
                    ", ".join(h.replica_id for h in mine), " (kept serving a CPU copy)" if copies else "")

    def _wait_fence(self, mine: list["_Held"], deadline: Optional[float], model: str, version: int) -> None:
        """Holder rule (docs/consistency.md): after this worker learned it was expired or
        the coordinator restarted, what it held then stays untouched for one lease ttl."""
        with self._lock:
            until = max((self._fence_until.get((h.model, h.version, h.layout, h.shard), 0.0) for h in mine),
                        default=0.0)
        wait = until - time.monotonic()
        if wait <= 0:
            return
        if deadline is not None and time.monotonic() + wait > deadline:
            raise HubTimeoutError(
                f"unpublish {model!r} v{version}: this worker was expired or the coordinator restarted "
                f"while it held it; leases on it may run {wait:.1f}s more: the tensors must stay untouched")
        logger.warning("unpublish %s v%d: waiting %.1fs (leases from before this worker re-registered may "
                       "still be read)", model, version, wait)
        time.sleep(wait)

    def _retain_copy(self, h: _Held) -> _Held:
        """Copy a held shard into new CPU memory and register the copy as a replica."""
        buf, out = allocate_like(h.manifest, device="cpu")
        for name, t in h.tensors.items():
            out[name].copy_(t)
        local = [out[s.name].data_ptr() for s in h.manifest.tensors]
        regions = coalesce([(a, s.nbytes) for a, s in zip(local, h.manifest.tensors)])
        transport = self._ensure_transport()
        self._register_regions(transport, regions)
        c = _Held(h.model, h.version, h.layout, h.shard, h.num_shards, h.manifest, local, regions, out,
                  extra=[buf])
        try:
            c.replica_id = self._register_replica(c)
        except BaseException:
            self._unregister_regions(transport, regions)
            raise
        logger.warning("%s v%d is the newest version and this is its last holder: serving a %.1f MB CPU "
                       "copy (retain_on_cpu)", h.model, h.version, h.manifest.nbytes / 1e6)
        return c

    @staticmethod
    def _register_regions(transport: Transport, regions: list[tuple[int, int]]) -> None:
        done: list[tuple[int, int]] = []
        try:
            for a, n in regions:
                transport.register(a, n)
                done.append((a, n))
        except BaseException:
            Hub._unregister_regions(transport, done)
            raise

    @staticmethod
    def _unregister_regions(transport: Transport, regions: list[tuple[int, int]]) -> None:
        for a, n in regions:
            try:
                transport.unregister(a, n)
            except TensorHubError as e:  # pragma: no cover
                logger.warning("unregister %#x failed: %s", a, e)

    # ------------------------------------------------------------------ reader
    def latest(self, model: str) -> Optional[int]:
        """The newest complete version of ``model``, or None."""
        return self.api.get(f"/v1/models/{model}/latest")["version"]

    def wait_for_version(self, model: str, *, newer_than: Optional[int] = None,
                         timeout: Optional[float] = None) -> int:
        """Block until a complete version (newer than ``newer_than``) exists; return it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 30.0 if deadline is None else max(0.0, deadline - time.monotonic())
            params: dict[str, Any] = {"wait": min(left, 30.0)}
            if newer_than is not None:
                params["newer_than"] = newer_than
            try:
                v = self.api.get(f"/v1/models/{model}/latest", params=params, timeout=params["wait"] + 30)["version"]
            except NotFoundError:
                v = None
                time.sleep(min(0.2, left))
            if v is not None:
                return v
            if deadline is not None and time.monotonic() >= deadline:
                raise HubTimeoutError(
                    f"no complete version of {model!r}" + (f" newer than {newer_than}" if newer_than else "")
                    + f" within {timeout}s")

    def resolve(self, model: str, *, group: Optional[str] = None) -> int:
        """The version to fetch: the newest complete one; every caller passing the same
        ``group`` (e.g. one id per TP group and update step) gets the same number."""
        return self.api.post(f"/v1/models/{model}/resolve", {"group": group})["version"]

    def fetch(self, model: str, version: Optional[int] = None, *, layout: str = "hf", shard: int = 0,
              into: Optional[Mapping[str, Any]] = None, serve: bool = True, group: Optional[str] = None,
              timeout: Optional[float] = None,
              progress: Optional[Callable[[FetchProgress], None]] = None,
              names: Optional[Iterable[str]] = None) -> Fetched:
        """Read ``model`` v``version`` (newest complete when None) from the holders the
        coordinator picks, into ``into`` (checked tensor by tensor) or new tensors.

        With ``serve=True`` the result is registered as one more replica: leave the tensors
        unchanged until ``unpublish``. ``group``: see :meth:`resolve`. The fetch completes or
        fails within ``timeout`` (default ``fetch_timeout``), coordinator outages included.
        ``progress``: called on this thread with a :class:`~tensorhub.FetchProgress` about
        once a second (``TENSORHUB_PROGRESS_INTERVAL``) once the fetch has run for a second,
        and once more at its end (``done=True``); without it, progress goes to the log.
        ``names``: read only these tensors (``serve`` must be False; ``into`` then needs only
        them); :meth:`manifest` lists a version's tensors. Streaming a version in bounded
        buckets is a loop of such fetches into one reused buffer."""
        self._check_open()
        if names is not None:
            names = list(dict.fromkeys(names))
            if serve:
                raise ConfigError("fetch(names=...) reads part of a version, which cannot be served: "
                                  "pass serve=False")
            if not names:
                raise ConfigError("fetch(names=...) needs at least one tensor name")
        deadline = time.monotonic() + (self.fetch_timeout if timeout is None else timeout)
        track = Track(progress)
        t0 = time.monotonic()
        try:
            with self.api.bounded(deadline + _RELEASE_GRACE):
                f = self._fetch(model, version, layout, shard, into, serve, group, deadline, track, names)
        except BaseException:
            self._account(model, layout, shard, track, None, t0)
            raise
        self._account(model, layout, shard, track, f, t0)
        return f

    def _account(self, model: str, layout: str, shard: int, track: Track, f: Optional[Fetched], t0: float) -> None:
        """Count a fetch that ended (``f`` None: it failed) and report it to the coordinator."""
        try:
            m = hub_metrics()
            if f is not None and track.reporter is None:
                m.fetches.labels(model, "ok").inc()  # this process held it already: no transfer
                return
            if track.reporter is None:  # failed before a lease: nothing was read
                m.fetched(model, "failed", 0, time.monotonic() - t0, 0)
                if track.version is not None:
                    self._outbox.put("/v1/fetches", {"worker_id": self.worker_id, "model": model,
                                                     "version": track.version, "layout": layout, "shard": shard,
                                                     "state": "failed", "seconds": time.monotonic() - t0})
                return
            p = track.reporter.finish()
            outcome = "failed" if f is None else "ok"
            if f is not None:  # the read's own figures (leases and registration excluded)
                p = FetchProgress(p.model, p.version, p.layout, p.shard, f.nbytes, p.total, f.seconds,
                                  dict(f.sources), len(f.failed_sources), True)
            m.fetched(model, outcome, p.nbytes, p.seconds, 0)
            self._outbox.put("/v1/fetches", self._fetch_report(p, outcome))
        except Exception:  # pragma: no cover - accounting never breaks a fetch
            logger.debug("fetch accounting failed", exc_info=True)

    def _fetch(self, model: str, version: Optional[int], layout: str, shard: int,
               into: Optional[Mapping[str, Any]], serve: bool, group: Optional[str], deadline: float,
               track: Optional[Track] = None, names: Optional[list[str]] = None) -> Fetched:
        track = track if track is not None else Track(None)
        if version is None:
            version = self.resolve(model, group=group)
        elif not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ConfigError(f"version must be a positive int, got {version!r}")
        with self._lock:
            held = self._held.get((model, version, layout, shard))
        if held is not None and names is not None:  # part of what we hold: copy it
            keep = _select(held.manifest, names, model, version)
            part = Manifest.model_construct(tensors=[held.manifest.tensors[i] for i in keep])
            if into is None:
                _, into = allocate_like(part)
            check_into(part, into)
            self._check_not_served(into)
            for spec in part.tensors:
                into[spec.name].copy_(held.tensors[spec.name])
            return self._fetched(dict(into), version, layout, shard, part.nbytes, 0.0,
                                 {self.worker_id: part.nbytes}, [])
        if held is not None:  # we hold it already: no transfer
            if into is None:
                return self._fetched(dict(held.tensors), version, layout, shard, 0, 0.0, {}, [])
            check_into(held.manifest, into)
            self._check_not_served(into)
            for name, t in held.tensors.items():
                into[name].copy_(t)
            return self._fetched(dict(into), version, layout, shard, held.manifest.nbytes, 0.0,
                                 {self.worker_id: held.manifest.nbytes}, [])
        track.version = version
        if self.pipelined and names is None:
            from ._pipeline import fetch_pipelined

            return fetch_pipelined(self, model, version, layout, shard, into, serve, deadline, track=track)
        transport = self._ensure_transport()
        leases: list[str] = []
        clock = LeaseClock()
        grant = self._acquire(model, version, layout, shard, set(), deadline, clock)
        leases.append(grant.lease_id)
        manifest = grant.manifest
        keep: Optional[list[int]] = None
        if names is not None:
            try:
                keep = _select(manifest, names, model, version)
            except BaseException:
                self._release_all(leases)
                raise
            manifest = Manifest.model_construct(tensors=[manifest.tensors[i] for i in keep])
        regions: list[tuple[int, int]] = []
        served = False
        try:
            if into is not None:
                local = check_into(manifest, into)
                self._check_not_served(into)
                out, buf = dict(into), None
            else:
                buf, out = allocate_like(manifest)
                local = [t.data_ptr() for t in out.values()]
            wanted = coalesce([(a, s.nbytes) for a, s in zip(local, manifest.tensors)])
            self._register_regions(transport, wanted)
            regions = wanted
            # Enough chunks to stripe over every source with a few batches in flight each.
            spread = -(-manifest.nbytes // (2 * _DEPTH * max(1, len(grant.replicas))))
            chunk = min(self.chunk_bytes, max(_MIN_CHUNK, spread))
            reader = ShardReader(transport, [s.nbytes for s in manifest.tensors], local, chunk_bytes=chunk,
                                 depth=_DEPTH, progress_timeout=self.progress_timeout,
                                 checksums=verifier(grant.manifest, out, self.checksum, keep))
            prog = track.start(self, model, version, layout, shard, manifest.nbytes)
            first = [grant]

            def sources(excluded: set[str]) -> list[Source]:
                g = first.pop() if first else self._acquire(model, version, layout, shard, excluded, deadline, clock)
                if g.lease_id not in leases:
                    leases.append(g.lease_id)
                return [Source(r.replica_id, r.worker_id, r.endpoint,
                               tuple(r.addresses) if keep is None else tuple(r.addresses[i] for i in keep),
                               g.lease_id, r.cost)
                        for r in g.replicas]

            def report(src: Source, reason: str) -> None:
                hub_metrics().source_failures.labels(model).inc()
                self._as_worker(f"/v1/replicas/{src.replica_id}/report",
                              {"worker_id": self.worker_id, "reason": reason[:1000]}, retry_timeout=2.0)

            renew_every = max(0.1, self._lease_ttl / 3)
            last_renew = [time.monotonic()]

            def renew() -> None:
                prog.tick(reader.live)
                if time.monotonic() - last_renew[0] < renew_every:
                    return
                last_renew[0] = time.monotonic()
                renew_leases(self.api, leases, clock, self._lease_ttl)

            todo: Optional[list[int]] = None
            total_sources: dict[str, int] = {}
            failed: list[str] = []
            nbytes, seconds = 0, 0.0
            for attempt in range(3):
                try:
                    stats = reader.run(sources, report, chunks=todo, deadline=deadline, on_tick=renew)
                except BaseException as e:
                    if not reader.stuck:
                        raise
                    regions = []  # a hung batch may still write there: never unregister it
                    raise _quarantine(self, e, buf, out, into) from e
                nbytes += stats.nbytes
                seconds += stats.seconds
                failed += stats.failed_sources
                for w, n in stats.bytes_by_source.items():
                    total_sources[w] = total_sources.get(w, 0) + n
                prog.tick(stats)
                prog.attempt_done()
                lapsed = self._release_checked(leases, clock)
                if not lapsed:
                    break
                todo = sorted(c for lid in lapsed for c in stats.chunks_by_lease.get(lid, []))
                logger.warning("%s v%d: worker %s's lease(s) %s lapsed during the read; re-reading %d chunk(s)",
                               model, version, self.worker_id, lapsed, len(todo))
                first.clear()
            else:
                raise LeaseLapsedError(f"{model!r} v{version}: leases kept lapsing; bytes discarded")
            h = None
            if serve:
                h = _Held(model, version, layout, shard, grant.num_shards, manifest, local, regions, out,
                          extra=[buf])
                h.replica_id = self._register_replica(h)
                with self._lock:
                    self._hold(h)
                served = True
            logger.info("worker %s fetched %s v%d layout %s shard %d: %.1f MB in %.3fs (%.2f GB/s) from %s%s%s",
                        self.worker_id, model, version, layout, shard, nbytes / 1e6, seconds,
                        nbytes / seconds / 1e9 if seconds else 0.0, total_sources,
                        f"; failed replicas {failed}" if failed else "",
                        f"; serving it as replica {h.replica_id}" if h is not None else "")
            return self._fetched(out, version, layout, shard, nbytes, seconds, total_sources, failed)
        finally:
            if not served:
                self._release_all(leases)
                self._unregister_regions(transport, regions)

    def _check_not_served(self, into: Mapping[str, Any]) -> None:
        """Refuse to write into memory this hub still serves (invariant 3: unpublish first)
        or that is quarantined (a peer may still read it, or a hung transfer write it)."""
        self._quarantine.check(into)
        with self._lock:
            served = [(a, n, h) for h in self._held.values() for a, n in h.regions]
        for name, t in into.items():
            lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
            for a, n, h in served:
                if lo < a + n and a < hi:
                    raise ConfigError(
                        f"into[{name!r}] lies in memory this hub serves as {h.model!r} v{h.version}; "
                        f"unpublish({h.model!r}, {h.version}) first")

    def _acquire(self, model: str, version: int, layout: str, shard: int, excluded: set[str],
                 deadline: float, clock: Optional[LeaseClock] = None) -> LeaseGrant:
        """A lease on the shard; waits (until ``deadline``) while no replica is serving.
        ``clock`` learns how long the reader may trust it (docs/consistency.md)."""
        delay = 0.05
        while True:
            try:
                sent = time.monotonic()
                body = self._as_worker("/v1/leases", {
                    "worker_id": self.worker_id, "model": model, "version": version, "layout": layout,
                    "shard": shard, "max_sources": self.max_sources, "exclude": sorted(excluded)[:1024],
                    "request_id": secrets.token_hex(12),  # a retried request gets the same lease
                })
                grant = LeaseGrant.model_validate(body)
                if grant.version != version:
                    raise FetchError(f"asked for {model!r} v{version} but the lease is for v{grant.version}")
                if clock is not None:
                    clock.granted(grant.lease_id, sent, grant.ttl)
                return grant
            except ConflictError as e:
                if e.code != "no_replica" or time.monotonic() + delay > deadline:
                    raise FetchError(f"cannot fetch {model!r} v{version}: {e.message}") from e
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _release(self, lease_id: str) -> bool:
        try:
            return bool(self.api.post(f"/v1/leases/{lease_id}/release")["valid"])
        except NotFoundError:
            return False

    def _release_checked(self, leases: list[str], clock: LeaseClock) -> list[str]:
        """Release a read's leases; returns those whose bytes cannot be trusted: the
        coordinator says the lease lapsed, or the reader's own bound passed first."""
        lapsed = []
        for lid in leases:
            trusted = clock.trusted(lid)  # the bytes are all in: judge before the round trip
            valid = self._release(lid)
            if not (trusted and valid):
                if valid:
                    logger.warning("lease %s: released in time for the coordinator, but past this reader's "
                                   "own bound (last grant/renewal + ttl): re-reading", lid)
                lapsed.append(lid)
        leases.clear()
        return lapsed

    def _release_all(self, leases: list[str]) -> None:
        for lid in leases:
            try:
                self._release(lid)
            except TensorHubError:
                pass
        leases.clear()

    @staticmethod
    def _fetched(out: dict, version: int, layout: str, shard: int, nbytes: int, seconds: float,
                 sources: dict[str, int], failed: list[str]) -> Fetched:
        f = Fetched(out)
        f.version, f.layout, f.shard, f.nbytes, f.seconds = version, layout, shard, nbytes, seconds
        f.sources, f.failed_sources = sources, failed
        return f

    def manifest(self, model: str, version: int, *, layout: str = "hf", shard: int = 0) -> list[TensorSpec]:
        """The tensors of ``model`` v``version`` (``layout``, ``shard``) in their order: each
        with ``.name``, ``.dtype``, ``.shape`` and ``.nbytes``. Reads no weights."""
        self._check_open()
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ConfigError(f"version must be a positive int, got {version!r}")
        body = self.api.get(f"/v1/models/{model}/versions/{version}/manifest",
                            params={"layout": layout, "shard": shard})
        return list(Manifest.model_validate(body).tensors)

    def held(self) -> list[tuple[str, int, str, int]]:
        """(model, version, layout, shard) of every replica this process holds."""
        with self._lock:
            return sorted(self._held)


def _quarantine(hub: Hub, e: BaseException, buf: Any, out: Any, into: Any) -> FetchError:
    """A read whose batch never ended: keep its destination alive forever (never freed or
    reused by us; ``fetch(into=...)`` refuses it) and say so in the error the caller raises."""
    _QUARANTINE.append(buf if buf is not None else out)
    if into is not None:
        hub._quarantine.add(into, into, "a hung source may still write into it (a fetch's transfer never ended)")
    return FetchError(f"{e}; a hung source may still write into the destination"
                      + (": the `into` tensors are quarantined and must not be reused" if into is not None else ""))


def _select(manifest: Manifest, names: list[str], model: str, version: int) -> list[int]:
    """Indices (manifest order) of ``names``; the error names the first unknown one."""
    index = {t.name: i for i, t in enumerate(manifest.tensors)}
    missing = [n for n in names if n not in index]
    if missing:
        raise TensorMismatchError(f"{model!r} v{version} has no tensor {missing[0]!r} "
                                  f"({len(missing)} of the {len(names)} names asked for are unknown)")
    return sorted(index[n] for n in names)


def connect(url: Optional[str] = None, *, worker_id: Optional[str] = None,
            locality: Optional[Locality | str | Mapping[str, str]] = None, token: Optional[str] = None,
            **options: Any) -> Hub:
    """Connect to the coordinator at ``url`` (default: ``TENSORHUB_COORDINATOR``)."""
    return Hub(url, worker_id=worker_id, locality=locality, token=token, **options).connect()
