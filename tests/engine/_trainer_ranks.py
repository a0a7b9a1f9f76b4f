"""One rank of a sharded trainer that speaks vLLM's trainer API (tests/engine/test_vllm_trainer_api.py).

``python _trainer_ranks.py RANK WORLD MASTER_PORT COORDINATOR ENGINE_URL SEED [bad]``: joins a
gloo group of WORLD ranks; each rank holds a row slice of every tensor of
``make_weights(SEED)`` and the source materializes each full tensor with an all-gather (a
real collective, as FSDP's ``full_tensor()``). Every rank calls ``trainer_init`` and
``send_weights``; rank 0 sends, the others' client raises if it is ever called. Prints one
``@@{json}`` line: the version published (rank 0), how many tensors this rank gathered and
the error ``send_weights`` raised, if any;
then shuts its engine down (rank 0's Hub closes: the engine keeps serving the version).
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    rank, world, port, url, engine_url, seed = sys.argv[1:7]
    bad = sys.argv[7:] == ["bad"]  # metadata() misdeclares one tensor's shape: rank 0 refuses it
    rank, world, seed = int(rank), int(world), int(seed)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    import torch
    import torch.distributed as dist
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from _tiny import make_weights
    from tensorhub.integrations.vllm.trainer import TensorHubTrainerInitInfo

    dist.init_process_group("gloo", rank=rank, world_size=world)
    full = make_weights(seed)
    shards = {n: t.chunk(world, dim=0)[rank].clone() for n, t in full.items()}
    gathered = [0]

    class Sharded(WeightSource):
        def metadata(self):
            meta = [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in full.items()]
            if bad:
                meta[1] = ParamMeta(meta[1].name, meta[1].dtype, (1,) + meta[1].shape)
            return meta

        def __iter__(self):
            for n in full:
                parts = [torch.empty_like(p) for p in full[n].chunk(world, dim=0)]
                dist.all_gather(parts, shards[n])  # every rank, same order: a collective
                gathered[0] += 1
                yield n, torch.cat(parts, dim=0)

    class NeverCalled:
        def __getattr__(self, name):
            raise AssertionError(f"rank {rank} called the engine client ({name}); only rank 0 sends")

    client = HTTPVLLMWeightSyncClient(engine_url) if rank == 0 else NeverCalled()
    eng = WeightTransferTrainerFactory.trainer_init(
        TensorHubTrainerInitInfo(model="policy", coordinator=url, worker_id=f"trainer-rank{rank}", rank=rank),
        client=client, source=Sharded())
    error = None
    try:
        eng.send_weights()
    except Exception as e:  # reported; the ranks must still have finished the same collectives
        error = str(e)
    dist.barrier()
    print("@@" + json.dumps({"rank": rank, "version": eng.version, "gathered": gathered[0],
                             "connected": eng.hub is not None, "error": error}), flush=True)
    eng.shutdown()  # the engine that swapped holds the version: the trainer may go
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
