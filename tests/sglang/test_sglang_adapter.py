"""The SGLang adapter against SGLang 0.5.23's own modules on CPU, over real Mooncake.

Every SGLang side runs in a child process (``_sgl_worker.py``): SGLang's plug-in loader,
hook registry, ``ServerArgs``/``LoadConfig``/``get_model_loader``, a real
``LlamaForCausalLM`` built by SGLang's model loader, SGLang's ``WeightUpdater`` for the
hot-swap and SGLang's ``remote_instance`` transfer-engine client for the seed. Weights
are the tiny Llama of tests/engine; each check compares the SGLang model's parameter
bytes with an SGLang model loaded from the same weights on disk by SGLang's default
loader.

The engines share one coordinator and are used in order (start, swaps, peers, seed).
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from _sglang_procs import SGLangError, SGLangWorker, Trainer, reference_digest, replicas, require_sglang, run_py

pytestmark = [pytest.mark.engine, pytest.mark.multiprocess]


@pytest.fixture(scope="module", autouse=True)
def _need_sglang():
    require_sglang()


# ---------------------------------------------------------------- plug-in, no model
_PLUGIN = r"""
import argparse, json, _torchvision_shim
_torchvision_shim.install()
from sglang.srt.plugins import load_plugins
from sglang.srt.arg_groups.choices import LOAD_FORMAT_CHOICES
from sglang.srt.configs.load_config import LoadConfig
from sglang.srt.server_args import ServerArgs
out = {"choice_before": "tensorhub" in LOAD_FORMAT_CHOICES}
load_plugins()
out["choice_after"] = "tensorhub" in LOAD_FORMAT_CHOICES
p = argparse.ArgumentParser()
ServerArgs.add_cli_args(p)
extra = json.dumps({"coordinator": "http://127.0.0.1:9", "model": "policy", "version": 3, "on_missing": "wait"})
try:
    ns = p.parse_args(["--model-path", "/m", "--load-format", "tensorhub", "--model-loader-extra-config", extra])
    out["cli"] = [ns.load_format, ns.model_loader_extra_config]
except SystemExit as e:
    out["cli"] = f"exit {e.code}"
try:
    lc = LoadConfig(load_format="tensorhub", model_loader_extra_config=extra)
    out["load_config"] = lc.load_format
    from sglang.srt.model_loader import get_model_loader
    loader = get_model_loader(lc)
    out["loader"] = type(loader).__name__
    s = loader.settings
    out["settings"] = [s.coordinator, s.model, s.version, s.on_missing, s.native]
    out["auto"] = type(get_model_loader(LoadConfig(load_format="auto"))).__name__
    try:
        get_model_loader(LoadConfig(load_format="tensorhub", model_loader_extra_config={"model": "p", "verison": 2}))
    except Exception as e:
        out["bad_setting"] = f"{type(e).__name__}: {e}"
except Exception as e:
    out["load_config"] = f"{type(e).__name__}: {e}"
