"""Publishing a version as an earlier one's tensors with its own sums (``RegisterReplica.like``,
``ManifestLike``): the coordinator builds the manifest from its copy of the earlier one, byte
for byte the manifest a full registration gives; what it cannot build is refused with a code
the publisher answers by sending the manifest. End to end on a real coordinator process with
Mooncake between worker processes: readers get the new version's bytes, checksums verified."""

from __future__ import annotations

import httpx
import pytest

from tensorhub._exceptions import ConflictError, InvalidRequestError
from tensorhub.server.grants import grid_of
from tensorhub.server.state import CoordinatorState, StateConfig
from tensorhub.protocol import (Locality, Manifest, ManifestLike, RegisterReplica, manifest_digest, manifest_json,
                                shape_digest)
from tensorhub.testing import digest, make_weights


def _manifest(n: int = 40, sums: int = 0, slices: bool = False) -> Manifest:
    tensors = [{"name": f"layers.{i}.w", "dtype": "float32", "shape": [256, 64], "nbytes": 256 * 64 * 4}
               for i in range(n)]
    m = Manifest.model_validate({"tensors": tensors})
    k = grid_of(m)[1]
    return Manifest.model_validate({"tensors": tensors, "checksum": "xxh3_64",
                                    "checksums": [(sums * 1_000_003 + c) % (1 << 64) for c in range(k)]})


def _state_with_v1(man: Manifest) -> CoordinatorState:
    st = CoordinatorState(StateConfig(), now=0.0)
    st.register_worker(0.0, "trainer", "127.0.0.1:1", Locality())
    v1 = st.allocate_version(0.0, "m")
    st.register_replica(0.0, RegisterReplica(worker_id="trainer", model="m", version=v1, manifest=man,
                                             addresses=[(1 << 32) + (1 << 20) * i for i in range(len(man.tensors))]))
    return st


def _like(man: Manifest, new: Manifest, version: int = 1, **kw) -> RegisterReplica:
    like = ManifestLike(version=version, shape_digest=shape_digest(man), checksum=new.checksum,
                        checksums=new.checksums, meta=new.meta)
    body = dict(worker_id="trainer", model="m", version=2, like=like,
                addresses=[(2 << 32) + (1 << 20) * i for i in range(len(man.tensors))])
    return RegisterReplica(**(body | kw))


def test_the_manifest_made_from_an_earlier_version_is_the_one_a_full_registration_gives():
    v1, v2 = _manifest(sums=1), _manifest(sums=2)
    st = _state_with_v1(v1)
    assert st.allocate_version(1.0, "m") == 2
    rid, complete = st.register_replica(1.0, _like(v1, v2))
    assert rid and complete
    got = st.manifest("m", 2, "hf", 0)
    assert got.checksums == v2.checksums and got.tensors == v1.tensors
    assert manifest_json(got) == manifest_json(v2)  # byte for byte: the canonical JSON made from v1's
    assert st.digest_of("m", 2, "hf", 0, got) == manifest_digest(v2)  # readers register by digest
    assert shape_digest(got) == shape_digest(v2) and grid_of(got) == grid_of(v2)
    # the durable record is the full manifest: a restart restores v2 as a full registration would
    assert Manifest.model_validate_json(manifest_json(got)) == v2


def test_what_cannot_be_made_is_refused_and_registers_nothing():
    v1, v2 = _manifest(sums=1), _manifest(sums=2)
    st = _state_with_v1(v1)
    st.allocate_version(1.0, "m")
    with pytest.raises(ConflictError) as e:  # a version the coordinator does not know
        st.register_replica(1.0, _like(v1, v2, version=1).model_copy(
            update={"like": _like(v1, v2).like.model_copy(update={"version": 7})}))
    assert e.value.code == "like_unknown"
    other = _manifest(n=41, sums=2)
    with pytest.raises(ConflictError) as e:  # other tensors than v1's
        st.register_replica(1.0, _like(other, other))
    assert e.value.code == "like_mismatch"
    with pytest.raises(InvalidRequestError, match="checksums for a shard of"):
        st.register_replica(1.0, _like(v1, v2.model_copy(update={"checksums": v2.checksums[:-1]})))
    assert st.latest("m") == 1  # nothing registered for v2
    with pytest.raises(ValueError, match="exactly one"):
        RegisterReplica(worker_id="t", model="m", version=2, manifest=v2, like=_like(v1, v2).like,
                        addresses=[1] * len(v2.tensors))
    with pytest.raises(ValueError, match="earlier version"):
        _like(v1, v2, version=2)
    with pytest.raises(ValueError, match="go together"):
        ManifestLike(version=1, shape_digest=shape_digest(v1), checksums=[1])


