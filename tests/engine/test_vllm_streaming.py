"""Cold start of a rank that serves no copy: bucket by bucket through one reused buffer.

Unit level (an embedded coordinator, the in-memory transport, a recording stand-in for
the model's ``load_weights``); the real engine path is the TP=2 test in
test_vllm_adapter.py, whose rank 1 loads this way.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

import tensorhub
from tensorhub.integrations._core import load, worker
from tensorhub.integrations._core.settings import Settings
from tensorhub.integrations.vllm import _runtime
from tensorhub.testing import InMemoryTransport, digest


def _llama_like(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {"model.embed_tokens.weight": torch.randn(512, 128, generator=g)}
    for i in range(4):
        for part in ("self_attn.q_proj", "self_attn.k_proj", "mlp.up_proj", "mlp.down_proj"):
            out[f"model.layers.{i}.{part}.weight"] = torch.randn(128, 128, generator=g)
        out[f"model.layers.{i}.input_layernorm.weight"] = torch.randn(128, generator=g).to(torch.bfloat16)
    out["lm_head.weight"] = torch.randn(512, 128, generator=g)
    return out


class Recorder:
    """Stands in for ``model.load_weights``: keeps a digest of every tensor it is fed and
    where its bytes lie (to check the buffer is reused)."""

    def __init__(self) -> None:
        self.seen: dict = {}
        self.calls: list = []

    def load_weights(self, weights) -> None:
        batch = list(weights)
        self.calls.append([(n, t.data_ptr()) for n, t in batch])
        for n, t in batch:
            self.seen[n] = hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.fixture
def hubs(embedded):
    made = []

    def make(name):
        h = tensorhub.connect(embedded.url, worker_id=name, transport=InMemoryTransport(), heartbeat_interval=0.2)
        made.append(h)
        return h

    yield embedded.url, make
    for h in made:
        h.close()


def test_stream_into_feeds_every_tensor_once_through_one_bounded_buffer(hubs, caplog):
    url, make = hubs
    w = _llama_like(3)
    v = make("trainer").publish("policy", w)
    limit = 200_000  # ~3 tensors of 64 KB: many buckets
    s = Settings.from_config({"coordinator": url, "model": "policy", "bucket_bytes": limit})
    st = _runtime.WorkerState(s, make("rank1"), rank=1, tp_size=2, serving=False)
    model = Recorder()
    with caplog.at_level("INFO", logger="tensorhub.integrations._core.load"):
        specs = load.stream_into(st, model, v, limit)
    assert model.seen == digest(w)  # every tensor, right bytes
    assert sum(len(c) for c in model.calls) == len(w)  # each exactly once
    assert len(model.calls) > 3
    assert specs == load.specs_of(w)
    biggest = max(t.numel() * t.element_size() for t in w.values())
    addrs = [p for call in model.calls for _, p in call]
    assert max(addrs) - min(addrs) < limit + biggest + 4096  # one reused buffer, not the model
    for call in model.calls:  # bounded buckets (one tensor alone may exceed the limit)
        nbytes = sum(w[n].numel() * w[n].element_size() for n, _ in call)
        assert nbytes <= limit or len(call) == 1, call
    assert st.hub.held() == []  # nothing registered: this rank serves no copy
    assert any("bucket(s) through one" in r.getMessage() for r in caplog.records)


def test_stream_into_a_missing_version_is_a_clear_error(hubs):
    url, make = hubs
    make("trainer").publish("policy", _llama_like(1))
    s = Settings.from_config({"coordinator": url, "model": "policy"})
    st = _runtime.WorkerState(s, make("rank1"), rank=1, tp_size=2, serving=False)
    with pytest.raises(tensorhub.NotFoundError, match="no version 7"):
        load.stream_into(st, Recorder(), 7, 1 << 20)


def test_a_drained_copy_becomes_the_next_swaps_destination(hubs):
    """reuse_buffers: once readers of the old version drained, its copy is kept (same
    tensors) and the next fetch lands in it: no new memory, the new bytes."""
    url, make = hubs
    trainer = make("trainer")
    w1, w2 = _llama_like(1), _llama_like(2)
    v1 = trainer.publish("policy", w1)
    s = Settings.from_config({"coordinator": url, "model": "policy", "drain_timeout": 5})
    st = _runtime.WorkerState(s, make("engine"), rank=0, tp_size=1, serving=True)
    got1 = worker.fetch(st, v1)
    st.version, st.specs, st.copy = v1, load.specs_of(got1), got1
    v2 = trainer.publish("policy", w2)
    st.retire(v1, got1)  # the swap's background step, after v2 was applied
    assert st.spare is not None and all(st.spare[k].data_ptr() == got1[k].data_ptr() for k in w1)
    assert ("policy", v1, "hf", 0) not in st.hub.held()
    got2 = worker.fetch(st, v2, into=st.spare)
    assert all(got2[k].data_ptr() == got1[k].data_ptr() for k in w2)  # the same memory
    assert digest(dict(got2)) == digest(w2)
    assert ("policy", v2, "hf", 0) in st.hub.held()  # and served from there
    # a copy whose tensors differ from the running version's is not kept
    st.spare, st.specs = None, {"other": ((1,), torch.float32)}
    v3 = trainer.publish("policy", _llama_like(3))
    st.retire(v2, got2)
    assert st.spare is None
    # reuse_buffers=false never keeps one
    st2 = _runtime.WorkerState(Settings.from_config({"coordinator": url, "model": "policy", "reuse_buffers": False}),
                               make("engine2"), serving=True)
    got3 = worker.fetch(st2, v3)
    st2.version, st2.specs = v3, load.specs_of(got3)
    trainer.publish("policy", _llama_like(4))
    st2.retire(v3, got3)
    assert st2.spare is None


def _eventually(cond, timeout: float = 20.0) -> bool:
    import time

    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def test_prefetch_fetches_new_versions_while_the_engine_runs_the_old_one(hubs):
    """prefetch: a background thread fetches (and serves) each new version at once; a swap
    takes it without a transfer; a version superseded before its swap is retired."""
    from tensorhub.integrations.vllm._prefetch import Prefetcher

    url, make = hubs
    trainer = make("trainer")
    w = {i: _llama_like(10 + i) for i in range(1, 5)}
    v1 = trainer.publish("policy", w[1])
    s = Settings.from_config({"coordinator": url, "model": "policy", "prefetch": True, "drain_timeout": 5})
    st = _runtime.WorkerState(s, make("engine"), serving=True)
    got1 = worker.fetch(st, v1)
    st.version, st.specs, st.copy = v1, load.specs_of(got1), got1
    pf = Prefetcher(st, poll=1.0).start()
    try:
        v2 = trainer.publish("policy", w[2])
        assert _eventually(lambda: ("policy", v2, "hf", 0) in st.hub.held())  # served before any swap
        got2 = pf.take(v2, timeout=10)
        assert got2 is not None and digest(dict(got2)) == digest(w[2])
        assert pf.take(v2, timeout=0) is None  # handed over once
        st.version, st.copy = v2, got2
        # two versions before the next swap: only the newest stays, the other is retired
        v3 = trainer.publish("policy", w[3])
        assert _eventually(lambda: ("policy", v3, "hf", 0) in st.hub.held())
        v4 = trainer.publish("policy", w[4])
        assert _eventually(lambda: ("policy", v4, "hf", 0) in st.hub.held()
                           and ("policy", v3, "hf", 0) not in st.hub.held())
        assert pf.take(v3, timeout=1) is None  # superseded
        got4 = pf.take(v4, timeout=10)
        assert got4 is not None and digest(dict(got4)) == digest(w[4])
    finally:
        pf.stop()


class Keeper(torch.nn.Module):
    """Stands in for a model whose ``load_weights`` copies most tensors into its parameters
    but keeps one loaded tensor itself (as a buffer): the case ``borrow_into`` must catch."""

    def __init__(self, w: dict, kept: str) -> None:
        super().__init__()
        self.names = {n: f"p{i}" for i, n in enumerate(w)}
        for n, t in w.items():
            if n != kept:
                self.register_parameter(self.names[n], torch.nn.Parameter(torch.empty_like(t), requires_grad=False))
        self.kept = kept

    def load_weights(self, weights) -> None:
        for n, t in weights:
            if n == self.kept:
                self.register_buffer("kept_tensor", t)  # the loaded tensor itself, no copy
            else:
                getattr(self, self.names[n]).data.copy_(t)

    def weights(self) -> dict:
        out = {n: getattr(self, p).detach() for n, p in self.names.items() if n != self.kept}
        out[self.kept] = self.kept_tensor
        return out


def test_borrow_into_loads_in_place_then_the_kept_copy_serves(embedded, caplog):
    """A same-host trainer's ``empty_like`` snapshot (real Mooncake + same-host transports,
    two Hubs in this process): the rank loads it in place (no fetch, nothing held), a tensor
    the model kept is copied before the lease ends, and the background copy is registered
    with every byte; the trainer then drops and zeroes its memory: the model is unchanged."""
    url = embedded.url
    trainer = tensorhub.connect(url, worker_id="trainer", heartbeat_interval=0.2)
    rank = tensorhub.connect(url, worker_id="rank0", heartbeat_interval=0.2)
    try:
        w = _llama_like(5)
        snap = trainer.empty_like(w)
        for k, t in w.items():
            snap[k].copy_(t)
        v = trainer.publish("policy", snap)
        s = Settings.from_config({"coordinator": url, "model": "policy", "bucket_bytes": 200_000})
        st = _runtime.WorkerState(s, rank, serving=True)
        model = Keeper(w, kept="model.layers.1.mlp.up_proj.weight")
        with caplog.at_level("INFO", logger="tensorhub.integrations._core.load"):
            b = load.borrow_into(st, model, v, s.bucket_bytes)
        assert b is not None and b.trusted()
        assert digest(model.weights()) == digest(w) and st.version == v and st.specs == load.specs_of(w)
        assert b.sharing(model.named_buffers()) == [] and b.sharing(model.named_parameters()) == []
        assert any("Keeper kept the loaded tensor kept_tensor itself" in r.getMessage()
                   for r in caplog.records)
        assert rank.held() == []  # nothing of its own yet
        st.keep_borrowed(b, v)
        st.wait_kept(60)
        assert st.copy is not None and digest(st.copy) == digest(w)
        assert rank.held() == [("policy", v, "hf", 0)]
        trainer.unpublish("policy", v, timeout=10)  # the lease was released: no wait
        for t in snap.values():
            t.zero_()
        assert digest(model.weights()) == digest(w)  # nothing of the model viewed the trainer's memory
        got = trainer.fetch("policy", v, serve=False)
        assert set(got.sources) == {"rank0"} and digest(got) == digest(w)
    finally:
        rank.close()
        trainer.close()


def test_borrow_into_is_none_without_a_same_host_holder(hubs):
    """The in-memory transport (as a remote holder): nothing borrowed, nothing loaded."""
    url, make = hubs
    v = make("trainer").publish("policy", _llama_like(2))
    st = _runtime.WorkerState(Settings.from_config({"coordinator": url, "model": "policy"}), make("rank0"))
    model = Recorder()
    assert load.borrow_into(st, model, v, 1 << 20) is None
    assert model.calls == [] and st.version is None
