"""The SGLang adapter's parts that need no SGLang: lazy imports, settings, the update
payload, buckets, and the seed's answers when no native layout exists."""

from __future__ import annotations

import io
import pickle
import subprocess
import sys
from dataclasses import fields

import httpx
import pytest

from tensorhub.integrations._core.settings import Settings, SettingsError


def test_importing_the_adapter_imports_no_sglang():
    code = ("import sys, tensorhub.integrations.sglang, tensorhub.integrations.sglang.loader, tensorhub.integrations.sglang.pull, "
            "tensorhub.integrations.sglang.seed, tensorhub.integrations.sglang.follow; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('sglang', 'vllm', 'torch')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_settings_are_the_shared_ones_native_included():
    assert "native" in {f.name for f in fields(Settings)}
    s = Settings.from_extra('{"coordinator": "http://h:1", "model": "policy"}')  # SGLang passes the JSON text
    assert (s.version, s.on_missing, s.serve_ranks, s.native) == ("latest", "error", "first", True)
    with pytest.raises(SettingsError, match="setting 'native': must be true or false"):
        Settings.from_config({"coordinator": "http://h:1", "model": "policy", "native": "yes"})
    with pytest.raises(SettingsError, match="setting 'on_missing'"):
        Settings.from_config({"coordinator": "http://h:1", "model": "policy", "on_missing": "maybe"})
    with pytest.raises(SettingsError, match="must be a JSON object"):
        Settings.from_extra("[1]")


def test_payload_names_the_version_and_nothing_else():
    torch = pytest.importorskip("torch")
    from tensorhub.integrations.sglang.pull import payload, requested_version

    import base64

    named = pickle.Unpickler(io.BytesIO(base64.b64decode(payload(12)))).load()
    assert [n for n, _ in named] == ["tensorhub:12"] and named[0][1].numel() == 0
    assert requested_version(named) == 12
    assert requested_version([("tensorhub:latest", torch.empty(0))]) == "latest"
    for bad in ([("model.embed_tokens.weight", torch.ones(2))], [], [("tensorhub:0", torch.empty(0))],
                [("tensorhub:1", torch.empty(0))] * 2):
        with pytest.raises(ValueError, match="tensorhub: the update payload"):
            requested_version(bad)


def test_buckets_cut_between_layers_and_at_the_limit():
    torch = pytest.importorskip("torch")
    from tensorhub.integrations._core.load import buckets
    from tensorhub.integrations.sglang._runtime import layer_groups

    t = {f"model.layers.{i}.{p}": torch.zeros(256) for i in range(3) for p in ("a", "b")}  # 1 KiB each
    t["lm_head.weight"] = torch.zeros(4096)  # 16 KiB: alone past the limit
    got = [[n for n, _ in b] for b in buckets(t, 2048, layer_groups)]
    assert got == [["model.layers.0.a", "model.layers.0.b"], ["model.layers.1.a", "model.layers.1.b"],
                   ["model.layers.2.a", "model.layers.2.b"], ["lm_head.weight"]]
    assert sum(len(b) for b in got) == len(t)


@pytest.mark.multiprocess
def test_seed_without_a_native_layout_says_what_to_start(embedded, workers):
    from tensorhub.integrations.sglang.seed import SeedServer

    url = embedded.url
    w = workers(url, "trainer")
    v = w.call("publish", seed=1, nbytes=1 << 16)
    with SeedServer(url, "policy") as seed:
        r = httpx.get(f"{seed.url}/get_remote_instance_transfer_engine_info", params={"rank": 0})
        assert r.status_code == 404
        assert f"'policy' v{v}: complete engine-native layouts: none" in r.json()["error"]["message"]
        r = httpx.get(f"{seed.url}/remote_instance_transfer_engine_info")
        assert r.status_code == 400 and "rank" in r.json()["error"]["message"]
    with SeedServer(url, "nope") as seed:
        r = httpx.get(f"{seed.url}/get_remote_instance_transfer_engine_info", params={"rank": 0})
        assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
