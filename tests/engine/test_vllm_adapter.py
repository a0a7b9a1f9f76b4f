"""The vLLM adapter with real vLLM CPU engines (a tiny Llama made locally, float32).

One fleet per module, because each engine start costs ~20-40 s on two cores:

* engine A: offline ``vllm.LLM``, ``--load-format tensorhub`` with ``on_missing="disk"``:
  no version yet, so it loads its weight files and publishes them as v1;
* engine B: the OpenAI server (dev mode) with ``--load-format tensorhub`` and a model
  directory without weight files: it loads v1 from A;
* a trainer (this process) publishes v2; A swaps offline, B through the HTTP endpoints;
  a fresh engine C loads v2's safetensors from disk with vLLM's default loader: the
  reference for the outputs.

Every engine here pins ``"prefetch": false`` (:data:`SWAP_FETCHES`): this module tests the
swap's own fetch (a source killed before and in the middle of it, a failed fetch, a
timeout) and who holds which version afterwards. With the default prefetch each engine
fetches every version the moment it is complete, before the test can stop or kill the
source, and becomes one more holder of it; the swap then transfers nothing. The fetch code
is the same either way (``tensorhub.integrations._core.worker.fetch``); the prefetch path, and
``prefetch`` being the default, are tested with real engines in ``test_vllm_prefetch.py``.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest

from _engines import (Coordinator, OfflineEngine, Publisher, ServerEngine, close_fixture, reference_outputs,
                      require_vllm)
from _tiny import PROMPTS, make_model_dir, make_weights

pytestmark = pytest.mark.engine

MODEL = "policy"
#: The swaps of this module fetch inside the swap (see the module docstring).
SWAP_FETCHES = {"prefetch": False}


def _digest(tensors: dict) -> dict:
    import torch

    return {k: hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, v in tensors.items()}


def _status(url: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "tensorhub", "status", "--coordinator", url, "--json"],
                         capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def _eventually(cond, timeout: float = 15.0) -> bool:
    """Poll ``cond`` (swaps drop the old version on a background thread)."""
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


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
                                                     "on_missing": "disk", "worker_id": "engine-a",
                                                     **SWAP_FETCHES},
                          weight_transfer_config={"backend": "tensorhub"})
        f["engines"].append(a)
        f["a"] = a
        # With PROMETHEUS_MULTIPROC_DIR, vLLM's /metrics (API server) also shows the metrics
        # of its engine process, where the tensorhub Hub fetches: tensorhub_hub_*.
        (tmp / "prom").mkdir()
        b = ServerEngine(tmp / "b.log", f["dir_bare"], [
            "--load-format", "tensorhub",
            "--model-loader-extra-config", json.dumps({"model": MODEL, "worker_id": "engine-b",
                                                         "bucket_bytes": 300_000, "fetch_timeout": 8,
                                                         **SWAP_FETCHES}),
            "--weight-transfer-config", json.dumps({"backend": "tensorhub"})],
            env={"TENSORHUB_COORDINATOR": coord.url,  # the env default for "coordinator"
                 "PROMETHEUS_MULTIPROC_DIR": str(tmp / "prom")})
        f["engines"].append(b)
        f["b"] = b
        f["trainer"] = tensorhub.connect(coord.url, worker_id="trainer")
        yield f
    finally:
        close_fixture(f, coord)


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
    log = b.log_tail(400_000)
    assert "tensorhub: fetched policy v1 (hf)" in log
    buckets = next(l for l in log.splitlines() if "load_weights in" in l)
    assert int(buckets.split("load_weights in ")[1].split()[0]) > 3, buckets  # bucket_bytes=300 kB
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
    assert _eventually(lambda: "engine-a" not in _replicas(fleet["url"], 1))
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
    _check_swap_metrics(fleet, b, nbytes=got.nbytes)

    # The trainer may now reuse its memory: the engines hold v2.
    trainer.unpublish(MODEL, v2, timeout=30)
    for t in w2.values():
        t.zero_()
    assert set(_replicas(fleet["url"], 2)) == {"engine-a", "engine-b"}
    assert _eventually(lambda: _replicas(fleet["url"], 1) == {})

    ref = reference_outputs(fleet["dir_v2"], PROMPTS)  # a fresh engine's answer on v2's files
    fleet["v2_ref"] = ref
    out_a = a.call("generate", prompts=PROMPTS)
    assert out_a["ids"] == ref["ids"]
    assert b.generate(PROMPTS) == ref["text"]
    assert ref["text"] != fleet.get("v1_text")
    # and the bytes the engines serve are v2's
    got = trainer.fetch(MODEL, 2, serve=False)
    assert _digest(got) == _digest(make_weights(1))


def _metric(text: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _check_swap_metrics(fleet, b, nbytes: int) -> None:
    """B's own /metrics (vLLM's, fed from its engine process) counts its two fetches (v1 at
    start, v2 in the swap) and one swap stall; the coordinator's counts A's and B's swaps."""
    import httpx

    text = httpx.get(f"{b.url}/metrics", timeout=30).text
    assert _metric(text, "tensorhub_hub_fetch_bytes_total", model=MODEL) == 2 * nbytes, text[-3000:]
    assert _metric(text, "tensorhub_hub_fetches_total", model=MODEL, outcome="ok") == 2
    assert _metric(text, "tensorhub_hub_swap_stall_seconds_count", model=MODEL) == 1
    assert _metric(text, "tensorhub_hub_held_bytes", model=MODEL) >= nbytes
    assert "vllm:" in text  # vLLM's own metrics are still there
    coord = lambda: httpx.get(f"{fleet['url']}/metrics", timeout=30).text  # noqa: E731
    assert _eventually(lambda: _metric(coord(), "tensorhub_swap_stall_seconds_count", model=MODEL) == 2)
    assert _metric(coord(), "tensorhub_swaps_total", model=MODEL, outcome="ok") == 2


