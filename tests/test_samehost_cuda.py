"""Same-host reads of CUDA memory through CUDA IPC handles (issue 34, item 2), without a GPU.

``transport/_cudaipc`` talks to CUDA through six small seams (``_share``, ``_open``,
``_set_device``, ``_stream``, ``_memcpy``, ``_sync``); here a fake backend stands in for
them: a holder's "device memory" is host memory cut into segments (each with its own IPC
handle) and blocks, a reader's "opened" block is a copy of those bytes at another address,
and the fake memcpy moves real bytes. So every test checks the bytes that landed, and the copies
the reader asked for (``(dst, src, n)``) against the local pointers it was given. What runs
only on a GPU (torch's ``_share_cuda_`` / ``_new_shared_cuda``, the CUDA runtime) is
exercised by ``scripts/gpu_check.sh`` (``benchmarks/gpu_check.py``, "same-host CUDA IPC");
the calls into torch are checked here against mocks, in torch's argument order.
"""

from __future__ import annotations

import base64
import ctypes
import gc
import hashlib
import json
import logging
import socket
import threading
import time
import weakref
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from tensorhub._reader import Source
from tensorhub._tensors import coalesce
from tensorhub.testing import InMemoryTransport
from tensorhub.transport import DONE, PENDING, ReadOp
from tensorhub.transport import _cudaipc
from tensorhub.transport._shm import SameHostTransport, host_identity, socket_name

KiB, MiB = 1 << 10, 1 << 20
SECRET = "s" * 32
#: The real CUDA runtime calls, before any test replaces them.
REAL = {name: getattr(_cudaipc, name) for name in ("_set_device", "_stream", "_memcpy", "_sync")}


# ---------------------------------------------------------------------- the fake backend
class Seg:
    """A segment of the holder's "device memory" (one cudaMalloc): host bytes, a handle."""

    def __init__(self, buf: torch.Tensor, handle: bytes) -> None:
        self.buf, self.handle, self.base = buf, handle, buf.data_ptr()


class Storage:
    def __init__(self, seg: Seg, off: int, size: int) -> None:
        self.seg, self.off, self.size = seg, off, size


class FakeTensor:
    """Stands for a CUDA tensor: ``n`` bytes at ``off`` in a storage (block) of a segment."""

    device = SimpleNamespace(type="cuda")

    def __init__(self, st: Storage, off: int, n: int) -> None:
        self.st, self.off, self.n = st, off, n

    def data_ptr(self) -> int:
        return self.st.seg.base + self.st.off + self.off

    def bytes(self) -> torch.Tensor:
        o = self.st.off + self.off
        return self.st.seg.buf[o:o + self.n]


class Keep:
    """What a fake open keeps alive (the opened storage): a mirror of the block's bytes."""

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf


