"""vLLM's trainer-side weight-transfer API with TensorHub: the ``tensorhub`` trainer engine.

A framework that drives vLLM's trainer API (``WeightTransferTrainerFactory.trainer_init``,
then ``send_weights()`` each round; SkyRL, prime-rl) gets TensorHub by passing this
backend's init info; the engines run the worker-side ``tensorhub`` backend
(``--weight-transfer-config '{"backend": "tensorhub"}'``, :mod:`tensorhub.integrations.vllm.transfer`)::

    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from tensorhub.integrations.vllm.trainer import TensorHubTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        TensorHubTrainerInitInfo(model="policy", coordinator=URL, rank=rank),
        client=HTTPVLLMWeightSyncClient(ENGINE_URL), source=ModuleSource(model))
    for step in ...:
        train(...)
        engine.send_weights()     # publishes a new version; the engines fetch and swap to it

Who runs what (every trainer rank calls ``trainer_init`` and ``send_weights``; vLLM's rule:
rank 0 is the sender):

* ``trainer_init``: the sender connects a Hub to the coordinator (``coordinator``,
  ``token``; defaults ``TENSORHUB_COORDINATOR`` / ``TENSORHUB_TOKEN``) and calls the
  engines' ``init_weight_transfer_engine`` with ``{"coordinator": URL, "model": NAME}``
  (never the token: engines take theirs from their own settings or environment). Other
  ranks connect nothing.
* ``send_weights``: every rank iterates the source group by group
  (``WeightSource.iter_groups``: the gathers are collectives, so ranks stay in lockstep,
  even when one fails). The sender copies each group into a snapshot buffer and drops it
  before the next is materialized; once all groups are in, it publishes the buffer as a
  new version ``v`` (in place, the ``hf`` layout) and drives the engines:
  ``start_weight_update``, ``update_weights({"version": v})`` (each engine fetches ``v``
  from whoever holds it and swaps), ``finish_weight_update(weight_version=str(v))``.
* Memory on the sender: ``buffers`` snapshot buffers (default 2: ``v`` is published while
  engines may still read ``v-1``) plus one gathered group at a time, never a gathered
  model. A buffer is reused only after ``unpublish`` of the version it held returned (its
  readers drained). With ``buffers=1`` the previous version must be held elsewhere (the
  engines that swapped to it are) before it can be dropped.
* ``shutdown``: the sender's Hub closes; its replicas go, the engines keep theirs.

Sources whose ranks each hold only part of the model (``WeightSource.held_names``) are
refused at ``trainer_init``: the sender publishes whole tensors it materialized itself.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from .._core.settings import SettingsError

logger = logging.getLogger(__name__)

__all__ = ["TensorHubTrainerInitInfo", "TensorHubTrainerWeightTransferEngine", "register_trainer_engine"]

BACKEND = "tensorhub"


@dataclass
class TensorHubTrainerInitInfo(TrainerInitInfo):
    """Options of the ``tensorhub`` trainer engine (``rank``: this trainer process's rank,
    keyword-only, from vLLM's base class; rank 0 sends). An unknown option is a
    ``TypeError`` naming it; a bad value a :class:`SettingsError` naming the option."""

    backend: ClassVar[str] = BACKEND

    #: Model name on the coordinator (required), e.g. ``"policy"``; the engines must serve it.
    model: Optional[str] = None
    #: Coordinator URL(s); default ``TENSORHUB_COORDINATOR``.
    coordinator: Optional[str] = None
    #: API token of the coordinator; default ``TENSORHUB_TOKEN``. Never sent to the engines.
    token: Optional[str] = None
    #: The sender's worker id; default ``TENSORHUB_WORKER_ID`` or ``<host>-<pid>-<random>``.
    worker_id: Optional[str] = None
    #: Locality labels ``dc=..,zone=..,host=..``; default ``TENSORHUB_LOCALITY``.
    locality: Optional[str] = None
    #: Snapshot buffers the sender keeps (each one model-size, CPU memory).
    buffers: int = 2
    #: Seconds ``send_weights`` waits for the readers of the version a buffer held to drain
    #: before it reuses that buffer.
    drain_timeout: float = 300.0

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise SettingsError(f"tensorhub trainer engine: option 'model' is required (a model name), got "
                                f"{self.model!r}")
        if isinstance(self.buffers, bool) or not isinstance(self.buffers, int) or self.buffers < 1:
            raise SettingsError(f"tensorhub trainer engine: option 'buffers' must be an int >= 1, got "
                                f"{self.buffers!r}")
        if isinstance(self.drain_timeout, bool) or not isinstance(self.drain_timeout, (int, float)) \
                or not self.drain_timeout > 0:
            raise SettingsError(f"tensorhub trainer engine: option 'drain_timeout' must be seconds > 0, got "
                                f"{self.drain_timeout!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise SettingsError(f"tensorhub trainer engine: option 'rank' must be an int >= 0, got {self.rank!r}")


@dataclass
class _Buffer:
    """One snapshot buffer of the sender and the version it holds (None: not published)."""

    tensors: dict
    version: Optional[int] = None


class TensorHubTrainerWeightTransferEngine(TrainerWeightTransferEngine[TensorHubTrainerInitInfo]):
    """The ``tensorhub`` trainer engine; see the module docstring. Made by
    ``WeightTransferTrainerFactory.trainer_init`` (or :meth:`trainer_init`) on every rank."""

    init_info_cls = TensorHubTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource, info: TensorHubTrainerInitInfo,
                 hub: Any = None) -> None:
        super().__init__(client=client, source=source, is_sender=info.is_sender)
        self.info = info
        #: The sender's ``tensorhub.Hub`` (None on other ranks and after :meth:`shutdown`).
        self.hub = hub
        #: The version the last ``send_weights`` published and the engines swapped to.
        self.version: Optional[int] = None
        self._buffers: list[_Buffer] = []
        self._next = 0

    @classmethod
    def trainer_init(cls, init_info: TensorHubTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: Optional[WeightSource] = None) -> "TensorHubTrainerWeightTransferEngine":
        if not isinstance(init_info, TensorHubTrainerInitInfo):
            raise SettingsError(f"tensorhub trainer engine: init_info must be a TensorHubTrainerInitInfo, got "
                                f"{type(init_info).__name__}")
        if source is None:
            raise SettingsError("tensorhub trainer engine: trainer_init needs source= (a vLLM WeightSource, "
                                "e.g. ModuleSource(model)): send_weights publishes what it yields")
        held = source.held_names()
        if held is not None:
            raise SettingsError("tensorhub trainer engine: this source holds only part of the model on each rank "
                                "(WeightSource.held_names); the tensorhub backend publishes whole tensors from "
                                "rank 0 and needs a source that materializes every tensor there")
        hub = _connect(init_info) if init_info.is_sender else None
        engine = cls(client=client, source=source, info=init_info, hub=hub)
        if engine.is_sender:
            try:
                client.init_weight_transfer_engine({"coordinator": hub.url, "model": init_info.model})
            except BaseException:
                hub.close()
                raise
        return engine

    # ------------------------------------------------------------------ every round
    def send_weights(self) -> None:
        """Publish the source's weights as a new version and swap the engines to it (all
        ranks iterate the source; the sender publishes and drives the engines)."""
        if self.source is None:
            raise SettingsError("tensorhub trainer engine: send_weights() after shutdown()")
        t0 = time.monotonic()
        err: Optional[BaseException] = None
        buf: Optional[_Buffer] = None
        meta: dict = {}
        if self.is_sender:
            try:
                meta = {m.name: m for m in self.source.metadata()}
                buf = self._take_buffer(meta)
            except Exception as e:  # keep iterating: the other ranks are in the same collectives
                err = e
        filled: set = set()
        for names, tensors in self.source.iter_groups():
            if buf is not None and err is None:
                try:
                    _copy_group(buf.tensors, meta, names, tensors, filled)
                except Exception as e:
                    err = e
            del names, tensors  # one gathered group alive at a time
        if not self.is_sender:
            return
        if err is None and len(filled) != len(meta):
            missing = next(n for n in meta if n not in filled)
            err = SettingsError(f"tensorhub trainer engine: the source yielded {len(filled)} of the {len(meta)} "
                                f"tensors its metadata() declares (not {missing!r})")
        if err is not None or buf is None or self.hub is None:
            raise err or SettingsError("tensorhub trainer engine: send_weights() after shutdown()")
        t1 = time.monotonic()
        v = self.hub.publish(self.info.model, buf.tensors)
        buf.version = v
        t2 = time.monotonic()
        try:
            self.client.start_weight_update()
            self.client.update_weights({"version": v})
            self.client.finish_weight_update(weight_version=str(v))
        except Exception as e:
            body = getattr(getattr(e, "response", None), "text", None)  # an HTTP client's error: the engine's words
            raise RuntimeError(f"tensorhub trainer engine: published {self.info.model!r} v{v}, but the engines did "
                               f"not swap to it: {e}" + (f": {body}" if body else "")) from e
        self.version = v
        logger.info("tensorhub: published %s v%d (%d tensors, %.1f MB; snapshot %.2fs, publish %.2fs) and the "
                    "engines swapped to it in %.2fs", self.info.model, v, len(meta),
                    sum(t.numel() * t.element_size() for t in buf.tensors.values()) / 1e6, t1 - t0, t2 - t1,
                    time.monotonic() - t2)

    def _take_buffer(self, meta: dict) -> _Buffer:
        """The buffer to fill: a new one while fewer than ``buffers`` exist, else the oldest,
        after its version's readers drained (a buffer of other shapes is replaced)."""
        shapes = {n: (m.dtype, tuple(m.shape)) for n, m in meta.items()}
        if not shapes:
            raise SettingsError("tensorhub trainer engine: the source's metadata() lists no tensors")
        if len(self._buffers) < self.info.buffers:
            self._buffers.append(self._allocate(shapes))
            return self._buffers[-1]
        i, self._next = self._next, (self._next + 1) % len(self._buffers)
        buf = self._buffers[i]
        if buf.version is not None:
            try:
                self.hub.unpublish(self.info.model, buf.version, timeout=self.info.drain_timeout)
            except Exception as e:
                raise RuntimeError(f"tensorhub trainer engine: cannot reuse the buffer of {self.info.model!r} "
                                   f"v{buf.version} ({e}); it keeps serving v{buf.version}") from e
            buf.version = None
        if {n: (t.dtype, tuple(t.shape)) for n, t in buf.tensors.items()} != shapes:
            buf = self._buffers[i] = self._allocate(shapes)
        return buf

    def _allocate(self, shapes: dict) -> _Buffer:
        import torch

        return _Buffer(self.hub.empty_like({n: torch.empty(s, dtype=d, device="meta")
                                            for n, (d, s) in shapes.items()}))

    def shutdown(self) -> None:
        """Close the sender's Hub (its replicas go; engines keep theirs). Idempotent."""
        if self.hub is not None:
            self.hub.close()
            self.hub = None
        self._buffers.clear()
        self.source = None


