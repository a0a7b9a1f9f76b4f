"""A delta crosses the slow link once per datacenter: the delta layout is leased, seeded and
pipelined like any layout (embedded coordinator, throttled in-memory transport that
records every data read: reader, source, bytes; reads of partial replicas' chunk maps,
``_chunkmap``, are not data and not counted)."""

from __future__ import annotations

import threading

import pytest
import torch

import tensorhub
from tensorhub.testing import InMemoryTransport

# What these check tilts on a loaded machine: scripts/test.sh runs them with no other test beside them.
pytestmark = pytest.mark.alone

MiB = 1 << 20
_READS: list[tuple[str, str, int]] = []
_MAPS: list[tuple[int, int]] = []  # (addr, nbytes) of every chunk map made
_LOCK = threading.Lock()


class CountingTransport(InMemoryTransport):
    def submit_read(self, peer, ops):
        with _LOCK:
            data = [op for op in ops if not any(a <= op.remote_addr < a + n for a, n in _MAPS)]
            if data:
                _READS.append((self.endpoint, peer, sum(op.length for op in data)))
        return super().submit_read(peer, ops)


@pytest.fixture
def hubs(embedded, monkeypatch):
    from tensorhub import _chunkmap

    made = []
    _READS.clear()
    _MAPS.clear()
    init = _chunkmap.ChunkMap.__init__

    def record(self, n):
        init(self, n)
        with _LOCK:
            _MAPS.append(self.region)

    monkeypatch.setattr(_chunkmap.ChunkMap, "__init__", record)

    def make(name: str, where: str):
        h = tensorhub.connect(embedded.url, worker_id=name, transport=CountingTransport(bandwidth=24 * MiB),
                              locality=where, heartbeat_interval=0.2)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def _fetch_all(readers, version):
    out: dict[str, object] = {}

    def run(h):
        try:
            out[h.worker_id] = h.fetch("m", version)
        except Exception as e:  # noqa: BLE001 - asserted below
            out[h.worker_id] = e

    ts = [threading.Thread(target=run, args=(h,)) for h in readers]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    return out


def _bits(t):
    return bytes(t.reshape(-1).view(torch.uint8).numpy())


def test_a_delta_crosses_datacenters_once_and_fans_out_on_the_far_side(hubs):
    pub = hubs("pub", "dc=a,zone=z,host=p")
    g = torch.Generator().manual_seed(7)
    w1 = {f"w{i}": torch.randn(1 << 20, generator=g).to(torch.bfloat16) for i in range(4)}  # 8 MiB
    pub.publish("m", w1)
    readers = [hubs(f"b{i}", f"dc=b,zone=z,host=h{i}") for i in range(3)]
    for f in _fetch_all(readers, 1).values():
        assert not isinstance(f, Exception), f
    w2 = {}
    for k, t in w1.items():
        t = t.clone()
        idx = torch.randperm(t.numel(), generator=g)[: t.numel() // 100]
        t[idx] = (t[idx].float() * 1.01 + 1e-3).to(torch.bfloat16)
        w2[k] = t
    pub.publish("m", w2, base=1)
    delta = sum(s.nbytes for s in pub.manifest("m", 2, layout="delta:1"))
    full = sum(t.numel() * 2 for t in w2.values())
    assert delta < 0.06 * full

    pub_ep = pub.endpoint
    _READS.clear()
    got = _fetch_all(readers, 2)
    for name, f in got.items():
        assert not isinstance(f, Exception), f
        assert f.delta is not None and f.delta.steps == [(1, 2)], name
        assert all(_bits(f[k]) == _bits(w2[k]) for k in w2), name
    crossed = sum(n for _, peer, n in _READS if peer == pub_ep)
    assert crossed == delta, f"{crossed} bytes crossed datacenters for a {delta}-byte delta (full: {full})"
    assert sum(n for _, _, n in _READS) == 3 * delta  # the far side fanned it out among itself
