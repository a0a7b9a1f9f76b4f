"""``tensorhub follow``: keep a running inference server on the newest version of a model.

Engine-neutral: the loop here connects to the coordinator, waits for each newer complete
version, has the engine's *driver* swap to it, prints one line per swap (the version, the
stall, the bytes and the holders; a progress line on a terminal while a swap runs longer
than a second) and keeps going after a failed swap. Before each swap it waits until the
engine's ``prefetch`` holds the version, so the pause covers only the apply: the engine's
workers are the ones ``--engine-worker`` names, else the ones the engine names itself (the
driver's ``workers`` query, asked once at start; vLLM answers through its dev route
``/collective_rpc``). Drivers register under the entry-point
group ``tensorhub.engines`` (this package's ``pyproject.toml`` registers ``vllm`` and
``sglang`` from ``tensorhub.integrations``); the rest of ``tensorhub`` imports no engine adapter. A driver
is picked by the ``--engine`` URL's prefix (``sglang+http://...``); the one with no prefix
(vLLM) is the default.

``--lora K``: ``--model`` names LoRA adapter versions (``Hub.publish(kind="lora")``); each
new one is loaded beside the others through the engine's LoRA API as ``<model>@v<N>``
(the driver's :class:`LoraOps`; no pause, no swap) and only the newest ``K`` stay loaded
(K >= the rollouts' max staleness + 1): older ones are unloaded by name. An unloaded name
takes no new request; requests already running with it finish with it (vLLM keeps their
adapter, reloading it from peers if it evicted it meanwhile).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, TextIO

from ._exceptions import ConflictError, NotFoundError
from .config import HubConfig

__all__ = ["Driver", "EngineWorker", "LoraOps", "ProgressLine", "drivers", "engine_holds", "follow", "follow_lora",
           "main", "parser", "pick", "progress_text", "prefetching_workers", "wait_prefetched"]

#: Entry-point group of engine drivers (each a :class:`Driver`).
GROUP = "tensorhub.engines"


class ProgressLine:
    """One line redrawn in place on a terminal (``\\r`` + clear to end of line); on anything
    else (a pipe, a log file) a line is written at most every ``every`` seconds, so logs
    stay readable. ``done()`` ends the line."""

    def __init__(self, stream: Optional[TextIO] = None, every: float = 10.0) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = every
        self.drawn = False
        self._last = float("-inf")

    def draw(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r" + text + "\x1b[K")
            self.drawn = True
        elif time.monotonic() - self._last >= self.every:
            self._last = time.monotonic()
            self.stream.write(text + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self.tty and self.drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
        self.drawn = False


@dataclass(frozen=True)
class LoraOps:
    """What ``tensorhub follow --lora`` needs of an engine's LoRA API: ``load(client, model,
    version)`` loads adapter version ``version`` as ``<model>@v<N>`` (raise ``RuntimeError``
    naming why it failed), ``unload(client, model, version)`` drops that name, and
    ``loaded(client, model)`` lists the versions of ``model`` loaded now."""

    load: Callable[[Any, str, int], None]
    unload: Callable[[Any, str, int], None]
    loaded: Callable[[Any, str], list]


@dataclass(frozen=True)
class Driver:
    """What ``tensorhub follow`` needs of an engine (an adapter registers one).

    ``banner(client, args)`` -> (the engine's current version or None, the first line to
    print); ``swap(client, version, args, show)`` -> the stall in seconds (``show(stall)``
    draws the progress line; raise ``RuntimeError`` for a failed swap the engine survived).
    ``workers(client)`` (optional) -> what the engine says of its TensorHub workers, one
    :class:`EngineWorker` (or its JSON object) per worker. ``client`` is an ``httpx.Client`` on the engine's base URL."""

    name: str
    prefix: str  # of the --engine URL that selects it ("" for the default)
    engine_help: str
    modes: tuple[str, ...]
    doc: str
    banner: Callable[[Any, argparse.Namespace], tuple[Optional[int], str]]
    swap: Callable[[Any, int, argparse.Namespace, Callable[[float], None]], float]
    workers: Optional[Callable[[Any], list]] = None
    #: The engine's LoRA API, for ``--lora`` (None: the engine has none TensorHub drives).
    lora: Optional[LoraOps] = None

    def base_url(self, engine: str) -> str:
        return engine.removeprefix(self.prefix).rstrip("/")


