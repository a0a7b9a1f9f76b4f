"""benchmarks/simulate.py at a small size: the chunk-map control loop (as implemented) and the
loop before it both run to the end, every reader gets every chunk, and the chunk-map model
makes the coordinator calls the client makes -- each one through the coordinator's queue, at
its measured service time (issue 31: the model credits only what the code does). No timing
targets here (those are the benchmark's printout, docs/operations/benchmarks.md)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tensorhub.server.stripes import STRIPES, WINDOW

ROOT = Path(__file__).resolve().parent.parent


def _sim():
    path = ROOT / "benchmarks" / "simulate.py"
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
    # 32 leases served well inside the forming window: all members, none late
    assert (out["plan_members"], out["plan_late"], out["no_plan"]) == (32, 0, 0)
    # every call went through the one coordinator: resolve, manifest, lease, refreshes, release
    served = out["coord_served"]
    assert served["resolve"] == served["manifest"] == served["lease"] == served["release"] == 32
    assert served["refresh"] == sum(r.refreshes + r.stalls for r in rs)


def test_the_coordinator_is_one_queue_first_come_first_served():
    S = _sim()
    co = S.Coordinator({"lease": 1.0, "resolve": 0.5})
    co.ask(0.0, "lease", "a")
    co.ask(0.0, "lease", "b")
    co.ask(0.0005, "resolve", "c")  # came later: waits for both leases
    got = [co.pop() for _ in range(3)]
    assert [(round(t, 6), k, w) for t, k, w in got] == [(0.001, "lease", "a"), (0.002, "lease", "b"),
                                                        (0.0025, "resolve", "c")]
    assert abs(co.waited - 0.0015) < 1e-12 and abs(co.busy - 0.0025) < 1e-12
    co.ask(1.0, "lease", "d")  # an idle server answers at once
    assert co.next_end() == pytest.approx(1.001)
    # the defaults are bench_routes' figures, and --coord-costs / --coord-scale change them
    assert S.COORD_MS["lease"] > S.COORD_MS["refresh"] > 0 and S.COORD_MS["release"] > 0
    args = argparse.Namespace(coord_costs="lease=2.5,refresh=1", coord_scale=2.0)
    c = S.coordinator(args).cost
    assert c["lease"] == pytest.approx(0.005) and c["refresh"] == pytest.approx(0.002)
    assert c["resolve"] == pytest.approx(2 * S.COORD_MS["resolve"] / 1e3)


def _standalone(S, scale: float, samehost: str = "none", nodes: int = 8, gib: float = 4.0):
    cl = S.Cluster(nodes=nodes, samehost=samehost)
    nbytes = gib * S.GiB
    chunks = -(-int(nbytes) // S.grid_chunk_bytes(int(nbytes)))
    sim = S.MapSim(cl, nbytes, chunks, readers=tuple(range(nodes * 8)), max_sources=4,
                   coord=S.Coordinator(scale=scale))
    out = sim.run()
    assert all(r.have == set(range(chunks)) for r in sim.mreaders.values())
    return out, S.lower_bound(cl, nbytes, 1)


def test_a_slow_coordinator_lets_fewer_readers_into_the_plan_and_the_ratio_gets_worse():
    """A reader joins the plan only if its lease is *served* inside the forming window
    (``server.grants._planned`` / ``Plan.join``); later ones are leaves in every stripe."""
    S = _sim()
    fast, bound = _standalone(S, 0.0)  # the old model's free coordinator
    real, _ = _standalone(S, 1.0)
    slow, _ = _standalone(S, 8.0)
    assert fast["plan_members"] == 64 and fast["plan_late"] == 0
    assert slow["plan_members"] < real["plan_members"] <= 64
    assert slow["plan_late"] > 0 and slow["plan_members"] + slow["plan_late"] + slow["no_plan"] == 64
    # the window: leases answered after the first one + WINDOW are late
    assert slow["last_lease_s"] - slow["first_lease_s"] > WINDOW
    assert fast["seconds"] < real["seconds"] < slow["seconds"]
    assert slow["seconds"] / bound > 1.2 * fast["seconds"] / bound
    assert slow["coord_busy_s"] > real["coord_busy_s"] > 0 == fast["coord_busy_s"]


def test_same_host_reads_cost_nic_bandwidth_by_default():
    S = _sim()
    # two GPUs of one node: by default through Mooncake, the source's NIC up and the reader's down
    def links(sim, src, dst):
        path = sim._path(src, dst)
        keys = {v: k for k, v in sim._res.items()}
        return tuple(keys[i][0] for i in path)

    for path, want in ((None, ("up", "dn")), ("none", ("up", "dn")), ("nvlink", ("nvup", "nvdn"))):
        cl = S.Cluster(nodes=2) if path is None else S.Cluster(nodes=2, samehost=path)  # (None: the default)
        sim = S.MapSim(cl, 1 * S.GiB, 16, readers=tuple(range(16)))
        assert links(sim, 1, 2) == want
        assert links(sim, 1, 9) == ("up", "dn")  # another node: the NIC always
    # memfd (transport/_shm): complete replicas in Hub memory only; a partial one over the NIC
    sim = S.MapSim(S.Cluster(nodes=2, samehost="memfd"), 1 * S.GiB, 16, readers=tuple(range(1, 16)), holders=(0,))
    assert links(sim, 0, 2) == ("memup", "memcp")
    assert links(sim, 1, 2) == ("up", "dn")
    # and it shows: over the NIC the host's leaves share their parents' uplinks
    nic, bound = _standalone(S, 0.0, "none", nodes=4)
    nv, _ = _standalone(S, 0.0, "nvlink", nodes=4)
    assert nv["seconds"] < nic["seconds"]


def test_map_reads_wait_behind_the_data_in_flight_from_that_source():
    S = _sim()
    cl = S.Cluster(nodes=2)
    sim = S.MapSim(cl, 1 * S.GiB, 16, readers=tuple(range(16)), queue_s=0.05)
    r = sim.mreaders[3]
    assert sim._map_wait(r, 5) == 0.0  # nothing in flight
    sim._add_flow(r, 5, 0)
    sim._add_flow(sim.mreaders[4], 5, 1)
    sim._merge_new()
    sim.f_rate = sim._flow_rates()
    eta = sim.chunk / sim.f_rate[0]
    own = sim._map_wait(r, 5)  # behind its own read (in order) and the uplink's queue, capped at 50 ms
    assert own >= eta * 0.999
    assert own == pytest.approx(max(eta, min(2 * sim.chunk, 0.05 * cl.nic) / cl.nic))
    sim.queue_s = 0.0
    assert sim._map_wait(r, 5) == pytest.approx(eta)
    assert sim._map_wait(sim.mreaders[6], 5) == 0.0  # another reader, no shaped queue: no wait


def test_reports_model_still_runs_for_comparison(tmp_path: Path):
    S = _sim()
    cl = S.Cluster(nodes=2)
    out = S.Sim(cl, 1 * S.GiB, 64, readers=tuple(range(16)), max_sources=4).run()
    assert out["seconds"] < float("inf")


def test_validate_compares_the_model_with_a_testbed_run(tmp_path: Path):
    S = _sim()
    meas = {"scenario": "fanout", "mib": 64, "host_rate": "200mbit", "rows": [
        {"readers": 1, "tensorhub": 3.0, "single-source": 2.9, "tensorhub_calls_per_reader": 4.0,
         "tensorhub_from_publisher_x": 1.0, "tensorhub_cpu_busy": 0.05},
        {"readers": 2, "tensorhub": 3.2, "single-source": 5.8, "tensorhub_calls_per_reader": 4.0,
         "tensorhub_from_publisher_x": 1.2, "tensorhub_cpu_busy": 0.08}]}
    path = tmp_path / "bench_fanout.json"
    path.write_text(json.dumps(meas))
    args = argparse.Namespace(protocol="chunkmap", rtt_us=50.0, testbed_rtt_us=200.0, tick_ms=0.25)
    rows = S.validate(path, args)
    assert [r["readers"] for r in rows] == [1, 2]
    for r, m in zip(rows, meas["rows"]):
        assert abs(r["err_tensorhub"] - (r["model_tensorhub"] / m["tensorhub"] - 1)) < 1e-9
        assert r["model_calls"] >= 3  # manifest, lease, release (the testbed names the version)
        assert r["cpu_busy"] == m["tensorhub_cpu_busy"]  # printed beside each row
    # the link efficiency is taken from the single-source run at N=1: the model matches it there
    assert abs(rows[0]["err_single"]) < 0.05
    assert S.tc_rate("200mbit") == 2e8 and S.tc_rate("1gbit") == 1e9
    assert S.TESTBED_RATE == "200mbit"


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


def test_kimi_scenario_prints_beside_the_published_figures(tmp_path: Path):
    """The sliced read as the code does it: every GPU reads every rank's slice from its holder
    (one lease, one release per slice), printed beside vLLM's and checkpoint-engine's figures."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "simulate.py"), "--only", "kimi", "--kimi-tb", "0.02",
         "--kimi-ranks", "16", "--kimi-gpus", "8", "--jobs", "1", "--json", str(tmp_path / "sim.json")],
        capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "Kimi-K2-class" in text and "16 independent sources each holding 1/16 of the bytes" in text
    assert "7.53 s on 48 nodes x 8 H100" in text and "~16 s" in text and "bound" in text
    k = json.loads((tmp_path / "sim.json").read_text())["kimi"]
    assert k["tensorhub"] >= k["bound_whole"] > k["bound_own_share"]
    # per GPU: resolve, the refused hf lease, a manifest + lease + release per slice, the assembled copy
    assert k["calls_per_gpu"] >= 2 + 3 * 16 + 1


