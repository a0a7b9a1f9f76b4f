"""Same-host fd exchange, hardened (issue 30, item 4): who may ask, what is sent, who answers.

* both ends check the other's uid (``SO_PEERCRED``: ours or root) before anything is sent
  or read: a local user of another uid who binds a holder's socket name first gets nothing,
  and the holder refuses to start, naming that process and ``TENSORHUB_SAMEHOST=0``;
* the reader proves its lease with the lease's secret (``protocol.lease_proof``); the API
  token never crosses the socket, and the coordinator checks the proof;
* only sources on the reader's own host (locality label) are asked;
* the fd server's threads do not grow with connections.

The local-user tests need root (they run a child as uid 65534); they are skipped otherwise.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
import socket
import threading
import time

import httpx
import pytest

import tensorhub
from tensorhub import TransferError
from tensorhub._reader import Source
from tensorhub.server.state import CoordinatorState, StateConfig
from tensorhub.protocol import AcquireLease, LeaseGrant, Locality, Manifest, RegisterReplica, TensorSpec, lease_proof
from tensorhub.testing import InMemoryTransport
from tensorhub.transport import DONE, PENDING, ReadOp
from tensorhub.transport import _arena as _arena_mod, _fdserver, _shm
from tensorhub.transport._shm import SameHostTransport, host_identity, socket_name

MiB = 1 << 20
NOBODY = 65534
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: runs a child process as another uid (65534)")


# ---------------------------------------------------------------------- helpers
def _read(reader: SameHostTransport, src: Source, ops: list[ReadOp], timeout: float = 20.0) -> int:
    h = reader.submit_from(src, ops)
    deadline = time.monotonic() + timeout
    while (st := reader.poll(h)) == PENDING:
        assert time.monotonic() < deadline, "read did not end"
        time.sleep(0.001)
    return st


def _squat(name: bytes, pipe) -> None:
    """Child: become uid/gid 65534, bind ``name`` first, and record what every connection
    sends (bytes per connection) until the parent says stop."""
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(name)
    srv.listen(16)
    srv.settimeout(0.05)
    pipe.send((os.getpid(), os.geteuid()))
    got: list[int] = []
    while not pipe.poll():
        try:
            conn, _ = srv.accept()
        except socket.timeout:
            continue
        n = 0
        conn.settimeout(3.0)
        try:
            while b := conn.recv(1 << 16):
                n += len(b)
        except OSError:  # kept open without sending more
            pass
        conn.close()
        got.append(n)
    pipe.send(got)


def _ask_as_nobody(name: bytes, request: bytes, pipe) -> None:
    """Child: as uid 65534, connect to ``name``, send ``request``, and report what came back."""
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10.0)
    s.connect(name)
    data, fds, err = b"", [], ""
    try:
        s.sendall(request)
        data, fds, _, _ = socket.recv_fds(s, 1 << 16, 250)
    except OSError as e:  # closed with the request unread: a reset
        err = repr(e)
    for fd in fds:
        os.close(fd)
    pipe.send((data, len(fds), err))


class Squatter:
    """A process of uid 65534 that binds ``name`` before we do."""

    def __init__(self, name: bytes) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        self.proc = ctx.Process(target=_squat, args=(name, child), daemon=True)
        self.proc.start()
        assert self.pipe.poll(60), "squatter did not start"
        self.pid, self.uid = self.pipe.recv()

    def received(self) -> list[int]:
        """Stop it; bytes each connection it accepted sent."""
        self.pipe.send("stop")
        assert self.pipe.poll(30)
        got = self.pipe.recv()
        self.proc.join(10)
        return got

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


class Listener:
    """A fd-socket stand-in of our own uid at ``name``: records each request, answers nothing."""

    def __init__(self, name: bytes) -> None:
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(name)
        self.srv.listen(16)
        self.requests: list[bytes] = []
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            conn.settimeout(5.0)
            try:
                self.requests.append(conn.recv(1 << 16))
            except OSError:
                self.requests.append(b"")
            conn.close()

    def close(self) -> None:
        self.srv.shutdown(socket.SHUT_RDWR)
        self.srv.close()
        self.t.join(5)


def _arena(nbytes: int, fill: int = 0):
    import torch

    a = _arena_mod.empty(nbytes)
    a.copy_(torch.arange(nbytes, dtype=torch.int64).remainder(251).to(torch.uint8) + fill)
    return a


# ---------------------------------------------------------------------- the coordinator's side (pure)
CFG = StateConfig(lease_ttl=10.0, worker_ttl=5.0, suspect_ttl=3.0, pause_grace=1e9, group_ttl=100.0)


def _state() -> CoordinatorState:
    s = CoordinatorState(CFG, now=0.0)
    for w in ("pub", "reader"):
        s.register_worker(0.0, w, f"ep-{w}", Locality(datacenter="d", zone="z", host="h"))
    man = Manifest(tensors=[TensorSpec(name="w", dtype="float32", shape=(4,), nbytes=16)])
    v = s.allocate_version(0.0, "m")
    s.register_replica(0.0, RegisterReplica(worker_id="pub", model="m", version=v, layout="hf", shard=0,
                                            num_shards=1, manifest=man, addresses=[4096]))
    return s


def test_the_grant_carries_the_lease_secret_only_when_asked_and_the_same_on_retry_and_refresh():
    s = _state()
    g = s.acquire_lease(1.0, AcquireLease(worker_id="reader", model="m", version=1, request_id="q1",
                                          lease_secret=True))
    assert len(g.secret) == 32 and int(g.secret, 16) >= 0  # 16 random bytes, hex
    again = s.acquire_lease(1.5, AcquireLease(worker_id="reader", model="m", version=1, request_id="q1",
                                              lease_secret=True))
    assert again.lease_id == g.lease_id and again.secret == g.secret  # a retried request: the same lease
    refreshed = s.acquire_lease(2.0, AcquireLease(worker_id="reader", model="m", version=1, lease_id=g.lease_id,
                                                  lease_secret=True))
    assert refreshed.lease_id == g.lease_id and refreshed.secret == g.secret
    other = s.acquire_lease(2.0, AcquireLease(worker_id="reader", model="m", version=1, lease_secret=True))
    assert other.secret != g.secret  # per lease
    # Not asked (an older reader): no secret, and none on the wire (extra="forbid" readers parse it).
    plain = s.acquire_lease(2.0, AcquireLease(worker_id="reader", model="m", version=1))
    assert plain.secret == "" and "secret" not in json.loads(plain.model_dump_json())
    assert LeaseGrant.model_validate_json(g.model_dump_json()).secret == g.secret


def test_lease_covers_only_with_the_readers_proof_for_that_holder():
    s = _state()
    g = s.acquire_lease(1.0, AcquireLease(worker_id="reader", model="m", version=1, lease_secret=True))
    rid = g.replicas[0].replica_id
    proof = lease_proof(g.secret, g.lease_id, rid, "ep-pub")
    assert s.lease_covers(2.0, g.lease_id, rid, "reader", proof, "ep-pub")
    assert not s.lease_covers(2.0, g.lease_id, rid, "reader")  # no proof (an older holder): never
    assert not s.lease_covers(2.0, g.lease_id, rid, "reader", "", "ep-pub")
    assert not s.lease_covers(2.0, g.lease_id, rid, "reader", "0" * 64, "ep-pub")  # wrong proof
    assert not s.lease_covers(2.0, g.lease_id, rid, "reader", proof, "ep-other")  # made for another holder
    assert not s.lease_covers(2.0, g.lease_id, rid, "reader", proof.upper(), "ep-pub")
    assert not s.lease_covers(2.0, g.lease_id, rid, "pub", proof, "ep-pub")  # not the asker's lease
    assert not s.lease_covers(2.0, g.lease_id, "r-other", "reader",
                              lease_proof(g.secret, g.lease_id, "r-other", "ep-pub"), "ep-pub")
    assert not s.lease_covers(12.0, g.lease_id, rid, "reader", proof, "ep-pub")  # lapsed


# ---------------------------------------------------------------------- real coordinator, real Hubs
@pytest.fixture
def hubs(tmp_path):
    """Hubs (own Mooncake transport, wrapped for same-host reads as in production) on an
    embedded coordinator with an API token."""
    from tensorhub.coordinator import EmbeddedCoordinator

    token = "api-token-not-for-sockets"
    made = []
    with EmbeddedCoordinator(tmp_path / "state", token=token, config=StateConfig(lease_ttl=10.0)) as c:
        def make(name: str, host: str = "a") -> tensorhub.Hub:
            h = tensorhub.connect(c.url, worker_id=name, token=token, locality=f"host={host}", heartbeat_interval=0.5)
            made.append(h)
            return h

        make.url, make.token = c.url, token
        yield make
        for h in made:
            h.close()


def _weights(seed: int = 1):
    import torch

    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randint(-1000, 1000, (64 * 1024,), generator=g, dtype=torch.int32) for i in range(4)}


def _ask_fds(endpoint: str, **req) -> tuple[dict, int]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(socket_name(endpoint))
    req.setdefault("host", dict(host_identity(), label="a"))
    s.sendall(json.dumps(req).encode())
    data, fds, _, _ = socket.recv_fds(s, 1 << 16, 250)
    s.close()
    for fd in fds:
        os.close(fd)
    return json.loads(data.decode()), len(fds)


def test_the_holder_serves_a_right_proof_and_refuses_a_wrong_or_absent_one(hubs):
    pub = hubs("pub")
    w = _weights()
    snap = pub.empty_like(w)
    for k in w:
        snap[k].copy_(w[k])
    v = pub.publish("policy", snap)
    ep = pub.endpoint
    api = httpx.Client(base_url=hubs.url, headers={"Authorization": f"Bearer {hubs.token}"}, timeout=10)
    assert api.post("/v1/workers", json={"worker_id": "asker", "endpoint": "", "locality": {"host": "a"}}).is_success
    grant = api.post("/v1/leases", json={"worker_id": "asker", "model": "policy", "version": v,
                                          "lease_secret": True}).json()
    lid, rid, secret = grant["lease_id"], grant["replicas"][0]["replica_id"], grant["secret"]
    ok = dict(lease_id=lid, replica_id=rid, worker_id="asker", proof=lease_proof(secret, lid, rid, ep))

    no_proof = {k: x for k, x in ok.items() if k != "proof"}
    for bad in (no_proof,  # absent
                dict(no_proof, token=hubs.token),  # the old form: the API token opens nothing now
                dict(ok, proof="0" * 64),  # wrong
                dict(ok, proof=lease_proof("00" * 16, lid, rid, ep)),  # another key
                dict(ok, proof=lease_proof(secret, lid, rid, "127.0.0.1:1")),  # made for another holder
                dict(ok, proof=ok["proof"][:-1]),  # malformed
                dict(ok, worker_id="pub")):  # someone else's lease
        ans, n = _ask_fds(ep, **bad)
        assert n == 0 and not ans["arenas"] and "proof" in ans["why"], (bad, ans)
    ans, n = _ask_fds(ep, **ok)
    assert n >= 1 and ans["arenas"], ans  # the right proof: the memory

    # The coordinator's route: the proof in a body (never a URL), checked there.
    body = {"worker_id": "asker", "replica_id": rid, "endpoint": ep}
    assert api.post(f"/v1/leases/{lid}/covers", json=dict(body, proof=ok["proof"])).json() == {"valid": True}
    assert api.post(f"/v1/leases/{lid}/covers", json=dict(body, proof="1" * 64)).json() == {"valid": False}
    assert api.post(f"/v1/leases/{lid}/covers", json=body).json() == {"valid": False}
    api.post(f"/v1/leases/{lid}/release")
    ans, n = _ask_fds(ep, **ok)  # released: the proof opens nothing any more
    assert n == 0 and "lease" in ans["why"], ans


def test_only_sources_on_this_host_are_asked_and_the_token_is_never_sent(hubs, monkeypatch):
    """Through the Hub: a reader on another host (locality label) never connects to a fd
    socket; one on the holder's host asks (and copies), sending a proof, never the token."""
    pub = hubs("pub", host="a")
    w = _weights(2)
    snap = pub.empty_like(w)
    for k in w:
        snap[k].copy_(w[k])
    v = pub.publish("policy", snap)
    far, near = hubs("far", host="b"), hubs("near", host="a")
    far.endpoint, near.endpoint  # transports up (their own servers bound) before we count
    asked: list[str] = []
    sent: list[bytes] = []
    real_name, real_sendall = _shm.socket_name, socket.socket.sendall

    def counting(endpoint: str) -> bytes:
        asked.append(endpoint)
        return real_name(endpoint)

    def recording(self, data, *a):
        if self.family == socket.AF_UNIX:
            sent.append(bytes(data))
        return real_sendall(self, data, *a)

    monkeypatch.setattr(_shm, "socket_name", counting)
    monkeypatch.setattr(socket.socket, "sendall", recording)
    got = far.fetch("policy", v, serve=False)
    assert all(bool((got[k] == w[k]).all()) for k in w)
    assert asked == [] and sent == []  # another host: no connection attempt at all
    t_far = far._session.transport()
    assert t_far.copied_bytes == 0 and t_far.inner_batches > 0
    got = near.fetch("policy", v, serve=False)
    assert all(bool((got[k] == w[k]).all()) for k in w)
    assert asked == [pub.endpoint] and near._session.transport().copied_bytes == sum(x.nbytes for x in w.values())
    req = json.loads(sent[0])
    assert sorted(req) == ["host", "lease_id", "proof", "replica_id", "worker_id"], req
    assert hubs.token not in sent[0].decode()


