"""What one engine worker process holds, and how it gets there: connect, resolve, fetch.

Runs in every engine worker process (one per TP/PP rank: a vLLM worker, an SGLang
scheduler). The adapter's model loader creates the state at start (:func:`connect`); its
hot-swap path (vLLM's weight-transfer engine, SGLang's pull function: same process)
reuses it. The engine is known here only through its :class:`EngineHooks`: its name, its
ranks (:class:`~tensorhub.integrations._core.ranks.EngineRanks`) and how its checkpoint names group
into layers.

Replicas per rank, for the version the engine runs: the ``hf`` copy (checkpoint names and
dtypes, the size of the checkpoint) that the serving rank(s) fetched (``serve_ranks``),
registered with the coordinator for trainers, other engines and other TP sizes; and, where
the engine allows it (``native``), the rank's parameters in place as the engine-native
layout (the adapters' ``_native``). Memory: one extra model-size of host memory per serving
rank, plus a second one during a hot-swap until readers of the old version drained.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from tensorhub import ConfigError, envs
from tensorhub.config import coordinator_urls

from .ranks import EngineRanks
from .settings import Settings, SettingsError

logger = logging.getLogger(__name__)

__all__ = ["EngineHooks", "WorkerState", "connect", "get_state", "open_hub", "probe", "resolve", "version_status",
           "fetch", "serve_in_place", "withdraw", "read_disk", "publish_disk", "engine_quiet", "off_engine_cores"]


def one_group(names: list) -> list:
    """Layer groups for an engine that has none: every name in one group."""
    return [list(names)]


@dataclass(frozen=True)
class EngineHooks:
    """What the engine-neutral core asks of an engine; each adapter makes one."""

    #: ``"vllm"``, ``"sglang"``: the default worker id's prefix.
    name: str
    #: This worker's engine, every axis (pipeline stages x TP ranks ...); a lone process
    #: (``EngineRanks()``) outside the engine. Asked at each use, never cached.
    ranks: Callable[[], EngineRanks] = EngineRanks
    #: Checkpoint names -> lists of names, one per layer, in load order (buckets close at
    #: these boundaries once half full).
    groups: Callable[[list], list] = one_group


#: Hooks of a process outside any engine (unit use): one rank, one layer group.
LONE = EngineHooks("engine")


@dataclass
class WorkerState:
    """Per worker process; see the module docstring. The ``rank`` is the TP rank."""

    settings: Settings
    hub: Any
    rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    serving: bool = True  # this rank keeps and serves the hf copy it fetched
    version: Optional[int] = None  # the version the engine's parameters hold
    copy: Optional[Mapping[str, Any]] = None  # the hf copy of ``version`` (registered if serving)
    specs: Optional[dict] = None  # name -> (shape, dtype) of the hf tensors the engine runs
    layout: Optional[str] = None  # the engine-native layout's name (the adapter's fingerprint)
    native: bool = False  # the parameters are registered in place as ``version`` in ``layout``
    hooks: EngineHooks = LONE
    retired: list = field(default_factory=list)  # old (version, copy) whose readers had not drained
    pending_borrow: Any = None  # a start in place's open Borrowed, until the loader hands it to keep_borrowed
    keeper: Optional[threading.Thread] = None  # making the hf copy after a start in place (keep_borrowed)
    #: Why the parameters are a mix of two versions (a failed swap whose rollback failed:
    #: ``rollback.roll_back``); None while they are one version's exact bytes.
    broken: Optional[str] = None
    #: The last swap got as far as changing parameters (even if it then rolled back).
    touched: bool = False
    _copies: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def engine(self) -> EngineRanks:
        """This worker's engine, every rank of every stage (collectives go over it)."""
        return self.hooks.ranks()

    def retire(self, old_v: Optional[int], old_copy: Any, reason: str = "") -> None:
        """Stop serving ``old_v``'s ``hf`` copy (and copies retired earlier) and let them go
        once their readers drained; a copy whose readers did not drain stays referenced
        here (its memory untouched) and is tried again next time. (vLLM's state also keeps
        one drained copy as its next swap's destination.)"""
        import tensorhub

        s = self.settings
        if reason:
            logger.info("tensorhub: dropping the fetched %s v%s: %s", s.model, old_v, reason)
        with self._copies:
            pending = list(self.retired)
            if old_v is not None and old_copy is not None:
                pending.append((old_v, old_copy))
            self.retired = []
            for v, copy in pending:
                try:
                    self.hub.unpublish(s.model, v, timeout=s.drain_timeout)
                except tensorhub.NotFoundError:
                    pass  # not held (any more)
                except tensorhub.TensorHubError as e:
                    logger.warning("tensorhub: keeping %s v%d allocated: %s", s.model, v, e)
                    self.retired.append((v, copy))
                    continue
                self.drained(copy)

    def drained(self, copy: Any) -> None:
        """A retired copy nobody reads any more (nothing here: it is freed with its last
        reference; vLLM keeps one as its next swap's destination)."""

    def keep_borrowed(self, borrowed: Any, v: int) -> None:
        """After a start in place (``load.borrow_into``): make this serving rank's ``hf``
        copy of ``v`` from the borrowed memory on a background thread that gives way to the
        engine (:func:`off_engine_cores`, after :func:`engine_quiet`), release the lease,
        register the copy (``publish`` of ``v``: the coordinator checks its checksums) and
        keep it as :attr:`copy`. The engine answers requests meanwhile; it serves ``v`` once
        the copy is in. If the lease lapsed during the copy, the copy is dropped and ``v``
        fetched instead. A swap waits for this first (:meth:`wait_kept`)."""
        self.keeper = threading.Thread(target=self._keep, args=(borrowed, v), name="tensorhub-keep", daemon=True)
        self.keeper.start()

    def _keep(self, borrowed: Any, v: int) -> None:
        import tensorhub

        from .load import copy_bytes

        s = self.settings
        off_engine_cores()
        waited = engine_quiet()
        t0 = time.monotonic()
        copy: Any = None
        try:
            copy = self.hub.empty_like(borrowed)  # Hub memory: same-host readers copy from it in turn
            copy_bytes(copy, borrowed)
            borrowed.release()
            self.hub.publish(s.model, copy, version=v, layout="hf")
            how = "copied from the borrowed memory"
        except Exception as e:
            borrowed.release_quietly()
            copy = None
            logger.warning("tensorhub: keeping %s v%d from the borrowed memory failed (%s); fetching it", s.model, v,
                           e if isinstance(e, tensorhub.TensorHubError) else repr(e))
            try:
                copy = fetch(self, v)
                how = "fetched"
            except Exception as e2:
                logger.warning("tensorhub: the engine runs %s v%d but serves no hf copy of it: %s", s.model, v, e2)
                return
        with self._copies:
            current = self.version == v and self.copy is None
            if current:
                self.copy = copy
        if not current:
            self.retire(v, copy, reason="the engine moved on while it was being copied")
            return
        logger.info("tensorhub: worker %s serves its hf copy of %s v%d (%s in the background in %.2fs, "
                    "after %.2fs waiting for the engine's start to quiet down)",
                    self.hub.worker_id, s.model, v, how, time.monotonic() - t0, waited)

    def wait_kept(self, timeout: float) -> None:
        """Wait (up to ``timeout``) for :meth:`keep_borrowed`'s copy: a swap then finds the
        running version's copy where it expects it."""
        k = self.keeper
        if k is not None:
            k.join(timeout)


