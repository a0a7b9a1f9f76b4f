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

from .._core import load, worker
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
        st.wait_kept(s.fetch_timeout)  # a start in place still copying the running version: let it finish
        old_v = st.version
        got, err = None, None
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
            raise RuntimeError(f"tensorhub: could not fetch {s.model!r} v{requested}{where}: {why}; "
                               f"the engine keeps serving v{old_v}")
        if got is None:
            logger.info("tensorhub: already at %s v%d", s.model, v)
            return
        t1 = time.monotonic()
        loading = self._apply(got)
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
        prepacking; the rest is vLLM's set-up and finalize)."""
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        model = self.model  # type: ignore[attr-defined]
        initialize_layerwise_reload(model)
        # One pass, as vLLM's own reload_weights does: the whole version is in memory
        # already, so buckets would bound nothing and only add calls.
        t0 = time.monotonic()
        model.load_weights(iter(tensors.items()))
        loading = time.monotonic() - t0
        finalize_layerwise_reload(model, self.model_config)  # type: ignore[attr-defined]
        return loading

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
