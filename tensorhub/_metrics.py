"""Metrics (Prometheus, through ``prometheus_client``) and fetch progress.

Two sets of metrics, two places:

* **The coordinator's** (:class:`CoordinatorMetrics`, served at its ``/metrics``): the
  fleet as the coordinator sees it. Gauges read from the state machine at each scrape
  (``CoordinatorState.metrics_view``); counters fed by what workers report: each
  finished fetch (``POST /v1/fetches``), each failing source (``POST .../report``), each
  engine swap (``POST /v1/swaps``), each lease granted. A registry of its own, so an
  embedded coordinator never mixes with its host process's metrics.
* **Each Hub process's** (:class:`HubMetrics`, names ``tensorhub_hub_*``): this process's
  fetches, failures, held replicas, what it served (the coordinator's count, answered on
  heartbeats: a source does no work per one-sided read, so only readers know). Registered
  in ``prometheus_client``'s default registry on first use, so a process that already
  serves ``/metrics`` from it shows them. vLLM: its API server serves ``/metrics`` but the
  workers that fetch run in other processes; start vLLM with ``PROMETHEUS_MULTIPROC_DIR``
  set to an empty directory and vLLM's ``/metrics`` aggregates every process's metrics
  (counters and histograms summed, the held gauges summed over live processes). Other
  processes (a trainer): :func:`start_metrics_server`.

Progress: a fetch calls :class:`ProgressReporter` from its polling loop; once the fetch
has run ``TENSORHUB_PROGRESS_INTERVAL`` seconds (1), and then every as many, it hands a
:class:`FetchProgress` to the caller's callback (the CLI draws it), else logs it. Library
code never draws.

Label sets are bounded: ``model`` (only models the coordinator knows are counted),
``outcome``, ``distance`` and replica ``state`` take a few values; worker ids and
versions are never labels (workers churn, versions grow every step).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

__all__ = [
    "CoordinatorMetrics",
    "FetchProgress",
    "HubMetrics",
    "Outbox",
    "ProgressReporter",
    "Track",
    "hub_metrics",
    "start_metrics_server",
]

logger = logging.getLogger(__name__)

#: GB/s of single fetches (histogram buckets).
GBPS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0)
#: Seconds of fetches and of swap stalls (histogram buckets).
SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)


class CoordinatorMetrics:
    """The coordinator's metrics; one per :class:`~tensorhub.coordinator.Coordinator`.

    ``view`` returns ``CoordinatorState.metrics_view(now)`` (taken under the coordinator's
    lock); the counters are fed by the HTTP shell."""

    def __init__(self, view: Callable[[], dict], start_time: float) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.fetches = Counter("tensorhub_fetches", "Fetches readers reported, by outcome (ok, failed).",
                               ["model", "outcome"], registry=r)
        self.fetch_bytes = Counter(
            "tensorhub_fetch_bytes", "Bytes readers reported reading, by distance from reader to source "
            "(same_host, same_zone, same_datacenter, other_datacenter, unknown).", ["model", "distance"],
            registry=r)
        self.fetch_seconds = Histogram("tensorhub_fetch_seconds", "Duration of finished fetches (seconds).",
                                       ["model"], buckets=SECONDS_BUCKETS, registry=r)
        self.fetch_gbps = Histogram("tensorhub_fetch_gbps", "Throughput of finished fetches (GB/s).",
                                    ["model"], buckets=GBPS_BUCKETS, registry=r)
        self.source_failures = Counter("tensorhub_source_failures",
                                       "Replicas readers reported failing (dead, hung, refused).", ["model"],
                                       registry=r)
        self.leases_granted = Counter("tensorhub_leases_granted", "Read leases granted.", ["model"], registry=r)
        self.registrations = Counter("tensorhub_replica_registrations", "Complete replicas registered, by how "
                                     "their manifest came: manifest (sent whole), like (an earlier version's "
                                     "tensors, this one's sums: RegisterReplica.like), digest (known already).",
                                     ["model", "manifest"], registry=r)
        self.requests = Counter("tensorhub_requests", "HTTP requests answered, by route (method and path "
                                "template; at most 64 routes, the rest counted as 'other').", ["route"], registry=r)
        self._routes: dict[str, Any] = {}
        self._known: Optional[set[str]] = None  # the app's routes (``known_routes``); None: any
        self.swap_stall = Histogram("tensorhub_swap_stall_seconds",
                                    "Engine stalls while switching weight versions (seconds), as engines report.",
                                    ["model"], buckets=SECONDS_BUCKETS, registry=r)
        self.swaps = Counter("tensorhub_swaps", "Engine swaps reported, by outcome.", ["model", "outcome"],
                             registry=r)
        start = Gauge("tensorhub_coordinator_start_time_seconds",
                      "When this coordinator process started (Unix time; changes on restart).", registry=r)
        start.set(start_time)
        r.register(_StateCollector(view))

    def request(self, method: str, path: str) -> None:
        """Count one HTTP request (the shell calls it for authenticated ones only) under its
        route (``POST /v1/leases/{id}/renew``). Only the app's own routes get a label
        (:meth:`known_routes`); any other method and path counts as ``other``, so requests
        cannot make label values up."""
        route = _route(method, path)
        c = self._routes.get(route)
        if c is None:
            if (self._known is not None and route not in self._known) or len(self._routes) >= 64:
                route = "other"
            c = self._routes.setdefault(route, self.requests.labels(route))
        c.inc()

    def known_routes(self, routes: Iterable[tuple[str, str]]) -> None:
        """The app's routes, ``(method, path template)`` as declared (``/v1/leases/{lease_id}``):
        the only label values :meth:`request` gives."""
        self._known = {_route(m, p) for m, p in routes}

    def track_election(self, election: Any) -> None:
        """Highly available coordinators (``server.election.Election``): its role and counts."""
        self.registry.register(_ElectionCollector(election))

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    # fed by the HTTP shell
    def fetch(self, model: str, outcome: str, by_distance: dict[str, int], nbytes: int, seconds: float) -> None:
        self.fetches.labels(model, outcome).inc()
        for d, n in by_distance.items():
            self.fetch_bytes.labels(model, d).inc(n)
        if outcome == "ok" and nbytes > 0 and seconds > 0:
            self.fetch_seconds.labels(model).observe(seconds)
            self.fetch_gbps.labels(model).observe(nbytes / seconds / 1e9)

    def swap(self, model: str, stall: float, ok: bool) -> None:
        self.swaps.labels(model, "ok" if ok else "failed").inc()
        if ok:
            self.swap_stall.labels(model).observe(stall)


class _ElectionCollector:
    """Role, elections and failovers of one coordinator process (read at scrape time)."""

    def __init__(self, election: Any) -> None:
        self.election = election

    def describe(self) -> list:
        return []

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        e = self.election
        leader = GaugeMetricFamily("tensorhub_coordinator_leader",
                                   "1 while this coordinator leads, 0 while it follows (etcd store).")
        leader.add_metric([], 1.0 if e.leading() else 0.0)
        won = CounterMetricFamily("tensorhub_coordinator_elections",
                                  "Elections this coordinator process won.")
        won.add_metric([], e.won)
        lost = CounterMetricFamily("tensorhub_coordinator_step_downs",
                                   "Times this coordinator stepped down (lease lapsed, commit refused, stop).")
        lost.add_metric([], e.lost)
        changes = CounterMetricFamily("tensorhub_coordinator_failovers",
                                      "Leader changes this coordinator process saw (including its own elections).")
        changes.add_metric([], e.changes)
        yield from (leader, won, lost, changes)


_IDS = re.compile(r"/(workers|replicas|leases)/[^/]+")
_MODELS = re.compile(r"/models/[^/]+")
_VERSIONS = re.compile(r"/versions/[^/]+")


def _route(method: str, path: str) -> str:
    """``POST /v1/workers/w1/heartbeat`` -> ``POST /v1/workers/{id}/heartbeat``."""
    p = _VERSIONS.sub("/versions/{version}", _MODELS.sub("/models/{model}", _IDS.sub(r"/\1/{id}", path)))
    return f"{method} {p[:96]}"


class _StateCollector:
    """Gauges read from the state machine at scrape time."""

    def __init__(self, view: Callable[[], dict]) -> None:
        self.view = view

    def describe(self) -> list:
        return []  # names are only known at collect time; nothing to check for clashes

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        v = self.view()
        workers = GaugeMetricFamily("tensorhub_workers", "Workers registered (heart-beating).")
        workers.add_metric([], v["workers"])
        latest = GaugeMetricFamily("tensorhub_latest_version", "Newest complete version (absent: none yet).",
                                   labels=["model"])
        counter = GaugeMetricFamily("tensorhub_version_counter", "Highest version number handed out.",
                                    labels=["model"])
        held = GaugeMetricFamily("tensorhub_versions_held", "Versions with at least one serving complete replica.",
                                 labels=["model"])
        replicas = GaugeMetricFamily("tensorhub_replicas",
                                     "Replicas by state (serving, partial: still receiving, suspect, draining, "
                                     "fenced: a dropped worker's replica that leases still name).",
                                     labels=["model", "state"])
        nbytes = GaugeMetricFamily("tensorhub_replica_bytes", "Bytes held by serving complete replicas.",
                                   labels=["model"])
        leases = GaugeMetricFamily("tensorhub_leases_open", "Read leases open now.", labels=["model"])
        for name, m in sorted(v["models"].items()):
            if m["latest"] is not None:
                latest.add_metric([name], m["latest"])
            counter.add_metric([name], m["counter"])
            held.add_metric([name], m["held_versions"])
            for state, n in m["replicas"].items():
                replicas.add_metric([name, state], n)
            nbytes.add_metric([name], m["bytes"])
            leases.add_metric([name], m["leases"])
        pauses = CounterMetricFamily(
            "tensorhub_pause_grace", "Times the coordinator saw a gap with no call longer than its pause grace "
            "(paused or starved) and gave every worker a fresh worker_ttl instead of expiring them.")
        pauses.add_metric([], v.get("pauses", 0))
        return [workers, latest, counter, held, replicas, nbytes, leases, pauses]


class HubMetrics:
    """This process's Hub metrics (every Hub of the process adds to the same series).

    Created on first use by :func:`hub_metrics`, in ``prometheus_client``'s default
    registry (or ``PROMETHEUS_MULTIPROC_DIR``'s files when that is set)."""

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import REGISTRY, Counter, Gauge, Histogram

        r = REGISTRY if registry is None else registry
        self.fetches = Counter("tensorhub_hub_fetches", "Fetches by this process, by outcome (ok, failed).",
                               ["model", "outcome"], registry=r)
        self.fetch_bytes = Counter("tensorhub_hub_fetch_bytes", "Bytes this process read from other workers.",
                                   ["model"], registry=r)
        self.fetch_seconds = Histogram("tensorhub_hub_fetch_seconds", "Duration of this process's fetches (seconds).",
                                       ["model"], buckets=SECONDS_BUCKETS, registry=r)
        self.source_failures = Counter("tensorhub_hub_source_failures",
                                       "Sources that failed during this process's fetches.", ["model"], registry=r)
        self.served_bytes = Counter("tensorhub_hub_served_bytes",
                                    "Bytes other workers reported reading from this process (the coordinator's "
                                    "count, updated on heartbeats).", registry=r)
        self.served_leases = Counter("tensorhub_hub_served_leases",
                                     "Read leases naming this process's replicas (updated on heartbeats).",
                                     registry=r)
        self.held_replicas = Gauge("tensorhub_hub_held_replicas", "Replicas this process holds and serves.",
                                   ["model"], registry=r, multiprocess_mode="livesum")
        self.held_bytes = Gauge("tensorhub_hub_held_bytes", "Bytes this process holds and serves.",
                                ["model"], registry=r, multiprocess_mode="livesum")
        self.swap_stall = Histogram("tensorhub_hub_swap_stall_seconds",
                                    "This engine's stalls while switching weight versions (seconds).",
                                    ["model"], buckets=SECONDS_BUCKETS, registry=r)

    def fetched(self, model: str, outcome: str, nbytes: int, seconds: float, failed_sources: int) -> None:
        self.fetches.labels(model, outcome).inc()
        if nbytes:
            self.fetch_bytes.labels(model).inc(nbytes)
        if outcome == "ok" and nbytes:
            self.fetch_seconds.labels(model).observe(seconds)
        if failed_sources:
            self.source_failures.labels(model).inc(failed_sources)

    def held(self, by_model: dict[str, tuple[int, int]], known: set[str]) -> None:
        """Set the held gauges: ``by_model`` model -> (replicas, bytes); models in ``known``
        but not in ``by_model`` drop to 0."""
        for m in known | set(by_model):
            n, b = by_model.get(m, (0, 0))
            self.held_replicas.labels(m).set(n)
            self.held_bytes.labels(m).set(b)


_HUB_METRICS: Optional[HubMetrics] = None
_HUB_LOCK = threading.Lock()


def hub_metrics() -> HubMetrics:
    """The process's :class:`HubMetrics`, created (and registered) on first call."""
    global _HUB_METRICS
    with _HUB_LOCK:
        if _HUB_METRICS is None:
            _HUB_METRICS = HubMetrics()
        return _HUB_METRICS


def start_metrics_server(port: int = 0, addr: str = "127.0.0.1") -> tuple[str, Any]:
    """Serve this process's metrics (``prometheus_client``'s default registry, which holds
    the ``tensorhub_hub_*`` metrics; or ``PROMETHEUS_MULTIPROC_DIR``'s aggregate when that
    is set) at ``http://ADDR:PORT/metrics`` on a daemon thread. For processes that serve no
    ``/metrics`` of their own (a trainer); vLLM serves its own (module docstring).
    ``port=0`` picks a free port. Returns (URL, server); ``server.shutdown()`` stops it.
    No authentication: bind to an address only your scraper reaches."""
    import os

    from prometheus_client import REGISTRY, CollectorRegistry, start_http_server

    hub_metrics()
    registry: Any = REGISTRY
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    server, _ = start_http_server(port, addr=addr, registry=registry)
    host = f"[{addr}]" if ":" in addr else addr
    return f"http://{host}:{server.server_port}/metrics", server


@dataclass(frozen=True)
class FetchProgress:
    """A running fetch, as handed to ``fetch(..., progress=callback)`` about once a second.

    ``nbytes`` read of ``total``; ``seconds`` since the read started; ``sources``: worker id
    -> bytes read from it; ``failed_sources``: how many failed so far. ``done`` is set on the
    last call (the fetch ended, well or not)."""

    model: str
    version: int
    layout: str
    shard: int
    nbytes: int
    total: int
    seconds: float
    sources: dict[str, int] = field(default_factory=dict)
    failed_sources: int = 0
    done: bool = False

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def line(self) -> str:
        """One line: ``policy v3: 1.2/2.5 GB (48%) 1.10 GB/s from w1 0.8 GB, w2 0.4 GB``."""
        pct = f" ({100 * self.nbytes / self.total:.0f}%)" if self.total else ""
        src = ", ".join(f"{w} {_gb(n)}" for w, n in sorted(self.sources.items(), key=lambda kv: -kv[1])[:4])
        more = f" +{len(self.sources) - 4} more" if len(self.sources) > 4 else ""
        failed = f"; {self.failed_sources} source(s) failed" if self.failed_sources else ""
        return (f"{self.model} v{self.version}: {_gb(self.nbytes)}/{_gb(self.total)}{pct} in {self.seconds:.1f}s, "
                f"{self.gbps:.2f} GB/s" + (f" from {src}{more}" if src else "") + failed)


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


class ProgressReporter:
    """One fetch's progress; the fetch's polling loop calls ``tick(stats)`` (``stats``: the
    reader's live ``ReadStats``), ``attempt_done()`` after each attempt, ``finish()`` at the end.

    After ``after`` seconds, then every ``interval`` seconds, it builds a
    :class:`FetchProgress` and hands it to ``callback`` if given, else logs it at INFO;
    ``on_report`` (the Hub's report to the coordinator) gets it too. ``interval <= 0``:
    silent (counts are still kept)."""

    def __init__(self, model: str, version: int, layout: str, shard: int, total: int, *,
                 callback: Optional[Callable[[FetchProgress], None]] = None,
                 on_report: Optional[Callable[[FetchProgress], None]] = None,
                 interval: float = 1.0, after: float = 1.0, worker_id: str = "") -> None:
        self.key = (model, version, layout, shard)
        self.total = total
        self.callback, self.on_report = callback, on_report
        self.interval, self.worker_id = interval, worker_id
        self.t0 = time.monotonic()
        self.next = self.t0 + after
        self.shown = False
        self.stats: Any = None
        #: Bytes and sources of earlier attempts (lapsed leases) of the same fetch.
        self.base_bytes = 0
        self.base_sources: dict[str, int] = {}
        self.base_failed = 0

    def snapshot(self, done: bool = False) -> FetchProgress:
        sources = dict(self.base_sources)
        nbytes, failed = self.base_bytes, self.base_failed
        if self.stats is not None:
            nbytes += self.stats.nbytes
            failed += len(self.stats.failed_sources)
            for w, n in list(self.stats.bytes_by_source.items()):
                sources[w] = sources.get(w, 0) + n
        return FetchProgress(*self.key, nbytes=nbytes, total=self.total, seconds=time.monotonic() - self.t0,
                             sources=sources, failed_sources=failed, done=done)

    def tick(self, stats: Any) -> None:
        self.stats = stats
        if self.interval <= 0:
            return
        now = time.monotonic()
        if now < self.next:
            return
        self.next = now + self.interval
        self._emit(self.snapshot())

    def attempt_done(self) -> None:
        """An attempt ended (its leases released): later ticks add to its counts."""
        p = self.snapshot()
        self.base_bytes, self.base_sources, self.base_failed = p.nbytes, p.sources, p.failed_sources
        self.stats = None

    def finish(self) -> FetchProgress:
        """The fetch ended: the last progress (to the callback too, if it was shown)."""
        p = self.snapshot(done=True)
        if self.shown:
            self._emit(p)
        return p

    def _emit(self, p: FetchProgress) -> None:
        self.shown = True
        for fn in (self.callback, self.on_report):
            if fn is None:
                continue
            try:
                fn(p)
            except Exception:  # a progress consumer never breaks the fetch
                logger.debug("progress callback failed", exc_info=True)
        if self.callback is None and not p.done:
            logger.info("fetching %s (worker %s)", p.line(), self.worker_id)


class Track:
    """One fetch's bookkeeping between ``Hub.fetch`` and the read path that runs it."""

    def __init__(self, callback: Optional[Callable[[FetchProgress], None]]) -> None:
        self.callback = callback
        self.version: Optional[int] = None
        self.reporter: Optional[ProgressReporter] = None

    def start(self, hub: Any, model: str, version: int, layout: str, shard: int, total: int) -> ProgressReporter:
        """The lease is in (the size is known): progress starts here."""
        self.version = version

        def to_coordinator(p: FetchProgress) -> None:
            if not p.done:
                hub._outbox.put("fetch", hub._fetch_report(p, "running"))

        every = hub.config.progress_interval  # also the delay before the first report
        self.reporter = ProgressReporter(model, version, layout, shard, total, callback=self.callback,
                                         on_report=to_coordinator, interval=every, after=every,
                                         worker_id=hub.worker_id)
        return self.reporter


class Outbox:
    """Reports to the coordinator (fetches, swaps), so that telemetry never delays or fails
    the caller; at most ``limit`` wait (older ones drop). Fetch reports ride on the next
    heartbeat (``take_fetches``: no call of their own); the rest, and fetch reports an
    older coordinator did not take from a heartbeat, are posted by a background thread."""

    def __init__(self, hub: Any, limit: int = 256) -> None:
        self.hub = hub
        self.queue: deque = deque(maxlen=limit)
        #: Fetch reports waiting for the next heartbeat (a heartbeat carries at most 64).
        self.beats: deque = deque(maxlen=64)
        self.wake = threading.Event()
        self.stop = threading.Event()
        self.thread: Optional[threading.Thread] = None
        self.lock = threading.Lock()

    def put(self, kind: str, body: dict, *, post: bool = False) -> None:
        with self.lock:
            if self.stop.is_set():
                return
            if kind == "fetch" and not post:
                self.beats.append(body)
                return
            self.queue.append((kind, body))
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name=f"tensorhub-report-{self.hub.worker_id}",
                                               daemon=True)
                self.thread.start()
        self.wake.set()

    def take_fetches(self) -> list[dict]:
        """The fetch reports for this heartbeat (the heartbeat thread; it posts them back
        with ``put(..., post=True)`` if the coordinator did not take them)."""
        with self.lock:
            out = list(self.beats)
            self.beats.clear()
        return out

    def _run(self) -> None:
        while True:
            self.wake.wait(1.0)
            self.wake.clear()
            while self.queue:
                try:
                    kind, body = self.queue.popleft()
                except IndexError:
                    break
                try:
                    self.hub._api.report(kind, body, retry_timeout=1.0, timeout=5.0)  # type: ignore[union-attr]
                except Exception as e:  # best effort: an old coordinator, an outage, an unknown model
                    logger.debug("worker %s: report %s not delivered: %s", self.hub.worker_id, kind, e)
            with self.lock:
                if self.stop.is_set() and not self.queue:
                    return

    def close(self, timeout: float = 2.0) -> None:
        """Deliver what is queued (up to ``timeout``), then stop."""
        for body in self.take_fetches():  # no heartbeat will carry them any more
            self.put("fetch", body, post=True)
        with self.lock:
            self.stop.set()
            t = self.thread
        if t is not None:
            self.wake.set()
            t.join(timeout)
