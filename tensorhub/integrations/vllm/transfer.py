"""``--weight-transfer-config '{"backend": "tensorhub"}'``: hot-swap through vLLM's RL API.

The trainer (or ``tensorhub follow``) drives vLLM's own calls; every worker process runs
this engine:

* ``init_weight_transfer_engine({"init_info": {...}})``: optional ``coordinator``,
  ``model``, ``token`` (defaults: the ``--model-loader-extra-config`` of a
  ``--load-format tensorhub`` engine, then ``TENSORHUB_*``). Connects (or reuses the
  loader's connection).
* ``start_weight_update()``: nothing to prepare (the fetch happens before anything in
  the model changes).
* ``update_weights({"update_info": {"version": N}})`` (``N`` or ``"latest"``; every rank
  of the engine, each TP rank of each pipeline stage, uses the answer of PP stage 0's TP
  rank 0): fetch N in the ``hf`` layout into new memory; check names, shapes, dtypes
  against the running version; only then apply it with vLLM's layerwise reload
  (``model.load_weights`` in buckets). Every rank of the engine applies N, or none does:
  a failed fetch on any rank of any stage raises on all of them and leaves the old
  weights serving everywhere. The serving rank(s) are replicas of N from the fetch on; afterwards
  they unpublish the old version (waiting for its readers) and free it.
* ``finish_weight_update(weight_version="N")``: nothing left to do here; vLLM records the
  version that ``/weight_info`` reports.

Identity: the engine object is callable; vLLM's dev route ``POST /collective_rpc
{"method": "weight_transfer_engine"}`` answers, per worker, its TensorHub ``worker_id``,
model, version, whether it serves its ``hf`` copy and whether it prefetches. ``tensorhub
follow`` asks it once, so it can wait for the engine's prefetch without ``--engine-worker``.

Metrics: the engine's root (PP stage 0, TP rank 0) reports each swap to the coordinator (``Hub.report_swap``): the stall
is ``start_weight_update`` to ``finish_weight_update`` (the engine is paused throughout;
without a ``start`` call, the ``update_weights`` call alone), with its fetch and apply
parts; it lands in the coordinator's ``tensorhub_swap_stall_seconds`` and this process's
``tensorhub_hub_swap_stall_seconds``. A failed update is reported as failed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Optional, Union

from .._core import load, rollback, worker
from .._core.settings import Settings, SettingsError
from . import _native, _runtime

logger = logging.getLogger(__name__)

__all__ = ["TensorHubInitInfo", "TensorHubUpdateInfo", "make_engine_class"]


@dataclass
class TensorHubInitInfo:
    coordinator: Optional[str] = None
    model: Optional[str] = None
    token: Optional[str] = None


@dataclass
class TensorHubUpdateInfo:
    #: The version to switch to, or "latest".
    version: Union[int, str] = "latest"


def _engine_base() -> type:
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    return WeightTransferEngine


class _Mixin:
    """The engine's logic; combined with vLLM's base class by :func:`make_engine_class`."""

    init_info_cls = TensorHubInitInfo
    update_info_cls = TensorHubUpdateInfo
    supports_draft_weight_update = False

    def _settings(self, info: Optional[TensorHubInitInfo]) -> Settings:
        load = self.vllm_config.load_config  # type: ignore[attr-defined]
        base = dict(load.model_loader_extra_config) if load.load_format == "tensorhub" and \
            isinstance(load.model_loader_extra_config, dict) else {}
        if info is not None:
            base.update({k: v for k, v in vars(info).items() if v is not None})
        return Settings.from_config(base)

    def init_transfer_engine(self, init_info: TensorHubInitInfo) -> None:
        st = worker.get_state()
        s = self._settings(init_info)
        if st is not None and st.settings.model != s.model:
            raise SettingsError(f"tensorhub: setting 'model': this engine loaded {st.settings.model!r}, "
                                f"init_info names {s.model!r}")
        self._state = _runtime.connect(s)

    def _st(self) -> "_runtime.WorkerState":
        st = getattr(self, "_state", None) or worker.get_state()
        if st is None:  # init_weight_transfer_engine not called: use the loader's / env settings
            st = _runtime.connect(self._settings(None))
        self._state = st
        return st

    def start_weight_update(self) -> None:
        self._st()
        self._swap_t0 = time.monotonic()
        self._swap_parts: Optional[tuple[int, float, float]] = None

    def _report_swap(self, st: "_runtime.WorkerState", version: Any, t0: float, ok: bool,
                     parts: Optional[tuple[int, float, float]] = None) -> None:
        """The engine's root tells the coordinator (and this process's metrics) how long
        serving stalled: one report per swap, whatever the TP x PP."""
        if st.rank != 0 or st.pp_rank != 0 or not isinstance(version, int):
            return
        try:
            st.hub.report_swap(st.settings.model, version, time.monotonic() - t0, ok=ok,
                               fetch_seconds=parts[1] if parts else None, apply_seconds=parts[2] if parts else None)
        except Exception as e:  # metrics never break a swap
            logger.debug("tensorhub: swap report failed: %s", e)

    def receive_weights(self, update_info: TensorHubUpdateInfo) -> None:
        st = self._st()
        s = st.settings
        requested = update_info.version
        if isinstance(requested, str) and requested.isdigit():
            requested = int(requested)
        t0 = time.monotonic()
        st.touched = False
        st.wait_kept(s.fetch_timeout)  # a start in place still copying the running version: let it finish
        old_v = st.version
        got, err = None, None
        kept: Optional[Any] = None
        prefetched = False
        try:
            v = worker.resolve(st, requested, on_missing="error", what="update_info 'version'")
            if v != old_v:
                if st.prefetcher is not None:
                    got = st.prefetcher.take(v, s.fetch_timeout)
                    prefetched = got is not None
                if got is None:
                    spare = st.take_spare()
                    # Not serving: the spare is the running version's fetched copy (delta base;
                    # checked against its checksums before any delta is applied).
                    got = worker.fetch(st, v, into=spare, base=st.spare_base(spare, v))
                load.check_same_layout(st.specs, got, f"{s.model!r} v{v}")
                # The copy of old_v this rank serves: a failed apply restores from it
                # (withdraw() below drops it from the state on a GPU engine, not its bytes).
                kept = st.copy
                # The parameters are served in place: no reader may be reading them when
                # they change. Unpublish the running version (every layout) and let it drain.
                _native.withdraw(st)
        except Exception as e:
            err = str(e).removeprefix("tensorhub: ")
        # Every rank of the engine (each TP rank of each pipeline stage) applies the new
        # version, or none does. Nothing above raises past the try: every rank gets here.
        failed = st.engine().first_error(err)
        if failed is not None:
            if got is not None and st.serving:
                st.retire(v, got, reason="another rank failed")
            _native.publish(st, self.model)  # type: ignore[attr-defined]  # the unchanged parameters again
            self._report_swap(st, requested, getattr(self, "_swap_t0", None) or t0, ok=False)
            self._swap_t0 = None  # vLLM ends the session: no finish_weight_update follows
            where, why = failed
            where = f" ({where})" if where else ""
            raise RuntimeError(f"tensorhub: could not fetch {s.model!r} v{requested}{where}: {why}; the swap "
                               f"failed before any parameter changed and was rolled back to v{old_v}: "
                               f"the engine keeps serving v{old_v}")
        if got is None:
            logger.info("tensorhub: already at %s v%d", s.model, v)
            return
        t1 = time.monotonic()
        loading, err = 0.0, None
        st.touched = True  # the engine core resets its caches after this swap, even a failed one
        try:
            loading = self._apply(got)
        except Exception as e:  # some layers may hold v already: every rank rolls back below
            err = f"{type(e).__name__}: {str(e).removeprefix('tensorhub: ')}"
            logger.error("tensorhub: applying %s v%d failed on worker %s: %s", s.model, v, st.hub.worker_id, err)
        failed = st.engine().first_error(err)  # all ranks apply v, or all go back to old_v
        if failed is not None:
            self._roll_back(st, requested, v, old_v, got, kept, failed, t0)
        t2 = time.monotonic()
        old_copy = st.copy
        st.version, st.specs, st.copy = v, load.specs_of(got), (got if st.serving else None)
        _native.publish(st, self.model)  # type: ignore[attr-defined]
        if not st.serving and s.reuse_buffers:  # never served: reusable at once
            st.spare = dict(got)
        st.retire_later(old_v, old_copy)  # draining the old version's readers must not stall the engine
        logger.info("tensorhub: worker %s swapped %s v%s -> v%d: fetch %.2fs (%.1f MB, %.2f GB/s, from %s%s), "
                    "apply %.2fs (load_weights %.2fs, finalize %.2fs)", st.hub.worker_id, s.model, old_v, v,
                    t1 - t0, got.nbytes / 1e6, got.gbps, got.sources,
                    "; prefetched before the swap" if prefetched else "", t2 - t1, loading, t2 - t1 - loading)
        self._swap_parts = (v, t1 - t0, t2 - t1)
        if getattr(self, "_swap_t0", None) is None:  # no start_weight_update: this call is the swap
            self._report_swap(st, v, t0, ok=True, parts=self._swap_parts)
            self._swap_parts = None

    def _apply(self, tensors: Any) -> float:
        """vLLM's layerwise reload of the fetched version; returns the seconds in
        ``load_weights`` (which also processes each layer once it is whole, e.g. the CPU
        prepacking; the rest is vLLM's set-up and finalize). The test hook
        (:class:`_FailPoint`) may make it fail; never while it restores (:meth:`_restore`)."""
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        fail = None if getattr(self, "_restoring", False) else _FailPoint.from_env()
        model = self.model  # type: ignore[attr-defined]
        initialize_layerwise_reload(model)
        # One pass, as vLLM's own reload_weights does: the whole version is in memory
        # already, so buckets would bound nothing and only add calls.
        items = iter(tensors.items()) if fail is None else fail.wrap(tensors)
        t0 = time.monotonic()
        model.load_weights(items)
        loading = time.monotonic() - t0
        if fail is not None:
            fail.at_finalize()
        finalize_layerwise_reload(model, self.model_config)  # type: ignore[attr-defined]
        return loading

    def _abandon_reload(self) -> None:
        """After an interrupted :meth:`_apply`: drop what vLLM's layerwise reload buffered for
        layers that were not whole yet and put every unprocessed layer's own tensors back
        (vLLM's finalize: those still hold the old bytes), so the model has its parameters
        again and a full reload can start from a clean state."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        model = self.model  # type: ignore[attr-defined]
        for layer in model.modules():
            info = get_layerwise_info(layer)
            if info.can_load():  # waiting for more weights: forget the new version's part
                info.loaded_weights.clear()
                info.load_numel = 0
        finalize_layerwise_reload(model, self.model_config)  # type: ignore[attr-defined]

    def _restore(self, tensors: Any) -> None:
        """Apply the previous version again, in full, over whatever the failed apply left."""
        self._abandon_reload()
        fail = _FailPoint.from_env(restoring=True)
        if fail is not None:
            fail.fail("in the rollback's own apply")
        self._restoring = True
        try:
            self._apply(tensors)
        finally:
            self._restoring = False

    def _roll_back(self, st: "_runtime.WorkerState", requested: Any, v: int, old_v: Optional[int], got: Any,
                   kept: Any, failed: tuple[str, str], t0: float) -> None:
        """Applying ``v`` failed on some rank (``failed``: where, why): every rank puts
        ``old_v``'s exact bytes back (:func:`tensorhub.integrations._core.rollback.roll_back`), serves
        ``old_v`` again, and the call raises one message naming the rollback. When a rank
        cannot restore, the message says the engine is broken (it then stops serving)."""
        s = st.settings
        where, why = failed
        where = f" ({where})" if where else ""
        failure = f"applying {s.model!r} v{v} failed{where}: {why}"
        err: Optional[str] = None
        how = ""
        try:
            how = rollback.roll_back(st, old_v, kept, self._restore, failure)
        except rollback.RollbackError as e:
            err = str(e).removeprefix("tensorhub: ")
        broken = st.engine().first_error(err)  # the engine is whole only if every rank restored
        if st.serving:  # the fetched copy of v (registered): not a version this engine runs
            st.retire_later(v, got, reason="the swap failed")
        self._report_swap(st, requested, getattr(self, "_swap_t0", None) or t0, ok=False)
        self._swap_t0 = None  # vLLM ends the session: no finish_weight_update follows
        if broken is not None:
            place = f" ({broken[0]})" if broken[0] else ""
            st.broken = st.broken or f"another rank could not restore v{old_v}{place}: {broken[1]}"
            raise RuntimeError(f"tensorhub: the swap to v{v} failed and rolling back to v{old_v} failed "
                               f"too{place}: {broken[1]}; the engine refuses to serve a mix of layers: restart it")
        if kept is not None and st.copy is None and st.serving:  # withdrawn (GPU native): serve it again
            try:
                st.hub.publish(s.model, kept, version=old_v, layout="hf")
                st.copy = kept
            except Exception as e:
                logger.warning("tensorhub: could not register the hf copy of %s v%s again: %s", s.model, old_v, e)
        _native.publish(st, self.model)  # type: ignore[attr-defined]  # old_v's parameters again
        raise RuntimeError(f"tensorhub: {failure}; the swap failed and was rolled back to v{old_v} "
                           f"(every parameter restored {how}): the engine keeps serving v{old_v}")

    def finish_weight_update(self) -> None:
        t0, parts = getattr(self, "_swap_t0", None), getattr(self, "_swap_parts", None)
        self._swap_t0, self._swap_parts = None, None
        if t0 is not None and parts is not None:
            self._report_swap(self._st(), parts[0], t0, ok=True, parts=parts)

    def __call__(self) -> dict:
        """This worker's TensorHub identity, for ``tensorhub follow`` to learn which workers
        are the engine's: vLLM's dev route ``POST /collective_rpc {"method":
        "weight_transfer_engine"}`` looks the name up on every worker and calls what it finds
        (this engine), answering one of these per worker. Read-only: it never connects."""
        from dataclasses import asdict

        from tensorhub.follow import EngineWorker

        st = getattr(self, "_state", None) or worker.get_state()
        if st is None:  # not connected yet (no --load-format tensorhub, no update so far)
            return asdict(EngineWorker(None))
        return asdict(EngineWorker(st.hub.worker_id, st.settings.model, st.version, st.serving,
                                   st.prefetcher is not None))

    def shutdown(self) -> None:
        """Keep the Hub: the engine's replicas stay registered while it runs."""
        st = getattr(self, "_state", None)
        if st is not None and st.prefetcher is not None:
            st.prefetcher.stop()


class _FailPoint:
    """Test hook, never set in production: ``TENSORHUB_TEST_FAIL_APPLY`` makes the next
    apply fail at a chosen point, so tests can show the rollback on a real engine.

    The value (or, with a leading ``@``, the contents of that file, read at each swap so a
    test can change it while the engine runs; a missing file means no failure):
    ``before`` (before the first tensor reaches ``load_weights``), ``after:N`` (after N
    tensors, i.e. with the layers they complete already applied), ``last`` (at the last
    tensor), ``finalize`` (after ``load_weights``, before vLLM's finalize); add
    ``+restore`` to make the rollback's own apply fail too (the engine then refuses to
    serve). Read once per swap, outside the per-tensor path when unset."""

    ENV = "TENSORHUB_TEST_FAIL_APPLY"

    def __init__(self, point: str, count: int = 0) -> None:
        self.point, self.count = point, count

    @classmethod
    def parse(cls, spec: str, restoring: bool = False) -> Optional["_FailPoint"]:
        spec = spec.strip()
        if not spec:
            return None
        point, _, flags = spec.partition("+")
        if restoring:  # the rollback's own apply fails only when asked
            return cls("restore") if flags == "restore" else None
        name, _, n = point.partition(":")
        if name not in ("before", "after", "last", "finalize") or (name == "after") != n.isdigit() \
                or flags not in ("", "restore"):
            raise ValueError(f"{cls.ENV}={spec!r}: expected before, after:N, last or finalize, "
                             "optionally +restore")
        return cls(name, int(n) if n else 0)

    @classmethod
    def from_env(cls, restoring: bool = False) -> Optional["_FailPoint"]:
        import os

        spec = os.environ.get(cls.ENV, "")
        if spec.startswith("@"):
            try:
                with open(spec[1:]) as f:
                    spec = f.read()
            except FileNotFoundError:
                return None
        return cls.parse(spec, restoring)

    def fail(self, what: str) -> None:
        raise RuntimeError(f"test failure injected {what} ({self.ENV})")

    def wrap(self, tensors: Any) -> Any:
        """``tensors``' items for ``load_weights``, raising at the chosen point."""
        total = len(tensors)
        stop = {"before": 0, "after": self.count, "last": total - 1}.get(self.point)
        for i, item in enumerate(tensors.items()):
            if i == stop:
                self.fail(f"after {i} of {total} tensors")
            yield item

    def at_finalize(self) -> None:
        if self.point == "finalize":
            self.fail("before vLLM's finalize, every tensor loaded")


def make_engine_class() -> type:
    base = _engine_base()
    return type("TensorHubWeightTransferEngine", (_Mixin, base), {"__module__": __name__,
                                                                   "__doc__": __doc__})


def __getattr__(name: str) -> Any:
    # Lazy registration target: WeightTransferEngineFactory imports this module and reads the
    # class attribute only when an engine is configured with the tensorhub backend.
    if name == "TensorHubWeightTransferEngine":
        cls = make_engine_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