def test_failed_fetch_keeps_old_weights(fleet):
    """A swap to a missing version, and one whose only source died, fail with a clear
    error; B keeps serving v2."""
    b = fleet["b"]
    import httpx

    before = b.generate(PROMPTS)
    assert b.post("/pause").status_code == 200
    assert b.post("/start_weight_update").status_code == 200
    r = b.post("/update_weights", {"update_info": {"version": 99}})
    assert r.status_code >= 400
    assert "keeps serving v2" in b.log_tail(400_000)
    assert "no complete version 99" in b.log_tail(400_000)

    src = Publisher(fleet["url"], seed=5, worker_id="gone")
    src.kill()
    assert b.post("/start_weight_update").status_code == 200
    r = b.post("/update_weights", {"update_info": {"version": src.version}})  # fetch_timeout 8 s
    assert r.status_code >= 400
    log = b.log_tail(400_000)
    assert f"tensorhub: could not fetch 'policy' v{src.version}: " in log and "keeps serving v2" in log
    assert b.post("/resume").status_code == 200
    assert b.generate(PROMPTS) == before
    assert httpx.get(f"{b.url}/weight_info").json()["weight_version"] == "2"


def test_tp2_engine_loads_from_peers(fleet):
    """A TP=2 engine with no weight files loads v2 from A/B: the TP=1 engines' outputs."""
    ref = fleet.get("v2_ref")
    if ref is None:
        pytest.fail("needs test_hot_swap_offline_and_http to have run first")
    # TENSORHUB_SAMEHOST=0: A's and B's copies are Hub memory on this host, which the ranks would
    # read in place (test_vllm_samehost_start.py); this test is about the copying paths: rank 0
    # fetches and serves its copy, rank 1 streams through one bucket-sized buffer.
    tp = OfflineEngine(fleet["tmp"] / "tp2.log", env={"VLLM_CPU_OMP_THREADS_BIND": "0|1", "TENSORHUB_SAMEHOST": "0"},
                       model=str(fleet["dir_bare"]), tensor_parallel_size=2, load_format="tensorhub",
                       model_loader_extra_config={"coordinator": fleet["url"], "model": MODEL,
                                                  "version": 2, "worker_id": "engine-tp", **SWAP_FETCHES},
                       weight_transfer_config={"backend": "tensorhub"})
    try:
        assert tp.call("generate", prompts=PROMPTS)["ids"] == ref["ids"]
        reps = _replicas(fleet["url"], 2)
        assert reps.get("engine-tp-tp0") == "hf" and "engine-tp-tp1" not in reps, reps  # serve_ranks="first"
        # rank 1 keeps no copy: it streamed v2 through one bucket-sized buffer
        assert "tensorhub: streamed policy v2 (hf)" in tp.log_tail(400_000), tp.log_tail(3000)
        # both ranks swap to the same "latest" (rank 0 resolves it)
        trainer = fleet["trainer"]
        w = make_weights(2)
        v = trainer.publish(MODEL, w)
        tp.call("start_weight_update")
        tp.call("update_weights", update_info={"version": "latest"})
        tp.call("finish_weight_update", weight_version=str(v))
        out = tp.call("generate", prompts=PROMPTS)
        assert out["text"] != ref["text"]
        fleet["seed2_text"] = out["text"]  # B loads the same bytes (as another version) below
        trainer.unpublish(MODEL, v, timeout=30)
        assert set(_replicas(fleet["url"], v)) == {"engine-tp-tp0"}
    finally:
        tp.close()


