"""The rollout side: read a version bucket by bucket, or from a copy prefetched earlier.

Runs in verl's rollout worker processes (``CheckpointEngineWorker``), which hand what
:meth:`Receiver.stream` yields to the rollout server's ``update_weights``.

* **Streamed** (no prefetched copy of the version): the version's ``hf`` tensors are cut,
  in manifest order, into buckets of at most ``bucket_size`` bytes; each bucket is one
  ``hub.fetch(names=..., into=views, serve=False)`` into one of two reused buffers, the next
  bucket read while the consumer takes the current one. A tensor larger than the bucket
  is read alone into its own tensor (as verl's own engines merge oversized chunks). Extra
  memory: two buckets, plus the largest oversized tensor. A yielded tensor is valid until
  the consumer asks for the item after its bucket's last (as with verl's NCCL/NIXL engines).
* **Cached** (``prefetch``): a background thread fetches a version whole into a local copy,
  ``serve=True``: the copy is one more replica, so other rollouts read it from here instead
  of all reading the trainer. ``stream`` and ``get_weights`` then read that copy locally.
  Before the copy's memory is reused for a newer version, its version is unpublished (its
  readers drained) and no local consumer is reading it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from tensorhub import FetchError, NotFoundError, TensorHubError
from tensorhub.protocol import SLICED

from tensorhub.integrations._core.worker import ask_ahead_after, deltas_published

__all__ = ["Receiver", "plan_buckets", "StreamStats"]

logger = logging.getLogger(__name__)

ALIGN = 64


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def plan_buckets(specs: list, limit: int) -> list[list]:
    """Specs (``.name .nbytes``, manifest order) in runs of at most ``limit`` bytes, each
    tensor 64-byte aligned in its buffer; a tensor larger than ``limit`` is a bucket alone."""
    out: list[list] = []
    cur: list = []
    used = 0
    for s in specs:
        n = _padded(s.nbytes)
        if cur and used + n > limit:
            out.append(cur)
            cur, used = [], 0
        cur.append(s)
        used += n
    if cur:
        out.append(cur)
    return out


@dataclass
class StreamStats:
    """What the last receive did (for logs, metrics and tests)."""

    version: int = 0
    source: str = ""  # "stream" or "cache"
    buckets: int = 0
    nbytes: int = 0
    largest_bucket: int = 0  # bytes read by one fetch into a reused buffer
    buffer_bytes: int = 0  # the two reused buffers together
    oversized: int = 0  # bytes of the largest tensor read alone (larger than a bucket)
    seconds: float = 0.0
    sources: dict = field(default_factory=dict)


class _Cache:
    """A prefetched whole version (served), and who reads it locally."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.version: Optional[int] = None  # complete and readable
        self.tensors: Optional[dict] = None
        self.fetching: Optional[int] = None  # a fetch in flight for this version
        self.error: Optional[BaseException] = None
        self.readers = 0
        self.spare: Optional[dict] = None  # an unpublished older copy, memory for the next fetch


def _missing(info: Any) -> str:
    """Why a version is not complete, for the timeout error: the trainer ranks whose slices
    are not in (sliced publishing), else that nothing was published."""
    sl = info.layouts.get(SLICED)
    if sl is None:
        return "did the trainer publish it?"
    done = sorted({r.shard for r in info.replicas if r.layout == SLICED})
    missing = [s for s in range(sl.num_shards) if s not in done]
    return (f"published as slices: {len(done)} of {sl.num_shards} trainer ranks registered theirs, ranks "
            f"{missing} did not (did a trainer rank fail mid-send?); no partial weights were handed over")


