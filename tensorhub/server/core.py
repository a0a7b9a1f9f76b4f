"""The coordinator process's core: the state machine, its durable store, the lock and the
clock (what the HTTP routes of ``coordinator.py`` call), and, on etcd, its leadership.

Each call runs one state-machine method under ``lock`` (microseconds) and queues its
durable writes; they are committed after the lock is let go, batched (group commit), and
a call is answered only once what it saw is durable -- except soft calls (registry only:
heartbeats, renewals, releases, reports), which never wait for the disk.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import threading
import time
from typing import Any, Callable, Optional

from .catalog import Catalog
from .._exceptions import CoordinatorError
from .fleet import FleetGroups
from .manifest_cache import LeaseAnswers, ManifestCache
from .._metrics import CoordinatorMetrics
from .state import CoordinatorState, StateConfig
from .store import SqliteStore

__all__ = ["Coordinator", "NOT_LEADER", "ha_coordinator"]

logger = logging.getLogger("tensorhub.coordinator")

#: The ``code`` of answers from a coordinator that does not lead (HA on etcd): 307 with
#: ``Location`` (and ``leader`` in the body) when it knows the leader, else 503.
NOT_LEADER = "not_leader"


#: Called (if set, in the caller's context) before a call waits for the disk: the HTTP
#: shell's gate (``server.asgi._Guard``) lets go of the caller's slot there, so a slow
#: disk holds no slot and group commits still batch every caller waiting.
before_disk_wait: contextvars.ContextVar[Optional[Callable[[], None]]] = contextvars.ContextVar(
    "tensorhub_before_disk_wait", default=None)


def _waiting_for_disk() -> None:
    hook = before_disk_wait.get()
    if hook is not None:
        hook()


class _Watch:
    """Waiters for a model's next complete version, woken by the publish that completes
    it (no polling). Waiters live on the server's event loop; ``notify`` may be called from
    any thread."""

    def __init__(self) -> None:
        self._waiters: dict[str, set[asyncio.Future]] = {}
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    def register(self, model: str) -> asyncio.Future:
        """Register before reading the state (a version completing in between wakes it)."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        fut = loop.create_future()
        self._waiters.setdefault(model, set()).add(fut)
        return fut

    def forget(self, model: str, fut: asyncio.Future) -> None:
        ws = self._waiters.get(model)
        if ws is not None:
            ws.discard(fut)
            if not ws:
                del self._waiters[model]

    def notify(self, models: set[str]) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake, models)

    def _wake(self, models: set[str]) -> None:
        for m in models:
            for fut in self._waiters.pop(m, ()):
                if not fut.done():
                    fut.set_result(None)