@dataclass(frozen=True)
class EngineWorker:
    """One engine worker's TensorHub identity, as the engine answers the driver's ``workers``
    query (vLLM: ``/collective_rpc`` ``weight_transfer_engine``, one JSON object per worker)."""

    worker_id: Optional[str]
    model: Optional[str] = None
    version: Optional[int] = None  # the version its parameters hold
    serving: bool = False  # it serves its hf copy (so the coordinator lists what it holds)
    prefetch: bool = False  # it fetches each new version before the swap

    @classmethod
    def parse(cls, answer: Any) -> "EngineWorker":
        """From one worker's JSON answer; anything else is a ``ValueError`` naming it."""
        if isinstance(answer, EngineWorker):
            return answer
        if not isinstance(answer, dict):
            raise ValueError(f"not an engine worker's identity: {answer!r:.200}")
        v = answer.get("version")
        return cls(answer.get("worker_id") or None, answer.get("model"),
                   v if isinstance(v, int) and not isinstance(v, bool) else None,
                   answer.get("serving") is True, answer.get("prefetch") is True)


def drivers() -> dict[str, Any]:
    """Registered drivers by name (entry points, not loaded yet)."""
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=GROUP)}


def pick(argv: Sequence[str]) -> Driver:
    """The driver an ``--engine`` URL in ``argv`` asks for (by prefix; else the default)."""
    engine = ""
    for i, a in enumerate(argv):
        if a.startswith("--engine="):
            engine = a.split("=", 1)[1]
        elif a == "--engine" and i + 1 < len(argv):
            engine = argv[i + 1]
    eps = drivers()
    if not eps:
        raise SystemExit(f"tensorhub follow: no engine driver is installed (entry-point group {GROUP!r})")
    loaded = [ep.load() for ep in eps.values()]
    for d in sorted(loaded, key=lambda d: -len(d.prefix)):
        if d.prefix and engine.startswith(d.prefix):
            return d
    default = [d for d in loaded if not d.prefix]
    if not default:
        raise SystemExit(f"tensorhub follow: no driver for --engine {engine!r} "
                         f"(drivers: {', '.join(d.name + ' ' + repr(d.prefix) for d in loaded)})")
    return default[0]


def progress_text(status: dict, model: str, version: int, stall: float) -> str:
    """The follow progress line from the coordinator's running fetches of ``model`` v``version``
    (the engine's fetch; several engines' fetches are summed)."""
    from ._metrics import FetchProgress

    running = [f for f in status.get("fetches", []) if f["model"] == model and f["version"] == version]
    if not running:
        return f"v{version}: swapping, stall {stall:.1f}s"
    sources: dict[str, int] = {}
    for f in running:
        for w, n in f["sources"].items():
            sources[w] = sources.get(w, 0) + n
    p = FetchProgress(model, version, running[0]["layout"], running[0]["shard"],
                      sum(f["nbytes"] for f in running), sum(f["total"] for f in running),
                      max(f["seconds"] for f in running), sources, sum(f["failed_sources"] for f in running))
    who = ", ".join(sorted(f["worker_id"] for f in running))
    return f"swap {p.line()} (reader {who}; stall {stall:.1f}s)"


def _holders(hub: Any, model: str, version: int) -> tuple[int, list[str]]:
    v = hub.version_info(model, version)
    if v is None:
        return 0, []
    hf = v.layouts.get("hf")
    return (hf.nbytes if hf is not None else 0), sorted({r.worker_id for r in v.replicas})


