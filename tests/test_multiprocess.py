"""Real coordinator process, real Mooncake over loopback TCP, real worker processes.

Every fetch is checked byte for byte (sha256 per tensor) against the publisher's weights.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tensorhub.testing import CoordinatorProcess, Worker, WorkerError, digest, make_weights

pytestmark = pytest.mark.multiprocess

MiB = 1 << 20


def expected(seed: int, nbytes: int) -> dict:
    return digest(make_weights(seed, nbytes))


def status(url: str, token: str | None = None) -> dict:
    h = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.get(f"{url}/v1/status", headers=h, timeout=10).json()


def replicas_of(st: dict, version: int) -> list[dict]:
    for m in st["models"]:
        for v in m["versions"]:
            if v["version"] == version:
                return v["replicas"]
    return []


def test_one_publisher_three_readers_sequential_then_concurrent(coordinator, workers):
    url = coordinator.url
    pub = workers(url, "pub")
    readers = [workers(url, f"reader{i}") for i in range(3)]
    v1 = pub.call("publish", seed=1, nbytes=48 * MiB)
    want = expected(1, 48 * MiB)
    # sequential: each reader becomes a source for the next
    for r in readers:
        got = r.call("fetch", version=None)
        assert got["version"] == v1
        assert got["digest"] == want
        assert got["nbytes"] == sum(t.nbytes for t in make_weights(1, 48 * MiB).values())
    last = got
    assert set(last["sources"]) - {"pub"}, f"the last reader read only from the publisher: {last['sources']}"
    st = status(url)
    reps = replicas_of(st, v1)
    assert {r["worker_id"] for r in reps} == {"pub", "reader0", "reader1", "reader2"}
    served_by_readers = sum(r["served"] for r in reps if r["worker_id"] != "pub")
    assert served_by_readers >= 1  # visible in status: readers served later readers
    from tensorhub.cli import format_status

    table = format_status(st)
    assert "reader0" in table and "serving" in table

    # concurrent: a new version, three readers at once
    v2 = pub.call("publish", seed=2, nbytes=48 * MiB)
    assert v2 > v1
    for r in readers:
        r.send("fetch", version=v2)
    results = [r.result() for r in readers]
    want2 = expected(2, 48 * MiB)
    for got in results:
        assert got["version"] == v2 and got["digest"] == want2


def test_source_killed_mid_read_fetch_completes_from_other_replica(coordinator, workers):
    url = coordinator.url
    size = 512 * MiB
    a = workers(url, "holder-a")
    b = workers(url, "holder-b")
    v = a.call("publish", seed=7, nbytes=size)
    assert b.call("fetch", version=v)["digest"] == expected(7, size)
    # The reader stripes over a and b; once its first chunk is in, the test kills a.
    reader = workers(url, "reader", gated=True, chunk_bytes=16 * MiB)
    reader.send("fetch", version=v)
    assert reader.first_done.wait(60), "the read never started"
    leases = status(url)["leases"]
    assert any(l["worker_id"] == "reader" for l in leases), "reader holds no lease mid-read"
    a.kill()
    reader.gate.set()
    got = reader.result(timeout=120)
    assert got["digest"] == expected(7, size)
    assert got["failed_sources"], "the killed source was never seen failing: the kill was not mid-read"
    assert "holder-b" in got["sources"]


def test_unpublish_waits_for_reader_mid_read(coordinator, workers):
    url = coordinator.url
    size = 128 * MiB
    holder = workers(url, "holder")
    other = workers(url, "other")
    v1 = holder.call("publish", seed=11, nbytes=size)
    other.call("publish", seed=12, nbytes=MiB)  # v2: v1 is no longer the newest (no retention)
    reader = workers(url, "reader", gated=True, chunk_bytes=8 * MiB)
    reader.send("fetch", version=v1, serve=False)
    assert reader.first_done.wait(60)
    holder.send("unpublish", version=v1)
    time.sleep(1.5)
    assert not holder.conn.poll(), "unpublish returned while a reader was mid-read"
    reps = replicas_of(status(url), v1)
    assert reps and reps[0]["draining"] and reps[0]["open_leases"] == 1
    reader.gate.set()
    got = reader.result()
    waited = holder.result()
    assert waited >= 1.5
    assert got["digest"] == expected(11, size)  # all of v1, none of the zeros written after
    assert replicas_of(status(url), v1) == []


def test_coordinator_killed_and_restarted_between_publishes(coordinator, workers):
    url = coordinator.url
    pub = workers(url, "pub")
    v1 = pub.call("publish", seed=21, nbytes=8 * MiB)
    coordinator.kill()
    coordinator.start()  # same state dir, same port
    assert coordinator.url == url
    v2 = pub.call("publish", seed=22, nbytes=8 * MiB)
    assert v2 > v1
    # replicas of v1 re-register by themselves (heartbeat sees the new epoch)
    deadline = time.monotonic() + 15
    while not replicas_of(status(url), v1):
        assert time.monotonic() < deadline, "v1's replica did not re-register"
        time.sleep(0.2)
    reader = workers(url, "reader")
    assert reader.call("fetch", version=v1)["digest"] == expected(21, 8 * MiB)
    assert reader.call("fetch", version=None)["digest"] == expected(22, 8 * MiB)
    # versions keep increasing after a second restart too
    coordinator.kill()
    coordinator.start()
    assert pub.call("publish", seed=23, nbytes=MiB) > v2


def test_bad_input_gets_clear_errors_and_service_keeps_serving(coordinator, workers, tmp_path):
    url = coordinator.url
    pub = workers(url, "pub")
    v = pub.call("publish", seed=31, nbytes=4 * MiB)
    reader = workers(url, "reader")
    with pytest.raises(WorkerError, match="has no version 99"):
        reader.call("fetch", version=99)
    with pytest.raises(WorkerError) as e:
        reader.call("fetch", version=v, into={"nbytes": 4 * MiB, "break": "shape"})
    assert e.value.kind == "TensorMismatchError" and "layers.0.weight" in e.value.message
    assert "shape [3]" in e.value.message
    with pytest.raises(WorkerError, match=r"into\['layers.0.weight'\] has dtype float64"):
        reader.call("fetch", version=v, into={"nbytes": 4 * MiB, "break": "dtype"})
    # into with the right shapes works and gets the bytes
    assert reader.call("fetch", version=v, into={"nbytes": 4 * MiB}, serve=False)["digest"] == expected(31, 4 * MiB)
    # a different manifest for the same version is refused
    with pytest.raises(WorkerError) as e:
        pub.call("publish", seed=32, nbytes=2 * MiB, version=v)
    assert e.value.kind == "ManifestMismatchError" and "layers.0.weight" in e.value.message
    assert httpx.get(f"{url}/healthz").json()["ok"]
    assert reader.call("fetch", version=v)["digest"] == expected(31, 4 * MiB)


def test_killed_holder_is_dropped_within_worker_ttl(tmp_path, workers):
    c = CoordinatorProcess(tmp_path / "state", extra=("--worker-ttl", "2"))
    c.start()
    try:
        a = workers(c.url, "a")
        b = workers(c.url, "b")
        v = a.call("publish", seed=51, nbytes=2 * MiB)
        assert b.call("fetch", version=v)["digest"] == expected(51, 2 * MiB)
        a.kill()
        t0 = time.monotonic()
        while any(r["worker_id"] == "a" for r in replicas_of(status(c.url), v)):
            assert time.monotonic() - t0 < 2 + 3, "the dead holder's replica outlived the TTL"
            time.sleep(0.1)
        assert [r["worker_id"] for r in replicas_of(status(c.url), v)] == ["b"]
        reader = workers(c.url, "reader")
        got = reader.call("fetch", version=v)
        assert got["digest"] == expected(51, 2 * MiB) and got["sources"] == {"b": got["nbytes"]}
    finally:
        c.stop()


def test_wrong_token_is_refused_and_changes_nothing(tmp_path, workers):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    c = CoordinatorProcess(tmp_path / "state", token_file=token_file)
    c.log_level = "debug"
    c.start()
    try:
        assert httpx.get(f"{c.url}/healthz").status_code == 200
        for path in ("/v1/status", "/v1/models", "/openapi.json"):
            r = httpx.get(f"{c.url}{path}", headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401, path
        r = httpx.post(f"{c.url}/v1/models/policy/versions", json={}, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401
        with pytest.raises(WorkerError) as e:
            Worker(c.url, "intruder", token="wrong")
        assert e.value.kind == "UnauthorizedError" and "401" in e.value.message
        assert "s3cret" not in e.value.message
        pub = workers(c.url, "pub", token="s3cret-token")
        v = pub.call("publish", seed=41, nbytes=MiB)
        assert v == 1  # the refused request allocated nothing
        assert status(c.url, "s3cret-token")["models"][0]["counter"] == 1
    finally:
        c.stop()
    log = c.log_path.read_text()
    assert "coordinator epoch" in log  # the log was captured (debug level)...
    assert "s3cret" not in log  # ...and never shows the token
