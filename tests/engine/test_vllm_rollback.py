"""A failed swap rolls back (issue 33 item 3), on one real vLLM CPU engine (the OpenAI server)
with two tensor-parallel ranks: rank 0 keeps (and serves) its copy of the running version and
restores from it; rank 1 keeps none (``serve_ranks="first"``) and reads the previous version
again from peers. Both paths run in every case below.

The engine (B) loads v2 from the trainer (this process) at start: the reference tokens of
v2. It then swaps to v1 (the reference tokens of v1) and every case below tries to swap it
from v1 to v2 and fails at another point:

* inside the apply, through the adapter's test hook ``TENSORHUB_TEST_FAIL_APPLY`` (read from
  a file at each swap, so one engine serves every case): before the first tensor, after 3
  tensors (the embedding already holds v2, a layer half loaded), after 10 (a whole decoder
  layer holds v2), at the last tensor, after every tensor before vLLM's finalize;
* a fetch error: the only holder of the version is SIGKILLed before the swap;
* a bad checksum: the only holder's bytes changed after it published them.

After each: ``/update_weights`` answers an error naming the rollback to v1 (a rank that failed
in the apply says how it restored v1: its kept copy, or v1 read again), greedy tokens are
v1's, ``/weight_info`` and the completion's ``X-TensorHub-Weight-Version`` say 1, and the
engine's served copy of v1 is still v1's bytes. Then a plain swap to v2 gives v2's tokens.
Last, a failure whose rollback fails too: the engine refuses to serve (``/health`` fails).
"""

from __future__ import annotations

import hashlib
import json
import time

import httpx
import pytest

from _engines import Coordinator, Publisher, ServerEngine, require_vllm
from _tiny import PROMPTS, make_model_dir, make_weights

pytestmark = pytest.mark.engine

MODEL = "policy"
HOOK = "TENSORHUB_TEST_FAIL_APPLY"


def _digest(tensors: dict) -> dict:
    import torch

    return {k: hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, v in tensors.items()}


def _completion(b: ServerEngine) -> tuple[list, str]:
    """Greedy token ids per prompt and the X-TensorHub-Weight-Version header."""
    r = b.post("/v1/completions", {"model": b.model_dir, "prompt": PROMPTS, "max_tokens": 8, "temperature": 0,
                                   "ignore_eos": True, "logprobs": 0})
    r.raise_for_status()
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    return [c["logprobs"]["tokens"] for c in choices], r.headers.get("x-tensorhub-weight-version", "")


def _weight_version(b: ServerEngine) -> str:
    return httpx.get(f"{b.url}/weight_info", timeout=30).json()["weight_version"]


def _swap(b: ServerEngine, version: int) -> httpx.Response:
    """vLLM's RL API as a trainer drives it: pause, start, update, (finish,) resume."""
    assert b.post("/pause").status_code == 200
    assert b.post("/start_weight_update").status_code == 200
    r = b.post("/update_weights", {"update_info": {"version": version}})
    if r.status_code == 200:
        assert b.post("/finish_weight_update", {"weight_version": str(version)}).status_code == 200
    assert b.post("/resume").status_code == 200
    return r


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    require_vllm()
    import tensorhub

    tmp = tmp_path_factory.mktemp("rollback")
    coord = Coordinator(tmp / "state")
    hook = tmp / "fail_apply"
    r: dict = {"coord": coord, "url": coord.url, "tmp": tmp, "hook": hook}
    b = trainer = None
    try:
        trainer = tensorhub.connect(coord.url, worker_id="trainer")
        r["trainer"] = trainer
        r["w1"], r["w2"] = make_weights(0), make_weights(1)
        r["v1"] = trainer.publish(MODEL, r["w1"])
        r["v2"] = trainer.publish(MODEL, r["w2"])
        b = ServerEngine(tmp / "b.log", make_model_dir(tmp / "bare", weights=False), [
            "--load-format", "tensorhub",
            "--model-loader-extra-config", json.dumps({
                "coordinator": coord.url, "model": MODEL, "version": r["v2"], "worker_id": "engine-b",
                "fetch_timeout": 6, "prefetch": False}),
            "--weight-transfer-config", json.dumps({"backend": "tensorhub"}),
            "--tensor-parallel-size", "2"],
            env={HOOK: f"@{hook}", "TENSORHUB_SAMEHOST": "0", "VLLM_CPU_OMP_THREADS_BIND": "0|1"})
        r["b"] = b
        r["ref2"] = _completion(b)[0]  # v2 loaded at start
        assert _swap(b, r["v1"]).status_code == 200
        r["ref1"], header = _completion(b)
        assert header == str(r["v1"]) and _weight_version(b) == str(r["v1"])
        assert r["ref1"] != r["ref2"]  # the two versions give different tokens
        yield r
    finally:
        if b is not None:
            b.close()
        if trainer is not None:
            trainer.close()
        coord.stop()