def parser(engine_help: str, modes: Sequence[str], doc: str) -> argparse.ArgumentParser:
    """The follow options, the same for every engine (``doc``: the driver's description)."""
    p = argparse.ArgumentParser(prog="tensorhub follow", description=doc.split("\n\n")[0])
    p.add_argument("--engine", required=True, help=engine_help)
    p.add_argument("--model", required=True, help="model name on the coordinator")
    p.add_argument("--mode", choices=tuple(modes), default=modes[0],
                   help=f"what pausing does with in-flight requests (default {modes[0]})")
    p.add_argument("--coordinator", help="coordinator URL (default: $TENSORHUB_COORDINATOR)")
    p.add_argument("--token-file", help="file holding the API token (default: $TENSORHUB_TOKEN)")
    p.add_argument("--max-swaps", type=int, default=0, help="stop after this many swaps (0: never)")
    p.add_argument("--engine-worker", default=None,
                   help="the engine's TensorHub worker id (its `worker_id` setting; rank suffixes such as "
                        "-tp1 match too): each swap first waits until that engine holds the new version "
                        "(its `prefetch`), so the engine pauses only to apply a local copy. Default: the "
                        "workers the engine names itself (vLLM: through /collective_rpc, dev mode)")
    p.add_argument("--prefetch-wait", type=float, default=300.0,
                   help="most seconds a swap waits for the engine's prefetch (then it swaps anyway)")
    p.add_argument("--group", default=None,
                   help="fleet switch group: the engines of the group (one follow process each) switch to each "
                        "version in two phases -- all prefetch and say ready, then the ready ones apply; an engine "
                        "not ready by the deadline leaves the group for that version and catches up alone "
                        "(`tensorhub status` and /metrics show the group)")
    p.add_argument("--group-switch", choices=("auto", "caller"), default="auto",
                   help="auto: a round applies once every member is ready (or at --group-wait); caller: only when "
                        "the trainer asks, at its step boundary (Hub.fleet_switch)")
    p.add_argument("--group-wait", type=float, default=60.0,
                   help="seconds a round waits for the group's members to be ready (from its first ready member, "
                        "or from the caller's switch)")
    p.add_argument("--lora", type=int, default=0, metavar="K",
                   help="--model names LoRA adapter versions: load each new one through the engine's LoRA API as "
                        "<model>@v<N> (no pause) and keep the newest K loaded (K >= max staleness + 1); older ones "
                        "are unloaded (requests running with them finish with them). 0: off, follow full weights")
    return p


def engine_holds(status: dict, model: str, version: int, worker: str) -> bool:
    """Does a worker of the engine (``worker`` or ``worker-<rank suffix>``) hold a complete,
    serving replica of ``model`` v``version``, by the coordinator's ``status``?"""
    for m in status.get("models", []):
        if m["model"] != model:
            continue
        for v in m["versions"]:
            if v["version"] != version:
                continue
            return any((r["worker_id"] == worker or r["worker_id"].startswith(worker + "-"))
                       and not r.get("partial") and not r.get("draining") for r in v["replicas"])
    return False


def wait_prefetched(hub: Any, model: str, version: int, worker: "str | Sequence[str]", timeout: float,
                    interval: float = 0.2) -> bool:
    """Wait (up to ``timeout`` s) until the engine's prefetch holds ``version`` (every one of
    ``worker``, when several are named); True if it does."""
    workers = [worker] if isinstance(worker, str) else list(worker)
    end = time.monotonic() + timeout
    while True:
        try:
            status = hub.api.status(retry_timeout=1.0)
            if all(engine_holds(status, model, version, w) for w in workers):
                return True
        except Exception:  # coordinator away a moment: keep waiting until the deadline
            pass
        if time.monotonic() >= end:
            return False
        time.sleep(interval)


