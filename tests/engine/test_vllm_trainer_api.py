"""vLLM's trainer-side API with the ``tensorhub`` backend, against a real vLLM CPU engine.

One engine for the module (a start costs ~30-45 s here): the OpenAI server (dev mode),
``--load-format tensorhub`` with ``on_missing="disk"``, so it loads the seed-0 weight
files from disk and publishes them as v1: its outputs then are those of a fresh engine
loaded with the seed-0 weights. A coordinator with a token; the engine gets the token from
its environment, the trainer from its init info.

The trainer (this process) speaks only vLLM's API: ``WeightTransferTrainerFactory.trainer_init``
with :class:`TensorHubTrainerInitInfo`, vLLM's ``HTTPVLLMWeightSyncClient``, a
``WeightSource`` that materializes a fresh copy of each tensor (as FSDP's gathers do), then
``send_weights()``. It publishes seed-1 weights (v2), seed-0 (v3: outputs equal the fresh
seed-0 engine's again), seed-1 (v4: the first snapshot buffer is reused after its
version drained). Then two gloo ranks of a sharded trainer (all-gather per tensor) send
seed 0: only rank 0 talks to the engine. Bad input: unknown options on either side, a
wrong token, a version that is not there, each a clear error, the engine serving on.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import weakref

import httpx
import pytest

from _engines import HERE, Coordinator, ServerEngine, engine_env, free_port, require_vllm
from _tiny import PROMPTS, make_model_dir, make_weights

pytestmark = pytest.mark.engine

MODEL = "policy"
TOKEN = "trainer-api-secret"


def _digest(tensors) -> dict:
    import torch

    return {k: hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, v in tensors.items()}


def _replicas(url: str, version: int) -> dict:
    """worker id -> layout of each replica of MODEL v``version`` (``tensorhub status --json``)."""
    out = subprocess.run([sys.executable, "-m", "tensorhub", "status", "--coordinator", url, "--json"],
                         capture_output=True, text=True, timeout=60, check=True,
                         env=engine_env({"TENSORHUB_TOKEN": TOKEN}))
    for m in json.loads(out.stdout)["models"]:
        if m["model"] == MODEL:
            for v in m["versions"]:
                if v["version"] == version:
                    return {r["worker_id"]: r["layout"] for r in v["replicas"]}
    return {}


def _source(weights: dict):
    """A WeightSource over ``weights`` that materializes each group as fresh copies (what a
    gather makes) and records, whenever it materializes one, how many tensors of earlier
    groups are still alive: the trainer engine must drop a group before the next."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class Gathering(WeightSource):
        def __init__(self) -> None:
            self.weights = weights
            self.alive_from_earlier_groups = 0
            self.group_count = 0

        def metadata(self):
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.weights.items()]

        def __iter__(self):
            for n, t in self.weights.items():
                yield n, t.clone()

        def iter_groups(self):  # one step per group, as vLLM allows; keeps no reference itself
            made: list = []
            groups = self.groups()
            self.group_count = len(groups)
            for names in groups:
                alive = sum(1 for ref in made if ref() is not None)
                self.alive_from_earlier_groups = max(self.alive_from_earlier_groups, alive)
                tensors = [self.weights[n].clone() for n in names]
                made += [weakref.ref(t) for t in tensors]
                yield names, tensors
                del tensors

    return Gathering()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    require_vllm()
    tmp = tmp_path_factory.mktemp("trainer_api")
    (tmp / "token").write_text(TOKEN)
    coord = Coordinator(tmp / "state", token_file=tmp / "token")
    s = {"url": coord.url, "tmp": tmp}
    engine = None
    try:
        model_dir = make_model_dir(tmp / "v1", seed=0)
        engine = ServerEngine(tmp / "engine.log", model_dir, [
            "--load-format", "tensorhub",
            "--model-loader-extra-config", json.dumps({"model": MODEL, "on_missing": "disk",
                                                         "worker_id": "engine-a"}),
            "--weight-transfer-config", json.dumps({"backend": "tensorhub"})],
            env={"TENSORHUB_COORDINATOR": coord.url, "TENSORHUB_TOKEN": TOKEN})
        s["engine"] = engine
        s["seed0_text"] = engine.generate(PROMPTS)  # a fresh engine on the seed-0 weights
        yield s
    finally:
        if engine is not None:
            engine.close()
        coord.stop()


