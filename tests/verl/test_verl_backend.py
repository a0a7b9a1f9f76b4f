"""The verl checkpoint-engine backend ``tensorhub`` against the real verl 0.9.1 package.

Multi-process tests: a real coordinator process, trainer ranks and rollout workers in
``spawn`` processes over real Mooncake (TCP); what stands in for Ray, the model engine and
the server adapter is said in ``_verl_procs.py``. Every received tensor is compared by hash with
the one the trainer sent.
"""

from __future__ import annotations

import asyncio
import time

import pytest

import tensorhub
from tensorhub.testing import CoordinatorProcess


from _verl_procs import BACKEND, digests, make_weights, rollout, sync_step, trainer

MB = 1 << 20


# ---------------------------------------------------------------------- in process: verl's contract
def test_verl_finds_the_backend_by_name_through_its_plugin_entry_point(verl_plugin):
    import subprocess
    import sys

    code = ("import verl; from verl.checkpoint_engine.base import CheckpointEngineRegistry as R, "
            "CheckpointEngineWithCache as C; cls = R.get('tensorhub'); "
            "assert issubclass(cls, C) and not cls.__abstractmethods__, cls; print(cls.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "PYTHONPATH": ":".join(sys.path)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "tensorhub.integrations.verl.engine"


def test_without_the_plugin_verl_names_what_is_registered():
    import subprocess
    import sys

    code = ("import os; os.environ['VERL_USE_EXTERNAL_PLUGINS'] = 'none'\n"
            "from verl.checkpoint_engine import CheckpointEngineRegistry as R\n"
            "try:\n    R.get('tensorhub')\nexcept ValueError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "Checkpoint engine tensorhub not registered" in out.stdout, out.stderr[-2000:]


def _new(**kw):
    import tensorhub.integrations.verl.engine  # noqa: F401
    from verl.checkpoint_engine import CheckpointEngineRegistry

    return CheckpointEngineRegistry.new(BACKEND, bucket_size=kw.pop("bucket_size", MB), **kw)


@pytest.mark.parametrize("kwargs, text", [
    ({"modle": "p"}, "unknown key 'modle'"),
    ({"keep": 1}, "keep=1: must be an integer >= 2"),
    ({"dtype": "fp8"}, "dtype='fp8': must be one of float32, bfloat16, float16"),
    ({"timeout": -1}, "timeout=-1: must be a positive number"),
    ({"prefetch": "yes"}, "prefetch='yes': must be true or false"),
])
def test_bad_engine_kwargs_are_one_line_errors(kwargs, text):
    with pytest.raises(tensorhub.ConfigError, match="tensorhub \\(verl engine_kwargs\\): .*" + text.replace("(", "\\(")):
        _new(**kwargs)


def test_build_topology_hands_every_worker_the_masters_version():
    cls = type(_new())
    meta = [{"coordinator": "http://c:1", "model": "policy", "worker_id": f"w{i}", "is_master": i == 0,
             "version": 7 if i == 0 else None} for i in range(5)]
    actor, roll = cls.build_topology(2, 3, meta)
    assert actor == {"rank": [0, 1], "version": [7, 7], "role": ["trainer", "trainer"]}
    assert roll == {"rank": [0, 1, 2], "version": [7, 7, 7], "role": ["rollout"] * 3}
    bad = [dict(m) for m in meta]
    bad[3]["model"] = "critic"
    with pytest.raises(ValueError, match="rollout rank 1 \\(w3\\) uses model 'critic', trainer rank 0 uses 'policy'"):
        cls.build_topology(2, 3, bad)
    nomaster = [dict(m, version=None) for m in meta]
    with pytest.raises(ValueError, match="exactly one trainer rank must be the master"):
        cls.build_topology(2, 3, nomaster)


def test_coordinator_down_fails_prepare_naming_the_url():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there
    e = _new(coordinator=f"http://127.0.0.1:{port}", connect_timeout=1.5, is_master=True)
    t0 = time.monotonic()
    with pytest.raises(tensorhub.ConfigError, match=f"http://127.0.0.1:{port} did not answer within 1.5s"):
        e.prepare()
    assert time.monotonic() - t0 < 10


def test_wrong_token_and_unknown_version_and_nothing_prefetched(tmp_path):
    tok = tmp_path / "token"
    tok.write_text("s3cret")
    c = CoordinatorProcess(tmp_path / "state", token_file=tok)
    c.start()
    try:
        bad = _new(coordinator=c.url, token="wrong", is_master=True)
        with pytest.raises(tensorhub.UnauthorizedError, match=f"coordinator at {c.url} refused the token"):
            bad.prepare()

        r = _new(coordinator=c.url, token="s3cret", timeout=5)
        meta = r.prepare()
        assert meta["version"] is None and meta["coordinator"] == c.url
        r.init_process_group(rank=0, version=99, role="rollout")

        async def drain(gen):
            return [n async for n, _ in gen]

        with pytest.raises(tensorhub.NotFoundError, match="'policy' v99 is unknown to the coordinator at .*"
                                                          "newest complete version: None"):
            asyncio.run(drain(r.receive_weights(global_steps=1)))
        with pytest.raises(tensorhub.FetchError, match="no prefetched copy of 'policy' a version here"):
            asyncio.run(drain(r.get_weights()))
        r.close()
    finally:
        c.stop()


# ---------------------------------------------------------------------- processes: sync steps
def _check(step: dict, seed: int, layers: int = 4, cast: str | None = None) -> None:
    import torch

    sent = make_weights(seed, layers)
    assert step["sent"][0]["digests"] == digests(sent)
    if cast is not None:  # the trainer's engine_kwargs dtype: floating tensors cast in the snapshot
        sent = {n: t.to(getattr(torch, cast)) if t.is_floating_point() else t for n, t in sent.items()}
    want = digests(sent)
    for got in step["got"]:
        assert got["digests"] == want  # every tensor, bit for bit, in the order sent
        assert list(got["digests"]) == list(want)
        assert got["wire_format"] == "named_tensors"
        assert got["stats"]["version"] == step["version"]


@pytest.mark.multiprocess
def test_sync_steps_publish_and_stream_bit_exact_in_bounded_buckets(coord, model_dir):
    kw = {"coordinator": coord.url, "timeout": 120}
    ws = [trainer(0, kw), trainer(1, kw), rollout(0, kw, model_dir), rollout(1, kw, model_dir, how="module")]
    trainers, rollouts = ws[:2], ws[2:]
    try:
        for w in ws:
            w.ready()
        versions = []
        for step, seed in enumerate((11, 12, 13), start=1):
            s = sync_step(trainers, rollouts, seed, global_steps=step)
            _check(s, seed)
            versions.append(s["version"])
            assert s["sent"][0]["metrics"]["tensorhub/version"] == s["version"]
            assert s["sent"][1]["metrics"] == {}  # rank 1 drained its generator, published nothing
            for got in s["got"]:
                st = got["stats"]
                assert st["source"] == "stream" and st["buckets"] > 3
                assert st["largest_bucket"] <= MB  # every fetch into a reused buffer fit one bucket
                assert st["buffer_bytes"] <= 2 * MB  # two buffers
                assert st["oversized"] == 2 * MB  # the embedding, read alone
                assert set(st["sources"]) == {s["meta"][0]["worker_id"]}  # from the trainer's snapshot
        assert versions == sorted(versions) and len(set(versions)) == 3

        # bounded memory: a 50 MiB model through 1 MiB buckets grows a rollout by a few MiB
        s = sync_step(trainers, rollouts, 14, global_steps=4, layers=96)
        _check(s, 14, layers=96)
        model_mb = sum(t.numel() * t.element_size() for t in make_weights(14, 96).values()) / MB
        for got in s["got"]:
            print(f"rollout RSS growth {got['rss_growth_mb']:.1f} MiB for a {model_mb:.0f} MiB version "
                  f"({got['stats']['buckets']} buckets)")
            assert got["rss_growth_mb"] < model_mb / 4
    finally:
        for w in ws:
            w.close()


@pytest.mark.multiprocess
def test_prefetch_while_rollouts_run_then_get_weights(coord, model_dir):
    import torch

    kw = {"coordinator": coord.url, "timeout": 120}
    pkw = dict(kw, prefetch=True)
    t = trainer(0, dict(kw, dtype="bfloat16"))  # float32 masters, bfloat16 on the wire
    rollouts = [rollout(0, pkw, model_dir), rollout(1, pkw, model_dir)]
    try:
        for w in [t, *rollouts]:
            w.ready()
        s1 = sync_step([t], rollouts, 21, global_steps=1)
        _check(s1, 21, cast="bfloat16")

        # The trainer's half of the next step, while both rollouts keep generating.
        for r in rollouts:
            r.start("generate", s1["version"], 240.0)
        meta = t.call("engine", "prepare")
        v2 = meta["version"]
        t.call("engine", "init_process_group", rank=0, version=v2, role="trainer")
        t.call("send", 22, global_steps=2)
        t.call("engine", "finalize")
        ran = [r.result() for r in rollouts]
        for r, gen in zip(rollouts, ran):
            assert gen["versions_seen"][-1] == v2 and len(gen["versions_seen"]) >= 2, gen
            # (the copy changed from v1 to v2 while this rollout's thread kept generating)
            assert r.call("cached") == v2
            want = digests({n: t.to(torch.bfloat16) if t.is_floating_point() else t
                            for n, t in make_weights(22).items()})
            assert r.call("get_weights") == want  # get_weights: the prefetched v2, bit for bit

        hub = tensorhub.connect(coord.url, worker_id="test-observer")
        try:
            holders = {rep.worker_id for rep in hub.version_info("policy", v2).replicas}
        finally:
            hub.close()
        assert len(holders) == 3, holders  # the trainer and both rollouts' prefetched copies serve v2

        # v2 came without a delta: both rollouts now ask v3's lease ahead, before v3 exists
        import httpx
        import time

        deadline = time.monotonic() + 60
        while len([s for s in httpx.get(f"{coord.url}/v1/status", timeout=10).json()["subscribers"]
                   if s["version"] == v2 + 1]) < 2:
            assert time.monotonic() < deadline, "the rollouts did not subscribe ahead"
            time.sleep(0.1)
        s3 = sync_step([t], rollouts, 23, global_steps=3)  # receive_weights reads through the copy
        _check(s3, 23, cast="bfloat16")
        assert all(r.call("cached") == s3["version"] for r in rollouts)
    finally:
        for w in [t, *rollouts]:
            w.close()


# ---------------------------------------------------------------------- in process: the rollout's reads
def test_plan_buckets_cuts_in_order_within_the_limit():
    from collections import namedtuple

    from tensorhub.integrations.verl._receiver import plan_buckets

    S = namedtuple("S", "name nbytes")
    specs = [S("a", 64), S("b", 448), S("c", 500), S("d", 2000), S("e", 10), S("f", 20), S("g", 1024)]
    plan = [[s.name for s in b] for b in plan_buckets(specs, 1024)]
    # a+b+c fill 1024 bytes (c padded to 512); d is larger than a bucket: alone; g would overflow e+f
    assert plan == [["a", "b", "c"], ["d"], ["e", "f"], ["g"]]


def test_streamed_buckets_are_exact_and_an_abandoned_stream_closes_cleanly(connect):
    """The rollout's stream over a real Hub (in-memory transport, embedded coordinator): every
    tensor exact, at most two bucket buffers, and a consumer that stops early (its next bucket's
    read in flight) closes the stream without an error."""
    import torch

    from tensorhub.integrations.verl._receiver import Receiver

    w = make_weights(3, layers=6)
    v = connect("trainer").publish("policy", w)
    r = Receiver(connect("rollout"), "policy", bucket_size=MB, timeout=30)

    async def read_all():
        return {n: t.clone() async for n, t in r.stream(v)}

    got = asyncio.run(read_all())
    assert list(got) == list(w) and all(torch.equal(got[n], w[n]) for n in w)
    assert r.stats.largest_bucket <= MB and r.stats.buffer_bytes <= 2 * MB and r.stats.oversized == 2 * MB

    async def stop_early():
        gen = r.stream(v)
        first = [await gen.__anext__() for _ in range(2)]
        await gen.aclose()  # the next bucket's read is in flight: aclose waits for it
        return first

    first = asyncio.run(stop_early())
    assert [n for n, _ in first] == list(w)[:2]