class FakeCuda:
    def __init__(self, events: bool = True) -> None:
        self.events = events
        self.segs: dict[bytes, Seg] = {}
        self.opened: list[tuple[dict, int]] = []  # (description, local address)
        self.keeps: list[weakref.ref] = []
        self.copies: list[tuple[int, int, int, int]] = []  # (dst, src, n, stream)
        self.syncs: list[int] = []
        self.devices: list[int] = []  # made current on a copy thread
        self.threads: list[str] = []  # where each open ran
        self.fail_open: dict[bytes, Exception] = {}  # segment handle -> what opening it raises
        self.fail_copy = None  # callable(dst, src, n) -> Exception or None
        self._gen = torch.Generator().manual_seed(34)

    def segment(self, nbytes: int, buf: torch.Tensor = None) -> Seg:
        if buf is None:
            buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=self._gen)
        seg = Seg(buf, f"cuda-ipc-handle-{len(self.segs)}".encode())
        self.segs[seg.handle] = seg
        return seg

    def tensors(self, seg: Seg, off: int, sizes: list[int]) -> list[FakeTensor]:
        """One block per size, back to back from ``off`` (the caching allocator's many small tensors)."""
        out = []
        for n in sizes:
            out.append(FakeTensor(Storage(seg, off, n), 0, n))
            off += n
        return out

    # -- the seams
    def share(self, t) -> _cudaipc.Shared | None:
        if not isinstance(t, FakeTensor):
            return None
        st = t.st
        ev = hashlib.sha256(st.seg.handle + st.off.to_bytes(8, "little")).digest() * 2 if self.events else b""
        return _cudaipc.Shared(0, "uuid-0", st.seg.handle, st.off, st.seg.base + st.off, st.size, ev)

    def open(self, desc: dict, prefer=None) -> tuple[Keep, int, int]:
        self.threads.append(threading.current_thread().name.rsplit("_", 1)[0])
        seg = self.segs[base64.b64decode(desc["handle"])]
        if seg.handle in self.fail_open:
            self.opened.append((desc, 0))
            e = self.fail_open[seg.handle]
            raise type(e)(*e.args)  # (a new one each time: a kept traceback would keep the frames alive)
        assert desc["addr"] - desc["offset"] == seg.base  # the remote block is at offset in its segment
        keep = Keep(seg.buf[desc["offset"]:desc["offset"] + desc["size"]].clone())
        self.opened.append((desc, keep.buf.data_ptr()))
        self.keeps.append(weakref.ref(keep))
        return keep, keep.buf.data_ptr(), 0

    def set_device(self, device: int) -> None:
        self.devices.append(device)

    def stream(self, device: int) -> int:
        return 7000 + device

    def memcpy(self, dst: int, src: int, n: int, stream: int) -> None:
        if self.fail_copy is not None and (e := self.fail_copy(dst, src, n)) is not None:
            raise e
        self.copies.append((dst, src, n, stream))
        ctypes.memmove(dst, src, n)

    def sync(self, stream: int) -> None:
        self.syncs.append(stream)

    # -- checks
    def local(self, remote: int) -> int:
        """Where the reader should read ``remote`` from: in the mirror of the block holding it."""
        for d, addr in self.opened:
            if addr and d["addr"] <= remote < d["addr"] + d["size"]:
                return addr + (remote - d["addr"])
        raise AssertionError(f"{remote:#x} is in no opened block")

    def data_copies(self) -> list[tuple[int, int, int]]:
        """The copies of the reads (not the one-byte probes of freshly opened blocks)."""
        return [(d, s, n) for d, s, n, _ in self.copies if n != 1]


@pytest.fixture
def fake(monkeypatch):
    f = FakeCuda()
    monkeypatch.setattr(_cudaipc, "available", lambda: True)
    for name in ("share", "open", "set_device", "stream", "memcpy", "sync"):
        monkeypatch.setattr(_cudaipc, "_" + name, getattr(f, name))
    monkeypatch.setattr(_cudaipc, "_streams", _cudaipc._Streams())
    return f


