"""The Hub client: what a trainer or an engine process uses.

``hub = tensorhub.connect(url)`` registers this process as a worker (no data plane yet;
the transport starts on the first publish or fetch). A heartbeat thread keeps the
worker's replicas alive; when the coordinator restarts (new epoch, or "unknown worker")
it re-registers the worker and every replica it holds, by itself.

Who calls what:

* holder (trainer, engine): ``publish`` registers tensors in place; they must stay
  untouched until ``unpublish`` returns (that is when no reader holds a lease on them).
* reader (engine): ``latest`` / ``wait_for_version`` / ``fetch``; with ``serve=True`` a
  fetched shard becomes one more replica (the reader is then a holder of it). A reader that
  follows a model calls ``fetch_next(model, after=v)``: the next version's lease is asked
  ahead, so it reads the moment that version is published, inside its distribution plan.
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

import logging
import time
import weakref
from typing import Any, Callable, Iterable, Mapping, Optional

from . import _borrow, _delta_path, _holder, _lora, _next, _sliced, _tensors
from ._borrow import Borrowed
from ._client import CoordinatorClient
from ._exceptions import (
    ConfigError, HubClosedError, NotFoundError, HubTimeoutError, ReadSlices, TensorHubError,
)
from ._fencing import LeaseClock, Quarantine
from ._retry import jittered
from ._fetch import Fetch, FetchOptions, Fetched, copy_held
from ._sources import RELEASE_GRACE as _RELEASE_GRACE, acquire_lease, release_checked, release_lease
from ._sources import QUARANTINE as _QUARANTINE  # noqa: F401 (tests use _QUARANTINE)
from ._holdings import Holdings
from ._metrics import FetchProgress, Track, hub_metrics
from ._session import Session
from .config import HubConfig, parse_locality
from .protocol import DELTA_PREFIX, LeaseGrant, Locality, TensorSpec, VersionMeta, VersionView, is_delta_layout
from .transport import Transport

__all__ = ["Hub", "Fetched", "connect", "parse_locality"]

logger = logging.getLogger(__name__)


def _option(name: str) -> property:
    """A Hub setting that may change on a live Hub (``hub.pipelined = False``): the
    config is replaced (and checked again)."""
    return property(lambda self: getattr(self.config, name),
                    lambda self, value: setattr(self, "config", self.config.replace(**{name: value})))


class Hub:
    """A connection to a coordinator; see the module docstring for the lifecycle. A facade:
    the worker's session (``_session``), what it holds (``_holdings``), the holder calls
    (``_holder``) and one read path (``_fetch.Fetch``) do the work."""

    def __init__(self, url: Optional[str] = None, *, config: Optional[HubConfig] = None,
                 transport: Optional[Transport | str] = None, **options: Any) -> None:
        """``config``: a resolved :class:`~tensorhub.config.HubConfig`; else one is
        resolved from ``url`` and ``options`` (its field names: worker_id, locality, token,
        ca_file, heartbeat_interval, progress_timeout, chunk_bytes, max_sources, pipelined,
        checksum, retain_on_cpu, fetch_timeout, progress_interval, transport_kind, data_host,
        mooncake_protocol, mooncake_devices, samehost, samehost_vm, address_runs,
        register_like), each argument > environment > default. ``transport``: a transport
        object to use, or the name of one (``"mooncake"``, ``"memory"``: ``transport_kind``)."""
        if isinstance(transport, str):
            options["transport_kind"], transport = transport, None
        if config is None:
            config = HubConfig.resolve(url, **options)
        elif url is not None or options:
            raise ConfigError("pass either config= or url and options, not both")
        self.config = config
        self._holdings = Holdings()
        self._session = Session(config, self._holdings, transport=transport)
        self._closed = False

    # The settings, read from (and, for the few that may change on a live Hub, written
    # to) the one config object.
    url = property(lambda self: self.config.coordinator)
    worker_id = property(lambda self: self.config.worker_id)
    locality = property(lambda self: self.config.locality)
    heartbeat_interval = property(lambda self: self.config.heartbeat_interval)
    progress_timeout = property(lambda self: self.config.progress_timeout)
    chunk_bytes = _option("chunk_bytes")
    max_sources = _option("max_sources")
    pipelined = _option("pipelined")
    checksum = _option("checksum")
    fetch_timeout = _option("fetch_timeout")
    retain_on_cpu = _option("retain_on_cpu")

    # ------------------------------------------------------------------ lifecycle
    def connect(self) -> "Hub":
        """Register with the coordinator and start heart-beating. Called by ``tensorhub.connect``."""
        self._check_open()
        self._session.connect()
        weakref.finalize(self, self._session._stop.set)
        return self

    def close(self) -> None:
        """Drop this worker's replicas, unregister its memory, stop heart-beating. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._session.stop()
        api = self._session._api
        if api is not None:
            try:
                api.remove_worker(self.worker_id, retry_timeout=2.0)
            except TensorHubError as e:
                logger.debug("worker %s: deregistration failed: %s", self.worker_id, e)
            api.close()
        for h in self._holdings.all():
            self._holdings.drop(h.key)
        self._session.close_transport()

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
        return self._session.api

    @property
    def endpoint(self) -> str:
        """This worker's data-plane endpoint (starts the transport)."""
        return self._session.transport().endpoint

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
        self._session.report("swap", body)

    # ------------------------------------------------------------------ holder
    def empty_like(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """New CPU tensors shaped like ``tensors`` (names, dtypes, shapes; ``meta`` tensors
        will do) in memory the Hub allocates: copy a snapshot into them and ``publish`` them,
        and readers on this host copy from them at memory speed (``transport/_shm``); other readers are unaffected."""
        return _tensors.empty_like(tensors, arena=self.config.samehost)

    def publish(self, model: str, tensors: Mapping[str, Any], *, version: Optional[int] = None,
                layout: str = "hf", shard: Optional[int] = None, num_shards: Optional[int] = None,
                base: Optional[int] = None, base_tensors: Optional[Mapping[str, Any]] = None,
                key: Optional[str] = None, kind: str = "full", base_model: Optional[str] = None,
                config: Optional[Mapping[str, Any]] = None) -> int:
        """Register ``tensors`` in place as ``model``'s version (new when ``version`` is None).

        No copy: the tensors must stay unchanged until ``unpublish`` returns. With several
        shards, one rank publishes with ``version=None`` and passes the number it got to the
        others (``version=v``), or every rank passes the same ``key`` (e.g. ``"step-17"``,
        unique per publish) and gets the same number. The version is complete once every
        shard has a replica.

        Sliced trainers (``tensorhub._sliced``): values that are FSDP2 ``DTensor`` shards or
        :class:`~tensorhub.Slice` objects (a slice with its full shape and offsets) are this
        rank's parts of full tensors, registered in place without a gather; ``shard`` and
        ``num_shards`` (this rank, the ranks publishing) default to the DTensors' mesh. The
        version is complete once the slices of all ranks cover every tensor exactly (checked
        by the coordinator); readers of ``hf`` get the full tensors.

        ``base=b``: also publish the version's delta against v``b`` (layout ``delta:<b>``,
        ``tensorhub._delta_path``), which readers holding v``b`` fetch instead of the full
        bytes. The delta is registered first: the full layout, published after it, completes
        the version (a delta layout never does), so whoever waits for the version finds it. The base is this process's replica of v``b``, or ``base_tensors`` (exactly
        v``b``'s bytes; checked against its checksums before anything is published).

        LoRA adapters (``tensorhub._lora``, docs/guides/lora.md): ``kind="lora"`` with
        ``base_model`` (``"<model>"`` or ``"<model>@v<N>"``: the model the adapter adapts;
        not ``base=``, which names a delta's base version) and ``config`` (the PEFT adapter
        config as a dict: ``r``, ``lora_alpha``, ``target_modules`` ...) publishes
        ``tensors`` (PEFT names, ``<module>.lora_A.weight`` / ``lora_B``, of the config's
        rank: checked first) as a version of ``model`` that carries them; readers get them
        with :meth:`version_meta`. Served, checksummed and delta-capable like any version."""
        self._check_open()
        meta = _lora.version_meta(kind, base_model, config, tensors)
        if meta is not None and (layout != "hf" or _sliced.is_sliced(tensors) or num_shards not in (None, 1)):
            raise ConfigError("a LoRA adapter is published whole, as layout 'hf' (one shard, no slices, no engine "
                              "layout)")
        if _sliced.is_sliced(tensors):
            if layout != "hf" or base is not None or base_tensors is not None:
                raise ConfigError("slices (DTensor, Slice) are published as layout 'hf', without base=")
            return _sliced.publish(self._session, self._holdings, self.checksum, model, tensors, version=version,
                                   key=key, shard=shard, num_shards=num_shards)
        shard = 0 if shard is None else shard
        num_shards = 1 if num_shards is None else num_shards
        if isinstance(layout, str) and is_delta_layout(layout):
            raise ConfigError(f"layout {layout!r}: names starting with {DELTA_PREFIX!r} are the deltas "
                              "publish(base=...) makes; publish the full tensors with base= instead")
        if key is not None:
            if version is not None:
                raise ConfigError("pass version= or key=, not both")
            version = self._session.api.allocate_version(model, None, request_id=key)
        if base is None and base_tensors is None:
            return _holder.publish(self._session, self._holdings, self.checksum, model, tensors, version=version,
                                   layout=layout, shard=shard, num_shards=num_shards, meta=meta)
        return _delta_path.publish_with_delta(self._session, self._holdings, self.checksum, model, tensors,
                                              base, base_tensors, version=version, layout=layout, shard=shard,
                                              num_shards=num_shards, meta=meta)

    def unpublish(self, model: str, version: int, *, timeout: Optional[float] = None,
                  retain_on_cpu: Optional[bool] = None) -> None:
        """Stop serving ``model`` v``version``; return once no reader holds a lease on it.

        After it returns the caller may overwrite or free those tensors. If this worker holds
        the last replica of the newest complete version (retention), then with
        ``retain_on_cpu`` (default: the Hub's setting) it first copies the bytes into CPU
        memory it keeps serving from; without it, it waits (up to ``timeout``) for another
        holder, then raises RetentionError. If readers do not drain in time it raises
        HubTimeoutError, and the bytes must stay untouched. After this worker learned it was
        expired or the coordinator restarted, it also waits one lease ttl
        (docs/concepts/consistency.md)."""
        self._check_open()
        retain = self.retain_on_cpu if retain_on_cpu is None else retain_on_cpu
        _holder.unpublish(self._session, self._holdings, model, version, timeout=timeout, retain=retain)

    # ------------------------------------------------------------------ reader
    def latest(self, model: str) -> Optional[int]:
        """The newest complete version of ``model``, or None."""
        return self.api.latest(model)

    def wait_for_version(self, model: str, *, newer_than: Optional[int] = None,
                         timeout: Optional[float] = None) -> int:
        """Block until a complete version (newer than ``newer_than``) exists; return it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 30.0 if deadline is None else max(0.0, deadline - time.monotonic())
            wait = min(left, 30.0)
            try:
                v = self.api.latest(model, newer_than=newer_than, wait=wait, timeout=wait + 30)
            except NotFoundError:
                v = None
                time.sleep(jittered(min(0.2, left)))
            if v is not None:
                return v
            if deadline is not None and time.monotonic() >= deadline:
                raise HubTimeoutError(
                    f"no complete version of {model!r}" + (f" newer than {newer_than}" if newer_than else "")
                    + f" within {timeout}s")

    def fleet_switch(self, group: str, model: str, version: int, *, wait: Optional[float] = None,
                     timeout: float = 900.0) -> dict:
        """Switch the fleet group ``group`` (engines followed by ``tensorhub follow --group``)
        to ``model`` v``version``, in two phases, at the caller's step boundary: members
        whose engine holds the version (prefetched) are ready; once all are (or after
        ``wait`` seconds, default the group's ``--group-wait``) the ready ones apply and the
        others leave the group for this version. Returns when every applying member
        reported, with the round: ``go``, ``applied``, ``failed`` (member -> why), ``left``;
        from then on every member in the group serves ``version`` (``fleet(group)``)."""
        deadline = time.monotonic() + timeout
        r = self.api.fleet_switch(group, model, version, wait)
        while r["state"] != "done":
            if time.monotonic() >= deadline:
                raise HubTimeoutError(f"fleet group {group!r} did not finish switching to v{version} within "
                                      f"{timeout}s (round: {r})")
            time.sleep(0.1)
            r = self.api.fleet_round(group, version)
        return r

    def fleet(self, group: str) -> dict:
        """A fleet group now: its version, members (version, in the group or out and why),
        recent rounds, ``mixed`` (the alarm) and how many left or failed."""
        return self.api.fleet(group)

    def resolve(self, model: str, *, group: Optional[str] = None) -> int:
        """The version to fetch: the newest complete one; every caller passing the same
        ``group`` (e.g. one id per TP group and update step) gets the same number."""
        return self.api.resolve(model, group)

    def fetch(self, model: str, version: Optional[int] = None, *, layout: str = "hf", shard: int = 0,
              into: Optional[Mapping[str, Any]] = None, serve: bool = True, group: Optional[str] = None,
              timeout: Optional[float] = None,
              progress: Optional[Callable[[FetchProgress], None]] = None,
              names: Optional[Iterable[str]] = None, base: Optional[int] = None,
              ranges: Optional[Mapping[str, tuple[Any, Any]]] = None) -> Fetched:
        """Read ``model`` v``version`` (newest complete when None) from the holders the
        coordinator picks, into ``into`` (checked tensor by tensor) or new tensors.

        With ``serve=True`` the result is registered as one more replica: leave the tensors
        unchanged until ``unpublish``. ``group``: see :meth:`resolve`. The fetch completes or
        fails within ``timeout`` (default ``fetch_timeout``), coordinator outages included.
        ``progress``: called on this thread with a :class:`~tensorhub.FetchProgress` about
        once a second (``progress_interval``) once the fetch has run for a second,
        and once more at its end (``done=True``); without it, progress goes to the log.
        ``names``: read only these tensors (``serve`` must be False; ``into`` then needs only
        them); :meth:`manifest` lists a version's tensors. Streaming a version in bounded
        buckets is a loop of such fetches into one reused buffer.

        Deltas (``tensorhub._delta_path``): when this process serves an older version of
        the same layout and shard, or ``into`` holds exactly v``base`` (``base=``), and
        published deltas move fewer bytes than the full version, the deltas are read and
        applied (into a new buffer, or ``into`` in place), checked against the version's
        checksums, and served too; any delta problem reads the full version instead (and
        logs why). ``result.delta`` says how (None: read in full), and
        ``result.delta_skipped`` why a reader that had a base read in full (None: it had none).

        Sliced versions (published by trainer ranks, ``tensorhub._sliced``) read as ``hf``
        like any other: the full tensors are assembled from the ranks' slices. ``ranges``
        (``{name: (rows, cols)}``, each a ``(start, stop)`` on dim 0 / dim 1 or None for the
        whole dimension; ``serve`` must be False) reads only those parts of those tensors,
        and moves only their bytes, from any version's ``hf`` tensors; the result holds each
        at the range's shape (plus the whole tensors in ``names``)."""
        self._check_open()
        if ranges is not None:
            if serve:
                raise ConfigError("fetch(ranges=...) reads part of a version, which cannot be served: "
                                  "pass serve=False")
            if layout != "hf" or base is not None or not isinstance(ranges, Mapping) or not ranges:
                raise ConfigError("fetch(ranges=...) needs a non-empty {name: (rows, cols)} of the hf layout, "
                                  "without base=")
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
                f = self._fetch(model, version, layout, shard, into, serve, group, deadline, track, names, base,
                                ranges)
        except BaseException:
            self._account(model, layout, shard, track, None, t0)
            raise
        self._account(model, layout, shard, track, f, t0)
        return f

    def fetch_next(self, model: str, after: int, *, into: Optional[Mapping[str, Any]] = None, layout: str = "hf",
                   shard: int = 0, wait: float = 60.0, timeout: Optional[float] = None,
                   progress: Optional[Callable[[FetchProgress], None]] = None,
                   bound: Optional[Callable[[int], None]] = None) -> Optional[Fetched]:
        """The next complete version of ``model`` newer than ``after``, read and served as
        soon as it is published; None if none is published within ``wait`` seconds.

        What a reader that follows a model calls once it holds ``after``: its lease is asked
        ahead (the coordinator holds it until the version exists), so this reader is in the
        version's distribution plan from its first moment instead of queueing with the
        fleet after the publish (``tensorhub._next``). ``into``: the destination (e.g. the
        kept copy of an older version), laid out as ``after``. The read itself completes
        within ``timeout`` (default ``fetch_timeout``) of the publish; ``bound(version)`` is
        called once it is known which version is read, before the read. Read in full (no
        deltas); against an older coordinator, ``wait_for_version`` + :meth:`fetch`."""
        self._check_open()
        if not isinstance(after, int) or isinstance(after, bool) or after < 1:
            raise ConfigError(f"after must be a positive int, got {after!r}")
        if not wait > 0:
            raise ConfigError(f"wait must be > 0 seconds, got {wait!r}")
        return _next.fetch_next(self, model, after, into=into, layout=layout, shard=shard, wait=wait,
                                timeout=timeout, progress=progress, bound=bound)

    def borrow(self, model: str, version: int, *, layout: str = "hf", shard: int = 0,
               timeout: Optional[float] = None) -> Optional[Borrowed]:
        """Read ``model`` v``version`` where it lies, without copying it: read-only views of
        a same-host holder's memory (Hub-allocated: ``empty_like``, fetched copies), under a
        read lease, valid inside ``with`` only; None (nothing held) when no replica the
        coordinator names is on this host in such memory: then :meth:`fetch`.

        >>> b = hub.borrow("policy", 3)                              # doctest: +SKIP
        >>> if b is not None:
        ...     with b as w:            # checked against the manifest's checksums
        ...         model.load_weights(w.items())   # copy out what you keep

        Leaving the block releases the lease (the holder may then overwrite its memory) and
        raises :class:`~tensorhub.LeaseLapsedError` if it lapsed meanwhile: what was read may
        have changed, read it again. Keep nothing that views the tensors past the block
        (``Borrowed.sharing(named_tensors)`` names those that do). Waits up to ``timeout``
        (default ``fetch_timeout``) while no replica serves."""
        self._check_open()
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ConfigError(f"version must be a positive int, got {version!r}")
        deadline = time.monotonic() + (self.fetch_timeout if timeout is None else timeout)
        opts = FetchOptions(self.max_sources, self.chunk_bytes, self.progress_timeout, self.checksum)
        with self.api.bounded(deadline + _RELEASE_GRACE):
            return _borrow.borrow(self._session, opts, model, version, layout, shard, deadline)

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
                    self._session.report("fetch", {"worker_id": self.worker_id, "model": model,
                                                     "version": track.version, "layout": layout, "shard": shard,
                                                     "state": "failed", "seconds": time.monotonic() - t0})
                return
            p = track.reporter.finish()
            outcome = "failed" if f is None else "ok"
            if f is not None:  # the read's own figures (leases and registration excluded)
                p = FetchProgress(p.model, p.version, p.layout, p.shard, f.nbytes, p.total, f.seconds,
                                  dict(f.sources), len(f.failed_sources), True)
            m.fetched(model, outcome, p.nbytes, p.seconds, 0)
            self._session.report("fetch", self._session._fetch_report(p, outcome))
        except Exception:  # pragma: no cover - accounting never breaks a fetch
            logger.debug("fetch accounting failed", exc_info=True)

    def _fetch(self, model: str, version: Optional[int], layout: str, shard: int,
               into: Optional[Mapping[str, Any]], serve: bool, group: Optional[str], deadline: float,
               track: Track, names: Optional[list[str]] = None, base: Optional[int] = None,
               ranges: Optional[Mapping[str, tuple[Any, Any]]] = None) -> Fetched:
        if version is None:
            version = self.resolve(model, group=group)
        elif not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ConfigError(f"version must be a positive int, got {version!r}")
        if base is not None:  # delta versions (issue #16)
            _delta_path.check_fetch_base(base, version, into, names)
        opts = FetchOptions(self.max_sources, self.chunk_bytes, self.progress_timeout, self.checksum)
        if ranges is not None:  # parts of tensors: from the slices' holders (or a full replica)
            return _sliced.fetch(self._session, self._holdings, opts, model, version, into=into, serve=False,
                                 deadline=deadline, track=track, names=names, ranges=ranges)
        held = self._holdings.get((model, version, layout, shard))
        if held is not None:  # we hold it already: no transfer
            return copy_held(held, into, names, self._holdings, self.worker_id, self.config.samehost)
        track.version = version
        skipped: Optional[str] = None
        try:
            if names is None:  # delta versions (issue #16): None -> read in full
                f, skipped = _delta_path.fetch_through_delta(self._session, self._holdings, opts, model, version,
                                                             layout, shard, into=into, base=base, serve=serve,
                                                             deadline=deadline, track=track, pipelined=self.pipelined)
                if f is not None:
                    return f
            got = Fetch(self._session, self._holdings, opts, model, version, layout, shard, into=into,
                        serve=serve, deadline=deadline, track=track, names=names, pipelined=self.pipelined).run()
        except ReadSlices as e:
            # Published as slices and no assembled copy serves yet: the coordinator's answer
            # to the lease said so (or, serving while receiving, there is no hf manifest yet).
            got = _sliced.fetch(self._session, self._holdings, opts, model, version, into=into, serve=serve,
                                deadline=deadline, track=track, names=names, num_shards=e.num_shards)
        got.delta_skipped = skipped
        return got

    def version_info(self, model: str, version: int) -> Optional[VersionView]:
        """``model`` v``version`` as the coordinator sees it now: ``.complete``, its
        ``.layouts`` (``num_shards``, ``complete``, ``nbytes``) and ``.replicas``
        (``worker_id``, ``layout``, ``shard``, ``serving``); None if it has no such version."""
        self._check_open()
        try:
            return self.api.version(model, version)
        except NotFoundError:
            return None

    def version_meta(self, model: str, version: int) -> Optional[VersionMeta]:
        """What ``model`` v``version`` is, as its publisher said (``VersionMeta``: ``kind``
        ``"lora"``, ``base``, ``config``); None for full weights (and for versions published
        by clients that predate it). Raises ``NotFoundError`` for an unknown version."""
        self._check_open()
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ConfigError(f"version must be a positive int, got {version!r}")
        try:
            return self._session.manifest(model, version, "hf", 0).meta
        except NotFoundError as e:
            if e.code != "unknown_layout":
                raise
            return None  # published as slices: full weights

    def manifest(self, model: str, version: int, *, layout: str = "hf", shard: int = 0) -> list[TensorSpec]:
        """The tensors of ``model`` v``version`` (``layout``, ``shard``) in their order: each
        with ``.name``, ``.dtype``, ``.shape`` and ``.nbytes``. Reads no weights."""
        self._check_open()
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ConfigError(f"version must be a positive int, got {version!r}")
        try:
            return list(self.api.manifest(model, version, layout, shard).tensors)
        except NotFoundError as e:
            if layout != "hf" or shard != 0 or e.code != "unknown_layout":
                raise
            try:  # a version published as slices: its full tensors
                return _sliced.full_manifest(self._session, model, version)
            except NotFoundError:
                raise e from None

    def held(self) -> list[tuple[str, int, str, int]]:
        """(model, version, layout, shard) of every replica this process holds."""
        return sorted(h.key for h in self._holdings.all())

    # ------------------------------------------------------------------ leases, for the few callers that need one
    def lease(self, model: str, version: int, *, layout: str = "hf", shard: int = 0,
              exclude: Iterable[str] = (), timeout: float = 10.0) -> LeaseGrant:
        """A read lease on one shard, for callers that hand its replicas to a reader
        outside TensorHub (the SGLang seed): the holders it names keep those bytes until
        :meth:`release` (or the lease lapses: renew it with ``hub.api.renew_lease``).
        Waits up to ``timeout`` while no replica is serving. The grant carries the
        shard's manifest."""
        self._check_open()
        return self._acquire(model, version, layout, shard, set(exclude), time.monotonic() + timeout)

    def release(self, lease_id: str) -> bool:
        """Release a lease from :meth:`lease`; True if it stayed valid throughout."""
        self._check_open()
        return self._release(lease_id)

    def _acquire(self, model: str, version: int, layout: str, shard: int, excluded: set[str],
                 deadline: float, clock: Optional[LeaseClock] = None) -> LeaseGrant:
        grant = acquire_lease(self._session, model, version, layout, shard, excluded, deadline, clock,
                              self.max_sources)
        if grant.manifest is None:
            grant = grant.model_copy(update={"manifest": self._session.manifest(model, version, layout, shard)})
        return grant

    def _release(self, lease_id: str) -> bool:
        return release_lease(self._session, lease_id)

    def _release_checked(self, leases: list[str], clock: LeaseClock) -> list[str]:
        return release_checked(self._session, leases, clock)

    def _as_worker(self, path: str, body: Any, **kw: Any) -> Any:
        return self._session.as_worker(path, body, **kw)

    @property
    def _quarantine(self) -> Quarantine:
        return self._holdings.quarantine

    @property
    def _fence_until(self) -> dict:
        return self._holdings.fence_until

    @property
    def _lease_ttl(self) -> float:
        return self._session.lease_ttl


def connect(url: Optional[str] = None, *, worker_id: Optional[str] = None,
            locality: Optional[Locality | str | Mapping[str, str]] = None, token: Optional[str] = None,
            config: Optional[HubConfig] = None, transport: Optional[Transport | str] = None, **options: Any) -> Hub:
    """Connect to the coordinator at ``url`` (default: ``TENSORHUB_COORDINATOR``); or with
    a resolved ``config`` (:class:`~tensorhub.config.HubConfig`). Several highly available
    coordinators are given comma-separated (``"http://c1:7777,http://c2:7777"``): the Hub
    follows the leader and fails over by itself. ``transport``: a transport object, or the
    name of one (``transport_kind``)."""
    named = {k: v for k, v in (("worker_id", worker_id), ("locality", locality), ("token", token)) if v is not None}
    return Hub(url, config=config, transport=transport, **named, **options).connect()
