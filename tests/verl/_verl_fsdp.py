"""FSDP2 trainer ranks driving the verl backend's ``send_weights`` with ``DTensor`` shards.

Each rank is a ``spawn`` process (:class:`_verl_procs.Proc`) in a real gloo group on CPU,
its tiny Llama (HF names, ``tensorhub.testing._fsdp.tiny_llama``) sharded with FSDP2
``fully_shard``; it builds the backend through verl's ``CheckpointEngineRegistry`` as
verl's actor worker does (rank 0 is the master) and hands ``send_weights`` the model's
``state_dict()`` items: DTensors, no gather. ``die_after=k`` makes the rank exit after its
generator yielded ``k`` tensors (a rank dying mid-send).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Optional

from _verl_procs import BACKEND, Proc, _load_backend, _serve, digest


def _fsdp_trainer(conn: Any, rank: int, world: int, init_file: str, engine_kwargs: dict, bucket_mb: int) -> None:
    os.environ.setdefault("GLOG_minloglevel", "2")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    _load_backend("plugins")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from verl.checkpoint_engine import CheckpointEngineRegistry

    from tensorhub.testing._fsdp import tiny_llama

    model = tiny_llama(0)
    mesh = init_device_mesh("cpu", (world,))
    for m in list(model.modules())[1:]:
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    engine = CheckpointEngineRegistry.new(BACKEND, is_master=(rank == 0), bucket_size=bucket_mb << 20,
                                          **engine_kwargs)

    def send(step: int, global_steps: Optional[int] = None, die_after: Optional[int] = None) -> dict:
        with torch.no_grad():  # a training step: every parameter changes
            for p in model.parameters():
                p.add_(torch.full_like(p, 0.01 * step))
        items = [(n, p.detach()) for n, p in model.state_dict().items()]

        def weights():
            for i, item in enumerate(items):
                if die_after is not None and i == die_after:
                    os._exit(3)
                yield item

        kinds = sorted({type(t).__name__ for _, t in items})
        metrics = asyncio.run(engine.send_weights(weights(), global_steps=global_steps))
        full = {n: digest(t.full_tensor()) for n, t in items}  # a gather, only to compare with
        local = sum(t.to_local().numel() * t.element_size() for _, t in items)
        return {"metrics": metrics, "digests": full if rank == 0 else None, "kinds": kinds, "local_bytes": local,
                "full_bytes": sum(t.numel() * t.element_size() for _, t in items), "worker_id": engine.hub.worker_id}

    try:
        _serve(conn, {"engine": lambda m, *a, **k: getattr(engine, m)(*a, **k), "send": send})
    finally:
        dist.destroy_process_group()


def fsdp_trainer(rank: int, world: int, init_file: str, engine_kwargs: dict, bucket_mb: int = 1) -> Proc:
    return Proc(_fsdp_trainer, rank, world, init_file, engine_kwargs, bucket_mb)
