"""The holder's calls (trainer, engine): publish in place, unpublish once drained.

``publish`` registers the caller's tensors as a replica without copying them; they must
stay untouched until ``unpublish`` returns, which is when the coordinator says no lease
names them any more (tombstones of this worker included) and, if this worker learned it
was expired or the coordinator restarted while holding them, one more lease ttl has
passed on this process's clock (docs/consistency.md, rules 2 and 4).
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any, Mapping, Optional

from ._exceptions import ConfigError, HubTimeoutError, NotFoundError, RetentionError, TensorHubError
from ._holdings import Held, Holdings, register_regions, unregister_regions
from ._retry import jittered, next_delay
from ._session import Session
from ._tensors import allocate_like, coalesce, manifest_of
from .protocol import VersionMeta

__all__ = ["publish", "unpublish"]

logger = logging.getLogger(__name__)


def serve(session: Session, holdings: Holdings, h: Held, transport: Any, *, publish: bool = False) -> None:
    """Register ``h``'s memory with the transport and ``h`` with the coordinator, then
    hold it (its memory is unregistered again if the coordinator refuses it). ``publish``:
    a new version this worker publishes (``Session.register_replica``)."""
    register_regions(transport, h.regions)
    try:
        h.replica_id = session.register_replica(h, publish=publish)
    except BaseException:
        unregister_regions(transport, h.regions)
        raise
    holdings.hold(h)


def publish(session: Session, holdings: Holdings, checksum: str, model: str, tensors: Mapping[str, Any], *,
            version: Optional[int], layout: str, shard: int, num_shards: int,
            meta: Optional[VersionMeta] = None) -> int:
    """``Hub.publish`` (see there); ``meta`` goes on the manifest (a LoRA adapter's)."""
    manifest, addrs = manifest_of(tensors, checksum)
    if meta is not None:
        manifest = manifest.model_copy(update={"meta": meta})
    if not 0 <= shard < num_shards:
        raise ConfigError(f"shard {shard} is not in [0, {num_shards})")
    # A retried allocation (the answer was lost) gets the same number: no skipped version.
    key_version = session.api.allocate_version(model, version, request_id=secrets.token_hex(12))
    transport = session.transport()
    regions = coalesce([(a, s.nbytes) for a, s in zip(addrs, manifest.tensors)])
    h = Held(model, key_version, layout, shard, num_shards, manifest, addrs, regions, dict(tensors))
    serve(session, holdings, h, transport, publish=True)
    logger.info("published %s v%d layout %s shard %d/%d as replica %s of worker %s: %d tensors, %.1f MB",
                model, key_version, layout, shard, num_shards, h.replica_id, session.worker_id, len(addrs),
                manifest.nbytes / 1e6)
    return key_version


def unpublish(session: Session, holdings: Holdings, model: str, version: int, *, timeout: Optional[float],
              retain: bool) -> None:
    """``Hub.unpublish`` (see there)."""
    with holdings.lock:
        mine = holdings.of_version(model, version)
        holdings.withdrawing.update(h.key for h in mine)  # no re-registration announces them now
    if not mine:
        raise NotFoundError(f"this hub holds no replica of {model!r} v{version}", "not_held")
    try:
        _withdraw(session, holdings, mine, model, version, timeout, retain)
    finally:
        with holdings.lock:  # dropped on success; still served (and announced) on failure
            holdings.withdrawing.difference_update(h.key for h in mine)


def _withdraw(session: Session, holdings: Holdings, mine: list[Held], model: str, version: int,
              timeout: Optional[float], retain: bool) -> None:
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = 0.02
    only: Optional[list[str]] = None
    copies: list[Held] = []
    while True:
        try:
            r = session.as_worker(lambda api: api.unpublish(model, version, session.worker_id, only))
            if r.drained:
                break
            why: TensorHubError = HubTimeoutError(
                f"unpublish {model!r} v{version}: {r.open_leases} reader lease(s) still open; "
                "the tensors must stay untouched")
        except RetentionError as e:
            if retain and not copies:
                copies = [_retain_copy(session, h) for h in mine]
                only = [h.replica_id for h in mine]
                continue
            why = e
        if deadline is not None and time.monotonic() >= deadline:
            raise why
        time.sleep(jittered(delay))
        delay = next_delay(delay, cap=0.25, factor=1.5)
    _wait_fence(holdings, mine, deadline, model, version)
    transport = session.transport()
    with holdings.lock:
        for h in mine:
            holdings.drop(h.key)
            h.retire_map()  # drained: no reader may take its chunk map as valid again
            unregister_regions(transport, h.regions)
        for c in copies:
            holdings.hold(c)
    logger.info("worker %s unpublished %s v%d (replica(s) %s)%s", session.worker_id, model, version,
                ", ".join(h.replica_id for h in mine), " (kept serving a CPU copy)" if copies else "")


def _wait_fence(holdings: Holdings, mine: list[Held], deadline: Optional[float], model: str, version: int) -> None:
    """Holder rule (docs/consistency.md): after this worker learned it was expired or the
    coordinator restarted, what it held then stays untouched for one lease ttl."""
    wait = holdings.fence_of(mine) - time.monotonic()
    if wait <= 0:
        return
    if deadline is not None and time.monotonic() + wait > deadline:
        raise HubTimeoutError(
            f"unpublish {model!r} v{version}: this worker was expired or the coordinator restarted "
            f"while it held it; leases on it may run {wait:.1f}s more: the tensors must stay untouched")
    logger.warning("unpublish %s v%d: waiting %.1fs (leases from before this worker re-registered may "
                   "still be read)", model, version, wait)
    time.sleep(wait)


def _retain_copy(session: Session, h: Held) -> Held:
    """Copy a held shard into new CPU memory and register the copy as a replica."""
    buf, out = allocate_like(h.manifest, device="cpu", arena=session.config.samehost)
    for name, t in h.tensors.items():
        out[name].copy_(t)
    local = [out[s.name].data_ptr() for s in h.manifest.tensors]
    regions = coalesce([(a, s.nbytes) for a, s in zip(local, h.manifest.tensors)])
    transport = session.transport()
    register_regions(transport, regions)
    c = Held(h.model, h.version, h.layout, h.shard, h.num_shards, h.manifest, local, regions, out, extra=[buf])
    try:
        c.replica_id = session.register_replica(c)
    except BaseException:
        unregister_regions(transport, regions)
        raise
    logger.warning("%s v%d is the newest version and this is its last holder: serving a %.1f MB CPU "
                   "copy (retain_on_cpu)", h.model, h.version, h.manifest.nbytes / 1e6)
    return c