def prefetching_workers(model: str, infos: Sequence[Any]) -> tuple[list[str], str]:
    """From what the engine says of its workers (:class:`EngineWorker` or its JSON), the ones
    whose prefetch a swap to ``model`` waits for (those that prefetch it and serve their
    copy, so the coordinator sees them hold it), and a line saying so."""
    ws = [EngineWorker.parse(i) for i in infos]
    on = sorted({w.worker_id for w in ws if w.worker_id and w.prefetch and w.serving and w.model == model})
    if on:
        return on, f"engine worker(s) {', '.join(on)} prefetch {model}: each swap waits until they hold it"
    known = sorted({f"{w.worker_id} ({w.model}, prefetch {'on' if w.prefetch else 'off'})"
                    for w in ws if w.worker_id})
    return [], (f"the engine does not prefetch {model} ({', '.join(known) or 'no TensorHub worker yet'}): "
                "each swap fetches while the engine is paused")


def _engine_workers(args: argparse.Namespace, client: Any,
                    workers: Optional[Callable[[Any], list]]) -> tuple[list[str], Optional[int]]:
    """Whose prefetch each swap waits for: ``--engine-worker`` when given, else the workers
    the engine names itself (``workers(client)``), else none (said on stderr); and the
    version those workers run (an engine reports none before its first swap)."""
    if getattr(args, "engine_worker", None):
        return [args.engine_worker], None
    if workers is None:
        return [], None
    try:
        infos = [EngineWorker.parse(i) for i in workers(client)]
    except Exception as e:  # an older engine, dev mode off: follow still works, the pause covers the fetch
        print(f"tensorhub follow: could not ask the engine for its TensorHub workers ({e}); swaps do not "
              f"wait for a prefetch (--engine-worker ID names the engine's worker)", file=sys.stderr, flush=True)
        return [], None
    ids, line = prefetching_workers(args.model, infos)
    print(line, file=sys.stderr, flush=True)
    runs = [w.version for w in infos if w.model == args.model]
    return ids, (min(runs) if runs and all(v is not None for v in runs) else None)


def follow(args: argparse.Namespace, base_url: str, banner: Callable[[Any], tuple[Optional[int], str]],
           do_swap: Callable[[Any, int, Callable[[float], None]], float],
           workers: Optional[Callable[[Any], list]] = None, lora: Optional[LoraOps] = None) -> int:
    """The loop: connect, then for each newer complete version ``do_swap(client, version,
    show)``, print one line per swap, and keep going after a failed one. ``banner(client)``
    returns the engine's version and the first line to print; ``workers(client)`` what the
    engine says of its TensorHub workers (see :func:`prefetching_workers`; not asked when
    ``--engine-worker`` names one)."""
    import httpx

    import tensorhub

    try:
        hub = tensorhub.connect(config=HubConfig.from_cli(args.coordinator, args.token_file))
    except tensorhub.TensorHubError as e:
        print(f"tensorhub follow: {e}", file=sys.stderr)
        return 2
    if getattr(args, "lora", 0):
        with hub, httpx.Client(base_url=base_url, timeout=600) as client:
            return follow_lora(args, hub, client, lora)
    swaps = 0
    line = ProgressLine(sys.stderr)
    with hub, httpx.Client(base_url=base_url, timeout=600) as client:
        current, first = banner(client)
        print(first, flush=True)
        prefetchers, runs = _engine_workers(args, client, workers)
        if current is None and runs is not None:  # no swap yet: the engine reports no version, its workers do
            current = runs
            print(f"the engine's TensorHub workers run {args.model} v{runs}", file=sys.stderr, flush=True)
        fleet = _Fleet(hub, args, current) if getattr(args, "group", None) else None
        while not args.max_swaps or swaps < args.max_swaps:
            try:
                v = hub.wait_for_version(args.model, newer_than=current, timeout=60 if fleet is None else 3)
            except tensorhub.HubTimeoutError:
                if fleet is not None:
                    fleet.refresh(current)
                continue
            except KeyboardInterrupt:
                return 130
            nbytes, holders = _holders(hub, args.model, v)

            def show(stall: float, v: int = v) -> None:
                line.draw(progress_text(hub.api.status(retry_timeout=1.0), args.model, v, stall))

            waited = ""
            if fleet is not None:
                go, waited = fleet.round(v, prefetchers)
                if go is None:  # a newer version overtook this round: nobody applies it
                    continue
                if not go:  # out of the group for v: catch up alone, then back in
                    prefetchers_ok = not prefetchers or wait_prefetched(hub, args.model, v, prefetchers,
                                                                        args.prefetch_wait)
                    waited += "" if prefetchers_ok else "; swapping without the prefetch"
            elif prefetchers:
                t_wait = time.monotonic()
                if wait_prefetched(hub, args.model, v, prefetchers, args.prefetch_wait):
                    waited = f"; the engine had prefetched it (waited {time.monotonic() - t_wait:.2f}s)"
                else:
                    print(f"v{v}: engine worker {', '.join(prefetchers)} did not hold it within "
                          f"{args.prefetch_wait:.0f}s (prefetch off?); swapping anyway", file=sys.stderr, flush=True)
            try:
                stall = do_swap(client, v, show)
            except RuntimeError as e:
                line.done()
                print(f"v{v}: swap failed, engine kept v{current}: {e}", file=sys.stderr, flush=True)
                if fleet is not None:
                    fleet.applied(v, current, False, str(e))
                time.sleep(1)
                continue
            line.done()
            swaps += 1
            current = v
            if fleet is not None:
                fleet.applied(v, current, True)
            print(f"v{v}: stall {stall:.3f}s, {nbytes / 1e6:.1f} MB from holders {', '.join(holders)}{waited}",
                  flush=True)
    return 0


