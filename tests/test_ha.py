"""Highly available coordinators on a real etcd (issue #17).

A real etcd (``/usr/bin/etcd``, Debian's etcd-server; scripts/setup.sh installs it), real
coordinator processes (``tensorhub coordinator --store etcd://...``), real Mooncake workers.
Every fetch is checked byte for byte. Skipped, with the reason, only when etcd is absent.
Select them with ``-m ha``.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Callable

import httpx
import pytest

from tensorhub.server.state import CoordinatorState
from tensorhub.testing import CoordinatorProcess, Worker, digest, make_weights
from tensorhub.testing._etcd import EtcdCluster, etcd_binary

pytestmark = [
    pytest.mark.ha,
    pytest.mark.multiprocess,
    pytest.mark.skipif(etcd_binary() is None, reason="no etcd binary (apt-get install etcd-server; "
                                                     "scripts/setup.sh installs it)"),
]

MiB = 1 << 20


def expected(seed: int, nbytes: int) -> dict:
    return digest(make_weights(seed, nbytes))


def wait_for(pred: Callable[[], Any], timeout: float, what: str, every: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = pred()
        except httpx.HTTPError:
            got = None
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


def health(url: str) -> dict:
    return httpx.get(f"{url}/healthz", timeout=2).json()


class Coordinators:
    """N coordinator processes on one etcd store."""

    def __init__(self, tmp_path, store_url: str, n: int = 3, extra: tuple = ()) -> None:
        self.procs = [CoordinatorProcess(tmp_path / f"c{i}" / "state",
                                         extra=("--store", store_url, *extra)) for i in range(n)]
        for p in self.procs:
            p.start()

    @property
    def urls(self) -> str:
        return ",".join(p.url for p in self.procs)

    def leader(self, timeout: float = 10.0, exclude: tuple = ()) -> CoordinatorProcess:
        def find():
            for p in self.procs:
                if p in exclude or p.proc is None or p.proc.poll() is not None:
                    continue
                try:
                    if health(p.url)["role"] == "leader":
                        return p
                except httpx.HTTPError:
                    pass
            return None
        return wait_for(find, timeout, "a leader")

    def stop(self) -> None:
        for p in self.procs:
            if p.proc is not None and p.proc.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                except OSError:
                    pass
            p.stop()


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    with EtcdCluster(tmp_path_factory.mktemp("etcd"), members=1) as c:
        yield c


@pytest.fixture
def prefix(request):
    """A fresh key prefix per test: tests share the module's etcd."""
    return "/t-" + request.node.name.replace("[", "-").replace("]", "") + "-" + os.urandom(3).hex()


def _status(url: str) -> dict:
    return httpx.get(f"{url}/v1/status", timeout=10, follow_redirects=True).json()


# ------------------------------------------------------------------ store contract
ROWS = [
    ("model", ("m",), 3),
    ("version", ("m", 1), 10.5),
    ("version", ("m", 3), 11.0),
    ("layout", ("m", 1, "hf"), 2),
    ("layout", ("m", 1, "vllm/tp2#abc"), 1),
    ("allocation", ("m", "req-1"), 1),
    ("allocation", ("m", "req-3"), 3),
    ("allocation", ("other", "req-1"), 7),
    ("model", ("other",), 7),
]


def _manifest_rows() -> list:
    from tensorhub.protocol import Manifest

    man = Manifest.model_validate({"tensors": [{"name": "w", "dtype": "float32", "shape": [2, 3], "nbytes": 24}]})
    return [("manifest", ("m", 1, "hf", 0), man), ("manifest", ("m", 1, "hf", 1), man)]


@pytest.fixture(params=["sqlite", "etcd"])
def store(request, tmp_path, etcd, prefix):
    if request.param == "sqlite":
        from tensorhub.server.store import SqliteStore

        s = SqliteStore(tmp_path / "state")
    else:
        from tensorhub.server.store_etcd import EtcdStore

        s = EtcdStore(etcd.store_url + prefix)
    s.open()
    yield s
    s.close()


def _norm(rows: list) -> list:
    out = []
    for t, k, v in rows:
        out.append((t, tuple(k), v.model_dump(mode="json") if hasattr(v, "model_dump") else v))
    return sorted(out, key=repr)


