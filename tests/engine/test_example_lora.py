"""The LoRA RL-loop example (``examples/rl_loop_lora.py``) as a user runs it, small: two real
vLLM CPU engines, three adapter versions, ``tensorhub follow --lora 2``. It exits 0, every
rollout is recorded with the adapter version it was stamped with (the one asked for) and the
base version, and v1 is unloaded (a request naming it gets 404) once v3 is loaded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from _engines import engine_env, require_vllm

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]


def test_rl_loop_lora_example_stamps_every_rollout_and_keeps_the_newest_k(tmp_path):
    require_vllm()
    out = tmp_path / "rollouts.jsonl"
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "rl_loop_lora.py"), "--steps", "3", "--keep", "2",
                        "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env=engine_env())
    assert r.returncode == 0, f"exited {r.returncode}\n{r.stdout[-6000:]}\n{r.stderr[-4000:]}"
    assert "v3: published" in r.stdout and "v1 unloaded (404)" in r.stdout, r.stdout
    assert "every stamp as expected" in r.stdout, r.stdout
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(recs) == 3 * 2 * 24  # steps x engines x prompts
    for rec in recs:
        assert rec["version"] == rec["asked"] == rec["step"] and rec["model"] == f"policy-lora@v{rec['step']}", rec
        assert rec["base_version"] == 1, rec
    assert {rec["engine"] for rec in recs} == {"engine-0", "engine-1"}
