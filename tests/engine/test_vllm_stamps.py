"""Version stamps and cache resets at a swap, with real vLLM CPU engines (issue 33, items 4-5).

One fleet for the module (each engine start costs ~30-45 s on two cores):

* a trainer (this process) publishes v1 = ``make_weights(0)`` and later v2 = ``make_weights(1)``,
  v3 = the bytes of v1 again, v4 = the bytes of v2 again;
* engine S: the OpenAI server (dev mode), ``--load-format tensorhub`` from a directory
  without weight files (it loads v1 from the trainer), 32-token KV blocks (CPU attention needs multiples of 32), prompt token
  details on (``usage.prompt_tokens_details.cached_tokens``: the prompt's prefix-cache hits);
* engine R: an offline ``vllm.LLM`` on v2's safetensors with vLLM's own loader (the fresh
  reference for v2's weights), with the tensorhub weight-transfer backend; later it swaps
  offline (no pause exists there).

The long prompt is 100 tokens: three full KV blocks that a second request reuses. Block
hashes are token ids, not weights: a swap that kept the cache would reuse blocks computed
with the old weights, and the output after the swap would differ from a fresh engine's.
"""

from __future__ import annotations

import json

import httpx
import pytest

from _engines import OfflineEngine, ServerEngine, close_fixture, require_vllm
from _tiny import make_model_dir, make_weights

pytestmark = pytest.mark.engine

MODEL = "policy"
LONG = " ".join(f"w{(7 * i) % 500 + 1}" for i in range(100))  # 100 tokens: 3 full 32-token blocks
SHORT = "w1 w2 w3"
ENGINE = {"block_size": 32, "enable_prefix_caching": True, "max_model_len": 256}


class ProbeEngine(OfflineEngine):
    """``vllm.LLM`` in a child process (``_offline_probe.py``: generate also answers the
    prefix-cache hits and ``weight_versions`` of each output)."""

    script = "_offline_probe.py"


