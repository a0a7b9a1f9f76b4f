"""benchmarks/simulate.py at a small size: the chunk-map control loop (as implemented) and the
loop before it both run to the end, every reader gets every chunk, and the chunk-map model
makes the coordinator calls the client makes. No timing targets here (those are the
benchmark's printout, docs/operations/benchmarks.md)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from tensorhub._stripes import STRIPES


def _sim():
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "simulate.py"
    spec = importlib.util.spec_from_file_location("simulate", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["simulate"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_chunkmap_model_every_reader_gets_every_chunk_with_a_fixed_number_of_calls():
    S = _sim()
    cl = S.Cluster(nodes=4, nodes_per_zone=2)  # 32 GPUs, 2 zones; the trainer in zone 0
    nbytes = 8 * S.GiB  # 128 chunks of 64 MiB (the grid): long enough for the one refresh (at 100 ms)
    sim = S.MapSim(cl, nbytes, 128, readers=tuple(range(32)), max_sources=4)
    out = sim.run()
    rs = list(sim.mreaders.values())
    assert all(r.done_t is not None and r.have == set(range(128)) for r in rs)
    assert out["seconds"] >= S.lower_bound(cl, nbytes, 1) * 0.999
    # resolve, manifest, lease (+ partial replica), the plan's refresh (the first four of a
    # plan: one more, early), release + register; more only after a stall; <= 6 (issue 13)
    assert all(r.plan is not None for r in rs)  # one complete source (the trainer): everyone has a plan
    assert all(S.FIXED_CALLS + 2 <= r.calls + S.FIXED_CALLS <= min(6, S.FIXED_CALLS + 4) + r.stalls
               for r in rs), [(r.wid, r.calls, r.stalls) for r in rs]
    assert all(r.refreshes <= 2 for r in rs) and sum(r.refreshes == 2 for r in rs) <= STRIPES  # one plan
    assert all(r.refreshes >= 1 for r in rs)  # everyone asked for the fixed layout
    assert sum(r.map_reads for r in rs) > 0  # partial sources are known from their maps only
    # the publisher sent the version once (each stripe to one reader), every byte counted
    assert nbytes <= out["from_trainer_bytes"] <= 1.05 * nbytes


def test_reports_model_still_runs_for_comparison(tmp_path: Path):
    S = _sim()
    cl = S.Cluster(nodes=2)
    out = S.Sim(cl, 1 * S.GiB, 64, readers=tuple(range(16)), max_sources=4).run()
    assert out["seconds"] < float("inf")


def test_validate_compares_the_model_with_a_testbed_run(tmp_path: Path):
    S = _sim()
    meas = {"scenario": "fanout", "mib": 64, "host_rate": "1gbit", "rows": [
        {"readers": 1, "tensorhub": 0.6, "single-source": 0.6, "tensorhub_calls_per_reader": 4.0,
         "tensorhub_from_publisher_x": 1.0},
        {"readers": 2, "tensorhub": 0.8, "single-source": 1.2, "tensorhub_calls_per_reader": 4.0,
         "tensorhub_from_publisher_x": 1.2}]}
    path = tmp_path / "bench_fanout.json"
    path.write_text(json.dumps(meas))
    args = argparse.Namespace(protocol="chunkmap", rtt_us=50.0, testbed_rtt_us=200.0, tick_ms=0.25)
    rows = S.validate(path, args)
    assert [r["readers"] for r in rows] == [1, 2]
    for r, m in zip(rows, meas["rows"]):
        assert abs(r["err_tensorhub"] - (r["model_tensorhub"] / m["tensorhub"] - 1)) < 1e-9
        assert r["model_calls"] >= 3  # manifest, lease, release (the testbed names the version)
    # the link efficiency is taken from the single-source run at N=1: the model matches it there
    assert abs(rows[0]["err_single"]) < 0.05


def test_the_cores_are_leave_one_out_and_slow_the_model_where_they_bind(tmp_path: Path):
    """With the testbed's CPU per round in the file, the model gets the cores as one more link
    every flow shares (the bytes per second they can move), and the floor they set -- both
    computed from the *other* rows, never from the row modelled."""
    S = _sim()
    rows = [{"readers": n, "tensorhub": t, "single-source": 0.6 * n, "tensorhub_reader_cpu_s": c,
             "tensorhub_publisher_cpu_s": 0.1} for n, t, c in ((1, 0.6, 0.2), (2, 0.7, 0.3), (8, 5.0, 1.0))]
    meas = {"scenario": "fanout", "mib": 64, "host_rate": "1gbit", "cores": 2, "rows": rows}
    assert S.cpu_floor(meas, 8) == (8 * 0.3 + 0.1) / 2  # from the N=2 row only (not its own 1.0)
    assert S.cpu_floor(meas, 2) == (2 * 1.0 + 0.1) / 2
    assert S.cpu_floor(meas, 1) == (1 * 0.65 + 0.1) / 2  # (N=1 rows never count: no serving there)
    assert S.cpu_floor(dict(meas, cores=None), 8) is None  # an older file: the network model alone
    path = tmp_path / "bench_fanout.json"
    path.write_text(json.dumps(meas))
    args = argparse.Namespace(protocol="chunkmap", rtt_us=50.0, testbed_rtt_us=200.0, tick_ms=0.25)
    got = {r["readers"]: r for r in S.validate(path, args)}
    # N=2: the cores (one more link every flow shares) bind, about at the floor; N=1: the network
    assert got[2]["model_tensorhub"] > 1.2 * got[2]["model_network"]
    assert got[2]["model_tensorhub"] >= 0.95 * got[2]["cpu_floor"]
    assert got[1]["model_tensorhub"] == got[1]["model_network"]
    assert S.cpu_rate(meas, 8, 64 << 20) == 2 / ((2 * 0.3 + 0.1) / (2 * (64 << 20)))
    assert S.cpu_rate(dict(meas, cores=None), 8, 1.0) == float("inf")
