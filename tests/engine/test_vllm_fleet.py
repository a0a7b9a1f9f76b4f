"""A fleet switch with real vLLM CPU engines: two OpenAI servers, each followed by its own
``tensorhub follow --group rl --group-switch caller`` process, and a trainer that switches
the group at its step boundary with ``Hub.fleet_switch``. Both engines apply together;
an engine that cannot prefetch in time (its processes stopped: SIGSTOP) leaves the group
for that version while the other applies, then catches up alone and is back in."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import httpx
import pytest

from _engines import Coordinator, ServerEngine, engine_env, require_vllm
from _tiny import PROMPTS, make_model_dir, make_weights

pytestmark = pytest.mark.engine


def _signal_tree(pid: int, sig: int) -> None:
    """``sig`` to a vLLM server and every process it started (engine core, workers)."""
    import psutil

    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in tree:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def _version(srv: ServerEngine) -> str:
    return str(httpx.get(f"{srv.url}/weight_info", timeout=30).json().get("weight_version"))


def _wait(cond, timeout: float, what: str, tail=lambda: "") -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"{what} within {timeout}s\n{tail()}"
        time.sleep(0.3)


def test_a_group_switches_together_and_a_late_engine_leaves_then_catches_up(tmp_path):
    require_vllm()
    import tensorhub

    coord = Coordinator(tmp_path / "state")
    trainer = tensorhub.connect(coord.url, worker_id="trainer")
    servers: list = []
    follows: list = []
    try:
        v1 = trainer.publish("policy", make_weights(0))
        bare = make_model_dir(tmp_path / "bare", weights=False)
        for name in ("a", "b"):  # both start at once (the machine's two cores share the imports)
            servers.append(ServerEngine(tmp_path / f"{name}.log", bare, [
                "--load-format", "tensorhub",
                "--model-loader-extra-config", json.dumps({"model": "policy", "worker_id": f"engine-{name}"}),
                "--weight-transfer-config", json.dumps({"backend": "tensorhub"})],
                env={"TENSORHUB_COORDINATOR": coord.url}, wait=False))
        for s in servers:
            s.wait_ready()
        a, b = servers
        before = a.generate(PROMPTS)
        assert b.generate(PROMPTS) == before and _version(a) == _version(b) == str(v1)
        for s in servers:
            follows.append(subprocess.Popen(
                [sys.executable, "-m", "tensorhub", "follow", "--engine", s.url, "--model", "policy",
                 "--coordinator", coord.url, "--group", "rl", "--group-switch", "caller", "--group-wait", "30",
                 "--prefetch-wait", "180", "--max-swaps", "2"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=engine_env()))

        def members() -> dict:
            try:
                view = trainer.fleet("rl")
            except tensorhub.TensorHubError:
                return {}
            return {m["engine"]: (m["version"], m["in_group"], m["why_out"]) for m in view["members"]}

        def followers() -> str:
            """What a follow process that already ended said (a running one is left alone)."""
            return "\n".join(f"follow {i}: exit {f.returncode}: {f.communicate()[1][-3000:]}"
                             for i, f in enumerate(follows) if f.poll() is not None) or "both still running"

        # (each follow process imports torch first: on a loaded 2-core machine that takes a while)
        _wait(lambda: len(members()) == 2, 180, "both follow processes joined the group", followers)
        assert members() == {a.url: (v1, True, ""), b.url: (v1, True, "")}

        # step boundary 1: both prefetch v2, then both apply; when fleet_switch returns both serve v2
        v2 = trainer.publish("policy", make_weights(1))
        r = trainer.fleet_switch("rl", "policy", v2, timeout=300)
        assert r["state"] == "done" and len(r["applied"]) == 2 and r["left"] == [] and r["failed"] == {}, r
        assert _version(a) == _version(b) == str(v2)
        after = a.generate(PROMPTS)
        assert after != before and b.generate(PROMPTS) == after
        view = trainer.fleet("rl")
        assert view["version"] == v2 and not view["mixed"] and view["left_total"] == 0

        # step boundary 2: engine b cannot prefetch (its processes are stopped); the round's
        # deadline passes, a applies alone, b leaves the group for v3 -- the group is never mixed
        _signal_tree(b.proc.pid, signal.SIGSTOP)
        try:
            v3 = trainer.publish("policy", make_weights(2))
            r = trainer.fleet_switch("rl", "policy", v3, wait=8, timeout=300)
        finally:
            _signal_tree(b.proc.pid, signal.SIGCONT)
        b_member = next(m["member"] for m in trainer.fleet("rl")["members"] if m["engine"] == b.url)
        assert r["left"] == [b_member] and len(r["applied"]) == 1 and b_member not in r["go"], r
        assert _version(a) == str(v3)
        view = trainer.fleet("rl")
        assert view["version"] == v3 and not view["mixed"] and view["left_total"] == 1
        assert members()[b.url][:2] == (v2, False) and "not ready for v" in members()[b.url][2]
        metrics = httpx.get(f"{coord.url}/metrics").text
        assert 'tensorhub_fleet_left{group="rl"} 1.0' in metrics and 'tensorhub_fleet_mixed{group="rl"} 0.0' in metrics

        # b catches up alone once it runs again, and is back in the group on v3
        _wait(lambda: members().get(b.url, (None,))[:2] == (v3, True), 240, "b back in the group on v3",
              lambda: b.log_tail())
        assert _version(b) == str(v3) and b.generate(PROMPTS) == a.generate(PROMPTS) != after
        outs = [f.communicate(timeout=120) for f in follows]
        assert all(f.returncode == 0 for f in follows), outs
        a_out, b_out = outs
        assert "fleet group rl: member" in a_out[1] and "in the group" in a_out[1]
        assert "fleet group rl: 2 apply together" in a_out[0], a_out  # v2's line
        assert f"fleet group rl: 1 apply together" in a_out[0] and f"left: {b_member}" in a_out[0], a_out  # v3's
        assert f"v{v3}: left fleet group rl for v{v3} (not ready by the round's deadline)" in b_out[1], b_out
        assert f"v{v3}: stall" in b_out[0] and "alone, out of fleet group rl" in b_out[0], b_out
    finally:
        for f in follows:
            if f.poll() is None:
                f.kill()
        for s in servers:
            _signal_tree(s.proc.pid, signal.SIGCONT)
            s.close()
        trainer.close()
        coord.stop()