def _copy_group(buf: dict, meta: dict, names: list, tensors: list, filled: set) -> None:
    """Copy one yielded group into its snapshot slots (adding the names to ``filled``),
    refusing what the source's metadata did not declare."""
    if len(names) != len(tensors):
        raise SettingsError(f"tensorhub trainer engine: the source yielded a group of {len(names)} names and "
                            f"{len(tensors)} tensors")
    for name, t in zip(names, tensors):
        m = meta.get(name)
        if m is None:
            raise SettingsError(f"tensorhub trainer engine: the source yielded {name!r}, which its metadata() "
                                "does not declare")
        if t is None:
            raise SettingsError(f"tensorhub trainer engine: the source yielded no tensor for {name!r} on rank 0")
        if t.dtype != m.dtype or tuple(t.shape) != tuple(m.shape):
            raise SettingsError(f"tensorhub trainer engine: the source yielded {name!r} as "
                                f"{t.dtype}{list(t.shape)}, its metadata() declares {m.dtype}{list(m.shape)}")
        if name in filled:
            raise SettingsError(f"tensorhub trainer engine: the source yielded {name!r} twice")
        buf[name].copy_(t.detach())
        filled.add(name)


def _connect(info: TensorHubTrainerInitInfo) -> Any:
    """The sender's Hub; a bad coordinator or token becomes one line naming the option."""
    import tensorhub

    try:
        return tensorhub.connect(info.coordinator, worker_id=info.worker_id, locality=info.locality,
                                 token=info.token)
    except tensorhub.UnauthorizedError as e:
        where = info.coordinator or "$TENSORHUB_COORDINATOR"
        raise SettingsError(f"tensorhub trainer engine: option 'token': the coordinator at {where} refused it "
                            f"({e.message})") from None
    except (tensorhub.ConfigError, tensorhub.CoordinatorUnavailableError) as e:
        raise SettingsError(f"tensorhub trainer engine: option 'coordinator': {e}") from None


def register_trainer_engine() -> None:
    """Register this engine as vLLM's ``tensorhub`` trainer backend. Idempotent; done on
    import of this module and by the plug-in's ``register``."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, TensorHubTrainerWeightTransferEngine)


register_trainer_engine()
