"""One rank of a TP x PP SGLang engine, without the model: for test_sglang_pipeline.py.

The SGLang twin of tests/engine/_pp_ranks.py (whose weights, digests and markers it
uses). Each spawned process initialises SGLang's own parallel state on CPU (gloo;
``init_distributed_environment`` + ``initialize_model_parallel`` with the TP/PP widths
set through ``get_parallel().override_permanently``, as SGLang's launcher publishes
them), connects the adapter's worker state and runs three steps through the adapter's
real code (``worker.resolve``, ``pull.swap``, real fetches over Mooncake). What stands
in: the model (:class:`Model`, whose ``load_weights`` records the bytes it is fed;
``native`` off), the race (``worker._resolve_here`` wrapped as in ``_pp_ranks``) and
the failure (``worker.fetch`` raises on PP stage 1, TP rank 1 in step 2).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path


class Model:
    """Stands in for an SGLang model: records what ``load_weights`` is fed."""

    def __init__(self) -> None:
        self.loaded: dict = {}
        self.calls = 0

    def load_weights(self, weights) -> None:
        from _pp_ranks import digest

        self.calls += 1
        self.loaded.update(digest(dict(weights)))


def init_sglang(rank: int, tp: int, pp: int, init_file: str) -> None:
    import _torchvision_shim

    _torchvision_shim.install()
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(tp_size=tp, pp_size=pp, moe_ep_size=1, attn_dp_size=1, attn_cp_size=1,
                                        moe_dp_size=1, attn_dcp_size=1, shared_experts_tp_size=None)
    ps.init_distributed_environment(backend="gloo", world_size=tp * pp, rank=rank, local_rank=rank,
                                    distributed_init_method=f"file://{init_file}")
    ps.initialize_model_parallel(backend="gloo")


def run(rank: int, tp: int, pp: int, init_file: str, url: str, tmp: str, path: list) -> None:
    sys.path[:0] = [p for p in path if p not in sys.path]
    tmp_p = Path(tmp)
    out: dict = {"rank": rank}
    try:
        init_sglang(rank, tp, pp, init_file)
        steps(out, url, tmp_p)
    except BaseException:
        out["crash"] = traceback.format_exc()
    finally:
        (tmp_p / f"rank{rank}.json").write_text(json.dumps(out))
        os._exit(0)


def steps(out: dict, url: str, tmp: Path) -> None:
    from _pp_ranks import MODEL, three_steps

    from tensorhub.integrations._core.settings import Settings
    from tensorhub.integrations.sglang import _runtime, pull

    st = _runtime.connect(Settings.from_config({
        "coordinator": url, "model": MODEL, "native": False, "worker_id": "pp-sglang",
        "fetch_timeout": 120, "drain_timeout": 10}))
    model = Model()
    three_steps(out, st, tmp, lambda: list(pull.swap(st, model, "latest")),
                lambda whole: {"loaded": model.loaded} if whole else {"load_calls": model.calls})
