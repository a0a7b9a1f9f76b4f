"""This process as a worker of the coordinator: one :class:`Session` per Hub.

It owns the coordinator client, the worker's identity and locality, the data-plane
transport (started on first use, which registers its endpoint), the lease ttl and epoch
the coordinator answered, the heartbeat thread, and re-registration: when the coordinator
restarted (new epoch) or forgot this worker (404), the worker and every replica in
``holdings`` are registered again, and everything held then is fenced for one lease ttl
(docs/consistency.md, rule 4). Fetches, publishes and the Hub facade share it; it never
reaches back into them.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import random
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar
from urllib.parse import urlparse

from . import _addresses, _samehost as samehost
from ._client import CoordinatorClient
from ._exceptions import ConflictError, FetchError, HubClosedError, NotFoundError, ReadSlices, TensorHubError
from ._holdings import Held, Holdings, unregister_regions
from ._kept import KeptBy
from ._metrics import FetchProgress, Outbox, hub_metrics
from .protocol import (SLICED, HeartbeatAnswer, LeaseGrant, Manifest, ManifestLike, ReplicaRegistered, manifest_digest,
                       shape_digest)
from .transport import Transport, create_transport

if TYPE_CHECKING:  # pragma: no cover
    from .config import HubConfig

__all__ = ["Session", "data_host"]

T = TypeVar("T")

logger = logging.getLogger(__name__)

#: Manifests a Hub keeps (a 50,000-tensor manifest is a few MB of Python objects).
MANIFESTS_KEPT = 32


def data_host(coordinator_url: str) -> str:
    """The address our data plane advertises: loopback if the coordinator is, else the
    local address of the route towards it (no packet is sent). With several coordinator
    URLs the caller passes the first."""
    host = urlparse(coordinator_url).hostname or "127.0.0.1"
    try:
        if ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
            return "127.0.0.1"
    except (OSError, ValueError):
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(host), 9))
        return s.getsockname()[0]


class Session:
    """See the module docstring. ``holdings.lock`` is also this session's lock: a replica
    being unpublished is never announced again by a concurrent re-registration."""

    def __init__(self, config: "HubConfig", holdings: Holdings, *, transport: Optional[Transport]) -> None:
        self.config = config
        self.url = config.coordinator
        self.worker_id = config.worker_id
        self.locality = config.locality
        self.holdings = holdings
        self.heartbeat_interval = config.heartbeat_interval
        self.progress_timeout = config.progress_timeout
        self._token, self._ca_file = config.token, config.ca_file
        self._transport = transport
        self._transport_started = False
        self._api: Optional[CoordinatorClient] = None
        self.epoch: Optional[str] = None
        self.lease_ttl = 30.0
        #: Seconds a reported replica stays suspect at the coordinator (``_reader.Excluded``).
        self.suspect_ttl = 30.0
        #: Send and ask for addresses as runs (``_addresses``): the coordinator reads them
        #: (it said so when this worker registered) and ``HubConfig.address_runs`` allows it.
        self.address_runs = False
        #: Ask leases with their secret (``LeaseGrant.secret``, what same-host reads prove
        #: their lease with): the coordinator answers it and same-host reads are on.
        self.lease_secrets = False
        #: The coordinator answers ``AcquireLease.slices`` (``WorkerRegistered.slices_grant``).
        self.slices_grant = False
        #: The coordinator answers leases asked ahead (``server.ahead``).
        self.ahead = False
        #: The coordinator reads a manifest as an earlier version's (``RegisterReplica.like``).
        self.register_like = False
        #: (model, layout, shard) -> (version, shape digest) of this worker's newest publish
        #: of it with a full manifest in the coordinator's catalog: the next publish with the
        #: same tensors names it instead of sending its manifest (``ManifestLike``).
        self._published: dict[tuple[str, str, int], tuple[int, str]] = {}
        self.closed = False
        self._stop = threading.Event()
        self._hb: Optional[threading.Thread] = None
        self._outbox = Outbox(self)
        #: Manifests read, by (model, version, layout, shard), least recently used first.
        self._manifests: "OrderedDict[tuple, Manifest]" = OrderedDict()
        self._manifests_lock = threading.Lock()
        #: id(manifest) -> (manifest, its digest): registration by digest.
        self._digests = KeptBy(MANIFESTS_KEPT)  # manifest -> manifest_digest
        #: (epoch, served leases, served bytes) last answered on a heartbeat.
        self._served_seen: tuple[Optional[str], int, int] = (None, 0, 0)

    # ------------------------------------------------------------------ lifecycle
    def connect(self) -> None:
        self._api = CoordinatorClient(self.url, self._token, ca_file=self._ca_file)
        self.register_worker()
        self._hb = threading.Thread(target=self._heartbeat_loop, name=f"tensorhub-hb-{self.worker_id}", daemon=True)
        self._hb.start()

    def stop(self) -> None:
        """Stop heart-beating and reporting (the first half of ``Hub.close``)."""
        self.closed = True
        self._stop.set()
        if self._hb is not None:
            self._hb.join(timeout=5)
        self._outbox.close(timeout=2.0)

    def close_transport(self) -> None:
        if self._transport is not None and self._transport_started:
            self._transport.close()

    @property
    def api(self) -> CoordinatorClient:
        if self.closed:
            raise HubClosedError(f"Hub {self.worker_id} is closed")
        if self._api is None:
            raise HubClosedError("Hub is not connected; use tensorhub.connect(url)")
        return self._api

    def manifest(self, model: str, version: int, layout: str, shard: int) -> Manifest:
        """A shard's manifest, read once and kept (the first one registered is final, so a
        kept one is never stale): leases do not carry it."""
        key = (model, version, layout, shard)
        with self._manifests_lock:
            hit = self._manifests.get(key)
            if hit is not None:
                self._manifests.move_to_end(key)
                return hit
        m = self.api.manifest(model, version, layout, shard)
        with self._manifests_lock:
            self._manifests[key] = m
            while len(self._manifests) > MANIFESTS_KEPT:
                self._manifests.popitem(last=False)
        return m

    @property
    def transport_started(self) -> bool:
        return self._transport_started

    def transport(self) -> Transport:
        """The data plane, started (and its endpoint registered) on first use. A start that
        fails raises here, from the first publish, fetch or borrow, and again at every later
        use: e.g. the same-host socket name taken by another process (``transport/_shm``,
        :class:`TransferError` naming that process and ``TENSORHUB_SAMEHOST=0``)."""
        with self.holdings.lock:
            if self._transport is None:
                cfg = self.config
                host = cfg.data_host or data_host(self.url.split(",")[0])
                self._transport = create_transport(cfg.transport_kind, host=host, progress_timeout=self.progress_timeout,
                                                   protocol=cfg.mooncake_protocol, devices=cfg.mooncake_devices)
                self._transport = samehost.wrap(self._transport, self)  # same-host reads (issue #14)
            if not self._transport_started:
                self._transport.start()
                self._transport_started = True
                self.register_worker()
            return self._transport

    # ------------------------------------------------------------------ registration
    def register_worker(self, retry_timeout: Optional[float] = None) -> None:
        endpoint = self._transport.endpoint if self._transport_started and self._transport else ""
        r = self.api.register_worker(self.worker_id, endpoint, self.locality.model_dump(),
                                     retry_timeout=retry_timeout)
        self.epoch = r.epoch
        self.lease_ttl = r.lease_ttl
        self.suspect_ttl = r.suspect_ttl if r.suspect_ttl is not None else 30.0
        self.address_runs = r.address_runs and self.config.address_runs
        self.lease_secrets = r.lease_secrets and self.config.samehost
        self.ahead = r.ahead and self.address_runs  # (held requests stay small: offers as runs)
        self.register_like = r.register_like and self.config.register_like
        self.slices_grant = r.slices_grant

    def reregister(self) -> None:
        """Register the worker and every held replica again, under the holdings' lock, with
        a short retry budget: a coordinator still down must not stall fetches for long."""
        budget = max(1.0, 2 * self.heartbeat_interval)
        # Leases on what we held may still run (granted before the restart, or renewed on
        # our tombstones): overwriting any of it waits one more lease ttl.
        self.holdings.fence_all(time.monotonic() + self.lease_ttl)
        try:
            with self.holdings.lock:
                self.register_worker(retry_timeout=budget)
                for h in self.holdings.announced():
                    self.api.allocate_version(h.model, h.version, retry_timeout=budget)
                    h.replica_id = self.api.register_replica(self.replica_body(h), retry_timeout=budget).replica_id
        except TensorHubError as e:
            logger.warning("re-registration failed (will retry): %s", e)

    def as_worker(self, call: Callable[[CoordinatorClient], T]) -> T:
        """A worker-scoped call (``call(api)``); if the coordinator forgot us (it restarted),
        register again (with every held replica) and retry once."""
        try:
            return call(self.api)
        except NotFoundError as e:
            if e.code != "unknown_worker":
                raise
            logger.warning("coordinator forgot worker %s; re-registering", self.worker_id)
            self.reregister()
            return call(self.api)

    def register_replica(self, h: Held, *, publish: bool = False, **extra: Any) -> str:
        """Announce a held replica (``extra``: e.g. ``partial=True`` and its chunk grid).
        ``publish``: ``h`` is a new version this worker publishes; if it has the tensors of
        the version this worker published before (model trained in place), it is sent as
        that version's tensors with its own sums (``ManifestLike``: no manifest to send,
        parse and validate), else, or if the coordinator no longer knows that version, with
        its manifest."""
        self.api.allocate_version(h.model, h.version)
        like = self._like(h) if publish and not extra else None
        if like is not None:
            body = dict(self.replica_body(h, like=like))
            try:
                rid = self.as_worker(lambda api: api.register_replica(body)).replica_id
                # the next one names this one: the newest version, the last the coordinator retires
                self._published[(h.model, h.layout, h.shard)] = (h.version, like.shape_digest)
                return rid
            except ConflictError as e:
                if e.code not in ("like_unknown", "like_mismatch"):
                    raise
                logger.info("%s v%d: the coordinator cannot make its manifest from v%d's (%s); sending it",
                            h.model, h.version, like.version, e.code)
                self._published.pop((h.model, h.layout, h.shard), None)
        body = dict(self.replica_body(h), **extra)
        rid = self.as_worker(lambda api: api.register_replica(body)).replica_id
        if publish and not extra and self.register_like and h.manifest.slices is None:
            self._published[(h.model, h.layout, h.shard)] = (h.version, shape_digest(h.manifest))
        return rid

    def _like(self, h: Held) -> Optional[ManifestLike]:
        """``h``'s manifest as the earlier version's this worker published (None: none, or
        other tensors)."""
        hit = self._published.get((h.model, h.layout, h.shard))
        if not self.register_like or hit is None or hit[0] >= h.version or h.manifest.slices is not None:
            return None
        if shape_digest(h.manifest) != hit[1]:
            return None
        m = h.manifest
        return ManifestLike(version=hit[0], shape_digest=hit[1], checksum=m.checksum, checksums=m.checksums,
                            meta=m.meta)

    def register_read(self, h: Held, *, release: Optional[list[str]] = None, **extra: Any) -> ReplicaRegistered:
        """Announce a replica this worker read (the version and its manifest are known to
        the coordinator: no allocation, the manifest by digest). ``release``: the read's
        leases, released in the same call (the replica is registered only if all stayed
        valid; the answer's ``released`` says which)."""
        body = dict(self.replica_body(h, digest=True), **extra)
        if release:
            body["release"] = list(release)
        return self.as_worker(lambda api: api.register_replica(body))

    def digest(self, m: Manifest) -> str:
        """``manifest_digest(m)``, computed once per manifest object kept."""
        return self._digests.get(m, lambda: manifest_digest(m))

    def replica_body(self, h: Held, digest: bool = False, like: Optional[ManifestLike] = None) -> dict:
        body = {
            "worker_id": self.worker_id, "model": h.model, "version": h.version, "layout": h.layout,
            "shard": h.shard, "num_shards": h.num_shards, **self.addresses_of(h),
        }
        if like is not None:
            body["like"] = like.model_dump(mode="json", exclude_none=True)
        elif digest:
            body["manifest_digest"] = self.digest(h.manifest)
        else:
            body["manifest"] = h.manifest.model_dump(mode="json")
        return body

    def addresses_of(self, h: Held) -> dict:
        """A held replica's addresses as the registration fields: ``address_runs`` when the
        coordinator reads runs and they are much shorter, else ``addresses`` (encoded once
        per held replica)."""
        if not self.address_runs:
            return {"addresses": h.addresses}
        if h.runs is None or h.runs[0] is not h.addresses:
            h.runs = (h.addresses, _addresses.encode(h.addresses, h.manifest))
        runs = h.runs[1]
        return {"addresses": h.addresses} if runs is None else {"address_runs": runs.model_dump(mode="json")}

    def keep_manifest(self, model: str, version: int, layout: str, shard: int, m: Manifest) -> Manifest:
        """Keep ``m`` as that shard's manifest (made here: a lease asked ahead, ``VersionSums``),
        as if read (the first one kept stays)."""
        key = (model, version, layout, shard)
        with self._manifests_lock:
            m = self._manifests.setdefault(key, m)
            while len(self._manifests) > MANIFESTS_KEPT:
                self._manifests.popitem(last=False)
        return m

    def lease(self, body: dict, shaped: Optional[Manifest] = None, **kw: Any) -> LeaseGrant:
        """``POST /v1/leases`` (``body``: the ``AcquireLease`` fields) as this worker, asking
        for sources' addresses as runs when the coordinator has them; the grant comes back
        with every source's addresses expanded (against the shard's manifest, read once).
        Asked ahead (``wait=`` in ``kw``): None when nothing was published meanwhile; a grant
        with the version's checksums (``sums``) makes its manifest from ``shaped`` (the
        tensors this reader offered), kept as if read."""
        if self.address_runs:
            body = dict(body, address_runs=True)
        if self.lease_secrets:
            body = dict(body, lease_secret=True)
        if body.get("slices") and not self.slices_grant:
            body = {k: v for k, v in body.items() if k != "slices"}  # an older coordinator refuses instead
        try:
            g = self.as_worker(lambda api: api.acquire_lease(body, **kw))
        except ConflictError as e:
            if e.code == "read_slices":
                raise ReadSlices(e.message) from e
            raise
        if g is None:  # asked ahead, nothing published within the wait
            return None
        if g.layout == SLICED and body.get("layout") != SLICED:
            raise ReadSlices(f"{g.model!r} v{g.version} was published as slices ({g.num_shards} shards of layout "
                             f"{SLICED!r}) and no assembled copy serves: read the slices", g.num_shards)
        if g.sums is not None and shaped is not None:
            self.keep_manifest(g.model, g.version, g.layout, g.shard, g.sums.manifest(shaped))
        try:
            return _addresses.expand_grant(g, lambda: self.manifest(g.model, g.version, g.layout, g.shard))
        except ValueError as e:
            raise FetchError(f"lease {g.lease_id}: a source's address runs do not fit the manifest: {e}") from None

    # ------------------------------------------------------------------ heartbeat, telemetry
    def _heartbeat_loop(self) -> None:
        # Jittered: after a coordinator restart a fleet does not heartbeat in step.
        while not self._stop.wait(self.heartbeat_interval * (0.9 + 0.2 * random.random())):
            try:
                fetches = self._outbox.take_fetches()  # progress rides on the heartbeat
                try:
                    r = self.api.heartbeat(self.worker_id, fetches=fetches, retry_timeout=self.heartbeat_interval)
                except TensorHubError:
                    for body in fetches:  # not delivered: posted on their own (best effort)
                        self._outbox.put("fetch", body, post=True)
                    raise
                if fetches and r.fetches is None:  # an older coordinator ignored them
                    for body in fetches:
                        self._outbox.put("fetch", body, post=True)
                self._count_served(r)
                q = self.holdings.quarantine
                if len(q) and self._transport is not None:
                    q.retry(lambda regions: unregister_regions(self._transport, regions))
                if r.epoch != self.epoch:
                    logger.warning("coordinator restarted (epoch %s -> %s); re-registering", self.epoch, r.epoch)
                    self.reregister()
            except NotFoundError:
                logger.warning("coordinator forgot worker %s; re-registering its replicas", self.worker_id)
                self.reregister()
            except HubClosedError:
                return
            except TensorHubError as e:
                logger.warning("heartbeat to %s failed: %s", self.url, e)
            except Exception:  # pragma: no cover - never let the thread die
                logger.exception("heartbeat failed")

    def _count_served(self, answer: HeartbeatAnswer) -> None:
        """Turn the coordinator's totals of what this worker served (since it started, or
        since it re-registered us) into this process's ``served`` counter increments."""
        if answer.served_bytes is None or answer.served_leases is None:
            return  # an older coordinator
        epoch, leases, nbytes = answer.epoch, answer.served_leases, answer.served_bytes
        seen_epoch, seen_leases, seen_bytes = self._served_seen
        if epoch != seen_epoch or leases < seen_leases or nbytes < seen_bytes:
            seen_leases = seen_bytes = 0  # the coordinator counts afresh
        m = hub_metrics()
        if leases > seen_leases:
            m.served_leases.inc(leases - seen_leases)
        if nbytes > seen_bytes:
            m.served_bytes.inc(nbytes - seen_bytes)
        self._served_seen = (epoch, leases, nbytes)

    def report(self, kind: str, body: dict) -> None:
        """Send telemetry (``fetch`` or ``swap``) in the background (best effort)."""
        self._outbox.put(kind, body)

    def _fetch_report(self, p: FetchProgress, state: str) -> dict:
        return {"worker_id": self.worker_id, "model": p.model, "version": p.version, "layout": p.layout,
                "shard": p.shard, "state": state, "nbytes": p.nbytes, "total": p.total,
                "seconds": round(p.seconds, 6), "sources": dict(list(p.sources.items())[:1024]),
                "failed_sources": p.failed_sources}
