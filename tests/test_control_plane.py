"""The control plane's cost per reader and over history (issue: control plane at fleet
scale): retention of metadata, lean lease answers, waits woken by publish, lookups by
shard."""

from __future__ import annotations

import sqlite3
import threading
import time

import httpx
import pytest
import torch

from tensorhub import NotFoundError
from tensorhub.server.state import CoordinatorState, StateConfig
from tensorhub.server.store import SqliteStore
from tensorhub.protocol import AcquireLease, Locality, Manifest, RegisterReplica, TensorSpec
from tensorhub.coordinator import Coordinator

from _stores import SlowStore

CFG = StateConfig(lease_ttl=10.0, worker_ttl=5.0, pause_grace=1e9, group_ttl=100.0, keep_versions=4)
MAN = Manifest(tensors=[TensorSpec(name="w", dtype="float32", shape=(4,), nbytes=16)])


def reg(worker: str, version: int, model: str = "m") -> RegisterReplica:
    return RegisterReplica(worker_id=worker, model=model, version=version, manifest=MAN, addresses=[4096])


def state(*workers: str) -> CoordinatorState:
    s = CoordinatorState(CFG, now=0.0)
    for w in workers:
        s.register_worker(0.0, w, f"ep-{w}", Locality(datacenter="d", zone="z", host=w))
    return s


def settle(s: CoordinatorState, now: float) -> None:
    """The coordinator's ticks at ``now``: retention retires a few versions per tick."""
    for _ in range(10):
        s.expire(now)


def publish(s: CoordinatorState, now: float, worker: str, drop_previous: bool = True) -> int:
    """The trainer's loop: publish v, then unpublish v-1 (it keeps only the newest)."""
    v = s.allocate_version(now, "m")
    s.register_replica(now, reg(worker, v))
    if drop_previous and v > 1:
        assert s.unpublish(now, worker, "m", v - 1) == (True, 0)
    return v


def test_retention_keeps_the_newest_complete_versions_and_whatever_is_held():
    s = state("trainer", "engine")
    v1 = publish(s, 0, "trainer")
    s.register_replica(0, reg("engine", v1))  # an engine still serves v1
    for _ in range(20):
        publish(s, 0, "trainer")
    s.expire(1.0)
    assert len(s.models["m"].versions) == 21 - 8  # one tick retires at most RETIRE_PER_TICK
    settle(s, 1.0)
    kept = sorted(s.models["m"].versions)
    assert kept == [v1, 18, 19, 20, 21], kept  # v1 held; the newest 4 complete
    # Retired versions are gone with a clear error, and their numbers are never reused.
    with pytest.raises(NotFoundError, match="retired"):
        s.manifest("m", 5, "hf", 0)
    assert s.allocate_version(1.0, "m") == 22
    with pytest.raises(Exception, match="never reused"):
        s.allocate_version(1.0, "m", 5)
    # Once the engine lets v1 go, it is retired too.
    assert s.unpublish(1.0, "engine", "m", v1) == (True, 0)
    settle(s, 2.0)
    assert v1 not in s.models["m"].versions


def test_retention_keeps_versions_being_read_published_or_promised_to_a_group():
    s = state("trainer", "reader", "late")
    v1 = publish(s, 0, "trainer")
    grant = s.acquire_lease(0, AcquireLease(worker_id="reader", model="m", version=v1))
    resolved = s.resolve(0, "m", group="step-1")
    assert resolved == v1
    pending = None
    for i in range(10):
        v = publish(s, 0, "trainer", drop_previous=False)
        if i > 0:  # the reader's lease keeps v1 named, so v1 cannot drain: unpublish the rest
            s.unpublish(0, "trainer", "m", v - 1)
    pending = s.allocate_version(0, "m")  # allocated, not yet registered: in progress
    settle(s, 1.0)
    kept = set(s.models["m"].versions)
    assert {v1, pending} <= kept, kept
    s.release_lease(1.0, grant.lease_id)
    settle(s, 1.0 + CFG.group_ttl + 1)  # the group's answer expires too
    assert v1 not in s.models["m"].versions and pending in s.models["m"].versions