class Pair:
    """A holder and a reader transport in this process (InMemoryTransport underneath)."""

    def __init__(self, tensors: list) -> None:
        self.tensors = tensors
        self.regions = coalesce([(t.data_ptr(), t.n if isinstance(t, FakeTensor) else t.nbytes) for t in tensors])
        self.asked: list[str] = []
        self.holder = SameHostTransport(InMemoryTransport(), host_label="a", authorize=self._authorize,
                                        worker_id="holder", tensors=lambda rid: list(self.tensors))
        self.reader = SameHostTransport(InMemoryTransport(), host_label="a", authorize=lambda *a: None,
                                        worker_id="reader")
        self.ep = self.holder.start()
        for a, n in self.regions:  # (the inner transport serves them too: the fallback reads them)
            self.holder.register(a, n)
        self.reader.start()
        self.dst = torch.zeros(sum(n for _, n in self.regions) + MiB, dtype=torch.uint8)
        self.reader.register(self.dst.data_ptr(), self.dst.nbytes)

    def _authorize(self, lease, replica, worker, proof, endpoint):
        self.asked.append(lease)
        return list(self.regions)

    def src(self, lease: str) -> Source:
        return Source("r1", "holder", self.ep, (), lease, secret=SECRET, host="a")

    def read(self, lease: str, ops: list[ReadOp]) -> int:
        h = self.reader.submit_from(self.src(lease), ops)
        deadline = time.monotonic() + 20
        while (st := self.reader.poll(h)) == PENDING:
            assert time.monotonic() < deadline, "read did not end"
            time.sleep(0.001)
        return st

    def ops_for(self, tensors: list, at: int = 0) -> tuple[list[ReadOp], torch.Tensor]:
        """One op per tensor, packed one after another into ``dst`` from ``at``; the bytes expected there."""
        ops, off = [], at
        for t in tensors:
            ops.append(ReadOp(self.dst.data_ptr() + off, t.data_ptr(), t.n))
            off += t.n
        return ops, torch.cat([t.bytes() for t in tensors])

    def close(self) -> None:
        self.reader.close()
        self.holder.close()


@contextmanager
def pair(tensors: list):
    p = Pair(tensors)
    try:
        yield p
    finally:
        p.close()


