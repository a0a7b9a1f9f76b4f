"""Consistency, reader side (issue 30), on the state machine and the HTTP shell.

Each test is a sequence that gave a wrong answer on b990e80:

* a reader cut off from the coordinator is expired after ``worker_ttl`` while it still
  trusts its lease for up to 0.98 x ``lease_ttl``: its expiry dropped the lease, so the
  holder's ``unpublish`` answered "drained" at once and the holder overwrote bytes the
  reader was still reading (invariant 13 in ``tensorhub/server/state.py``);
* ``unpublish(replica_ids=[P])`` of a replica that had become a tombstone skipped its fence;
* retention retired a version whose (sharded) publish was still in progress, and a retried
  allocation by key then answered the retired number (invariant 14);
* a partial replica's ``num_chunks`` was not checked against the shard's grid;
* unauthenticated requests (and made-up paths) filled ``/metrics``' route labels.

The Hub-level and real-process sides: ``tests/test_reader_fencing_hub.py``,
``benchmarks/soak.py --only reader-cut``.
"""

from __future__ import annotations

import httpx
import pytest

from tensorhub import ConflictError
from tensorhub.server.state import CoordinatorState, StateConfig
from tensorhub.protocol import AcquireLease, Locality

# The same world as the holder-side scenarios (synthetic clock, the shell's expiry ticks).
from test_consistency_state import reg, tick  # noqa: E402
from test_consistency_state import ticking as world  # noqa: E402

LOC = Locality(datacenter="d", zone="z", host="h")


# ---------------------------------------------------------------------------- item 1
def test_an_expired_reader_keeps_its_lease_until_the_lease_itself_lapses():
    """The issue's sequence: the reader's route to the coordinator is cut at 1 s; it is
    expired at ~11 s (worker_ttl 10) while it trusts its lease up to 1 + 0.98 x 30 s. The
    holder publishes v2 and unpublishes v1: not drained until the lease lapses at 31 s on
    the coordinator's clock (never before the reader stops trusting it)."""
    cfg = StateConfig(lease_ttl=30.0, worker_ttl=10.0)
    st = world(cfg, "trainer", "reader")
    v1 = st.allocate_version(0, "m")
    st.register_replica(0, reg("trainer", v1, 4096))
    st.acquire_lease(1, AcquireLease(worker_id="reader", model="m", version=v1))
    tick(st, 1, 12, alive=("trainer",))  # the reader's control plane is cut
    assert "reader" not in st.workers  # expired ...
    assert len(st.leases) == 1  # ... its lease is not
    v2 = st.allocate_version(12, "m")
    st.register_replica(12, reg("trainer", v2, 8192))
    assert st.unpublish(12.1, "trainer", "m", v1) == (False, 1)
    tick(st, 12.1, 30.5, alive=("trainer",))
    assert st.unpublish(30.5, "trainer", "m", v1) == (False, 1)  # reader's own bound: 1 + 29.4 = 30.4
    tick(st, 30.5, 31.5, alive=("trainer",))
    assert st.unpublish(31.5, "trainer", "m", v1) == (True, 0)  # lapsed at 31 on the coordinator's clock


def test_an_expired_reader_that_comes_back_renews_and_releases_its_lease():
    cfg = StateConfig(lease_ttl=30.0, worker_ttl=10.0)
    st = world(cfg, "trainer", "reader")
    v1 = st.allocate_version(0, "m")
    st.register_replica(0, reg("trainer", v1, 4096))
    g = st.acquire_lease(1, AcquireLease(worker_id="reader", model="m", version=v1))
    tick(st, 1, 12, alive=("trainer",))
    assert "reader" not in st.workers
    st.register_replica(12, reg("trainer", st.allocate_version(12, "m"), 8192))
    assert st.unpublish(12.1, "trainer", "m", v1) == (False, 1)
    # The route heals: the reader re-registers, renews (it is still reading), then releases.
    st.register_worker(13, "reader", "ep-reader", LOC)
    st.renew_lease(13, g.lease_id)
    tick(st, 13, 35, alive=("trainer", "reader"))  # past the first grant's expiry: renewed at 13
    assert st.unpublish(35, "trainer", "m", v1) == (False, 1)
    assert st.release_lease(35.5, g.lease_id) is True
    assert st.unpublish(35.6, "trainer", "m", v1) == (True, 0)


def test_a_reader_that_closes_without_releasing_still_fences_until_its_lease_lapses():
    """``remove_worker`` (a Hub's close) is the reader's word that it is gone, not that
    nothing still reads through its lease (a borrowed view outliving the Hub)."""
    cfg = StateConfig(lease_ttl=5.0, worker_ttl=2.0)
    st = world(cfg, "h", "r")
    v1 = st.allocate_version(0, "m")
    st.register_replica(0, reg("h", v1, 4096))
    st.acquire_lease(0.5, AcquireLease(worker_id="r", model="m", version=v1))
    st.remove_worker(1, "r")
    st.register_replica(1, reg("h", st.allocate_version(1, "m"), 8192))
    assert st.unpublish(1.1, "h", "m", v1) == (False, 1)
    tick(st, 1.1, 6, alive=("h",))
    assert st.unpublish(6, "h", "m", v1) == (True, 0)
    tick(st, 6, 12, alive=("h",))
    assert not st.leases  # forgotten a lease ttl after their expiry


