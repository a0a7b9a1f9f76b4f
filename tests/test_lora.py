"""LoRA adapter versions in the core (embedded coordinator, in-memory transport): what
``publish(kind="lora")`` refuses before anything is published, what readers get with the
version (``version_meta``), the meta on the wire (bounded; left out for full weights, so
older peers read manifests as before; persisted across a coordinator restart), and an
adapter version read through a delta like any version."""

from __future__ import annotations

import json
import re

import pytest
import torch

import tensorhub
from tensorhub import VersionMeta, _lora
from tensorhub._exceptions import ConfigError
from tensorhub.protocol import MAX_META_BYTES, Manifest, TensorSpec, first_difference, manifest_json

CONFIG = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "peft_type": "LORA", "bias": "none"}


def adapter(seed: int, r: int = 4, layers: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(layers):
        for m, o in (("q_proj", 32), ("v_proj", 16)):
            p = f"base_model.model.model.layers.{i}.self_attn.{m}"
            out[f"{p}.lora_A.weight"] = torch.randn(r, 32, generator=g)
            out[f"{p}.lora_B.weight"] = torch.randn(o, r, generator=g)
    return out


def _bits(t: torch.Tensor) -> bytes:
    return bytes(t.reshape(-1).view(torch.uint8).numpy())


def test_an_adapter_version_carries_its_meta_and_is_read_like_any_version(connect):
    t, r = connect("trainer"), connect("reader")
    a1 = adapter(1)
    v1 = t.publish("pol-lora", a1, kind="lora", base_model="pol", config=CONFIG)
    meta = r.version_meta("pol-lora", v1)
    assert isinstance(meta, VersionMeta)
    assert (meta.kind, meta.base, meta.config) == ("lora", "pol", CONFIG)
    f = r.fetch("pol-lora", v1)
    assert all(_bits(f[k]) == _bits(a1[k]) for k in a1) and set(f) == set(a1)
    # The reader serves it (registered by digest: the manifest with its meta).
    assert ("pol-lora", v1, "hf", 0) in r.held()
    late = connect("late")
    assert late.version_meta("pol-lora", v1) == meta
    # A delta against the previous adapter version, read by a reader that holds it.
    a2 = {k: v.clone() for k, v in a1.items()}
    next(iter(a2.values()))[0, 0] += 1.0
    v2 = t.publish("pol-lora", a2, kind="lora", base_model="pol@v3", config=CONFIG, base=v1)
    g = r.fetch("pol-lora", v2)
    assert g.delta is not None and all(_bits(g[k]) == _bits(a2[k]) for k in a2)
    assert r.version_meta("pol-lora", v2).base == "pol@v3"
    # Full weights carry none.
    vf = t.publish("pol", {"w": torch.ones(4)})
    assert r.version_meta("pol", vf) is None


@pytest.mark.parametrize("kw, tensors, message", [
    (dict(kind="lora", config=CONFIG), None, "needs base_model"),
    (dict(kind="lora", base_model="pol"), None, "needs config="),
    (dict(kind="lora", base_model="pol", config={"r": 4, "lora_alpha": 8}), None, "lacks target_modules"),
    (dict(kind="lora", base_model="pol", config=dict(CONFIG, r=0)), None, "r (the rank) must be a positive int"),
    (dict(kind="lora", base_model="pol", config=dict(CONFIG, r=8)), None, "has rank 4, the config's r is 8"),
    (dict(kind="lora", base_model="pol", config=CONFIG), {"model.embed.weight": torch.ones(2, 2)},
     "is not a PEFT LoRA weight"),
    (dict(kind="lora", base_model="pol", config=CONFIG), {"m.q.lora_A.weight": torch.ones(4, 8)}, "needs its A and B"),
    (dict(kind="lora", base_model="pol", config=CONFIG),
     {"m.q.lora_A.weight": torch.ones(4, 8), "m.q.lora_B.weight": torch.ones(8, 2)}, "must agree"),
    (dict(kind="adapter"), None, "kind must be 'full' or 'lora'"),
    (dict(base_model="pol"), None, "publish it with kind='lora'"),
    (dict(kind="lora", base_model="pol", config=dict(CONFIG, blob="x" * MAX_META_BYTES)), None, "bytes of JSON"),
])
def test_bad_adapters_are_refused_before_anything_is_published(connect, kw, tensors, message):
    t = connect("trainer")
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        t.publish("pol-lora", adapter(1) if tensors is None else tensors, **kw)
    assert "\n" not in str(e.value)
    with pytest.raises(tensorhub.NotFoundError):
        t.latest("pol-lora")


def test_an_adapter_is_published_whole(connect):
    t = connect("trainer")
    for kw in (dict(layout="vllm-tp0"), dict(shard=0, num_shards=2)):
        with pytest.raises(ConfigError, match="published whole"):
            t.publish("pol-lora", adapter(1), kind="lora", base_model="pol", config=CONFIG, **kw)
    with pytest.raises(ConfigError, match="non-empty mapping"):
        t.publish("pol-lora", {}, kind="lora", base_model="pol", config=CONFIG)


def test_unknown_version_is_not_found(connect):
    t = connect("trainer")
    t.publish("pol-lora", adapter(1), kind="lora", base_model="pol", config=CONFIG)
    with pytest.raises(tensorhub.NotFoundError):
        t.version_meta("pol-lora", 7)


def test_peft_config_objects_and_sets_become_json():
    class Kind:  # an enum-like (peft's PeftType)
        value = "LORA"

    meta = _lora.version_meta("lora", "pol", dict(CONFIG, target_modules={"v_proj", "q_proj"}, peft_type=Kind()),
                              adapter(1))
    assert meta.config["target_modules"] == ["q_proj", "v_proj"] and meta.config["peft_type"] == "LORA"
    assert _lora.parse_base("pol@v12") == ("pol", 12) and _lora.parse_base("org/pol") == ("org/pol", None)
    assert _lora.module_of("x.q_proj.lora_B.default.weight") == ("x.q_proj", "lora_B")


def test_meta_on_the_wire_is_left_out_for_full_weights_and_compared_when_both_have_it():
    spec = [TensorSpec(name="a.lora_A.weight", dtype="float32", shape=(4, 8), nbytes=128)]
    plain = Manifest(tensors=spec)
    assert "meta" not in json.loads(manifest_json(plain))
    meta = VersionMeta(kind="lora", base="pol", config=CONFIG)
    m = Manifest(tensors=spec, meta=meta)
    back = Manifest.model_validate_json(manifest_json(m))
    assert back == m and back.meta.config == CONFIG
    assert first_difference(m, plain) is None  # a replica from an older client: no meta, no mismatch
    other = Manifest(tensors=spec, meta=VersionMeta(kind="lora", base="other", config=CONFIG))
    assert "meta" in first_difference(m, other)
    with pytest.raises(ValueError, match="kind 'lora' needs base"):
        VersionMeta(kind="lora", config=CONFIG)


def test_meta_survives_a_coordinator_restart(tmp_path):
    from tensorhub.coordinator import EmbeddedCoordinator
    from tensorhub.testing import InMemoryTransport

    with EmbeddedCoordinator(tmp_path / "state") as c:
        with tensorhub.connect(c.url, worker_id="t", transport=InMemoryTransport()) as t:
            v = t.publish("pol-lora", adapter(1), kind="lora", base_model="pol", config=CONFIG)
    with EmbeddedCoordinator(tmp_path / "state") as c2:
        with tensorhub.connect(c2.url, worker_id="r", transport=InMemoryTransport()) as r:
            assert r.version_meta("pol-lora", v).base == "pol"


# ---------------------------------------------------------------- the vLLM hook's checks (no vLLM needed)
def test_lora_paths_and_names():
    from tensorhub.integrations.vllm import lora

    assert lora.lora_name("pol-lora", 3) == "pol-lora@v3" and lora.lora_path("pol-lora", 3) == "tensorhub://pol-lora/3"
    assert lora.parse_path("tensorhub://org/pol-lora/12") == ("org/pol-lora", 12)
    assert lora.parse_path("/data/adapters/a1") is None
    for bad in ("tensorhub://pol-lora", "tensorhub://pol-lora/x", "tensorhub://pol-lora/0"):
        with pytest.raises(lora.LoRAAdapterError, match="expected tensorhub://<model>/<version>"):
            lora.parse_path(bad)


def test_the_hook_checks_base_kind_and_rank_with_one_error_each():
    from tensorhub.integrations.vllm.lora import LoRAAdapterError, check_adapter

    meta = VersionMeta(kind="lora", base="pol", config=CONFIG)
    assert check_adapter("a", meta, "pol", 2, [], 8) == 4
    assert check_adapter("a", meta, None, None, ["/models/x", "pol"], 8) == 4  # a plain engine: --served-model-name
    cases = [
        (meta, "other", None, [], 8, "is for base model 'pol'; this engine serves 'other'"),
        (VersionMeta(kind="lora", base="pol@v3", config=CONFIG), "pol", 2, [], 8, "this engine runs 'pol' v2"),
        (meta, None, None, ["/models/x"], 8, "this engine serves '/models/x'"),
        (meta, "pol", 1, [], 2, "has rank 4; this engine was started with --max-lora-rank 2"),
        (VersionMeta(kind="lora", base="pol", config=dict(CONFIG, rank_pattern={"q_proj": 16})), "pol", 1, [], 8,
         "has rank 16"),
        (None, "pol", 1, [], 8, "holds full weights, not a LoRA adapter"),
    ]
    for m, served, sv, names, max_rank, why in cases:
        with pytest.raises(LoRAAdapterError, match=re.escape(why)):
            check_adapter("tensorhub://pol-lora/1", m, served, sv, names, max_rank)


def test_a_plain_engine_opens_its_own_hub_from_the_environment(embedded, monkeypatch):
    from tensorhub.integrations.vllm import lora

    monkeypatch.setenv("TENSORHUB_COORDINATOR", embedded.url)
    monkeypatch.setenv("TENSORHUB_WORKER_ID", "plain-engine")
    adapters = lora._Adapters()
    try:
        hub, serving, model, version = adapters.hub(None)
        assert (serving, model, version) == (True, None, None) and hub.worker_id == "plain-engine"
        assert adapters.hub(None)[0] is hub
    finally:
        if adapters.own_hub is not None:
            adapters.own_hub.close()


def test_kept_adapter_copies_are_bounded_and_older_ones_unpublished(connect):
    from tensorhub.integrations.vllm import lora

    t, r = connect("trainer"), connect("engine")
    vs = [t.publish("pol-lora", adapter(i), kind="lora", base_model="pol", config=CONFIG) for i in range(4)]
    kept = lora._Adapters()
    for v in vs:
        kept.keep(r, ("pol-lora", v), r.fetch("pol-lora", v), capacity=2)
    assert list(kept.kept) == [("pol-lora", vs[2]), ("pol-lora", vs[3])]
    assert sorted(k[1] for k in r.held()) == vs[2:]


# ---------------------------------------------------------------- tensorhub follow --lora K (a fake engine)
def test_follow_lora_loads_each_new_version_and_keeps_the_newest_k(connect, embedded, capsys):
    import argparse

    from tensorhub.follow import LoraOps, follow_lora

    t = connect("trainer")
    calls: list = []
    loaded: set = set()

    def load(client, model, v):
        calls.append(("load", v))
        if v == 3:
            raise RuntimeError("tensorhub: LoRA adapter is for base model 'other'")
        loaded.add(v)

    def unload(client, model, v):
        calls.append(("unload", v))
        loaded.discard(v)

    for i in range(2):
        t.publish("pol-lora", adapter(i), kind="lora", base_model="pol", config=CONFIG)
    loaded.add(1)  # the engine had v1 loaded already
    ops = LoraOps(load, unload, lambda client, model: sorted(loaded))

    import threading

    def publish_more():
        import time as _t
        for i in range(2, 5):
            _t.sleep(0.5)
            t.publish("pol-lora", adapter(i), kind="lora", base_model="pol", config=CONFIG)

    th = threading.Thread(target=publish_more)
    th.start()
    args = argparse.Namespace(lora=2, model="pol-lora", engine="http://engine", max_swaps=3)
    hub = connect("follower")
    assert follow_lora(args, hub, None, ops) == 0
    th.join()
    assert [c for c in calls if c[0] == "load"] == [("load", 2), ("load", 3), ("load", 4), ("load", 5)]
    assert loaded == {4, 5} and ("unload", 1) in calls and ("unload", 2) in calls
    out = capsys.readouterr()
    assert "v5: loaded pol-lora@v5" in out.out and "v2: unloaded pol-lora@v2" in out.out
    assert "v3: loading pol-lora@v3 failed, skipped: tensorhub: LoRA adapter is for base model 'other'" in out.err
    args.lora = 0
    assert follow_lora(args, hub, None, ops) == 2
