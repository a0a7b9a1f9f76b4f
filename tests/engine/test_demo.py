"""The demo (``examples/demo.py``, what ``scripts/demo.sh`` runs) in a short mode, with real
vLLM CPU engines: its summary, its JSON, its PNG, and that it leaves no process behind,
after a normal run and after a Ctrl-C midway.

Each run marks its processes with an environment variable and the test looks for that mark
in ``/proc/*/environ`` afterwards, so a process that left the demo's process groups or
session still counts.
"""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import subprocess
import sys
import threading
import time
import uuid
import zlib
from pathlib import Path

import pytest

from _engines import require_vllm

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "demo.py"
ENGINES = ("engine-a", "engine-b", "engine-c")


def _marked(mark: str, sid: int) -> list[str]:
    """Live processes (pid and command line) carrying ``mark`` in their environment or in
    session ``sid`` (the demo's: vLLM's engine core and workers retitle themselves, which
    overwrites the environment /proc shows)."""
    needle = f"TENSORHUB_DEMO_TEST={mark}".encode()
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
            state, session = stat[0], int(stat[4])
            if state != "Z" and (session == sid or needle in (d / "environ").read_bytes().split(b"\0")):
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ")[:200]
                found.append(f"{d.name} {cmd!r}")
        except OSError:
            continue
    return found


def _no_leftovers(mark: str, sid: int, timeout: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        left = _marked(mark, sid)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def _kill_marked(mark: str, sid: int) -> None:
    """Last resort after a failed check: SIGKILL what this run started."""
    for entry in _marked(mark, sid):
        try:
            os.kill(int(entry.split()[0]), signal.SIGKILL)
        except ProcessLookupError:
            pass


def _start(out: Path, mark: str) -> subprocess.Popen:
    env = {**os.environ, "TENSORHUB_DEMO_TEST": mark, "GLOG_minloglevel": "2"}
    return subprocess.Popen([sys.executable, str(DEMO), "--versions", "3", "--steps", "5", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True, cwd=str(ROOT))


def _check_png(path: Path) -> None:
    """A well-formed PNG: signature, IHDR with a size, every chunk's CRC, IEND last."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    pos, kinds = 8, []
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert zlib.crc32(kind + body) == crc, f"bad CRC in chunk {kind!r}"
        kinds.append(kind)
        pos += 12 + n
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds
    w, h = struct.unpack(">II", data[16:24])
    assert w > 200 and h > 100


def _model_bytes() -> int:
    """The tiny Llama's size, computed here from its config (not from what the demo says)."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from rl_task import config_dict
    finally:
        sys.path.pop(0)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{k: v for k, v in config_dict().items() if k not in ("architectures", "dtype")})
    return sum(t.numel() * 4 for t in LlamaForCausalLM(cfg).state_dict().values())


def test_demo_short_run(tmp_path):
    require_vllm()
    mark = uuid.uuid4().hex
    out = tmp_path / "out"
    proc = _start(out, mark)
    try:
        stdout, _ = proc.communicate(timeout=540)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
            _kill_marked(mark, proc.pid)
    tail = stdout[-6000:]
    assert proc.returncode == 0, tail
    left = _no_leftovers(mark, proc.pid)
    assert not left, f"processes left behind: {left}"

    # the summary table: a row per engine load and swap, all three engines
    rows = re.findall(r"^v(\d+)\s+(engine-[abc])\s+(start|swap)\s.*\s(yes|NO)$", stdout, re.M)
    for name in ENGINES:
        assert (name, "start") in {(e, k) for _, e, k, _ in rows}, tail
        assert (name, "swap") in {(e, k) for _, e, k, _ in rows}, tail
    assert all(ok == "yes" for *_, ok in rows), tail
    assert "every load and swap verified" in stdout, tail

    data = json.loads((out / "demo.json").read_text())
    size = _model_bytes()
    assert data["model_bytes"] == size
    assert {r["engine"] for r in data["rows"]} == set(ENGINES)
    for r in data["rows"]:
        assert r["nbytes"] == size and sum(r["sources"].values()) == size, r
        assert r["verified"], r
        assert set(r["sources"]) <= {"trainer", *ENGINES}, r
        assert r["logprob_err"] <= 1e-3, r
        if r["version"] > 1:  # the check tells this version from the one before
            assert r["prev_differ"] > 0 or r["prev_off"] > 1e-3, r
    # every engine ends on the last version; the followers saw every version
    last = max(p["version"] for p in data["published"])
    for name in ENGINES:
        assert max(r["version"] for r in data["rows"] if r["engine"] == name) == last
    for name in ENGINES[:2]:
        assert sorted(r["version"] for r in data["rows"] if r["engine"] == name) == \
            sorted(p["version"] for p in data["published"])
    # engine-c started after the others were up, while the job ran
    c_start = next(r for r in data["rows"] if r["engine"] == "engine-c" and r["event"] == "start")
    assert c_start["version"] < last
    _check_png(out / "demo_timeline.png")
    assert (out / "logs" / "engine-c.log").exists()


def test_demo_ctrl_c_midway_leaves_nothing(tmp_path):
    require_vllm()
    mark = uuid.uuid4().hex
    proc = _start(tmp_path / "out", mark)
    lines: list[str] = []
    seen = threading.Event()

    def pump() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "engine-b: starting" in line:
                seen.set()

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    try:
        assert seen.wait(300), "".join(lines)[-4000:]
        # engine-a serving, engine-b's vLLM processes starting up: wait until they are there
        deadline = time.monotonic() + 30
        running = _marked(mark, proc.pid)
        while len(running) < 6 and time.monotonic() < deadline:
            time.sleep(0.2)
            running = _marked(mark, proc.pid)
        assert len(running) >= 6, running  # demo, trainer, two servers, their engine cores
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends to the foreground process
        rc = proc.wait(90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
            _kill_marked(mark, proc.pid)
    t.join(10)
    assert rc == 130, "".join(lines)[-4000:]
    assert "interrupted" in "".join(lines)
    left = _no_leftovers(mark, proc.pid)
    assert not left, f"processes left behind: {left}"