@pytest.mark.multiprocess
def test_a_publisher_sends_later_versions_as_the_earlier_ones_tensors(coordinator, workers):
    """A worker process publishes v1..v3 of the same tensors (new values each time): v1 with
    its manifest, v2 and v3 as v1's / v2's tensors with their own checksums; readers in
    other processes read each over Mooncake, checksums verified, bytes equal. A version with
    other tensors goes whole again. With ``TENSORHUB_REGISTER_LIKE=0`` every version does."""
    url = coordinator.url
    pub = workers(url, "pub")
    reader = workers(url, "reader")
    nbytes = 8 << 20

    def kinds() -> dict:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line.startswith("tensorhub_replica_registrations_total{"):
                labels, value = line.rsplit(" ", 1)
                if 'model="policy"' in labels:
                    out[labels.split('manifest="')[1].split('"')[0]] = int(float(value))
        return out

    for seed in (1, 2, 3):
        v = pub.call("publish", seed=seed, nbytes=nbytes)
        got = reader.call("fetch", version=v)
        assert got["digest"] == digest(make_weights(seed, nbytes))
    assert kinds().get("manifest") == 1 and kinds().get("like") == 2, kinds()
    v = pub.call("publish", seed=4, nbytes=nbytes // 2)  # other tensors: the manifest again
    assert reader.call("fetch", version=v)["digest"] == digest(make_weights(4, nbytes // 2))
    assert kinds().get("manifest") == 2 and kinds().get("like") == 2, kinds()

    before = kinds()
    off = workers(url, "pub-off", env={"TENSORHUB_REGISTER_LIKE": "0"})
    for seed in (5, 6):
        v = off.call("publish", seed=seed, nbytes=nbytes)
        assert reader.call("fetch", version=v)["digest"] == digest(make_weights(seed, nbytes))
    assert kinds()["manifest"] == before["manifest"] + 2 and kinds()["like"] == before["like"], kinds()


def test_a_publisher_the_coordinator_cannot_serve_by_like_sends_the_manifest(connect):
    """The version a publisher would name is unknown to the coordinator (retired, or another
    coordinator's), or has other tensors: it is refused by code and the publisher sends the
    manifest in the same ``publish`` call; readers read the right bytes either way."""
    import torch

    pub, reader = connect("pub"), connect("reader")
    w = {f"t{i}": torch.full((64, 32), float(i)) for i in range(4)}
    v1 = pub.publish("m", w)
    sent: list[dict] = []
    api = pub._session.api
    real = api.register_replica

    def spy(body, **kw):
        sent.append(body)
        return real(body, **kw)

    api.register_replica = spy
    key = ("m", "hf", 0)
    assert pub._session._published[key][0] == v1
    gap = api.allocate_version("m", None)  # allocated, never registered: no manifest to make one from
    other = connect("other").publish("m", {"x": torch.zeros(8)})  # registered, other tensors
    shape = pub._session._published[key][1]
    for bogus in ((gap, shape), (other, shape)):
        pub._session._published[key] = bogus
        w = {k: t + 1 for k, t in w.items()}
        v = pub.publish("m", w)
        assert [("like" in b, "manifest" in b) for b in sent] == [(True, False), (False, True)], sent
        got = reader.fetch("m", v)
        assert all(torch.equal(got[k], t) for k, t in w.items())
        assert pub._session._published[key][0] == v  # the next one is named by this one
        sent.clear()
    for _ in range(2):  # each next one names the one before (the newest: retired last)
        w = {k: t + 1 for k, t in w.items()}
        before = pub._session._published[key][0]
        v = pub.publish("m", w)
        assert [(b.get("like", {}).get("version"), "manifest" in b) for b in sent] == [(before, False)]
        assert pub._session._published[key][0] == v
        assert all(torch.equal(reader.fetch("m", v)[k], t) for k, t in w.items())
        sent.clear()