print("@@" + json.dumps(out))
"""


def _plugin_run(plugins: str) -> dict:
    r = run_py(_PLUGIN, extra_env={"SGLANG_PLUGINS": plugins})
    lines = [x for x in r.stdout.splitlines() if x.startswith("@@")]
    assert lines, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads(lines[-1][2:])


def test_plugin_entry_point_adds_the_load_format_to_cli_loadconfig_and_get_model_loader():
    out = _plugin_run("tensorhub")
    assert out["choice_before"] is False and out["choice_after"] is True
    assert out["cli"][0] == "tensorhub"
    assert out["load_config"] == "tensorhub"
    assert out["loader"] == "TensorHubModelLoader"
    assert out["settings"] == ["http://127.0.0.1:9", "policy", 3, "wait", True]
    assert out["auto"] == "DefaultModelLoader"  # every other format still goes to SGLang
    assert "unknown setting 'verison'" in out["bad_setting"]


def test_without_the_plugin_sglang_refuses_the_format():
    out = _plugin_run("someone-else")  # SGLANG_PLUGINS filters ours out
    assert out["choice_after"] is False
    assert out["cli"] == "exit 2"
    assert "ValueError" in out["load_config"] and "tensorhub" in out["load_config"]


# ---------------------------------------------------------------- engines
@pytest.fixture(scope="module")
def hub_env(tmp_path_factory):
    from tensorhub.testing import CoordinatorProcess

    from _tiny import make_model_dir

    tmp = tmp_path_factory.mktemp("sglang")
    coord = CoordinatorProcess(tmp / "state")
    url = coord.start()
    env = {"tmp": tmp, "url": url, "cfg": make_model_dir(tmp / "cfg", seed=0, weights=False),
           "trainers": [], "workers": [], "refs": {}}
    yield env
    for w in env["workers"]:
        w.close()
    for t in env["trainers"]:
        t.kill()
    coord.stop()


def _worker(env, name: str, model_dir, load_format: str, extra=None) -> SGLangWorker:
    w = SGLangWorker(env["tmp"] / f"{name}.log", model_dir, load_format, extra)
    env["workers"].append(w)
    return w


def _ref(env, seed: int) -> dict:
    """Parameter digests of SGLang's own default loader on the seed's safetensors."""
    if seed not in env["refs"]:
        from _tiny import make_model_dir

        env["refs"][seed] = reference_digest(make_model_dir(env["tmp"] / f"disk{seed}", seed=seed))
    return env["refs"][seed]


def _publish(env, seed: int) -> int:
    t = Trainer(env["url"], seed, f"trainer-{seed}")
    env["trainers"].append(t)
    return t.version


def _extra(env, **kw) -> dict:
    return {"coordinator": env["url"], "model": "policy", "drain_timeout": 3, **kw}


def _payload(v) -> str:
    from tensorhub.integrations.sglang.pull import payload

    return payload(v)


@pytest.fixture(scope="module")
def engine_a(hub_env):
    v1 = _publish(hub_env, 1)
    a = _worker(hub_env, "a", hub_env["cfg"], "tensorhub", _extra(hub_env))
    return {"worker": a, "v1": v1}


def test_start_from_peers_loads_the_bytes_and_registers_native_and_hf(hub_env, engine_a):
    a, v1 = engine_a["worker"], engine_a["v1"]
    assert a.ready == {"loader": "TensorHubModelLoader", "model": "LlamaForCausalLM"}
    assert a.call("digest") == _ref(hub_env, 1)  # fused qkv/gate_up etc.: SGLang's load_weights did it
    held = a.call("held")
    layout = held["layout"]
    assert layout.startswith("sglang-") and held["version"] == v1 and held["copy"] is True
    assert sorted(map(tuple, held["held"])) == sorted([("policy", v1, "hf", 0), ("policy", v1, layout, 0)])
    reps = {(r["worker_id"].split("-")[0], r["layout"]) for r in replicas(hub_env["url"], v1)}
    assert ("sglang", layout) in reps and ("sglang", "hf") in reps and ("trainer", "hf") in reps


def test_hot_swap_through_sglang_weight_updater(hub_env, engine_a):
    a, v1 = engine_a["worker"], engine_a["v1"]
    v2 = _publish(hub_env, 2)
    r = a.call("update", payload=_payload(v2))
    assert r == {"success": True, "message": "Success"}
    assert a.call("digest") == _ref(hub_env, 2)
    held = a.call("held")
    assert held["version"] == v2
    assert {tuple(h)[1] for h in held["held"]} == {v2}  # v1 unpublished before the overwrite
    assert not [r for r in replicas(hub_env["url"], v1) if r["worker_id"].startswith("sglang")]


def test_failed_pull_answers_false_and_keeps_the_old_weights(hub_env, engine_a):
    a = engine_a["worker"]
    before, v = a.call("digest"), a.call("held")["version"]
    r = a.call("update", payload=_payload(99))
    assert r["success"] is False
    assert "no complete version 99" in r["message"] and f"keeps serving v{v}" in r["message"]
    assert a.call("digest") == before and a.call("held")["version"] == v


def test_peer_starts_from_the_native_layout_and_swaps_in_place(hub_env, engine_a):
    a = engine_a["worker"]
    va = a.call("held")["version"]
    b = _worker(hub_env, "b", hub_env["cfg"], "tensorhub", _extra(hub_env))
    hb = b.call("held")
    assert hb["version"] == va and hb["layout"] == a.call("held")["layout"]
    assert hb["copy"] is False  # read raw from A's parameters, no hf copy kept
    assert "fetched policy v%d (%s)" % (va, hb["layout"]) in b.log_tail(200000)
    assert b.call("digest") == a.call("digest")
    # A swaps to v3 from the trainer (hf); B then swaps from A's native bytes.
    v3 = _publish(hub_env, 3)
    assert a.call("update", payload=_payload(v3))["success"]
    assert b.call("update", payload=_payload(v3))["success"]
    assert b.call("held")["copy"] is False
    assert b.call("digest") == a.call("digest") == _ref(hub_env, 3)


def test_swap_waits_for_readers_of_the_old_version(hub_env, engine_a):
    from tensorhub.integrations.sglang.seed import SeedServer

    a = engine_a["worker"]
    held = a.call("held")
    va, layout = held["version"], held["layout"]
    before = a.call("digest")
    v4 = _publish(hub_env, 4)
    # A reader (an SGLang remote_instance client through the seed) holds leases on va's
    # native shard, on A and on any other holder: A must not overwrite those bytes.
    seed = SeedServer(hub_env["url"], "policy", version=va, layout=layout, lease_seconds=600)
    seed.start()
    try:
        for _ in range(4):
            seed.info(0)
        r = a.call("update", payload=_payload(v4))
        assert r["success"] is False and "still being read" in r["message"], r
        assert a.call("digest") == before
    finally:
        seed.stop()  # releases the leases
    assert a.call("update", payload=_payload(v4))["success"]
    assert a.call("digest") == _ref(hub_env, 4)


def test_seed_answers_sglang_remote_instance_client(hub_env, engine_a):
    from tensorhub.integrations.sglang.seed import SeedServer

    a = engine_a["worker"]
    held = a.call("held")
    with SeedServer(hub_env["url"], "policy") as seed:
        c = _worker(hub_env, "c", hub_env["cfg"], "dummy")  # an unmodified SGLang reader, random weights
        assert c.call("digest") != a.call("digest")
        session, weights = c.call("seed_info", seed_url=seed.url, rank=0)
        holders = {r["endpoint"] for r in replicas(hub_env["url"], held["version"]) if r["layout"] == held["layout"]}
        assert session in holders
        assert {k: v[1:] for k, v in weights.items()} == c.call("specs")  # numel, element size per parameter
        r = c.call("seed_read", seed_url=seed.url, rank=0)
        assert r["success"] is True
        assert r["digest"] == a.call("digest")  # bytes read raw by SGLang's client over Mooncake
        # A TP-2 reader's rank 1: SGLang's client gets no info, our answer says why.
        assert c.call("seed_info", seed_url=seed.url, rank=1) == [None, None]
        resp = httpx.get(f"{seed.url}/get_remote_instance_transfer_engine_info", params={"rank": 1})
        assert resp.status_code == 404 and "same TP size" in resp.json()["error"]["message"]
        resp = httpx.post(f"{seed.url}/send_weights_to_remote_instance", json={})
        assert resp.status_code == 400 and "transfer_engine" in resp.json()["message"]


def test_wrong_settings_stop_the_start_with_one_line(hub_env):
    with pytest.raises(SGLangError, match="setting 'model': unknown model 'nope'"):
        _worker(hub_env, "bad", hub_env["cfg"], "tensorhub", _extra(hub_env, model="nope", version=1))
    with pytest.raises(SGLangError, match="setting 'coordinator'.*did not answer"):
        _worker(hub_env, "bad2", hub_env["cfg"], "tensorhub",
                {"coordinator": "http://127.0.0.1:9", "model": "policy", "connect_timeout": 1})


def test_on_missing_disk_publishes_the_weight_files(hub_env):
    from _tiny import make_model_dir

    d = make_model_dir(hub_env["tmp"] / "disk-other", seed=5)
    w = _worker(hub_env, "disk", d, "tensorhub", {"coordinator": hub_env["url"], "model": "other",
                                                  "on_missing": "disk"})
    held = w.call("held")
    assert held["version"] == 1 and held["copy"] is True
    assert sorted(h[2] for h in held["held"]) == sorted(["hf", held["layout"]])
    assert w.call("digest") == _ref(hub_env, 5)


def test_tensorhub_follow_drives_sglang_endpoints(hub_env, engine_a, workers):
    """``tensorhub follow --engine sglang+http://...`` against SGLang's endpoint paths and
    request types, served by the worker in front of SGLang's WeightUpdater (SGLang's own
    HTTP server needs CUDA to start)."""
    import subprocess
    import sys

    from _sglang_procs import env

    a = engine_a["worker"]
    port = a.call("serve_http")
    start = a.call("held")["version"]
    follow = subprocess.Popen([sys.executable, "-m", "tensorhub", "follow", "--engine",
                               f"sglang+http://127.0.0.1:{port}", "--model", "policy", "--coordinator",
                               hub_env["url"], "--max-swaps", "1"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env())
    try:
        first = follow.stdout.readline()
        assert f"engine at v{start}" in first and "tp 1" in first, first + follow.stderr.read()
        # A version of another model shape: the swap fails, the engine keeps its weights.
        bad = workers(hub_env["url"], "wrong-trainer").call("publish", seed=1, nbytes=1 << 16)
        deadline = time.monotonic() + 120
        while "update_weights_from_tensor" not in a.call("http_calls") and time.monotonic() < deadline:
            time.sleep(0.5)
        assert a.call("held")["version"] == start
        v = _publish(hub_env, 6)
        out, err = follow.communicate(timeout=240)
    finally:
        if follow.poll() is None:
            follow.kill()
    assert follow.returncode == 0, err
    assert out.startswith(f"v{v}: stall ") and "holders trainer-6" in out, out + err
    assert f"v{bad}: swap failed, engine kept v{start}" in err and "has no tensor" in err, err
    one = ["pause_generation", "begin_weight_update", "update_weights_from_tensor", "end_weight_update",
           "continue_generation"]
    calls = a.call("http_calls")
    assert len(calls) % 5 == 0 and calls == one * (len(calls) // 5)  # failed tries closed and resumed too
    assert a.call("held")["version"] == v
    assert a.call("digest") == _ref(hub_env, 6)
