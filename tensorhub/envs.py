"""Every environment variable TensorHub reads, in one place, read lazily.

Precedence, everywhere: an explicit argument > the environment variable > the default.
An argument counts as given when it is not ``None`` (so ``0`` and ``""`` are honoured).

Access a value as ``envs.TENSORHUB_TOKEN``; each access reads ``os.environ`` again, so
tests and launchers may change the environment after import.
"""

from __future__ import annotations

import os
from typing import Any, Callable

__all__ = ["ENVIRONMENT_VARIABLES", "pick"]


def _str(name: str, default: str | None) -> Callable[[], str | None]:
    return lambda: os.environ.get(name, default)


def _float(name: str, default: float) -> Callable[[], float]:
    def get() -> float:
        raw = os.environ.get(name)
        if raw is None or raw == "":
            return default
        try:
            return float(raw)
        except ValueError:
            from ._exceptions import ConfigError

            raise ConfigError(f"{name}={raw!r} is not a number") from None

    return get


def _bool(name: str, default: bool) -> Callable[[], bool]:
    def get() -> bool:
        raw = os.environ.get(name)
        if raw is None or raw == "":
            return default
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        from ._exceptions import ConfigError

        raise ConfigError(f"{name}={raw!r} is not a boolean (1/0, true/false)")

    return get


def _int(name: str, default: int) -> Callable[[], int]:
    f = _float(name, float(default))
    return lambda: int(f())