def test_a_reader_without_a_lease_secret_asks_nobody():
    """A source without the lease's secret (an older coordinator) or on another host is
    read over the wrapped transport; the holder's socket is never connected to."""
    holder = InMemoryTransport()
    ep = holder.start()
    data = _arena(MiB)
    holder.register(data.data_ptr(), MiB)
    lis = Listener(socket_name(ep))
    reader = SameHostTransport(InMemoryTransport(), host_label="a", authorize=lambda *a: None, worker_id="r")
    try:
        reader.start()
        import torch

        dst = torch.zeros(MiB, dtype=torch.uint8)
        reader.register(dst.data_ptr(), MiB)
        ops = [ReadOp(dst.data_ptr(), data.data_ptr(), MiB)]
        for src in [Source("r1", "h", ep, (), "l0", host="a"),  # no secret
                    Source("r1", "h", ep, (), "l1", secret="k" * 32, host="b"),  # another host
                    Source("r1", "h", ep, (), "l2", secret="k" * 32)]:  # host unknown
            dst.zero_()
            assert _read(reader, src, ops) == DONE and torch.equal(dst, data)
        assert lis.requests == [] and reader.copied_bytes == 0 and reader.inner_batches == 3
        # On this host with the secret: asked (the stand-in answers nothing: read over inner).
        dst.zero_()
        assert _read(reader, Source("r1", "h", ep, (), "l3", secret="k" * 32, host="a"), ops) == DONE
        assert torch.equal(dst, data)
        deadline = time.monotonic() + 5
        while not lis.requests and time.monotonic() < deadline:
            time.sleep(0.01)
        req = json.loads(lis.requests[0])
        assert req["proof"] == lease_proof("k" * 32, "l3", "r1", ep) and "token" not in req
    finally:
        lis.close()
        reader.close()
        holder.close()


