"""The SGLang seed's access and lease rules, against a real coordinator and a real Hub.

A trainer process (real Hub, real Mooncake) publishes the ``hf`` layout and the seed
serves it (``layout="hf"``), so these run without SGLang; SGLang's own client (its
``remote_instance_weight_loader_utils`` module, loaded from the installed wheel) is used
where it matters what an unmodified SGLang reader can send. Every lease is checked in the
coordinator's ``/v1/status``.
"""

from __future__ import annotations

import base64
import importlib.util
import os
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.multiprocess

INFO = "/get_remote_instance_transfer_engine_info"
TOKEN = "s3cret-seed-token"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def coordinator(tmp_path):
    """Start an embedded coordinator (``token``, ``lease_ttl``) and return its URL; stopped afterwards."""
    from tensorhub.server.state import StateConfig
    from tensorhub.coordinator import EmbeddedCoordinator

    made = []

    def make(token=None, lease_ttl=5.0):
        c = EmbeddedCoordinator(tmp_path / f"state{len(made)}", token=token,
                                config=StateConfig(lease_ttl=lease_ttl, worker_ttl=3.0))
        made.append(c)
        return c.start()

    yield make
    for c in made:
        c.stop()


def _status(url: str, token=None) -> dict:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    r = httpx.get(f"{url}/v1/status", headers=headers)
    r.raise_for_status()
    return r.json()


def _leases(url: str, token=None) -> list[dict]:
    return _status(url, token)["leases"]


def _endpoints(url: str, token=None) -> set[str]:
    return {w["endpoint"] for w in _status(url, token)["workers"]}


def _until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.1)