def _weight_version(engine) -> str:
    return httpx.get(f"{engine.url}/weight_info", timeout=10).json()["weight_version"]


def test_trainer_engine_publishes_and_the_engine_swaps(setup):
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from tensorhub.integrations.vllm.trainer import TensorHubTrainerInitInfo, TensorHubTrainerWeightTransferEngine

    import tensorhub

    engine, url = setup["engine"], setup["url"]
    assert _replicas(url, 1) == {"engine-a": "hf"}  # the engine published its disk weights as v1
    weights = {k: v.clone() for k, v in make_weights(1).items()}  # the trainer's parameters
    source = _source(weights)
    trainer = WeightTransferTrainerFactory.trainer_init(
        TensorHubTrainerInitInfo(model=MODEL, coordinator=url, token=TOKEN, worker_id="trainer", rank=0),
        client=HTTPVLLMWeightSyncClient(engine.url), source=source)
    try:
        assert isinstance(trainer, TensorHubTrainerWeightTransferEngine) and trainer.is_sender

        trainer.send_weights()  # seed 1
        assert trainer.version == 2 and _weight_version(engine) == "2"
        seed1_text = engine.generate(PROMPTS)
        assert seed1_text != setup["seed0_text"]
        assert set(_replicas(url, 2)) == {"trainer", "engine-a"}
        # the engine serves exactly the trainer's bytes: read v2 from the engine alone
        with tensorhub.connect(url, token=TOKEN, worker_id="checker") as checker:
            got = checker.fetch(MODEL, 2, serve=False, timeout=60)
            assert _digest(got) == _digest(make_weights(1))
        # streamed: never two gathered groups alive at once, and there were several groups
        assert source.group_count >= 3 and source.alive_from_earlier_groups == 0

        for k, v in make_weights(0).items():  # "training" moves the weights
            weights[k].copy_(v)
        trainer.send_weights()  # seed 0 again: the fresh seed-0 engine's outputs
        assert trainer.version == 3 and _weight_version(engine) == "3"
        assert engine.generate(PROMPTS) == setup["seed0_text"]

        for k, v in make_weights(1).items():
            weights[k].copy_(v)
        trainer.send_weights()  # buffers=2: v2's buffer is reused, after v2 was unpublished
        assert trainer.version == 4 and _weight_version(engine) == "4"
        assert engine.generate(PROMPTS) == seed1_text
        assert "trainer" not in _replicas(url, 2)
        assert set(_replicas(url, 4)) == {"trainer", "engine-a"}
    finally:
        trainer.shutdown()
    assert set(_replicas(url, 4)) == {"engine-a"}  # the engine keeps serving what it runs
    assert engine.generate(PROMPTS) == seed1_text
    setup["seed1_text"] = seed1_text


def _run_ranks(setup, *extra: str) -> dict:
    """Two gloo trainer ranks (``_trainer_ranks.py``) sending seed 0; their reports by rank."""
    engine, url = setup["engine"], setup["url"]
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(HERE / "_trainer_ranks.py"), str(r), "2", port, url, engine.url,
                               "0", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(HERE),
                              env=engine_env({"TENSORHUB_TOKEN": TOKEN}))
             for r in range(2)]
    results = {}
    try:
        for p in procs:
            out, err = p.communicate(timeout=300)  # a rank stuck in a collective fails here
            assert p.returncode == 0, err[-4000:]
            line = next(l for l in out.splitlines() if l.startswith("@@"))
            res = json.loads(line[2:])
            results[res["rank"]] = res
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
    return results