class Receiver:
    """One rollout worker's reads (reader; a holder too when it prefetches)."""

    def __init__(self, hub: Any, model: str, bucket_size: int, timeout: float) -> None:
        if bucket_size < ALIGN:
            raise ValueError(f"tensorhub: bucket_size must be at least {ALIGN} bytes, got {bucket_size}")
        self.hub = hub
        self.model = model
        self.bucket_size = bucket_size
        self.timeout = timeout
        self.cache = _Cache()
        self.stats = StreamStats()
        self._follow: Optional[threading.Thread] = None
        self._stop = threading.Event()
        #: Ask the next version's lease ahead (``Hub.fetch_next``): once a version read the
        #: usual way found no delta from the one before (the publisher publishes none).
        self._ahead = False

    # ------------------------------------------------------------------ versions
    def wait_complete(self, version: int, deadline: float) -> None:
        """Return once ``version`` is complete; a clear error if the coordinator has no such
        version, or it is not complete by ``deadline``."""
        delay = 0.02
        while True:
            info = self.hub.version_info(self.model, version)
            if info is None:
                latest = self._latest()
                raise NotFoundError(
                    f"tensorhub: {self.model!r} v{version} is unknown to the coordinator at {self.hub.url} "
                    f"(newest complete version: {latest})", "unknown_version")
            if info.complete:
                return
            if time.monotonic() >= deadline:
                raise FetchError(f"tensorhub: {self.model!r} v{version} was not complete within {self.timeout:g}s "
                                 f"({_missing(info)})")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.25)

    def _latest(self) -> Optional[int]:
        try:
            return self.hub.latest(self.model)
        except TensorHubError:
            return None

    def resolve(self, version: Optional[int]) -> int:
        """``version``, or the newest complete one (waiting for a first up to the timeout)."""
        if version is not None:
            return version
        return self.hub.wait_for_version(self.model, timeout=self.timeout)

    # ------------------------------------------------------------------ streamed
    async def stream(self, version: Optional[int]) -> AsyncIterator[tuple[str, Any]]:
        """``(name, tensor)`` of ``version`` (None: the newest complete): from the prefetched
        copy when it holds (or is fetching) that version, else streamed in buckets."""
        version = await asyncio.to_thread(self.resolve, version)
        if await asyncio.to_thread(self._cached, version, False):
            async for item in self._from_cache(version):
                yield item
            return
        async for item in self._stream(version):
            yield item

    async def _stream(self, version: int) -> AsyncIterator[tuple[str, Any]]:
        import torch

        t0 = time.monotonic()
        deadline = t0 + self.timeout
        await asyncio.to_thread(self.wait_complete, version, deadline)
        specs = await asyncio.to_thread(self.hub.manifest, self.model, version)
        plan = plan_buckets(specs, self.bucket_size)
        need = max((sum(_padded(s.nbytes) for s in b) for b in plan if len(b) > 1 or b[0].nbytes <= self.bucket_size),
                   default=ALIGN)
        bufs = [torch.empty(need, dtype=torch.uint8), torch.empty(need, dtype=torch.uint8)]
        stats = StreamStats(version=version, source="stream", buckets=len(plan), buffer_bytes=2 * need)
        loop = asyncio.get_running_loop()

        def read(bucket: list, buf: Any) -> dict:
            if len(bucket) == 1 and bucket[0].nbytes > self.bucket_size:  # oversized: alone, its own tensor
                s = bucket[0]
                views = {s.name: torch.empty(tuple(s.shape), dtype=getattr(torch, s.dtype))}
                stats.oversized = max(stats.oversized, s.nbytes)
            else:
                views, off = {}, 0
                for s in bucket:
                    views[s.name] = buf[off:off + s.nbytes].view(getattr(torch, s.dtype)).view(tuple(s.shape))
                    off += _padded(s.nbytes)
                stats.largest_bucket = max(stats.largest_bucket, off)
            left = deadline - time.monotonic()
            if left <= 0:
                raise FetchError(f"tensorhub: reading {self.model!r} v{version} took longer than {self.timeout:g}s")
            got = self.hub.fetch(self.model, version, names=list(views), into=views, serve=False, timeout=left)
            stats.nbytes += got.nbytes
            for w, b in got.sources.items():
                stats.sources[w] = stats.sources.get(w, 0) + b
            return views

        pending = loop.run_in_executor(None, read, plan[0], bufs[0]) if plan else None
        try:
            for i in range(len(plan)):
                views = await pending
                pending = None
                if i + 1 < len(plan):  # the next bucket goes into the other buffer meanwhile
                    pending = loop.run_in_executor(None, read, plan[i + 1], bufs[(i + 1) % 2])
                for name, t in views.items():
                    yield name, t
        finally:
            if pending is not None:  # never free a buffer a read may still write into
                try:
                    await pending
                except Exception:
                    pass
        stats.seconds = time.monotonic() - t0
        self.stats = stats
        logger.info("tensorhub: streamed %s v%d: %.1f MB in %d bucket(s) (bucket %.1f MB, buffers %.1f MB) in "
                    "%.2fs (%.2f GB/s) from %s", self.model, version, stats.nbytes / 1e6, stats.buckets,
                    self.bucket_size / 1e6, stats.buffer_bytes / 1e6, stats.seconds,
                    stats.nbytes / max(stats.seconds, 1e-9) / 1e9, stats.sources)

    # ------------------------------------------------------------------ cached
    def _cached(self, version: int, wait: bool) -> bool:
        """Whether the prefetched copy is (or is becoming) ``version``; with ``wait``, also
        wait for the fetch in flight."""
        c = self.cache
        with c.cond:
            if c.fetching == version and wait:
                c.cond.wait_for(lambda: c.fetching != version, timeout=self.timeout)
            if c.fetching == version:
                return True
            if c.error is not None and c.version != version:
                return False
            return c.version == version

    async def _from_cache(self, version: Optional[int]) -> AsyncIterator[tuple[str, Any]]:
        c = self.cache
        t0 = time.monotonic()

        def pin() -> dict:
            with c.cond:
                c.cond.wait_for(lambda: c.fetching is None or (version is not None and c.fetching != version),
                                timeout=self.timeout)
                if c.fetching is not None and (version is None or c.fetching == version):
                    raise FetchError(f"tensorhub: prefetching {self.model!r} v{c.fetching} took longer than "
                                     f"{self.timeout:g}s")
                if c.version is None or (version is not None and c.version != version):
                    why = f": {c.error}" if c.error is not None else ""
                    want = f"v{version}" if version is not None else "a version"
                    raise FetchError(f"tensorhub: no prefetched copy of {self.model!r} {want} here (holds "
                                     f"{'v%d' % c.version if c.version else 'none'}){why}; call prefetch() first "
                                     "or set engine_kwargs prefetch=true")
                c.readers += 1
                return c.tensors

        tensors = await asyncio.to_thread(pin)
        try:
            for name, t in tensors.items():
                yield name, t
        finally:
            with c.cond:
                c.readers -= 1
                c.cond.notify_all()
        v = c.version
        self.stats = StreamStats(version=v, source="cache", buckets=0,
                                 nbytes=sum(t.numel() * t.element_size() for t in tensors.values()),
                                 seconds=time.monotonic() - t0)

    async def from_cache(self) -> AsyncIterator[tuple[str, Any]]:
        """The newest prefetched copy (waiting for a prefetch in flight)."""
        async for item in self._from_cache(None):
            yield item

    def prefetch(self, version: Optional[int] = None) -> Optional[int]:
        """Start fetching ``version`` (None: the newest complete one, waiting for one newer
        than the copy held) into the local copy, in the background; returns at once (the
        version when it was given)."""
        threading.Thread(target=self._prefetch_one, args=(version,), name="tensorhub-verl-prefetch",
                         daemon=True).start()
        return version

    def follow(self) -> None:
        """Prefetch every new complete version as it appears, until :meth:`close`."""
        if self._follow is not None:
            return

        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self._prefetch_one(None)
                except Exception as e:  # logged; the next version is tried again
                    logger.warning("tensorhub: prefetch failed: %s", e)
                    self._stop.wait(1.0)

        self._follow = threading.Thread(target=loop, name="tensorhub-verl-follow", daemon=True)
        self._follow.start()

    def _prefetch_ahead(self) -> bool:
        """The version after the cached one, its lease asked ahead (``Hub.fetch_next``: in
        the version's plan from its first moment); False when it failed (then the usual way)."""
        c = self.cache
        with c.cond:
            after = c.version
            if after is None or c.fetching is not None:
                return False
            into, c.spare = c.spare, None
        t0 = time.monotonic()

        def bound(v: int) -> None:  # being read now: a local read of it waits for it
            with c.cond:
                c.fetching, c.error = v, None
                c.cond.notify_all()

        try:
            got = self.hub.fetch_next(self.model, after, into=into, wait=5.0, timeout=self.timeout, bound=bound)
        except Exception as e:
            logger.warning("tensorhub: asking %s's next version ahead failed (%s); reading it the usual way",
                           self.model, e)
            got, self._ahead, into = None, False, None
        if got is None:
            with c.cond:
                c.fetching = None
                if into is not None and c.spare is None:
                    c.spare = into  # nothing came: nothing was written
                c.cond.notify_all()
            return self._ahead
        tensors = dict(got)
        with c.cond:
            old, old_tensors = c.version, c.tensors
            c.version, c.tensors, c.fetching = got.version, tensors, None
            c.cond.notify_all()
        logger.info("tensorhub: prefetched %s v%d asked ahead: %.1f MB in %.2fs from %s", self.model, got.version,
                    got.nbytes / 1e6, time.monotonic() - t0, dict(got.sources))
        if old is not None:
            self._retire(old, old_tensors)
        self._ahead = not deltas_published(self.hub, self.model, got.version)  # (then through them again)
        return True

    def _prefetch_one(self, version: Optional[int]) -> None:
        c = self.cache
        t0 = time.monotonic()
        if version is None and self._ahead and self._prefetch_ahead():
            return
        if version is None:
            newer = c.version
            while not self._stop.is_set():
                try:
                    version = self.hub.wait_for_version(self.model, newer_than=newer, timeout=5.0)
                    break
                except TimeoutError:
                    continue
            if version is None:
                return
        with c.cond:
            if c.version == version or c.fetching == version:
                return
            c.fetching, c.error = version, None
            c.cond.notify_all()
        try:
            self.wait_complete(version, time.monotonic() + self.timeout)
            into = c.spare
            c.spare = None
            try:
                got = self.hub.fetch(self.model, version, into=into, serve=True, timeout=self.timeout)
            except TensorHubError:
                if into is None:
                    raise
                got = self.hub.fetch(self.model, version, serve=True, timeout=self.timeout)  # layout changed
            tensors = dict(got)
            with c.cond:
                old, old_tensors = c.version, c.tensors
                c.version, c.tensors = version, tensors
                c.fetching = None
                c.cond.notify_all()
            logger.info("tensorhub: prefetched %s v%d: %.1f MB in %.2fs from %s", self.model, version,
                        got.nbytes / 1e6, time.monotonic() - t0, dict(got.sources))
            self._ahead = ask_ahead_after(got)  # no delta from the one before: ask the next one ahead
            if old is not None:
                self._retire(old, old_tensors)
        except BaseException as e:
            with c.cond:
                c.fetching, c.error = None, e
                c.cond.notify_all()
            raise

    def _retire(self, version: int, tensors: Optional[dict]) -> None:
        """Stop serving an older copy (its readers drain first); its memory becomes the next
        fetch's destination once no local consumer reads it."""
        c = self.cache
        try:
            self.hub.unpublish(self.model, version, timeout=self.timeout)
        except TensorHubError as e:  # still served: never reuse that memory
            logger.warning("tensorhub: keeping %s v%d served (unpublish: %s)", self.model, version, e)
            return
        with c.cond:  # a local consumer still reading it pins it (conservatively: any consumer)
            c.spare = tensors if c.readers == 0 else None

    def close(self) -> None:
        self._stop.set()