def test_fd_server_threads_stay_bounded_under_500_idle_connections():
    """500 connections that send nothing: no thread each (a fixed accept thread and four
    handlers); the server keeps at most 64 waiting (a new one closes the oldest) and closes
    each after 2 s. A reader that connects *while they are open* is served at once: its
    request comes with its connection."""
    import torch

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2048:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
    data = _arena(4 * MiB, 3)
    asked = []

    def authorize(lease, replica, worker, proof, endpoint):
        asked.append(lease)
        ok = proof == lease_proof("s" * 32, lease, replica, endpoint)
        return [(data.data_ptr(), 4 * MiB)] if ok else None

    base = threading.active_count()
    holder = SameHostTransport(InMemoryTransport(), host_label="a", authorize=authorize, worker_id="holder")
    reader = SameHostTransport(InMemoryTransport(), host_label="a", authorize=lambda *a: None, worker_id="reader")
    idle: list[socket.socket] = []
    try:
        ep = holder.start()
        holder.register(data.data_ptr(), 4 * MiB)
        reader.start()
        started = threading.active_count()
        # an accept thread and the handlers, for the holder's server and the reader's own
        assert started - base <= 2 * (1 + _fdserver._HANDLERS), (base, started)
        for _ in range(500):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.connect(socket_name(ep))  # (blocking: waits while the backlog is full)
            idle.append(c)
        time.sleep(0.3)
        assert threading.active_count() <= started, (started, threading.active_count())
        # A legitimate reader, while the idle connections are still open: served by copy.
        dst = torch.zeros(4 * MiB, dtype=torch.uint8)
        reader.register(dst.data_ptr(), dst.nbytes)
        t0 = time.monotonic()
        src = Source("r1", "holder", ep, (), "lease-1", secret="s" * 32, host="a")
        assert _read(reader, src, [ReadOp(dst.data_ptr(), data.data_ptr(), 4 * MiB)]) == DONE
        assert torch.equal(dst, data) and reader.copied_bytes == 4 * MiB and reader.inner_batches == 0
        assert time.monotonic() - t0 < 1.5 and asked == ["lease-1"]
        assert threading.active_count() <= started + 4 + 1  # + the reader's copy pool and sweeper
        # Every idle connection is closed by the server within its receive timeout.
        deadline = time.monotonic() + _fdserver._RECV_TIMEOUT + 5
        for c in idle:
            c.settimeout(max(0.01, deadline - time.monotonic()))
            assert c.recv(1) == b""
    finally:
        for c in idle:
            c.close()
        reader.close()
        holder.close()


