"""One rank of a TP x PP vLLM engine, without the model: for test_vllm_pipeline.py.

Each spawned process initialises vLLM's own parallel state on CPU (gloo; vLLM's
``init_distributed_environment`` + ``initialize_model_parallel``, so ``get_tp_group()`` /
``get_pp_group()`` are the groups a real engine's workers get), connects the adapter's
worker state to the coordinator and runs three steps, each through the adapter's real
code (``worker.resolve``, ``transfer._Mixin.receive_weights``, real fetches over
Mooncake). What stands in:

* the model: :class:`Engine` is the weight-transfer engine with ``_apply`` (vLLM's
  layerwise reload into the model) replaced by a recorder of the bytes it was handed;
  ``native`` is off (no model parameters to register);
* the race: ``worker._resolve_here`` (the coordinator query) is wrapped so that a
  stage-0 call hands over to the test, which publishes a newer version, and a later
  stage's call waits for that publish first. Only a rank that queries the coordinator
  itself runs the wrapper: with one engine-wide decision that is the root alone;
* the failure: ``worker.fetch`` raises on PP stage 1, TP rank 1 in step 2.

Results go to ``<tmp>/rank<r>.json``; :func:`run_engine` (the test process's side: the
coordinator, the trainer, the publish between the stages' queries) collects them. The
SGLang twin (tests/sglang/_sgl_pp_ranks.py) runs under the same :func:`run_engine`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

MODEL = "policy"


def weights(seed: int) -> dict:
    """A few HF-named float32 tensors (~200 KB), the same in every process for one seed."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {"model.embed_tokens.weight": torch.randn(64, 64, generator=g)}
    for i in range(2):
        for part in ("self_attn.q_proj", "mlp.up_proj", "mlp.down_proj"):
            out[f"model.layers.{i}.{part}.weight"] = torch.randn(64, 64, generator=g)
    out["lm_head.weight"] = torch.randn(64, 64, generator=g)
    return out


def digest(tensors) -> dict:
    import torch

    return {n: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for n, t in tensors.items()}


def wait_for(path: Path, timeout: float = 120.0) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} did not appear within {timeout:g}s")
        time.sleep(0.05)
    return path.read_text()


def run_engine(tmp: Path, target: Callable, tp: int, pp: int, timeout: float = 420) -> dict:
    """Run ``target(rank, tp, pp, rdzv, url, tmp, sys.path)`` in ``tp * pp`` spawned
    processes against an embedded coordinator, with a trainer Hub here that publishes v1
    first and v2 once stage 0 resolved (``<tmp>/resolved``; then ``<tmp>/published``).
    Returns v1, v2, v2's digests and each rank's result (``{"crash": ...}`` if none)."""
    import tensorhub
    from tensorhub.server.state import StateConfig
    from tensorhub.coordinator import EmbeddedCoordinator

    with EmbeddedCoordinator(tmp / "state", config=StateConfig()) as coord:
        trainer = tensorhub.connect(coord.url, worker_id="trainer")
        try:
            w1, w2 = weights(0), weights(1)
            v1 = trainer.publish(MODEL, w1, layout="hf")
            published: dict = {}

            def publish_when_stage0_resolved() -> None:
                try:
                    wait_for(tmp / "resolved", timeout=timeout)
                    published["v2"] = trainer.publish(MODEL, w2, layout="hf")
                except Exception as e:  # the ranks then time out waiting and say so
                    published["error"] = repr(e)
                (tmp / "published").write_text(str(published.get("v2")))

            t = threading.Thread(target=publish_when_stage0_resolved, daemon=True)
            t.start()
            ctx = mp.get_context("spawn")
            procs = [ctx.Process(target=target, args=(r, tp, pp, str(tmp / "rdzv"), coord.url, str(tmp),
                                                      list(sys.path)))
                     for r in range(tp * pp)]
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout
            for p in procs:
                p.join(max(1.0, deadline - time.monotonic()))
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(10)
            t.join(5)
            ranks = {}
            for r in range(tp * pp):
                f = tmp / f"rank{r}.json"
                ranks[r] = json.loads(f.read_text()) if f.exists() else {"crash": "no result (hung or killed)"}
            return {"v1": v1, "v2": published.get("v2"), "w2": digest(w2), "ranks": ranks,
                    "publish_error": published.get("error")}
        finally:
            trainer.close()


