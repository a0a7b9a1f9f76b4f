"""scripts/gpu_check.sh in CPU mode: the GPU check's every step but the device calls.

The script (benchmarks/gpu_check.py) runs a real coordinator and worker processes over
Mooncake TCP, a raw Mooncake read, the engine-native layout's start / swap / drain rule, the
baselines and, when
gpu_wheels/ exists, the offline resolution of the carried wheels. Here it must say that
there is no GPU, pass, and write figures whose bytes were verified; a failing step must exit
non-zero with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"

if torch.cuda.is_available():  # pragma: no cover - the device runs the script itself
    pytest.skip("a GPU is here: run scripts/gpu_check.sh (GPU mode) instead", allow_module_level=True)


def _run(out: Path, *args: str, pytest_step: bool, timeout: float = 150) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(out), GLOG_minloglevel="2",
               GPU_CHECK_PYTEST="1" if pytest_step else "0", GPU_CHECK_WORK=str(out / "work"))
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_cpu_mode_runs_every_cpu_possible_step_and_verifies_the_bytes(tmp_path):
    # Its last step, pytest -m gpu, is left out here (the suite runs those tests itself).
    r = _run(tmp_path, pytest_step=False)
    tail = (r.stdout + r.stderr)[-4000:]
    assert r.returncode == 0, f"the GPU check failed in CPU mode:\n{tail}"
    assert "no CUDA GPU here" in r.stdout and "CPU mode" in r.stdout

    rep = json.loads((tmp_path / "gpu_check.json").read_text())
    assert rep["mode"] == "cpu" and rep["ok"] is True and "error" not in rep
    flows = {f["protocol"]: f for f in rep["flows"]}
    assert flows["nvlink_intra"]["status"] == "skipped" and "no GPU" in flows["nvlink_intra"]["reason"]
    tcp = flows["tcp"]
    assert tcp["status"] == "ok" and tcp["bytes_verified"] is True
    paths = {p["dest"] + ("-striped" if p["path"].startswith("C") else ""): p for p in tcp["paths"]}
    assert set(paths) == {"prealloc", "host", "fresh", "fresh-striped"}
    for p in tcp["paths"]:
        assert p["bytes_verified"] is True and p["differing"] == []
        assert p["nbytes"] == tcp["nbytes"] > 0 and p["gbps"] > 0 and p["wall_gbps"] > 0
    striped = paths["fresh-striped"]["sources"]
    assert set(striped) == {"holder-a", "holder-b"} and min(striped.values()) > 0  # read from both holders

    raw = {r["protocol"]: r for r in rep["raw"]}
    assert set(raw) == {"tcp"} and raw["tcp"]["bytes_verified"] is True and raw["tcp"]["gbps"] > 0

    nat = rep["native"]
    assert nat["status"] == "ok" and nat["layout"].startswith("vllm-") and nat["bytes_verified"] is True
    assert nat["raw_start"]["sources"] == {"engine-1": nat["nbytes"]} and nat["raw_start"]["gbps"] > 0
    assert nat["raw_swap"]["bytes_verified"] and nat["swap"]["in_place"] and nat["swap"]["bytes_verified"]
    drain = nat["drain"]
    assert drain["lease_valid"] and drain["unchanged_while_draining"]
    assert drain["swap_waited_s"] >= 0.9 * drain["lease_held_s"] > 1.0  # the swap waited for the lease
    assert drain["first_write_after_release_s"] >= 0

    assert rep["baselines"] and all(b["gbps"] > 0 for b in rep["baselines"])
    if (ROOT / "gpu_wheels").is_dir():  # made by scripts/fetch_gpu_wheels.sh
        assert rep["wheels"]["ok"] is True and set(rep["wheels"]["versions"]) == {"3.10", "3.11", "3.12", "3.13"}
    else:
        assert rep["wheels"]["checked"] is False and "fetch_gpu_wheels" in rep["wheels"]["reason"]

    text = (tmp_path / "gpu_check.txt").read_text()
    assert text.count("verified") == 7 and "torch host memcpy" in text and text.rstrip().endswith("OK")
    assert "pytest -m gpu not run" in (tmp_path / "pytest_gpu.txt").read_text()


def test_a_failing_step_exits_nonzero_with_the_reason(tmp_path):
    empty = tmp_path / "wheels"
    empty.mkdir()  # a carried folder that holds nothing
    r = _run(tmp_path / "out", "--wheels", str(empty), pytest_step=False, timeout=90)
    assert r.returncode != 0
    assert "GPU CHECK FAILED" in r.stderr and "does not hold everything for Python 3.10" in r.stderr
    rep = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert rep["ok"] is False and "gpu_wheels/ does not hold everything" in rep["error"]


@pytest.mark.skipif(not (ROOT / "gpu_wheels").is_dir(), reason="gpu_wheels/ absent (scripts/fetch_gpu_wheels.sh)")
def test_the_install_step_installs_everything_from_the_carried_wheels(tmp_path):
    """What the device runs first (pip, offline, into a private folder), here without a GPU:
    every dependency and Mooncake's CUDA build must then import from that folder."""
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path / "out"), GPU_CHECK_WORK=str(tmp_path / "work"),
               GPU_CHECK_INSTALL_ONLY="1")
    r = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert f"installed from gpu_wheels/ into {tmp_path / 'work' / 'site'}" in r.stdout
    site = tmp_path / "work" / "site"
    assert (site / "mooncake" / "engine.so").is_file() and (site / "mooncake" / "libetcd_wrapper.so").is_file()
    assert sorted(site.glob("mooncake_transfer_engine_cuda13-*.dist-info"))
