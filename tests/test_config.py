"""HubConfig: one configuration object, resolved once (argument > environment > default),
shared by the Hub, the CLI and the engine adapters."""

from __future__ import annotations

import pytest

import tensorhub
from tensorhub import ConfigError, HubConfig
from tensorhub.testing import InMemoryTransport


def test_argument_beats_environment_beats_default(monkeypatch):
    monkeypatch.setenv("TENSORHUB_COORDINATOR", "http://env:7777")
    monkeypatch.setenv("TENSORHUB_CHUNK_BYTES", "1048576")
    monkeypatch.setenv("TENSORHUB_PIPELINED", "0")
    monkeypatch.setenv("TENSORHUB_LOCALITY", "dc=east,zone=z2")
    monkeypatch.delenv("TENSORHUB_STRIPE", raising=False)
    cfg = HubConfig.resolve(chunk_bytes=2 << 20)
    assert cfg.coordinator == "http://env:7777"  # environment
    assert cfg.chunk_bytes == 2 << 20  # argument over environment
    assert cfg.pipelined is False  # environment ("0")
    assert cfg.max_sources == 4  # default
    assert (cfg.locality.datacenter, cfg.locality.zone) == ("east", "z2")
    assert HubConfig.resolve("http://arg:1").coordinator == "http://arg:1"
    # 0 and False given as arguments are honoured (only None means "not given").
    assert HubConfig.resolve("http://arg:1", pipelined=True).pipelined is True
    monkeypatch.setenv("TENSORHUB_PIPELINED", "1")
    assert HubConfig.resolve("http://arg:1", pipelined=False).pipelined is False


def test_bad_values_are_clear_errors(monkeypatch):
    monkeypatch.delenv("TENSORHUB_COORDINATOR", raising=False)
    with pytest.raises(ConfigError, match="no coordinator URL"):
        HubConfig.resolve()
    with pytest.raises(ConfigError, match="chunk_bytes"):
        HubConfig.resolve("http://x:1", chunk_bytes=0)
    with pytest.raises(ConfigError, match="max_sources"):
        HubConfig.resolve("http://x:1", max_sources=0)
    with pytest.raises(ConfigError, match="heartbeat_interval"):
        HubConfig.resolve("http://x:1", heartbeat_interval=-1)
    with pytest.raises(ConfigError, match="checksum"):
        HubConfig.resolve("http://x:1", checksum="maybe")
    with pytest.raises(ConfigError, match="locality"):
        HubConfig.resolve("http://x:1", locality="planet=mars")
    monkeypatch.setenv("TENSORHUB_STRIPE", "many")
    with pytest.raises(ConfigError, match="TENSORHUB_STRIPE"):
        HubConfig.resolve("http://x:1")
    with pytest.raises(TypeError, match="pipelinde"):
        HubConfig.resolve("http://x:1", pipelinde=False)
    with pytest.raises(TypeError, match="pipelinde"):
        tensorhub.connect("http://x:1", pipelinde=False)


def test_token_is_never_shown_and_token_files_are_checked(tmp_path):
    cfg = HubConfig.resolve("http://x:1", token="s3cret")
    assert "s3cret" not in repr(cfg) and cfg.token == "s3cret"
    f = tmp_path / "token"
    f.write_text("  tok\n")
    assert HubConfig.from_cli("http://x:1", str(f)).token == "tok"
    f.write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        HubConfig.from_cli("http://x:1", str(f))
    with pytest.raises(ConfigError, match="cannot read token file"):
        HubConfig.from_cli("http://x:1", str(tmp_path / "missing"))


def test_hub_runs_on_the_config_it_was_given(embedded):
    cfg = HubConfig.resolve(embedded.url, worker_id="cfg-w", chunk_bytes=1 << 20, pipelined=False,
                            heartbeat_interval=0.5)
    with tensorhub.connect(config=cfg, transport=InMemoryTransport()) as hub:
        assert hub.config is cfg
        assert (hub.url, hub.worker_id, hub.chunk_bytes, hub.pipelined) == (embedded.url, "cfg-w", 1 << 20, False)
        # The few settings that may change on a live Hub go through the config, checked again.
        hub.pipelined = True
        assert hub.config.pipelined is True and cfg.pipelined is False
        with pytest.raises(ConfigError):
            hub.chunk_bytes = 0
        assert hub.chunk_bytes == 1 << 20
    with pytest.raises(ConfigError, match="either config= or"):
        tensorhub.connect(embedded.url, config=cfg)


