"""Part of a version: ``Hub.manifest`` lists its tensors, ``fetch(names=...)`` reads some.

What an engine streams with (bounded buckets into one reused buffer, instead of a whole
model-size copy). First against an embedded coordinator with the in-memory transport,
then between real processes over Mooncake.
"""

from __future__ import annotations

import pytest
import torch

import tensorhub
from tensorhub.testing import InMemoryTransport, digest, make_weights

MiB = 1 << 20


@pytest.fixture
def pair(embedded):
    made = []

    def make(name: str) -> tensorhub.Hub:
        h = tensorhub.connect(embedded.url, worker_id=name, transport=InMemoryTransport(), heartbeat_interval=0.2)
        made.append(h)
        return h

    yield make("trainer"), make("reader")
    for h in made:
        h.close()


def _open_leases(hub: tensorhub.Hub) -> list:
    return hub.api.get("/v1/status")["leases"]


def test_manifest_lists_names_dtypes_and_shapes_in_order(pair):
    trainer, reader = pair
    w = make_weights(1, 4 * MiB, n=6)
    v = trainer.publish("m", w)
    specs = reader.manifest("m", v)
    assert [s.name for s in specs] == list(w)
    for s in specs:
        t = w[s.name]
        assert s.shape == tuple(t.shape) and s.nbytes == t.numel() * t.element_size()
        assert s.dtype == str(t.dtype).removeprefix("torch.")
    with pytest.raises(tensorhub.NotFoundError, match="no version 99"):
        reader.manifest("m", 99)
    with pytest.raises(tensorhub.NotFoundError, match="no layout 'native'"):
        reader.manifest("m", v, layout="native")


def test_fetch_names_reads_only_those_tensors(pair):
    trainer, reader = pair
    w = make_weights(2, 8 * MiB, n=8)
    v = trainer.publish("m", w)
    pick = [list(w)[5], list(w)[1]]
    got = reader.fetch("m", v, names=pick, serve=False)
    assert set(got) == set(pick)
    assert digest(dict(got)) == digest({k: w[k] for k in pick})
    assert got.nbytes == sum(w[k].numel() * w[k].element_size() for k in pick)
    assert reader.held() == [] and _open_leases(reader) == []


def test_streaming_buckets_into_one_reused_buffer(pair):
    """The loop an engine runs: each bucket lands in the same buffer, checked before reuse."""
    trainer, reader = pair
    w = make_weights(3, 8 * MiB, n=8)
    v = trainer.publish("m", w)
    names = [s.name for s in reader.manifest("m", v)]
    biggest = max(w[k].numel() * w[k].element_size() for k in names)
    buf = torch.empty(2 * biggest, dtype=torch.uint8)
    seen = {}
    for i in range(0, len(names), 2):
        bucket, off = {}, 0
        for k in names[i:i + 2]:
            t = w[k]
            n = t.numel() * t.element_size()
            bucket[k] = buf[off:off + n].view(t.dtype).view(t.shape)
            off += n
        got = reader.fetch("m", v, names=list(bucket), into=bucket, serve=False)
        assert all(got[k].data_ptr() == bucket[k].data_ptr() for k in bucket)  # no new memory
        seen.update(digest(dict(got)))
    assert seen == digest(w)


def test_fetch_names_errors_are_clear_and_leave_nothing_open(pair):
    trainer, reader = pair
    w = make_weights(4, 2 * MiB, n=4)
    v = trainer.publish("m", w)
    with pytest.raises(tensorhub.ConfigError, match="serve=False"):
        reader.fetch("m", v, names=[next(iter(w))])  # serve defaults to True
    with pytest.raises(tensorhub.ConfigError, match="at least one"):
        reader.fetch("m", v, names=[], serve=False)
    with pytest.raises(tensorhub.TensorMismatchError, match="no tensor 'nope'"):
        reader.fetch("m", v, names=[next(iter(w)), "nope"], serve=False)
    first = next(iter(w))
    wrong = {first: torch.empty(3, dtype=torch.float64)}
    with pytest.raises(tensorhub.TensorMismatchError, match=first):
        reader.fetch("m", v, names=[first], into=wrong, serve=False)
    assert _open_leases(reader) == [] and reader.held() == []
    # ...and the reader still works
    assert digest(dict(reader.fetch("m", v, names=[first], serve=False))) == digest({first: w[first]})


def test_a_holder_reads_part_of_its_own_replica_without_transfer(pair):
    trainer, _ = pair
    w = make_weights(5, 2 * MiB, n=4)
    v = trainer.publish("m", w)
    k = list(w)[2]
    got = trainer.fetch("m", v, names=[k], serve=False)
    assert digest(dict(got)) == digest({k: w[k]})
    assert got[k].data_ptr() != w[k].data_ptr()  # a copy: the served tensor stays untouched


@pytest.mark.multiprocess
def test_fetch_names_between_processes_over_mooncake(coordinator, workers):
    pub = workers(coordinator.url, "pub")
    v = pub.call("publish", seed=6, nbytes=32 * MiB)
    want = make_weights(6, 32 * MiB)
    hub = tensorhub.connect(coordinator.url, worker_id="streamer")
    try:
        specs = hub.manifest(_model_of(pub), v)
        names = [s.name for s in specs]
        assert names == list(want)
        part = names[1::3]
        got = hub.fetch(_model_of(pub), v, names=part, serve=False)
        assert digest(dict(got)) == digest({k: want[k] for k in part})
        assert set(got.sources) == {"pub"}
    finally:
        hub.close()


def _model_of(worker) -> str:
    return worker.call("held")[0][0]
