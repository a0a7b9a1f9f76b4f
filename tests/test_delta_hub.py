"""Delta versions through the Hub (embedded coordinator, in-memory transport): publishing a
delta beside the full version, fetching through it (direct, chain, into in place), and
every fallback a reader takes (no base, evicted base, corrupt delta, wrong base), checking
the bytes that arrive and the bytes that moved."""

from __future__ import annotations

import logging

import pytest
import torch
from prometheus_client import REGISTRY

from tensorhub import _delta, _delta_path
from tensorhub._exceptions import ConfigError, TensorMismatchError


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(512, 256, generator=g).to(torch.bfloat16),
        "w": torch.randn(256, 256, generator=g),
        "fp8": torch.randn(1000, generator=g).to(torch.float8_e4m3fn),
        "step": torch.tensor([seed], dtype=torch.int64),
        "mask": torch.rand(77, generator=g) > 0.5,
    }


def _step(prev: dict[str, torch.Tensor], seed: int, frac: float = 0.01) -> dict[str, torch.Tensor]:
    """A new version: ``frac`` of each float tensor's elements changed, the rest bit-identical."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, t in prev.items():
        t = t.clone()
        if t.dtype in (torch.bfloat16, torch.float32, torch.float8_e4m3fn):
            flat = t.view(-1)
            idx = torch.randperm(flat.numel(), generator=g)[: max(1, int(frac * flat.numel()))]
            flat[idx] = (flat[idx].float() + 0.5).to(t.dtype)
        elif k == "step":
            t += 1
        out[k] = t
    return out


def _bits(t: torch.Tensor) -> bytes:
    return bytes(t.reshape(-1).view(torch.uint8).numpy())


def _same(got, want) -> bool:
    return set(got) == set(want) and all(_bits(got[k]) == _bits(want[k]) for k in want)


def _full(w) -> int:
    return sum(t.numel() * t.element_size() for t in w.values())


def _counter(outcome: str) -> float:
    return REGISTRY.get_sample_value("tensorhub_hub_delta_fetches_total", {"model": "m", "outcome": outcome}) or 0.0


def test_publish_with_base_adds_a_delta_layout_and_a_holder_of_the_base_fetches_only_it(connect):
    t, r, late = connect("trainer"), connect("reader"), connect("late")
    w1 = _weights(1)
    v1 = t.publish("m", w1)
    r.fetch("m", v1)
    w2 = _step(w1, 2)
    v2 = t.publish("m", w2, base=v1)
    dm = t.manifest("m", v2, layout=_delta_path.delta_layout(v1))
    assert [s.name for s in dm][0] == _delta_path.HEADER
    dbytes = sum(s.nbytes for s in dm)
    assert dbytes < 0.1 * _full(w2)

    ok0 = _counter("ok")
    f = r.fetch("m", v2)
    assert _same(f, w2)
    assert f.delta is not None and f.delta.steps == [(v1, v2)]
    assert f.nbytes == dbytes and f.sources == {"trainer": dbytes}
    assert _counter("ok") == ok0 + 1
    # The reader serves v2 in full and the delta it read; v1 stays as it was.
    assert ("m", v2, "hf", 0) in r.held() and ("m", v2, "delta:1", 0) in r.held()
    assert _same(r._holdings.get(("m", v1, "hf", 0)).tensors, w1)
    # The full version stays fetchable (a reader without the base reads it, from anyone).
    g = late.fetch("m", v2)
    assert _same(g, w2) and g.delta is None and g.nbytes == _full(w2)


def test_a_chain_of_deltas_and_a_direct_delta_the_planner_counts_bytes(connect):
    t, r = connect("trainer"), connect("reader")
    w = [_weights(1)]
    v1 = t.publish("m", w[0])
    r.fetch("m", v1)
    for i in (2, 3, 4):
        w.append(_step(w[-1], i))
        t.publish("m", w[-1], base=i - 1)
    f = r.fetch("m", 4)
    assert _same(f, w[-1])
    assert f.delta.steps == [(1, 2), (2, 3), (3, 4)]
    assert f.nbytes == sum(sum(s.nbytes for s in t.manifest("m", v, layout=f"delta:{v - 1}")) for v in (2, 3, 4))
    # A direct delta v4 -> v6 (v5's own delta kept away) beats nothing: it is used.
    w5 = _step(w[-1], 5)
    t.publish("m", w5)  # no delta
    w6 = _step(w5, 6)
    t.publish("m", w6, base=4, base_tensors=w[-1])
    f6 = r.fetch("m", 6)
    assert _same(f6, w6) and f6.delta.steps == [(4, 6)]


def test_planner_prefers_fewest_bytes_and_full_when_deltas_are_dearer():
    S = _delta_path.Step
    assert _delta_path.plan(1000, S(1, 3, 300), [S(1, 2, 100), S(2, 3, 100)]) == [S(1, 2, 100), S(2, 3, 100)]
    assert _delta_path.plan(1000, S(1, 3, 150), [S(1, 2, 100), S(2, 3, 100)]) == [S(1, 3, 150)]
    assert _delta_path.plan(1000, S(1, 3, 1000), None) is None
    assert _delta_path.plan(1000, S(1, 3, 501), None) is None  # applying would cost more than it saves
    assert _delta_path.plan(1000, S(1, 3, 500), None) == [S(1, 3, 500)]
    assert _delta_path.plan(1000, None, None) is None


def test_fetch_into_the_base_in_place(connect):
    t, r = connect("trainer"), connect("reader")
    w1 = _weights(1)
    v1 = t.publish("m", w1)
    mine = {k: v.clone() for k, v in w1.items()}
    w2 = _step(w1, 2)
    v2 = t.publish("m", w2, base=v1)
    ptrs = {k: v.data_ptr() for k, v in mine.items()}
    f = r.fetch("m", v2, into=mine, base=v1, serve=False)
    assert f.delta is not None and _same(mine, w2)
    assert {k: v.data_ptr() for k, v in f.items()} == ptrs
    with pytest.raises(ConfigError, match="pass into="):
        r.fetch("m", v2, base=v1)


def test_into_that_is_not_the_base_falls_back_to_full_and_says_so(connect, caplog):
    t, r = connect("trainer"), connect("reader")
    w1 = _weights(1)
    v1 = t.publish("m", w1)
    w2 = _step(w1, 2)
    v2 = t.publish("m", w2, base=v1)
    wrong = {k: v.clone() for k, v in w1.items()}
    wrong["w"][3, 3] += 1  # not v1 any more
    fb = _counter("fallback")
    with caplog.at_level(logging.WARNING, logger="tensorhub._delta_path"):
        f = r.fetch("m", v2, into=wrong, base=v1, serve=False)
    assert f.delta is None and _same(wrong, w2) and f.nbytes == _full(w2)
    assert f.delta_skipped.startswith("delta from v1 not used") and "base v1" in f.delta_skipped
    assert _counter("fallback") == fb + 1
    assert "reading the full version instead" in caplog.text and "base v1" in caplog.text


def test_a_base_evicted_mid_chain_falls_back_to_full(connect, caplog):
    t, r = connect("trainer"), connect("reader")
    w1 = _weights(1)
    t.publish("m", w1)
    r.fetch("m", 1)
    w2 = _step(w1, 2)
    t.publish("m", w2, base=1)
    w3 = _step(w2, 3)
    t.publish("m", w3, base=2)
    t.unpublish("m", 2)  # v2 and its delta are gone: the chain 1->2->3 is broken
    with caplog.at_level(logging.WARNING, logger="tensorhub._delta_path"):
        f = r.fetch("m", 3)
    assert f.delta is None and _same(f, w3) and f.nbytes == _full(w3)
    assert "delta from v1 not used" in caplog.text and "delta from v1 not used" in f.delta_skipped


def test_corrupt_delta_bytes_are_caught_by_its_checksums_and_the_full_version_read(connect, caplog):
    t, r = connect("trainer"), connect("reader")
    w1 = _weights(1)
    t.publish("m", w1)
    r.fetch("m", 1)
    w2 = _step(w1, 2)
    t.publish("m", w2, base=1)
    held = t._holdings.get(("m", 2, "delta:1", 0))
    blob = held.tensors["w"]
    blob[-1] ^= 0xFF  # the holder's memory goes bad after publishing
    with caplog.at_level(logging.WARNING):
        f = r.fetch("m", 2)
    assert f.delta is None and _same(f, w2)
    assert "checksum mismatch" in caplog.text and "reading the full version instead" in caplog.text


def test_a_delta_whose_result_does_not_verify_is_dropped_and_the_full_version_read(connect, caplog, monkeypatch):
    t, r = connect("trainer"), connect("reader")
    w1 = _weights(1)
    t.publish("m", w1)
    r.fetch("m", 1)
    real = _delta.encode

    def wrong(base, new, itemsize, **kw):  # an encoder bug: one changed element is lost
        e = real(base, new, itemsize, modes=(_delta.SAME, _delta.SPARSE))
        if e.mode == _delta.SPARSE:
            k = e.changed
            b = bytearray(e.blob)
            vals = 16 + 8 + 4 * k  # header, count, indices: then the values
            b[vals] ^= 0x01
            return _delta.Encoded(bytes(b), e.mode, e.changed, e.elements)
        return e

    monkeypatch.setattr(_delta, "encode", wrong)
    w2 = _step(w1, 2)
    t.publish("m", w2, base=1)
    monkeypatch.setattr(_delta, "encode", real)
    with caplog.at_level(logging.WARNING):
        f = r.fetch("m", 2)
    assert f.delta is None and _same(f, w2)
    assert "rebuilt from v1 by its delta" in caplog.text and "does not match" in caplog.text
    assert ("m", 2, "delta:1", 0) not in r.held()  # not served on from here


def test_reader_without_a_base_reads_the_full_version(connect):
    t, r = connect("trainer"), connect("reader")
    w1 = _weights(1)
    t.publish("m", w1)
    w2 = _step(w1, 2)
    t.publish("m", w2, base=1)
    f = r.fetch("m", 2)
    assert f.delta is None and f.delta_skipped is None and _same(f, w2) and f.nbytes == _full(w2)


def test_publish_base_errors(connect):
    t = connect("trainer")
    w1 = _weights(1)
    t.publish("m", w1)
    with pytest.raises(ConfigError, match="holds no replica of 'm' v7"):
        t.publish("m", _step(w1, 2), base=7)
    bad = {k: v.clone() for k, v in w1.items()}
    bad["embed"][0, 0] = 3.0
    with pytest.raises(TensorMismatchError, match="not 'm' v1"):
        t.publish("m", _step(w1, 2), base=1, base_tensors=bad)
    other = dict(_step(w1, 2))
    other["w"] = other["w"][:10].clone()
    with pytest.raises(TensorMismatchError, match="'w' is float32\\[10, 256\\], v1 has float32\\[256, 256\\]"):
        t.publish("m", other, base=1)
    with pytest.raises(ConfigError, match="needs base="):
        t.publish("m", _step(w1, 2), base_tensors=w1)
    assert t.latest("m") == 1  # nothing was published by the refused calls
    with pytest.raises(ConfigError, match="not fetch\\(names=...\\)"):
        t.fetch("m", 1, names=["w"], serve=False, base=1)
    with pytest.raises(ConfigError, match="a version below v1"):
        t.fetch("m", 1, into={k: v.clone() for k, v in w1.items()}, base=1)


def test_a_delta_of_most_of_the_bytes_is_not_published(connect):
    t, r = connect("trainer"), connect("reader")
    w1 = _weights(1)
    t.publish("m", w1)
    r.fetch("m", 1)
    w2 = _step(w1, 2, frac=0.9)
    t.publish("m", w2, base=1)
    assert ("m", 2, "delta:1", 0) not in t.held() and ("m", 2, "hf", 0) in t.held()
    f = r.fetch("m", 2)
    assert f.delta is None and _same(f, w2) and f.nbytes == _full(w2)


def test_a_delta_that_fails_still_publishes_the_full_version_and_delta_names_are_reserved(connect, monkeypatch,
                                                                                            caplog):
    """publish(base=) registers the delta before the full layout: an encode that fails
    leaves no delta and no missing version; a non-contiguous tensor is refused before the
    delta is registered (no delta-only version left behind); 'delta:' layouts are only the
    deltas publish(base=) makes."""
    t, r = connect("trainer"), connect("reader")
    w1 = _weights(1)
    t.publish("m", w1)
    r.fetch("m", 1)

    def broken(*a, **k):
        raise RuntimeError("encoder broke")

    monkeypatch.setattr(_delta, "encode", broken)
    w2 = _step(w1, 2)
    with caplog.at_level(logging.WARNING, logger="tensorhub._delta_path"):
        assert t.publish("m", w2, base=1) == 2
    assert "its delta against v1 is not published" in caplog.text and "encoder broke" in caplog.text
    assert t.latest("m") == 2 and [k for k in t.held() if k[1] == 2] == [("m", 2, "hf", 0)]
    f = r.fetch("m", 2)
    assert f.delta is None and _same(f, w2) and "no direct delta" in f.delta_skipped
    monkeypatch.undo()

    odd = dict(_step(w2, 3))
    odd["w"] = odd["w"].t()
    with pytest.raises(ConfigError, match="not contiguous"):
        t.publish("m", odd, base=2)
    assert t.latest("m") == 2 and not [k for k in t.held() if k[1] > 2]
    with pytest.raises(ConfigError, match="layout 'delta:1'.*publish the full tensors with base="):
        t.publish("m", w2, layout="delta:1")


def test_a_version_whose_tensors_come_in_another_order_than_its_base(connect):
    """An engine publishes v1 in its own order, the trainer v2 in another: the delta is laid
    out (and checked) in v2's order."""
    t, r = connect("trainer"), connect("reader")
    w1 = _weights(1)
    r.publish("m", dict(reversed(list(w1.items()))))
    w2 = _step(w1, 2)
    t.publish("m", w2, base=1, base_tensors=w1)
    f = r.fetch("m", 2)
    assert f.delta is not None and _same(f, w2)
    assert list(f) == list(w2)
