"""The rollback's pure parts (no engine): where the previous version's bytes come from, what
a failed restore marks, the test hook's failure points, the engine core after a failed swap.
The engine proof is ``test_vllm_rollback.py``."""

from __future__ import annotations

import types

import pytest

from tensorhub.integrations._core import rollback
from tensorhub.integrations._core.settings import Settings
from tensorhub.integrations._core.worker import WorkerState
from tensorhub.integrations.vllm import _engine_core
from tensorhub.integrations.vllm.transfer import _FailPoint


class _Got(dict):
    nbytes = 12


class _Hub:
    """Stands in for the Hub: ``fetch`` answers ``versions[v]`` (or raises ``error``)."""

    def __init__(self, versions: dict, error: Exception | None = None) -> None:
        self.versions, self.error, self.calls = versions, error, []

    def fetch(self, model, version, **kw):
        self.calls.append((model, version, kw))
        if self.error is not None:
            raise self.error
        return _Got(self.versions[version])


def _state(hub) -> WorkerState:
    return WorkerState(Settings.from_config({"model": "policy", "coordinator": "http://c:1"}), hub)


def test_restores_from_the_kept_copy_without_a_read():
    hub, model = _Hub({}), {}
    kept = {"w": [1, 1], "b": [2]}
    how = rollback.roll_back(_state(hub), 4, kept, model.update, "applying v5 failed")
    assert model == kept and hub.calls == []
    assert how == "from this worker's kept copy of v4"


def test_without_a_kept_copy_reads_the_version_again_unregistered():
    hub, model = _Hub({4: {"w": [1, 1]}, 5: {"w": [9, 9]}}), {"w": [9, 1]}  # half v5
    st = _state(hub)
    how = rollback.roll_back(st, 4, None, model.update, "applying v5 failed")
    assert model == {"w": [1, 1]} and st.broken is None
    (name, v, kw), = hub.calls
    assert (name, v, kw["serve"], kw["layout"]) == ("policy", 4, False, "hf")
    assert how.startswith("v4 read again from peers")


@pytest.mark.parametrize("case", ["read fails", "apply fails", "no version"])
def test_a_failed_restore_marks_the_worker_broken(case):
    hub = _Hub({}, error=RuntimeError("tensorhub: no replica of 'policy' v4 answered")) \
        if case == "read fails" else _Hub({4: {}})

    def apply(_):
        raise RuntimeError("engine error")

    st = _state(hub)
    with pytest.raises(rollback.RollbackError) as e:
        rollback.roll_back(st, None if case == "no version" else 4, None,
                           apply if case == "apply fails" else dict, "applying v5 failed (x)")
    msg = str(e.value)
    assert msg.startswith("tensorhub: 'policy' holds a mix of two versions' layers after a failed swap "
                          "(applying v5 failed (x)); restoring v")
    assert st.broken and st.broken in msg
    assert {"read fails": "no replica of 'policy' v4 answered", "apply fails": "engine error",
            "no version": "no copy to restore from"}[case] in msg


@pytest.mark.parametrize("spec, stop", [("before", 0), ("after:3", 3), ("last", 4), ("after:9", None)])
def test_fail_point_raises_after_that_many_tensors(spec, stop):
    tensors = {f"t{i}": i for i in range(5)}
    fp = _FailPoint.parse(spec)
    seen = []
    if stop is None:
        seen = list(fp.wrap(tensors))
        assert len(seen) == 5
        return
    with pytest.raises(RuntimeError, match="test failure injected .*TENSORHUB_TEST_FAIL_APPLY"):
        for item in fp.wrap(tensors):
            seen.append(item)
    assert len(seen) == stop
    fp.at_finalize()  # only "finalize" fails there


def test_fail_point_specs(tmp_path, monkeypatch):
    assert _FailPoint.parse("") is None
    with pytest.raises(RuntimeError, match="before vLLM's finalize"):
        _FailPoint.parse("finalize").at_finalize()
    for bad in ("after", "after:x", "middle", "before:2", "last+later"):
        with pytest.raises(ValueError, match="TENSORHUB_TEST_FAIL_APPLY="):
            _FailPoint.parse(bad)
    # the rollback's own apply fails only with +restore, and then before its first tensor
    assert _FailPoint.parse("after:3", restoring=True) is None
    assert _FailPoint.parse("after:3+restore", restoring=True).point == "restore"
    monkeypatch.delenv(_FailPoint.ENV, raising=False)
    assert _FailPoint.from_env() is None
    f = tmp_path / "hook"
    monkeypatch.setenv(_FailPoint.ENV, f"@{f}")
    assert _FailPoint.from_env() is None  # no file: no failure
    f.write_text("after:2\n")
    assert (_FailPoint.from_env().point, _FailPoint.from_env().count) == ("after", 2)


class _Core:
    """Stands in for vLLM's EngineCore after a failed tensorhub update_weights."""

    def __init__(self, broken):
        self.resets, self.label = [], "1"
        self.model_executor = types.SimpleNamespace(collective_rpc=self._rpc)
        self._broken = broken

    touched = [False, True]

    def _rpc(self, fn):
        if fn is _engine_core.worker_touched:
            return self.touched
        return [1, 1] if fn is _engine_core.worker_version else self._broken

    def _reset_caches(self, **kw):
        self.resets.append(kw)

    def set_weight_version(self, v):
        self.label = v

    def get_weight_version(self):
        return self.label


def test_a_rolled_back_swap_resets_caches_and_keeps_serving():
    core = _Core([None, None])
    _engine_core._after_failed_swap(core)
    assert core.resets == [{"reset_running_requests": True, "reset_connector": True}]
    assert core.label == "1" and not getattr(core, "_tensorhub_broken", None)
    _engine_core._refuse_if_broken(core)  # serves
    core = _Core([None, None])
    core.touched = [False, False]  # a failed fetch: nothing changed, the cache stays
    _engine_core._after_failed_swap(core)
    assert core.resets == []


def test_a_failed_rollback_makes_the_engine_refuse_requests():
    core = _Core([None, "'policy' holds a mix of two versions' layers"])
    _engine_core._after_failed_swap(core)
    assert core.resets  # reset all the same
    with pytest.raises(RuntimeError, match="this engine refuses requests: 'policy' holds a mix"):
        _engine_core._refuse_if_broken(core)


def test_every_worker_answers_a_failed_update_weights():
    """A worker's error comes back as a value (vLLM's executor would stop reading replies at
    the first worker that raised and leave the others' replies queued for the next call)."""
    class Worker:
        def __init__(self, error=None):
            self.error, self.calls = error, []

        def update_weights(self, *a, **kw):
            self.calls.append((a, kw))
            if self.error:
                raise RuntimeError(self.error)
            return "done"

    ok, bad = Worker(), Worker("tensorhub: applying 'policy' v2 failed; rolled back to v1")
    assert _engine_core.guarded_update_weights(ok, {"version": 2}, x=1) == (None, "done")
    assert ok.calls == [(({"version": 2},), {"x": 1})]
    answer = _engine_core.guarded_update_weights(bad, {"version": 2})
    assert answer == (_engine_core._FAILED, "tensorhub: applying 'policy' v2 failed; rolled back to v1")