def test_two_trainer_ranks_only_rank0_sends(setup):
    """A gloo group of two ranks, each holding half of every tensor; the source all-gathers
    per tensor. Both ranks run trainer_init/send_weights; only rank 0 connects and talks to
    the engine (rank 1's client raises if touched)."""
    engine, url = setup["engine"], setup["url"]
    results = _run_ranks(setup)
    assert results[0]["error"] is None and results[1]["error"] is None, results
    n = len(make_weights(0))
    assert results[0]["gathered"] == results[1]["gathered"] == n
    assert results[0]["connected"] and not results[1]["connected"]
    v = results[0]["version"]
    assert v == 5 and results[1]["version"] is None
    assert _weight_version(engine) == "5"
    assert engine.generate(PROMPTS) == setup["seed0_text"]
    assert set(_replicas(url, 5)) == {"engine-a"}  # rank 0 shut down; the engine holds v5

    # a source whose metadata() misdeclares a tensor: rank 0 refuses it naming the tensor,
    # yet goes through every gather, so rank 1 is not left waiting in a collective
    results = _run_ranks(setup, "bad")
    n = len(make_weights(0))
    assert results[0]["gathered"] == results[1]["gathered"] == n
    assert results[0]["version"] is None and results[1]["error"] is None
    err = results[0]["error"]
    assert "yielded 'model.layers.0.self_attn.q_proj.weight' as" in err and "its metadata() declares" in err, err
    assert _weight_version(engine) == "5"  # nothing was published, the engine was not asked


def test_bad_input_gives_clear_errors_and_the_engine_serves_on(setup):
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from tensorhub.integrations._core.settings import SettingsError
    from tensorhub.integrations.vllm.trainer import TensorHubTrainerInitInfo

    engine, url = setup["engine"], setup["url"]
    before, text_before = _weight_version(engine), engine.generate(PROMPTS)

    # unknown and bad trainer-side options
    with pytest.raises(TypeError, match="bogus"):
        TensorHubTrainerInitInfo(model=MODEL, coordinator=url, rank=0, bogus=1)
    with pytest.raises(SettingsError, match="option 'model' is required"):
        TensorHubTrainerInitInfo(coordinator=url, rank=0)
    with pytest.raises(SettingsError, match="option 'buffers' must be an int >= 1, got 0"):
        TensorHubTrainerInitInfo(model=MODEL, coordinator=url, rank=0, buffers=0)

    class Recording:
        def __init__(self) -> None:
            self.calls: list = []

        def __getattr__(self, name):
            return lambda *a, **k: self.calls.append(name)

    client = Recording()
    # a wrong token: refused at trainer_init, naming the option; the engine is not contacted
    with pytest.raises(SettingsError, match="option 'token': the coordinator at .* refused it"):
        WeightTransferTrainerFactory.trainer_init(
            TensorHubTrainerInitInfo(model=MODEL, coordinator=url, token="wrong", rank=0),
            client=client, source=_source(make_weights(0)))
    with pytest.raises(SettingsError, match="needs source="):
        WeightTransferTrainerFactory.trainer_init(
            TensorHubTrainerInitInfo(model=MODEL, coordinator=url, token=TOKEN, rank=0), client=client)
    assert client.calls == []

    http = HTTPVLLMWeightSyncClient(engine.url)
    import requests

    # an unknown worker-side option, in the update info the trainer hands to the engine
    http.start_weight_update()
    with pytest.raises(requests.HTTPError) as ei:
        http.update_weights({"version": 2, "bogus": 1})
    assert "bogus" in ei.value.response.text, ei.value.response.text
    # an unknown worker-side option at init
    with pytest.raises(requests.HTTPError) as ei:
        http.init_weight_transfer_engine({"model": MODEL, "bogus": 1})
    assert "bogus" in ei.value.response.text, ei.value.response.text
    # a version that is not there: named, with the newest complete one; the engine keeps its weights
    http.start_weight_update()
    with pytest.raises(requests.HTTPError) as ei:
        http.update_weights({"version": 99})
    body = ei.value.response.text
    assert "no complete version 99" in body and "newest complete: 5" in body, body
    assert f"keeps serving v{before}" in body, body
    assert _weight_version(engine) == before
    assert engine.generate(PROMPTS) == text_before
    # and a model the engine does not serve
    with pytest.raises(requests.HTTPError) as ei:
        http.init_weight_transfer_engine({"model": "other"})
    assert "'model'" in ei.value.response.text and "other" in ei.value.response.text, ei.value.response.text
    assert engine.generate(PROMPTS) == text_before

    # a source that does not fit the engine's model: published, refused by the engine before
    # anything changed, and the trainer's error carries the engine's words
    wrong = {k: v for k, v in make_weights(0).items() if k != "lm_head.weight"}
    trainer = WeightTransferTrainerFactory.trainer_init(
        TensorHubTrainerInitInfo(model=MODEL, coordinator=url, token=TOKEN, worker_id="trainer-wrong", rank=0),
        client=HTTPVLLMWeightSyncClient(engine.url), source=_source(wrong))
    try:
        with pytest.raises(RuntimeError) as ei:
            trainer.send_weights()
        msg = str(ei.value)
        assert "published 'policy' v6, but the engines did not swap to it" in msg, msg
        assert "'lm_head.weight'" in msg and f"keeps serving v{before}" in msg, msg  # the engine's words
        assert trainer.version is None
    finally:
        trainer.shutdown()
    assert _weight_version(engine) == before
    assert engine.generate(PROMPTS) == text_before


