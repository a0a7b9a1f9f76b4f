"""The verl backend with an FSDP2 trainer that does not gather: every trainer rank publishes
its own DTensor shards as slices of the step's version (docs/concepts/sliced.md).

Real parts: a gloo group of 2 spawned ranks with ``fully_shard`` handing ``send_weights``
their DTensors, verl 0.9.1's registry and ``CheckpointEngineWorker`` on the rollout side, a
coordinator process, Mooncake over TCP. Every received tensor is compared by hash with the
full tensor (gathered only for the comparison).
"""

from __future__ import annotations


import pytest


from _verl_fsdp import fsdp_trainer
from _verl_procs import BACKEND, RemoteError, rollout

MB = 1 << 20


def _topology(trainers, rollouts):
    from verl.checkpoint_engine import CheckpointEngineRegistry

    meta = [w.call("engine", "prepare") for w in trainers + rollouts]
    actor, roll = CheckpointEngineRegistry.get(BACKEND).build_topology(len(trainers), len(rollouts), meta)
    for group, kw in ((trainers, actor), (rollouts, roll)):
        for i, w in enumerate(group):
            w.call("engine", "init_process_group", **{k: v[i] for k, v in kw.items()})
    return actor["version"][0], [m["worker_id"] for m in meta]


@pytest.mark.multiprocess
def test_fsdp2_ranks_publish_their_shards_and_rollouts_get_bit_exact_full_tensors(coord, model_dir, tmp_path):
    kw = {"coordinator": coord.url, "timeout": 120}
    trainers = [fsdp_trainer(r, 2, str(tmp_path / "pg"), kw) for r in range(2)]
    rollouts = [rollout(0, kw, model_dir), rollout(1, {**kw, "prefetch": True}, model_dir)]
    try:
        for w in trainers + rollouts:
            w.ready()
        versions = []
        for step in (1, 2, 3):
            v, ids = _topology(trainers, rollouts)
            for t in trainers:
                t.start("send", step, global_steps=step)
            rollouts[0].start("update", global_steps=step)
            sent = [t.result() for t in trainers]
            got = rollouts[0].result()
            cached = rollouts[1].call("update", global_steps=step)  # from the prefetched copy
            fetched = rollouts[1].call("get_weights")
            for w in trainers + rollouts:
                w.call("engine", "finalize")
            versions.append(v)
            want = sent[0]["digests"]
            assert all(s["kinds"] == ["DTensor"] for s in sent)
            for s in sent:  # each rank snapshotted and published only its own shard
                m = s["metrics"]
                assert m["tensorhub/version"] == v and m["tensorhub/sliced"] == 1
                assert m["tensorhub/bytes"] == s["local_bytes"] < s["full_bytes"]
            assert sum(s["metrics"]["tensorhub/bytes"] for s in sent) == sent[0]["full_bytes"]
            assert got["digests"] == want and list(got["digests"]) == list(want)  # bit for bit, in order
            st = got["stats"]
            assert st["version"] == v and st["source"] == "stream" and st["buckets"] > 1
            assert st["largest_bucket"] <= MB
            # from the slice holders (the trainer ranks), or the copy the prefetching rollout serves
            assert set(st["sources"]) <= {*ids[:2], ids[3]} and sum(st["sources"].values()) == st["nbytes"]
            layouts = rollouts[0].call("layouts", v)
            assert layouts["hf.slices"] == (2, True)  # published as 2 ranks' slices, complete
            assert cached["digests"] == want and cached["stats"]["source"] == "cache"
            assert cached["stats"]["version"] == v
            assert fetched == want
        assert versions == sorted(versions) and len(set(versions)) == 3
    finally:
        for w in trainers + rollouts:
            w.close()


@pytest.mark.multiprocess
def test_a_rank_dying_mid_send_leaves_the_version_incomplete_and_rollouts_get_a_clear_error(coord, model_dir,
                                                                                               tmp_path):
    kw = {"coordinator": coord.url, "timeout": 120}
    trainers = [fsdp_trainer(r, 2, str(tmp_path / "pg"), kw) for r in range(2)]
    ro = rollout(0, {**kw, "timeout": 6}, model_dir)
    try:
        for w in trainers + [ro]:
            w.ready()
        v, _ = _topology(trainers, [ro])
        trainers[1].start("send", 1, die_after=3)  # exits after 3 of its tensors: registers nothing
        ro.start("update", global_steps=1)
        with pytest.raises(RemoteError, match=f"'policy' v{v} was not complete within 6s \\(published as slices: "
                                              r"1 of 2 trainer ranks registered theirs, ranks \[1\] did not"):
            # rank 0 publishes its shard; its gather for the comparison never returns, so only start it
            trainers[0].start("send", 1)
            ro.result(timeout=120)
        trainers[1].p.join(30)
        assert trainers[1].p.exitcode == 3
        import tensorhub

        hub = tensorhub.connect(coord.url, worker_id="observer")
        try:
            info = hub.version_info("policy", v)
            assert info is not None and not info.complete
            assert hub.latest("policy") is None  # never handed out
        finally:
            hub.close()
    finally:
        for w in [ro] + trainers:
            if w is trainers[0]:
                w.p.kill()
            w.close()


def test_sliced_weights_without_a_version_and_replicated_placements_are_clear_errors(tmp_path):
    import asyncio
    import subprocess
    import sys

    import tensorhub
    from tensorhub.integrations.verl._publisher import Publisher

    p = Publisher(hub=None, model="policy", keep=2, dtype=None)

    async def rest():
        return
        yield

    with pytest.raises(tensorhub.ConfigError, match="need the step's version on every trainer rank"):
        asyncio.run(p.publish_slices(("w", None), rest(), None, 5, True))
    # a DTensor replicated over the mesh (HSDP's replicate dimension): refused, naming the tensor
    code = ("import torch, torch.distributed as dist\n"
            f"dist.init_process_group('gloo', init_method='file://{tmp_path / 'pg'}', rank=0, world_size=1)\n"
            "from torch.distributed.device_mesh import init_device_mesh\n"
            "from torch.distributed.tensor import distribute_tensor, Replicate, Shard\n"
            "from tensorhub.integrations.verl._publisher import _local_part\n"
            "mesh = init_device_mesh('cpu', (1,))\n"
            "local, shape, off, r = _local_part('a', distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)]))\n"
            "assert (tuple(local.shape), shape, off, r) == ((4, 3), (4, 3), (0, 0), (0, 1)), (shape, off, r)\n"
            "try:\n    _local_part('w', distribute_tensor(torch.ones(4), mesh, [Replicate()]))\n"
            "except ValueError as e:\n    print(e)\n"
            "dist.destroy_process_group()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "PYTHONPATH": ":".join(sys.path)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "tensor 'w': placement Replicate() on mesh dimension 0: sliced publishing takes Shard placements" \
        in out.stdout
