"""What the netns tests share: the testbed (``benchmarks/testbed.py``), their marks (skipped
with the reason where network namespaces are not available; CI, as root with iproute2 from
scripts/setup.sh, fails instead), and the namespaces that exist (nothing left behind)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import testbed  # noqa: E402  (benchmarks/testbed.py)

_ok, _why = testbed.available()
if not _ok and os.environ.get("CI", "").lower() in ("1", "true", "yes"):
    raise RuntimeError(f"the testbed must run in CI: {_why}")

MARKS = [pytest.mark.multiprocess, pytest.mark.skipif(not _ok, reason=f"testbed unavailable: {_why}")]


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}