class PipelineChecks:
    """What both adapters' pipeline tests check of one :func:`run_engine` run of a TP=2 x
    PP=2 engine. A test module subclasses it (``class TestPipeline(PipelineChecks)``), gives
    it an ``engine`` fixture and says how its adapter reports a swap: what a rank shows after
    the refused swap (``nothing_applied``), what its swap call returns and what it applied."""

    #: ``after_failed_swap`` besides the version: nothing reached the model.
    nothing_applied: dict = {}

    def swap_answer(self, engine: dict) -> object:
        raise NotImplementedError

    def applied(self, engine: dict) -> dict:
        """Keys of ``after_swap`` besides the version, and what each must be: v2's bytes, once."""
        raise NotImplementedError

    @staticmethod
    def ranks(engine: dict) -> dict:
        crashed = {r: o["crash"] for r, o in engine["ranks"].items() if "crash" in o}
        assert not crashed, crashed
        assert engine["publish_error"] is None, engine["publish_error"]
        return engine["ranks"]

    def test_the_ranks_form_one_tp2_pp2_engine(self, engine):
        places = sorted(tuple(o["place"]) for o in self.ranks(engine).values())
        assert places == [(0, 0, 2, 2), (0, 1, 2, 2), (1, 0, 2, 2), (1, 1, 2, 2)]

    def test_every_stage_loads_the_version_the_root_resolved(self, engine):
        ranks = self.ranks(engine)
        v1, v2 = engine["v1"], engine["v2"]
        assert v2 == v1 + 1
        # A newer version existed before any rank had its answer; every rank of both stages
        # still got the one the root resolved.
        assert {r: o["latest_after"] for r, o in ranks.items()} == {r: v2 for r in ranks}
        assert {r: o["resolved"] for r, o in ranks.items()} == {r: v1 for r in ranks}

    def test_one_rank_failing_refuses_the_swap_on_every_stage(self, engine):
        v1 = engine["v1"]
        for r, o in self.ranks(engine).items():
            err = o["failed_swap"]
            assert err is not None, f"rank {r} swapped although pp stage 1, tp rank 1 could not fetch"
            assert "(pp stage 1, tp rank 1)" in err and "cannot read" in err, err
            assert f"the engine keeps serving v{v1}" in err, err
            assert o["after_failed_swap"] == {"version": v1, **self.nothing_applied}, (r, o["after_failed_swap"])

    def test_then_every_stage_swaps_to_the_same_bytes(self, engine):
        for r, o in self.ranks(engine).items():
            assert o["swap"] == self.swap_answer(engine), (r, o["swap"])
            assert o["after_swap"]["version"] == engine["v2"], (r, o["after_swap"]["version"])
            for key, want in self.applied(engine).items():
                assert o["after_swap"][key] == want, (r, key)


def init_vllm(rank: int, tp: int, pp: int, init_file: str) -> None:
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    cfg = VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp))
    with set_current_vllm_config(cfg):
        ps.init_distributed_environment(tp * pp, rank, f"file://{init_file}", rank, backend="gloo")
        ps.initialize_model_parallel(tp, pp, backend="gloo")


def run(rank: int, tp: int, pp: int, init_file: str, url: str, tmp: str, path: list) -> None:
    sys.path[:0] = [p for p in path if p not in sys.path]
    tmp_p = Path(tmp)
    out: dict = {"rank": rank}
    try:
        init_vllm(rank, tp, pp, init_file)
        steps(out, url, tmp_p)
    except BaseException:
        out["crash"] = traceback.format_exc()
    finally:
        (tmp_p / f"rank{rank}.json").write_text(json.dumps(out))
        os._exit(0)  # vLLM's groups and Mooncake threads: no orderly teardown needed here


