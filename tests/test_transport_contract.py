"""One contract, every transport: InMemoryTransport and MooncakeTransport pass the same tests.

Tiers: the parametrized contract (both transports, one process); fault controls of the
test double; Mooncake-only checks (missing-library message, in-flight window); and a
multi-process test (spawn) with a real 64 MiB source that is hung, resumed and killed.
"""

from __future__ import annotations

import importlib.abc
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tensorhub import ConfigError, TransferError, TransportUnavailableError
from tensorhub.testing import InMemoryTransport
from tensorhub.transport import (
    DONE,
    MAX_BATCH_ENTRIES,
    MAX_ENTRY_BYTES,
    PENDING,
    MooncakeTransport,
    ReadOp,
    Transport,
    create_transport,
)
from tensorhub.transport._mooncake import PROGRESS_TIMEOUT_VAR, mooncake_available
from tensorhub.transport._shm import SameHostTransport

ROOT = Path(__file__).resolve().parents[1]
FIX_PIP = "pip install 'tensorhub-ros[cpu]'"
FIX_APT = "apt-get install -y libibverbs1"


def _need_mooncake() -> None:
    reason = mooncake_available()
    if reason is None:
        return
    if os.environ.get("CI"):  # CI installs Mooncake: never skip there
        pytest.fail(reason)
    pytest.skip(reason)


# ---------------------------------------------------------------------------- helpers
def pattern(n: int, seed: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(seed).bytes(n), dtype=np.uint8).copy()


def addr(a: np.ndarray, off: int = 0) -> int:
    return a.ctypes.data + off