def test_store_contract_round_trips_the_same_rows(store):
    """SqliteStore and EtcdStore: what is committed is what is loaded, upserts and the
    allocation floor included; and a state restored from it answers the same."""
    assert store.load() == []
    rows = ROWS + _manifest_rows()
    store.commit(rows[:4])
    store.commit(rows[4:])
    store.commit([("model", ("m",), 4), ("version", ("m", 4), 12.0), ("allocation", ("m", "req-4"), 4)])
    store.commit([("allocation_floor", ("m",), 3)])  # drops m's answers up to version 3
    want = [r for r in rows if not (r[0] == "allocation" and r[1][0] == "m")]
    want = [r for r in want if r != ("model", ("m",), 3)]
    want += [("model", ("m",), 4), ("version", ("m", 4), 12.0), ("allocation", ("m", "req-4"), 4)]
    assert _norm(store.load()) == _norm(want)
    st = CoordinatorState.restore(store.load(), now=0.0)
    assert st.models["m"].counter == 4 and st.models["other"].counter == 7
    assert st.allocations == {("m", "req-4"): 4, ("other", "req-1"): 7}
    assert st.manifest("m", 1, "hf", 1).tensors[0].name == "w"
    # Retention retires a version: its version, layout and manifest rows go, the counter stays.
    store.commit([("retire", ("m", 1), None)])
    left = _norm(store.load())
    assert not [r for r in left if r[0] in ("version", "layout", "manifest") and tuple(r[1][:2]) == ("m", 1)]
    assert _norm(store.load()) == _norm([r for r in want if not (r[0] in ("version", "layout", "manifest")
                                                                and tuple(r[1][:2]) == ("m", 1))])
    assert CoordinatorState.restore(store.load(), now=0.0).models["m"].counter == 4


def test_store_contract_retire_drops_a_versions_rows(store):
    """Retention's ``retire``: the version's version, layout and manifest rows go (only
    that version's: v1 must not take v10's), the counter and other versions stay."""
    from tensorhub.protocol import Manifest

    man = Manifest.model_validate({"tensors": [{"name": "w", "dtype": "float32", "shape": [1], "nbytes": 4}]})
    rows = [("model", ("m",), 10)]
    for v in (1, 10):
        rows += [("version", ("m", v), 1.0), ("layout", ("m", v, "hf"), 2),
                 ("manifest", ("m", v, "hf", 0), man), ("manifest", ("m", v, "hf", 1), man)]
    store.commit(rows)
    store.commit([("retire", ("m", 1), None)])
    left = _norm(store.load())
    assert left == _norm([r for r in rows if not (r[0] != "model" and r[1][1] == 1)])


def test_store_url_errors_are_clear():
    from tensorhub._exceptions import ConfigError
    from tensorhub.server.store_etcd import parse_store_url

    u = parse_store_url("etcd://a:2379,b:2380/jobs/x")
    assert u.endpoints == (("a", 2379), ("b", 2380)) and u.prefix == "/jobs/x/" and not u.tls
    assert parse_store_url("etcds://[::1]:2379").tls
    for bad in ("etcd://", "etcd://a", "etcd://a:x", "etcd://a:2379,", "redis://a:1", "etcd://u@a:1"):
        with pytest.raises(ConfigError, match="--store"):
            parse_store_url(bad)