def ask(endpoint: str, **req) -> dict:
    """Ask a holder's fd server as a reader would (up to EOF); its answer."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(socket_name(endpoint))
    req = {"lease_id": "l", "replica_id": "r1", "worker_id": "w", "proof": "a" * 64,
           "host": dict(host_identity(), label="a"), **req}
    s.sendall(json.dumps(req).encode())
    data, fds, _, _ = socket.recv_fds(s, 1 << 16, 250)
    while more := s.recv(1 << 16):
        data += more
    s.close()
    assert not fds
    return json.loads(data.decode())


# ---------------------------------------------------------------------- holder
def test_the_holder_lists_each_block_once_clipped_to_the_replica(fake):
    seg = fake.segment(2 * MiB)
    flat = Storage(seg, 0, 64 * KiB)  # one block, 64 tensors viewing it (a flat buffer)
    views = [FakeTensor(flat, i * KiB, KiB) for i in range(64)]
    small = fake.tensors(seg, 64 * KiB, [4 * KiB] * 16)  # 16 blocks back to back after it
    apart = fake.tensors(seg, MiB, [4 * KiB])  # the same segment, not touching them
    other = fake.tensors(fake.segment(MiB), 0, [MiB])  # another segment
    descs = _cudaipc.export(views + small + apart + other + [torch.zeros(16)])  # (a CPU tensor: left out)
    assert [(d["handle"], d["offset"], d["addr"], d["size"]) for d in descs] == [
        (base64.b64encode(seg.handle).decode(), 0, seg.base, 128 * KiB),
        (base64.b64encode(seg.handle).decode(), MiB, seg.base + MiB, 4 * KiB),
        (base64.b64encode(other[0].st.seg.handle).decode(), 0, other[0].data_ptr(), MiB)]
    assert all(d["device"] == 0 and d["uuid"] == "uuid-0" for d in descs)
    assert [len(d["events"]) for d in descs] == [17, 1, 1]  # the holder's event of each block shared
    assert json.loads(json.dumps(descs)) == descs  # JSON as it is
    # Clipped to the replica's regions: only the bytes the lease covers are described.
    clip = _cudaipc.export(views + small, [(seg.base + KiB, 2 * KiB), (seg.base + 70 * KiB, 8 * KiB)])
    assert [(d["offset"], d["addr"], d["size"]) for d in clip] == [
        (KiB, seg.base + KiB, 2 * KiB), (70 * KiB, seg.base + 70 * KiB, 8 * KiB)]
    # Through the fd server, after the lease was confirmed: "cuda", no fds, no "vm".
    with pair(views + small + other) as p:
        ans = ask(p.ep, cuda=True)
        assert len(ans["cuda"]) == 2 and "vm" not in ans and ans["arenas"] == [] and p.asked == ["l"]
        assert "cuda" not in ask(p.ep, cuda=False) and "cuda" not in ask(p.ep)  # a reader without CUDA (or older)


def test_without_cuda_the_holder_never_answers_cuda(monkeypatch):
    """On this machine torch has no CUDA: whatever the reader asks, the answer is the CPU
    one ("vm": read in place), never "cuda"; and a reader here does not ask for it."""
    if torch.cuda.is_available():  # pragma: no cover
        pytest.skip("a GPU is here")
    user = torch.arange(MiB, dtype=torch.uint8)
    holder = SameHostTransport(InMemoryTransport(), host_label="a", authorize=lambda *a: [(user.data_ptr(), MiB)],
                               worker_id="holder", tensors=lambda rid: [user])
    try:
        ep = holder.start()
        ans = ask(ep, cuda=True)
        assert _cudaipc.available() is False and "cuda" not in ans and ans.get("vm") is True
        f = FakeCuda()  # even tensors that would share: no CUDA in the holder, no "cuda"
        monkeypatch.setattr(_cudaipc, "_share", f.share)
        seg = f.segment(MiB)
        holder._tensors = lambda rid: f.tensors(seg, 0, [MiB])
        ans = ask(ep, cuda=True)
        assert "cuda" not in ans and ans.get("vm") is True
    finally:
        holder.close()
    # A reader without CUDA does not ask for it.
    name = socket_name("memory://no-such-holder-34")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(name)
    srv.listen(1)
    got = []

    def serve():
        c, _ = srv.accept()
        got.append(json.loads(c.recv(1 << 16)))
        c.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    reader = SameHostTransport(InMemoryTransport(), host_label="a", authorize=lambda *a: None, worker_id="r")
    try:
        m = reader._ask(Source("r1", "h", "memory://no-such-holder-34", (), "l1", secret=SECRET, host="a"))
        t.join(10)
        assert got and "cuda" not in got[0] and m.cuda is None and len(reader.cuda) == 0
    finally:
        srv.close()
        reader.close()


def test_share_shares_each_storage_once_and_drops_torchs_count(monkeypatch):
    """The holder's ``_share`` (torch mocked): ``_share_cuda_`` once per live storage, torch's
    counter released at once, the IPC event kept only when torch asks the reader to wait
    on it; a storage whose memory changed is shared again."""
    released, shared = [], []

    class St:
        def __init__(self, cdata, ptr, n):
            self._cdata, self.ptr, self.n, self.sync = cdata, ptr, n, True

        def nbytes(self):
            return self.n

        def data_ptr(self):
            return self.ptr

        def _share_cuda_(self):
            shared.append(self._cdata)
            return (1, b"\x02chandle" + bytes([self._cdata]), self.n, 512, b"/torch_1_2_3", 7 + len(shared),
                    b"\x01" * 64, self.sync)

    class Weak:
        def __init__(self, st):
            self.st = st

        def expired(self):
            return self.st.dead

    class T:
        device = SimpleNamespace(type="cuda")

        def __init__(self, st):
            self.st = st

        def untyped_storage(self):
            return self.st

    import torch.multiprocessing.reductions as red

    monkeypatch.setattr(red, "StorageWeakRef", Weak)
    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter_cuda", lambda h, o: released.append((h, o)),
                        raising=False)
    monkeypatch.setattr(_cudaipc, "_uuid", lambda dev: f"uuid-{dev}")
    monkeypatch.setattr(_cudaipc, "_shared", {})
    a, b = St(1, 0x7000_0000_0200, 4 * MiB), St(2, 0x7000_0100_0000, MiB)
    a.dead = b.dead = False
    b.sync = False
    s1 = _cudaipc._share(T(a))
    assert s1 == _cudaipc.Shared(1, "uuid-1", b"\x02chandle\x01", 512, 0x7000_0000_0200, 4 * MiB, b"\x01" * 64)
    assert released == [(b"/torch_1_2_3", 8)]  # torch's count is 0 again: the block lives as long as its storage
    assert _cudaipc._share(T(a)) is s1 and shared == [1]  # shared once
    assert _cudaipc._share(T(b)).event == b"" and shared == [1, 2]  # no event to wait on
    a.ptr += 4096  # (a resized storage: other memory behind the same StorageImpl)
    assert _cudaipc._share(T(a)).addr == a.ptr and shared == [1, 2, 1]
    a.dead = True  # a new storage at the same address after the old one died: shared anew
    assert _cudaipc._share(T(a)) is not None and shared == [1, 2, 1, 1]
    assert _cudaipc._share(torch.zeros(4)) is None and _cudaipc._share(object()) is None


def test_open_calls_torch_in_its_argument_order_on_the_readers_device_or_the_holders(monkeypatch):
    """The reader's ``_open`` (torch mocked): ``_new_shared_cuda(device, handle, size,
    offset, ref_counter, ref_counter_offset, event_handle, event_sync_required)`` as torch's
    ``rebuild_cuda_tensor`` calls it, with a counter name no process can create, and the
    holder's events waited on; on the reader's own device first (a peer mapping: no new
    context, and the holder's GPU need not be visible), else on our index of the holder's
    GPU (by UUID)."""
    calls, waited, devices = [], [], []
    refuse: set[int] = set()

    def new_shared_cuda(*a):
        calls.append(a)
        if a[0] in refuse:
            raise RuntimeError("CUDA error: peer access is not supported between these two devices\nmore")
        return Opened()

    class Opened:
        def data_ptr(self):
            return 0xA000_0000

    @contextmanager
    def device(i):
        devices.append(i)
        yield

    class Event:
        @staticmethod
        def from_ipc_handle(dev, handle):
            return SimpleNamespace(synchronize=lambda: waited.append((dev, handle)))

    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(_cudaipc, "_uuid", lambda i: f"uuid-{i + 5}")
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", new_shared_cuda, raising=False)
    desc = {"device": 0, "uuid": "uuid-7", "handle": base64.b64encode(b"H" * 66).decode(), "offset": 4096,
            "addr": 0x7000_1000, "size": 8192, "events": [base64.b64encode(b"E" * 64).decode()]}
    keep, local, dev = _cudaipc._open(desc)  # a reader not using CUDA yet: on the holder's GPU
    assert (local, dev, devices) == (0xA000_0000, 2, [2])  # the holder's device 0 is our device 2
    assert calls == [(2, b"H" * 66, 8192, 4096, b"/tensorhub/none", 0, b"", False)]
    assert waited == [(torch.device("cuda", 2), b"E" * 64)]
    calls.clear()
    assert _cudaipc._open(desc, prefer=1)[2] == 1 and [c[0] for c in calls] == [1]  # the reader's device
    refuse.add(1)
    calls.clear()
    assert _cudaipc._open(desc, prefer=1)[2] == 2 and [c[0] for c in calls] == [1, 2]  # no peer access: the holder's
    refuse.clear()
    assert _cudaipc._open(dict(desc, uuid="uuid-99"), prefer=0)[2] == 0  # its GPU not visible here: a peer mapping
    with pytest.raises(LookupError, match="not visible"):
        _cudaipc._open(dict(desc, uuid="uuid-99"))
    refuse.update({0, 2})
    with pytest.raises(LookupError, match="on device 0: CUDA error: peer access .*; on device 2"):
        _cudaipc._open(desc, prefer=0)
    refuse.clear()
    monkeypatch.setattr(Event, "from_ipc_handle", staticmethod(lambda *a: 1 / 0))
    assert _cudaipc._open(desc)[2] == 2  # the holder's event cannot be waited on: opened all the same
    assert _cudaipc._local_device("", 1) == 1  # no UUID sent: the index
    with pytest.raises(LookupError):
        _cudaipc._local_device("", 3)


# ---------------------------------------------------------------------- reader
def test_the_reader_opens_each_block_once_and_copies_through_its_local_pointers(fake):
    """Two segments that lie back to back in the holder's address space (two IPC handles:
    two descriptions), many small blocks in the first: each description is opened once for
    many batches and a second lease; every copy reads the local mirror of the right block
    (an op over the seam is split there); the bytes land exactly; nothing goes over the
    wrapped transport."""
    whole = torch.randint(0, 256, (4 * MiB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    sa, sb = fake.segment(0, whole[:2 * MiB]), fake.segment(0, whole[2 * MiB:])
    small = fake.tensors(sa, MiB, [16 * KiB] * 63 + [16 * KiB - 256])  # 64 blocks up to sa's end - 256
    small.append(FakeTensor(Storage(sa, 2 * MiB - 256, 256), 0, 256))
    big = fake.tensors(sb, 0, [MiB + 3])
    with pair(small + big) as p:
        assert len(p.regions) == 1  # one region across both segments: an op may span the seam
        issued: list[ReadOp] = []
        for lease in ("lease-1", "lease-2"):
            for i in range(0, len(small), 16):  # several batches, one op per tensor
                ops, want = p.ops_for(small[i:i + 16])
                assert p.read(lease, ops) == DONE
                assert torch.equal(p.dst[:want.numel()], want)
                issued += ops
            seam = [ReadOp(p.dst.data_ptr(), small[-1].data_ptr() - 100, 100 + 256 + 1000)]
            assert p.read(lease, seam) == DONE  # across the seam of the two segments
            assert torch.equal(p.dst[:1356], whole[2 * MiB - 356:2 * MiB + 1000])
            issued.append(seam[0])
            ops, want = p.ops_for(big)
            assert p.read(lease, ops) == DONE and torch.equal(p.dst[:want.numel()], want)
            issued += ops
        assert p.asked == ["lease-1", "lease-2"]  # one answer per lease
        assert set(fake.threads) == {"tensorhub-shm"}  # opened (and probed) on a copy thread, not the caller's
        assert len(fake.opened) == 2 and p.reader.cuda.opens == 2  # each description once, across leases
        assert [(d["addr"], d["size"]) for d, _ in fake.opened] == [(sa.base + MiB, MiB), (sb.base, MiB + 3)]
        # Every copy reads the mirror of the block holding the op's remote bytes (local base +
        # (remote - remote base)) into the op's destination; the seam op is split at the seam.
        want = []
        for op in issued:
            if op.length == 1356:
                want += [(op.local_addr, fake.local(op.remote_addr), 356),
                         (op.local_addr + 356, fake.local(sb.base), 1000)]
            else:
                want.append((op.local_addr, fake.local(op.remote_addr), op.length))
        assert fake.data_copies() == want
        n = 2 * (sum(t.n for t in small) + 1356 + big[0].n)
        r = p.reader
        assert r.cuda_bytes == r.copied_bytes == n and r.inner_batches == 0 and r.vm_bytes == 0
        assert len(fake.syncs) == 2 * 7 + 1  # one per batch, and the probe of the first fresh block


def test_a_long_answer_of_many_blocks_arrives_whole(fake):
    """600 blocks in 600 segments: an answer past one socket read (64 KiB) is read to EOF."""
    ts = [fake.tensors(fake.segment(4 * KiB), 0, [4 * KiB])[0] for _ in range(600)]
    with pair(ts) as p:
        ops, want = p.ops_for(ts)
        assert p.read("lease-1", ops) == DONE and torch.equal(p.dst[:want.numel()], want)
        assert len(fake.opened) == 600 and len(json.dumps([d for d, _ in fake.opened])) > 1 << 16
        assert p.reader.cuda_bytes == 600 * 4 * KiB and p.reader.inner_batches == 0


def test_blocks_are_closed_when_no_lease_of_ours_is_left(fake):
    ts = fake.tensors(fake.segment(MiB), 0, [64 * KiB] * 8)
    with pair(ts) as p:
        ops, want = p.ops_for(ts)
        for lease in ("lease-1", "lease-2"):
            assert p.read(lease, ops) == DONE and torch.equal(p.dst[:want.numel()], want)
        assert len(fake.keeps) == 1 and len(p.reader.cuda) == 1
        p.reader.forget({"lease-1"})  # lease-2 still names the block: kept open
        gc.collect()
        assert len(p.reader.cuda) == 1 and fake.keeps[0]() is not None
        p.reader.forget({"lease-2"})
        gc.collect()
        assert len(p.reader.cuda) == 0 and fake.keeps[0]() is None  # the opened storage is gone: unmapped
        assert p.read("lease-3", ops) == DONE and len(fake.opened) == 2  # a new lease opens it again


def test_a_batch_outside_the_blocks_goes_over_the_wrapped_transport(fake, caplog):
    """A replica with a CPU tensor beside its CUDA ones: batches touching the CPU bytes are
    read over the wrapped transport (one log line), the others by CUDA IPC."""
    cuda = fake.tensors(fake.segment(MiB), 0, [256 * KiB] * 2)
    host = torch.randint(0, 256, (100 * KiB,), dtype=torch.uint8)
    host_op = SimpleNamespace(data_ptr=host.data_ptr, n=host.numel(), bytes=lambda: host)
    with pair(cuda + [host]) as p, caplog.at_level(logging.INFO, logger="tensorhub.transport._shm"):
        ops, want = p.ops_for(cuda + [host_op])
        for _ in range(2):
            p.dst.zero_()
            assert p.read("lease-1", ops) == DONE and torch.equal(p.dst[:want.numel()], want)
        cops, cwant = p.ops_for(cuda)
        assert p.read("lease-1", cops) == DONE and torch.equal(p.dst[:cwant.numel()], cwant)
        assert p.reader.inner_batches == 2 and p.reader.cuda_bytes == 512 * KiB and fake.data_copies()
        said = [r.getMessage() for r in caplog.records if "outside the CUDA blocks" in r.getMessage()]
        assert len(said) == 1 and p.ep in said[0] and "InMemoryTransport" in said[0]


@pytest.mark.parametrize("failure", ["first", "second", "probe"])
def test_a_block_that_cannot_be_opened_means_the_wrapped_transport(fake, caplog, failure):
    """The holder's GPU not visible here, the driver refusing a handle, or the runtime
    unable to read a freshly opened block: the lease reads over the wrapped transport, said
    once, and nothing stays open."""
    ts = fake.tensors(fake.segment(MiB), 0, [128 * KiB]) + fake.tensors(fake.segment(MiB), 0, [128 * KiB])
    if failure == "probe":
        fake.fail_copy = lambda d, s, n: RuntimeError("cudaMemcpyAsync: CUDA error 1 (invalid argument)") \
            if n == 1 else None
    else:
        seg = ts[0 if failure == "first" else 1].st.seg
        fake.fail_open[seg.handle] = LookupError("the holder's GPU uuid-0 is not visible")
    with pair(ts) as p, caplog.at_level(logging.INFO, logger="tensorhub.transport._shm"):
        ops, want = p.ops_for(ts)
        for lease in ("lease-1", "lease-1", "lease-2"):
            p.dst.zero_()
            assert p.read(lease, ops) == DONE and torch.equal(p.dst[:want.numel()], want)
        r = p.reader
        assert r.cuda_bytes == 0 and r.inner_batches == 3 and len(r.cuda) == 0
        gc.collect()
        assert all(k() is None for k in fake.keeps)  # an opened first block was closed again
        said = [x.getMessage() for x in caplog.records if "cannot open its CUDA memory" in x.getMessage()]
        assert len(said) == 1 and ("not visible" in said[0] or "invalid argument" in said[0])


def test_without_a_cuda_runtime_the_probe_fails_and_the_read_falls_back(fake, monkeypatch):
    """The real stream / copy calls on this CPU machine (no CUDA runtime, or no device):
    the probe of the first opened block fails, and the read goes over the wrapped transport."""
    if torch.cuda.is_available():  # pragma: no cover
        pytest.skip("a GPU is here")
    for name, fn in REAL.items():
        monkeypatch.setattr(_cudaipc, name, fn)
    ts = fake.tensors(fake.segment(MiB), 0, [MiB])
    with pair(ts) as p:
        ops, want = p.ops_for(ts)
        assert p.read("lease-1", ops) == DONE and torch.equal(p.dst[:want.numel()], want)
        assert p.reader.cuda_bytes == 0 and p.reader.inner_batches == 1 and len(p.reader.cuda) == 0


def test_copy_waits_for_what_it_queued_before_it_fails(fake):
    """A copy that fails mid-batch: the streams are still synchronized (nothing lands after
    the batch is reported failed), the error reaches the caller, the stream is reused."""
    a = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    b = torch.zeros_like(a)
    calls = []
    fake.fail_copy = lambda d, s, n: (calls.append(n), RuntimeError("boom") if len(calls) == 2 else None)[1]
    plan = _cudaipc.Plan([(b.data_ptr(), a.data_ptr(), 100, 0), (b.data_ptr() + 100, a.data_ptr() + 100, 100, 0),
                          (b.data_ptr(), a.data_ptr(), 8, 1)], [])
    with pytest.raises(RuntimeError, match="boom"):
        _cudaipc.copy(plan)
    assert fake.syncs == [7000] and torch.equal(b[:100], a[:100]) and fake.devices == [0]
    fake.fail_copy = None
    assert _cudaipc.copy(plan) == 208 and sorted(fake.syncs[1:]) == [7000, 7001] and torch.equal(b[:200], a[:200])
    assert fake.devices == [0, 0, 1]  # each device made current before its copies
    assert _cudaipc._streams._free == {0: [7000], 1: [7001]}  # taken from the pool and given back


def test_malformed_answers_open_nothing(fake):
    o = _cudaipc.Opened()
    good = {"device": 0, "uuid": "", "handle": "aGFuZGxl", "offset": 0, "addr": 4096, "size": 10, "events": []}
    for bad in (None, [], "x", [dict(good, size=0)], [dict(good, addr=True)], [dict(good, handle=3)],
                [{k: v for k, v in good.items() if k != "offset"}]):
        assert o.open("h#1", bad, "l")[0] is None
    assert fake.opened == [] and len(o) == 0


def test_the_hub_gives_the_replicas_tensors_only_for_a_replica_it_holds(monkeypatch):
    """``_samehost.wrap``: the holder's fd server gets a replica's tensors (asked after the
    lease was confirmed) from the Hub's holdings, by replica id."""
    from tensorhub import _samehost

    monkeypatch.setenv("TENSORHUB_SAMEHOST", "1")
    a, b = torch.zeros(4), torch.ones(2)
    held = {"r1": SimpleNamespace(tensors={"a": a, "b": b})}
    session = SimpleNamespace(holdings=SimpleNamespace(find=held.get), locality=SimpleNamespace(host="h"),
                              worker_id="w", api=None, config=SimpleNamespace(samehost=True, samehost_vm=True))
    t = _samehost.wrap(InMemoryTransport(), session)
    try:
        assert isinstance(t, SameHostTransport)
        assert t._tensors("r1") == [a, b] and t._tensors("r2") == []
    finally:
        t.close()
