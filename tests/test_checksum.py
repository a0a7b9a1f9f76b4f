"""End-to-end chunk checksums (tensorhub/_checksum.py).

Pure tests of the hash and the grid (every dtype, across tensor boundaries, the 2048-piece
rule), of the manifest's validation and comparison; client tests with the in-memory
transport (plain, pipelined and partial reads fail over from a holder whose memory was
corrupted after publish); and the same over real Mooncake between processes.
"""

from __future__ import annotations

import httpx
import pytest
import torch
import xxhash

import tensorhub
from tensorhub import _checksum
from tensorhub._checksum import compute, count, grid, verifier
from tensorhub._planner import grid_chunk_bytes
from tensorhub._tensors import manifest_of
from tensorhub.protocol import DTYPE_SIZES, Manifest, TensorSpec, first_difference
from tensorhub.testing import InMemoryTransport, WorkerError, digest, make_weights

MiB = 1 << 20


def every_dtype(elements: int = 40_001) -> dict[str, torch.Tensor]:
    """One tensor per supported dtype, odd sizes (so chunks straddle tensors), random bits."""
    g = torch.Generator().manual_seed(5)
    out = {}
    for i, name in enumerate(sorted(DTYPE_SIZES)):
        nbytes = (elements + 7 * i) * DTYPE_SIZES[name]
        raw = torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)
        out[name] = raw.view(getattr(torch, name))
    out["scalar"] = torch.tensor(3.5, dtype=torch.bfloat16)
    out["empty"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    return out


def raw_bytes(tensors: dict) -> bytes:
    return b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors.values())


def test_hash_covers_every_dtype_across_tensor_boundaries():
    w = every_dtype()
    assert {"bfloat16", "float8_e4m3fn", "float8_e5m2", "bool", "complex128"} <= set(w)
    data = raw_bytes(w)
    assert len(data) > 2 * MiB  # several chunks of the 1 MiB grid, each spanning tensors
    step = grid_chunk_bytes(len(data))
    want = [xxhash.xxh3_64_intdigest(data[o:o + step]) for o in range(0, len(data), step)]
    algo, sums = compute(list(w.values()), "auto")
    assert algo == "xxh3_64" and sums == want
    assert compute(list(w.values()), "auto", algo="crc32")[1] == [
        _checksum.hash_bytes("crc32", data[o:o + step]) for o in range(0, len(data), step)]
    # the manifest carries them and the wire accepts them
    m, _ = manifest_of(w, "auto")
    assert (m.checksum, m.checksums) == ("xxh3_64", want)
    assert Manifest.model_validate(m.model_dump(mode="json")) == m
    # the staged path (how CUDA memory is read: through a host copy) gives the same hashes
    staged = _checksum._Bytes(list(w.values()), staged=True)
    sizes = [t.numel() * t.element_size() for t in w.values()]
    assert [_checksum._hash_chunk("xxh3_64", c, staged) for c in grid(sizes)] == want
    # any change of one byte changes exactly that chunk's hash
    t = w["float8_e4m3fn"].view(torch.uint8)
    t[5] ^= 1
    after = compute(list(w.values()), "auto")[1]
    assert sum(a != b for a, b in zip(after, want)) == 1


def test_grid_also_cuts_after_2048_pieces():
    sizes = [4] * 3000 + [0, 5]
    chunks = grid(sizes)
    assert [len(c) for c in chunks] == [2048, 953] and count(sizes) == 2
    specs = [TensorSpec(name=f"t{i}", dtype="uint8", shape=(n,), nbytes=n) for i, n in enumerate(sizes)]
    Manifest(tensors=specs, checksum="xxh3_64", checksums=[1, 2])
    with pytest.raises(ValueError, match="3 checksums for a shard of 2 chunks"):
        Manifest(tensors=specs, checksum="xxh3_64", checksums=[1, 2, 3])


def test_settings():
    meta = torch.empty(10, device="meta")
    assert compute([torch.zeros(3)], "off") is None
    assert compute([meta], "auto") is None  # not CPU memory: only with "on"
    assert _checksum.check_mode(True) == "on" and _checksum.check_mode(" OFF ") == "off"
    with pytest.raises(tensorhub.ConfigError, match="not one of auto, on, off"):
        _checksum.check_mode("sometimes")
    m, _ = manifest_of({"a": torch.zeros(4)})  # default: none (Hub passes its setting)
    assert m.checksums is None
    assert verifier(m, {"a": torch.zeros(4)}, "on") is None
    m, _ = manifest_of({"a": torch.zeros(4)}, "on")
    assert verifier(m, {"a": torch.zeros(4)}, "off") is None
    assert verifier(m, {"a": meta}, "auto") is None
    assert verifier(m, {"a": torch.zeros(4)}, "auto") is not None
    unknown = Manifest.model_construct(tensors=m.tensors, checksum="blake9", checksums=m.checksums)
    assert verifier(unknown, {"a": torch.zeros(4)}, "on") is None  # a newer client's: not verified


