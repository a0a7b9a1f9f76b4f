"""``prefetch`` (on by default) with a real vLLM CPU engine: the new version is fetched (and
served) while the engine still runs the old one; the swap then only applies it. And
``tensorhub follow`` learns the engine's workers from the engine itself and waits for that
prefetch before it pauses the engine."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time

import pytest

from _engines import Coordinator, OfflineEngine, ServerEngine, engine_env, require_vllm
from _tiny import PROMPTS, make_model_dir, make_weights

pytestmark = pytest.mark.engine


def _digest(tensors) -> dict:
    import torch

    return {k: hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, v in tensors.items()}


def test_prefetched_version_swaps_without_a_transfer(tmp_path):
    """The engine sets nothing about prefetch: the default prefetches."""
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
                                                       "worker_id": "engine-p"},  # prefetch: the default
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
        # v2 came without a delta: the engine now asks v3's lease ahead, before v3 exists
        end = time.monotonic() + 60
        while not any(s["worker_id"] == "engine-p" and s["version"] == v2 + 1
                      for s in trainer.api.get("/v1/status")["subscribers"]):
            assert time.monotonic() < end, eng.log_tail()
            time.sleep(0.2)
        w3 = make_weights(2)
        v3 = trainer.publish("policy", w3)
        end = time.monotonic() + 60
        while "engine-p" not in {r["worker_id"] for m in trainer.api.get("/v1/status")["models"]
                                 for v in m["versions"] if v["version"] == v3 for r in v["replicas"]
                                 if r["partial"] is None}:
            assert time.monotonic() < end, eng.log_tail()
            time.sleep(0.2)
        eng.call("start_weight_update")
        eng.call("update_weights", update_info={"version": v3})
        eng.call("finish_weight_update", weight_version=str(v3))
        log = eng.log_tail(400_000)  # (the worker's lines come through once it answered the swap)
        line = next(l for l in log.splitlines() if f"-> v{v3}:" in l)
        assert "prefetched before the swap" in line, line
        assert f"fetched policy v{v3} (hf, asked ahead)" in log, log[-3000:]
        trainer.unpublish("policy", v3, timeout=30)
        got = trainer.fetch("policy", v3, serve=False)  # the engine's copy, read into the kept one
        assert set(got.sources) == {"engine-p"} and _digest(got) == _digest(w3)
    finally:
        if eng is not None:
            eng.close()
        trainer.close()
        coord.stop()


def test_follow_learns_the_engines_workers_and_waits_for_its_prefetch(tmp_path):
    """``tensorhub follow`` without ``--engine-worker``: it asks the server for its TensorHub
    workers (``/collective_rpc`` ``weight_transfer_engine``), waits until that worker holds
    the new version, then swaps; the swap applies the prefetched copy, every byte v2's."""
    require_vllm()
    import httpx

    import tensorhub

    coord = Coordinator(tmp_path / "state")
    trainer = tensorhub.connect(coord.url, worker_id="trainer")
    srv = follow = None
    try:
        v1 = trainer.publish("policy", make_weights(0))
        srv = ServerEngine(tmp_path / "s.log", make_model_dir(tmp_path / "bare", weights=False), [
            "--load-format", "tensorhub",
            "--model-loader-extra-config", json.dumps({"model": "policy", "worker_id": "engine-f"}),
            "--weight-transfer-config", json.dumps({"backend": "tensorhub"})],
            env={"TENSORHUB_COORDINATOR": coord.url})
        infos = httpx.post(f"{srv.url}/collective_rpc", json={"method": "weight_transfer_engine"},
                           timeout=60).json()["results"]
        assert infos == [{"worker_id": "engine-f", "model": "policy", "version": v1, "serving": True,
                          "prefetch": True}], infos
        before = srv.generate(PROMPTS)
        follow = subprocess.Popen([sys.executable, "-m", "tensorhub", "follow", "--engine", srv.url,
                                   "--model", "policy", "--coordinator", coord.url, "--max-swaps", "1"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=engine_env())
        first = follow.stdout.readline()
        # the plug-in labels vLLM's weight version with the version it loaded (tensorhub.integrations.vllm._engine_core)
        assert f"engine at v{v1}" in first, first + follow.stderr.read()
        w2 = make_weights(1)
        v2 = trainer.publish("policy", w2)
        out, err = follow.communicate(timeout=180)
        assert follow.returncode == 0, err
        assert "engine worker(s) engine-f prefetch policy" in err, err
        assert f"v{v2}: stall " in out and "the engine had prefetched it (waited" in out, out + err
        line = next(l for l in srv.log_tail(400_000).splitlines() if f"-> v{v2}:" in l)
        assert "prefetched before the swap" in line, line
        assert httpx.get(f"{srv.url}/weight_info").json()["weight_version"] == str(v2)
        assert srv.generate(PROMPTS) != before
        trainer.unpublish("policy", v2, timeout=30)
        got = trainer.fetch("policy", v2, serve=False)  # the engine's prefetched copy, every byte
        assert set(got.sources) == {"engine-f"} and _digest(got) == _digest(w2)
    finally:
        if follow is not None and follow.poll() is None:
            follow.kill()
        if srv is not None:
            srv.close()
        trainer.close()
        coord.stop()
