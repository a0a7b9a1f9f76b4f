"""The load benchmark, shortened: a real coordinator process answers every heartbeat and
lease of a few hundred simulated workers without an error. No timing assertions here; the
figures come from ``python benchmarks/bench_load.py`` (2,000 workers, 200 leases/s)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess


def _bench():
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_load.py"
    spec = importlib.util.spec_from_file_location("bench_load", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_load"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_coordinator_answers_everything_under_a_short_load():
    bench = _bench()
    out = bench.run(workers=200, holders=40, models=2, tensors=4, seconds=3.0, heartbeat=1.0,
                    lease_rate=20.0, connections=4)
    print(bench.report(out))
    assert out["errors"] == 0, out
    assert out["setup_errors"] == 0
    assert out["coordinator_alive"] and out["alive_after"]
    k = out["kinds"]
    assert k["register"]["ok"] == 200
    assert k["publish"]["ok"] == 2 + 40  # versions + replicas
    assert k["heartbeat"]["ok"] == out["sent"]["heartbeat"] > 0
    assert k["acquire"]["ok"] == k["release"]["ok"] == out["sent"]["lease"] > 0
    assert out["bytes_per_replica"] > 0


def _fleet():
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_fleet.py"
    _bench()  # bench_fleet imports bench_load's helpers
    spec = importlib.util.spec_from_file_location("bench_fleet", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_fleet"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_fleet_mode_bookkeeping():
    """Fleet mode (benchmarks/bench_fleet.py), shortened: every simulated pipelined reader
    completes each phase's version with the chunk-map protocol, its calls are counted by
    route (a fixed number per reader, whatever the chunk count), nothing answers an HTTP
    error; the protocol before chunk maps still runs for comparison."""
    bench = _fleet()
    readers = 12
    out = bench.run_fleet(workers=300, readers=readers, tensors=300, chunks=(64, 128), history=(2, 6),
                          history_tensors=4, heartbeat=1.0, link_gbps=10.0, connections=8, idle_seconds=0.5)
    print(bench.report_fleet(out))
    assert out["errors"] == 0, out
    assert out["coordinator_alive"] and out["alive_after"]
    assert list(out["phases"]) == ["base", "chunks", "history"]
    for name, ph in out["phases"].items():
        assert ph["completed"] == readers, (name, ph)
        c = ph["calls"]
        once = ("POST resolve", "POST leases (new, serving)", "GET manifest", "POST replicas (complete + release)")
        for route in once:  # one each per reader and version, as PipelinedSources does
            assert c[route] == readers, (name, route, c)
        assert c.get("POST leases (refresh)", 0) <= readers  # at most one each
        assert set(c) <= set(once) | {"POST leases (refresh)", "POST renew"}, c
        assert ph["calls_per_reader"] == round(sum(c.values()) / readers, 2) <= 6
        assert ph["heartbeats"] > 0 and ph["leases"] >= readers
    assert out["phases"]["chunks"]["chunks"] == 128 and out["phases"]["history"]["history"] == 6
    text = bench.report_fleet(out)
    assert "PASS" in text or "MISS" in text
    old = bench.run_fleet(workers=100, readers=4, tensors=300, chunks=(64, 128), history=(2, 3), history_tensors=4,
                          heartbeat=1.0, link_gbps=10.0, connections=8, idle_seconds=0.2, protocol="reports")
    assert old["errors"] == 0 and all(p["completed"] == 4 for p in old["phases"].values()), old
    assert all(p["calls"]["POST chunks"] >= 4 for p in old["phases"].values())


def test_fleet_readers_take_chunks_in_their_order():
    """The simulated readers' chunk choice by bit operations (``_in_order``) is the first
    readable chunks of ``chunk_order`` (forward and reverse, every start), as a scan would."""
    import random

    from tensorhub._planner import chunk_order

    bench = _fleet()
    rng = random.Random(7)
    for n in (1, 2, 5, 64, 257):
        for _ in range(40):
            start, rev = rng.random(), rng.random() < 0.5
            s = int(start * n) % n
            mask = rng.getrandbits(n) & rng.getrandbits(n) if rng.random() < 0.5 else rng.getrandbits(n)
            k = rng.randint(1, 10)
            want = [c for c in chunk_order(n, start, rev) if mask >> c & 1][:k]
            assert bench._in_order(mask, n, s, rev, k) == want, (n, start, rev, mask, k)


def test_bench_load_fleet_flag_runs_bench_fleet(capfd):
    """``bench_load.py --fleet`` keeps working (it runs bench_fleet.py in a process of its own)."""
    bench = _bench()
    rc = bench.main(["--fleet", "--workers", "60", "--readers", "2", "--fleet-tensors", "300", "--chunks", "64", "128",
                     "--history", "1", "2", "--history-tensors", "2", "--heartbeat", "1.0"])
    assert rc == 0
    assert "chunkmap protocol" in capfd.readouterr().out


def test_route_costs_bookkeeping():
    """``benchmarks/bench_routes.py``, shortened: every route it measures is answered 200 by
    the real coordinator process, for every reader (leases, refreshes, release + complete),
    and the gzip the readers ask for comes back (the manifest's answer is small)."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_routes.py"
    spec = importlib.util.spec_from_file_location("bench_routes", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_routes"] = mod
    spec.loader.exec_module(mod)
    out = mod.run_routes(readers=6, tensors=300, chunks=64, beats=40)
    print(mod.report_routes(out))
    assert out["alive"]
    routes = {r["route"]: r for r in out["routes"]}
    sent = routes.pop("(the manifest's JSON, as sent by the trainer)")
    assert len(routes) == 12, list(routes)
    for name, r in routes.items():
        assert r["statuses"] == {200: r["n"]}, (name, r)
    assert routes["lease refresh"]["n"] == routes["complete + release"]["n"] == 6
    # the next versions of the same tensors, each published by the one before's (``RegisterReplica.like``)
    assert routes["publish: register v+1 like v (the same 300 tensors)"]["n"] == mod.LIKES
    for got in ("GET manifest: the first (encodes)", "GET manifest: the others"):
        assert 0 < routes[got]["bytes"] < 0.25 * sent["bytes"], (routes[got], sent)  # gzipped


def test_lease_burst_bookkeeping():
    """``bench_fleet.py --burst`` (issue 31's lease burst), shortened: 16 followers hold their
    lease for v2 asked ahead on the real coordinator process; one registration of v2 answers
    every one with a grant of the fixed plan (v2, no refresh, striped, its partial replica
    registered), the publisher's replica the source of each stripe for exactly one reader.
    The usual way, side by side, gives every reader its plan answer too. No timing here."""
    bench = _fleet()
    readers = 16
    out = bench.run_burst(readers=readers, tensors=300, chunks=64, wait=20.0, keep_grants=True)
    print(bench.report_burst(out))
    ahead, base = out["runs"][0]["ahead"], out["runs"][0]["baseline"]
    for x in (ahead, base):
        assert x["coordinator_alive"] and not x["errors"], x
        assert x["planned"] == readers, x
    assert not ahead["bad"], ahead["bad"]
    grants = ahead["grants"]
    assert len(grants) == readers
    pub = ahead["publisher_replica"]
    stripes = grants[0]["stripes"]
    for g in grants:
        assert g["version"] == ahead["version"] == 2, g
        assert g.get("refresh_after", 0.0) == 0.0 and g["stripes"] == stripes > 0, g
        assert g["partial_replica_id"] and not g.get("serve_refused"), g
        assert "forming" not in g["reason"] and "late" not in g["reason"], g
    for s in range(stripes):  # the publisher sends each stripe once: to one reader
        assert sum(1 for g in grants if g["stripe_sources"][s] == pub) == 1, (s, [g["stripe_sources"] for g in grants])
    assert len({g["partial_replica_id"] for g in grants}) == readers
    assert "GET manifest" not in ahead["calls"]  # the grants carry the checksums (LeaseGrant.sums)
    assert all(g.get("sums") and g["sums"].get("checksums") for g in grants)
    assert base["calls"]["POST leases (new, serving)"] == readers