def test_partial_read_verifies_whole_chunks_only():
    w = {f"t{i}": torch.arange(300_000 + i, dtype=torch.float32) for i in range(6)}  # ~7 MiB, 1 MiB grid
    m, _ = manifest_of(w, "auto")
    keep = [1, 2]
    v = verifier(m, {f"t{i}": w[f"t{i}"] for i in keep}, "auto", keep)
    full = grid([s.nbytes for s in m.tensors])
    # the chunks t1..t2 lie in entirely are verified against the manifest; the two cut at
    # the ends (shared with t0 / t3) are read but not verified
    whole = [c for c, pieces in enumerate(full) if {p[0] for p in pieces} <= set(keep)]
    assert len(whole) >= 1 and v.expected.count(None) == 2
    assert [e for e in v.expected if e is not None] == [m.checksums[c] for c in whole]
    assert all(v.check(c) is None for c in range(len(v.chunks)))
    assert sum(p[2] for c in v.chunks for p in c) == w["t1"].nbytes + w["t2"].nbytes


def test_checking_every_chunk_on_threads_names_the_first_mismatch_in_chunk_order():
    w = {f"t{i}": torch.arange(300_000 + i, dtype=torch.float32) for i in range(6)}  # ~7 MiB, 1 MiB grid
    m, _ = manifest_of(w, "auto")
    into = {k: t.clone() for k, t in w.items()}
    v = verifier(m, into, "auto")
    assert len(v.chunks) >= 6 and v.first_mismatch(threads=2) is None
    assert v.nbytes == sum(t.nbytes for t in w.values())  # every byte hashed once
    into["t5"][-1] += 1  # the last chunk ...
    into["t2"][0] += 1  # ... and a middle one: the first in chunk order is named, as serially
    for threads in (1, 2, 4):
        why = verifier(m, into, "auto").first_mismatch(threads=threads)
        serial = next(r for c in range(len(v.chunks)) if (r := v.check(c)))
        first = next(c for c, pieces in enumerate(v.chunks) if any(i == 2 and off == 0 for i, off, _ in pieces))
        assert why == serial and why.startswith(f"checksum mismatch on chunk {first}: ")


def test_manifest_validation_and_comparison():
    w = {"a": torch.randn(600_000), "b": torch.randn(10)}
    m, _ = manifest_of(w, "auto")
    specs = m.tensors
    with pytest.raises(ValueError, match="go together"):
        Manifest(tensors=specs, checksum="xxh3_64")
    with pytest.raises(ValueError, match="less than 18446744073709551616"):
        Manifest(tensors=specs, checksum="xxh3_64", checksums=[1 << 64, 0, 0])
    bare = Manifest(tensors=specs)
    assert first_difference(m, bare) is None and first_difference(bare, m) is None  # e.g. a CUDA holder
    other = Manifest(tensors=specs, checksum="xxh3_64", checksums=[m.checksums[0], 7, m.checksums[2]])
    assert "chunk 1: xxh3_64 checksum 0x7 != registered" in first_difference(m, other)
    crc = Manifest(tensors=specs, checksum="crc32", checksums=[1, 2, 3])
    assert first_difference(m, crc) is None  # another algorithm: not comparable


def test_wrong_checksum_count_is_a_clear_4xx(embedded):
    hub = tensorhub.connect(embedded.url, worker_id="h", transport=InMemoryTransport())
    try:
        m, addrs = manifest_of({"a": torch.randn(600_000)}, "auto")  # 3 chunks
        body = {"worker_id": "h", "model": "m", "version": 1, "addresses": addrs,
                "manifest": dict(m.model_dump(mode="json"), checksums=m.checksums[:2])}
        hub.api.post("/v1/models/m/versions", {"version": None})
        with pytest.raises(tensorhub.InvalidRequestError, match="2 checksums for a shard of 3 chunks"):
            hub.api.post("/v1/replicas", body)
        r = httpx.post(f"{embedded.url}/v1/replicas", json=body, timeout=10)
        assert r.status_code == 422 and r.json()["code"] == "invalid_request"
    finally:
        hub.close()


