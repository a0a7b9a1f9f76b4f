"""A simulated world around the coordinator's state machine, for the model-checking tests.

``tests/test_state_model.py`` (hypothesis, random long runs) and
``tests/test_state_exhaustive.py`` (every interleaving of a small scope) drive the same
:class:`World`: the real ``CoordinatorState`` plus what the state machine cannot see --
holders' memory buffers, readers' reads, the true time, the coordinator's clock, faults.

What the world models (DESIGN.md, "Protocol and its invariants" and "Faults come one
plane at a time"):

* **Holders** own buffers. Each buffer has a *generation*, bumped whenever the holder
  overwrites it. A holder publishes a version from a free buffer (``register_replica``
  with addresses naming that buffer) and frees it only when ``unpublish`` answers
  ``drained=True``: the buffer is then overwritten at once (the worst case). A holder
  re-registers like the real Hub: a heartbeat answered "unknown worker" registers the
  worker, and its held replicas follow in a separate step (``rereg``; the Hub's
  ``_reregister`` does not exclude a concurrent ``unpublish``, so another call can come
  in between); any other call answered "unknown worker" re-registers everything and
  retries once (``Hub._as_worker``). Every held buffer is re-registered, including one
  being unpublished (the Hub keeps it in ``_held`` until drained), at the same addresses.
* **Readers** acquire a lease, note the generation and the content of every buffer the
  grant names, may renew, and release. A reader *accepts* the bytes only if release
  answers True and its own bound holds: it trusts a lease only until (true time at which
  it sent its last successful acquire or renew) + ``lease_ttl``. Reader and coordinator
  clocks run at the same rate; the coordinator's may be offset and step.
* **Faults**, one plane at a time: a holder partitioned from the coordinator (sends
  nothing, misses heartbeats, is expired; readers keep reading its memory); coordinator
  clock steps (the ``now`` it is given jumps forward or back; true time does not); a
  coordinator pause (no calls for longer than ``worker_ttl``; its first call after it is
  its own ``expire``); a coordinator restart (durable rows into
  ``CoordinatorState.restore``; soft state and leases forgotten; clients find out when a
  call is answered "unknown worker"); a reader crash (its lease is never released).

**Safety property** (checked on every acceptance, no exemption): every buffer the lease
named held the leased version when the lease named it, and its generation did not change
between then and the release. **Rule 3** (``World(trust_check=True)``, checked on every
overwrite): no reader still trusts, by its own bound, a lease that named the buffer at the
generation being overwritten -- "the coordinator's expiry is never earlier" than the
reader's bound, whatever happened to the reader's registration (expired while cut off,
removed, back again). It assumes what the real coordinator's ``time.monotonic()`` gives: a
clock that never runs ahead of true time, so worlds with forward clock steps check the
acceptance property only (a reader there learns from ``release`` that its lease lapsed). Also checked on every state: ``latest`` is a version whose
replica was registered (complete), the counter covers every version handed out, and
versions handed out strictly increase (never reused, also across restarts).

Not modelled: bytes (the generation stands for them), multi-shard layouts, pipelined
(partial) replicas and chunk reports, source failure reports, the HTTP shell and its
retries except where named above, network delay between a call and its answer (calls are
instantaneous; the reader's bound counts from the send, which is what a real reader can
do), a holder process dying (both planes at once: its reads fail loudly).
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import pickle
import re
from dataclasses import dataclass
from typing import Any, Optional

from tensorhub import ConflictError, NotFoundError, RetentionError
from tensorhub.server.state import CoordinatorState, StateConfig
from tensorhub.protocol import AcquireLease, LeaseGrant, Locality, Manifest, RegisterReplica, TensorSpec

MODEL = "m"
MANIFEST = Manifest(tensors=[TensorSpec(name="w", dtype="float32", shape=(4,), nbytes=16)])
LOC = Locality(datacenter="d", zone="z", host="h")

#: Does the state machine take idempotency keys yet (rule 5)? The model only retries
#: with one when it does; ``test_state_model``'s focused tests check it either way.
HAS_ALLOC_REQUEST_ID = "request_id" in inspect.signature(CoordinatorState.allocate_version).parameters
HAS_LEASE_REQUEST_ID = "request_id" in AcquireLease.model_fields


#: Failures of the state machine at 8941ddb, fixed since (their traces are regression tests).
RESTART_GAP = ("after a restart, unpublish by a worker whose replicas are not registered again yet "
               "answers drained=True inside the restart window (the `not mine and not fenced` early "
               "return comes before the `boot + lease_ttl` check)")
RESTART_EDGE = ("at now == boot + lease_ttl unpublish already drains (now < boot + ttl) while "
                "release of an earlier-epoch lease still answers True (now <= boot + ttl)")
FORWARD_THEN_RESTART = ("a forward clock step makes the old incarnation drain a lease early; the new one "
                        "vouches for that lease until boot + lease_ttl, and the reader's own bound still "
                        "holds: fixed by the design decision that release of an "
                        "earlier-epoch lease answers False)")


class Violation(AssertionError):
    """The safety property (or a state invariant) failed; the message holds the trace."""


def make_config(lease_ttl: float, worker_ttl: float, **extra: float) -> StateConfig:
    """A ``StateConfig`` with the given ttls (and any of ``extra`` the class knows)."""
    names = {f.name for f in dataclasses.fields(StateConfig)}
    kw = {k: v for k, v in extra.items() if k in names}
    return StateConfig(lease_ttl=lease_ttl, worker_ttl=worker_ttl, suspect_ttl=lease_ttl,
                       group_ttl=100 * lease_ttl, **kw)


@dataclass
class Scope:
    """Who takes part and the timing (seconds; the exhaustive search uses whole ticks)."""

    holders: tuple[str, ...] = ("h0", "h1")
    readers: tuple[str, ...] = ("r0", "r1")
    buffers: int = 2  # per holder: double-buffering
    max_versions: int = 2  # versions the holders may allocate (None: unbounded)
    lease_ttl: float = 4.0
    worker_ttl: float = 2.0
    #: Time between two coordinator ticks (its ``expire`` timer); at most the pause grace.
    tick: float = 1.0


@dataclass
class Buffer:
    gen: int = 0
    version: Optional[int] = None  # the version whose bytes it holds (None: free)
    pending: bool = False  # unpublish called, not drained yet (informational)
    #: Holder fence (``World(holder_fence=True)``): not overwritten before this true time.
    fence_until: float = float("-inf")
    waiting: bool = False  # drained, waiting out its fence (still held: re-registered like the Hub)


@dataclass
class Holder:
    buffers: list[Buffer]
    partitioned: bool = False  # cut off from the coordinator (control plane only)
    need_replicas: bool = False  # worker re-registered, its replicas not yet
    endpoint: int = 0  # bumped when its transport comes back on a new endpoint


@dataclass
class Read:
    """One buffer a reader's lease named: its generation then and whether it held the version."""

    gen: int
    held_version: bool