class Subscribers:
    """Held ``POST /v1/leases?wait=`` requests asked ahead (``server.ahead``), by (worker id,
    request id). ``stream`` gets the subscribers a completed version bound (in plan order)
    once that version is durable, and makes, encodes and answers their grants one by one on
    the event loop, each answer sent before the next grant is made (``server.ahead``)."""

    def __init__(self) -> None:
        #: (worker id, request id) -> (its future, when the request arrived: ``time.monotonic()``)
        self._waiters: dict[tuple[str, str], tuple[asyncio.Future, float]] = {}
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self.delivered = 0

    def register(self, worker_id: str, request_id: str, arrived: float) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        self._loop = loop
        fut = loop.create_future()
        old = self._waiters.get((worker_id, request_id))
        if old is not None and not old[0].done():
            old[0].set_result(None)  # (the same poll asked again: the older one answers "pending")
        self._waiters[(worker_id, request_id)] = (fut, arrived)
        return fut

    def forget(self, worker_id: str, request_id: str, fut: asyncio.Future) -> None:
        hit = self._waiters.get((worker_id, request_id))
        if hit is not None and hit[0] is fut:
            del self._waiters[(worker_id, request_id)]

    def stream(self, bound: list, make: Callable[..., Any], encode: Callable[[Any], bytes]) -> None:
        """Answer bound subscribers (``bound``: (worker id, request id, (request, refused) or
        CoordinatorError), plan order) one by one on the event loop: ``make(request,
        refused)`` makes a grant (raising CoordinatorError to answer that instead), which is
        encoded and its held request answered at once, before the next is made (the answer
        is sent meanwhile). Each grant says how long after its request arrived it was made
        (``LeaseGrant.granted_after``: the reader's lease clock; read before the grant, so
        never later than it). A request between two polls finds its grant when it asks
        again. May be called from any thread."""
        loop = self._loop
        if loop is None or loop.is_closed():  # nobody ever held a request here: grants made, kept
            for _, _, x in bound:
                self._make(make, x)
            return
        loop.call_soon_threadsafe(lambda: loop.create_task(self._stream(bound, make, encode)))

    @staticmethod
    def _make(make: Callable[..., Any], x: Any) -> Any:
        if isinstance(x, CoordinatorError):
            return x
        try:
            return make(*x)
        except CoordinatorError as e:
            return e

    async def _stream(self, bound: list, make: Callable[..., Any], encode: Callable[[Any], bytes]) -> None:
        for w, r, x in bound:
            at = time.monotonic()
            x = self._make(make, x)
            hit = self._waiters.pop((w, r), None)
            if hit is None or hit[0].done():
                continue
            fut, arrived = hit
            if not isinstance(x, CoordinatorError):
                x = encode(x.model_copy(update={"granted_after": max(0.0, at - arrived)}))
            fut.set_result(x)
            self.delivered += 1
            await asyncio.sleep(0)  # the woken request sends its answer before the next grant

    def wake_pending(self, answers: list) -> None:
        """Answer these held requests "pending" (``answers``: (worker, request id, None))."""
        loop = self._loop
        if answers and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake, answers)

    def _wake(self, answers: list) -> None:
        for w, r, x in answers:
            fut = self._waiters.pop((w, r), (None, 0.0))[0]
            if fut is not None and not fut.done():
                fut.set_result(x)
                self.delivered += 1


