"""``GET .../manifest`` served from the coordinator's cache (``server.manifest_cache``): the
cached answer is the uncached one byte for byte, gzipped only for clients that accept it,
encoded once per shard, and a retired version is refused (404) as before, never served
from the cache."""

from __future__ import annotations

import gzip
import time

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tensorhub.server.manifest_cache import GZIP_OVER, ManifestCache, encode
from tensorhub.protocol import Manifest, SliceSpec, TensorSpec
from tensorhub.testing import CoordinatorProcess


def _manifest(n: int, checksums: bool = False, slices: bool = False) -> Manifest:
    tensors = [TensorSpec(name=f"model.layers.{i}.mlp.experts.{i % 7}.weight", dtype="bfloat16",
                          shape=(16, 8 + i % 5), nbytes=16 * (8 + i % 5) * 2) for i in range(n)]
    kw: dict = {}
    if checksums:
        from tensorhub._checksum import count

        kw = {"checksum": "xxh3_64", "checksums": [(1 << 63) + i for i in range(count([t.nbytes for t in tensors]))]}
    if slices:
        kw["slices"] = [SliceSpec(shape=(32, t.shape[1]), offsets=(16, 0)) for t in tensors]
    return Manifest(tensors=tensors, **kw)


def _route_before_cache(man: Manifest) -> bytes:
    """What the route answered before the cache: FastAPI serializing the state machine's
    Manifest through ``response_model=Manifest`` (the route's code as it was)."""
    app = FastAPI()

    @app.get("/manifest", response_model=Manifest)
    def manifest() -> Manifest:
        return man

    with TestClient(app) as c:
        r = c.get("/manifest")
        assert r.status_code == 200
        return r.content


@pytest.mark.parametrize("kind", ["plain", "checksums", "slices", "tiny"])
def test_encoded_answer_equals_the_uncached_route_byte_for_byte(kind):
    man = _manifest(3 if kind == "tiny" else 2000, checksums=kind == "checksums", slices=kind == "slices")
    enc = encode(man)
    assert enc.json == _route_before_cache(man)
    if kind == "tiny":
        assert enc.gzip is None and len(enc.json) <= GZIP_OVER  # small answers go as they are
    else:
        assert gzip.decompress(enc.gzip) == enc.json and len(enc.gzip) < len(enc.json) / 4


def test_cache_matches_by_identity_forgets_retired_versions_and_stays_bounded():
    a, b = _manifest(500), _manifest(500)
    cache = ManifestCache(max_bytes=3 * encode(a).size)
    cache.put(("m", 1, "hf", 0), a)
    assert cache.get(("m", 1, "hf", 0), a) is not None
    assert cache.get(("m", 1, "hf", 0), b) is None  # equal, but another object (a reloaded catalog)
    for v in (2, 3, 4):
        cache.put(("m", v, "hf", 0), _manifest(500))
    assert len(cache) == 3 and cache.nbytes <= cache.max_bytes  # the least recently used went
    cache.forget("m", 3)
    assert len(cache) == 2 and cache.get(("m", 3, "hf", 0), a) is None


def _publish(c: httpx.Client, worker: str, man: Manifest) -> int:
    v = c.post("/v1/models/m/versions", json={}).json()["version"]
    c.post("/v1/replicas", json={"worker_id": worker, "model": "m", "version": v, "manifest": man.model_dump(mode="json"),
                                 "addresses": [4096 * (i + 1) for i in range(len(man.tensors))]}).raise_for_status()
    return v


