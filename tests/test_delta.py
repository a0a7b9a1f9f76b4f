"""The delta encoding (tensorhub._delta): bit-exact over every dtype, shape and change
fraction; malformed blobs and wrong bases are refused, never half applied."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from tensorhub import _delta
from tensorhub._delta import DeltaError, apply, encode

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8,
          torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool, torch.float64, torch.complex128]


def _raw(t: torch.Tensor) -> np.ndarray:
    if t.numel() == 0:
        return np.zeros(0, np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


def _random(dtype, shape, seed) -> torch.Tensor:
    """Any bit pattern (NaNs, -0.0, fp8 specials; bools as their raw byte 0/1)."""
    g = np.random.default_rng(seed)
    n = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    raw = g.integers(0, 256, n, dtype=np.uint8)
    if dtype == torch.bool:
        raw &= 1
    return torch.from_numpy(raw.copy()).view(dtype).reshape(shape)


def _changed(base: torch.Tensor, frac: float, seed: int) -> torch.Tensor:
    new = base.clone()
    flat = new.reshape(-1)
    if flat.numel() == 0:
        return new
    g = np.random.default_rng(seed + 1)
    k = int(round(frac * flat.numel()))
    idx = torch.from_numpy(g.choice(flat.numel(), size=k, replace=False)).long()
    flat[idx] = _random(base.dtype, (k,), seed + 2)
    return new


@settings(max_examples=150, deadline=None)
@given(dtype=st.sampled_from(DTYPES),
       shape=st.lists(st.integers(0, 37), min_size=0, max_size=3),
       frac=st.sampled_from([0.0, 0.001, 0.01, 0.1, 0.5, 1.0]),
       seed=st.integers(0, 2**31),
       mode=st.sampled_from([None, _delta.SPARSE, _delta.SPARSE_Z, _delta.XOR_Z, _delta.RAW]))
def test_apply_reproduces_the_new_bytes_exactly(dtype, shape, frac, seed, mode):
    base = _random(dtype, shape, seed)
    new = _changed(base, frac, seed)
    itemsize = base.element_size()
    enc = encode(_raw(base), _raw(new), itemsize, modes=None if mode is None else (mode,))
    want_changed = int(_delta.changed(_raw(base), _raw(new), itemsize).size)
    assert enc.changed == want_changed
    out = base.clone()
    apply(_raw(out), enc.blob)
    assert bytes(_raw(out)) == bytes(_raw(new))
    if mode is None and want_changed == 0:
        assert enc.mode == _delta.SAME


def test_special_float_bits_survive():
    """NaN payloads, -0.0 and infinities: compared and copied as bits, never as floats."""
    base = torch.tensor([0.0, 1.0, float("nan"), 2.0], dtype=torch.float32)
    new = base.clone()
    raw = new.view(torch.int32)
    raw[0] = np.int32(-2**31)          # -0.0 (equal to 0.0 as a float)
    raw[2] = 0x7FC00001                 # another NaN payload
    new[3] = float("-inf")
    enc = encode(_raw(base), _raw(new), 4)
    assert enc.changed == 3
    out = base.clone()
    apply(_raw(out), enc.blob)
    assert bytes(_raw(out)) == bytes(_raw(new))


def test_a_few_changes_are_small_and_sparse():
    base = _random(torch.bfloat16, (1024, 1024), 1)
    new = _changed(base, 0.01, 1)
    enc = encode(_raw(base), _raw(new), 2)
    assert enc.mode in (_delta.SPARSE, _delta.SPARSE_Z)
    assert len(enc.blob) < 0.04 * base.numel() * 2


def test_wrong_base_size_and_width_are_refused():
    base = _random(torch.float16, (100,), 3)
    new = _changed(base, 0.1, 3)
    blob = encode(_raw(base), _raw(new), 2).blob
    with pytest.raises(DeltaError, match="50 elements|100 elements"):
        apply(_raw(torch.zeros(50, dtype=torch.float16)), blob)
    with pytest.raises(DeltaError, match="base has"):
        encode(_raw(base), _raw(new[:10]), 2)


@pytest.mark.parametrize("mode", [_delta.SPARSE, _delta.SPARSE_Z, _delta.XOR_Z, _delta.RAW])
def test_malformed_blobs_are_refused_and_leave_the_base_alone(mode):
    base = _random(torch.bfloat16, (64, 64), 4)
    new = _changed(base, 0.05, 4)
    blob = encode(_raw(base), _raw(new), 2, modes=(mode,)).blob
    for bad, why in [(blob[:-3], "bytes|decompress|inflates"), (b"XXXX" + blob[4:], "magic"),
                     (blob[:10], "shorter than its header")]:
        out = base.clone()
        with pytest.raises(DeltaError, match=why):
            apply(_raw(out), bad)
        assert torch.equal(out.view(torch.int16), base.view(torch.int16))


def test_sparse_index_past_the_end_is_refused():
    base = np.zeros(10, np.uint8)
    new = base.copy()
    new[9] = 1
    blob = bytearray(encode(base, new, 1, modes=(_delta.SPARSE,)).blob)
    # header (16) + count (8) + one uint32 index: make it 10
    blob[24:28] = (10).to_bytes(4, "little")
    with pytest.raises(DeltaError, match="past the tensor"):
        apply(base.copy(), bytes(blob))
