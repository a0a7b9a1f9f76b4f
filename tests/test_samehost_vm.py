"""Same-host reads of any CPU tensor a holder publishes (issue 34): real coordinator and
worker processes on this host, real Mooncake underneath.

Memory the Hub did not allocate (``torch.randn`` weights, ``torch.empty_like``
snapshots: what the README's RL loop publishes) is read in place with
``process_vm_readv`` (``tensorhub/transport/_vm.py``) under the same lease, drain and
checksum rules as the memfd path; a partial replica (a reader still receiving) serves its
ready chunks the same way; a holder the kernel will not let us read is read over
Mooncake. Every fetch is checked byte for byte; the transport's counters say which path
the bytes took.
"""

from __future__ import annotations

import ctypes
import os
import time

import pytest

from tensorhub.testing import WorkerError, digest, make_weights

pytestmark = pytest.mark.multiprocess

MiB = 1 << 20


def expected(seed: int, nbytes: int) -> dict:
    return digest(make_weights(seed, nbytes))


def test_user_tensors_into_new_and_preallocated_memory(coordinator, workers):
    url = coordinator.url
    pub = workers(url, "pub", own_transport=True)
    v = pub.call("publish", seed=31, nbytes=32 * MiB)  # the user's own tensors (torch.randn)
    reader = workers(url, "reader", own_transport=True)
    got = reader.call("fetch", version=v, serve=False)
    assert got["digest"] == expected(31, 32 * MiB)
    s = reader.call("transport_stats")
    assert s["vm_bytes"] == got["nbytes"] and s["inner_batches"] == 0, s
    assert s["hashed_bytes"] == got["nbytes"], s  # checksummed as it landed, by the copy
    got2 = reader.call("fetch", version=v, serve=False, into={"name": "buf", "nbytes": 32 * MiB})
    assert got2["digest"] == expected(31, 32 * MiB)
    s2 = reader.call("transport_stats")
    assert s2["vm_bytes"] - s["vm_bytes"] == got2["nbytes"] and s2["inner_batches"] == 0, s2


def test_unpublish_waits_for_a_cross_reading_reader(coordinator, workers):
    url = coordinator.url
    pub = workers(url, "pub", own_transport=True)
    v1 = pub.call("publish", seed=32, nbytes=16 * MiB)
    pub.call("publish", seed=33, nbytes=16 * MiB)  # v1 is not the newest: unpublish is allowed
    reader = workers(url, "slow", own_transport=True, copy_delay=3.0)
    reader.send("fetch", version=v1, serve=False)
    time.sleep(1.0)  # the reader holds its lease; its copies wait
    waited = pub.call("unpublish", version=v1, drain_timeout=60)  # then zeroes the memory
    got = reader.result()
    assert got["digest"] == expected(32, 16 * MiB)  # read before the holder overwrote it
    assert reader.call("transport_stats")["vm_bytes"] == got["nbytes"]
    assert waited >= 1.0, f"unpublish returned after {waited:.2f}s while a same-host reader was reading"


def test_checksums_still_verified_on_cross_reads(coordinator, workers):
    url = coordinator.url
    pub = workers(url, "pub", own_transport=True)
    v = pub.call("publish", seed=34, nbytes=8 * MiB)
    pub.call("corrupt", version=v)
    reader = workers(url, "reader", own_transport=True)
    with pytest.raises(WorkerError, match="checksum"):
        reader.call("fetch", version=v, serve=False, fetch_timeout=15)
    assert reader.call("transport_stats")["vm_bytes"] > 0  # the mismatch was found on cross-read bytes


def test_a_partial_replica_serves_its_ready_chunks_same_host(coordinator, workers, tmp_path):
    """``mid`` receives v from ``pub`` (another host by its label: over Mooncake, slowed)
    and serves it while it receives; ``late``, on mid's host (its Mooncake reads slowed the
    same way), reads chunks from mid's memory in place -- only those mid's chunk map says
    are ready -- and the rest from pub."""
    url = coordinator.url
    pub = workers(url, "pub", own_transport=True, locality="dc=d,zone=z,host=a")
    v = pub.call("publish", seed=35, nbytes=64 * MiB)
    mid = workers(url, "mid", own_transport=True, locality="dc=d,zone=z,host=b",
                  trace=(str(tmp_path / "mid.jsonl"), 0.08))
    late = workers(url, "late", own_transport=True, locality="dc=d,zone=z,host=b",
                   trace=(str(tmp_path / "late.jsonl"), 0.08))  # its Mooncake reads slowed as mid's
    mid.send("fetch", version=v, serve=True)
    time.sleep(1.0)  # mid holds some chunks, not all
    got = late.call("fetch", version=v, serve=True)  # (a pipelined read: it may use partial sources)
    assert mid.result()["digest"] == expected(35, 64 * MiB)
    assert got["digest"] == expected(35, 64 * MiB)
    assert "mid" in got["sources"], got["sources"]
    s = late.call("transport_stats")
    assert s["copied_bytes"] >= got["sources"]["mid"] > 0, (s, got["sources"])