def test_cli_refuses_bad_store_and_unreachable_etcd(tmp_path):
    import subprocess
    import sys

    run = lambda *a: subprocess.run([sys.executable, "-m", "tensorhub", "coordinator", "--port", "0", *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=60)
    r = run("--store", "etcd://nohost")
    assert r.returncode == 2 and "is not HOST:PORT" in r.stderr
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # nothing listens there once closed
    r = run("--store", f"etcd://127.0.0.1:{dead}")
    assert r.returncode == 2 and "cannot reach etcd" in r.stderr, r.stderr
    r = run()
    assert r.returncode == 2 and "--state-dir" in r.stderr


# ------------------------------------------------------------------ fencing in etcd
def test_deposed_leader_cannot_commit_and_counters_never_repeat(etcd, prefix):
    """Fencing through etcd revisions, without trusting the deposed leader's own clock:
    its lease is revoked behind its back, another campaigns and wins; its next commit is
    refused by etcd. Two stores that both think they may allocate never both get a number."""
    from tensorhub.server.election import Election
    from tensorhub.server.store_etcd import EtcdStore, Fenced

    a_store, b_store = EtcdStore(etcd.store_url + prefix), EtcdStore(etcd.store_url + prefix)
    a_store.open(), b_store.open()
    a = Election(a_store.etcd, a_store.prefix, "http://a")
    b = Election(b_store.etcd, b_store.prefix, "http://b")
    a_store.fence, b_store.fence = a.fence, b.fence
    a._grant(), b._grant()
    a._campaign()
    assert a.leading() and not b.leading()
    a_store.load()
    a_store.commit([("model", ("m",), 1), ("version", ("m", 1), 0.0)])
    b._campaign()
    assert not b.leading(), "two leaders"
    with pytest.raises(Fenced):
        b_store.commit([("model", ("m",), 2)])
    # a is deposed behind its back (its lease revoked: as if it had been paused past its ttl
    # while its local clock somehow still trusted it); b takes over
    a_store.etcd.post("/lease/revoke", {"ID": str(a._lease)})
    b._campaign()
    assert b.leading() and a.leading(), "a's local view must not matter for the next check"
    with pytest.raises(Fenced):
        a_store.commit([("model", ("m",), 2), ("version", ("m", 2), 0.0)])
    b_store.load()
    b_store.commit([("model", ("m",), 2), ("version", ("m", 2), 0.0)])
    # counter fencing alone (no leadership compare): the same stale counter cannot be raised twice
    x, y = EtcdStore(etcd.store_url + prefix), EtcdStore(etcd.store_url + prefix)
    x.open(), y.open()
    x.load(), y.load()
    x.commit([("model", ("m",), 3)])
    with pytest.raises(Fenced):
        y.commit([("model", ("m",), 3)])
    rows = {(t, k): v for t, k, v in x.load()}
    assert rows[("model", ("m",))] == 3 and ("version", ("m", 2)) in rows
    for s in (a_store, b_store, x, y):
        s.close()


# ------------------------------------------------------------------ 3 coordinators
def test_three_coordinators_one_leader_redirects_status_and_metrics(tmp_path, etcd, prefix):
    cs = Coordinators(tmp_path, etcd.store_url + prefix)
    try:
        leader = cs.leader()
        followers = [p for p in cs.procs if p is not leader]
        roles = [health(p.url) for p in cs.procs]
        assert sorted(r["role"] for r in roles) == ["follower", "follower", "leader"]
        assert all(r["leader"] == leader.url for r in roles)
        r = httpx.post(f"{followers[0].url}/v1/models/m/versions", json={})
        assert r.status_code == 307 and r.headers["location"] == f"{leader.url}/v1/models/m/versions"
        assert r.json()["leader"] == leader.url
        st = _status(followers[1].url)
        assert st["coordinators"]["leader"] == leader.url
        assert sorted(st["coordinators"]["followers"]) == sorted(p.url for p in followers)
        text = httpx.get(f"{leader.url}/metrics").text
        assert "tensorhub_coordinator_leader 1.0" in text and "tensorhub_coordinator_elections_total 1.0" in text
        assert "tensorhub_coordinator_leader 0.0" in httpx.get(f"{followers[0].url}/metrics").text
        # the CLI shows the leader and the followers, from any of the URLs
        import subprocess
        import sys

        out = subprocess.run([sys.executable, "-m", "tensorhub", "status", "--coordinator", cs.urls],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert f"leader {leader.url}; followers:" in out.stdout
        # a leader stopped with SIGTERM revokes its lease: a follower takes over at once
        t0 = time.monotonic()
        leader.stop()
        cs.leader(timeout=5, exclude=(leader,))
        assert time.monotonic() - t0 < 1.5, "takeover waited out the ttl after a clean stop"
    finally:
        cs.stop()


def test_leader_killed_mid_transfer_transfer_completes_versions_continue(tmp_path, etcd, prefix):
    cs = Coordinators(tmp_path, etcd.store_url + prefix)
    made: list[Worker] = []
    try:
        urls = cs.urls
        pub = Worker(urls, "pub")
        made.append(pub)
        size = 256 * MiB
        v1 = pub.call("publish", seed=1, nbytes=size)
        reader = Worker(urls, "reader", gated=True, chunk_bytes=16 * MiB)
        made.append(reader)
        reader.send("fetch", version=v1, serve=False)
        assert reader.first_done.wait(60), "the read never started"
        old = cs.leader()
        assert any(l["worker_id"] == "reader" for l in _status(old.url)["leases"]), "no lease mid-read"
        old.kill()
        t0 = time.monotonic()
        reader.gate.set()
        new = cs.leader(timeout=10, exclude=(old,))
        took = time.monotonic() - t0
        got = reader.result(timeout=120)
        assert got["digest"] == expected(1, size), "wrong bytes after failover"
        assert took < 5, f"takeover took {took:.1f}s"
        # versions continue: the next one is v1 + 1 (none reused, none lost)
        v2 = pub.call("publish", seed=2, nbytes=4 * MiB)
        assert v2 == v1 + 1
        assert health(new.url)["epoch"] and _status(new.url)["coordinators"]["leader"] == new.url
        # the publisher's replica of v1 re-registered on the new leader; a new reader gets both
        r2 = Worker(urls, "reader2")
        made.append(r2)
        assert r2.call("fetch", version=v1)["digest"] == expected(1, size)
        assert r2.call("fetch", version=None)["digest"] == expected(2, 4 * MiB)
    finally:
        for w in made:
            w.close()
        cs.stop()


def test_sigstopped_leader_cannot_hand_out_a_version_after_resuming(tmp_path, etcd, prefix):
    """A zombie leader: SIGSTOPped past its lease ttl, another coordinator takes over and
    allocates; after SIGCONT the zombie answers nothing as leader (checked at once, before
    its election thread can have run) and never hands out a number."""
    cs = Coordinators(tmp_path, etcd.store_url + prefix)
    try:
        old = cs.leader()
        api = httpx.Client(timeout=10)
        v1 = api.post(f"{old.url}/v1/models/m/versions", json={}).json()["version"]
        os.kill(old.pid, signal.SIGSTOP)
        try:
            new = cs.leader(timeout=10, exclude=(old,))
            v2 = api.post(f"{new.url}/v1/models/m/versions", json={}).json()["version"]
            assert v2 == v1 + 1
            # requests queued to the zombie while it is stopped: answered after SIGCONT
            import concurrent.futures as cf

            pool = cf.ThreadPoolExecutor(4)
            queued = [pool.submit(api.post, f"{old.url}/v1/models/m/versions", json={}) for _ in range(3)]
            queued.append(pool.submit(api.post, f"{old.url}/v1/workers",
                                      json={"worker_id": "w", "endpoint": "127.0.0.1:1", "locality": {}}))
            time.sleep(0.3)
        finally:
            os.kill(old.pid, signal.SIGCONT)
        answers = [f.result(timeout=30) for f in queued]
        for r in answers:
            assert r.status_code in (307, 503), f"zombie answered {r.status_code}: {r.text}"
            assert r.json()["code"] == "not_leader"
        assert health(old.url)["role"] == "follower"
        v3 = httpx.post(f"{old.url}/v1/models/m/versions", json={}, follow_redirects=True).json()["version"]
        assert v3 == v2 + 1, "a version number was handed out twice or skipped"
        counters = [m["counter"] for m in _status(new.url)["models"] if m["model"] == "m"]
        assert counters == [v3]
    finally:
        cs.stop()


def test_one_etcd_member_killed_service_continues(tmp_path):
    with EtcdCluster(tmp_path / "etcd3", members=3) as cluster:
        cs = Coordinators(tmp_path, cluster.store_url + "/fault")
        made: list[Worker] = []
        try:
            pub = Worker(cs.urls, "pub")
            made.append(pub)
            v1 = pub.call("publish", seed=5, nbytes=8 * MiB)
            cluster.kill(0)  # the first endpoint every client of etcd tries
            v2 = pub.call("publish", seed=6, nbytes=8 * MiB)
            assert v2 == v1 + 1
            # and a coordinator failover still works on the two remaining members
            old = cs.leader()
            old.kill()
            cs.leader(timeout=10, exclude=(old,))
            reader = Worker(cs.urls, "reader")
            made.append(reader)
            assert reader.call("fetch", version=v2)["digest"] == expected(6, 8 * MiB)
            assert pub.call("publish", seed=7, nbytes=MiB) == v2 + 1
        finally:
            for w in made:
                w.close()
            cs.stop()


def test_client_several_urls_single_url_and_bad_list(tmp_path, etcd, prefix):
    from tensorhub._client import CoordinatorClient
    from tensorhub._exceptions import ConfigError

    with pytest.raises(ConfigError, match="not http"):
        CoordinatorClient("http://a:1,,http://b:2")
    cs = Coordinators(tmp_path, etcd.store_url + prefix)
    try:
        leader = cs.leader()
        follower = next(p for p in cs.procs if p is not leader)
        # one follower URL alone: the client follows its redirect and stays on the leader
        c = CoordinatorClient(follower.url, retry_timeout=10)
        assert c.allocate_version("m") == 1 and c.url == leader.url
        # a dead URL first in the list: rotated past
        with __import__("socket").socket() as s:
            s.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{s.getsockname()[1]}"
        c2 = CoordinatorClient(f"{dead},{cs.urls}", retry_timeout=10)
        assert c2.allocate_version("m") == 2 and c2.url == leader.url
        c.close(), c2.close()
    finally:
        cs.stop()


def test_leader_that_stepped_down_on_its_clock_frees_its_key(etcd, prefix):
    """A leader whose lease lapsed on its own clock while etcd kept it (an etcd leader change
    extends every lease) steps down; it must free its leader key, or nobody campaigns."""
    from tensorhub.server.election import Election
    from tensorhub.server.store_etcd import EtcdStore

    store = EtcdStore(etcd.store_url + prefix)
    store.open()
    a = Election(store.etcd, store.prefix, "http://a")
    a.start()
    try:
        wait_for(a.leading, 5, "a leads")
        first = a.fence()["create_revision"]
        with a._lock:
            a._lease_until = float("-inf")  # its clock says the lease lapsed; etcd says not
        wait_for(lambda: a.leading() and a.fence()["create_revision"] != first, 5, "a new election")
        assert a.lost == 1 and a.won == 2
    finally:
        a.stop()
        store.close()
