"""SGLang swaps through deltas (issue #16), against SGLang 0.5.23's own modules on CPU.

What is real: the coordinator process, Mooncake between the processes, SGLang's plug-in
loader, model loader, ``LlamaForCausalLM`` and ``WeightUpdater`` driving our pull function
in each SGLang worker process (``_sgl_worker.py``; no scheduler loop, no HTTP server, which
need CUDA). The trainer is this process (``Hub.publish(..., base=)``). Each check compares
the engine's parameter bytes with an SGLang model loaded by SGLang's default loader from
the same weights on disk.

Engine A starts from v1 (hf: it keeps and serves the hf copy). v2 is published with its
delta against v1: A's swap reads only the delta and applies it to a copy of its v1. Engine
B then starts from A's native layout (no hf copy). v3 comes with its delta against v2; B
swaps first (no base: full hf) and serves v3 natively; A then still reads the delta, not
B's complete native shard (a few % of the bytes instead of all). v4's delta is wrong (an
encoder bug with consistent checksums): A's swap detects it, says so, reads v4 in full.
"""

from __future__ import annotations

import pytest

from _sglang_procs import SGLangWorker, reference_digest, require_sglang  # also puts tests/engine on sys.path

from _tiny import changed_weights, save_model_dir  # noqa: E402  (tests/engine)

pytestmark = [pytest.mark.engine, pytest.mark.multiprocess]

MODEL = "policy"


@pytest.fixture(scope="module", autouse=True)
def _need_sglang():
    require_sglang()


def _ref(tmp, name: str, weights: dict) -> dict:
    """Parameter digests of SGLang's default loader on ``weights`` saved as safetensors."""
    return reference_digest(save_model_dir(tmp / name, weights))


def _update(w: SGLangWorker, v: int) -> None:
    from tensorhub.integrations.sglang.pull import payload

    r = w.call("update", payload=payload(v))
    assert r == {"success": True, "message": "Success"}, r
    assert w.call("held")["version"] == v


def test_sglang_swaps_through_deltas_and_falls_back_on_a_bad_one(tmp_path, monkeypatch):
    import tensorhub
    from tensorhub import _delta
    from tensorhub.testing import CoordinatorProcess

    from _tiny import make_model_dir, make_weights

    coord = CoordinatorProcess(tmp_path / "state")
    url = coord.start()
    workers: list[SGLangWorker] = []
    trainer = None
    try:
        trainer = tensorhub.connect(url, worker_id="trainer")
        cfg = make_model_dir(tmp_path / "cfg", seed=0, weights=False)
        extra = {"coordinator": url, "model": MODEL, "drain_timeout": 3}
        w1 = make_weights(0)
        assert trainer.publish(MODEL, w1) == 1
        a = SGLangWorker(tmp_path / "a.log", cfg, "tensorhub", {**extra, "worker_id": "sglang-a"})
        workers.append(a)
        assert a.call("held")["copy"] is True  # the serving rank keeps v1's hf copy: the delta base

        w2 = changed_weights(w1, 2)
        assert trainer.publish(MODEL, w2, base=1) == 2
        full = sum(t.numel() * t.element_size() for t in w2.values())
        assert sum(s.nbytes for s in trainer.manifest(MODEL, 2, layout="delta:1")) < 0.15 * full
        _update(a, 2)
        assert "through delta(s) [(1, 2)]" in a.log_tail(400_000), a.log_tail(3000)
        assert a.call("digest") == _ref(tmp_path, "ref2", w2)

        b = SGLangWorker(tmp_path / "b.log", cfg, "tensorhub", {**extra, "worker_id": "sglang-b"})
        workers.append(b)
        hb = b.call("held")
        assert hb["version"] == 2 and hb["copy"] is False  # read A's native shard raw: no hf base
        w3 = changed_weights(w2, 3)
        assert trainer.publish(MODEL, w3, base=2) == 3
        _update(b, 3)  # no base: the full hf version; B then serves v3 natively
        assert "through delta" not in b.log_tail(400_000)
        _update(a, 3)
        log = a.log_tail(400_000)
        assert "through delta(s) [(2, 3)]" in log, log[-3000:]  # not B's native shard: the delta is smaller
        assert f"fetched policy v3 ({hb['layout']})" not in log
        ref3 = _ref(tmp_path, "ref3", w3)
        assert a.call("digest") == b.call("digest") == ref3

        real = _delta.encode

        def wrong(base, new, itemsize, **kw):  # an encoder bug: one new value off by one bit
            e = real(base, new, itemsize, modes=(_delta.SAME, _delta.SPARSE))
            if e.mode != _delta.SPARSE:
                return e
            blob = bytearray(e.blob)
            blob[16 + 8 + 4 * e.changed] ^= 0x01
            return _delta.Encoded(bytes(blob), e.mode, e.changed, e.elements)

        monkeypatch.setattr(_delta, "encode", wrong)
        w4 = changed_weights(w3, 4)
        assert trainer.publish(MODEL, w4, base=3) == 4
        monkeypatch.setattr(_delta, "encode", real)
        _update(a, 4)
        log = a.log_tail(400_000)
        assert "delta from v3 not used, reading the full version instead" in log, log[-3000:]
        assert "does not match its checksum" in log
        assert "fetched policy v4 (hf)" in log and "in full, not through deltas: delta from v3 not used" in log
        assert a.call("digest") == _ref(tmp_path, "ref4", w4)
    finally:
        for w in workers:
            w.close()
        if trainer is not None:
            trainer.close()
        coord.stop()
