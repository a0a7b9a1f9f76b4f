"""An SGLang engine (SGLang 0.5.23's own loader and ``WeightUpdater`` on CPU, in a child
process) started from a trainer on the same host reads the trainer's ``empty_like``
snapshot in place (``Hub.borrow``): no copy of its own on the way to the parameters, the
same parameter bytes as SGLang's default loader on the weight files, and afterwards its own
``hf`` copy (made in the background from the borrowed memory) registered with every byte
checked, the trainer's lease released, and a hot-swap that works as after any start.
"""

from __future__ import annotations

import hashlib
import time

import pytest

from _sglang_procs import SGLangWorker, Trainer, reference_digest, require_sglang

pytestmark = [pytest.mark.engine, pytest.mark.multiprocess]


def _bytes_digest(tensors) -> dict:
    import torch

    return {k: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, t in tensors.items()}


def test_sglang_starts_in_place_from_a_same_host_trainer_then_serves_its_own_copy(tmp_path):
    require_sglang()
    import tensorhub
    from tensorhub.testing import CoordinatorProcess

    from _tiny import make_model_dir, make_weights

    coord = CoordinatorProcess(tmp_path / "state")
    url = coord.start()
    trainer = tensorhub.connect(url, worker_id="trainer")
    workers, procs = [], []
    try:
        w1 = make_weights(1)
        snap = trainer.empty_like(w1)  # Hub memory: a same-host reader may map it
        for k, t in w1.items():
            snap[k].copy_(t)
        v1 = trainer.publish("policy", snap)
        want = reference_digest(make_model_dir(tmp_path / "disk1", seed=1))

        eng = SGLangWorker(tmp_path / "eng.log", make_model_dir(tmp_path / "cfg", seed=0, weights=False),
                           "tensorhub", {"coordinator": url, "model": "policy", "drain_timeout": 3,
                                         "worker_id": "sglang-s"})
        workers.append(eng)
        log = eng.log_tail(400_000)
        assert f"loaded policy v{v1} in place (hf)" in log and "from {'trainer': " in log, log[-3000:]
        assert "tensorhub: fetched policy" not in log  # no copy of its own on the way to the parameters
        assert eng.call("digest") == want  # SGLang's load_weights fused qkv / gate_up from the borrowed views

        end = time.monotonic() + 60
        while not eng.call("held")["copy"]:  # the copy is made in the background once the engine is up
            assert time.monotonic() < end, eng.log_tail()
            time.sleep(0.2)
        held = eng.call("held")
        assert held["version"] == v1 and ["policy", v1, "hf", 0] in held["held"]
        assert f"serves its hf copy of policy v{v1} (copied from the borrowed memory" in eng.log_tail(400_000)

        # The borrowed lease is released: the trainer drops v1 at once and overwrites its memory.
        t0 = time.monotonic()
        trainer.unpublish("policy", v1, timeout=30)
        assert time.monotonic() - t0 < 5.0
        for t in snap.values():
            t.zero_()
        got = trainer.fetch("policy", v1, serve=False)  # the engine's copy, every byte
        assert set(got.sources) == {"sglang-s"} and _bytes_digest(got) == _bytes_digest(w1)
        assert eng.call("digest") == want  # the parameters view nothing of the (zeroed) snapshot

        # A hot-swap after a start in place: v1's copy is withdrawn, v2 applied.
        t2 = Trainer(url, 2, "trainer-2")
        procs.append(t2)
        from tensorhub.integrations.sglang.pull import payload

        assert eng.call("update", payload=payload(t2.version)) == {"success": True, "message": "Success"}
        assert eng.call("digest") == reference_digest(make_model_dir(tmp_path / "disk2", seed=2))
        assert {h[1] for h in eng.call("held")["held"]} == {t2.version}
    finally:
        for w in workers:
            w.close()
        for p in procs:
            p.kill()
        trainer.close()
        coord.stop()