def test_real_coordinator_serves_the_cached_manifest_and_refuses_a_retired_one(tmp_path):
    """A real coordinator process (``--keep-versions 1``): the answer to many readers is the
    uncached route's bytes, gzipped for httpx (which accepts it) and plain for a client that
    does not say so; once retired, the version is 404 ``unknown_version`` as before, although
    its manifest had been cached."""
    coord = CoordinatorProcess(tmp_path / "state", extra=("--keep-versions", "1", "--worker-ttl", "30"))
    coord.start()
    try:
        man = _manifest(3000, checksums=True)
        want = _route_before_cache(man)
        with httpx.Client(base_url=coord.url, timeout=30) as c:
            c.post("/v1/workers", json={"worker_id": "trainer", "endpoint": "127.0.0.1:1"}).raise_for_status()
            v1 = _publish(c, "trainer", man)
            path = f"/v1/models/m/versions/{v1}/manifest"
            answers = [c.get(path, params={"layout": "hf", "shard": 0}) for _ in range(3)]
            for r in answers:  # httpx sends Accept-Encoding: gzip and decodes it
                assert r.status_code == 200 and r.headers["content-encoding"] == "gzip"
                assert r.content == want
                assert int(r.headers["content-length"]) < len(want) / 4  # what crossed the wire
            plain = c.get(path, headers={"Accept-Encoding": "identity"})
            assert "content-encoding" not in plain.headers and plain.content == want
            refused = c.get(path, headers={"Accept-Encoding": "gzip;q=0"})
            assert "content-encoding" not in refused.headers and refused.content == want
            # The Hub's own client reads it as before.
            from tensorhub._client import CoordinatorClient

            hub_client = CoordinatorClient(coord.url)
            try:
                assert hub_client.manifest("m", v1) == man
            finally:
                hub_client.close()
            # A newer version, and the trainer lets v1 go: retention retires v1 (ticks every second).
            v2 = _publish(c, "trainer", _manifest(10))
            c.post(f"/v1/models/m/versions/{v1}/unpublish", json={"worker_id": "trainer"}).raise_for_status()
            deadline = time.monotonic() + 20
            while True:
                gone = c.get(path)
                if gone.status_code != 200 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert gone.status_code == 404, (gone.status_code, gone.text[:200])
            assert gone.json()["code"] == "unknown_version" and "retired" in gone.json()["detail"]
            assert c.get(f"/v1/models/m/versions/{v2}/manifest").status_code == 200
    finally:
        coord.stop()


def test_lease_answers_equal_the_grants_own_json_byte_for_byte():
    """``LeaseAnswers`` splices each source's addresses, encoded once per replica, into the
    grant's JSON: the bytes equal ``grant.model_dump_json()`` (strings that look like the
    splice point included), and a replica whose address list changed is encoded again."""
    from tensorhub.server.manifest_cache import LeaseAnswers
    from tensorhub.protocol import LeaseGrant, Locality, ReplicaInfo

    def rep(i: int, n: int, addresses=None) -> ReplicaInfo:
        return ReplicaInfo(replica_id=f"r-{i}", worker_id=f'w"{i}', endpoint="127.0.0.1:1",
                           locality=Locality(datacenter="d", zone="z", host=f"h{i}"),
                           addresses=addresses or [(1 << 44) + (i << 32) + 4096 * k for k in range(n)], cost=i % 4,
                           chunks=None if i == 0 else [], status_addr=None if i == 0 else 4096,
                           status_tag=None if i == 0 else 7, num_chunks=0 if i == 0 else 64)

    answers = LeaseAnswers()
    odd = 'reason "addresses":[] and \\"addresses\\":[]'
    for reps in ([rep(0, 5000), rep(1, 5000), rep(2, 5000), rep(3, 5000)], [rep(0, 3)], [], [rep(1, 100)]):
        g = LeaseGrant(lease_id="l-1", model="m", version=3, layout="hf", shard=0, num_shards=1, replicas=reps,
                       ttl=30.0, reason=odd, serve_refused=odd, manifest=_manifest(20))
        for _ in range(2):  # encoded, then from what was kept
            assert answers.encode(g) == g.model_dump_json().encode()
    moved = rep(1, 100, addresses=[8192 * k for k in range(100)])  # same id, other memory
    g = LeaseGrant(lease_id="l-2", model="m", version=3, layout="hf", shard=0, num_shards=1, replicas=[moved], ttl=1.0)
    assert answers.encode(g) == g.model_dump_json().encode()


