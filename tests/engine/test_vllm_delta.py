"""A real vLLM CPU engine swapping through deltas (issue #16).

Engine A (offline ``vllm.LLM``, ``--load-format tensorhub``, ``on_missing="disk"``) loads v1
from its weight files and serves its ``hf`` copy. The trainer (this process) publishes v2
with ``base=1`` (a few % of the elements changed): A's prefetcher (on by default; it starts
the moment v2 is complete) reads only the delta, applies it to a copy of the v1 it serves,
and the swap applies that copy: outputs equal a fresh engine's on v2's files.
Then v3's delta is wrong (an encoder bug, consistent checksums): the prefetch detects it,
says so, reads v3 in full, and outputs equal a fresh engine's on v3's files.
"""

from __future__ import annotations

import time

import pytest

from _engines import Coordinator, OfflineEngine, reference_outputs, require_vllm
from _tiny import PROMPTS, changed_weights, make_model_dir, make_weights, save_model_dir

pytestmark = pytest.mark.engine

MODEL = "policy"


def _swap(a: OfflineEngine, v: int) -> None:
    a.call("start_weight_update")
    a.call("update_weights", update_info={"version": v})
    a.call("finish_weight_update", weight_version=str(v))
    assert a.call("weight_version") == str(v)


def _prefetched(trainer, a: OfflineEngine, worker: str, v: int, timeout: float = 90.0) -> set:
    """Wait until ``worker``'s prefetcher (it starts once ``v`` is complete) serves ``v`` whole;
    the layouts of ``v`` it serves then (a reader serves the deltas it read, too)."""
    end = time.monotonic() + timeout
    while True:
        mine = {r.layout for r in trainer.version_info(MODEL, v).replicas
                if r.worker_id == worker and r.partial is None}
        if "hf" in mine:
            return mine
        assert time.monotonic() < end, a.log_tail(200_000)[-3000:]
        time.sleep(0.2)


def _reference(tmp, name: str, weights: dict) -> dict:
    """What a fresh engine answers on ``weights`` saved as weight files (one shared engine)."""
    return reference_outputs(save_model_dir(tmp / name, weights), PROMPTS)


def test_vllm_swaps_through_a_delta_and_falls_back_on_a_bad_one(tmp_path, monkeypatch):
    require_vllm()
    import tensorhub
    from tensorhub import _delta

    coord = Coordinator(tmp_path / "state")
    a = trainer = None
    try:
        w1 = make_weights(0)
        a = OfflineEngine(tmp_path / "a.log", model=str(make_model_dir(tmp_path / "v1", seed=0)),
                          load_format="tensorhub",
                          # prefetch: the default. It starts the moment v2 is complete, and
                          # publish(base=...) registers the delta before that: it reads the delta.
                          model_loader_extra_config={"coordinator": coord.url, "model": MODEL,
                                                     "on_missing": "disk", "worker_id": "engine-a"},
                          weight_transfer_config={"backend": "tensorhub"})
        out1 = a.call("generate", prompts=PROMPTS)
        a.call("init_weight_transfer_engine", init_info={})
        trainer = tensorhub.connect(coord.url, worker_id="trainer")

        w2 = changed_weights(w1, 2)
        v2 = trainer.publish(MODEL, w2, base=1, base_tensors=w1)
        delta = sum(s.nbytes for s in trainer.manifest(MODEL, v2, layout="delta:1"))
        full = sum(t.numel() * 4 for t in w2.values())
        assert delta < 0.15 * full
        # Prefetched before any swap, through the delta (the reader serves the delta it read).
        assert _prefetched(trainer, a, "engine-a", v2) == {"hf", "delta:1"}
        _swap(a, v2)
        log = a.log_tail(200_000)
        assert "through delta(s) [(1, 2)]" in log, log[-3000:]
        line = next(l for l in log.splitlines() if f"-> v{v2}:" in l)
        assert "prefetched before the swap" in line, line
        ref2 = _reference(tmp_path, "ref2", w2)
        assert a.call("generate", prompts=PROMPTS)["ids"] == ref2["ids"]
        assert ref2["ids"] != out1["ids"]

        real = _delta.encode

        def wrong(base, new, itemsize, **kw):  # an encoder bug: one new value off by one bit
            e = real(base, new, itemsize, modes=(_delta.SAME, _delta.SPARSE))
            if e.mode != _delta.SPARSE:
                return e
            b = bytearray(e.blob)
            b[16 + 8 + 4 * e.changed] ^= 0x01
            return _delta.Encoded(bytes(b), e.mode, e.changed, e.elements)

        monkeypatch.setattr(_delta, "encode", wrong)
        w3 = changed_weights(w2, 3)
        v3 = trainer.publish(MODEL, w3, base=v2, base_tensors=w2)
        monkeypatch.setattr(_delta, "encode", real)
        assert _prefetched(trainer, a, "engine-a", v3) == {"hf"}  # the bad delta is not served on
        _swap(a, v3)
        log = a.log_tail(200_000)
        assert "delta from v2 not used, reading the full version instead" in log, log[-3000:]
        assert "does not match its checksum" in log
        ref3 = _reference(tmp_path, "ref3", w3)
        assert a.call("generate", prompts=PROMPTS)["ids"] == ref3["ids"]
    finally:
        if a is not None:
            a.close()
        if trainer is not None:
            trainer.close()
        coord.stop()