def test_source_killed_during_swap(fleet):
    """The replica a swap reads from first is SIGKILLed: the engine reads from another one
    and still loads the right bytes."""
    b, trainer = fleet["b"], fleet["trainer"]
    src = Publisher(fleet["url"], seed=2, worker_id="doomed")
    try:
        v3 = src.version
        trainer.fetch(MODEL, v3)  # a second replica, registered after the doomed one
        src.kill()  # the coordinator still lists it (worker TTL): the first lease points at it
        assert "doomed" in _replicas(fleet["url"], v3)
        r = b.post("/start_weight_update")
        assert r.status_code == 200
        r = b.post("/update_weights", {"update_info": {"version": v3}})
        assert r.status_code == 200, r.text
        assert b.post("/finish_weight_update", {"weight_version": str(v3)}).status_code == 200
    finally:
        src.kill()
    log = b.log_tail(400_000)
    line = next(l for l in log.splitlines() if f"tensorhub: fetched policy v{v3} (hf)" in l)
    assert "failed sources [" in line, line  # the dead replica was tried, reported, and replaced
    # only B and the trainer hold v3 now; read it from B alone and check every byte
    trainer.unpublish(MODEL, v3, timeout=30)
    got = trainer.fetch(MODEL, v3, serve=False)
    assert set(got.sources) == {"engine-b"}
    assert _digest(got) == _digest(make_weights(2))
    assert b.generate(PROMPTS) == fleet["seed2_text"]  # same bytes as the TP=2 engine ran


