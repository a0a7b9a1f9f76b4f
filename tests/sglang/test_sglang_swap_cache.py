"""SGLang: a swap through TensorHub's pull always flushes the radix (prefix/KV) cache.

SGLang 0.5.23 flushes the cache itself after a successful ``update_weights_from_tensor``
when ``flush_cache`` is true (its default) and records the request's ``weight_version``
for every completion (``meta_info.weight_version``, per-token ``weight_versions``);
``tensorhub follow`` sends both (checked here against the request struct SGLang parses).
The plug-in refuses a tensorhub swap asked with ``flush_cache: false`` before anything
changes. Here with SGLang's own plug-in loader and hook registry on CPU, in a child
process; generating with SGLang needs CUDA, so no completion is served here.
"""

from __future__ import annotations

import json

import pytest

from _sglang_procs import require_sglang, run_py

pytestmark = [pytest.mark.engine]

_CODE = r"""
import json, types, _torchvision_shim
_torchvision_shim.install()
from sglang.srt.plugins import load_plugins
load_plugins()  # tensorhub's hooks, through the sglang.srt.plugins entry point
from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager as M
from tensorhub.integrations.sglang.pull import LOAD_FORMAT
import tensorhub.integrations.sglang.follow as follow

def req(**kw):
    return UpdateWeightsFromTensorReqInput(serialized_named_tensors=[b"x"], load_format=LOAD_FORMAT, **kw)

no_session = types.SimpleNamespace(_session=None)  # SGLang itself answers: no begin_weight_update
out = {}
r = M.update_weights_from_tensor(no_session, req(flush_cache=False, weight_version="7"))
out["refused"] = [r.success, r.message]
r = M.update_weights_from_tensor(no_session, req(weight_version="7"))
out["default"] = [r.success, r.message]
r = M.update_weights_from_tensor(no_session, UpdateWeightsFromTensorReqInput(
    serialized_named_tensors=[b"x"], load_format="direct", flush_cache=False))
out["other"] = [r.success, r.message]

sent = []
class Client:
    def post(self, path, json=None, **kw):
        sent.append((path, json))
        return types.SimpleNamespace(status_code=200, text="", json=lambda: {"success": True})
    def get(self, path, **kw):
        return types.SimpleNamespace(status_code=200, json=lambda: {"tp_size": 1, "weight_version": "6"})
follow.swap(Client(), 7, "abort", 1)
body = next(b for p, b in sent if p == "/update_weights_from_tensor")
import base64
body = {**body, "serialized_named_tensors": [base64.b64decode(x) for x in body["serialized_named_tensors"]]}
parsed = UpdateWeightsFromTensorReqInput(**body)  # the struct SGLang's route parses
out["follow"] = [parsed.flush_cache, parsed.weight_version, parsed.load_format]
print("@@" + json.dumps(out))
"""


def test_tensorhub_swap_flushes_the_cache_and_names_its_version():
    require_sglang()
    r = run_py(_CODE)
    lines = [x for x in r.stdout.splitlines() if x.startswith("@@")]
    assert lines, r.stdout[-2000:] + r.stderr[-4000:]
    out = json.loads(lines[-1][2:])
    ok, msg = out["refused"]
    assert not ok and msg.startswith('tensorhub: "flush_cache": false refused') and "\n" not in msg
    assert out["default"] == [False, out["default"][1]] and "begin_weight_update" in out["default"][1]
    assert "begin_weight_update" in out["other"][1]  # other formats: SGLang decides
    assert out["follow"][:2] == [True, "7"]