def test_one_buffer_is_reused_once_the_engine_holds_the_version(setup):
    """buffers=1: the second send overwrites the snapshot of the first, after unpublishing it
    (the engine, which runs that version, keeps it served); outputs follow each version."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from tensorhub.integrations.vllm.trainer import TensorHubTrainerInitInfo

    engine, url = setup["engine"], setup["url"]
    weights = {k: v.clone() for k, v in make_weights(1).items()}
    trainer = WeightTransferTrainerFactory.trainer_init(
        TensorHubTrainerInitInfo(model=MODEL, coordinator=url, token=TOKEN, worker_id="trainer-1buf", rank=0,
                                 buffers=1),
        client=HTTPVLLMWeightSyncClient(engine.url), source=_source(weights))
    try:
        trainer.send_weights()
        first = trainer.version
        assert set(_replicas(url, first)) == {"trainer-1buf", "engine-a"}
        assert engine.generate(PROMPTS) == setup["seed1_text"]
        for k, v in make_weights(0).items():
            weights[k].copy_(v)
        trainer.send_weights()
        assert trainer.version == first + 1 and _weight_version(engine) == str(first + 1)
        assert engine.generate(PROMPTS) == setup["seed0_text"]
        assert "trainer-1buf" not in _replicas(url, first)
        assert len(trainer._buffers) == 1
    finally:
        trainer.shutdown()


def test_the_backend_is_registered_by_the_plugin_and_by_import():
    """vLLM's plug-in hook registers the trainer engine lazily (no import of it until used);
    a trainer process that loads no plug-ins gets it by importing the init info's module."""
    code = """if True:
        import sys
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory as F
        assert "tensorhub" not in F._registry
        import tensorhub.integrations.vllm
        tensorhub.integrations.vllm.register()
        tensorhub.integrations.vllm.register()  # idempotent
        assert "tensorhub.integrations.vllm.trainer" not in sys.modules
        cls = F._registry["tensorhub"]()
        from tensorhub.integrations.vllm.trainer import TensorHubTrainerInitInfo, TensorHubTrainerWeightTransferEngine
        assert cls is TensorHubTrainerWeightTransferEngine and TensorHubTrainerInitInfo.backend == "tensorhub"
    """
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=engine_env())
    code = """if True:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory as F
        from tensorhub.integrations.vllm.trainer import TensorHubTrainerWeightTransferEngine
        assert F._registry["tensorhub"]() is TensorHubTrainerWeightTransferEngine
    """
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=engine_env())


def test_example_runs_and_rollouts_match_the_trainer(tmp_path):
    """examples/vllm_trainer_api.py as a user runs it: vLLM's default loader, the trainer
    API with the tensorhub backend, rollouts checked against the trainer's after each swap."""
    require_vllm()
    out = tmp_path / "res.json"
    r = subprocess.run([sys.executable, str(HERE.parent.parent / "examples" / "vllm_trainer_api.py"),
                        "--versions", "2", "--steps", "10", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, env=engine_env(), cwd=str(tmp_path))
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr[-4000:]}"
    assert "all rollouts match the trainer's" in r.stdout, r.stdout
    res = json.loads(out.read_text())
    assert res["ok"] and [row["version"] for row in res["versions"]] == [1, 2]
    assert all(row["differ"] == 0 for row in res["versions"])
    assert res["versions"][-1]["score"] > 0  # the engine runs the trained weights, not the initial ones