@dataclass
class ReaderLease:
    lease_id: str
    version: int
    reads: dict[tuple[str, int], Read]
    trusted_until: float  # true time: send time of the last successful acquire/renew + ttl


@dataclass
class Reader:
    lease: Optional[ReaderLease] = None
    partitioned: bool = False


@dataclass
class Stats:
    accepted: int = 0
    rejected: int = 0  # release False, or the reader's own bound ran out
    drained: int = 0  # buffers overwritten after unpublish answered drained
    grants: int = 0


class World:
    """The state machine plus holders, readers, true time and the coordinator's clock offset."""

    def __init__(self, scope: Scope, config: Optional[StateConfig] = None, holder_fence: bool = False,
                 trust_check: bool = False) -> None:
        self.scope = scope
        #: Check rule 3 on every overwrite (module docstring); only without forward clock steps.
        self.trust_check = trust_check
        #: The Hub's holder rule (``tensorhub/_fencing.py``): a holder that learns it was
        #: dropped (expired, or the coordinator restarted) does not overwrite what it held
        #: then for one more ``lease_ttl``, even after ``drained``. Off: the state machine alone.
        self.holder_fence = holder_fence
        self.config = config or make_config(scope.lease_ttl, scope.worker_ttl)
        self.t = 0.0  # true time (readers' and holders' clocks)
        self.off = 0.0  # coordinator clock = t + off
        self.s = CoordinatorState(self.config, now=self.c)
        self.holders = {h: Holder([Buffer() for _ in range(scope.buffers)]) for h in scope.holders}
        self.readers = {r: Reader() for r in scope.readers}
        self.issued: list[int] = []  # versions handed out, in order
        self.complete: set[int] = set()  # versions that had a complete replica registered
        self.trace: list[str] = []
        self.stats = Stats()
        self._req = itertools.count(1)
        for w in (*scope.holders, *scope.readers):
            self.s.register_worker(self.c, w, self._endpoint(w), LOC)

    # ------------------------------------------------------------------ plumbing
    @property
    def c(self) -> float:
        """What the coordinator's clock reads now."""
        return self.t + self.off

    def copy(self) -> "World":
        return pickle.loads(pickle.dumps(self, pickle.HIGHEST_PROTOCOL))

    def apply(self, action: tuple) -> None:
        """Run one action given as ``(method name, *arguments)``."""
        getattr(self, action[0])(*action[1:])

    def _endpoint(self, w: str) -> str:
        h = self.holders.get(w)
        return f"ep-{w}-{h.endpoint if h else 0}"

    @staticmethod
    def address(holder_index: int, buf: int) -> int:
        return 4096 * (1 + 16 * holder_index + buf)

    def _buffer_of(self, worker: str, addresses: list[int]) -> Optional[tuple[str, int]]:
        if worker not in self.holders or len(addresses) != 1:
            return None
        i = self.scope.holders.index(worker)
        for b in range(self.scope.buffers):
            if addresses[0] == self.address(i, b):
                return worker, b
        return None

    def fail(self, what: str) -> None:
        raise Violation(f"{what}\n  after {len(self.trace)} steps:\n    " + "\n    ".join(self.trace))

    def _log(self, msg: str) -> None:
        self.trace.append(f"t={self.t:g} c={self.c:g}: {msg}")

    def _held(self, h: str, v: int) -> Optional[int]:
        for b, buf in enumerate(self.holders[h].buffers):
            if buf.version == v:
                return b
        return None

    def _free(self, h: str) -> Optional[int]:
        for b, buf in enumerate(self.holders[h].buffers):
            if buf.version is None:
                return b
        return None

    def _register(self, h: str, b: int) -> None:
        v = self.holders[h].buffers[b].version
        i = self.scope.holders.index(h)
        self.s.allocate_version(self.c, MODEL, v)  # the Hub names the version first
        self.s.register_replica(self.c, RegisterReplica(
            worker_id=h, model=MODEL, version=v, manifest=MANIFEST, addresses=[self.address(i, b)]))

    def _learned_dropped(self, h: str) -> None:
        if self.holder_fence:
            for buf in self.holders[h].buffers:
                if buf.version is not None:
                    buf.fence_until = max(buf.fence_until, self.t + self.scope.lease_ttl)

    def _overwrite(self, h: str, b: int) -> None:
        buf = self.holders[h].buffers[b]
        if self.trust_check:
            for r, rd in self.readers.items():
                l = rd.lease
                read = None if l is None else l.reads.get((h, b))
                if read is not None and read.held_version and read.gen == buf.gen and self.t <= l.trusted_until:
                    self.fail(f"{h} overwrites buffer {b} (v{buf.version}, gen {buf.gen}) while {r} still trusts "
                              f"{l.lease_id} on it (until t={l.trusted_until:g}): the coordinator let it drain "
                              "before the reader's own bound")
        buf.gen += 1
        buf.version, buf.pending, buf.waiting = None, False, False
        self.stats.drained += 1

    def _settle(self) -> None:
        """Holders waiting out a fence overwrite as soon as it ends (the worst case)."""
        for h, hd in self.holders.items():
            for b, buf in enumerate(hd.buffers):
                if buf.waiting and self.t >= buf.fence_until:
                    self._overwrite(h, b)
                    self._log(f"{h} fence over: buffer {b} overwritten (gen {buf.gen})")

    def unpublishable(self, h: str) -> list[int]:
        """Versions holder ``h`` may call unpublish for (held, not already waiting a fence)."""
        return sorted(b.version for b in self.holders[h].buffers if b.version is not None and not b.waiting)

    def _rereg_all(self, h: str) -> None:
        self.s.register_worker(self.c, h, self._endpoint(h), LOC)
        for b, buf in enumerate(self.holders[h].buffers):
            if buf.version is not None:
                self._register(h, b)
        self.holders[h].need_replicas = False

    def _as_worker(self, w: str, fn, *args):
        """A worker's call; "unknown worker" re-registers it (all it holds) and retries once."""
        try:
            return fn(*args)
        except NotFoundError as e:
            if e.code != "unknown_worker":
                raise
            if w in self.holders:
                self._learned_dropped(w)
                self._rereg_all(w)
            else:
                self.s.register_worker(self.c, w, self._endpoint(w), LOC)
            return fn(*args)

    def _heartbeat(self, w: str) -> None:
        try:
            self.s.heartbeat(self.c, w)
        except NotFoundError:
            self.s.register_worker(self.c, w, self._endpoint(w), LOC)
            h = self.holders.get(w)
            if h is not None and any(b.version is not None for b in h.buffers):
                h.need_replicas = True
                self._learned_dropped(w)

    def _heartbeats(self, skip: str = "") -> None:
        for w in (*self.scope.holders, *self.scope.readers):
            if w != skip and not (self.holders[w] if w in self.holders else self.readers[w]).partitioned:
                self._heartbeat(w)

    def _issue(self, v: int) -> None:
        if any(v <= x for x in self.issued):
            self.fail(f"version {v} handed out again or out of order (handed out: {self.issued})")
        self.issued.append(v)

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        """State invariants (the acceptance property is checked where it happens)."""
        m = self.s.models.get(MODEL)
        if m is None:
            if self.issued:
                self.fail(f"model forgotten after versions {self.issued} were handed out")
            return
        latest = self.s.latest(MODEL)
        if latest is not None and latest not in self.complete:
            self.fail(f"latest() = {latest}, which never had a complete replica")
        if self.issued and m.counter < max(self.issued):
            self.fail(f"counter {m.counter} below handed-out version {max(self.issued)}")

    # ------------------------------------------------------------------ time and faults
    def tick(self, d: float) -> None:
        """Time passes by ``d``; everyone not cut off heart-beats; the coordinator expires.
        Keep ``d`` within the pause grace (``worker_ttl / 2``): the real shell calls
        ``expire`` every second, so only a real pause leaves a longer gap."""
        self.t += d
        self._log(f"tick {d:g}")
        self._heartbeats()
        self.s.expire(self.c)
        self._settle()

    def partition(self, h: str) -> None:
        """Macro: holder ``h`` is cut off from the coordinator for ``worker_ttl`` + one tick
        (everyone else heart-beats, the coordinator expires every tick), then its heartbeat
        comes back (answered "unknown worker": it registers again)."""
        self._log(f"holder {h} cut off for {self.scope.worker_ttl + self.scope.tick:g}")
        for _ in range(int(round(self.scope.worker_ttl / self.scope.tick)) + 1):
            self.t += self.scope.tick
            self._heartbeats(skip=h)
            self.s.expire(self.c)
        self._heartbeat(h)
        self._settle()

    def reader_cut(self, r: str) -> None:
        """Macro: reader ``r`` is cut off from the coordinator for ``worker_ttl`` + one tick
        (it cannot renew or release; everyone else heart-beats and the coordinator expires
        every tick, so it is expired while it holds its lease and keeps reading), then its
        heartbeat comes back (answered "unknown worker": it registers again)."""
        self._log(f"reader {r} cut off for {self.scope.worker_ttl + self.scope.tick:g}")
        for _ in range(int(round(self.scope.worker_ttl / self.scope.tick)) + 1):
            self.t += self.scope.tick
            self._heartbeats(skip=r)
            self.s.expire(self.c)
            self._settle()
        self._heartbeat(r)

    def set_partitioned(self, w: str, on: bool) -> None:
        self._log(f"{w} {'cut off from' if on else 'reconnected to'} the coordinator")
        (self.holders[w] if w in self.holders else self.readers[w]).partitioned = on
        if not on:
            self._heartbeat(w)

    def step(self, delta: float) -> None:
        """The coordinator's clock steps (true time does not move)."""
        self.off += delta
        self._log(f"coordinator clock steps {delta:+g}")

    def pause(self, d: float) -> None:
        """The coordinator makes no progress for ``d``; its own expiry runs first on resume."""
        self.t += d
        self._log(f"coordinator paused for {d:g}")
        self.s.expire(self.c)
        self._settle()

    def restart(self) -> None:
        """The coordinator restarts from its durable rows; soft state is gone."""
        self._log("coordinator restarts")
        self.s = CoordinatorState.restore(self.s.durable_rows(), self.config, now=self.c)

    # ------------------------------------------------------------------ holders
    def publish(self, h: str, request_retry: bool = False) -> None:
        """Holder ``h`` publishes a new version from a free buffer (allocate + register).
        ``request_retry``: the first allocation's answer is lost and retried with the same
        idempotency key (rule 5); the retry must answer the same version."""
        b = self._free(h)
        if request_retry and HAS_ALLOC_REQUEST_ID:
            rid = f"{h}-alloc-{next(self._req)}"
            v = self.s.allocate_version(self.c, MODEL, None, request_id=rid)
            v2 = self.s.allocate_version(self.c, MODEL, None, request_id=rid)
            if v2 != v:
                self.fail(f"allocate_version retried with request_id {rid}: {v2} != first answer {v}")
        else:
            v = self.s.allocate_version(self.c, MODEL)
        self._issue(v)
        buf = self.holders[h].buffers[b]
        buf.version, buf.pending = v, False
        self._log(f"{h} publishes v{v} from buffer {b} (gen {buf.gen})")
        self._as_worker(h, self._register, h, b)
        self.complete.add(v)

    def copy_version(self, h: str, v: int) -> None:
        """Holder ``h`` (which got v's bytes, e.g. by a fetch) registers them from a free buffer."""
        b = self._free(h)
        buf = self.holders[h].buffers[b]
        buf.version, buf.pending = v, False
        self._log(f"{h} registers a copy of v{v} from buffer {b} (gen {buf.gen})")
        self._as_worker(h, self._register, h, b)
        self.complete.add(v)

    def rereg(self, h: str) -> None:
        """The second half of the Hub's re-registration: every held replica again."""
        self._log(f"{h} re-registers its replicas")
        self.holders[h].need_replicas = False
        for b, buf in enumerate(self.holders[h].buffers):
            if buf.version is not None:
                self._as_worker(h, self._register, h, b)

    def rebind(self, h: str) -> None:
        """Holder ``h``'s transport comes back on a new endpoint, same memory (its old
        endpoint is assumed to keep serving reads: the conservative case)."""
        self.holders[h].endpoint += 1
        self._log(f"{h} re-registers with a new endpoint")
        self.s.register_worker(self.c, h, self._endpoint(h), LOC)
        if any(b.version is not None for b in self.holders[h].buffers):
            self.holders[h].need_replicas = True

    def leave(self, h: str) -> None:
        """Holder ``h`` disconnects (``remove_worker``) but keeps its memory, and keeps
        heart-beating: its next heartbeat registers it again."""
        self._log(f"{h} is removed (remove_worker)")
        try:
            self.s.remove_worker(self.c, h)
        except NotFoundError:
            pass

    def unpublish(self, h: str, v: int) -> None:
        """Holder ``h`` asks to unpublish v; only ``drained=True`` lets it overwrite the buffer."""
        b = self._held(h, v)
        buf = self.holders[h].buffers[b]
        try:
            drained, open_ = self._as_worker(h, self.s.unpublish, self.c, h, MODEL, v)
        except RetentionError:
            self._log(f"{h} unpublish v{v}: refused (retention)")
            return
        if drained and self.t < buf.fence_until:
            buf.waiting = True
            self._log(f"{h} unpublish v{v}: drained; buffer {b} waits its fence until t={buf.fence_until:g}")
        elif drained:
            self._overwrite(h, b)
            self._log(f"{h} unpublish v{v}: drained; buffer {b} overwritten (gen {buf.gen})")
        else:
            buf.pending = True
            self._log(f"{h} unpublish v{v}: {open_} lease(s) open")

    # ------------------------------------------------------------------ readers
    def _note_grant(self, r: str, grant, lease: Optional[ReaderLease]) -> ReaderLease:
        if grant.version != lease_version(grant, lease):
            self.fail(f"{r} got a grant for v{grant.version}, asked for v{lease_version(grant, lease)}")
        if lease is None:
            lease = ReaderLease(grant.lease_id, grant.version, {}, self.t + self.scope.lease_ttl)
        for rep in grant.replicas:
            where = self._buffer_of(rep.worker_id, list(rep.addresses))
            if where is None:
                self.fail(f"{r}'s grant names {rep.worker_id} at {rep.addresses}: no such buffer")
            if where not in lease.reads:
                buf = self.holders[where[0]].buffers[where[1]]
                lease.reads[where] = Read(buf.gen, buf.version == grant.version)
        return lease

    def acquire(self, r: str, v: int, retry_after: Optional[float] = None) -> None:
        """Reader ``r`` asks for a lease on v. ``retry_after``: the first answer is lost and
        the request is sent again that much later with the same idempotency key (rule 5):
        while the first lease is open it must be answered with that lease. The reader's
        bound counts from the first send (what ``Hub._acquire`` records)."""
        sent = self.t
        kw: dict[str, Any] = {}
        if retry_after is not None and HAS_LEASE_REQUEST_ID:
            kw["request_id"] = f"{r}-lease-{next(self._req)}"
        req = AcquireLease(worker_id=r, model=MODEL, version=v, **kw)
        try:
            grant = self._as_worker(r, self.s.acquire_lease, self.c, req)
        except (ConflictError, NotFoundError) as e:
            self._log(f"{r} acquire v{v}: {e.code}")
            newest = self.s.latest(MODEL)
            if e.code == "version_gone" and (newest is None or v >= newest or f"v{newest}" not in e.message):
                self.fail(f"version_gone for v{v} (newest complete: {newest}): {e.message}")
            return
        if kw:
            first = grant
            self._log(f"{r} acquire v{v}: answer {first.lease_id} lost; retry after {retry_after:g}")
            self.t += retry_after
            try:
                grant = self._as_worker(r, self.s.acquire_lease, self.c, req)
            except (ConflictError, NotFoundError) as e:
                self._log(f"{r} acquire v{v} (retry): {e.code}")
                return
            if grant.lease_id != first.lease_id and first.lease_id in self.s.leases \
                    and self.s.leases[first.lease_id].expires >= self.s.clock:
                self.fail(f"acquire_lease retried with request_id {kw['request_id']}: lease {grant.lease_id} "
                          f"!= first answer {first.lease_id}, which is still open")
        self.stats.grants += 1
        self.readers[r].lease = lease = self._note_grant(r, grant, None)
        lease.trusted_until = sent + self.scope.lease_ttl
        self._log(f"{r} acquires v{v}: {grant.lease_id} on "
                  + ", ".join(f"{h}/buf{b} gen {rd.gen}" for (h, b), rd in lease.reads.items()))

    def refresh(self, r: str) -> None:
        """Reader ``r`` asks its lease again (``AcquireLease(lease_id=...)``): it may be sent
        to more replicas; the expiry is not extended."""
        lease = self.readers[r].lease
        req = AcquireLease(worker_id=r, model=MODEL, version=lease.version, lease_id=lease.lease_id)
        try:
            grant = self.s.acquire_lease(self.c, req)
        except (ConflictError, NotFoundError) as e:
            self._log(f"{r} refresh {lease.lease_id}: {e.code}")
            return
        if grant.lease_id != lease.lease_id:
            return  # a lease the coordinator no longer knows came back as a new one: keep the old
        self._note_grant(r, grant, lease)
        self._log(f"{r} refreshes {lease.lease_id}")

    def renew(self, r: str) -> None:
        lease = self.readers[r].lease
        try:
            self.s.renew_lease(self.c, lease.lease_id)
        except (ConflictError, NotFoundError) as e:
            self._log(f"{r} renew {lease.lease_id}: {e.code}")
            return
        lease.trusted_until = self.t + self.scope.lease_ttl
        self._log(f"{r} renews {lease.lease_id}")

    def release(self, r: str) -> None:
        """Reader ``r`` ends its read. Accepting bytes that changed is the violation."""
        lease = self.readers[r].lease
        self.readers[r].lease = None
        try:
            valid = self.s.release_lease(self.c, lease.lease_id)
        except (ConflictError, NotFoundError):
            valid = False
        own = self.t <= lease.trusted_until
        self._log(f"{r} releases {lease.lease_id}: coordinator says {valid}, own bound "
                  f"{'holds' if own else 'ran out'}")
        if not (valid and own):
            self.stats.rejected += 1
            return
        self.stats.accepted += 1
        for (h, b), rd in lease.reads.items():
            buf = self.holders[h].buffers[b]
            if not rd.held_version:
                self.fail(f"{r} accepted v{lease.version} read from {h}/buf{b}, which did not hold it "
                          "when the lease named it")
            if buf.gen != rd.gen:
                self.fail(f"{r} accepted v{lease.version} read from {h}/buf{b}, overwritten during "
                          f"the lease (gen {rd.gen} -> {buf.gen})")

    def crash(self, r: str) -> None:
        """Reader ``r`` dies mid-read: its lease is never released."""
        self._log(f"{r} crashes holding {self.readers[r].lease.lease_id}")
        self.readers[r].lease = None

    # ------------------------------------------------------------------ canonical form
    def key(self) -> tuple:
        """A canonical abstraction of the whole world, for deduplication: times relative to
        now (coordinator fields to the coordinator's clock, the world's to true time),
        facts long past clamped, ids renamed by what they name, observability counters and
        the order of equal candidates dropped."""
        horizon = 2 * self.scope.lease_ttl + self.scope.worker_ttl + 1
        names = _id_names(self.s)
        coord = _Canon(self.c, horizon, names, self.s.epoch)(self.s)
        hold = tuple((h.partitioned, h.need_replicas, h.endpoint,
                      tuple((b.version, b.pending, b.waiting, max(b.fence_until - self.t, -1.0)) for b in h.buffers))
                     for h in self.holders.values())
        reads = []
        for r in self.readers.values():
            l = r.lease
            if l is None:
                reads.append((r.partitioned, None))
                continue
            reads.append((r.partitioned, _rename(l.lease_id, names, self.s.epoch), l.version,
                          max(l.trusted_until - self.t, -1.0),
                          tuple(sorted((k, rd.held_version, rd.gen == self.holders[k[0]].buffers[k[1]].gen)
                                       for k, rd in l.reads.items()))))
        return coord, hold, tuple(reads), tuple(self.issued), tuple(sorted(self.complete))