def follow_lora(args: argparse.Namespace, hub: Any, client: Any, ops: Optional[LoraOps]) -> int:
    """``--lora K``: load each new adapter version (the newest at start when none is
    loaded), keep the newest K, unload the older ones; print one line per load and unload;
    a failed load is said and skipped (a version's bytes never change: retrying would fail
    the same way)."""
    import tensorhub

    k, model = args.lora, args.model
    if ops is None:
        print("tensorhub follow: --lora: this engine's driver drives no LoRA API", file=sys.stderr)
        return 2
    if k < 1:
        print(f"tensorhub follow: --lora must be >= 1 (the adapter versions kept loaded), got {k}", file=sys.stderr)
        return 2
    resident = sorted(ops.loaded(client, model))
    current: Optional[int] = resident[-1] if resident else None
    print(f"following LoRA adapter versions of {model} for {args.engine}, keeping the newest {k} loaded "
          f"(loaded now: {', '.join(f'v{v}' for v in resident) or 'none'})", flush=True)
    loads = 0
    while not args.max_swaps or loads < args.max_swaps:
        try:
            v = None
            if current is None:
                try:
                    v = hub.latest(model)
                except NotFoundError:  # no version yet
                    pass
            if v is None:
                v = hub.wait_for_version(model, newer_than=current, timeout=60)
        except tensorhub.HubTimeoutError:
            continue
        except KeyboardInterrupt:
            return 130
        current = v
        nbytes, holders = _holders(hub, model, v)
        t0 = time.monotonic()
        try:
            ops.load(client, model, v)
        except RuntimeError as e:
            print(f"v{v}: loading {model}@v{v} failed, skipped: {e}", file=sys.stderr, flush=True)
            continue
        loads += 1
        resident = sorted(set(resident) | {v})
        print(f"v{v}: loaded {model}@v{v} in {time.monotonic() - t0:.3f}s, {nbytes / 1e6:.2f} MB from holders "
              f"{', '.join(holders)}", flush=True)
        for old in resident[:-k]:
            try:
                ops.unload(client, model, old)
                print(f"v{old}: unloaded {model}@v{old} (newest {k} kept)", flush=True)
            except RuntimeError as e:
                print(f"v{old}: unloading {model}@v{old} failed: {e}", file=sys.stderr, flush=True)
        resident = resident[-k:]
    return 0