#: name -> (getter, documentation)
ENVIRONMENT_VARIABLES: dict[str, tuple[Callable[[], Any], str]] = {
    "TENSORHUB_COORDINATOR": (
        _str("TENSORHUB_COORDINATOR", None),
        "Coordinator URL used when none is passed (e.g. http://10.0.0.5:7777); several "
        "highly available coordinators comma-separated (http://c1:7777,http://c2:7777).",
    ),
    "TENSORHUB_TOKEN": (
        _str("TENSORHUB_TOKEN", None),
        "Shared API token sent as 'Authorization: Bearer <token>'. Never logged.",
    ),
    "TENSORHUB_CA_FILE": (
        _str("TENSORHUB_CA_FILE", None),
        "PEM file of the CA (or self-signed certificate) that signed an https coordinator's "
        "certificate. Default: the system's trusted CAs.",
    ),
    "TENSORHUB_WORKER_ID": (
        _str("TENSORHUB_WORKER_ID", None),
        "Worker id; default <hostname>-<pid>-<random>.",
    ),
    "TENSORHUB_LOCALITY": (
        _str("TENSORHUB_LOCALITY", None),
        "Locality labels 'dc=a,zone=z1,host=h3'; missing labels default from the hostname.",
    ),
    "TENSORHUB_TRANSPORT": (
        _str("TENSORHUB_TRANSPORT", "mooncake"),
        "Data-plane transport: 'mooncake' (default) or 'memory' (in-process test double).",
    ),
    "TENSORHUB_DATA_HOST": (
        _str("TENSORHUB_DATA_HOST", None),
        "Address the data plane advertises to readers (and, on RDMA, its NIC). Default: "
        "127.0.0.1 when the coordinator is on loopback, else the local address of the route "
        "to it. Mooncake's ports still listen on all interfaces: see SECURITY.md.",
    ),
    "TENSORHUB_MOONCAKE_PROTOCOL": (
        _str("TENSORHUB_MOONCAKE_PROTOCOL", "tcp"),
        "Mooncake protocol: 'tcp' or 'rdma'.",
    ),
    "TENSORHUB_MOONCAKE_DEVICES": (
        _str("TENSORHUB_MOONCAKE_DEVICES", ""),
        "Mooncake device filter (RDMA NIC names, comma separated); empty = auto.",
    ),
    "TENSORHUB_PROGRESS_TIMEOUT": (
        _float("TENSORHUB_PROGRESS_TIMEOUT", 10.0),
        "Seconds a read batch may make no progress before its source counts as hung.",
    ),
    "TENSORHUB_HEARTBEAT_INTERVAL": (
        _float("TENSORHUB_HEARTBEAT_INTERVAL", 2.0),
        "Seconds between a client's heartbeats.",
    ),
    "TENSORHUB_CHUNK_BYTES": (
        _int("TENSORHUB_CHUNK_BYTES", 64 << 20),
        "Bytes per read chunk (the unit of striping and of failover), at most 1 GiB.",
    ),
    "TENSORHUB_PIPELINED": (
        _bool("TENSORHUB_PIPELINED", True),
        "Pipelined replication: fetch from readers still receiving, serve while receiving, "
        "one reader per datacenter crosses to another (1/0).",
    ),
    "TENSORHUB_RETAIN_ON_CPU": (
        _bool("TENSORHUB_RETAIN_ON_CPU", False),
        "When unpublishing the last replica of the newest version, first keep serving a CPU copy.",
    ),
    "TENSORHUB_PROGRESS_INTERVAL": (
        _float("TENSORHUB_PROGRESS_INTERVAL", 1.0),
        "Seconds between progress reports of a fetch that runs longer than a second (to the "
        "fetch's progress callback, else the log, and to the coordinator's status); 0: none.",
    ),
    "TENSORHUB_CHECKSUM": (
        _str("TENSORHUB_CHECKSUM", "auto"),
        "Per-chunk checksums (xxh3_64), computed at publish and verified by readers before "
        "they accept a chunk: 'auto' (CPU memory only), 'on' (CUDA memory too, hashed through "
        "a host copy), 'off'.",
    ),
    "TENSORHUB_STRIPE": (
        _int("TENSORHUB_STRIPE", 4),
        "Most replicas one fetch reads from at once.",
    ),
    "TENSORHUB_SAMEHOST": (
        _bool("TENSORHUB_SAMEHOST", True),
        "Read from holders on this host by copying from their memfd-backed memory (fds passed "
        "over a Unix socket under a lease), instead of over the data plane's loopback.",
    ),
    "TENSORHUB_SAMEHOST_VM": (
        _bool("TENSORHUB_SAMEHOST_VM", True),
        "Same-host reads of memory the Hub did not allocate (the user's own tensors) with "
        "process_vm_readv, under the same lease; 0 reads such memory over the data plane.",
    ),
    "TENSORHUB_ADDRESS_RUNS": (
        _bool("TENSORHUB_ADDRESS_RUNS", True),
        "Send a replica's tensor addresses to the coordinator, and ask for sources', as a "
        "few runs when the memory lays tensors out in order (the Hub's own allocations), "
        "instead of one address per tensor; 0 sends and asks for plain lists, as clients "
        "before runs did (coordinators that predate runs get plain lists either way).",
    ),
    "TENSORHUB_REGISTER_LIKE": (
        _bool("TENSORHUB_REGISTER_LIKE", True),
        "Publish a version whose tensors are those of the version this worker published "
        "before (a model trained in place) as that version's tensors plus its own checksums, "
        "instead of sending its whole manifest (the coordinator builds it: ~0.2 s less before "
        "a 50,000-tensor version is complete); 0 always sends the manifest.",
    ),
    "TENSORHUB_SHM_POOL_BYTES": (
        _int("TENSORHUB_SHM_POOL_BYTES", -1),
        "Bytes of freed TensorHub-allocated CPU memory kept (pages faulted in) for reuse by "
        "the next fetch into new memory; 0 frees it at once; -1 (default): the largest "
        "buffer allocated so far (one model's worth).",
    ),
}


def pick(arg: Any, name: str) -> Any:
    """Return ``arg`` if it is not None, else the environment variable ``name`` (or its default)."""
    if arg is not None:
        return arg
    return ENVIRONMENT_VARIABLES[name][0]()


def __getattr__(name: str) -> Any:
    if name in ENVIRONMENT_VARIABLES:
        return ENVIRONMENT_VARIABLES[name][0]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