def _basic(user: str, password: str) -> dict:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def _non_loopback_address():
    """This machine's address on its default route, or None."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.255", 9))  # no packet is sent: only picks the route
        addr = s.getsockname()[0]
    except OSError:
        return None
    finally:
        s.close()
    return None if addr.startswith("127.") else addr


def test_cli_binds_loopback_by_default_and_says_no_token_guards_it(coordinator, workers):
    url = coordinator()
    workers(url, "trainer").call("publish", seed=1, nbytes=1 << 16)
    env = {**os.environ, "GLOG_minloglevel": "2"}
    env.pop("TENSORHUB_TOKEN", None)
    p = subprocess.Popen([sys.executable, "-m", "tensorhub.integrations.sglang.seed", "--coordinator", url,
                          "--model", "policy", "--layout", "hf"], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([p.stdout], [], [], 60)
        line = p.stdout.readline() if ready else ""
        assert line.startswith("tensorhub seed for SGLang serving on http://127.0.0.1:"), \
            line + p.stderr.read() if p.poll() is not None else line
        assert line.rstrip().endswith("(no token)"), line
        seed_url = line.split(" on ")[1].split()[0]
        assert httpx.get(f"{seed_url}{INFO}", params={"rank": 0}).status_code == 200
        addr = _non_loopback_address()
        if addr is not None:  # nothing listens on the machine's other addresses
            port = seed_url.rsplit(":", 1)[1]
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"http://{addr}:{port}/health", timeout=5)
    finally:
        p.terminate()
        p.wait(timeout=30)
        p.stdout.close()
        p.stderr.close()


def test_seed_refuses_readers_without_the_coordinators_token(coordinator, workers, monkeypatch):
    from tensorhub.integrations.sglang.seed import SeedServer

    url = coordinator(token=TOKEN)
    workers(url, "trainer", token=TOKEN).call("publish", seed=1, nbytes=1 << 16)
    with SeedServer(url, "policy", layout="hf", token=TOKEN) as seed:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {TOKEN}x"},
                        _basic("tensorhub", "wrong"), {"Authorization": "Basic !!not-base64"},
                        {"Authorization": TOKEN}):
            r = httpx.get(f"{seed.url}{INFO}", params={"rank": 0}, headers=headers)
            assert r.status_code == 401, (headers, r.text)
            assert "missing or wrong token" in r.json()["error"]["message"]
            assert "Bearer" in r.headers["www-authenticate"]
        r = httpx.post(f"{seed.url}/send_weights_to_remote_instance", json={})
        assert r.status_code == 401
        assert _leases(url, TOKEN) == []  # a refused ask opens no lease
        assert httpx.get(f"{seed.url}/health").status_code == 200  # liveness needs no token
        # ... and the seed keeps serving those who have it, as a Bearer token or a Basic password.
        r = httpx.get(f"{seed.url}{INFO}", params={"rank": 0}, headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200, r.text
        session, weights = r.json()["remote_instance_transfer_engine_info"]
        assert session in _endpoints(url, TOKEN) and weights
        r = httpx.get(f"{seed.url}{INFO}", params={"rank": 0}, headers=_basic("anyone", TOKEN))
        assert r.status_code == 200 and r.json()["remote_instance_transfer_engine_info"][0] == session
    # Without token=..., the seed takes $TENSORHUB_TOKEN, for the coordinator and for its readers.
    monkeypatch.setenv("TENSORHUB_TOKEN", TOKEN)
    with SeedServer(url, "policy", layout="hf") as seed:
        assert httpx.get(f"{seed.url}{INFO}", params={"rank": 0}).status_code == 401
        r = httpx.get(f"{seed.url}{INFO}", params={"rank": 0}, headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200, r.text


@pytest.mark.engine
def test_sglang_client_sends_the_token_from_netrc(coordinator, workers, tmp_path, monkeypatch):
    from _sglang_procs import require_sglang

    require_sglang()
    from tensorhub.integrations.sglang.seed import SeedServer

    # SGLang's own client function, from the installed wheel (the module imports only requests).
    spec = importlib.util.find_spec("sglang")
    path = Path(spec.origin).parent / "srt" / "model_loader" / "remote_instance_weight_loader_utils.py"
    mod_spec = importlib.util.spec_from_file_location("_sglang_remote_instance_utils", path)
    sgl = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(sgl)

    url = coordinator(token=TOKEN)
    workers(url, "trainer", token=TOKEN).call("publish", seed=1, nbytes=1 << 16)
    with SeedServer(url, "policy", layout="hf", token=TOKEN) as seed:
        other = tmp_path / "netrc-other"
        other.write_text("machine elsewhere.example login tensorhub password nope\n")
        monkeypatch.setenv("NETRC", str(other))
        assert list(sgl.get_remote_instance_transfer_engine_info_per_rank(seed.url, 0)) == [None, None]
        good = tmp_path / "netrc"
        good.write_text(f"machine 127.0.0.1 login tensorhub password {TOKEN}\n")
        good.chmod(0o600)
        monkeypatch.setenv("NETRC", str(good))
        session, weights = sgl.get_remote_instance_transfer_engine_info_per_rank(seed.url, 0)
        assert session in _endpoints(url, TOKEN) and weights


def test_a_reader_asking_again_renews_its_one_lease(coordinator, workers):
    from tensorhub.integrations.sglang.seed import SeedServer

    url = coordinator(lease_ttl=2.5)  # shorter than the seed's lease: the seed must renew
    workers(url, "trainer").call("publish", seed=1, nbytes=1 << 16)
    b = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"))  # another reader
    c = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.3"))  # a third one
    with SeedServer(url, "policy", layout="hf", lease_seconds=4.0, max_leases=2) as seed:
        t0 = time.monotonic()
        first = httpx.get(f"{seed.url}{INFO}", params={"rank": 0})
        again = httpx.get(f"{seed.url}{INFO}", params={"rank": 0})
        assert first.status_code == again.status_code == 200
        assert again.json() == first.json()  # the same replica, the same addresses
        (lease,) = _leases(url)  # ... under one lease, not two
        assert lease["worker_id"] == seed.hub.worker_id
        # Another reader gets its own lease; a third finds the table full and is told so.
        assert b.get(f"{seed.url}{INFO}", params={"rank": 0}).status_code == 200
        assert len(_leases(url)) == 2
        r = c.get(f"{seed.url}{INFO}", params={"rank": 0})
        assert r.status_code == 503 and "max_leases 2" in r.json()["error"]["message"]
        assert len(_leases(url)) == 2
        # Past the coordinator's TTL the seed still holds both (renewed), and the first
        # reader asking again renews its lease once more.
        time.sleep(max(0.0, t0 + 3.0 - time.monotonic()))
        assert lease["lease_id"] in {x["lease_id"] for x in _leases(url)} and len(_leases(url)) == 2
        t_again = time.monotonic()
        assert httpx.get(f"{seed.url}{INFO}", params={"rank": 0}).json() == first.json()
        assert lease["lease_id"] in {x["lease_id"] for x in _leases(url)} and len(_leases(url)) == 2
        # The second reader's lease is released 4 s after its only ask, while the first's is
        # still held ...
        _until(lambda: [x["lease_id"] for x in _leases(url)] == [lease["lease_id"]], 5.0,
               "only the first reader's lease left")
        # ... until 4 s after that reader's last ask; asking later opens a new lease.
        _until(lambda: _leases(url) == [], 6.0, "no lease left")
        assert time.monotonic() - t_again >= 4.0
        assert httpx.get(f"{seed.url}{INFO}", params={"rank": 0}).status_code == 200
        (later,) = _leases(url)
        assert later["lease_id"] != lease["lease_id"]
    assert _leases(url) == []  # stop() releases
    b.close()
    c.close()


def test_direct_calls_open_a_lease_each(coordinator, workers):
    """``info(rank)`` without a reader (a test or a script pinning replicas) opens a lease per call."""
    from tensorhub.integrations.sglang.seed import SeedError, SeedServer

    url = coordinator()
    workers(url, "trainer").call("publish", seed=1, nbytes=1 << 16)
    with SeedServer(url, "policy", layout="hf", max_leases=3) as seed:
        for _ in range(3):
            seed.info(0)
        assert len(_leases(url)) == 3
        with pytest.raises(SeedError, match="max_leases 3"):
            seed.info(0)
