"""Same-host reads (issue #14): real coordinator and worker processes on this host.

A reader on the holder's host copies from the holder's memfd-backed memory (fds passed over
a Unix socket under a lease) instead of reading over Mooncake's loopback. Every fetch is
checked byte for byte; the transport's counters say which path the bytes took.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import httpx
import pytest

from tensorhub.testing import CoordinatorProcess, WorkerError, digest, make_weights
from tensorhub.testing._workers import MODEL
from tensorhub.transport._shm import host_identity, socket_name

pytestmark = pytest.mark.multiprocess

MiB = 1 << 20


def expected(seed: int, nbytes: int) -> dict:
    return digest(make_weights(seed, nbytes))


def endpoint_of(url: str, worker_id: str, token: str | None = None) -> str:
    h = {"Authorization": f"Bearer {token}"} if token else {}
    st = httpx.get(f"{url}/v1/status", headers=h, timeout=10).json()
    return next(w["endpoint"] for w in st["workers"] if w["worker_id"] == worker_id)


def ask_fds(endpoint: str, **req) -> tuple[dict, int]:
    """Ask a holder's fd server as a reader would; returns its answer and how many fds came."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(socket_name(endpoint))
    req.setdefault("host", dict(host_identity(), label=socket.gethostname()))
    s.sendall(json.dumps(req).encode())
    data, fds, _, _ = socket.recv_fds(s, 1 << 16, 250)
    s.close()
    for fd in fds:
        os.close(fd)
    return json.loads(data.decode()), len(fds)


def test_same_host_read_copies_exact_bytes_without_mooncake(coordinator, workers):
    url = coordinator.url
    pub = workers(url, "pub", own_transport=True)
    reader = workers(url, "reader", own_transport=True)
    v = pub.call("publish", seed=3, nbytes=64 * MiB, empty_like=True)
    got = reader.call("fetch", version=v, serve=True)
    assert got["digest"] == expected(3, 64 * MiB)
    stats = reader.call("transport_stats")
    assert stats["copied_bytes"] == got["nbytes"] and stats["inner_batches"] == 0, stats
    # The reader's fetched copy is Hub memory too: a third process copies it from there.
    pub2 = workers(url, "late", own_transport=True)
    got2 = pub2.call("fetch", version=v, serve=False)
    assert got2["digest"] == expected(3, 64 * MiB)
    assert pub2.call("transport_stats")["copied_bytes"] == got2["nbytes"]


def test_user_tensors_and_other_hosts_still_use_mooncake(coordinator, workers):
    url = coordinator.url
    pub = workers(url, "pub", own_transport=True, locality="host=a")
    v_plain = pub.call("publish", seed=4, nbytes=16 * MiB)  # user tensors: not Hub memory
    v_snap = pub.call("publish", seed=5, nbytes=16 * MiB, empty_like=True)
    near = workers(url, "near", own_transport=True, locality="host=a")
    got = near.call("fetch", version=v_plain, serve=False)
    assert got["digest"] == expected(4, 16 * MiB)
    s = near.call("transport_stats")
    assert s["copied_bytes"] == 0 and s["inner_batches"] > 0, s
    # Another host (by its locality label): Mooncake, although the memory could be mapped.
    far = workers(url, "far", own_transport=True, locality="host=b")
    got = far.call("fetch", version=v_snap, serve=False)
    assert got["digest"] == expected(5, 16 * MiB)
    s = far.call("transport_stats")
    assert s["copied_bytes"] == 0 and s["inner_batches"] > 0, s
    # ... while a reader on host a copies the same version.
    got = near.call("fetch", version=v_snap, serve=False)
    assert got["digest"] == expected(5, 16 * MiB)
    assert near.call("transport_stats")["copied_bytes"] == got["nbytes"]


def test_unpublish_waits_for_a_same_host_reader(coordinator, workers):
    url = coordinator.url
    pub = workers(url, "pub", own_transport=True)
    v1 = pub.call("publish", seed=6, nbytes=16 * MiB, empty_like=True)
    pub.call("publish", seed=7, nbytes=16 * MiB, empty_like=True)  # v1 is not the newest: unpublish is allowed
    reader = workers(url, "slow", own_transport=True, copy_delay=3.0)
    reader.send("fetch", version=v1, serve=False)
    time.sleep(1.0)  # the reader holds its lease; its copies wait
    waited = pub.call("unpublish", version=v1, drain_timeout=60)  # then zeroes the memory
    got = reader.result()
    assert got["digest"] == expected(6, 16 * MiB)  # read before the holder overwrote it
    assert reader.call("transport_stats")["copied_bytes"] == got["nbytes"]
    assert waited >= 1.0, f"unpublish returned after {waited:.2f}s while a same-host reader was copying"


def test_checksums_still_verified_on_same_host_reads(coordinator, workers):
    url = coordinator.url
    pub = workers(url, "pub", own_transport=True)
    v = pub.call("publish", seed=8, nbytes=16 * MiB, empty_like=True)
    pub.call("corrupt", version=v)  # the bytes change behind the manifest's checksums
    reader = workers(url, "reader", own_transport=True)
    with pytest.raises(WorkerError, match="checksum"):
        reader.call("fetch", version=v, serve=False, fetch_timeout=15)
    assert reader.call("transport_stats")["copied_bytes"] > 0  # the mismatch was found on copied bytes


def test_fds_only_for_a_valid_lease_on_that_replica(tmp_path, workers):
    token = "s3cret-token"
    tf = tmp_path / "token"
    tf.write_text(token)
    coord = CoordinatorProcess(tmp_path / "state", token_file=tf)
    url = coord.start()
    try:
        pub = workers(url, "pub", own_transport=True, token=token)
        v = pub.call("publish", seed=9, nbytes=8 * MiB, empty_like=True)
        ep = endpoint_of(url, "pub", token)
        api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=10)
        assert api.post("/v1/workers", json={"worker_id": "asker", "endpoint": "", "locality": {}}).status_code == 200
        grant = api.post("/v1/leases", json={"worker_id": "asker", "model": MODEL, "version": v, "layout": "hf",
                                              "shard": 0, "max_sources": 4}).json()
        assert "lease_id" in grant, grant
        lease, replica = grant["lease_id"], grant["replicas"][0]["replica_id"]
        ok = dict(token=token, lease_id=lease, replica_id=replica, worker_id="asker")
        ans, n = ask_fds(ep, **ok)
        assert n >= 1 and ans["arenas"], ans  # the valid asker gets the memory
        for bad, why in [(dict(ok, token="wrong"), "token"), (dict(ok, token=""), "token"),
                         (dict(ok, lease_id="nope"), "lease"), (dict(ok, replica_id="r-other"), "lease"),
                         (dict(ok, worker_id="someone-else"), "lease")]:
            ans, n = ask_fds(ep, **bad)
            assert n == 0 and not ans["arenas"], (bad, ans)
            assert why in ans.get("why", ""), ans
        api.post(f"/v1/leases/{lease}/release")
        ans, n = ask_fds(ep, **ok)  # released: no longer valid
        assert n == 0 and "lease" in ans.get("why", ""), ans
    finally:
        coord.stop()
