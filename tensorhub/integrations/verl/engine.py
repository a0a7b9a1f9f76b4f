"""``tensorhub``: a verl checkpoint engine (``verl.checkpoint_engine``) over TensorHub.

Importing this module registers :class:`TensorHubCheckpointEngine` under the name
``tensorhub`` in verl's ``CheckpointEngineRegistry``. verl imports it by itself: the
package's ``verl.plugins`` entry point names this module (verl loads every such entry point
on ``import verl``); ``checkpoint_engine.custom_backend_module=tensorhub.integrations.verl.engine``
does the same where entry points are turned off (``VERL_USE_EXTERNAL_PLUGINS=none``).

Who calls what (verl's ``CheckpointEngineManager.update_weights``, every sync step):

* every trainer rank and rollout worker: ``prepare()`` -> metadata; the trainer's master
  (rank 0) also takes the step's version number from the coordinator here;
* the driver: ``build_topology(...)`` (a classmethod) checks that all agree on the
  coordinator and model and hands every worker the version (no process group is built);
* every worker: ``init_process_group(rank, version, role)``;
* trainer ranks: ``send_weights(weights)``: full tensors (gathered): the master snapshots
  and publishes the version (:mod:`._publisher`), other ranks drain the generator (FSDP
  gathers on every rank); ``DTensor`` shards (FSDP2, no gather): every rank snapshots its
  own shards and publishes them as slices of the same version;
* rollout workers, concurrently: ``receive_weights()`` yields ``(name, tensor)`` of that
  version, streamed in buckets of ``bucket_size`` or read from a prefetched copy
  (:mod:`._receiver`);
* all: ``finalize()``.

Partial rollout (``CheckpointEngineWithCache``): ``prefetch()`` (or
``engine_kwargs.tensorhub.prefetch: true``, which follows every new version) fetches a
version into a local copy while rollouts run; ``get_weights()`` yields that copy.
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any, AsyncGenerator, Optional

import tensorhub
from verl.checkpoint_engine.base import CheckpointEngineRegistry, CheckpointEngineWithCache

from tensorhub.integrations._core.worker import probe

from ._publisher import Publisher
from ._receiver import Receiver
from .settings import VerlSettings

__all__ = ["TensorHubCheckpointEngine", "BACKEND"]

logger = logging.getLogger(__name__)

BACKEND = "tensorhub"


@CheckpointEngineRegistry.register(BACKEND)
class TensorHubCheckpointEngine(CheckpointEngineWithCache):
    """verl's checkpoint-engine contract over a TensorHub coordinator (see the module docstring).

    Args (verl passes the first two; the rest come from ``engine_kwargs.tensorhub``, see
    :class:`~tensorhub.integrations.verl.settings.VerlSettings`):
        bucket_size: bytes of one streamed bucket (verl's ``update_weights_bucket_megabytes``).
        is_master: True on the trainer rank that publishes (verl sets it on rank 0).
    """

    def __init__(self, bucket_size: int, is_master: bool = False, **engine_kwargs: Any) -> None:
        if not isinstance(bucket_size, int) or bucket_size <= 0:
            raise tensorhub.ConfigError(f"tensorhub: bucket_size must be a positive int, got {bucket_size!r}")
        self.bucket_size = bucket_size
        self.is_master = bool(is_master)
        self.settings = VerlSettings.from_kwargs(engine_kwargs)
        self.hub: Optional[tensorhub.Hub] = None  # connected in prepare(): no I/O in a constructor
        self.role: Optional[str] = None
        self.rank: Optional[int] = None
        self.version: Optional[int] = None  # this step's version (from init_process_group)
        self._publisher: Optional[Publisher] = None
        self._receiver: Optional[Receiver] = None

    # ------------------------------------------------------------------ lifecycle
    def _connect(self, role: str) -> tensorhub.Hub:
        if self.hub is None:
            s = self.settings
            config = s.hub_config(role)
            probe(config.coordinator, s.connect_timeout)  # fail fast, naming the URL, when it is down
            try:
                self.hub = tensorhub.connect(config=config)
            except tensorhub.UnauthorizedError as e:
                raise tensorhub.UnauthorizedError(
                    f"tensorhub: the coordinator at {config.coordinator} refused the token (verl engine_kwargs "
                    f"'token' or TENSORHUB_TOKEN): {e.message}", e.code, status=e.status) from None
            logger.info("tensorhub: %s worker %s connected to %s (model %r)", role, self.hub.worker_id,
                        self.hub.url, s.model)
        return self.hub

    @property
    def receiver(self) -> Receiver:
        if self._receiver is None:
            self._receiver = Receiver(self._connect("rollout"), self.settings.model, self.bucket_size,
                                      self.settings.timeout)
        return self._receiver

    @property
    def publisher(self) -> Publisher:
        if self._publisher is None:
            s = self.settings
            self._publisher = Publisher(self._connect("trainer"), s.model, s.keep, s.dtype)
        return self._publisher

    def prepare(self) -> dict[str, Any]:
        """Connect (once) and describe this worker; the trainer's master takes the step's
        version number from the coordinator (published by ``send_weights``)."""
        role = "trainer" if self.is_master else "worker"
        hub = self._connect(role)
        version = None
        if self.is_master:
            # a retried request (its answer lost) gets the same number: no version skipped
            version = hub.api.allocate_version(self.settings.model, None, request_id=secrets.token_hex(12))
        return {"coordinator": hub.url, "model": self.settings.model, "worker_id": hub.worker_id,
                "is_master": self.is_master, "version": version}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """No process group: every worker gets the version the trainer's master took, after
        checking that all name the same coordinator and model."""
        if len(metadata) != actor_wg_world_size + rollout_world_size:
            raise ValueError(f"tensorhub: {len(metadata)} metadata for {actor_wg_world_size} trainer and "
                             f"{rollout_world_size} rollout workers")
        first = metadata[0]
        for i, m in enumerate(metadata):
            side = "trainer" if i < actor_wg_world_size else "rollout"
            rank = i if i < actor_wg_world_size else i - actor_wg_world_size
            for key in ("coordinator", "model"):
                if m[key] != first[key]:
                    raise ValueError(f"tensorhub: {side} rank {rank} ({m['worker_id']}) uses {key} {m[key]!r}, "
                                     f"trainer rank 0 uses {first[key]!r}: engine_kwargs must agree")
        versions = [m["version"] for m in metadata[:actor_wg_world_size] if m["version"] is not None]
        if len(versions) != 1:
            raise ValueError(f"tensorhub: exactly one trainer rank must be the master (is_master=True), "
                             f"found {len(versions)}")
        v = versions[0]
        actor = {"rank": list(range(actor_wg_world_size)), "version": [v] * actor_wg_world_size,
                 "role": ["trainer"] * actor_wg_world_size}
        rollout = {"rank": list(range(rollout_world_size)), "version": [v] * rollout_world_size,
                   "role": ["rollout"] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, rank: int, version: int, role: str = "rollout", **_: Any) -> None:
        """Record this step's version and this worker's role; builds no group."""
        if role not in ("trainer", "rollout"):
            raise ValueError(f"tensorhub: role must be 'trainer' or 'rollout', got {role!r}")
        self.rank, self.version, self.role = rank, version, role
        if role == "rollout" and self.settings.prefetch:
            self.receiver.follow()  # once; prefetches every new version from now on

    def finalize(self) -> None:
        """End of a sync step. The published snapshot and a prefetched copy stay (readers
        read them later); the streaming buffers were freed when the stream ended."""
        self.version = None

    def close(self) -> None:
        """Drop this worker's replicas and leave the coordinator (e.g. at shutdown)."""
        if self._receiver is not None:
            self._receiver.close()
        if self.hub is not None:
            self.hub.close()
            self.hub = None

    # ------------------------------------------------------------------ trainer
    async def send_weights(self, weights: Any, global_steps: Optional[int] = None) -> dict:
        """Full tensors: the master publishes ``weights`` as this step's version (the number
        from ``prepare``; a new one when the topology was skipped), other ranks drain the
        generator. ``DTensor`` shards: every rank publishes its own slices of that version."""
        from ._publisher import _aiter, _is_dtensor

        items = _aiter(weights)
        first = await anext(items, None)
        if first is not None and _is_dtensor(first[1]):
            metrics = await self.publisher.publish_slices(first, items, self.version, self.settings.timeout,
                                                          self.is_master)
        elif not self.is_master:
            async for _ in items:
                pass
            return {}
        else:
            async def chained():
                if first is not None:
                    yield first
                async for item in items:
                    yield item

            metrics = await self.publisher.publish(chained(), self.version, self.settings.timeout)
        if global_steps is not None:
            logger.info("tensorhub: step %s -> %s v%d", global_steps, self.settings.model, metrics["tensorhub/version"])
        return metrics

    # ------------------------------------------------------------------ rollout
    async def receive_weights(self, global_steps: Optional[int] = None) -> AsyncGenerator[tuple[str, Any], None]:
        """``(name, tensor)`` of this step's version (from ``init_process_group``; the newest
        complete one when there was none), from the prefetched copy when it holds it, else
        streamed in buckets. A yielded tensor is valid until the item after its bucket."""
        t0 = time.monotonic()
        async for item in self.receiver.stream(self.version):
            yield item
        st = self.receiver.stats
        logger.info("tensorhub: step %s: received %s v%d (%s) in %.2fs", global_steps, self.settings.model,
                    st.version, st.source, time.monotonic() - t0)

    def prefetch(self, version: Optional[int] = None) -> Optional[int]:
        """Start fetching ``version`` (None: the next new one) into the local copy in the
        background, while rollouts run; returns at once. The copy is served to peers."""
        return self.receiver.prefetch(version)

    async def get_weights(self) -> AsyncGenerator[tuple[str, Any], None]:
        """``(name, tensor)`` of the prefetched copy (waits for a prefetch in flight; a clear
        error when nothing was prefetched)."""
        async for item in self.receiver.from_cache():
            yield item
