"""The vLLM adapter with real vLLM CPU engines (a tiny Llama made locally, float32).

One fleet per module, because each engine start costs ~20-40 s on two cores:

* engine A: offline ``vllm.LLM``, ``--load-format tensorhub`` with ``on_missing="disk"``:
  no version yet, so it loads its weight files and publishes them as v1;
* engine B: the OpenAI server (dev mode) with ``--load-format tensorhub`` and a model
  directory without weight files: it loads v1 from A;
* a trainer (this process) publishes v2; A swaps offline, B through the HTTP endpoints;
  a fresh engine C loads v2's safetensors from disk with vLLM's default loader: the
  reference for the outputs.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest

from _engines import Coordinator, EngineError, OfflineEngine, ServerEngine, require_vllm
from _tiny import PROMPTS, make_model_dir, make_weights

pytestmark = pytest.mark.engine

MODEL = "policy"


def _digest(tensors: dict) -> dict:
    import torch

    return {k: hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, v in tensors.items()}


def _status(url: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "tensorhub", "status", "--coordinator", url, "--json"],
                         capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def _replicas(url: str, version: int) -> dict:
    """worker id -> layout of each replica of MODEL v``version``."""
    for m in _status(url)["models"]:
        if m["model"] == MODEL:
            for v in m["versions"]:
                if v["version"] == version:
                    return {r["worker_id"]: r["layout"] for r in v["replicas"]}
    return {}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    require_vllm()
    import tensorhub

    tmp = tmp_path_factory.mktemp("fleet")
    coord = Coordinator(tmp / "state")
    f = {"coord": coord, "url": coord.url, "tmp": tmp, "engines": []}
    try:
        f["dir_v1"] = make_model_dir(tmp / "v1", seed=0)
        f["dir_v2"] = make_model_dir(tmp / "v2", seed=1)
        f["dir_bare"] = make_model_dir(tmp / "bare", weights=False)
        a = OfflineEngine(tmp / "a.log", model=str(f["dir_v1"]), load_format="tensorhub",
                          model_loader_extra_config={"coordinator": coord.url, "model": MODEL,
                                                     "on_missing": "disk", "worker_id": "engine-a"},
                          weight_transfer_config={"backend": "tensorhub"})
        f["engines"].append(a)
        f["a"] = a
        b = ServerEngine(tmp / "b.log", f["dir_bare"], [
            "--load-format", "tensorhub",
            "--model-loader-extra-config", json.dumps({"model": MODEL, "worker_id": "engine-b"}),
            "--weight-transfer-config", json.dumps({"backend": "tensorhub"})],
            env={"TENSORHUB_COORDINATOR": coord.url})  # the env default for "coordinator"
        f["engines"].append(b)
        f["b"] = b
        f["trainer"] = tensorhub.connect(coord.url, worker_id="trainer")
        yield f
    finally:
        for e in f["engines"]:
            e.close()
        if "trainer" in f:
            f["trainer"].close()
        coord.stop()


def test_cold_start_from_peers(fleet):
    """A publishes its disk weights as v1; B (no weight files) loads v1 from A: same outputs."""
    a, b = fleet["a"], fleet["b"]
    out_a = a.call("generate", prompts=PROMPTS)
    out_b = b.generate(PROMPTS)
    assert out_b == out_a["text"]
    assert len(set(map(tuple, out_a["ids"]))) > 1  # the prompts do not all give the same tokens
    reps = _replicas(fleet["url"], 1)
    assert reps == {"engine-a": "hf", "engine-b": "hf"}, reps
    assert "engine-b" in subprocess.run([sys.executable, "-m", "tensorhub", "status", "--coordinator",
                                         fleet["url"]], capture_output=True, text=True, check=True).stdout
    assert "fetched policy v1" in b.log_tail(200_000)
    fleet["v1_text"] = out_a["text"]


def test_hot_swap_offline_and_http(fleet):
    """The trainer publishes v2; A swaps offline, B over HTTP; both match a fresh engine on v2."""
    a, b, trainer = fleet["a"], fleet["b"], fleet["trainer"]
    w2 = make_weights(1)
    v2 = trainer.publish(MODEL, w2)
    assert v2 == 2

    a.call("init_weight_transfer_engine", init_info={})
    a.call("start_weight_update")
    a.call("update_weights", update_info={"version": v2})
    a.call("finish_weight_update", weight_version=str(v2))
    assert a.call("weight_version") == "2"

    # A dropped v1; B is now its only holder: a read of v1 must come from B, byte-exact.
    assert "engine-a" not in _replicas(fleet["url"], 1)
    got = trainer.fetch(MODEL, 1, serve=False)
    assert got.sources == {"engine-b": got.nbytes}
    from safetensors.torch import load_file

    assert _digest(got) == _digest(load_file(str(fleet["dir_v1"] / "model.safetensors")))

    assert b.post("/pause").status_code == 200
    assert b.post("/init_weight_transfer_engine", {"init_info": {}}).status_code == 200
    assert b.post("/start_weight_update").status_code == 200
    r = b.post("/update_weights", {"update_info": {"version": v2}})
    assert r.status_code == 200, r.text
    assert b.post("/finish_weight_update", {"weight_version": str(v2)}).status_code == 200
    assert b.post("/resume").status_code == 200
    import httpx

    assert httpx.get(f"{b.url}/weight_info").json()["weight_version"] == "2"

    # The trainer may now reuse its memory: the engines hold v2.
    trainer.unpublish(MODEL, v2, timeout=30)
    for t in w2.values():
        t.zero_()
    assert set(_replicas(fleet["url"], 2)) == {"engine-a", "engine-b"}
    assert _replicas(fleet["url"], 1) == {}

    c = OfflineEngine(fleet["tmp"] / "c.log", model=str(fleet["dir_v2"]))
    try:
        ref = c.call("generate", prompts=PROMPTS)
    finally:
        c.close()
    out_a = a.call("generate", prompts=PROMPTS)
    assert out_a["ids"] == ref["ids"]
    assert b.generate(PROMPTS) == ref["text"]
    assert ref["text"] != fleet.get("v1_text")
    # and the bytes the engines serve are v2's
    got = trainer.fetch(MODEL, 2, serve=False)
    assert _digest(got) == _digest(make_weights(1))


def test_failed_fetch_keeps_old_weights(fleet):
    """Asking for a version that does not exist fails clearly; B keeps serving v2."""
    b = fleet["b"]
    before = b.generate(PROMPTS)
    assert b.post("/pause").status_code == 200
    assert b.post("/start_weight_update").status_code == 200
    r = b.post("/update_weights", {"update_info": {"version": 99}})
    assert r.status_code >= 400
    assert "no complete version 99" in r.text or "no complete version 99" in b.log_tail(200_000)
    assert "keeps serving v2" in b.log_tail(200_000)
    assert b.post("/resume").status_code == 200
    assert b.generate(PROMPTS) == before
    import httpx

    assert httpx.get(f"{b.url}/weight_info").json()["weight_version"] == "2"