def engine_quiet(limit: float = 10.0, window: float = 0.2, busy: float = 0.5) -> float:
    """Wait until this worker process has used less than ``busy`` of a core over ``window``
    seconds (the engine's start after the load -- vLLM's profiling, KV cache and warm-up,
    SGLang's memory pool and graphs -- is done), at most ``limit`` seconds; returns the
    seconds waited. Why: a background copy of the model into new memory right after the
    load (page faults, memory bandwidth) made vLLM's "init engine" step 0.5 -> 1.3 s on the
    test VM; idle, the engine loses nothing to it."""
    t0 = time.monotonic()
    used = sum(os.times()[:2])
    while time.monotonic() - t0 < limit:
        time.sleep(window)
        now = sum(os.times()[:2])
        if now - used < busy * window:
            break
        used = now
    return time.monotonic() - t0


def off_engine_cores() -> None:
    """Make the calling thread (Linux: per thread) give way to the engine: off the cores
    the engine's threads are pinned to (vLLM's CPU worker pins its OpenMP threads, and
    every thread they start, to its cores; the others are left to its front-end processes),
    onto the others (every core when it has them all), at nice 10 (the front end's start
    goes first; unlike nice 19, a busy host still lets it finish). Best effort."""
    try:
        mine = os.sched_getaffinity(0)
        every = set(range(os.cpu_count() or 1))
        os.sched_setaffinity(0, (every - mine) or every)
    except (AttributeError, OSError, ValueError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


_LOCK = threading.Lock()
_STATE: Optional[WorkerState] = None


def get_state() -> Optional[WorkerState]:
    """The process's state, once :func:`connect` made it (one engine per process)."""
    return _STATE


def connect(settings: Settings, hooks: EngineHooks, state: type = WorkerState) -> WorkerState:
    """The process's state, connecting its Hub on first use (same settings expected);
    ``state``: the class to make, :class:`WorkerState` or an adapter's subclass."""
    global _STATE
    with _LOCK:
        if _STATE is not None:
            return _STATE
        eng = hooks.ranks()
        tp_rank, tp_size, pp_rank = eng.rank_on("tp"), eng.size_on("tp"), eng.rank_on("pp")
        hub = open_hub(settings, hooks.name, tp_rank, tp_size, pp_rank)
        serving = settings.serve_ranks == "all" or tp_rank == 0
        _STATE = state(settings, hub, rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=eng.size_on("pp"),
                       serving=serving, hooks=hooks)
        logger.info("tensorhub: worker %s connected to %s (tp rank %d/%d, serving hf copy: %s)",
                    hub.worker_id, settings.coordinator, tp_rank, tp_size, serving)
        return _STATE


# ---------------------------------------------------------------- connect
def _probe(settings: Settings) -> None:
    """Fail fast, naming the setting, when the coordinator does not answer."""
    probe(settings.coordinator, settings.connect_timeout)


def probe(coordinator: str, connect_timeout: float) -> None:
    """Fail fast (a :class:`SettingsError` naming ``coordinator`` and the last problem) when
    none of the coordinator URLs answers ``/healthz`` within ``connect_timeout`` seconds."""
    import httpx

    try:
        urls = coordinator_urls(coordinator)  # several: HA coordinators, any one answering will do
    except ConfigError as e:
        raise SettingsError(f"tensorhub: setting 'coordinator': {e}") from None
    url = ",".join(urls)
    deadline = time.monotonic() + connect_timeout
    last: Exception | str = ""
    while time.monotonic() < deadline:
        for u in urls:
            try:
                r = httpx.get(f"{u}/healthz", timeout=min(5.0, connect_timeout))
                if r.status_code == 200:
                    return
                last = f"{u}: HTTP {r.status_code}"
            except httpx.HTTPError as e:
                last = f"{u}: {e}"
        time.sleep(0.5)
    raise SettingsError(f"tensorhub: setting 'coordinator': {url} did not answer within "
                        f"{connect_timeout:g}s ({last})")


def open_hub(settings: Settings, engine: str, tp_rank: int, tp_size: int, pp_rank: int) -> Any:
    """Probe the coordinator and connect this rank's Hub (worker id ``<base>[-tp<r>][-pp<r>]``,
    base from the settings, ``TENSORHUB_WORKER_ID`` or ``<engine>-<host>-<pid>``); a refused
    token becomes the one-line settings error."""
    import tensorhub

    _probe(settings)
    base = envs.pick(settings.worker_id, "TENSORHUB_WORKER_ID") or f"{engine}-{socket.gethostname()}-{os.getpid()}"
    wid = base + (f"-tp{tp_rank}" if tp_size > 1 else "") + (f"-pp{pp_rank}" if pp_rank else "")
    try:
        return tensorhub.connect(config=settings.hub_config(wid))
    except tensorhub.UnauthorizedError as e:
        raise SettingsError(f"tensorhub: setting 'token': the coordinator at {settings.coordinator} "
                            f"refused it ({e.message})") from None


def version_status(hub: Any, model: str, version: int) -> Any:
    """``model`` ``version`` as the coordinator sees it now (``tensorhub`` ``VersionView``:
    ``.complete``, ``.layouts``, ``.replicas``); None when it knows no such version."""
    return hub.version_info(model, version)


# ---------------------------------------------------------------- resolve
def resolve(st: WorkerState, requested: Any, *, on_missing: str = "error",
            what: str = "setting 'version'") -> Optional[int]:
    """The version every rank of the engine loads, every TP rank of every pipeline stage;
    None means "no version, load from disk".

    The engine's root (PP stage 0, TP rank 0) decides, the others receive its answer (or
    its one-line error): a version published meanwhile cannot split the stages."""
    return st.engine().decide(lambda: _resolve_here(st, requested, on_missing, what), SettingsError)


def _resolve_here(st: WorkerState, requested: Any, on_missing: str, what: str) -> Optional[int]:
    import tensorhub

    s, hub = st.settings, st.hub
    if requested != "latest":
        try:
            newest = hub.latest(s.model)
        except tensorhub.NotFoundError:
            raise SettingsError(f"tensorhub: setting 'model': unknown model {s.model!r} on {s.coordinator}") from None
        vi = hub.version_info(s.model, requested)
        if vi is None or not vi.complete:
            raise SettingsError(f"tensorhub: {what}: {s.model!r} has no complete version {requested} "
                                f"(newest complete: {newest or 'none'})")
        return int(requested)
    try:
        return hub.latest(s.model) or _missing(st, on_missing, f"model {s.model!r} has no complete version yet")
    except tensorhub.NotFoundError as e:
        return _missing(st, on_missing, f"{e.message} on {s.coordinator}")


def _missing(st: WorkerState, on_missing: str, why: str) -> Optional[int]:
    s = st.settings
    if on_missing == "disk":
        logger.info("tensorhub: %s; loading the weight files from disk (on_missing='disk')", why)
        return None
    if on_missing == "wait":
        logger.info("tensorhub: %s; waiting up to %gs for one (on_missing='wait')", why, s.wait_timeout)
        try:
            return st.hub.wait_for_version(s.model, timeout=s.wait_timeout)
        except Exception as e:
            raise SettingsError(f"tensorhub: setting 'on_missing'='wait': {e}") from None
    raise SettingsError(f"tensorhub: setting 'model': {why} (on_missing='error'; use \"disk\" to load "
                        "the weight files and publish them, or \"wait\")")


# ---------------------------------------------------------------- fetch
def fetch(st: WorkerState, version: int, layout: str = "hf", *, shard: int = 0,
          into: Optional[Mapping[str, Any]] = None, base: Optional[int] = None) -> Any:
    """Fetch ``version`` into ``into`` (a spare copy: memory already touched, so no page
    faults) or new memory. ``hf`` is registered when this rank serves; a native ``layout``'s
    ``shard`` never is (the parameters are, once it is copied over them). Through deltas
    when this rank serves an older version or ``into`` holds v``base`` (``Hub.fetch``);
    a delta that does not verify is logged and the full version read."""
    s = st.settings
    t0 = time.monotonic()
    native = layout != "hf"
    got = st.hub.fetch(s.model, version, layout=layout, shard=shard if native else 0,
                       serve=st.serving and not native, timeout=s.fetch_timeout, into=into,
                       base=base if into is not None and not native else None)
    d, skipped = getattr(got, "delta", None), getattr(got, "delta_skipped", None)
    logger.info("tensorhub: fetched %s v%d (%s): %.1f MB in %.2fs (%.2f GB/s) from %s%s%s%s%s",
                s.model, version, layout, got.nbytes / 1e6,
                time.monotonic() - t0, got.gbps, got.sources,
                f"; failed sources {got.failed_sources}" if got.failed_sources else "",
                "; into the kept copy of an older version" if into is not None else "",
                f"; through delta(s) {d.steps} ({100 * d.nbytes / max(1, d.full_nbytes):.1f}% of the version)"
                if d is not None else "",
                f"; in full, not through deltas: {skipped}" if skipped else "")
    return got


def ask_ahead_after(got: Any) -> bool:
    """May a follower ask the next version's lease ahead after this usual read? Yes when it
    had a base and found no delta from it (the publisher publishes none): asked ahead, a
    version is read in full."""
    skipped = getattr(got, "delta_skipped", None) or ""
    return getattr(got, "delta", None) is None and skipped.startswith("no direct delta")


def deltas_published(hub: Any, model: str, version: int) -> bool:
    """Does ``version`` have delta layouts (the publisher started publishing them)? Asked
    after a read asked ahead, off the critical path: the next version is then read through
    them. An unreachable coordinator counts as no."""
    try:
        info = hub.version_info(model, version)
    except Exception:  # (best effort: asked again after the next version)
        return False
    return info is not None and any(l.startswith("delta:") for l in info.layouts)


def fetch_next(st: WorkerState, after: int, *, into: Optional[Mapping[str, Any]] = None,
               wait: float = 30.0) -> Any:
    """The version after ``after``, its lease asked ahead (``Hub.fetch_next``: this rank is
    in the version's plan from its first moment), into ``into`` (the kept copy) or new
    memory, served when this rank serves; None when none was published within ``wait``."""
    s = st.settings
    t0 = time.monotonic()
    got = st.hub.fetch_next(s.model, after, into=into, wait=wait, timeout=s.fetch_timeout)
    if got is not None:
        logger.info("tensorhub: fetched %s v%d (hf, asked ahead): %.1f MB in %.2fs (%.2f GB/s) from %s%s; %.2fs "
                    "after the ask", s.model, got.version, got.nbytes / 1e6, got.seconds, got.gbps, got.sources,
                    "; into the kept copy of an older version" if into is not None else "", time.monotonic() - t0)
    return got


# ---------------------------------------------------------------- serving the parameters
def serve_in_place(st: WorkerState, tensors: Mapping[str, Any], version: int, shard: int, num_shards: int) -> None:
    """Register the rank's parameters (``tensors``: the adapter's ``native_tensors``, no
    copy) as ``shard`` of ``num_shards`` of ``version`` in the native layout ``st.layout``.
    Raises what the publish raises; whether that fails the engine is the adapter's call."""
    s = st.settings
    st.hub.publish(s.model, tensors, version=version, layout=st.layout, shard=shard, num_shards=num_shards)
    st.native = True
    logger.info("tensorhub: worker %s serves %s v%d in place as layout %s (shard %d of %d, %.1f MB)",
                st.hub.worker_id, s.model, version, st.layout, shard, num_shards,
                sum(t.numel() * t.element_size() for t in tensors.values()) / 1e6)


def withdraw(st: WorkerState, version: int) -> None:
    """Before the parameters change: stop serving ``version`` (every layout this worker
    holds of it: the parameters in place, the ``hf`` copy) and wait up to ``drain_timeout``
    for its readers (invariant 3: memory a reader may still read is never overwritten).
    Raises ``TensorHubError`` when they do not drain, and then the parameters must stay as
    they are; nothing registered is fine."""
    import tensorhub

    try:
        st.hub.unpublish(st.settings.model, version, timeout=st.settings.drain_timeout)
    except tensorhub.NotFoundError:
        pass  # nothing registered (native off, not a serving rank)
    st.native, st.copy = False, None  # the hf copy of that version went with it


# ---------------------------------------------------------------- on_missing="disk"
def read_disk(model_dir: str) -> dict:
    """``on_missing="disk"``: every ``*.safetensors`` tensor in ``model_dir``, contiguous."""
    import glob

    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise SettingsError(f"tensorhub: setting 'on_missing'='disk': no *.safetensors in {model_dir}")
    out: dict = {}
    for f in files:
        out.update(load_file(f))
    return {k: v.contiguous() for k, v in out.items()}


def publish_disk(st: WorkerState, tensors: Mapping[str, Any], model_dir: str) -> int:
    """After a disk load: publish the weight files once, as a new version for the whole
    engine (its root publishes, every rank of every stage learns the number), and keep them
    as the ``hf`` copy where this rank serves. Returns the version."""
    from .load import specs_of

    s = st.settings

    def publish() -> int:
        try:
            v = st.hub.publish(s.model, tensors, layout="hf")
        except Exception as e:
            raise RuntimeError(f"tensorhub: publishing the weight files of {model_dir} failed: {e}") from None
        logger.info("tensorhub: published the weight files of %s as %s v%d", model_dir, s.model, v)
        return v

    eng = st.engine()
    v = eng.decide(publish, RuntimeError)
    if not eng.root and st.serving:
        st.hub.publish(s.model, tensors, version=v, layout="hf")
    st.version, st.specs = v, specs_of(tensors)
    st.copy = tensors if st.serving else None
    return v
