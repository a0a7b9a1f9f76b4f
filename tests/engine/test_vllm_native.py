"""The engine-native layout of the vLLM adapter (tensorhub/integrations/vllm/_native.py).

Unit level on CPU: a small torch module stands in for a vLLM model (vLLM's own CPU
engine cannot serve its parameters: it prepacks linear weights, which `servable` refuses
and the engine tests check). The raw start and swap with real engines need a GPU:
test_native_start_and_swap_on_gpu, marked `gpu`.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import tensorhub
from tensorhub.integrations._core.load import copy_into
from tensorhub.integrations._core.settings import Settings
from tensorhub.integrations.vllm import _native, _runtime
from tensorhub.testing import InMemoryTransport, digest


def _model(seed: int, hidden: int = 64) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Embedding(100, hidden), torch.nn.Linear(hidden, hidden),
                            torch.nn.Linear(hidden, 100, bias=False))
    m.config = SimpleNamespace(to_dict=lambda: {"hidden": hidden, "layers": 2})
    m[0].register_buffer("cache", torch.randn(8, hidden), persistent=False)  # like a rotary cache
    return m.requires_grad_(False)


MC = SimpleNamespace(dtype=torch.float32, quantization=None)


def test_fingerprint_is_stable_and_covers_what_fixes_the_bytes():
    a = _native.fingerprint(_model(0), MC, tp_size=2, engine_version="0.32.0")
    assert a == _native.fingerprint(_model(1), MC, tp_size=2, engine_version="0.32.0")  # values don't matter
    assert a.startswith("vllm-") and len(a) == 21
    others = [
        _native.fingerprint(_model(0), MC, tp_size=1, engine_version="0.32.0"),
        _native.fingerprint(_model(0), MC, tp_size=2, pp_size=2, engine_version="0.32.0"),
        _native.fingerprint(_model(0), MC, tp_size=2, engine_version="0.33.0"),
        _native.fingerprint(_model(0, hidden=32), MC, tp_size=2, engine_version="0.32.0"),
        _native.fingerprint(_model(0), SimpleNamespace(dtype=torch.float16, quantization=None), tp_size=2,
                            engine_version="0.32.0"),
        _native.fingerprint(_model(0), SimpleNamespace(dtype=torch.float32, quantization="fp8"), tp_size=2,
                            engine_version="0.32.0"),
    ]
    assert a not in others and len(set(others)) == len(others)


def test_servable_refuses_cpu_prepacking_empty_and_strided(monkeypatch):
    m = _model(0)
    why = _native.servable(_native.native_tensors(m))
    assert why is not None and "prepacked" in why  # CPU parameters are never served raw
    monkeypatch.setattr(_native, "CPU_PREPACKS", False)
    assert _native.servable(_native.native_tensors(m)) is None
    m[1].weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)  # what vLLM's CPU dispatch leaves
    assert "'1.weight' is empty" in _native.servable(_native.native_tensors(m))
    assert "not contiguous" in _native.servable({"w": torch.zeros(4, 4).t()})


def test_copy_into_checks_everything_before_writing():
    src, dst = _model(1), _model(2)
    before = digest(_native.native_tensors(dst))
    bad = dict(_native.native_tensors(src))
    bad["2.weight"] = bad["2.weight"][:50]
    with pytest.raises(ValueError, match=r"'2.weight' is torch.float32\(50, 64\)"):
        copy_into(_native.native_tensors(dst), bad)
    missing = dict(_native.native_tensors(src))
    del missing["0.weight"]
    with pytest.raises(ValueError, match="has no tensor '0.weight'"):
        copy_into(_native.native_tensors(dst), missing)
    assert digest(_native.native_tensors(dst)) == before  # nothing written
    n = copy_into(_native.native_tensors(dst), {k: v.clone() for k, v in _native.native_tensors(src).items()})
    assert digest(_native.native_tensors(dst)) == digest(_native.native_tensors(src))
    assert n == sum(t.numel() * 4 for t in _native.native_tensors(src).values())


@pytest.fixture
def ranks(embedded, monkeypatch):
    """Two TP ranks of one engine (a WorkerState each, own Hub) and a reader Hub."""
    monkeypatch.setattr(_native, "CPU_PREPACKS", False)
    made = []

    def hub(name):
        h = tensorhub.connect(embedded.url, worker_id=name, transport=InMemoryTransport(), heartbeat_interval=0.2)
        made.append(h)
        return h

    s = Settings.from_config({"coordinator": embedded.url, "model": "policy", "drain_timeout": 5})
    sts = [_runtime.WorkerState(s, hub(f"eng-tp{r}"), rank=r, tp_size=2) for r in range(2)]
    yield sts, hub("reader")
    for h in made:
        h.close()


def test_every_rank_registers_in_place_and_the_layout_is_available_once_all_did(ranks):
    sts, reader = ranks
    trainer_v = sts[0].hub.publish("policy", {"x": torch.ones(4)})  # the version the engine runs
    models = [_model(10 + r) for r in range(2)]
    layout = _native.fingerprint(models[0], MC, tp_size=2)
    for st in sts:
        st.layout, st.version = layout, trainer_v
    assert _native.publish(sts[0], models[0]) is True
    assert not _native.available(reader, "policy", trainer_v, layout, 0)  # one of two ranks
    assert _native.publish(sts[1], models[1]) is True
    assert _native.available(reader, "policy", trainer_v, layout, 0)
    assert _native.available(reader, "policy", trainer_v, layout, 1)
    for r in range(2):
        got = reader.fetch("policy", trainer_v, layout=layout, shard=r, serve=False)
        assert digest(dict(got)) == digest(_native.native_tensors(models[r]))
    with torch.no_grad():  # in place: the registered bytes are the parameters themselves
        models[1][1].weight.add_(1.0)
    reader.checksum = "off"  # without checksums the reader gets exactly those bytes ...
    got = reader.fetch("policy", trainer_v, layout=layout, shard=1, serve=False)
    reader.checksum = "auto"
    assert torch.equal(got["1.weight"], models[1][1].weight)
    # ... with them (the default), a change behind the Hub's back is refused
    with pytest.raises(tensorhub.FetchError, match="checksum mismatch"):
        reader.fetch("policy", trainer_v, layout=layout, shard=1, serve=False, timeout=3)
    # a swap (to a newer version, fetched first) withdraws before the parameters change:
    # the running version, every layout, is no longer served by the engine
    reader.publish("policy", {"x": torch.zeros(4)})
    for st in sts:
        _native.withdraw(st)
        assert st.native is False
    assert not _native.available(reader, "policy", trainer_v, layout, 0)
    assert not _native.available(reader, "policy", trainer_v, layout, 1)


def test_publish_never_fails_the_engine(ranks, monkeypatch, caplog):
    sts, _ = ranks
    st = sts[0]
    st.layout, st.version = "vllm-0000000000000000", 5
    assert _native.publish(st, _model(3)) is True
    assert _native.publish(st, _model(3)) is True  # already served: nothing to do
    st.native = False  # the same shard again with other shapes: the coordinator refuses it
    with caplog.at_level("WARNING"):
        assert _native.publish(st, _model(3, hidden=32)) is False
    assert "could not register the engine-native layout" in caplog.text and st.native is False
    st.version = 6
    monkeypatch.setattr(_native, "CPU_PREPACKS", True)
    assert _native.publish(st, _model(3)) is False  # CPU: refused, logged once at INFO
    st.settings = Settings.from_config({"coordinator": st.settings.coordinator, "model": "policy", "native": False})
    assert _native.publish(st, _model(3)) is False


def test_native_setting_is_validated():
    with pytest.raises(tensorhub.ConfigError, match="setting 'native'"):
        Settings.from_config({"coordinator": "http://x:1", "model": "m", "native": "yes"})


def _gpu_missing():
    try:
        import vllm  # noqa: F401
    except Exception as e:
        return f"vllm not importable: {e}"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    return None


@pytest.mark.gpu
@pytest.mark.engine
@pytest.mark.skipif(_gpu_missing() is not None, reason=str(_gpu_missing()))
def test_native_start_and_swap_on_gpu(tmp_path):
    """Engine A (GPU) loads its weight files and serves v1 in both layouts; engine B starts
    from A's native layout (raw, no load_weights) and generates the same tokens; both swap
    to v2 (hf from a trainer); engine C then starts from the native v2 of A and B."""
    from _engines import Coordinator, OfflineEngine
    from _tiny import PROMPTS, make_model_dir, make_weights

    coord = Coordinator(tmp_path / "state")
    engines = []
    trainer = tensorhub.connect(coord.url, worker_id="trainer")
    gpu = {"dtype": "float16", "enforce_eager": True, "max_model_len": 128, "gpu_memory_utilization": 0.2}
    try:
        d1, bare = make_model_dir(tmp_path / "v1", seed=0), make_model_dir(tmp_path / "bare", weights=False)

        def engine(name, model_dir, **extra):
            e = OfflineEngine(tmp_path / f"{name}.log", model=str(model_dir), load_format="tensorhub",
                              model_loader_extra_config={"coordinator": coord.url, "model": "policy",
                                                         "worker_id": name, **extra},
                              weight_transfer_config={"backend": "tensorhub"}, **gpu)
            engines.append(e)
            return e

        a = engine("a", d1, on_missing="disk")
        assert "serves policy v1 in place as layout vllm-" in a.log_tail(200_000)
        b = engine("b", bare)
        assert "loaded policy v1 raw from the native layout" in b.log_tail(200_000)
        ref = a.call("generate", prompts=PROMPTS)["ids"]
        assert b.call("generate", prompts=PROMPTS)["ids"] == ref
        w2 = make_weights(1)  # float32 like v1's weight files (an hf version keeps its dtypes)
        v2 = trainer.publish("policy", w2)
        for e in (a, b):
            e.call("start_weight_update")
            e.call("update_weights", update_info={"version": v2})
            e.call("finish_weight_update", weight_version=str(v2))
        out = a.call("generate", prompts=PROMPTS)["ids"]
        assert out != ref and b.call("generate", prompts=PROMPTS)["ids"] == out
        c = engine("c", bare)
        assert f"loaded policy v{v2} raw from the native layout" in c.log_tail(200_000)
        assert c.call("generate", prompts=PROMPTS)["ids"] == out
    finally:
        for e in engines:
            e.close()
        trainer.close()
        coord.stop()
