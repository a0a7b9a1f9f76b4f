"""The Hub's side of same-host reads (``transport/_shm``): what the fd server asks us.

Called by the Session when it creates its transport (holder and reader alike): wraps the
data plane in a :class:`~tensorhub.transport._shm.SameHostTransport` whose fd server
answers only a reader that (1) runs as our uid or root (``SO_PEERCRED``, checked by the
transport) and (2) holds a lease, valid now by the coordinator's word, that names the
replica it asks for, and proves it: the proof (``protocol.lease_proof``, keyed by the lease's
secret) is checked by the coordinator, not here -- the holder never learns the secret, and
no API token crosses the socket. The answer then covers exactly that replica's memory
(for CUDA tensors: IPC handles of the blocks behind them, clipped to its regions).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from ._exceptions import TensorHubError
from .transport import Transport
from .transport._shm import SameHostTransport

__all__ = ["wrap"]

logger = logging.getLogger(__name__)


def wrap(inner: Transport, session: Any) -> Transport:
    """``inner`` wrapped for same-host reads (unless ``HubConfig.samehost`` is off:
    ``TENSORHUB_SAMEHOST=0``). ``session`` is the caller's ``_session.Session`` (its config,
    api, holdings, identity)."""
    if not session.config.samehost:
        return inner

    def authorize(lease_id: str, replica_id: str, worker_id: str, proof: str,
                  endpoint: str) -> Optional[list[tuple[int, int]]]:
        held = session.holdings.find(replica_id)  # a held replica, or one still receiving (partial)
        if held is None:
            return None
        try:
            if not session.api.lease_covers(lease_id, replica_id, worker_id, proof, endpoint, retry_timeout=2.0):
                return None
        except TensorHubError as e:
            logger.info("same-host request for replica %s: lease %s not confirmed: %s", replica_id, lease_id, e)
            return None
        # The data's regions (a chunk map, ``_chunkmap``, is read over the wrapped transport).
        skip = held.chunkmap.region if held.chunkmap is not None else None
        return [r for r in held.regions if r != skip]

    def tensors(replica_id: str) -> list[Any]:
        """The replica's tensors, asked after ``authorize`` confirmed the lease: the CUDA ones
        among them are served through CUDA IPC (``transport/_cudaipc``)."""
        held = session.holdings.find(replica_id)
        if held is None:
            return []
        ts = held.tensors
        return list(ts.values() if hasattr(ts, "values") else ts or ())

    return SameHostTransport(inner, host_label=session.locality.host, authorize=authorize,
                             worker_id=session.worker_id, tensors=tensors, vm=session.config.samehost_vm)