class _Fleet:
    """This follow process's part in a fleet switch group (``tensorhub.server.fleet``): join, say
    ready when the engine holds a version, apply only when the round says go, report the
    outcome. Joins again whenever the coordinator forgot the member (a restart)."""

    def __init__(self, hub: Any, args: argparse.Namespace, version: Optional[int]) -> None:
        self.hub, self.args, self.group, self.member = hub, args, args.group, hub.worker_id
        self.in_round: Optional[int] = None
        self.refresh(version, say=True)

    def refresh(self, version: Optional[int], say: bool = False) -> dict:
        a = self.args
        view = self.hub.api.fleet_join(self.group, self.member, a.model, version, a.group_switch, a.group_wait,
                                       engine=a.engine)
        me = next((m for m in view["members"] if m["member"] == self.member), {})
        if say:
            print(f"fleet group {self.group}: member {self.member}, "
                  + ("in the group" if me.get("in_group") else f"out of the group ({me.get('why_out')})")
                  + f" at v{view['version']}", file=sys.stderr, flush=True)
        self.version = version
        return view

    def _call(self, fn: Callable[[], dict]) -> dict:
        try:
            return fn()
        except NotFoundError as e:
            if e.code not in ("unknown_fleet_member", "unknown_fleet"):
                raise
            self.refresh(self.version, say=True)  # the coordinator forgot us (restarted): join again
            return fn()

    def round(self, v: int, prefetchers: Sequence[str]) -> tuple[Optional[bool], str]:
        """Take part in the round of ``v`` until it decides: (True: apply now, False: this
        member is out for ``v``, None: overtaken by a newer version), and a note."""
        a, t0, ready, said = self.args, time.monotonic(), False, False
        while True:
            if not ready:
                try:
                    status = self.hub.api.status(retry_timeout=1.0) if prefetchers else {}
                except Exception:
                    status = None
                ready = status is not None and all(engine_holds(status, a.model, v, w) for w in prefetchers)
            try:
                r = self._call(lambda: self.hub.api.fleet_ready(self.group, self.member, v) if ready
                               else self.hub.api.fleet_round(self.group, v, self.member))
            except ConflictError as e:  # the group already runs a newer version: follow the newest
                if e.code != "fleet_stale_version":
                    raise
                return None, ""
            if r["state"] in ("apply", "done"):
                break
            if not ready and not said and time.monotonic() - t0 > a.prefetch_wait:
                said = True
                print(f"v{v}: the engine does not hold it after {a.prefetch_wait:.0f}s; fleet group {self.group} "
                      f"goes on without it at the round's deadline", file=sys.stderr, flush=True)
            time.sleep(0.2)
        waited = time.monotonic() - t0
        if self.member in r["go"]:
            self.in_round = v
            return True, (f"; fleet group {self.group}: {len(r['go'])} apply together after {waited:.2f}s"
                          + (f", left: {', '.join(r['left'])}" if r["left"] else ""))
        if not r["go"]:
            return None, ""
        why = "not ready by the round's deadline" if self.member in r["left"] else "out of the group"
        print(f"v{v}: left fleet group {self.group} for v{v} ({why}); catching up alone", file=sys.stderr, flush=True)
        return False, f"; alone, out of fleet group {self.group}"

    def applied(self, v: int, current: Optional[int], ok: bool, error: Optional[str] = None) -> None:
        if self.in_round == v:
            self.in_round = None
            self._call(lambda: self.hub.api.fleet_applied(self.group, self.member, v, ok, error))
        self.refresh(current)  # a member that caught up alone is back in the group


def run(driver: Driver, argv: Optional[Sequence[str]] = None) -> int:
    """Follow with ``driver`` (parses ``argv``)."""
    args = parser(driver.engine_help, driver.modes, driver.doc).parse_args(argv)
    return follow(args, driver.base_url(args.engine), lambda client: driver.banner(client, args),
                  lambda client, v, show: driver.swap(client, v, args, show), workers=driver.workers,
                  lora=driver.lora)


def main(argv: Sequence[str]) -> int:
    """``tensorhub follow ARGS``: pick the driver from ``--engine``, then follow."""
    return run(pick(argv), argv)