def lease_version(grant, lease: Optional[ReaderLease]) -> int:
    return grant.version if lease is None else lease.version


# Fields that never change a decision: counters for observability, pipelining hints, and
# timestamps only used to order equal candidates or to report.
_NOISE = frozenset({"config", "epoch", "_ids", "_writes", "fetching", "seeders", "groups", "served", "pauses",
                    "served_leases", "served_bytes", "start", "reverse", "reserved", "coming", "created",
                    "registered_at", "granted_at"})
_ID = re.compile(r"^([a-z]+)-([0-9a-f]{8})-(\d+)$")


def _id_names(s: CoordinatorState) -> dict[str, tuple]:
    """Replica and lease ids -> what they name (ids are counters: equal states differ in them)."""
    names: dict[str, tuple] = {}
    seen: dict[tuple, int] = {}

    def add(i: str, sig: tuple) -> None:
        if i in names:
            return
        n = seen.get(sig, 0)
        seen[sig] = n + 1
        names[i] = sig + (n,)

    for value in vars(s).values():
        if not isinstance(value, dict):
            continue
        for k, o in sorted(value.items(), key=lambda kv: repr(kv[0])):
            if isinstance(k, str) and hasattr(o, "replica_id"):
                add(k, ("R", o.worker_id, o.version, tuple(o.addresses)))
            elif isinstance(k, str) and hasattr(o, "lease_id"):
                add(k, ("L", o.worker_id, o.version))
    return names


