from __future__ import annotations

import os
from pathlib import Path

import pytest

import tensorhub
from tensorhub.testing import CoordinatorProcess, InMemoryTransport, Worker

# Mooncake's glog chatter goes to stderr of every process; keep test output readable.
os.environ.setdefault("GLOG_minloglevel", "2")
os.environ.setdefault("TENSORHUB_HEARTBEAT_INTERVAL", "0.5")

# Test files that build network namespaces: they list the host's namespaces to check that
# nothing is left behind, so they run one after another on one worker.
_NETNS_FILES = {"test_bench_fetch_remote.py", "test_control_plane_faults.py", "test_examples.py",
                "test_reliability.py", "test_testbed.py"}


def pytest_xdist_make_scheduler(config, log):
    """scripts/test.sh runs the suite on pytest-xdist workers with ``--dist loadfile``: a test
    file runs on one worker (its module fixtures, engines among them, start once), and the
    network-namespace files run one after another on one worker."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ByFile(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "netns" if Path(path).name in _NETNS_FILES else path

    return ByFile(config, log)


@pytest.fixture
def coordinator(tmp_path):
    c = CoordinatorProcess(tmp_path / "state")
    c.start()
    yield c
    c.stop()


@pytest.fixture
def coordinator_with(tmp_path):
    """Start real coordinator processes with extra command-line arguments
    (``coordinator_with("--lease-ttl", "3")``); all stopped afterwards."""
    made = []

    def start(*extra: str) -> CoordinatorProcess:
        c = CoordinatorProcess(tmp_path / f"state{len(made) or ''}", extra=extra)
        c.start()
        made.append(c)
        return c

    yield start
    for c in made:
        c.stop()


@pytest.fixture
def embedded(tmp_path):
    """An in-process coordinator (real HTTP on loopback) for fast client tests."""
    from tensorhub.server.state import StateConfig
    from tensorhub.coordinator import EmbeddedCoordinator

    with EmbeddedCoordinator(tmp_path / "state", config=StateConfig(lease_ttl=5.0, worker_ttl=3.0)) as c:
        yield c


@pytest.fixture
def connect(embedded):
    """Make Hubs on the embedded coordinator (in-memory transport unless given); all closed afterwards."""
    made = []

    def make(name: str, transport=None, **kw):
        h = tensorhub.connect(embedded.url, worker_id=name, transport=transport or InMemoryTransport(),
                              heartbeat_interval=0.2, **kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


@pytest.fixture
def workers():
    """Make scriptable worker processes (real Hub, real Mooncake); all closed afterwards."""
    made: list[Worker] = []

    def make(url: str, name: str, **kw) -> Worker:
        w = Worker(url, name, **kw)
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()