def test_a_holder_the_kernel_will_not_let_us_read_is_read_over_mooncake(coordinator, workers):
    """A non-dumpable holder (``PR_SET_DUMPABLE`` 0) may be cross-read only by a reader
    with ``CAP_SYS_PTRACE``; this reader (root here) runs without it, so the kernel refuses:
    the reader's probe finds out before the first chunk, and it reads over Mooncake."""
    if os.geteuid() != 0:
        pytest.skip("needs root: drops CAP_SYS_PTRACE from a root worker")
    url = coordinator.url
    pub = workers(url, "pub", own_transport=True, dumpable=False)
    v = pub.call("publish", seed=36, nbytes=8 * MiB)
    reader = workers(url, "reader", own_transport=True, no_ptrace_cap=True)
    got = reader.call("fetch", version=v, serve=False)
    assert got["digest"] == expected(36, 8 * MiB)
    s = reader.call("transport_stats")
    assert s["vm_bytes"] == 0 and s["inner_batches"] > 0, s


def test_probe_says_why_and_read_into_copies():
    from tensorhub.transport import _vm
    from tensorhub.transport._base import ReadOp

    src = ctypes.create_string_buffer(b"tensorhub" * 1000)
    dst = ctypes.create_string_buffer(len(src.raw))
    assert _vm.probe(os.getpid(), ctypes.addressof(src)) is None
    ops = [ReadOp(ctypes.addressof(dst) + i * 100, ctypes.addressof(src) + i * 100, 100) for i in range(90)]
    assert _vm.read_into(os.getpid(), ops) == 9000
    assert dst.raw[:9000] == src.raw[:9000]
    assert _vm.probe(os.getpid(), 8) is not None  # unmapped: EFAULT, said
    with pytest.raises(OSError):
        _vm.read_into(2 ** 22 + 12345, ops[:1])  # no such process


def test_a_fused_copy_hashes_the_landed_bytes_in_chunk_order():
    """``_fused`` (copy a segment, hash it while in cache): across op and segment boundaries
    its digest is the hash of the chunk's bytes in op order; the verifier takes it as the
    chunk's hash, and a copy that landed other bytes than the manifest's fails the check."""
    from tensorhub import _checksum
    from tensorhub.transport import _shm
    from tensorhub.transport._base import ReadOp

    seg = _shm._SEGMENT
    src = (ctypes.c_char * (3 * seg + 777)).from_buffer(bytearray(os.urandom(3 * seg + 777)))
    dst = (ctypes.c_char * len(src))()
    # two ops, out of address order, the first crossing segment boundaries mid-segment
    cut = seg + 12345
    ops = [ReadOp(ctypes.addressof(dst) + cut, ctypes.addressof(src) + cut, len(src) - cut),
           ReadOp(ctypes.addressof(dst), ctypes.addressof(src), cut)]
    counted = []

    def move(l: int, r: int, n: int) -> int:
        ctypes.memmove(l, r, n)
        return n

    got = _shm._fused(ops, _checksum.ALGORITHMS["xxh3_64"], move, counted.append)
    assert bytes(dst) == bytes(src) and sum(counted) == len(src)
    want = _checksum.hash_bytes("xxh3_64", bytes(src)[cut:] + bytes(src)[:cut])
    assert got == want
    # through the process_vm_readv mover too (our own pid)
    dst2 = (ctypes.c_char * len(src))()
    ops2 = [ReadOp(ctypes.addressof(dst2) + (o.local_addr - ctypes.addressof(dst)), o.remote_addr, o.length)
            for o in ops]
    from tensorhub.transport import _vm
    assert _shm._fused(ops2, _checksum.ALGORITHMS["xxh3_64"],
                       lambda l, r, n: _vm.read_into(os.getpid(), [ReadOp(l, r, n)]), lambda n: None) == want
    assert bytes(dst2) == bytes(src)