def test_a_non_serving_tp_rank_swaps_through_a_delta_into_its_kept_copy(tmp_path):
    """A TP=2 engine: rank 0 serves the hf copy (its base by itself); rank 1 serves nothing
    (``serve_ranks="first"``) and keeps, after a swap, the copy it fetched as the next swap's
    destination (``reuse_buffers``). It started by streaming v1 (no copy), so its first swap
    reads v2 in full; its second names that kept v2 as the base and reads only v3's delta.
    Outputs equal a fresh engine's on v3's weight files."""
    require_vllm()
    import tensorhub

    coord = Coordinator(tmp_path / "state")
    tp = trainer = None
    try:
        trainer = tensorhub.connect(coord.url, worker_id="trainer")
        w1 = make_weights(0)
        assert trainer.publish(MODEL, w1) == 1
        tp = OfflineEngine(tmp_path / "tp2.log", env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
                           model=str(make_model_dir(tmp_path / "bare", weights=False)), tensor_parallel_size=2,
                           load_format="tensorhub",
                           model_loader_extra_config={"coordinator": coord.url, "model": MODEL,
                                                      "worker_id": "engine-tp"},
                           weight_transfer_config={"backend": "tensorhub"})
        tp.call("init_weight_transfer_engine", init_info={})
        # Rank 1 kept no copy of v1: it streamed v1, or (rank 0 had fetched it first) loaded it in
        # place from rank 0's memory on this host; which one depends on the ranks' timing.
        log = tp.log_tail(400_000)
        rank1 = [line for line in log.splitlines() if line.startswith("(Worker_TP1")]
        assert any("tensorhub: streamed policy v1 (hf)" in line or "tensorhub: loaded policy v1 in place (hf)" in line
                   for line in rank1), log[-3000:]
        assert "tensorhub: engine worker (tp rank 1) runs policy v1 and serves its hf copy" not in log

        w2 = changed_weights(w1, 2)
        assert trainer.publish(MODEL, w2, base=1) == 2
        _swap(tp, 2)
        log = tp.log_tail(400_000)
        assert "worker engine-tp-tp0 fetched policy v2 layout hf shard 0 through delta v1->v2" in log, log[-3000:]
        assert "worker engine-tp-tp1 fetched policy v2 layout hf shard 0 through delta" not in log  # no base yet

        w3 = changed_weights(w2, 3)
        assert trainer.publish(MODEL, w3, base=2) == 3
        _swap(tp, 3)
        log = tp.log_tail(400_000)
        for rank in (0, 1):
            assert f"worker engine-tp-tp{rank} fetched policy v3 layout hf shard 0 through delta v2->v3" in log, \
                log[-3000:]
        reps = {(r.worker_id, r.layout) for r in trainer.version_info(MODEL, 3).replicas}
        assert ("engine-tp-tp0", "hf") in reps and not [r for r in reps if r[0] == "engine-tp-tp1"], reps
        ref3 = _reference(tmp_path, "ref3", w3)
        assert tp.call("generate", prompts=PROMPTS)["ids"] == ref3["ids"]
    finally:
        if tp is not None:
            tp.close()
        if trainer is not None:
            trainer.close()
        coord.stop()