# ---------------------------------------------------------------- client, in-memory transport
def weights(seed: int, mib: int = 8, n: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn((mib * MiB) // n // 4, generator=g) for i in range(n)}


def corrupt(tensors: dict) -> None:
    for t in tensors.values():
        t.view(torch.uint8).bitwise_not_()


def suspects(hub) -> set[str]:
    st = hub.api.get("/v1/status")
    return {r["replica_id"] for m in st["models"] for v in m["versions"] for r in v["replicas"] if r["suspect"]}


def replica_of(hub, worker: str) -> str:
    st = hub.api.get("/v1/status")
    return next(r["replica_id"] for m in st["models"] for v in m["versions"] for r in v["replicas"]
                if r["worker_id"] == worker)


@pytest.mark.parametrize("pipelined", [False, True], ids=["plain", "pipelined"])
def test_corrupt_holder_is_reported_and_read_around(connect, pipelined):
    pub, good = connect("pub"), connect("good")
    w = weights(1)
    want = {k: t.clone() for k, t in w.items()}
    v = pub.publish("m", w)
    good.fetch("m", v)  # a second, intact replica
    bad_id = replica_of(pub, "pub")
    corrupt(w)
    r = connect("reader", pipelined=pipelined)
    got = r.fetch("m", v)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert got.failed_sources == [bad_id] and set(got.sources) == {"good"}
    assert bad_id in suspects(r)
    # a partial read with the same two sources: the chunks it reads whole are checked too
    part = connect("part", pipelined=pipelined).fetch("m", v, names=["w1", "w2"], serve=False)
    assert torch.equal(part["w1"], want["w1"]) and torch.equal(part["w2"], want["w2"])


@pytest.mark.parametrize("pipelined", [False, True], ids=["plain", "pipelined"])
def test_only_a_corrupt_source_fails_the_fetch_naming_the_mismatch(connect, pipelined):
    pub = connect("pub")
    w = weights(2)
    v = pub.publish("m", w)
    corrupt(w)
    r = connect("reader", pipelined=pipelined)
    with pytest.raises(tensorhub.FetchError, match=r"excluded after a checksum mismatch .*checksum mismatch "
                                                   r"on chunk \d+: xxh3_64"):
        r.fetch("m", v, timeout=3)
    assert r.held() == []  # nothing accepted, nothing served
    st = r.api.get("/v1/status")
    assert [x["worker_id"] for m in st["models"] for ver in m["versions"] for x in ver["replicas"]] == ["pub"]


def test_checksum_off_reads_what_is_there(connect):
    pub = connect("pub", checksum="off")
    w = weights(3, mib=2)
    v = pub.publish("m", w)
    assert pub.api.get(f"/v1/models/m/versions/{v}/manifest").get("checksums") is None
    corrupt(w)
    got = connect("reader").fetch("m", v)  # nothing to verify against: the corrupt bytes arrive
    assert all(torch.equal(got[k], w[k]) for k in w) and got.failed_sources == []


def test_a_replica_with_other_bytes_is_refused(connect):
    a, b = connect("a"), connect("b")
    v = a.publish("m", weights(4, mib=2))
    with pytest.raises(tensorhub.ManifestMismatchError, match="checksum"):
        b.publish("m", weights(5, mib=2), version=v)  # same names, shapes, dtypes; other bytes


# ---------------------------------------------------------------- real processes, real Mooncake
def _replicas(url: str, version: int) -> list[dict]:
    st = httpx.get(f"{url}/v1/status", timeout=10).json()
    return [r for m in st["models"] for v in m["versions"] if v["version"] == version for r in v["replicas"]]


@pytest.mark.multiprocess
def test_multiprocess_corrupt_holder(coordinator, workers):
    url, size = coordinator.url, 24 * MiB
    pub, good = workers(url, "pub"), workers(url, "good")
    v = pub.call("publish", seed=1, nbytes=size)
    want = digest(make_weights(1, size))
    assert good.call("fetch", version=v)["digest"] == want
    bad_id = next(r["replica_id"] for r in _replicas(url, v) if r["worker_id"] == "pub")
    pub.call("corrupt", version=v)
    got = workers(url, "reader").call("fetch", version=v)
    assert got["digest"] == want and got["failed_sources"] == [bad_id] and set(got["sources"]) == {"good"}
    assert {r["worker_id"]: r["suspect"] for r in _replicas(url, v)}["pub"] is True

    # only a corrupt source: the fetch fails, naming the mismatch, and accepts nothing
    v2 = pub.call("publish", seed=2, nbytes=size)
    pub.call("corrupt", version=v2)
    lone = workers(url, "lone")
    with pytest.raises(WorkerError, match="checksum mismatch on chunk"):
        lone.call("fetch", version=v2, fetch_timeout=3)
    assert lone.call("held") == [] and [r["worker_id"] for r in _replicas(url, v2)] == ["pub"]
