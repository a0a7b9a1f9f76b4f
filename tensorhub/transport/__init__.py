"""The data plane: one :class:`Transport` interface, a Mooncake implementation, a factory.

Importing this package does not import ``mooncake``; :meth:`MooncakeTransport.start`
does. The in-memory test double (``_memory.InMemoryTransport``) lives beside it and is
re-exported by :mod:`tensorhub.testing`, where users find it.
"""

from __future__ import annotations

from .. import envs
from .._exceptions import ConfigError
from ._base import DONE, MAX_BATCH_ENTRIES, MAX_ENTRY_BYTES, PENDING, ReadOp, Transport
from ._mooncake import MooncakeTransport

__all__ = [
    "Transport",
    "ReadOp",
    "PENDING",
    "DONE",
    "MAX_BATCH_ENTRIES",
    "MAX_ENTRY_BYTES",
    "MooncakeTransport",
    "create_transport",
]

_KINDS = ("mooncake", "memory")


def create_transport(
    kind: str | None = None,
    *,
    host: str | None = None,
    progress_timeout: float | None = None,
    protocol: str | None = None,
    devices: str | None = None,
) -> Transport:
    """Build an unstarted transport; call ``start()`` on it.

    ``kind`` is ``"mooncake"`` or ``"memory"`` (default: ``TENSORHUB_TRANSPORT``,
    else ``"mooncake"``). ``host`` is the address the Mooncake engine advertises
    (default: ``TENSORHUB_DATA_HOST``, else ``127.0.0.1``); Mooncake's sockets still
    listen on all interfaces (SECURITY.md); the memory transport ignores it.
    ``progress_timeout`` is the seconds a read may make no progress before its source
    counts as hung (Mooncake default: ``TENSORHUB_PROGRESS_TIMEOUT``; memory default:
    wait until resumed). ``protocol`` and ``devices``: Mooncake's (default:
    ``TENSORHUB_MOONCAKE_PROTOCOL`` / ``_DEVICES``). A Hub passes its ``HubConfig``'s.
    """
    raw = envs.pick(kind, "TENSORHUB_TRANSPORT")
    name = (raw or "").strip().lower()
    if name == "mooncake":
        bind = envs.pick(host, "TENSORHUB_DATA_HOST")
        return MooncakeTransport(
            host=bind if bind is not None else "127.0.0.1", protocol=protocol, devices=devices,
            progress_timeout=progress_timeout,
        )
    if name == "memory":
        from ._memory import InMemoryTransport

        return InMemoryTransport(progress_timeout=progress_timeout)
    source = "kind" if kind is not None else "TENSORHUB_TRANSPORT"
    raise ConfigError(f"{source}={raw!r} is not a transport; expected one of {', '.join(_KINDS)}")
