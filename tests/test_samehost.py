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

from tensorhub.protocol import lease_proof
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
    # every chunk's checksum was computed by the copy that landed it (no second pass)
    assert stats["hashed_bytes"] == got["nbytes"], stats
    # The reader's fetched copy is Hub memory too: a third process copies it from there.
    pub2 = workers(url, "late", own_transport=True)
    got2 = pub2.call("fetch", version=v, serve=False)
    assert got2["digest"] == expected(3, 64 * MiB)
    assert pub2.call("transport_stats")["copied_bytes"] == got2["nbytes"]


def test_user_tensors_cross_read_and_other_hosts_still_use_mooncake(coordinator, workers):
    url = coordinator.url
    pub = workers(url, "pub", own_transport=True, locality="host=a")
    v_plain = pub.call("publish", seed=4, nbytes=16 * MiB)  # user tensors: not Hub memory
    v_snap = pub.call("publish", seed=5, nbytes=16 * MiB, empty_like=True)
    near = workers(url, "near", own_transport=True, locality="host=a")
    got = near.call("fetch", version=v_plain, serve=False)
    assert got["digest"] == expected(4, 16 * MiB)
    s1 = near.call("transport_stats")  # read in place with process_vm_readv (issue 34), no Mooncake
    assert s1["vm_bytes"] == s1["copied_bytes"] == got["nbytes"] and s1["inner_batches"] == 0, s1
    # Another host (by its locality label): Mooncake, although the memory could be mapped.
    far = workers(url, "far", own_transport=True, locality="host=b")
    got = far.call("fetch", version=v_snap, serve=False)
    assert got["digest"] == expected(5, 16 * MiB)
    s = far.call("transport_stats")
    assert s["copied_bytes"] == 0 and s["inner_batches"] > 0, s
    # ... while a reader on host a copies the same version.
    got = near.call("fetch", version=v_snap, serve=False)
    assert got["digest"] == expected(5, 16 * MiB)
    s2 = near.call("transport_stats")  # Hub memory: copied from the mapped arenas, not cross-read
    assert s2["copied_bytes"] - s1["copied_bytes"] == got["nbytes"] and s2["vm_bytes"] == s1["vm_bytes"], s2


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
                                              "shard": 0, "max_sources": 4, "lease_secret": True}).json()
        assert "lease_id" in grant, grant
        lease, replica = grant["lease_id"], grant["replicas"][0]["replica_id"]
        # The reader proves its lease with the lease's secret; the API token never crosses the socket.
        ok = dict(lease_id=lease, replica_id=replica, worker_id="asker",
                  proof=lease_proof(grant["secret"], lease, replica, ep))
        ans, n = ask_fds(ep, **ok)
        assert n >= 1 and ans["arenas"], ans  # the valid asker gets the memory
        no_proof = {k: v for k, v in ok.items() if k != "proof"}
        for bad, why in [(dict(no_proof, token=token), "proof"), (dict(ok, proof="0" * 64), "proof"),
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


def test_borrow_reads_the_holders_memory_in_place(coordinator, workers):
    """``Hub.borrow``: the exact bytes, read where the holder keeps them (no copy at all:
    neither a same-host copy nor a Mooncake batch); every view shares the holder's memory
    and nothing is left once released."""
    url = coordinator.url
    pub = workers(url, "pub", own_transport=True)
    v = pub.call("publish", seed=11, nbytes=32 * MiB, empty_like=True)
    reader = workers(url, "reader", own_transport=True)
    got = reader.call("borrow", version=v)
    assert got is not None and got["digest"] == expected(11, 32 * MiB)
    assert got["worker_id"] == "pub" and got["nbytes"] == 32 * MiB and got["lapsed"] is None
    assert got["sharing"] == len(got["digest"]) and got["own"] == 0 and got["left"] == 0, got
    s = reader.call("transport_stats")
    assert s["copied_bytes"] == 0 and s["inner_batches"] == 0, s
    # The lease was released: the holder may drop the version at once.
    pub.call("publish", seed=12, nbytes=MiB, empty_like=True)
    assert pub.call("unpublish", version=v, drain_timeout=10) < 2.0


def test_borrow_is_none_where_memory_cannot_be_mapped(coordinator, workers):
    """User tensors (not Hub memory) and holders on another host: nothing borrowed, nothing
    held (the caller fetches); a corrupted replica fails its checksums in place: None too."""
    url = coordinator.url
    pub = workers(url, "pub", own_transport=True, locality="host=a")
    v_plain = pub.call("publish", seed=13, nbytes=8 * MiB)
    v_snap = pub.call("publish", seed=14, nbytes=8 * MiB, empty_like=True)
    near = workers(url, "near", own_transport=True, locality="host=a")
    far = workers(url, "far", own_transport=True, locality="host=b")
    assert near.call("borrow", version=v_plain) is None
    assert far.call("borrow", version=v_snap) is None
    assert near.call("borrow", version=v_snap)["digest"] == expected(14, 8 * MiB)
    pub.call("corrupt", version=v_snap)
    assert near.call("borrow", version=v_snap) is None
    # Nothing borrowed holds a lease: the holder unpublishes v_plain without waiting.
    assert pub.call("unpublish", version=v_plain, drain_timeout=10) < 2.0


def test_unpublish_waits_for_a_borrower(coordinator, workers):
    url = coordinator.url
    pub = workers(url, "pub", own_transport=True)
    v1 = pub.call("publish", seed=15, nbytes=16 * MiB, empty_like=True)
    v2 = pub.call("publish", seed=16, nbytes=16 * MiB, empty_like=True)  # v1 is not the newest
    reader = workers(url, "reader", own_transport=True)
    assert reader.call("borrow", version=v2)["digest"] == expected(16, 16 * MiB)  # its transport is up
    reader.send("borrow", version=v1, hold=6.0)
    time.sleep(2.5)  # the reader holds its borrowed lease (a busy machine: take time)
    waited = pub.call("unpublish", version=v1, drain_timeout=60)  # then zeroes the memory
    got = reader.result()
    assert got["digest"] == expected(15, 16 * MiB) and got["lapsed"] is None
    assert waited >= 2.0, f"unpublish returned after {waited:.2f}s while a borrower held its lease"


def test_borrow_whose_lease_lapsed_says_so_at_release(tmp_path, workers):
    """The coordinator paused past the lease's ttl while the reader holds it: renewals fail,
    the reader's own clock runs out, and the release says the bytes cannot be trusted."""
    import signal

    coord = CoordinatorProcess(tmp_path / "state", extra=("--lease-ttl", "2", "--worker-ttl", "30"))
    url = coord.start()
    try:
        pub = workers(url, "pub", own_transport=True)
        v = pub.call("publish", seed=17, nbytes=4 * MiB, empty_like=True)
        reader = workers(url, "reader", own_transport=True)
        assert reader.call("borrow", version=v)["lapsed"] is None  # its transport is up
        reader.send("borrow", version=v, hold=4.0)
        time.sleep(0.8)
        os.kill(coord.pid, signal.SIGSTOP)
        time.sleep(3.0)
        os.kill(coord.pid, signal.SIGCONT)
        got = reader.result()
        assert got["lapsed"] and "lapsed" in got["lapsed"], got
    finally:
        coord.stop()


def test_transport_copies_covered_batches_and_passes_the_rest_on():
    """Two wrapped transports in one process: a batch inside the holder's arena is copied
    (exact bytes, no Mooncake batch); one touching plain memory goes over Mooncake."""
    import torch

    from tensorhub._reader import Source
    from tensorhub.transport import DONE, PENDING, MooncakeTransport, ReadOp
    from tensorhub.transport import _arena, _shm

    asked = []
    arena = _arena.empty(8 * MiB)
    arena.copy_(torch.randint(0, 255, (8 * MiB,), dtype=torch.uint8))
    plain = torch.randint(0, 255, (1 * MiB,), dtype=torch.uint8)

    def authorize(lease, replica, worker, proof, endpoint):
        asked.append((lease, replica, worker))
        return [(arena.data_ptr(), 8 * MiB)] if lease == "good" else None

    holder = _shm.SameHostTransport(MooncakeTransport(), host_label="h", authorize=authorize,
                                    worker_id="holder")
    reader = _shm.SameHostTransport(MooncakeTransport(), host_label="h",
                                    authorize=lambda *a: None, worker_id="reader")
    try:
        ep = holder.start()
        reader.start()
        holder.register(arena.data_ptr(), 8 * MiB)
        holder.register(plain.data_ptr(), 1 * MiB)
        dst = torch.zeros(9 * MiB, dtype=torch.uint8)
        reader.register(dst.data_ptr(), dst.nbytes)

        def run(lease, ops):
            h = reader.submit_from(Source("r1", "holder", ep, (), lease, secret="k" * 32, host="h"), ops)
            while (st := reader.poll(h)) == PENDING:
                time.sleep(0.001)
            return st

        ops = [ReadOp(dst.data_ptr(), arena.data_ptr() + MiB, 3 * MiB),
               ReadOp(dst.data_ptr() + 3 * MiB, arena.data_ptr(), MiB)]
        assert run("good", ops) == DONE
        assert torch.equal(dst[:3 * MiB], arena[MiB:4 * MiB]) and torch.equal(dst[3 * MiB:4 * MiB], arena[:MiB])
        assert reader.copied_bytes == 4 * MiB and reader.inner_batches == 0
        assert asked == [("good", "r1", "reader")]
        # One op outside the arena: the whole batch goes over Mooncake (bytes still exact).
        mixed = [ReadOp(dst.data_ptr() + 4 * MiB, arena.data_ptr(), MiB),
                 ReadOp(dst.data_ptr() + 8 * MiB, plain.data_ptr(), MiB)]
        assert run("good", mixed) == DONE
        assert torch.equal(dst[8 * MiB:], plain) and reader.inner_batches == 1 and reader.copied_bytes == 4 * MiB
        # A lease the holder does not accept: Mooncake, no fd.
        dst.zero_()
        assert run("bad", ops[:1]) == DONE
        assert torch.equal(dst[:3 * MiB], arena[MiB:4 * MiB]) and reader.copied_bytes == 4 * MiB
        assert reader.inner_batches == 2
        # The holder's memory changes in place (same file): a later lease sees the new bytes.
        reader.forget({"good"})
        arena[MiB:2 * MiB] = 7
        assert run("good", ops[:1]) == DONE and bool((dst[:MiB] == 7).all())
    finally:
        reader.close()
        holder.close()


def test_follow_waits_for_the_engines_prefetch_before_it_swaps(embedded, capsys):
    """``tensorhub follow --engine-worker W`` pauses the engine (calls the driver's swap) only
    once W holds the new version; without it within --prefetch-wait, it swaps anyway."""
    import argparse

    import torch

    import tensorhub
    from tensorhub.follow import engine_holds, follow
    from tensorhub.testing import InMemoryTransport

    url = embedded.url
    pub = tensorhub.connect(url, worker_id="trainer", transport=InMemoryTransport())
    engine = tensorhub.connect(url, worker_id="eng", transport=InMemoryTransport())
    try:
        w = {"w": torch.arange(1 << 16, dtype=torch.float32)}
        swaps: list[tuple[int, bool, float]] = []

        def do_swap(client, v, show):
            swaps.append((v, engine_holds(engine.api.status(), "policy", v, "eng"), time.monotonic()))
            return 0.01

        def run(wait: float) -> None:
            args = argparse.Namespace(model="policy", max_swaps=1, coordinator=url, token_file=None,
                                      engine_worker="eng", prefetch_wait=wait)
            follow(args, "http://127.0.0.1:9", lambda client: (swaps[-1][0] if swaps else None, "start"), do_swap)

        t = threading.Thread(target=run, args=(30.0,), daemon=True)
        t.start()
        time.sleep(0.5)
        v1 = pub.publish("policy", w)
        time.sleep(1.5)  # the engine's prefetch lands later
        assert swaps == [], "follow swapped before the engine held the version"
        t_fetch = time.monotonic()
        engine.fetch("policy", v1)  # serve=True: the engine holds v1
        t.join(30)
        assert not t.is_alive() and len(swaps) == 1
        v, held, when = swaps[0]
        assert v == v1 and held and when >= t_fetch

        # No prefetch within the wait: it swaps anyway, and says so.
        t = threading.Thread(target=run, args=(1.0,), daemon=True)
        t.start()
        time.sleep(0.3)
        v2 = pub.publish("policy", w)
        t.join(30)
        assert [s[0] for s in swaps] == [v1, v2] and swaps[1][1] is False
        assert f"v{v2}: engine worker eng did not hold it" in capsys.readouterr().err
    finally:
        engine.close()
        pub.close()


def test_follow_learns_the_engines_prefetching_workers_from_the_engine(embedded, capsys):
    """Without ``--engine-worker``, follow asks the driver's ``workers`` query once and waits
    for the workers that prefetch the followed model and serve their copy; an engine that
    does not prefetch it (or cannot be asked) is swapped at once, and follow says why."""
    import argparse

    import torch

    import tensorhub
    from tensorhub.follow import engine_holds, follow, prefetching_workers
    from tensorhub.testing import InMemoryTransport

    me = {"worker_id": "eng", "model": "policy", "version": None, "serving": True, "prefetch": True}
    assert prefetching_workers("policy", [me, {**me, "worker_id": "eng-tp1", "serving": False}])[0] == ["eng"]
    ids, line = prefetching_workers("policy", [{**me, "prefetch": False}])
    assert ids == [] and "does not prefetch policy" in line and "eng (policy, prefetch off)" in line
    assert prefetching_workers("other", [me])[0] == []
    assert prefetching_workers("policy", [{"worker_id": None, "prefetch": False}])[0] == []
    assert prefetching_workers("policy", [{**me, "prefetch": "yes"}])[0] == []  # typed: true or nothing
    with pytest.raises(ValueError, match="not an engine worker's identity"):
        prefetching_workers("policy", ["engine-b"])

    url = embedded.url
    pub = tensorhub.connect(url, worker_id="trainer", transport=InMemoryTransport())
    engine = tensorhub.connect(url, worker_id="eng", transport=InMemoryTransport())
    try:
        w = {"w": torch.arange(1 << 12, dtype=torch.float32)}
        swaps: list[tuple[int, bool]] = []

        def do_swap(client, v, show):
            swaps.append((v, engine_holds(engine.api.status(), "policy", v, "eng")))
            return 0.01

        def run(workers) -> None:
            args = argparse.Namespace(model="policy", max_swaps=1, coordinator=url, token_file=None,
                                      engine_worker=None, prefetch_wait=30.0)
            follow(args, "http://127.0.0.1:9", lambda client: (swaps[-1][0] if swaps else None, "start"), do_swap,
                   workers=workers)

        t = threading.Thread(target=run, args=(lambda client: [me],), daemon=True)
        t.start()
        time.sleep(0.5)
        v1 = pub.publish("policy", w)
        time.sleep(1.0)
        assert swaps == [], "follow swapped before the engine's worker held the version"
        engine.fetch("policy", v1)
        t.join(30)
        assert swaps == [(v1, True)]
        out = capsys.readouterr()
        assert "engine worker(s) eng prefetch policy" in out.err
        assert f"v{v1}: stall 0.010s" in out.out and "the engine had prefetched it (waited" in out.out

        def unanswered(client):
            raise RuntimeError("/collective_rpc answered 404")

        t = threading.Thread(target=run, args=(unanswered,), daemon=True)
        t.start()
        time.sleep(0.3)
        v2 = pub.publish("policy", w)
        t.join(30)
        assert swaps[1] == (v2, False)  # swapped at once, without waiting
        err = capsys.readouterr().err
        assert "could not ask the engine for its TensorHub workers (/collective_rpc answered 404)" in err
    finally:
        engine.close()
        pub.close()


def test_a_borrow_dropped_without_release_gives_its_lease_back(coordinator, workers):
    """Misuse: a ``Borrowed`` dropped unreleased (no ``with``) is collected (its renewer
    holds no reference to it) and its lease released, so the holder's unpublish returns."""
    url = coordinator.url
    pub = workers(url, "pub", own_transport=True)
    v1 = pub.call("publish", seed=18, nbytes=4 * MiB, empty_like=True)
    pub.call("publish", seed=19, nbytes=4 * MiB, empty_like=True)  # v1 is not the newest
    reader = workers(url, "reader", own_transport=True)
    assert reader.call("borrow", version=v1, drop=True) == "dropped"
    assert pub.call("unpublish", version=v1, drain_timeout=20) < 5.0
