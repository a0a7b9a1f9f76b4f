"""Settings of the verl backend, from verl's ``checkpoint_engine.engine_kwargs.tensorhub``.

verl builds the backend with ``CheckpointEngineRegistry.new("tensorhub", bucket_size=...,
[is_master=...], **engine_kwargs["tensorhub"])`` on every trainer rank and every rollout
worker; those keyword arguments are parsed here, once, into :class:`VerlSettings`.

Precedence, as everywhere in TensorHub: a key given (and not ``null``) > the environment
(``TENSORHUB_COORDINATOR``, ``TENSORHUB_TOKEN``, ``TENSORHUB_WORKER_ID``,
``TENSORHUB_LOCALITY``, resolved by :class:`tensorhub.HubConfig`) > the default. Every
error names the key, in one line, and is a :class:`tensorhub.ConfigError` (a ``ValueError``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

import os
import socket

from tensorhub import ConfigError, HubConfig, envs

__all__ = ["VerlSettings"]

_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class VerlSettings:
    """Every key of ``engine_kwargs.tensorhub`` (all optional)."""

    #: Coordinator URL (several comma-separated for HA); default ``TENSORHUB_COORDINATOR``.
    coordinator: Optional[str] = None
    #: API token; default ``TENSORHUB_TOKEN``. Never logged.
    token: Optional[str] = None
    #: Model name on the coordinator.
    model: str = "policy"
    #: Worker id; default ``TENSORHUB_WORKER_ID`` or ``verl-<role>-<host>-<pid>``.
    worker_id: Optional[str] = None
    #: Locality labels ``dc=..,zone=..,host=..``; default ``TENSORHUB_LOCALITY``.
    locality: Optional[str] = None
    #: Seconds ``prepare`` waits for the coordinator to answer ``/healthz`` before it fails.
    connect_timeout: float = 20.0
    #: Trainer: snapshot buffers it publishes from, used in turn; a buffer is reused only
    #: after its version's readers drained (``unpublish``). 2 lets rollouts still read v
    #: while v+1 is published; 1 is refused: the newest version must keep a replica while
    #: the next one is copied (retention).
    keep: int = 2
    #: Trainer: cast floating-point tensors to this dtype in the snapshot (``"bfloat16"``
    #: halves what moves when the trainer holds float32 masters); None keeps each dtype.
    dtype: Optional[str] = None
    #: Rollout: seconds a receive may take, waiting for the version to be complete included.
    timeout: float = 600.0
    #: Rollout: fetch each new version into a local copy in the background as soon as it is
    #: complete (while rollouts run); ``receive_weights`` / ``get_weights`` then read it locally,
    #: and the copy is served to other rollouts (they read from peers, not only the trainer).
    prefetch: bool = False

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> "VerlSettings":
        known = {f.name for f in fields(cls)}
        for key in kwargs:
            if key not in known:
                raise ConfigError(f"tensorhub (verl engine_kwargs): unknown key {key!r}; known: {sorted(known)}")
        given = {k: v for k, v in kwargs.items() if v is not None}
        s = cls(**given)
        s._check()
        return s

    def _check(self) -> None:
        def bad(key: str, why: str) -> ConfigError:
            return ConfigError(f"tensorhub (verl engine_kwargs): {key}={getattr(self, key)!r}: {why}")

        if not isinstance(self.model, str) or not self.model:
            raise bad("model", "must be a non-empty string")
        if not isinstance(self.keep, int) or isinstance(self.keep, bool) or self.keep < 2:
            raise bad("keep", "must be an integer >= 2 (the newest version keeps its replica while the "
                              "next one is copied)")
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise bad("dtype", f"must be one of {', '.join(_DTYPES)} (or null)")
        if not isinstance(self.timeout, (int, float)) or isinstance(self.timeout, bool) or self.timeout <= 0:
            raise bad("timeout", "must be a positive number of seconds")
        if not isinstance(self.connect_timeout, (int, float)) or isinstance(self.connect_timeout, bool) \
                or self.connect_timeout <= 0:
            raise bad("connect_timeout", "must be a positive number of seconds")
        if not isinstance(self.prefetch, bool):
            raise bad("prefetch", "must be true or false")

    def hub_config(self, role: str) -> HubConfig:
        """The Hub's config for a worker of ``role`` (worker id default
        ``verl-<role>-<host>-<pid>``); a missing or malformed coordinator URL is an error here."""
        worker_id = envs.pick(self.worker_id, "TENSORHUB_WORKER_ID") or \
            f"verl-{role}-{socket.gethostname()}-{os.getpid()}"
        try:
            return HubConfig.resolve(self.coordinator, worker_id=worker_id, token=self.token, locality=self.locality)
        except ConfigError as e:
            raise ConfigError(f"tensorhub (verl engine_kwargs): {e}") from None