def _assert_rolled_back(rig, resp: httpx.Response, *phrases: str) -> None:
    """The swap's answer names the failure and the rollback; the engine serves v1 exactly."""
    b, v1 = rig["b"], rig["v1"]
    assert resp.status_code >= 400, resp.text
    text = resp.text + b.log_tail(20_000)
    assert f"rolled back to v{v1}" in resp.text, text[-3000:]  # the caller's answer says it, not only the log
    assert f"the engine keeps serving v{v1}" in text, text[-3000:]
    for p in phrases:
        assert p in text, (p, text[-3000:])
    tokens, header = _completion(b)
    assert tokens == rig["ref1"]
    assert header == str(v1) and _weight_version(b) == str(v1)
    # the copy of v1 the engine serves to peers is v1's bytes
    got = rig["trainer"].fetch(MODEL, v1, serve=False, timeout=30)
    assert _digest(got) == _digest(rig["w1"])


@pytest.mark.parametrize("point", ["before", "after:3", "after:10", "last", "finalize"])
def test_apply_fails_and_rolls_back(rig, point):
    """An engine error at ``point`` of the apply: every parameter goes back to v1."""
    rig["hook"].write_text(point)
    try:
        resp = _swap(rig["b"], rig["v2"])
    finally:
        rig["hook"].unlink()
    v1 = rig["v1"]
    _assert_rolled_back(rig, resp, "test failure injected", f"applying 'policy' v{rig['v2']} failed",
                        f"rolled back to policy v{v1} from this worker's kept copy of v{v1}",  # rank 0
                        f"rolled back to policy v{v1} v{v1} read again from peers")  # rank 1: no copy kept


def test_fetch_error_keeps_v1(rig):
    """The only holder of v3 is killed before the swap: the fetch fails, nothing changed."""
    src = Publisher(rig["url"], seed=5, worker_id="gone")
    src.kill()
    resp = _swap(rig["b"], src.version)
    _assert_rolled_back(rig, resp, f"could not fetch 'policy' v{src.version}")


def test_bad_checksum_keeps_v1(rig):
    """The only holder's bytes changed after publish: the fetch fails its checksums."""
    trainer = rig["trainer"]
    w = make_weights(7)
    v = trainer.publish(MODEL, w)
    name = next(iter(w))
    w[name].view(-1)[:16] += 1.0  # behind the manifest's checksums (the replica stays: retention)
    resp = _swap(rig["b"], v)
    _assert_rolled_back(rig, resp, f"could not fetch 'policy' v{v}", "checksum mismatch")


def test_swap_after_rollbacks_then_broken(rig):
    """After the failures a plain swap to v2 gives v2's tokens; then a failure whose rollback
    fails too makes the engine refuse to serve (never a mix of layers)."""
    b = rig["b"]
    assert _swap(b, rig["v2"]).status_code == 200
    tokens, header = _completion(b)
    assert tokens == rig["ref2"] and header == str(rig["v2"]) and _weight_version(b) == str(rig["v2"])

    rig["hook"].write_text("after:3+restore")
    try:
        assert b.post("/start_weight_update").status_code == 200
        resp = b.post("/update_weights", {"update_info": {"version": rig["v1"]}})
    finally:
        rig["hook"].unlink()
    assert resp.status_code >= 400
    log = b.log_tail(40_000)
    assert "refuses to serve a mix of layers" in resp.text + log, log[-3000:]
    deadline = time.monotonic() + 60
    healthy = True
    while healthy and time.monotonic() < deadline:
        try:
            healthy = httpx.get(f"{b.url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            healthy = False
        time.sleep(0.5)
    assert not healthy, "the engine still reports healthy with a mix of layers"
    try:
        r = b.post("/v1/completions", {"model": b.model_dir, "prompt": PROMPTS[:1], "max_tokens": 4,
                                       "temperature": 0})
        assert r.status_code >= 400, r.text
    except httpx.HTTPError:
        pass  # the server went away: no answer from mixed weights either
