"""Ray workers for test_verl_ray.py: a trainer worker group and rollout workers built on
verl's own ``Worker`` / ``CheckpointEngineWorker`` and dispatch decorators, as verl's
tests/checkpoint_engine/test_utils.py builds them, without a model engine (the trainer
yields seeded tensors as ``get_per_tensor_param`` would) and with a hashing server adapter."""

from __future__ import annotations

import asyncio
from typing import Optional

from verl.checkpoint_engine import CheckpointEngineRegistry, CheckpointEngineWorker
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.workers.rollout import BaseRollout, RolloutReplica

from _verl_procs import digest, make_weights


class TrainerWorker(Worker):
    def __init__(self, checkpoint_engine_config) -> None:
        super().__init__()
        ce = checkpoint_engine_config
        kwargs = ce.engine_kwargs.get(ce.backend, {})
        # as verl's engine_workers.ActorRolloutRefWorker: rank 0 is the master
        self.checkpoint_engine = CheckpointEngineRegistry.new(ce.backend, is_master=(self.rank == 0),
                                                              bucket_size=ce.update_weights_bucket_megabytes << 20,
                                                              **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: Optional[int] = None, mode: str = "auto"):
        w = make_weights(global_steps)
        return await self.checkpoint_engine.send_weights(iter(w.items()), global_steps=global_steps)

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args, **kwargs):
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)


class Hashing(BaseRollout):
    async def resume(self, tags):  # pragma: no cover - not called
        pass

    async def release(self):  # pragma: no cover - not called
        pass

    async def update_weights(self, weights, **kwargs):
        self.got = {}
        async for name, t in weights:
            self.got[name] = digest(t)


class RolloutWorker(CheckpointEngineWorker):
    def __init__(self, rollout_config, model_config) -> None:
        super().__init__(rollout_config, model_config, Hashing(rollout_config, model_config, None))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def received(self) -> dict:
        return self.server_adapter.got


class Replica(RolloutReplica):
    """verl's MockReplica: the workers of one replica; abort/release/resume have no servers to call."""

    async def init_hybrid(self, worker_group) -> None:
        self.workers = worker_group.workers[self.world_size * self.replica_rank:
                                            self.world_size * (self.replica_rank + 1)]

    def get_ray_class_with_init_args(self):  # pragma: no cover - not called
        raise NotImplementedError

    async def launch_servers(self):  # pragma: no cover - not called
        raise NotImplementedError


def replicas(wg, rollout_config, model_config) -> list:
    out = [Replica(replica_rank=i, config=rollout_config, model_config=model_config) for i in range(wg.world_size)]

    async def init():
        await asyncio.gather(*[r.init_hybrid(wg) for r in out])

    asyncio.run(init())
    return out
