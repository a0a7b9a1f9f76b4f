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


class TestPipeline(_pp_ranks.PipelineChecks):
    nothing_applied = {"load_calls": 0}

    def swap_answer(self, engine: dict) -> object:
        return [engine["v2"], "hf"]

    def applied(self, engine: dict) -> dict:
        return {"loaded": engine["w2"]}  # every tensor of v2, its bytes
