"""One configuration object for everything that talks to a coordinator.

:class:`HubConfig` is resolved once, field by field: an explicit argument > its
environment variable (``envs``) > the default, and checked then (a bad value is a
:class:`~tensorhub.ConfigError` naming where it came from). The Hub, the engine
adapters' settings and the CLI all build one the same way and hand it down; nothing
below them reads the environment for these values again.

    >>> cfg = HubConfig.resolve("http://10.0.0.5:7777", pipelined=False)
    >>> hub = tensorhub.connect(config=cfg)
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from . import envs
from ._checksum import check_mode
from ._client import coordinator_urls
from ._exceptions import ConfigError
from .protocol import Locality
from .transport import _KINDS as TRANSPORTS, MAX_ENTRY_BYTES

__all__ = ["HubConfig", "coordinator_urls", "parse_locality", "read_token"]

#: field -> the environment variable it falls back to (argument > variable > default).
ENV = {
    "coordinator": "TENSORHUB_COORDINATOR",
    "worker_id": "TENSORHUB_WORKER_ID",
    "locality": "TENSORHUB_LOCALITY",
    "token": "TENSORHUB_TOKEN",
    "ca_file": "TENSORHUB_CA_FILE",
    "heartbeat_interval": "TENSORHUB_HEARTBEAT_INTERVAL",
    "progress_timeout": "TENSORHUB_PROGRESS_TIMEOUT",
    "chunk_bytes": "TENSORHUB_CHUNK_BYTES",
    "max_sources": "TENSORHUB_STRIPE",
    "pipelined": "TENSORHUB_PIPELINED",
    "checksum": "TENSORHUB_CHECKSUM",
    "retain_on_cpu": "TENSORHUB_RETAIN_ON_CPU",
    "progress_interval": "TENSORHUB_PROGRESS_INTERVAL",
    "transport_kind": "TENSORHUB_TRANSPORT",
    "data_host": "TENSORHUB_DATA_HOST",
    "mooncake_protocol": "TENSORHUB_MOONCAKE_PROTOCOL",
    "mooncake_devices": "TENSORHUB_MOONCAKE_DEVICES",
    "samehost": "TENSORHUB_SAMEHOST",
    "samehost_vm": "TENSORHUB_SAMEHOST_VM",
    "address_runs": "TENSORHUB_ADDRESS_RUNS",
    "register_like": "TENSORHUB_REGISTER_LIKE",
}



def parse_locality(text: Optional[str]) -> Locality:
    """``"dc=a,zone=z1,host=h3"`` -> Locality; missing labels default from the hostname."""
    labels = {"datacenter": "default", "zone": "default", "host": socket.gethostname()}
    aliases = {"dc": "datacenter", "datacenter": "datacenter", "zone": "zone", "host": "host"}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in aliases:
            raise ConfigError(f"bad locality label {part!r}; expected dc=..,zone=..,host=..")
        labels[aliases[key.strip()]] = value.strip()
    return Locality(**labels)


def read_token(path: Optional[str]) -> Optional[str]:
    """The API token in file ``path`` (None: no file given). An empty file is an error,
    not "no token"."""
    if path is None:
        return None
    try:
        text = Path(path).read_text().strip()
    except OSError as e:
        raise ConfigError(f"cannot read token file {path}: {e}") from None
    if not text:
        raise ConfigError(f"token file {path} is empty")
    return text


def _locality(value: Union[Locality, str, Mapping[str, str], None]) -> Locality:
    if isinstance(value, Locality):
        return value
    if isinstance(value, Mapping):
        return parse_locality(",".join(f"{k}={v}" for k, v in value.items()))
    return parse_locality(value)


@dataclass(frozen=True)
class HubConfig:
    """What a Hub needs to know, resolved and checked. Build it with :meth:`resolve`;
    change it with :meth:`replace` (checked again)."""

    #: Coordinator URL; several highly available coordinators comma-separated.
    coordinator: str
    #: This worker's id (default ``<hostname>-<pid>-<random>``).
    worker_id: str
    #: Locality labels (datacenter, zone, host) the planner uses.
    locality: Locality
    #: Shared API token (never shown in ``repr``).
    token: Optional[str] = dataclasses.field(default=None, repr=False)
    #: CA bundle for an https coordinator (None: the system's CAs).
    ca_file: Optional[str] = None
    heartbeat_interval: float = 2.0
    #: Seconds a read batch may make no progress before its source counts as hung.
    progress_timeout: float = 10.0
    #: Bytes per read chunk (the unit of striping and failover).
    chunk_bytes: int = 64 << 20
    #: Most replicas one fetch reads from at once.
    max_sources: int = 4
    #: Read from readers still receiving, serve while receiving, seed across datacenters.
    pipelined: bool = True
    #: Per-chunk checksums: auto (CPU memory), on (CUDA too), off.
    checksum: str = "auto"
    #: Keep serving a CPU copy when unpublishing the newest version's last replica.
    retain_on_cpu: bool = False
    #: A fetch's default deadline (seconds).
    fetch_timeout: float = 600.0
    #: Seconds between progress reports of a fetch that runs longer than that (to its
    #: callback, else the log, and to the coordinator's status); 0: none.
    progress_interval: float = 1.0
    #: The data plane: ``"mooncake"``, or ``"memory"`` (the in-process test double). (A Hub's
    #: ``transport=`` takes a transport object, or this name.)
    transport_kind: str = "mooncake"
    #: Address the data plane advertises to readers; None: 127.0.0.1 for a coordinator on
    #: loopback, else the local address of the route to it.
    data_host: Optional[str] = None
    #: Mooncake's protocol (``"tcp"``, ``"rdma"``) and RDMA device filter (``""``: auto).
    mooncake_protocol: str = "tcp"
    mooncake_devices: str = ""
    #: Same-host reads at memory speed (``docs/concepts/samehost.md``): the Hub's CPU
    #: allocations are memfd arenas that readers on this host map under a lease; and, with
    #: ``samehost_vm``, other memory (the user's own tensors) read with process_vm_readv.
    samehost: bool = True
    samehost_vm: bool = True
    #: Send (and ask for) a replica's addresses as runs where the coordinator reads them.
    address_runs: bool = True
    #: Publish a model trained in place as its previous version's manifest plus new sums.
    register_like: bool = True

    def __post_init__(self) -> None:
        if not self.coordinator:
            raise ConfigError("no coordinator URL: pass one or set TENSORHUB_COORDINATOR")
        coordinator_urls(self.coordinator)  # a malformed list is refused here, naming the entry
        if not isinstance(self.locality, Locality):
            object.__setattr__(self, "locality", _locality(self.locality))
        for name in ("heartbeat_interval", "progress_timeout", "fetch_timeout"):
            if not float(getattr(self, name)) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")
            object.__setattr__(self, name, float(getattr(self, name)))
        if not 0 < int(self.chunk_bytes) <= MAX_ENTRY_BYTES:
            raise ConfigError(f"chunk_bytes must be in (0, {MAX_ENTRY_BYTES}], got {self.chunk_bytes!r}")
        if int(self.max_sources) < 1:
            raise ConfigError(f"max_sources must be >= 1, got {self.max_sources!r}")
        object.__setattr__(self, "chunk_bytes", int(self.chunk_bytes))
        object.__setattr__(self, "max_sources", int(self.max_sources))
        object.__setattr__(self, "pipelined", bool(self.pipelined))
        object.__setattr__(self, "retain_on_cpu", bool(self.retain_on_cpu))
        object.__setattr__(self, "checksum", check_mode(self.checksum))
        if not float(self.progress_interval) >= 0:
            raise ConfigError(f"progress_interval must be >= 0, got {self.progress_interval!r}")
        object.__setattr__(self, "progress_interval", float(self.progress_interval))
        kind = str(self.transport_kind).strip().lower()
        if kind not in TRANSPORTS:
            raise ConfigError(f"transport_kind={self.transport_kind!r} is not a transport; expected one of "
                              f"{', '.join(TRANSPORTS)}")
        object.__setattr__(self, "transport_kind", kind)
        for name in ("samehost", "samehost_vm", "address_runs", "register_like"):
            object.__setattr__(self, name, bool(getattr(self, name)))

    @classmethod
    def resolve(cls, coordinator: Optional[str] = None, **args: Any) -> "HubConfig":
        """Each field: ``args[field]`` if given (not None) > its environment variable >
        the default. Unknown names are refused like any unexpected keyword argument (a
        typo is not silently ignored)."""
        unknown = set(args) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"unexpected Hub option(s): {', '.join(sorted(unknown))}")
        args["coordinator"] = coordinator
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            v = args.get(f.name)
            if v is None and f.name in ENV:
                v = envs.pick(None, ENV[f.name])
            if v is not None:
                values[f.name] = v
        values.setdefault("coordinator", "")
        if not values.get("worker_id"):
            values["worker_id"] = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        values["locality"] = _locality(values.get("locality"))
        return cls(**values)

    @classmethod
    def from_cli(cls, coordinator: Optional[str], token_file: Optional[str] = None,
                 ca_file: Optional[str] = None, **args: Any) -> "HubConfig":
        """What the command line gives (``--coordinator``, ``--token-file``, ``--ca-file``),
        resolved like any other config."""
        return cls.resolve(coordinator, token=read_token(token_file), ca_file=ca_file, **args)

    @property
    def urls(self) -> list[str]:
        """The coordinator URLs (several: highly available coordinators, any may lead)."""
        return coordinator_urls(self.coordinator)

    def replace(self, **changes: Any) -> "HubConfig":
        return dataclasses.replace(self, **changes)
