"""The vLLM plug-in's pure parts: settings, buckets, lazy imports, the entry point (no engine)."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from tensorhub.integrations._core.settings import Settings, SettingsError


def test_importing_the_plugin_imports_no_vllm():
    code = ("import sys, tensorhub.integrations.vllm, tensorhub.integrations.vllm.loader, tensorhub.integrations.vllm.transfer; "
            "assert 'vllm' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_entry_point_is_registered():
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("tensorhub") == "tensorhub.integrations.vllm:register"


def test_settings_precedence(monkeypatch):
    monkeypatch.setenv("TENSORHUB_COORDINATOR", "http://env:1")
    monkeypatch.setenv("TENSORHUB_TOKEN", "env-token")
    s = Settings.from_config({"model": "policy"})
    assert (s.coordinator, s.token, s.version, s.on_missing) == ("http://env:1", "env-token", "latest", "error")
    s = Settings.from_config({"model": "policy", "coordinator": "http://arg:2", "token": "t", "version": 3})
    assert (s.coordinator, s.token, s.version) == ("http://arg:2", "t", 3)
    assert s.redacted()["token"] == "***"
    s = Settings.from_config({"model": "policy", "coordinator": None})  # null = not given
    assert s.coordinator == "http://env:1"


@pytest.mark.parametrize("extra, line", [
    ({"model": "p", "modle": 1}, "tensorhub: unknown setting 'modle'"),
    ({"model": "p", "on_missing": "maybe"}, "tensorhub: setting 'on_missing': must be one of disk, wait, error"),
    ({"model": "p", "version": 0}, "tensorhub: setting 'version': must be \"latest\" or a positive integer"),
    ({"model": "p", "version": "newest"}, "tensorhub: setting 'version'"),
    ({"model": "p", "fetch_timeout": -1}, "tensorhub: setting 'fetch_timeout'"),
    ({"model": "p", "coordinator": "tcp://x"}, "tensorhub: setting 'coordinator': 'tcp://x' is not an http(s) URL"),
    ({}, "tensorhub: setting 'model': missing"),
])
def test_wrong_settings_name_the_setting(monkeypatch, extra, line):
    monkeypatch.setenv("TENSORHUB_COORDINATOR", "http://c:1")
    with pytest.raises(SettingsError) as e:
        Settings.from_config(extra)
    assert str(e.value).startswith(line) and "\n" not in str(e.value)


def test_no_coordinator_anywhere(monkeypatch):
    monkeypatch.delenv("TENSORHUB_COORDINATOR", raising=False)
    with pytest.raises(SettingsError, match="setting 'coordinator': no coordinator URL"):
        Settings.from_config({"model": "p"})


def test_buckets_are_bounded_and_cover_every_tensor_once():
    torch = pytest.importorskip("torch")
    from tensorhub.integrations._core.load import buckets
    from tensorhub.integrations.vllm._runtime import layer_groups

    names = ["model.embed_tokens.weight"] + [f"model.layers.{i}.{p}.weight" for i in range(4)
                                             for p in ("q", "k", "mlp")] + ["model.norm.weight", "lm_head.weight"]
    tensors = {n: torch.zeros(256) for n in names}  # 1 KiB each
    out = list(buckets(tensors, 3 * 1024, layer_groups))
    flat = [n for b in out for n, _ in b]
    assert sorted(flat) == sorted(names) and len(flat) == len(set(flat))
    assert all(sum(t.numel() * 4 for _, t in b) <= 3 * 1024 for b in out)
    big = list(buckets({"a": torch.zeros(4096)}, 1024, layer_groups))  # one tensor over the limit: its own bucket
    assert [[n for n, _ in b] for b in big] == [["a"]]
