"""vLLM CPU engines (TP=1 and TP=2) load and swap versions a 2-rank FSDP2 trainer published
as slices, without a gather (issue #15 item 3).

Real parts: a coordinator process, two trainer processes in a gloo group with
``fully_shard`` on the tiny Llama (``_tiny``'s seeded weights), each registering its own
shards in place over Mooncake; a TP=1 and a TP=2 ``vllm.LLM`` with no weight files loading
through ``--load-format tensorhub`` and swapping through vLLM's weight-transfer API.
"""

from __future__ import annotations

import pytest

from _engines import Coordinator, OfflineEngine, require_vllm
from _tiny import PROMPTS, make_model_dir, make_weights

pytestmark = pytest.mark.engine

MODEL = "policy"


def test_vllm_tp1_and_tp2_load_and_swap_versions_published_sliced(tmp_path):
    require_vllm()
    import torch

    import tensorhub
    from tensorhub.testing._fsdp import ShardedTrainer

    coord = Coordinator(tmp_path / "state")
    engines = []
    tr = ShardedTrainer(coord.url, 2, str(tmp_path / "init"), kind="llama", seed=0)
    try:
        assert set(tr.all("publish", "step-1", answer="published").values()) == {1}
        full1 = tr.full()
        seeded = make_weights(0)
        assert set(full1) == set(seeded) and all(torch.equal(full1[k], seeded[k]) for k in seeded)
        bare = make_model_dir(tmp_path / "bare", weights=False)

        def engine(name, **kw):
            e = OfflineEngine(tmp_path / f"{name}.log", model=str(bare), load_format="tensorhub",
                              model_loader_extra_config={"coordinator": coord.url, "model": MODEL,
                                                         "worker_id": name},
                              weight_transfer_config={"backend": "tensorhub"}, **kw)
            engines.append(e)
            return e

        a = engine("engine-a")
        out_a1 = a.call("generate", prompts=PROMPTS)
        fetched = next(l for l in a.log_tail(400_000).splitlines() if "tensorhub: fetched policy v1 (hf)" in l)
        assert "'trainer-0'" in fetched and "'trainer-1'" in fetched, fetched  # assembled from both ranks
        tp = engine("engine-tp", env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, tensor_parallel_size=2)
        assert tp.call("generate", prompts=PROMPTS)["ids"] == out_a1["ids"]
        with tensorhub.connect(coord.url, worker_id="checker") as hub:
            # What the engine serves is its assembled copy: exactly the trainer's bytes.
            got = hub.fetch(MODEL, 1, serve=False)
            assert set(got.sources) <= {"engine-a", "engine-tp-tp0"}
            assert all(torch.equal(got[k], full1[k]) for k in full1)
            # Swap: a step, v2 published sliced, both engines swap to it through vLLM's API.
            tr.all("step", 0.01, answer="stepped")
            assert set(tr.all("publish", "step-2", answer="published").values()) == {2}
            full2 = tr.full()
            outs = []
            for e in (a, tp):
                e.call("start_weight_update")
                e.call("update_weights", update_info={"version": "latest"})
                e.call("finish_weight_update", weight_version="2")
                outs.append(e.call("generate", prompts=PROMPTS))
            assert outs[0]["ids"] == outs[1]["ids"] and outs[0]["ids"] != out_a1["ids"]
            got2 = hub.fetch(MODEL, 2, serve=False)
            assert all(torch.equal(got2[k], full2[k]) for k in full2)
            tr.all("unpublish", 1, answer="unpublished")
    finally:
        for e in engines:
            e.close()
        tr.close()
        coord.stop()