def test_engine_settings_take_several_coordinators(embedded):
    """HA: the adapters' start-up probe accepts a list and any answering coordinator will do."""
    from tensorhub.integrations._core.settings import Settings, SettingsError
    from tensorhub.integrations._core.worker import _probe

    dead = "http://127.0.0.1:1"
    s = Settings.from_config({"coordinator": f"{dead},{embedded.url}", "model": "m", "connect_timeout": 5})
    _probe(s)  # the second answers
    assert s.hub_config("w").urls == [dead, embedded.url]
    with pytest.raises(SettingsError, match="did not answer"):
        _probe(Settings.from_config({"coordinator": f"{dead},http://127.0.0.1:2", "model": "m",
                                     "connect_timeout": 1}))
    with pytest.raises(SettingsError, match="coordinator"):
        _probe(Settings.from_config({"coordinator": f"{embedded.url},ftp://x", "model": "m"}))


def test_every_hub_setting_is_a_config_field(monkeypatch):
    """The data plane's and same-host reads' settings are HubConfig fields too (argument >
    variable > default), and the Hub's parts read them from its config, not the environment."""
    for var in ("TENSORHUB_TRANSPORT", "TENSORHUB_DATA_HOST", "TENSORHUB_SAMEHOST", "TENSORHUB_SAMEHOST_VM",
                "TENSORHUB_ADDRESS_RUNS", "TENSORHUB_REGISTER_LIKE", "TENSORHUB_PROGRESS_INTERVAL",
                "TENSORHUB_MOONCAKE_PROTOCOL", "TENSORHUB_MOONCAKE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    cfg = HubConfig.resolve("http://x:1")
    assert (cfg.transport_kind, cfg.data_host, cfg.samehost, cfg.samehost_vm, cfg.address_runs, cfg.register_like,
            cfg.progress_interval, cfg.mooncake_protocol, cfg.mooncake_devices) == \
        ("mooncake", None, True, True, True, True, 1.0, "tcp", "")
    monkeypatch.setenv("TENSORHUB_SAMEHOST", "0")
    monkeypatch.setenv("TENSORHUB_TRANSPORT", "Memory")
    monkeypatch.setenv("TENSORHUB_DATA_HOST", "10.1.2.3")
    monkeypatch.setenv("TENSORHUB_PROGRESS_INTERVAL", "0")
    cfg = HubConfig.resolve("http://x:1", samehost_vm=False)
    assert (cfg.samehost, cfg.samehost_vm, cfg.transport_kind, cfg.data_host, cfg.progress_interval) == \
        (False, False, "memory", "10.1.2.3", 0.0)
    assert HubConfig.resolve("http://x:1", samehost=True).samehost is True  # argument over variable
    with pytest.raises(ConfigError, match="transport_kind='carrier-pigeon' is not a transport"):
        HubConfig.resolve("http://x:1", transport_kind="carrier-pigeon")
    with pytest.raises(ConfigError, match="progress_interval"):
        HubConfig.resolve("http://x:1", progress_interval=-1)
    monkeypatch.setenv("TENSORHUB_SAMEHOST", "maybe")
    with pytest.raises(ConfigError, match="TENSORHUB_SAMEHOST"):
        HubConfig.resolve("http://x:1")


def test_a_hub_reads_samehost_and_its_transport_from_its_config(embedded, monkeypatch):
    """``samehost=False`` given to one Hub (the variable says 1): its allocations are plain
    memory, not arenas same-host readers map; another Hub in the same process keeps them.
    ``transport="memory"`` names the transport as ``transport_kind``."""
    import torch

    from tensorhub.transport import _arena

    monkeypatch.setenv("TENSORHUB_SAMEHOST", "1")
    w = {"w": torch.zeros(1 << 16)}
    with tensorhub.connect(embedded.url, worker_id="plain", samehost=False, transport="memory") as plain, \
            tensorhub.connect(embedded.url, worker_id="arena", transport="memory") as arena:
        assert plain.config.transport_kind == "memory" and not plain.config.samehost
        a, b = plain.empty_like(w)["w"], arena.empty_like(w)["w"]
        assert _arena.arena_of(a.data_ptr(), a.nbytes) is None
        assert _arena.arena_of(b.data_ptr(), b.nbytes) is not None
        v = arena.publish("cfg", {"w": torch.arange(1 << 16, dtype=torch.float32)})
        got = plain.fetch("cfg", v, serve=False)
        assert torch.equal(got["w"], torch.arange(1 << 16, dtype=torch.float32))  # the bytes moved
        assert _arena.arena_of(got["w"].data_ptr(), got["w"].nbytes) is None
