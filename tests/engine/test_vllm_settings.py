"""Wrong settings stop a real vLLM server's start with one line naming the setting.

The four of the issue (unknown model, missing version, wrong token, unreachable
coordinator) go through real servers; malformed values are checked without an engine in
test_vllm_plugin_units.py (the same ``Settings`` code raises them in the worker).
"""

from __future__ import annotations

import json

import pytest

from _engines import Coordinator, ServerEngine, free_port, require_vllm
from _tiny import make_model_dir, make_weights

pytestmark = pytest.mark.engine

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    require_vllm()
    import tensorhub

    tmp = tmp_path_factory.mktemp("settings")
    (tmp / "token").write_text(TOKEN)
    coord = Coordinator(tmp / "state", token_file=tmp / "token")
    trainer = tensorhub.connect(coord.url, worker_id="trainer", token=TOKEN)
    weights = make_weights(0)
    trainer.publish("policy", weights)  # v1 exists, so "version": 7 is a missing version
    try:
        yield {"url": coord.url, "tmp": tmp, "bare": make_model_dir(tmp / "bare", weights=False)}
    finally:
        trainer.close()
        coord.stop()


def test_wrong_settings_fail_with_one_clear_line(setup):
    url, tmp = setup["url"], setup["tmp"]
    dead = f"http://127.0.0.1:{free_port()}"
    # The token travels in TENSORHUB_TOKEN: vLLM itself logs --model-loader-extra-config.
    cases = {
        "unknown model": ({"coordinator": url, "model": "nope"},
                          "tensorhub: setting 'model': unknown model 'nope'"),
        "missing version": ({"coordinator": url, "model": "policy", "version": 7},
                            "tensorhub: setting 'version': 'policy' has no complete version 7"),
        "wrong token": ({"coordinator": url, "model": "policy"},
                        f"tensorhub: setting 'token': the coordinator at {url} refused it"),
        "unreachable coordinator": ({"coordinator": dead, "model": "policy", "connect_timeout": 2},
                                    f"tensorhub: setting 'coordinator': {dead} did not answer within 2s"),
    }
    engines = {}
    try:
        for name, (extra, _) in cases.items():  # start them all at once: each fails in ~20 s
            engines[name] = ServerEngine(tmp / f"{name.replace(' ', '_')}.log", setup["bare"], [
                "--load-format", "tensorhub", "--model-loader-extra-config", json.dumps(extra)], wait=False,
                env={"TENSORHUB_TOKEN": "not-the-token" if name == "wrong token" else TOKEN})
        for name, (_, line) in cases.items():
            rc = engines[name].wait_exit(300)
            log = engines[name].log_tail(400_000)
            assert rc != 0, name
            assert line in log, f"{name}: {line!r} not in the log:\n{log[-3000:]}"
            assert TOKEN not in log and "not-the-token" not in log, name  # a token is never logged
    finally:
        for e in engines.values():
            e.close()