class Coordinator:
    """State machine + durable store + lock + clock: what the HTTP routes call.

    With an ``election`` (highly available coordinators on etcd, ``server.election``) the state
    is built when this process is elected (from the store, as after a restart: a new
    epoch) and every call first checks that it still leads; a commit etcd refuses makes
    it step down, and the request is answered ``not_leader``, never as if it were durable."""

    def __init__(self, state_dir: Optional[str | os.PathLike], config: StateConfig = StateConfig(),
                 clock: Callable[[], float] = time.monotonic, *, store: Any = None, election: Any = None) -> None:
        self.clock = clock
        self.config = config
        self.store = SqliteStore(state_dir) if store is None else store
        self.store.open()
        self.lock = threading.Lock()
        #: ``latest?wait=`` requests, woken when their model's newest version changes.
        self.watch = _Watch()
        #: Leases asked ahead, woken with their answers when their version completes.
        self.subscribers = Subscribers()
        #: ``GET .../manifest`` answers, encoded once per shard (``server.manifest_cache``); a
        #: retired version's entries are dropped when its retirement is applied.
        self.manifests = ManifestCache()
        #: ``POST /v1/leases`` answers: each source replica's addresses encoded once.
        self.lease_answers = LeaseAnswers()
        #: Group commit: writes queued (in order) since the last commit; the sequence
        #: number of the newest queued batch, and of the newest durable one; batches the
        #: store refused (lo, hi, the error their callers get).
        self._commit_lock = threading.Lock()
        self._queued: list[list] = []
        self._seq = self._durable = 0
        self._lost: list[tuple[int, int, CoordinatorError]] = []
        #: Leases asked ahead and bound, waiting for their version's commit: (sequence
        #: number of that batch, [(worker, request id, (request, refused) or error)]).
        self._bound: list[tuple[int, list]] = []
        self.election = election
        #: An elected coordinator whose state is loaded (always True without an election).
        self.serving = election is None
        self.state = CoordinatorState.restore(self.store.load() if election is None else [], config, now=clock())
        self.metrics = CoordinatorMetrics(lambda: self.read(lambda: self.state.metrics_view(self.clock()),
                                                            check=False, soft=True), start_time=time.time())
        #: Fleet switch groups (``server.fleet``): soft state of the coordinator that leads.
        self.fleets = FleetGroups()
        self.metrics.registry.register(self.fleets.collector())
        if election is not None:
            election.on_elected, election.on_deposed = self._elected, self._deposed
            self.metrics.track_election(election)
        else:
            logger.info(
                "coordinator epoch %s on %s (%d models restored)",
                self.state.epoch, self.store.path, len(self.state.models),
            )

    # ------------------------------------------------------------- leadership (HA)
    def leading(self) -> bool:
        """May this process answer requests now? (Always, without an election.)"""
        return self.election is None or (self.serving and self.election.leading())

    def leader_url(self) -> Optional[str]:
        return None if self.election is None else self.election.leader_url()

    def _check_leader(self) -> None:
        if not self.leading():
            raise CoordinatorError("this coordinator is not the leader", NOT_LEADER, status=503)

    def _elected(self, fence: int) -> None:
        with self.lock:
            self.state = CoordinatorState.restore(self.store.load(), self.config, now=self.clock())
            self.manifests.clear()
            self.serving = True
        logger.warning("coordinator epoch %s leads on %s (%d models restored)",
                       self.state.epoch, self.store.path, len(self.state.models))

    def _deposed(self, why: str) -> None:
        self.serving = False  # no lock: resign() may run under it; the state is rebuilt when elected
        with self.fleets.lock:  # soft: the members join the next leader again
            self.fleets.groups.clear()

    # ------------------------------------------------------------- calls and durability
    # A call runs its state-machine method under ``lock`` (microseconds) and queues the
    # method's durable writes; the commit to the store happens after the lock is let go,
    # batched with whatever else is queued (group commit, under ``_commit_lock``). A call
    # is answered only once everything it saw is durable -- its own writes, and writes of
    # others its answer may depend on -- except *soft* calls (heartbeats, renewals,
    # releases, reports: registry only), which never wait for the disk. So a slow disk
    # does not stall heartbeats, and nothing a client was told is lost by a crash.
    def call(self, fn: Callable[..., Any], *args: Any, soft: bool = False) -> Any:
        """Run one state-machine method; unless ``soft``, answer once durable."""
        result, seq = self._apply(fn, args)
        if not soft:
            self.sync(seq)
            self.deliver_durable()
        return result

    async def acall(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``call`` for the event loop."""
        result, seq = self._apply(fn, args)
        await self._async_sync(seq)
        self.deliver_durable()
        return result

    def read(self, fn: Callable[..., Any], *args: Any, check: bool = True, soft: bool = False) -> Any:
        result, seq = self._read(fn, args, check)
        if not soft:
            self.sync(seq)
        return result

    async def aread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``read`` for the event loop."""
        result, seq = self._read(fn, args, True)
        await self._async_sync(seq)
        return result

    def _read(self, fn: Callable[..., Any], args: tuple, check: bool) -> tuple[Any, int]:
        with self.lock:
            if check:
                self._check_leader()
            return fn(*args), self._seq

    async def _async_sync(self, seq: int) -> None:
        """``sync`` for the event loop: only a wait for a commit goes to a thread."""
        if self._durable < seq:
            _waiting_for_disk()
            await asyncio.to_thread(self.sync, seq)
        else:
            self._check_lost(seq)

    def _apply(self, fn: Callable[..., Any], args: tuple) -> tuple[Any, int]:
        with self.lock:
            self._check_leader()
            try:
                result = fn(self.clock(), *args)
            finally:
                completed = self.state.catalog.take_completed()
                bound: list = []
                if completed:
                    self.watch.notify(completed)
                    if self.state.ahead:  # leases asked ahead: bound in the same call
                        try:
                            bound = self.state.bind_ahead(self.clock(), completed)
                        except Exception:  # (never fails the publish; the polls ask again)
                            logger.exception("answering the leases asked ahead of %s failed", sorted(completed))
                writes = self.state.take_writes()
                if writes:
                    self._seq += 1
                    self._queued.append(writes)
                    for table, key, _ in writes:
                        if table == "retire":
                            self.manifests.forget(*key)
                if bound:  # answered once the version they name is durable (``deliver_durable``)
                    self._bound.append((self._seq, bound))
            return result, self._seq

    def deliver_durable(self) -> None:
        """Answer the leases asked ahead whose version is durable now (a grant never names
        a version a failed commit could still take back)."""
        if not self._bound:
            return
        with self.lock:
            ready = [b for b in self._bound if b[0] <= self._durable]
            self._bound = [b for b in self._bound if b[0] > self._durable]
        for _, bound in ready:
            self.subscribers.stream(bound, self._grant_ahead, self.lease_answers.encode)

    def _grant_ahead(self, at: Any, refused: str) -> Any:
        """One bound subscriber's grant (``CoordinatorState.grant_ahead``; soft: leases only)."""
        return self.call(lambda now: self.state.grant_ahead(now, at, refused), soft=True)

    def sync(self, seq: int) -> None:
        """Return once every write queued up to ``seq`` is durable (committing what is
        queued, if no one else is); raise if the store refused them."""
        if self._durable < seq:
            _waiting_for_disk()
            with self._commit_lock:
                if self._durable < seq:
                    with self.lock:
                        batch, self._queued, upto = self._queued, [], self._seq
                    try:
                        self.store.commit([w for ws in batch for w in ws])
                    except Exception as e:
                        self._commit_failed(e)
                        raise self._lost[-1][2] from None
                    self._durable = upto
        self._check_lost(seq)

    def _commit_failed(self, e: Exception) -> None:
        """Memory ran ahead of the store: every queued write (and what was applied on top
        of it) is lost; whoever waits on one of them gets the error."""
        with self.lock:
            lo, hi = self._durable, self._seq
            self._queued = []
            self._revoke([b for b in self._bound if lo < b[0] <= hi])
            self._bound = [b for b in self._bound if not lo < b[0] <= hi]
            if self.election is not None:
                # Refused (deposed) or unknown outcome: never answer it; whoever leads next
                # rebuilds from etcd.
                logger.warning("store commit failed (%s); stepping down", e)
                self.serving = False
                err: CoordinatorError = CoordinatorError(f"not committed, stepped down: {e}", NOT_LEADER, status=503)
            else:
                logger.error("store commit failed (%s); reloading durable state", e)
                self._reload()
                err = CoordinatorError(f"the durable store failed ({type(e).__name__}: {e}); not committed, "
                                       "retry", "store_failed", status=503)
            self._lost = (self._lost + [(lo, hi, err)])[-16:]
            # (calls from now on see the rolled-back state, which is durable: a number past
            # the lost ones, so a read that saw none of them is not refused for them)
            self._seq = self._durable = hi + 1
        if self.election is not None:
            self.election.resign(f"commit failed: {e}")

    def _revoke(self, lost: list) -> None:
        """Subscribers bound to a version whose commit failed: never granted; each held
        request answered "pending" (it asks again and is held again until the version is
        published anew). Under ``lock``."""
        pending = []
        for _, bound in lost:
            for w, r, _ in bound:  # (bound, no grant made yet: nothing to take back but the answer)
                pending.append((w, r, None))
        if pending:
            self.subscribers.wake_pending(pending)

    def _check_lost(self, seq: int) -> None:
        for lo, hi, err in self._lost:
            if lo < seq <= hi:
                raise err

    def _reload(self) -> None:
        """Memory ran ahead of disk: the catalog is read back from the store; the soft
        registry (and everything else in memory) stays."""
        self.state.catalog = Catalog.restore(self.store.load())
        self.manifests.clear()

    def expire(self) -> None:
        """The periodic tick: dead workers, lapsed leases, retention (its writes committed)."""
        if not self.leading():
            return
        dead = self.call(lambda now: self.state.expire(now))
        for wid in dead:
            logger.warning("worker %s stopped heart-beating; its replicas were dropped", wid)

    def close(self) -> None:
        if self.election is not None:
            self.election.stop()
        self.store.close()



def ha_coordinator(store_url: str, advertise_url: str, config: StateConfig = StateConfig(), *,
                   election_ttl: float = 2.0, etcd_ca_file: Optional[str] = None,
                   etcd_cert_file: Optional[str] = None, etcd_key_file: Optional[str] = None) -> Coordinator:
    """A coordinator on etcd (``--store etcd://...``) that leads only when elected.
    Raises ``ConfigError`` for a malformed URL, ``EtcdUnavailable`` when no member answers."""
    from .election import Election
    from .store_etcd import EtcdStore

    tls = dict(ca_file=etcd_ca_file, cert_file=etcd_cert_file, key_file=etcd_key_file)
    store = EtcdStore(store_url, **tls)
    store.open()
    election = Election(store.etcd, store.prefix, advertise_url.rstrip("/"), ttl=election_ttl)
    store.fence = election.fence
    coord = Coordinator(None, config, store=store, election=election)
    election.start()
    return coord