def test_lease_answers_encode_a_versions_sums_once_and_splice_them_byte_for_byte():
    """A lease asked ahead carries its version's checksums (``LeaseGrant.sums``, the same for
    every subscriber): ``LeaseAnswers`` encodes them once per sums list and splices them. The
    bytes equal ``model_dump_json`` with and without address lists to splice, with meta,
    with strings in the grant that look like the splice point; other sums (another version,
    or the same list object with other meta) are encoded anew, never answered stale."""
    import random

    from tensorhub.server.manifest_cache import SUMS_KEPT, LeaseAnswers, _SUMS_STUB_JSON
    from tensorhub.protocol import LeaseGrant, Locality, ReplicaInfo, VersionMeta, VersionSums

    rng = random.Random(7)
    answers = LeaseAnswers()

    def grant(sums, n_addresses: int, reason: str = "") -> LeaseGrant:
        reps = [ReplicaInfo(replica_id=f"r-{i}", worker_id=f"w{i}", endpoint="127.0.0.1:1",
                            locality=Locality(datacenter="d", zone="z", host=f"h{i}"),
                            addresses=[4096 * k for k in range(n_addresses)], cost=i) for i in range(3)]
        return LeaseGrant(lease_id="l-1", model="m", version=3, layout="hf", shard=0, num_shards=1, replicas=reps,
                          ttl=30.0, reason=reason, sums=sums)

    big = [rng.getrandbits(64) for _ in range(256)]  # past 2**63 too: pydantic's slow path
    s1 = VersionSums(checksum="xxh3_64", checksums=big, meta=VersionMeta(kind="lora", base="m", config={"r": 8, "lora_alpha": 16, "target_modules": ["q"], "note": "\x01sums\x01"}))
    odd = _SUMS_STUB_JSON.decode() + ' "addresses":[] \x01sums\x01 \u0001'
    for sums in (s1, VersionSums(checksum="xxh3_64", checksums=big[:3]), None):
        for n in (0, 100):
            for reason in ("", odd):
                g = grant(sums, n, reason)
                for _ in range(2):  # encoded, then spliced from what was kept
                    assert answers.encode(g) == g.model_dump_json().encode()
    # the same list object, other meta (another version made from it): not the kept JSON
    s2 = VersionSums(checksum="xxh3_64", checksums=big, meta=VersionMeta(kind="full"))
    g = grant(s2, 0)
    assert answers.encode(g) == g.model_dump_json().encode()
    # a list changed in place keeps its id: a new list is what a new version registers
    # (manifests are immutable); a different list with equal values encodes equal bytes
    g = grant(VersionSums(checksum="xxh3_64", checksums=list(big)), 0)
    assert answers.encode(g) == g.model_dump_json().encode()
    for k in range(SUMS_KEPT + 3):  # bounded
        g = grant(VersionSums(checksum="xxh3_64", checksums=[rng.getrandbits(64) for _ in range(20)]), 0)
        assert answers.encode(g) == g.model_dump_json().encode()
    assert len(answers._sums) <= SUMS_KEPT


@pytest.mark.parametrize("n", [0, 1, 2048, 2049, 3 * 2048 + 7, 20_000])
@pytest.mark.parametrize("extra", ["none", "slices", "checksums"])
def test_a_large_manifests_json_made_in_pieces_is_its_json_byte_for_byte(n, extra):
    """``manifest_json`` makes a large manifest's canonical JSON in pieces (so no one call
    holds the interpreter's lock for 50,000 tensors): the same bytes as ``model_dump_json``,
    hence the same digest, with and without slices and checksums, names that need escaping."""
    import math
    import random

    from tensorhub._checksum import count
    from tensorhub.protocol import DTYPE_SIZES, manifest_digest, manifest_json
    from tensorhub.protocol.manifest import _pieced_json

    rng = random.Random(n)
    tensors, slices = [], []
    for i in range(n):
        dt = rng.choice(sorted(DTYPE_SIZES))
        shape = [rng.randint(1, 9) for _ in range(rng.randint(1 if extra == "slices" else 0, 3))]
        tensors.append(TensorSpec(name=f'layer.{i}.w\u00e9"\\{rng.random()}', dtype=dt, shape=shape,
                                  nbytes=math.prod(shape) * DTYPE_SIZES[dt]))
        slices.append(SliceSpec(shape=[s * 2 for s in shape], offsets=[s for s in shape]))
    kw: dict = {}
    if extra == "slices":
        kw["slices"] = slices
    if extra == "checksums":
        kw = {"checksum": "xxh3_64", "checksums": [rng.getrandbits(64) for _ in range(count([t.nbytes for t in tensors]))]}
    m = Manifest(tensors=tensors, **kw)
    whole = m.model_dump_json().encode()
    assert _pieced_json(m) == whole
    assert manifest_json(m) == whole
    assert manifest_digest(m) == manifest_digest(Manifest.model_validate_json(whole))
