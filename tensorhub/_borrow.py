"""Reading a same-host replica where it lies: ``Hub.borrow`` (reader process).

A fetch copies a version into memory of the reader's own. A reader on the holder's host
that only needs the bytes for a while -- an engine's ``load_weights`` at start, which
copies every tensor into its parameters anyway -- can instead read them in the holder's
memory: the holder's memfd arenas (``transport/_shm``), mapped read-only, under a read
lease. That saves the reader one copy of the version into new memory (whose first-touch
page faults cost ~1 s/GiB on the test VMs, more than the copy).

The rules are a fetch's, applied to a read that lasts as long as the ``with`` block:

* **Lease.** One plain lease on the shard, granted before anything is mapped; the holder's
  fd server hands out its memory only against it (``_samehost.wrap``'s ``authorize``). A
  thread renews it every ``lease_ttl / 3`` while the block runs; the holder's
  ``unpublish`` waits for its release, so the bytes cannot change under the reader.
* **Checksums.** Verified on the mapped bytes before they are handed out (the manifest's,
  as for any read into CPU memory); a mismatch reports the replica and gives no views.
* **Release.** Leaving the block releases the lease and drops the views and our
  reference to the mapping. If the lease lapsed meanwhile (on the coordinator's word or on
  the reader's own clock), what was read may have changed: :class:`LeaseLapsedError`,
  and the caller reads again (an engine's loader then fetches and loads once more).
* **Nothing kept.** The views must not outlive the block: a tensor still viewing the
  holder's memory after the release would read bytes the holder may overwrite.
  :meth:`Borrowed.sharing` tells which of a caller's tensors share it (an engine checks
  its parameters before it releases).

``Hub.borrow`` returns None, holding nothing, when no replica named by the lease is on
this host in Hub-allocated memory (other hosts, user tensors published without
``empty_like``, a holder's socket out of reach, a version published as slices,
``TENSORHUB_SAMEHOST=0``) or none that is passes its checksums: then fetch.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any, Iterable, Optional

from ._checksum import verifier
from ._exceptions import LeaseLapsedError, ReadSlices, TensorHubError
from ._fencing import LeaseClock, renew_leases
from ._fetch import FetchOptions
from ._sources import acquire_lease, release_all, release_checked
from ._reader import Source
from ._session import Session
from ._tensors import _torch_dtype

__all__ = ["Borrowed", "borrow"]

logger = logging.getLogger(__name__)

#: Threads that verify a borrowed replica's checksums in place (an engine's start: nothing else
#: runs on this process's cores yet; measured 0.135 s -> 0.084 s for 1.25 GiB on 2 cores).
_VERIFY_THREADS = 2


class Borrowed(dict):
    """``name -> tensor``: read-only views of a same-host holder's memory, valid inside
    ``with`` (see the module docstring). Attributes: ``version``, ``layout``, ``shard``,
    ``nbytes``, ``worker_id`` (the holder), ``seconds`` (lease, mapping and checksums)."""

    version: int
    layout: str
    shard: int
    nbytes: int
    worker_id: str
    seconds: float

    def __init__(self, out: dict, session: Session, lease_id: str, clock: LeaseClock,
                 ranges: list[tuple[int, int]], what: str) -> None:
        super().__init__(out)
        self._session, self._lease, self._clock, self._ranges, self._what = session, lease_id, clock, ranges, what
        self._stop = threading.Event()
        self._released = False
        # The renewer holds no reference to this object: one dropped without release is
        # collected, and its finalizer stops the renewals and gives the lease back.
        self._renewer = threading.Thread(target=_renew, args=(session, lease_id, clock, self._stop),
                                         name="tensorhub-borrow", daemon=True)
        self._renewer.start()
        self._finalizer = weakref.finalize(self, _dropped, session, lease_id, self._stop, what)

    def sharing(self, tensors: Iterable[tuple[str, Any]]) -> list[str]:
        """The names of ``tensors`` (``(name, tensor)`` pairs) whose storage lies in the
        borrowed memory: they must be copied before :meth:`release`."""
        out = []
        for name, t in tensors:
            try:
                if t.device.type != "cpu":
                    continue
                st = t.untyped_storage()
                a, n = st.data_ptr(), st.nbytes()
            except Exception:  # no storage (meta, sparse): cannot share
                continue
            if n and any(a < base + size and base < a + n for base, size in self._ranges):
                out.append(name)
        return out

    def trusted(self) -> bool:
        """Whether the lease is still within this reader's own bound (last grant or renewal
        plus ttl, with the fencing margin): what was read up to now is the version's bytes.
        (The coordinator cannot expire the lease earlier; docs/concepts/consistency.md.)"""
        return not self._released and self._clock.trusted(self._lease)

    def release_quietly(self) -> None:
        """:meth:`release`, logging instead of raising (a caller that discards what it read)."""
        try:
            self.release()
        except TensorHubError as e:
            logger.debug("releasing a borrowed read: %s", e)

    def release(self) -> None:
        """Release the lease and drop the views; raises :class:`LeaseLapsedError` when the
        lease lapsed before (what was read may have changed). Idempotent."""
        if self._released:
            return
        self._released = True
        self._finalizer.detach()
        self._stop.set()
        self._renewer.join()
        self.clear()
        t = self._session.transport()
        try:
            lapsed = release_checked(self._session, [self._lease], self._clock)
        finally:
            forget = getattr(t, "forget", None)
            if forget is not None:
                forget({self._lease})
        if lapsed:
            raise LeaseLapsedError(f"{self._what}: the read lease lapsed while it was borrowed; what was read "
                                   "from the holder's memory may have changed: read it again")

    def __enter__(self) -> "Borrowed":
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is None:
            self.release()
        else:  # an error in the block wins; the lease is released all the same
            self.release_quietly()


def _renew(session: Session, lease_id: str, clock: LeaseClock, stop: threading.Event) -> None:
    every = max(0.1, session.lease_ttl / 3)
    while not stop.wait(every):
        renew_leases(session.api, [lease_id], clock, session.lease_ttl)


def _dropped(session: Session, lease_id: str, stop: threading.Event, what: str) -> None:
    """A :class:`Borrowed` was collected without :meth:`~Borrowed.release`."""
    stop.set()
    logger.warning("%s: borrowed and dropped without release; its lease is released now", what)
    release_all(session, [lease_id])
    forget = getattr(session.transport(), "forget", None)
    if forget is not None:
        forget({lease_id})


def borrow(session: Session, opts: FetchOptions, model: str, version: int, layout: str, shard: int,
           deadline: float) -> Optional[Borrowed]:
    """``Hub.borrow``: see the module docstring."""
    import torch

    from .transport._shm import SameHostTransport

    t0 = time.monotonic()
    transport = session.transport()
    if not isinstance(transport, SameHostTransport):
        return None
    clock = LeaseClock()
    try:
        grant = acquire_lease(session, model, version, layout, shard, set(), deadline, clock, opts.max_sources)
    except ReadSlices:
        return None  # published as slices, no assembled copy: nothing to map as a whole
    leases = [grant.lease_id]
    what = f"{model!r} v{version} ({layout}, shard {shard})"
    try:
        manifest = grant.manifest or session.manifest(model, version, layout, shard)
        for r in sorted(grant.replicas, key=lambda r: r.cost):
            src = Source(r.replica_id, r.worker_id, r.endpoint, tuple(r.addresses), grant.lease_id, r.cost,
                         secret=grant.secret, host=r.locality.host)
            views = transport.map_regions(src, [(a, s.nbytes) for a, s in zip(r.addresses, manifest.tensors)])
            if views is None:
                continue
            out: dict[str, Any] = {}
            for spec, v in zip(manifest.tensors, views):
                dt = _torch_dtype(spec.dtype)
                out[spec.name] = torch.empty(spec.shape, dtype=dt) if v is None else v.view(dt).view(spec.shape)
            check = verifier(manifest, out, opts.checksum)
            bad = check.first_mismatch(threads=_VERIFY_THREADS) if check is not None else None
            if bad is not None:
                logger.warning("%s: replica %s of worker %s fails its checksums in place (%s); not borrowed",
                               what, r.replica_id, r.worker_id, bad)
                try:
                    session.as_worker(lambda api: api.report_replica(r.replica_id, session.worker_id, bad,
                                                                     retry_timeout=2.0))
                except TensorHubError:
                    pass
                continue
            ranges = transport.mapped_ranges(src)
            b = Borrowed(out, session, grant.lease_id, clock, ranges, what)
            b.version, b.layout, b.shard, b.nbytes = version, layout, shard, manifest.nbytes
            b.worker_id, b.seconds = r.worker_id, time.monotonic() - t0
            leases.clear()  # the Borrowed owns the lease now
            return b
        return None
    finally:
        if leases:  # nothing borrowed: give the lease back at once
            release_all(session, leases)
            transport.forget({grant.lease_id})