def wait(t: Transport, handle: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        code = t.poll(handle)
        if code != PENDING:
            return code
        if time.monotonic() > deadline:
            pytest.fail(f"read still pending after {timeout} s")
        time.sleep(0.0005)


def read(t: Transport, peer: str, ops: list[ReadOp], timeout: float = 10.0) -> int:
    """DONE, or the negative code of a failure (raised at submit or answered by poll)."""
    try:
        handle = t.submit_read(peer, ops)
    except TransferError as e:
        assert e.code < 0 and e.op == "read" and e.peer == peer
        return e.code
    return wait(t, handle, timeout)


class Env:
    """Makes started transports of one kind and keeps buffers alive until they are closed."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.transports: list[Transport] = []
        self.buffers: list[np.ndarray] = []

    def transport(self, start: bool = True, **kw) -> Transport:
        t: Transport = InMemoryTransport(**kw) if self.kind == "memory" else MooncakeTransport(**kw)
        if self.kind == "samehost":  # Mooncake wrapped for same-host reads (no holder serves fds here)
            t = SameHostTransport(t, token=None, host_label="", authorize=lambda *a: None, worker_id="contract")
        self.transports.append(t)
        if start:
            t.start()
        return t

    def buffer(self, n: int, seed: int | None = None) -> np.ndarray:
        b = np.zeros(n, dtype=np.uint8) if seed is None else pattern(n, seed)
        self.buffers.append(b)
        return b

    def source(self, n: int, seed: int = 1, **kw) -> tuple[Transport, np.ndarray]:
        t = self.transport(**kw)
        b = self.buffer(n, seed)
        t.register(addr(b), n)
        return t, b

    def sink(self, n: int, **kw) -> tuple[Transport, np.ndarray]:
        t = self.transport(**kw)
        b = self.buffer(n)
        t.register(addr(b), n)
        return t, b

    def close(self) -> None:
        for t in self.transports:
            t.close()


@pytest.fixture(params=["memory", "mooncake", "samehost"])
def env(request):
    if request.param != "memory":
        _need_mooncake()
    e = Env(request.param)
    yield e
    e.close()


# ---------------------------------------------------------------------------- contract
def test_start_returns_a_stable_endpoint(env):
    a, b = env.transport(start=False), env.transport(start=False)
    with pytest.raises(TransferError):
        a.endpoint
    with pytest.raises(TransferError):  # memory is registered with a running transport only
        a.register(addr(env.buffer(64)), 64)
    ea = a.start()
    assert a.start() == ea == a.endpoint
    assert b.start() != ea
    if env.kind == "memory":
        assert ea.startswith("memory://")
    else:
        host, port = ea.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0


def test_register_is_reference_counted_and_refuses_partial_overlap(env):
    t, b = env.source(1 << 16)
    reader, dst = env.sink(1 << 16)
    base = addr(b)
    t.register(base + 128, 256)  # inside: one more reference
    t.register(base, 1 << 16)
    assert t.registered_regions() == [(base, 1 << 16)]
    other = env.buffer(1 << 16)
    with pytest.raises(TransferError) as ei:
        t.register(base + (1 << 15), 1 << 16)  # half in, half out
    assert ei.value.code < 0 and ei.value.op == "register"
    t.register(addr(other), 1 << 16)  # disjoint region is fine
    assert len(t.registered_regions()) == 2
    t.unregister(base + 128, 256)
    t.unregister(base, 1 << 16)
    assert read(reader, t.endpoint, [ReadOp(addr(dst), base, 4096)]) == DONE  # one reference left
    t.unregister(base, 1 << 16)
    assert t.registered_regions() == [(addr(other), 1 << 16)]
    with pytest.raises(TransferError):
        t.unregister(base, 1 << 16)
    # Unregistered means unreadable for peers, and the reader keeps working.
    assert read(reader, t.endpoint, [ReadOp(addr(dst), base, 4096)]) < 0
    assert read(reader, t.endpoint, [ReadOp(addr(dst), addr(other), 4096)]) == DONE
    with pytest.raises(TransferError):
        t.register(base, 0)


def test_batch_read_copies_exact_bytes(env):
    n = 1 << 20
    src, s = env.source(n, seed=7)
    dst, d = env.sink(n)
    # Scattered, odd-sized, out-of-order entries; the rest of d must stay untouched.
    pieces = [(900_001, 0, 77), (5, 1000, 4093), (123_457, 70_000, 300_000), (0, n - 1, 1)]
    ops = [ReadOp(addr(d, lo), addr(s, ro), ln) for ro, lo, ln in pieces]
    assert read(dst, src.endpoint, ops) == DONE
    expect = np.zeros(n, dtype=np.uint8)
    for ro, lo, ln in pieces:
        expect[lo : lo + ln] = s[ro : ro + ln]
    assert np.array_equal(d, expect)


def test_done_means_every_entry_landed(env):
    # Mooncake's transfer_check_status looks at entry 0 only; DONE must still mean all.
    n = 32 << 20
    src, s = env.source(n + 4096, seed=3)
    dst, d = env.sink(n + 4096)
    ops = [ReadOp(addr(d), addr(s), 4096), ReadOp(addr(d, 4096), addr(s, 4096), n)]
    h = dst.submit_read(src.endpoint, ops)
    assert wait(dst, h) == DONE
    assert np.array_equal(d, s)  # checked the moment DONE was answered
    # ...and a bad later entry fails the batch even though entry 0 succeeds.
    bogus = addr(s) + n + 8192
    bad = [ReadOp(addr(d), addr(s), 4096), ReadOp(addr(d, 4096), bogus, 4096)]
    assert read(dst, src.endpoint, bad) < 0


def test_striping_across_two_sources(env):
    n = 4 << 20
    a, sa = env.source(n, seed=11)
    b, sb = env.source(n, seed=11)
    assert np.array_equal(sa, sb)
    reader, d = env.sink(n)
    half = n // 2
    ha = reader.submit_read(a.endpoint, [ReadOp(addr(d), addr(sa), half)])
    hb = reader.submit_read(b.endpoint, [ReadOp(addr(d, half), addr(sb, half), half)])
    assert ha != hb
    assert wait(reader, hb) == DONE and wait(reader, ha) == DONE
    assert np.array_equal(d, sa)
    if env.kind == "memory":
        assert a.bytes_served == b.bytes_served == half


def test_unregistered_remote_range_fails_and_the_transport_keeps_working(env):
    n = 1 << 20
    src, s = env.source(n, seed=5)
    dst, d = env.sink(n)
    stray = env.buffer(n, seed=6)  # never registered at the source
    assert read(dst, src.endpoint, [ReadOp(addr(d), addr(stray), 4096)]) < 0
    assert read(dst, src.endpoint, [ReadOp(addr(d), addr(s, 16), n)]) < 0  # runs past the end
    assert read(dst, src.endpoint, [ReadOp(addr(d), addr(s), n)]) == DONE
    assert np.array_equal(d, s)


def test_destination_must_be_registered(env):
    src, s = env.source(1 << 16)
    dst, d = env.sink(1 << 16)
    loose = env.buffer(1 << 16)
    with pytest.raises(TransferError) as ei:
        dst.submit_read(src.endpoint, [ReadOp(addr(loose), addr(s), 4096)])
    assert ei.value.code < 0 and ei.value.peer == src.endpoint
    with pytest.raises(TransferError):  # runs past the end of the registered region
        dst.submit_read(src.endpoint, [ReadOp(addr(d, 8), addr(s), 1 << 16)])
    assert not loose.any()


def test_reading_from_a_closed_peer_fails_fast(env):
    src, s = env.source(1 << 20)
    dst, d = env.sink(1 << 20)
    ops = [ReadOp(addr(d), addr(s), 1 << 20)]
    assert read(dst, src.endpoint, ops) == DONE  # the reader knows the peer
    unseen, u = env.source(1 << 20)  # ...but has never contacted this one
    src.close()
    unseen.close()
    for peer, op in ((src.endpoint, ops), (unseen.endpoint, [ReadOp(addr(d), addr(u), 4096)])):
        t0 = time.monotonic()
        assert read(dst, peer, op, timeout=2.0) < 0
        assert time.monotonic() - t0 < 2.0


def test_batch_limits(env):
    src, s = env.source(1 << 16)
    dst, d = env.sink(1 << 16)
    one = ReadOp(addr(d), addr(s), 1)
    for ops in (
        [],
        [one] * (MAX_BATCH_ENTRIES + 1),
        [ReadOp(addr(d), addr(s), MAX_ENTRY_BYTES + 1)],
        [ReadOp(addr(d), addr(s), 0)],
    ):
        with pytest.raises(TransferError) as ei:
            dst.submit_read(src.endpoint, ops)
        assert ei.value.code < 0
    assert read(dst, src.endpoint, [one] * MAX_BATCH_ENTRIES) == DONE


def test_poll_unknown_and_finished_handles(env):
    src, s = env.source(1 << 16, seed=2)
    dst, d = env.sink(1 << 16)
    with pytest.raises(TransferError):
        dst.poll(12345)
    h = dst.submit_read(src.endpoint, [ReadOp(addr(d), addr(s), 1 << 16)])
    assert wait(dst, h) == DONE
    with pytest.raises(TransferError):  # a terminal answer freed the handle
        dst.poll(h)
    h = dst.submit_read(src.endpoint, [ReadOp(addr(d), addr(s) + (1 << 20), 16)])
    assert wait(dst, h) < 0
    with pytest.raises(TransferError):
        dst.poll(h)


def test_close_is_idempotent_and_unregisters(env):
    src, s = env.source(1 << 16)
    dst, d = env.sink(1 << 16)
    h = dst.submit_read(src.endpoint, [ReadOp(addr(d), addr(s), 1 << 16)])
    wait(dst, h)
    dst.close()
    dst.close()
    assert dst.registered_regions() == []
    with pytest.raises(TransferError):
        dst.submit_read(src.endpoint, [ReadOp(addr(d), addr(s), 16)])
    with pytest.raises(TransferError):
        dst.register(addr(d), 16)
    with pytest.raises(TransferError):
        dst.poll(h)
    with pytest.raises(TransferError):
        dst.start()
    # The source is unaffected by its reader going away.
    other, o = env.sink(1 << 16)
    assert read(other, src.endpoint, [ReadOp(addr(o), addr(s), 1 << 16)]) == DONE


def test_full_batches_in_flight_together_to_one_peer(env):
    # 2 x 2048 entries at once: past Mooncake's per-peer admission limit (2048),
    # which the transport must keep the engine below.
    e = 4096
    n = 2 * MAX_BATCH_ENTRIES * e
    src, s = env.source(n, seed=9)
    dst, d = env.sink(n)
    handles = []
    for k in range(2):
        base = k * MAX_BATCH_ENTRIES * e
        ops = [ReadOp(addr(d, base + i * e), addr(s, base + i * e), e) for i in range(MAX_BATCH_ENTRIES)]
        handles.append(dst.submit_read(src.endpoint, ops))
    assert [wait(dst, h, timeout=20) for h in handles] == [DONE, DONE]
    assert np.array_equal(d, s)


def test_threads_share_one_transport(env):
    n = 1 << 20
    src, s = env.source(n, seed=4)
    dst, d = env.sink(n)
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        rng = np.random.default_rng(k)
        lo = k * (n // 4)
        try:
            for _ in range(20):
                ro = int(rng.integers(0, n - 8192))
                ln = int(rng.integers(1, 8192))
                assert read(dst, src.endpoint, [ReadOp(addr(d, lo), addr(s, ro), ln)]) == DONE
                assert np.array_equal(d[lo : lo + ln], s[ro : ro + ln])
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors[0]


# ---------------------------------------------------------------------------- the test double
@pytest.fixture
def mem():
    e = Env("memory")
    yield e
    e.close()


def test_memory_hang_keeps_reads_pending_until_resume(mem):
    src, s = mem.source(1 << 20, seed=8)
    dst, d = mem.sink(1 << 20)
    InMemoryTransport.hang(src.endpoint)
    h = dst.submit_read(src.endpoint, [ReadOp(addr(d), addr(s), 1 << 20)])
    time.sleep(0.2)
    assert dst.poll(h) == PENDING and not d.any()
    InMemoryTransport.resume(src.endpoint)
    assert wait(dst, h) == DONE
    assert np.array_equal(d, s)


def test_memory_kill_fails_a_read_in_the_middle_and_every_later_one(mem):
    n = 1 << 20
    src, s = mem.source(n, seed=8, bandwidth=2e6)  # ~0.5 s for the whole read
    dst, d = mem.sink(n)
    h = dst.submit_read(src.endpoint, [ReadOp(addr(d), addr(s), n)])
    deadline = time.monotonic() + 5
    while src.bytes_served == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert 0 < src.bytes_served < n and dst.poll(h) == PENDING
    InMemoryTransport.kill(src.endpoint)
    t0 = time.monotonic()
    assert wait(dst, h) < 0
    assert time.monotonic() - t0 < 0.5
    assert read(dst, src.endpoint, [ReadOp(addr(d), addr(s), 16)]) < 0


def test_memory_bandwidth_shows_partial_progress(mem):
    n = 1 << 20
    src, s = mem.source(n, seed=12, bandwidth=4e6)  # ~0.26 s
    dst, d = mem.sink(n)
    t0 = time.monotonic()
    h = dst.submit_read(src.endpoint, [ReadOp(addr(d), addr(s), n)])
    time.sleep(0.1)
    assert dst.poll(h) == PENDING
    copied = int(np.count_nonzero(d == s))
    assert n // 20 < copied < n
    assert wait(dst, h) == DONE
    assert time.monotonic() - t0 >= n / 4e6 * 0.9
    assert np.array_equal(d, s)


def test_memory_progress_timeout_fails_reads_from_a_hung_source(mem):
    src, s = mem.source(4096)
    dst, d = mem.sink(4096, progress_timeout=0.2)
    InMemoryTransport.hang(src.endpoint)
    t0 = time.monotonic()
    assert read(dst, src.endpoint, [ReadOp(addr(d), addr(s), 4096)]) < 0
    assert 0.15 < time.monotonic() - t0 < 2
    InMemoryTransport.resume(src.endpoint)
    assert read(dst, src.endpoint, [ReadOp(addr(d), addr(s), 4096)]) == DONE


def test_memory_close_ends_reads_stuck_on_a_hung_source(mem):
    src, s = mem.source(4096)
    dst, d = mem.sink(4096)
    InMemoryTransport.hang(src.endpoint)
    dst.submit_read(src.endpoint, [ReadOp(addr(d), addr(s), 4096)])
    t0 = time.monotonic()
    dst.close()
    assert time.monotonic() - t0 < 1 and not d.any()
    InMemoryTransport.resume(src.endpoint)


def test_memory_rejects_bad_settings():
    with pytest.raises(ConfigError):
        InMemoryTransport(bandwidth=0)
    with pytest.raises(ConfigError):
        InMemoryTransport(progress_timeout=-1)


# ---------------------------------------------------------------------------- Mooncake specifics
def test_missing_mooncake_names_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    reason = mooncake_available()
    assert reason is not None and FIX_PIP in reason and FIX_APT in reason
    t = MooncakeTransport()
    with pytest.raises(TransportUnavailableError) as ei:
        t.start()
    assert isinstance(ei.value, ImportError)
    assert "not installed" in str(ei.value) and FIX_PIP in str(ei.value) and FIX_APT in str(ei.value)
    with pytest.raises(TransferError):
        t.endpoint
    t.close()


@pytest.mark.parametrize("exc_type", [ImportError, OSError])
def test_missing_libibverbs_names_the_fix(monkeypatch, exc_type):
    class NoVerbs(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "mooncake.engine":
                raise exc_type("libibverbs.so.1: cannot open shared object file: No such file or directory")
            return None

    monkeypatch.delitem(sys.modules, "mooncake.engine", raising=False)
    monkeypatch.setattr(sys, "meta_path", [NoVerbs(), *sys.meta_path])
    with pytest.raises(TransportUnavailableError) as ei:
        MooncakeTransport().start()
    msg = str(ei.value)
    assert "libibverbs.so.1" in msg and FIX_APT in msg and FIX_PIP in msg
    assert mooncake_available() == msg


def test_importing_loads_neither_mooncake_nor_torch():
    code = (
        "import sys, tensorhub.transport, tensorhub.testing\n"
        "bad = [m for m in ('mooncake', 'mooncake.engine', 'torch') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=env, timeout=60)


def test_create_transport(monkeypatch):
    monkeypatch.delenv("TENSORHUB_TRANSPORT", raising=False)
    assert isinstance(create_transport(), MooncakeTransport)  # default; no I/O before start()
    assert isinstance(create_transport("memory"), InMemoryTransport)
    monkeypatch.setenv("TENSORHUB_TRANSPORT", "memory")
    assert isinstance(create_transport(), InMemoryTransport)
    assert isinstance(create_transport("mooncake", host="127.0.0.1"), MooncakeTransport)
    monkeypatch.setenv("TENSORHUB_TRANSPORT", "rdma")
    with pytest.raises(ConfigError, match="TENSORHUB_TRANSPORT"):
        create_transport()
    with pytest.raises(ConfigError):
        create_transport("carrier-pigeon")


def test_mooncake_start_and_close_leak_no_file_descriptors():
    _need_mooncake()

    def cycle() -> None:
        a, b = MooncakeTransport(), MooncakeTransport()
        src, dst = pattern(4096, 1), np.zeros(4096, dtype=np.uint8)
        a.start(), b.start()
        a.register(addr(src), 4096), b.register(addr(dst), 4096)
        assert read(b, a.endpoint, [ReadOp(addr(dst), addr(src), 4096)]) == DONE
        a.close(), b.close()

    cycle()  # first use loads the library and its process-wide state
    before = len(os.listdir("/proc/self/fd"))
    t0 = time.monotonic()
    for _ in range(3):
        cycle()
    assert len(os.listdir("/proc/self/fd")) == before
    assert time.monotonic() - t0 < 3  # close() does not stall ~1 s per engine


def test_mooncake_rejects_a_bad_progress_timeout():
    with pytest.raises(ConfigError):
        MooncakeTransport(progress_timeout=0).start()


def test_mooncake_window_holds_back_entries_past_the_per_peer_limit():
    _need_mooncake()
    e = Env("mooncake")
    try:
        src, s = e.source(1 << 20, seed=13)
        dst, d = e.sink(1 << 20)
        dst.max_inflight_per_peer = 3
        chunk = 4096
        handles = [
            dst.submit_read(
                src.endpoint,
                [ReadOp(addr(d, (k * 64 + i) * chunk), addr(s, (k * 64 + i) * chunk), chunk) for i in range(64)],
            )
            for k in range(4)
        ]
        assert [wait(dst, h) for h in handles] == [DONE] * 4
        assert np.array_equal(d, s)
        assert dst._inflight == {}  # every slot given back
    finally:
        e.close()


# ---------------------------------------------------------------------------- multi-process
def _serve(q, nbytes: int, seed: int) -> None:
    """Child: hold ``nbytes`` of a known pattern in registered memory until killed."""
    t = MooncakeTransport(host="127.0.0.1")
    endpoint = t.start()
    buf = pattern(nbytes, seed)
    t.register(addr(buf), nbytes)
    q.put((endpoint, addr(buf)))
    while True:
        time.sleep(60)


def _read_hung(endpoint: str, remote: int, nbytes: int, go, out) -> None:
    """Child: a fresh reader with progress_timeout=0.5 s reads from a source the parent stops."""
    os.environ.pop(PROGRESS_TIMEOUT_VAR, None)  # inherited from the parent's own transports
    t = MooncakeTransport(host="127.0.0.1", progress_timeout=0.5)
    t.start()
    d = np.zeros(nbytes, dtype=np.uint8)
    t.register(addr(d), nbytes)
    ops = [ReadOp(addr(d), remote, nbytes)]
    out.put((read(t, endpoint, ops), os.environ.get(PROGRESS_TIMEOUT_VAR)))
    go.get(timeout=60)
    t0 = time.monotonic()
    code = read(t, endpoint, ops, timeout=30)
    out.put((code, time.monotonic() - t0))
    t.close()


@pytest.mark.multiprocess
def test_multiprocess_read_hung_and_dead_source():
    _need_mooncake()
    n, seed = 64 << 20, 21
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    server = ctx.Process(target=_serve, args=(q, n, seed), daemon=True)
    server.start()
    reader = MooncakeTransport(host="127.0.0.1")
    hung_reader = None
    try:
        endpoint, remote = q.get(timeout=60)
        reader.start()
        expect = pattern(n, seed)
        d = np.zeros(n, dtype=np.uint8)
        reader.register(addr(d), n)
        quarter = n // 4
        ops = [ReadOp(addr(d, i * quarter), remote + i * quarter, quarter) for i in range(4)]
        assert read(reader, endpoint, ops, timeout=30) == DONE
        assert np.array_equal(d, expect)  # every byte

        # Hung source: a reader with progress_timeout=0.5 gives up after ~1 s (whole seconds).
        go, out = ctx.Queue(), ctx.Queue()
        hung_reader = ctx.Process(target=_read_hung, args=(endpoint, remote, 1 << 20, go, out), daemon=True)
        hung_reader.start()
        warm, var = out.get(timeout=60)
        assert warm == DONE and var == "1"
        os.kill(server.pid, signal.SIGSTOP)
        try:
            go.put(1)
            code, took = out.get(timeout=30)
        finally:
            os.kill(server.pid, signal.SIGCONT)
        assert code < 0 and 0.5 < took < 5, (code, took)
        hung_reader.join(30)
        d[:] = 0
        assert read(reader, endpoint, ops, timeout=30) == DONE  # resumed source serves again
        assert np.array_equal(d, expect)

        # Dead source: fails fast.
        os.kill(server.pid, signal.SIGKILL)
        server.join(10)
        t0 = time.monotonic()
        assert read(reader, endpoint, ops, timeout=2.0) < 0
        assert time.monotonic() - t0 < 2.0
    finally:
        for p in (server, hung_reader):
            if p is not None and p.is_alive():
                p.kill()
                p.join(10)
        reader.close()


@pytest.mark.multiprocess
def test_multiprocess_first_contact_with_a_stopped_peer_does_not_block():
    """The first read from a peer makes Mooncake's handshake, which blocks ~60 s on a peer
    that accepts connections but never answers. submit_read returns at once instead; the
    batch is PENDING, can be cancelled (and then writes nothing), and batches submitted
    meanwhile go out once the peer answers."""
    _need_mooncake()
    n, seed = 1 << 20, 5
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    server = ctx.Process(target=_serve, args=(q, n, seed), daemon=True)
    server.start()
    reader = MooncakeTransport(host="127.0.0.1")
    try:
        endpoint, remote = q.get(timeout=60)
        reader.start()
        expect = pattern(n, seed)
        d = np.zeros(n, dtype=np.uint8)
        reader.register(addr(d), n)
        half = n // 2
        os.kill(server.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            first = reader.submit_read(endpoint, [ReadOp(addr(d), remote, half)])
            second = reader.submit_read(endpoint, [ReadOp(addr(d, half), remote + half, half)])
            assert time.monotonic() - t0 < 2.0
            time.sleep(1.0)
            assert reader.poll(first) == PENDING and reader.poll(second) == PENDING
            assert reader.cancel(first) is True
            with pytest.raises(TransferError):
                reader.poll(first)  # freed by cancel
        finally:
            os.kill(server.pid, signal.SIGCONT)
        assert wait(reader, second, timeout=30) == DONE
        assert np.array_equal(d[half:], expect[half:])
        assert not d[:half].any()  # the cancelled batch never wrote
        assert reader.cancel(second) is False  # finished handles cannot be cancelled
        assert read(reader, endpoint, [ReadOp(addr(d), remote, half)]) == DONE
        assert np.array_equal(d, expect)
    finally:
        if server.is_alive():
            server.kill()
            server.join(10)
        reader.close()


def test_cancel_of_an_unknown_handle_is_refused(env):
    dst, _ = env.sink(1 << 12)
    assert dst.cancel(987654) is False