def test_retention_waits_out_a_restart_window():
    s = state("trainer")
    for _ in range(10):
        publish(s, 0, "trainer")
    s2 = CoordinatorState.restore(s.durable_rows(), CFG, now=100.0)
    s2.expire(101.0)  # holders have not re-registered yet: nothing may be judged unheld
    assert len(s2.models["m"].versions) == 10
    settle(s2, 100.0 + CFG.lease_ttl + 1)
    assert sorted(s2.models["m"].versions) == [7, 8, 9, 10]


def test_the_store_stays_bounded_over_many_publishes(tmp_path):
    coord = Coordinator(tmp_path / "state", CFG)
    try:
        coord.call(lambda now: coord.state.register_worker(now, "trainer", "ep", Locality()))
        for i in range(1, 601):
            coord.call(lambda now: publish(coord.state, now, "trainer"))
            if i % 5 == 0:  # the coordinator ticks every second; a trainer publishes far slower
                coord.expire()
        db = sqlite3.connect(SqliteStore(tmp_path / "state").path)
        versions = db.execute("SELECT COUNT(*) FROM versions").fetchone()[0]
        manifests = db.execute("SELECT COUNT(*) FROM manifests").fetchone()[0]
        counter = db.execute("SELECT counter FROM models WHERE model='m'").fetchone()[0]
        db.close()
        assert versions <= CFG.keep_versions + 5 and manifests <= CFG.keep_versions + 5, (versions, manifests)
        assert counter == 600
    finally:
        coord.close()
    # After a restart the counter goes on (numbers never reused) and only kept rows load.
    coord = Coordinator(tmp_path / "state", CFG)
    try:
        assert coord.call(lambda now: coord.state.allocate_version(now, "m")) == 601
        assert len(coord.state.models["m"].versions) <= CFG.keep_versions + 6
    finally:
        coord.close()


def test_state_machine_10000_publishes_keep_metadata_bounded():
    s = state("trainer")
    for i in range(10_000):
        publish(s, float(i) / 1000, "trainer")
        if i % 5 == 4:
            s.heartbeat(float(i) / 1000, "trainer")
            s.expire(float(i) / 1000)
    assert len(s.models["m"].versions) <= CFG.keep_versions + 5
    assert s.models["m"].counter == 10_000 and s.latest("m") == 10_000


# ---------------------------------------------------------------------- over HTTP
def test_lease_answers_carry_the_manifest_only_when_asked(embedded):
    with httpx.Client(base_url=embedded.url, timeout=30) as c:
        for w in ("a", "r"):
            c.post("/v1/workers", json={"worker_id": w, "endpoint": f"127.0.0.1:{len(w)}"}).raise_for_status()
        v = c.post("/v1/models/m/versions", json={}).json()["version"]
        c.post("/v1/replicas", json=reg("a", v).model_dump(mode="json")).raise_for_status()
        body = {"worker_id": "r", "model": "m", "version": v}
        full = c.post("/v1/leases", json=body).json()
        assert full["manifest"]["tensors"][0]["name"] == "w"  # older clients: as before
        lean = c.post("/v1/leases", json={**body, "manifest": False, "pipelined": True}).json()
        assert lean["manifest"] is None and lean["replicas"]
        refresh = c.post("/v1/leases", json={**body, "pipelined": True, "lease_id": lean["lease_id"],
                                             "manifest": False}).json()
        assert refresh["manifest"] is None and refresh["lease_id"] == lean["lease_id"]
        # An older client (no "manifest" field) refreshing still gets it, as it always did.
        old = c.post("/v1/leases", json={**body, "pipelined": True, "lease_id": lean["lease_id"]}).json()
        assert old["manifest"]["tensors"][0]["name"] == "w"


def test_wait_for_version_is_woken_by_the_publish(connect):
    trainer, reader = connect("trainer"), connect("reader")
    trainer.publish("m", {"w": torch.zeros(4)})
    got: dict = {}

    def wait() -> None:
        t0 = time.monotonic()
        got["v"] = reader.wait_for_version("m", newer_than=1, timeout=20)
        got["waited"] = time.monotonic() - t0

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(1.0)
    assert t.is_alive(), "the wait returned before the publish"
    published = time.monotonic()
    trainer.publish("m", {"w": torch.ones(4)})
    t.join(10)
    assert got["v"] == 2
    # Woken by the publish, not by its long poll's 20 s deadline.
    assert time.monotonic() - published < 5.0