def _complete(engine: ServerEngine, prompt, max_tokens: int = 8, **extra) -> httpx.Response:
    r = engine.post("/v1/completions", {"model": engine.model_dir, "prompt": prompt, "max_tokens": max_tokens,
                                        "temperature": 0, "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    return r


def _cached(r: httpx.Response) -> int:
    return (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def _swap(engine: ServerEngine, version: int, pause: str | None) -> None:
    """One swap over vLLM's RL routes; ``pause`` None swaps without pausing (as vLLM's
    ``HTTPVLLMWeightSyncClient`` does), else it is the query of ``/pause``."""
    if pause is not None:
        assert engine.post(f"/pause?{pause}").status_code == 200
    try:
        assert engine.post("/start_weight_update").status_code == 200
        r = engine.post("/update_weights", {"update_info": {"version": version}})
        assert r.status_code == 200, r.text
        assert engine.post("/finish_weight_update", {"weight_version": str(version)}).status_code == 200
    finally:
        if pause is not None:
            assert engine.post("/resume").status_code == 200


def _spans(*spans) -> list:
    return [{"version": str(v), "start": s, "end": e} for v, s, e in spans]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    require_vllm()
    import tensorhub

    from _engines import Coordinator

    tmp = tmp_path_factory.mktemp("stamps")
    coord = Coordinator(tmp / "state")
    f = {"url": coord.url, "tmp": tmp, "engines": []}
    try:
        f["trainer"] = tensorhub.connect(coord.url, worker_id="trainer")
        f["w"] = {0: make_weights(0), 1: make_weights(1)}
        assert f["trainer"].publish(MODEL, f["w"][0]) == 1
        bare = make_model_dir(tmp / "bare", weights=False)
        s = ServerEngine(tmp / "s.log", bare, [
            "--load-format", "tensorhub",
            "--model-loader-extra-config", json.dumps({"model": MODEL, "worker_id": "engine-s"}),
            "--weight-transfer-config", json.dumps({"backend": "tensorhub"}),
            "--block-size", "32", "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--max-model-len", "256"],
            env={"TENSORHUB_COORDINATOR": coord.url})
        f["engines"].append(s)
        f["s"] = s
        r = ProbeEngine(tmp / "r.log", model=str(make_model_dir(tmp / "v2", seed=1)),
                        weight_transfer_config={"backend": "tensorhub"}, **ENGINE)
        f["engines"].append(r)
        f["r"] = r
        yield f
    finally:
        close_fixture(f, coord)


def test_completions_carry_the_version_loaded_at_start(fleet):
    """Before any swap, vLLM's label is the TensorHub version the loader loaded (v1, not
    vLLM's "default"), and every completion says so: header, fingerprint, per-choice spans
    (also for several prompts and n > 1), and the terminal chunk of a stream."""
    s = fleet["s"]
    assert httpx.get(f"{s.url}/weight_info").json()["weight_version"] == "1"
    r = _complete(s, SHORT)
    assert r.headers["x-tensorhub-weight-version"] == "1"
    assert r.headers["x-tensorhub-weight-versions"] == "1"
    body = r.json()
    assert body["system_fingerprint"] == "tensorhub-v1"
    assert body["choices"][0]["weight_versions"] == _spans((1, 0, 8))
    assert int(r.headers["content-length"]) == len(r.content)

    r = _complete(s, [SHORT, "w9 w8"], max_tokens=5, n=2, temperature=1.0, seed=3)
    assert [c.get("weight_versions") for c in r.json()["choices"]] == [_spans((1, 0, 5))] * 4

    with httpx.stream("POST", f"{s.url}/v1/completions", timeout=120,
                      json={"model": s.model_dir, "prompt": SHORT, "max_tokens": 6, "temperature": 0,
                            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}) as st:
        chunks = [json.loads(line[6:]) for line in st.iter_lines() if line.startswith("data: {")]
    last = [c for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
    assert len(last) == 1 and last[0]["choices"][0]["weight_versions"] == _spans((1, 0, 6))
    assert last[0]["system_fingerprint"] == "tensorhub-v1"
    assert chunks[-1]["usage"] and chunks[-1]["system_fingerprint"] == "tensorhub-v1"
    # other routes pass untouched
    assert "x-tensorhub-weight-version" not in httpx.get(f"{s.url}/v1/models").headers


def test_prefix_cache_is_not_reused_across_a_swap(fleet):
    """S swaps v1 -> v2 without a pause (vLLM resets caches only at /pause): the long
    prompt's three cached blocks are not reused, and the output equals R's (a fresh engine on
    v2's files). Then v2 -> v3 (v1's bytes again) with /pause?clear_cache=false: again no
    reuse, and the output equals v1's."""
    s, r, trainer = fleet["s"], fleet["r"], fleet["trainer"]
    first, again = _complete(s, LONG), _complete(s, LONG)
    assert _cached(again) >= 96, again.json()["usage"]  # the cache works: 3 blocks of 32 reused
    assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    v1_text = first.json()["choices"][0]["text"]

    v2 = trainer.publish(MODEL, fleet["w"][1])
    assert v2 == 2
    _swap(s, v2, pause=None)
    after = _complete(s, LONG)
    assert _cached(after) == 0, after.json()["usage"]
    ref = r.call("generate", prompts=[LONG])[0]
    assert after.json()["choices"][0]["text"] == ref["text"] != v1_text
    assert after.headers["x-tensorhub-weight-version"] == "2"
    assert after.json()["choices"][0]["weight_versions"] == _spans((2, 0, 8))
    again = _complete(s, LONG)
    assert _cached(again) >= 96 and again.json()["choices"][0]["text"] == ref["text"]

    v3 = trainer.publish(MODEL, fleet["w"][0])
    assert v3 == 3
    _swap(s, v3, pause="mode=abort&clear_cache=false")
    after = _complete(s, LONG)
    assert _cached(after) == 0, after.json()["usage"]
    assert after.json()["choices"][0]["text"] == v1_text
    assert after.json()["system_fingerprint"] == "tensorhub-v3"
    assert "weights swapped to v3: prefix/KV cache reset" in s.log_tail(2_000_000)
    fleet["v1_text"] = v1_text


def test_offline_swap_resets_the_cache_and_labels_tokens(fleet):
    """R (offline ``LLM``: no pause exists) swaps from its disk weights to v3 (v1's bytes):
    no block of the long prompt is reused, the output is v1's, and vLLM's own
    ``weight_versions`` say v3 even before ``finish_weight_update`` names a version."""
    r = fleet["r"]
    out = r.call("generate", prompts=[LONG])[0]
    assert out["weight_versions"] == [["default", 0, 8]]  # vLLM's loader: no TensorHub version
    assert r.call("generate", prompts=[LONG])[0]["cached"] >= 96
    r.call("init_weight_transfer_engine", init_info={"coordinator": fleet["url"], "model": MODEL})
    r.call("start_weight_update")
    r.call("update_weights", update_info={"version": 3})
    mid = r.call("generate", prompts=[LONG])[0]  # between update and finish: the new weights, labelled
    assert mid["cached"] == 0 and mid["text"] == fleet["v1_text"] and mid["weight_versions"] == [["3", 0, 8]]
    r.call("finish_weight_update")  # no version given: the label stays the TensorHub one
    assert r.call("weight_version") == "3"


def test_failed_swap_keeps_label_and_cache(fleet):
    """A swap to a version that does not exist fails with one clear error; the weights did not
    change, so neither do the label, the stamps or the prefix cache."""
    s = fleet["s"]
    assert _cached(_complete(s, LONG)) >= 96  # the previous test left it cached on v3
    assert s.post("/start_weight_update").status_code == 200
    bad = s.post("/update_weights", {"update_info": {"version": 99}})
    assert bad.status_code >= 400
    assert "tensorhub: could not fetch 'policy' v99" in bad.text and "the engine keeps serving v3" in bad.text
    after = _complete(s, LONG)
    assert _cached(after) >= 96 and after.json()["choices"][0]["text"] == fleet["v1_text"]
    assert after.headers["x-tensorhub-weight-version"] == "3"
    assert httpx.get(f"{s.url}/weight_info").json()["weight_version"] == "3"


def test_request_kept_across_a_swap_names_both_versions(fleet):
    """A streamed request in flight when S pauses with mode=keep and swaps v3 -> v4 (v2's
    bytes): its tokens before the pause are v3's, after it v4's, and its spans say so; the
    stamp is the oldest (v3). The tokens after the swap are exactly what v4 generates from
    the prompt plus the tokens so far (its KV was recomputed with v4's weights)."""
    s, trainer = fleet["s"], fleet["trainer"]
    v4 = trainer.publish(MODEL, fleet["w"][1])
    assert v4 == 4
    total = 240
    ids: list[int] = []
    with httpx.stream("POST", f"{s.url}/v1/completions", timeout=300,
                      json={"model": s.model_dir, "prompt": SHORT, "max_tokens": total, "temperature": 0,
                            "ignore_eos": True, "stream": True, "return_token_ids": True}) as st:
        lines = st.iter_lines()
        for line in lines:  # the first generated token: the request is in flight
            if line.startswith("data: {"):
                first = json.loads(line[6:])["choices"][0]
                prompt_ids = first["prompt_token_ids"]
                ids += first["token_ids"]
                break
        _swap(s, v4, pause="mode=keep")
        chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    for c in chunks:
        ids += [t for ch in c["choices"] for t in ch.get("token_ids") or ()]
    last = chunks[-1]
    spans = last["choices"][0]["weight_versions"]
    assert [sp["version"] for sp in spans] == ["3", "4"], spans
    k = spans[0]["end"]
    assert 0 < k < total and spans == _spans((3, 0, k), (4, k, total))
    assert last["system_fingerprint"] == "tensorhub-v3"
    assert len(ids) == total
    rest = _complete(s, prompt_ids + ids[:k], max_tokens=total - k, return_token_ids=True)
    assert rest.json()["choices"][0]["token_ids"] == ids[k:]
    assert rest.headers["x-tensorhub-weight-version"] == "4"