# ---------------------------------------------------------------------- a local user of another uid
@root_only
def test_a_squatter_of_another_uid_is_sent_nothing_and_the_reader_falls_back():
    """A process of uid 65534 bound a holder's socket name first: the reader checks the
    server's uid right after connect and sends nothing (the squatter receives zero bytes);
    the bytes come over the wrapped transport."""
    import torch

    holder = InMemoryTransport()
    ep = holder.start()
    data = _arena(2 * MiB, 5)
    holder.register(data.data_ptr(), 2 * MiB)
    squatter = Squatter(socket_name(ep))
    reader = SameHostTransport(InMemoryTransport(), host_label="a", authorize=lambda *a: None, worker_id="reader")
    try:
        reader.start()
        dst = torch.zeros(2 * MiB, dtype=torch.uint8)
        reader.register(dst.data_ptr(), dst.nbytes)
        src = Source("r1", "holder", ep, (), "lease-1", secret="s" * 32, host="a")
        assert _read(reader, src, [ReadOp(dst.data_ptr(), data.data_ptr(), 2 * MiB)]) == DONE
        assert torch.equal(dst, data) and reader.copied_bytes == 0 and reader.inner_batches == 1
        got = squatter.received()
        assert got == [0], got  # it was connected to (and identified), and sent nothing
    finally:
        squatter.kill()
        reader.close()
        holder.close()


