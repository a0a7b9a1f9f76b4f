"""Pipeline parallelism, SGLang adapter: every stage and rank of one engine (TP x PP)
loads the same version, and a swap is all-or-none over the whole engine.

Four spawned processes form one TP=2 x PP=2 engine with SGLang's real parallel state on
CPU (gloo groups from SGLang's ``initialize_model_parallel``); a real coordinator and
real Mooncake fetches, driven by tests/engine/_pp_ranks.run_engine. The adapter's
``resolve`` and ``pull.swap`` run as they do in an engine; the model (a recorder of
``load_weights``) and two injected events stand in (see ``_sgl_pp_ranks``).

With the TP-group-only decision of before, step 1 splits the stages and in step 2
stage 0 loads the version that stage 1 refused.
"""

from __future__ import annotations

import pytest

from _sglang_procs import require_sglang  # also puts tests/engine on sys.path

import _pp_ranks  # noqa: E402  (tests/engine)
import _sgl_pp_ranks  # noqa: E402

pytestmark = pytest.mark.multiprocess

TP, PP = 2, 2


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    require_sglang()
    return _pp_ranks.run_engine(tmp_path_factory.mktemp("pp"), _sgl_pp_ranks.run, TP, PP)


def _ranks(engine) -> dict:
    crashed = {r: o["crash"] for r, o in engine["ranks"].items() if "crash" in o}
    assert not crashed, crashed
    assert engine["publish_error"] is None, engine["publish_error"]
    return engine["ranks"]


def test_the_ranks_form_one_tp2_pp2_engine(engine):
    places = sorted(tuple(o["place"]) for o in _ranks(engine).values())
    assert places == [(0, 0, 2, 2), (0, 1, 2, 2), (1, 0, 2, 2), (1, 1, 2, 2)]


def test_every_stage_loads_the_version_the_root_resolved(engine):
    ranks = _ranks(engine)
    v1, v2 = engine["v1"], engine["v2"]
    assert v2 == v1 + 1
    assert {r: o["latest_after"] for r, o in ranks.items()} == {r: v2 for r in ranks}
    assert {r: o["resolved"] for r, o in ranks.items()} == {r: v1 for r in ranks}


def test_one_rank_failing_refuses_the_swap_on_every_stage(engine):
    ranks = _ranks(engine)
    v1 = engine["v1"]
    for r, o in ranks.items():
        err = o["failed_swap"]
        assert err is not None, f"rank {r} swapped although pp stage 1, tp rank 1 could not fetch"
        assert "(pp stage 1, tp rank 1)" in err and "cannot read" in err, err
        assert f"the engine keeps serving v{v1}" in err, err
        assert o["after_failed_swap"] == {"version": v1, "load_calls": 0}, (r, o["after_failed_swap"])


def test_then_every_stage_swaps_to_the_same_bytes(engine):
    ranks = _ranks(engine)
    for r, o in ranks.items():
        assert o["swap"] == [engine["v2"], "hf"], (r, o["swap"])
        assert o["after_swap"]["version"] == engine["v2"], r
        assert o["after_swap"]["loaded"] == engine["w2"], r  # every tensor of v2, its bytes