def test_public_lease_for_callers_outside_tensorhub(connect):
    trainer, seed = connect("trainer"), connect("seed")
    v = trainer.publish("m", {"w": torch.arange(4, dtype=torch.float32)})
    grant = seed.lease("m", v)
    assert [t.name for t in grant.manifest.tensors] == ["w"]
    assert [r.worker_id for r in grant.replicas] == ["trainer"]
    assert seed.release(grant.lease_id) is True
    assert seed.release(grant.lease_id) is False  # released once
    with pytest.raises(NotFoundError, match="no version 9"):
        seed.lease("m", 9, timeout=1.0)


# ---------------------------------------------------------------------- commits off the lock
def test_a_slow_disk_does_not_stall_heartbeats_and_answers_wait_for_what_they_saw(tmp_path):
    store = SlowStore(tmp_path / "state", delay=3.0)
    coord = Coordinator(None, CFG, store=store)
    try:
        for w in ("trainer", "reader"):
            coord.call(lambda now, w=w: coord.state.register_worker(now, w, f"ep-{w}", Locality()), soft=True)
        box: dict = {}
        t = threading.Thread(target=lambda: box.setdefault("v", coord.call(
            lambda now: coord.state.allocate_version(now, "m"))))
        t.start()
        assert store.started.wait(10)
        # The allocation's commit is on the (slow) disk: heartbeats answer meanwhile.
        coord.call(lambda now: coord.state.heartbeat(now, "reader"), soft=True)
        assert t.is_alive(), "the heartbeat waited for the commit"
        # A durable read (the version exists) is answered only once that commit is in.
        latest = coord.read(lambda: coord.state.models["m"].counter)
        assert not t.is_alive() and latest == 1 and box["v"] == 1
    finally:
        coord.close()
    # Nothing answered was lost: a fresh coordinator on the same store knows v1.
    coord = Coordinator(tmp_path / "state", CFG)
    try:
        assert coord.state.models["m"].counter == 1
    finally:
        coord.close()


def test_a_failed_commit_is_an_error_for_everyone_who_saw_it_and_is_rolled_back(tmp_path):
    store = SlowStore(tmp_path / "state", delay=1.0)
    coord = Coordinator(None, CFG, store=store)
    try:
        assert coord.call(lambda now: coord.state.allocate_version(now, "m")) == 1
        store.fail, store.started = True, threading.Event()
        errors: list = []

        def allocate() -> None:
            try:
                coord.call(lambda now: coord.state.allocate_version(now, "m"))
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        t = threading.Thread(target=allocate)
        t.start()
        assert store.started.wait(10)
        with pytest.raises(Exception, match="durable store failed"):
            coord.read(lambda: coord.state.models["m"].counter)  # it saw v2, which is not durable
        t.join(10)
        assert errors and "durable store failed" in str(errors[0]) and errors[0].status == 503
        store.fail = False
        # Rolled back to what the store holds: the next allocation is 2 again, never a gap.
        assert coord.call(lambda now: coord.state.allocate_version(now, "m")) == 2
    finally:
        coord.close()


def test_version_info_is_typed_and_answers_one_version(connect):
    trainer, reader = connect("trainer"), connect("reader")
    v = trainer.publish("m", {"w": torch.zeros(8)})
    info = reader.version_info("m", v)
    assert info.complete and info.layout_complete("hf") and not info.layout_complete("nope")
    assert info.layouts["hf"].nbytes == 32 and info.layouts["hf"].num_shards == 1
    assert [(r.worker_id, r.shard, r.serving) for r in info.replicas] == [("trainer", 0, True)]
    reader.fetch("m", v)  # serves it too
    assert sorted(r.worker_id for r in reader.version_info("m", v).replicas) == ["reader", "trainer"]
    assert reader.version_info("m", v + 5) is None and reader.version_info("nope", 1) is None