def test_source_killed_mid_transfer(fleet):
    """The source is stopped, the swap starts reading from it (a lease names it), then the
    source is SIGKILLed mid-transfer: the engine re-reads from the other replica and loads
    the right bytes."""
    import os
    import signal
    import threading
    import time

    b, trainer = fleet["b"], fleet["trainer"]
    src = Publisher(fleet["url"], seed=4, worker_id="doomed-mid")
    result: dict = {}
    try:
        v = src.version
        trainer.fetch(MODEL, v)  # a second replica
        doomed = next(r["replica_id"] for m in _status(fleet["url"])["models"] if m["model"] == MODEL
                      for ver in m["versions"] if ver["version"] == v for r in ver["replicas"]
                      if r["worker_id"] == "doomed-mid")
        os.kill(src.proc.pid, signal.SIGSTOP)  # reads from it cannot finish now
        assert b.post("/start_weight_update").status_code == 200

        def swap() -> None:
            result["update"] = b.post("/update_weights", {"update_info": {"version": v}})

        t = threading.Thread(target=swap)
        t.start()
        deadline = time.monotonic() + 60
        while not any(l["worker_id"] == "engine-b" and doomed in l["replicas"]
                      for l in _status(fleet["url"])["leases"]):
            assert t.is_alive(), f"the swap ended before reading from the source: {result}"
            assert time.monotonic() < deadline, "engine-b never leased the doomed replica"
            time.sleep(0.05)
        time.sleep(0.3)  # its reads are in flight
        assert t.is_alive()
        src.kill()  # SIGKILL works on a stopped process
        t.join(120)
        assert result["update"].status_code == 200, result["update"].text
        assert b.post("/finish_weight_update", {"weight_version": str(v)}).status_code == 200
    finally:
        src.kill()
    log = b.log_tail(400_000)
    line = next(l for l in log.splitlines() if f"tensorhub: fetched policy v{v} (hf)" in l)
    assert "failed sources [" in line and doomed in line, line
    trainer.unpublish(MODEL, v, timeout=30)
    got = trainer.fetch(MODEL, v, serve=False)  # B's copy, every byte
    assert set(got.sources) == {"engine-b"}
    assert _digest(got) == _digest(make_weights(4))


def test_follow_drives_the_server(fleet):
    """Follow mode swaps B to each new version through its endpoints and prints the swap."""
    b, trainer = fleet["b"], fleet["trainer"]
    import httpx

    from _engines import engine_env

    before = httpx.get(f"{b.url}/weight_info").json()["weight_version"]
    follow = subprocess.Popen([sys.executable, "-m", "tensorhub", "follow", "--engine", b.url, "--model", MODEL,
                               "--coordinator", fleet["url"], "--mode", "wait", "--max-swaps", "1"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=engine_env())
    try:
        first = follow.stdout.readline()
        assert f"engine at v{before}" in first, first + follow.stderr.read()
        w4 = make_weights(3)
        v4 = trainer.publish(MODEL, w4)
        out, err = follow.communicate(timeout=120)
    finally:
        if follow.poll() is None:
            follow.kill()
    assert follow.returncode == 0, err
    assert f"v{v4}: stall " in out and "engine-b" not in out.split("holders", 1)[0], out
    assert httpx.get(f"{b.url}/weight_info").json()["weight_version"] == str(v4)
    trainer.unpublish(MODEL, v4, timeout=30)
    got = trainer.fetch(MODEL, v4, serve=False)
    assert set(got.sources) == {"engine-b"} and _digest(got) == _digest(make_weights(3))


def test_coordinator_restart_does_not_disturb_engines(fleet):
    """The coordinator dies and comes back (same port and state): the engines keep serving
    tokens, re-register their replicas, and peers can read from them again."""
    import time

    b, trainer, coord = fleet["b"], fleet["trainer"], fleet["coord"]
    before = b.generate(PROMPTS)
    import httpx

    v = int(httpx.get(f"{b.url}/weight_info").json()["weight_version"])
    coord.kill()
    assert b.generate(PROMPTS) == before  # serving needs no coordinator
    time.sleep(1.5)  # a few missed heartbeats
    coord.start()
    deadline = time.monotonic() + 30
    while "engine-b" not in _replicas(fleet["url"], v) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "engine-b" in _replicas(fleet["url"], v)
    assert b.proc.poll() is None and fleet["a"].proc.poll() is None
    got = trainer.fetch(MODEL, v, serve=False)
    assert set(got.sources) == {"engine-b"} and _digest(got) == _digest(make_weights(3))
    assert b.generate(PROMPTS) == before
