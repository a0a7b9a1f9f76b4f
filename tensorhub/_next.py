"""``Hub.fetch_next``: read the next version as soon as it is published, its lease asked
ahead (``tensorhub.server.ahead``, issue 31 item 1) -- what a reader that follows a model does
(engines' prefetch, ``tensorhub follow``, the verl receiver).

The destination (``into``, e.g. the kept copy of an older version, or new memory) is laid
out by the manifest of the version the reader holds (``after``), registered with the
transport and offered as a partial replica with the lease, which the coordinator holds
until the version is published; then the reader is in the version's plan from its first
moment and reads at once (``_fetch.Fetch`` with ``Ahead``). Calls per version: the held
lease (polled again every ``AHEAD_POLL`` seconds, keeping its place; its grant carries the
version's checksums, so no manifest is read) and the release that registers the complete copy.

Read the usual way instead (``wait_for_version`` + ``fetch``) when the coordinator does not
answer leases asked ahead, the reader does not pipeline, the held version's manifest is
gone, too many readers subscribe already, the version has other tensors (``Reshaped``) or
lacks the layout (published as slices: :data:`USUAL`).
Deltas are not used here: a version asked ahead is read in full.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping, Optional

from ._exceptions import ConflictError, FetchError, HubTimeoutError, NotFoundError
from ._fetch import Ahead, Fetch, Fetched, FetchOptions, Reshaped
from ._sources import RELEASE_GRACE, NoNewVersion
from ._metrics import Track

__all__ = ["USUAL", "fetch_next"]

#: The coordinator's answers to a lease asked ahead that mean "read it the usual way": too
#: many subscribers, or the version has no such layout (e.g. published as slices by trainer
#: ranks: ``Hub.fetch`` assembles them).
USUAL = ("too_many_subscribers", "unknown_layout", "read_slices")

logger = logging.getLogger(__name__)


def fetch_next(hub: Any, model: str, after: int, *, into: Optional[Mapping[str, Any]], layout: str, shard: int,
               wait: float, timeout: Optional[float], progress: Optional[Callable[[Any], None]],
               bound: Optional[Callable[[int], None]] = None) -> Optional[Fetched]:
    t = hub.fetch_timeout if timeout is None else timeout
    s = hub._session

    def usual(why: str, version: Optional[int] = None) -> Optional[Fetched]:
        if why:
            logger.info("%s: reading the version after v%d the usual way: %s", model, after, why)
        if version is None:
            try:
                version = hub.wait_for_version(model, newer_than=after, timeout=wait)
            except HubTimeoutError:
                return None
        if bound is not None:
            bound(version)
        return hub.fetch(model, version, layout=layout, shard=shard, into=into, timeout=t, progress=progress)

    if not hub.pipelined or not s.ahead:
        return usual("")
    try:
        man = s.manifest(model, after, layout, shard)
    except NotFoundError as e:
        return usual(f"v{after}'s manifest is gone ({e})")
    now = time.monotonic()
    deadline = now + wait + t
    opts = FetchOptions(hub.max_sources, hub.chunk_bytes, hub.progress_timeout, hub.checksum)
    track = Track(progress)
    got: Optional[Fetched] = None
    try:
        with hub.api.bounded(deadline + RELEASE_GRACE):
            got = Fetch(s, hub._holdings, opts, model, after + 1, layout, shard, into=into, serve=True,
                        deadline=deadline, track=track, pipelined=True, ahead=Ahead(man, wait, now + wait, t, bound)).run()
        return got
    except NoNewVersion:
        return None
    except Reshaped as e:
        return usual(str(e), e.version)
    except (FetchError, NotFoundError) as e:
        cause = e.__cause__ if isinstance(e, FetchError) else e
        if isinstance(cause, (ConflictError, NotFoundError)) and cause.code in USUAL:
            return usual(cause.message)
        raise
    finally:
        if track.version is not None:  # (a lease was granted: the read is accounted as any fetch)
            hub._account(model, layout, shard, track, got, now)
