"""A vLLM CPU engine started from a trainer on the same host reads the trainer's snapshot in
place (``Hub.borrow``): no copy of its own before the engine is up, the same greedy outputs
as vLLM's own loader on the same bytes from local safetensors, and afterwards the engine's
``hf`` copy (made in the background from the borrowed memory) registered with every byte
of the version, so the trainer can drop the version and the engine serves it on."""

from __future__ import annotations

import time

import pytest

from _engines import Coordinator, OfflineEngine, reference_outputs, require_vllm
from tensorhub.testing import digest
from _tiny import PROMPTS, make_model_dir, make_weights

pytestmark = pytest.mark.engine


def test_engine_starts_in_place_from_a_same_host_trainer_and_then_serves_its_own_copy(tmp_path):
    require_vllm()
    import tensorhub

    coord = Coordinator(tmp_path / "state")
    trainer = tensorhub.connect(coord.url, worker_id="trainer")
    engines = []
    try:
        w1 = make_weights(0)
        snap = trainer.empty_like(w1)  # Hub memory: same-host readers may map it
        for k, t in w1.items():
            snap[k].copy_(t)
        v1 = trainer.publish("policy", snap)
        eng = OfflineEngine(tmp_path / "e.log", model=str(make_model_dir(tmp_path / "bare", weights=False)),
                            load_format="tensorhub",
                            model_loader_extra_config={"coordinator": coord.url, "model": "policy",
                                                       "worker_id": "engine-s"},
                            weight_transfer_config={"backend": "tensorhub"})
        engines.append(eng)
        log = eng.log_tail(400_000)
        assert f"loaded policy v{v1} in place (hf)" in log and "from {'trainer': " in log, log[-3000:]
        assert "tensorhub: fetched policy" not in log  # no copy of its own on the way to the parameters
        first = eng.call("generate", prompts=PROMPTS)["text"]
        assert first == reference_outputs(make_model_dir(tmp_path / "v1", seed=0), PROMPTS)["text"]

        def engine_holds() -> bool:
            st = trainer.api.get("/v1/status")
            return any(r["worker_id"] == "engine-s" and r["partial"] is None for m in st["models"]
                       for v in m["versions"] if v["version"] == v1 for r in v["replicas"])

        end = time.monotonic() + 60
        while not engine_holds():  # the copy is made in the background once the engine is up
            assert time.monotonic() < end, eng.log_tail()
            time.sleep(0.2)
        # vLLM's workers log to the engine's stdout, which a call drains into its log
        served = f"serves its hf copy of policy v{v1} (copied from the borrowed memory"
        while served not in eng.log_tail(400_000):
            assert time.monotonic() < end, eng.log_tail()
            eng.call("weight_version")
            time.sleep(0.2)
        # The borrowed lease is released: the trainer drops v1 at once and overwrites its memory.
        t0 = time.monotonic()
        trainer.unpublish("policy", v1, timeout=30)
        assert time.monotonic() - t0 < 5.0
        for t in snap.values():
            t.zero_()
        got = trainer.fetch("policy", v1, serve=False)  # the engine's copy, every byte
        assert set(got.sources) == {"engine-s"} and digest(got) == digest(w1)
        # The parameters view nothing of the trainer's (now zeroed) memory.
        assert eng.call("generate", prompts=PROMPTS)["text"] == first
    finally:
        for e in engines:
            e.close()
        trainer.close()
        coord.stop()