@pytest.mark.parametrize("deliver", ["batch", "stream"])
def test_subscribed_ahead_every_reader_is_a_member_of_a_plan_fixed_at_the_publish(deliver):
    """Subscribe ahead (tensorhub/server/ahead.py, the default of the benchmark): every lease is held
    before the publish and bound in the publish's call (COORD_MS['bind'] each, back to back),
    the plan's layout fixed with every reader in it (Plan.fix: none late, no refresh); then
    each grant is made and answered in turn (stream, the code) or every grant first (batch);
    then each reader reads at once (its grant carries the checksums: no manifest GET) and
    releases+registers: 2 calls."""
    S = _sim()
    cl = S.Cluster(nodes=4, nodes_per_zone=2)
    nbytes = 8 * S.GiB
    sim = S.MapSim(cl, nbytes, 128, readers=tuple(range(32)), max_sources=4, ahead=True, deliver=deliver)
    out = sim.run()
    rs = list(sim.mreaders.values())
    assert all(r.have == set(range(128)) for r in rs)
    assert (out["plan_members"], out["plan_late"], out["no_plan"]) == (32, 0, 0)
    assert all(r.refreshes == 0 and r.stalls == 0 and r.plan_refresh == 0 for r in rs)
    assert out["calls_max"] == 2 and out["calls_mean"] == 2
    served = out["coord_served"]
    assert served["bind"] == served["release"] == 32 and "lease" not in served and "manifest" not in served
    assert nbytes <= out["from_trainer_bytes"] <= 1.05 * nbytes
    bind, grant, wake = S.COORD_MS["bind"] / 1e3, S.COORD_MS["grant"] / 1e3, S.COORD_MS["wake"] / 1e3
    fixed = S.COORD_MS["bind_fixed"] / 1e3  # the bind's part once per publish (shape digest etc.: warmed)
    plan = next(iter(sim.plans.values()))
    assert sim.bind_order == [int(w) for w in plan.members]  # answered in plan order
    first = sim.mreaders[sim.bind_order[0]].start_t
    if deliver == "batch":  # the code before: every grant made, then the wake-ups
        assert first == pytest.approx(fixed + 32 * (bind + grant) + wake, rel=1e-6)
        assert out["last_lease_s"] == pytest.approx(fixed + 32 * (bind + grant + wake), rel=1e-6)
    else:  # the code: the whole bind, then each grant and its answer in turn (nothing else queued here)
        assert first == pytest.approx(fixed + 32 * bind + grant + wake, rel=1e-6)
        assert out["last_lease_s"] == pytest.approx(fixed + 32 * (bind + grant + wake), rel=1e-6)
    # the publisher's registration (the call that completes the version) comes first when charged
    for how in ("publish_like", "publish_manifest"):
        pub = S.MapSim(cl, nbytes, 128, readers=tuple(range(32)), max_sources=4, ahead=True, deliver=deliver,
                       publish=how)
        got = pub.run()
        assert got["coord_served"][how] == 1
        # (later by the registration, and by a heartbeat or two the longer window lets in)
        late = got["last_lease_s"] - out["last_lease_s"] - S.COORD_MS[how] / 1e3
        assert -1e-9 <= late <= 3 * S.COORD_MS["report"] / 1e3, late
        assert got["seconds"] > out["seconds"]
    assert all(r.read_t == r.start_t for r in rs)  # each reads once its answer came (no manifest GET)
    # asked after the publish, the same readers take longer (the leases queue, a forming window)
    after = S.MapSim(cl, nbytes, 128, readers=tuple(range(32)), max_sources=4).run()
    assert out["seconds"] < after["seconds"]


def test_subscribed_ahead_across_datacenters_the_others_get_the_usual_grant():
    """Readers whose datacenter has no complete replica are not put into a home plan up
    front (``Grants.join_ahead``): they get the usual grant right after, in the same bind."""
    S = _sim()
    cl = S.Cluster(nodes=4, nodes_per_zone=2, dcs=2)
    sim = S.MapSim(cl, 8 * S.GiB, 128, readers=tuple(range(32)), max_sources=4, ahead=True)
    out = sim.run()
    rs = list(sim.mreaders.values())
    assert all(r.have == set(range(128)) for r in rs)
    home = [r.wid for r in rs if r.loc.datacenter == "dc0"]
    assert sim.bind_order[:len(home)] != [] and set(sim.bind_order[:len(home)]) == set(home)
    assert out["coord_served"]["bind"] == 32