def resolve_racing(out: dict, st, tmp: Path) -> None:
    """Step 1 of both adapters' ranks: resolve "latest" while a newer version is published
    between the stages' queries (``run_engine`` publishes once stage 0 has its answer)."""
    from tensorhub.integrations._core import load, worker

    real = worker._resolve_here

    def racing(st_, *a):
        if st_.pp_rank > 0:  # a later stage asks only once a newer version exists
            wait_for(tmp / "published")
        v = real(st_, *a)
        if st_.pp_rank == 0:
            (tmp / "resolved").write_text(str(v))
            wait_for(tmp / "published")
        return v

    worker._resolve_here = racing
    try:
        out["resolved"] = worker.resolve(st, "latest")
    finally:
        worker._resolve_here = real
    out["latest_after"] = st.hub.latest(MODEL)
    st.version, st.specs = out["resolved"], load.specs_of(weights(0))  # as if the loader had loaded it


@contextlib.contextmanager
def failing_fetch(st):
    """Step 2: pp stage 1, tp rank 1 cannot fetch while inside."""
    from tensorhub.integrations._core import worker

    real_fetch = worker.fetch
    if (st.pp_rank, st.rank) == (1, 1):
        def failing(st_, v, *args, **kwargs):
            raise RuntimeError(f"injected: pp stage 1, tp rank 1 cannot read v{v}")
        worker.fetch = failing
    try:
        yield
    finally:
        worker.fetch = real_fetch


def three_steps(out: dict, st, tmp: Path, swap: Callable[[], object], applied: Callable[[bool], dict]) -> None:
    """Both adapters' ranks: 1. resolve "latest" in a race with a publish; 2. ``swap()`` to it
    while pp stage 1, tp rank 1 cannot fetch; 3. ``swap()`` again with every rank able to.
    ``applied(whole)``: what reached the model (a count after step 2, the record after 3)."""
    out["place"] = [st.pp_rank, st.rank, st.pp_size, st.tp_size]
    resolve_racing(out, st, tmp)
    with failing_fetch(st):
        try:
            swap()
            out["failed_swap"] = None
        except Exception as e:
            out["failed_swap"] = str(e)
    out["after_failed_swap"] = {"version": st.version, **applied(False)}
    try:
        out["swap"] = swap()
    except Exception as e:
        out["swap"] = str(e)
    out["after_swap"] = {"version": st.version, **applied(True)}
    st.hub.close()


def steps(out: dict, url: str, tmp: Path) -> None:
    from tensorhub.integrations._core.settings import Settings
    from tensorhub.integrations.vllm import _runtime, transfer

    st = _runtime.connect(Settings.from_config({
        "coordinator": url, "model": MODEL, "native": False, "worker_id": "pp-engine",
        "fetch_timeout": 120, "drain_timeout": 10}))
    eng = Engine(st)
    three_steps(out, st, tmp, lambda: eng.receive_weights(transfer.TensorHubUpdateInfo(version="latest")),
                lambda whole: {"applied": eng.applied if whole else len(eng.applied)})


def _engine_class():
    from tensorhub.integrations.vllm import transfer

    class _Engine(transfer._Mixin):
        """The weight-transfer engine minus vLLM's base class; ``_apply`` records."""

        def __init__(self, st) -> None:
            self._state = st
            self.model = None
            self.applied: list = []

        def _apply(self, tensors) -> float:
            self.applied.append(digest(tensors))
            return 0.0  # seconds in load_weights (there is no model here)

    return _Engine


def Engine(st):  # noqa: N802 - a class made on first use (imports the adapter in the child)
    return _engine_class()(st)