def _rename(x: str, names: dict[str, tuple], epoch: str) -> Any:
    if x in names:
        return names[x]
    m = _ID.match(x)
    if m is None:
        return x
    return ("id", m.group(1), "this" if m.group(2) == epoch else "earlier")


class _Canon:
    """Canonical form of any value of the state machine (see ``World.key``)."""

    def __init__(self, now: float, horizon: float, names: dict[str, tuple], epoch: str) -> None:
        self.now, self.horizon, self.names, self.epoch = now, horizon, names, epoch

    def __call__(self, o: Any) -> Any:
        t = type(o)
        if t is float:
            return max(round(o - self.now, 6), -self.horizon)
        if o is None or t is int or t is bool:
            return o
        if t is str:
            return _rename(o, self.names, self.epoch)
        if t is dict:
            return _sorted([(self(k), self(v)) for k, v in o.items()])
        if t is list or t is tuple:
            return tuple([self(v) for v in o])
        if t is set or t is frozenset:
            return _sorted([self(v) for v in o])
        if t is Manifest or t is Locality:
            return t.__name__
        if t is LeaseGrant:  # a remembered answer (idempotent retries)
            return ("grant", _rename(o.lease_id, self.names, self.epoch),
                    tuple((r.worker_id, tuple(r.addresses)) for r in o.replicas))
        d = getattr(o, "__dict__", None)
        if d is None:
            return t.__name__
        return (t.__name__,) + tuple([(k, self(d[k])) for k in _fields(t, d)])


_FIELDS: dict[type, tuple[str, ...]] = {}


def _fields(t: type, d: dict) -> tuple[str, ...]:
    f = _FIELDS.get(t)
    if f is None:  # dataclasses and pydantic models: every instance has the same fields
        f = _FIELDS[t] = tuple(sorted(k for k in d if k not in _NOISE))
    return f


def _sorted(items: list) -> tuple:
    try:
        items.sort()
    except TypeError:
        items.sort(key=repr)
    return tuple(items)
