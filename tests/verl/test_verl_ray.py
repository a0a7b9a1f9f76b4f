"""verl's own ``CheckpointEngineManager`` over Ray drives the ``tensorhub`` backend.

Real: Ray (a local cluster), verl's ``RayResourcePool`` / ``RayWorkerGroup`` / dispatch, its
``CheckpointEngineManager.update_weights`` (abort, kv release, ``build_process_group``:
prepare, build_topology, init_process_group; send and receive; finalize; resume), its
``CheckpointEngineWorker`` on the rollouts, the backend found by name through verl's
entry-point discovery in every Ray worker, a coordinator process, Mooncake between the
workers. Stands in: the model engine (seeded tensors) and the server adapter (hashes).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tensorhub.testing import CoordinatorProcess

from _verl_procs import digests, make_weights

pytestmark = pytest.mark.multiprocess


def test_verls_checkpoint_engine_manager_over_ray(tmp_path, verl_plugin):
    import ray

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
    from _tiny import make_model_dir

    model_dir = str(make_model_dir(tmp_path / "model", 0, weights=False))
    c = CoordinatorProcess(tmp_path / "state")
    c.start()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
                                       "GLOG_minloglevel": "2"}})
    try:
        from _verl_ray import RolloutWorker, TrainerWorker, replicas
        from verl.checkpoint_engine import CheckpointEngineManager
        from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
        from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig

        ce = CheckpointEngineConfig(backend="tensorhub", update_weights_bucket_megabytes=1,
                                    engine_kwargs={"tensorhub": {"coordinator": c.url, "timeout": 120}})
        rc = RolloutConfig(name="vllm", checkpoint_engine=ce, tensor_model_parallel_size=1)
        mc = HFModelConfig(path=model_dir, load_tokenizer=False)
        trainers = RayWorkerGroup(resource_pool=RayResourcePool([2], use_gpu=False, max_colocate_count=1),
                                  ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(TrainerWorker),
                                                                         checkpoint_engine_config=ce),
                                  device_name="cpu")
        rollout_wg = RayWorkerGroup(resource_pool=RayResourcePool([2], use_gpu=False, max_colocate_count=1),
                                    ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(RolloutWorker),
                                                                           rollout_config=rc, model_config=mc),
                                    device_name="cpu")
        manager = CheckpointEngineManager(config=ce, actor_wg=trainers, replicas=replicas(rollout_wg, rc, mc))
        for step in (1, 2):
            manager.update_weights(global_steps=step)
            want = digests(make_weights(step))
            got = rollout_wg.received()
            assert len(got) == 2 and all(g == want for g in got)  # both rollout workers, every tensor exact
    finally:
        ray.shutdown()
        c.stop()