# ---------------------------------------------------------------------------- item 3
def test_targeted_unpublish_of_a_tombstone_by_its_id_waits_for_its_reader():
    """``unpublish(v, replica_ids=[P])`` where P became a tombstone (its holder was expired
    while a reader read it) and the holder re-registered other replicas since: P's fence
    holds."""
    cfg = StateConfig(lease_ttl=30.0, worker_ttl=10.0)
    st = world(cfg, "h", "r")
    v1 = st.allocate_version(0, "m")
    st.register_replica(0, reg("h", v1, 4096))
    other, _ = st.register_replica(0, reg("h", v1, 9000, layout="native"))
    p, _ = st.register_replica(0, reg("h", v1, 12288, layout="other"))
    st.acquire_lease(1, AcquireLease(worker_id="r", model="m", version=v1, layout="other"))
    tick(st, 1, 12, alive=("r",))  # the holder is expired: P is a tombstone (leased)
    assert p in st.tombstones
    st.register_worker(12, "h", "ep-h", LOC)
    st.register_replica(12, reg("h", v1, 4096))  # it re-registers the hf copy, not P
    assert st.unpublish(12.1, "h", "m", v1, [p]) == (False, 1)
    tick(st, 12.1, 31.5, alive=("h",))
    assert st.unpublish(31.5, "h", "m", v1, [p]) == (True, 0)
    assert p not in st.tombstones and any(r.layout == "hf" for r in st.replicas.values())


# ---------------------------------------------------------------------------- item 6
def test_retention_keeps_an_allocated_version_whose_publish_is_in_progress():
    """keep_versions=1: v1 is allocated by a sharded publish (by key), v2 (another
    publisher) completes first. v1 is kept while its ranks may still register; once
    abandoned it is retired, and a retry by the same key is a clear error, never v1."""
    cfg = StateConfig(keep_versions=1, abandon_after=60.0, pause_grace=1e9)
    st = world(cfg, "a", "b")
    v1 = st.allocate_version(0, "m", request_id="step-1")
    v2 = st.allocate_version(0.1, "m")
    st.register_replica(0.2, reg("b", v2, 4096))
    tick(st, 0.2, 5, alive=("a", "b"))
    assert v1 in st.models["m"].versions  # kept: its publish is in progress
    assert st.allocate_version(5, "m", request_id="step-1") == v1  # a rank retrying gets the same number
    st.register_replica(6, reg("a", v1, 8192, shard=0, num_shards=2))  # rank 0 registers
    tick(st, 6, 61, alive=("a", "b"))  # past abandon_after, but named by a replica: kept
    assert v1 in st.models["m"].versions
    st.remove_worker(62, "a")  # the publisher died before rank 1 registered
    tick(st, 62, 63, alive=("b",))
    assert v1 not in st.models["m"].versions  # abandoned: retired
    with pytest.raises(ConflictError) as e:
        st.allocate_version(64, "m", request_id="step-1")
    assert e.value.code == "version_retired" and "new request id" in e.value.message


def test_retention_after_a_restart_counts_an_incomplete_version_from_the_boot():
    cfg = StateConfig(keep_versions=1, abandon_after=60.0, lease_ttl=5.0, pause_grace=1e9)
    st = world(cfg, "a", "b")
    v1 = st.allocate_version(0, "m", request_id="k")
    st.register_replica(0.2, reg("b", st.allocate_version(0.1, "m"), 4096))
    st2 = CoordinatorState.restore(st.durable_rows(), cfg, now=1000.0)
    st2.expire(1010)
    assert v1 in st2.models["m"].versions
    st2.expire(1061)
    assert v1 not in st2.models["m"].versions


# ---------------------------------------------------------------------------- item 7
@pytest.mark.parametrize("num_chunks", [0, 2, 10 ** 6])
def test_a_partial_replica_must_match_the_shards_chunk_grid(num_chunks):
    st = world(StateConfig(), "h", "r")
    v1 = st.allocate_version(0, "m")
    st.register_replica(0, reg("h", v1, 4096))  # 16 bytes: a 1-chunk grid of 1 MiB
    with pytest.raises(ConflictError) as e:
        st.register_replica(1, reg("r", v1, 8192, partial=True, chunk_bytes=1 << 20, num_chunks=num_chunks))
    assert e.value.code == "bad_chunk_grid" and "x 1" in e.value.message
    rid, _ = st.register_replica(1, reg("r", v1, 8192, partial=True, chunk_bytes=1 << 20, num_chunks=1))
    assert st.replicas[rid].num_chunks == 1


# ---------------------------------------------------------------------------- item 5
def test_metrics_route_labels_come_from_the_route_table_and_authenticated_calls_only(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    from tensorhub.coordinator import EmbeddedCoordinator

    token = "labels-Token-1"
    with EmbeddedCoordinator(tmp_path / "s", token=token) as c, \
            httpx.Client(base_url=c.url, timeout=10) as anon, \
            httpx.Client(base_url=c.url, headers={"Authorization": f"Bearer {token}"}, timeout=10) as http:
        for i in range(100):  # unauthenticated, each a new path
            assert anon.get(f"/v1/junk-{i}/x").status_code == 401
            assert anon.post(f"/v1/workers/w{i}/heartbeat").status_code == 401
        for i in range(100):  # authenticated but made-up paths: one "other" label
            assert http.get(f"/made/up/{i}-{'z' * 50}").status_code == 404
        http.post("/v1/workers", json={"worker_id": "w", "endpoint": "x:1"}).raise_for_status()
        http.post("/v1/workers/w/heartbeat", json={}).raise_for_status()
        r = http.get("/metrics")
        r.raise_for_status()
        routes = {}
        for fam in text_string_to_metric_families(r.text):
            for s in fam.samples:
                if s.name == "tensorhub_requests_total":
                    routes[s.labels["route"]] = s.value
        assert routes.get("POST /v1/workers") == 1
        assert routes.get("POST /v1/workers/{id}/heartbeat") == 1  # the 100 refused ones are not counted
        assert routes.get("other") == 100
        assert not any("junk" in k or "made" in k for k in routes), routes
        assert len(routes) <= 5, routes