@root_only
def test_the_holder_refuses_to_start_when_another_uid_holds_its_socket_name(embedded):
    inner = InMemoryTransport()
    ep = inner.start()  # (idempotent: the wrapper's start gets the same endpoint)
    name = socket_name(ep)
    squatter = Squatter(name)
    try:
        t = SameHostTransport(inner, host_label="a", authorize=lambda *a: None, worker_id="holder")
        with pytest.raises(TransferError) as e:
            t.start()
        msg = str(e.value)
        for part in ("@tensorhub-samehost:" + ep, f"pid {squatter.pid}", f"uid {NOBODY}", "TENSORHUB_SAMEHOST=0"):
            assert part in msg, msg
        with pytest.raises(TransferError, match="TENSORHUB_SAMEHOST=0"):
            t.start()  # again at every use, not a one-time log line
        t.close()
        # Through a Hub: the first call that starts the data plane raises it, and the next.
        inner2 = InMemoryTransport()
        ep2 = inner2.start()
        squatter2 = Squatter(socket_name(ep2))
        try:
            hub = tensorhub.connect(embedded.url, worker_id="pub", heartbeat_interval=0.2,
                                    transport=SameHostTransport(inner2, host_label="a", authorize=lambda *a: None,
                                                                worker_id="pub"))
            try:
                with pytest.raises(TransferError, match=f"pid {squatter2.pid}.*TENSORHUB_SAMEHOST=0"):
                    hub.publish("policy", _weights())
                with pytest.raises(TransferError, match="already bound"):
                    hub.endpoint
            finally:
                hub.close()
            assert squatter2.received() == [0]  # identified by SO_PEERCRED; nothing sent
        finally:
            squatter2.kill()
        assert squatter.received() == [0]  # probed once (the second start repeats the error), silent
    finally:
        squatter.kill()


@root_only
def test_the_holder_answers_nothing_to_a_peer_of_another_uid():
    """A connection from uid 65534 is closed before its request is read: no answer, no fd,
    even for a request the holder would accept from its own uid."""
    data = _arena(MiB)
    asked = []

    def authorize(*a):
        asked.append(a)
        return [(data.data_ptr(), MiB)]

    holder = SameHostTransport(InMemoryTransport(), host_label="a", authorize=authorize, worker_id="holder")
    try:
        ep = holder.start()
        request = json.dumps({"lease_id": "l", "replica_id": "r", "worker_id": "w", "proof": "a" * 64,
                              "host": dict(host_identity(), label="a")}).encode()
        ctx = multiprocessing.get_context("spawn")
        pipe, child = ctx.Pipe()
        p = ctx.Process(target=_ask_as_nobody, args=(socket_name(ep), request, child), daemon=True)
        p.start()
        assert pipe.poll(60)
        data_back, nfds, err = pipe.recv()
        p.join(10)
        assert data_back == b"" and nfds == 0 and asked == [], (data_back, err, asked)
        # Our own uid, same request: answered (the uid was the only difference).
        ans, n = _ask_fds(ep, **json.loads(request))
        assert n == 1 and asked, ans
    finally:
        holder.close()
