"""``prefetch`` with a real vLLM CPU engine: the new version is fetched (and served) while
the engine still runs the old one; the swap then only applies it."""

from __future__ import annotations

import hashlib
import time

import pytest

from _engines import Coordinator, OfflineEngine, require_vllm
from _tiny import PROMPTS, make_model_dir, make_weights

pytestmark = pytest.mark.engine


def _digest(tensors) -> dict:
    import torch

    return {k: hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, v in tensors.items()}


def test_prefetched_version_swaps_without_a_transfer(tmp_path):
    require_vllm()
    import tensorhub

    coord = Coordinator(tmp_path / "state")
    trainer = tensorhub.connect(coord.url, worker_id="trainer")
    eng = None
    try:
        v1 = trainer.publish("policy", make_weights(0))
        eng = OfflineEngine(tmp_path / "e.log", model=str(make_model_dir(tmp_path / "bare", weights=False)),
                            load_format="tensorhub",
                            model_loader_extra_config={"coordinator": coord.url, "model": "policy",
                                                       "worker_id": "engine-p", "prefetch": True},
                            weight_transfer_config={"backend": "tensorhub"})
        before = eng.call("generate", prompts=PROMPTS)["text"]
        w2 = make_weights(1)
        v2 = trainer.publish("policy", w2)

        def holders() -> set:
            st = trainer.api.get("/v1/status")
            return {r["worker_id"] for m in st["models"] for v in m["versions"] if v["version"] == v2
                    for r in v["replicas"] if r["partial"] is None}  # whole replicas, not mid-fetch

        end = time.monotonic() + 60
        while "engine-p" not in holders():  # prefetched and served before any swap
            assert time.monotonic() < end, eng.log_tail()
            time.sleep(0.2)
        assert eng.call("generate", prompts=PROMPTS)["text"] == before  # still runs v1
        eng.call("start_weight_update")
        eng.call("update_weights", update_info={"version": v2})
        eng.call("finish_weight_update", weight_version=str(v2))
        assert eng.call("generate", prompts=PROMPTS)["text"] != before
        line = next(l for l in eng.log_tail(400_000).splitlines() if f"-> v{v2}:" in l)
        assert "prefetched before the swap" in line, line
        trainer.unpublish("policy", v2, timeout=30)
        got = trainer.fetch("policy", v2, serve=False)  # the engine's copy, every byte
        assert set(got.sources) == {"engine-p"} and _digest(got) == _digest(w2)
        assert v1 < v2
    finally:
        if eng is not None:
            eng.close()
        trainer.close()
        coord.stop()
