"""``--load-format tensorhub``: start a vLLM engine from the weights its peers hold.

Runs in every vLLM worker process (one per TP/PP rank), inside vLLM's ``get_model``:

1. ``load_weights`` (before ``process_weights_after_loading``): connect to the coordinator,
   resolve the version (the engine's root, PP stage 0's TP rank 0, decides; every rank of
   every stage loads that number), fetch it in the ``hf``
   layout and stream it through ``model.load_weights`` in buckets of at most
   ``bucket_bytes``, cut at layer boundaries. When a holder on this host keeps the version
   in Hub memory (a trainer's ``empty_like`` snapshot, another engine's copy), the buckets
   are read-only views of that memory under a read lease (``Hub.borrow``): no copy of the
   version of our own on the way to the parameters; a serving rank makes its ``hf`` copy
   from that memory in the background once the engine is up (then releases the lease).
   Otherwise a rank that serves no copy (``serve_ranks="first"``, TP rank > 0) reads
   bucket by bucket into one reused buffer
   (``Hub.fetch(names=...)``): its extra memory is one bucket, not the model. A hot-swap
   still fetches the whole version before applying it, so that a failed fetch leaves
   the old weights intact on every rank. With no complete version, ``on_missing``
   decides: ``disk`` reads ``--model DIR``'s safetensors (and publishes them afterwards),
   ``wait`` waits for one, ``error`` stops the start with one line naming the setting.
2. ``load_model`` (after ``process_weights_after_loading``): the serving rank(s) register
   the ``hf`` copy with the coordinator (a fetched copy is already registered by the fetch;
   a disk copy is published once, by the engine's root, as a new version, which the other
   ranks then learn).

With ``native`` (default on), every rank also registers its processed parameters in place
as the engine-native layout, and a start whose fingerprint matches a complete native
layout copies its shard raw, with no ``load_weights`` (see ``_native``). On CPU vLLM
prepacks linear weights, so only the ``hf`` copy is servable there (see ``_runtime`` for
its memory cost).

The engine-neutral steps (settings, connect, resolve, fetch, load in buckets, publish a
disk load) are the core's (:mod:`tensorhub.integrations._core`); this module holds vLLM's hooks.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from .._core import load, worker
from . import _native, _runtime

logger = logging.getLogger(__name__)

__all__ = ["make_loader_class"]


def make_loader_class() -> type:
    """Build the loader class (vLLM is imported here, not at module import)."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    class TensorHubModelLoader(load.LoaderMixin, BaseModelLoader):
        """vLLM model loader for ``--load-format tensorhub``; see the module docstring."""

        def __init__(self, load_config: Any) -> None:
            super().__init__(load_config)
            self._pending_disk: Optional[dict] = None
            self._pending_native: Any = None
            self._pending_borrow: Any = None  # a start in place: the lease kept until the copy is made

        def load_weights(self, model: Any, model_config: Any) -> None:
            with self.one_line_errors():
                self._load(model, model_config)

        def _load(self, model: Any, model_config: Any) -> None:
            s = self.settings
            st = _runtime.connect(s)
            v = worker.resolve(st, s.version, on_missing=s.on_missing)
            if s.native:  # before any weight lands: the same on the engine that publishes and the one that reads
                st.layout = _native.fingerprint(model, model_config, tp_size=st.tp_size, pp_size=st.pp_size,
                                                pp_rank=st.pp_rank)
            if v is not None and s.native:
                got = self._fetch_native(st, v)
                if got is not None:  # copied over the parameters once vLLM processed them
                    self._pending_native, st.version = got, v
                    return
            if v is None:
                tensors = worker.read_disk(model_config.model)
                self._pending_disk = tensors
                load.load_into(model, tensors, s.bucket_bytes, st.hooks.groups)
                return
            borrowed = load.borrow_into(st, model, v, s.bucket_bytes, keep=st.serving)
            if borrowed is not None:  # loaded in place from a same-host holder's memory (released unless kept)
                if st.serving:  # its copy is made once the engine is up (load_model)
                    self._pending_borrow = borrowed
                return
            if not st.serving:  # nothing to keep: stream buckets through one reused buffer
                st.version, st.specs = v, load.stream_into(st, model, v, s.bucket_bytes)
                return
            got = worker.fetch(st, v)
            load.load_into(model, got, s.bucket_bytes, st.hooks.groups)
            st.version, st.specs, st.copy = v, load.specs_of(got), got

        def _fetch_native(self, st: Any, v: int) -> Any:
            """This rank's shard of ``v`` in the engine's native layout, if complete; else None
            (the caller reads the hf layout, also when this read fails)."""
            s = self.settings
            try:
                shard = _native.shard_of(st.rank, st.tp_size, st.pp_rank)
                if not _native.available(st.hub, s.model, v, st.layout, shard):
                    return None
                return worker.fetch(st, v, st.layout, shard=shard)
            except Exception as e:
                logger.warning("tensorhub: reading %s v%d in the native layout %s failed (%s); reading the hf "
                               "layout instead", s.model, v, st.layout, e)
                return None

        def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
            model = super().load_model(vllm_config, model_config, prefix)
            st = worker.get_state()
            if st is None:
                return model
            if self._pending_native is not None:  # raw bytes over the processed parameters
                got, self._pending_native = self._pending_native, None
                n = load.copy_into(_native.native_tensors(model), got)
                del got
                logger.info("tensorhub: loaded %s v%d raw from the native layout (%.1f MB, no load_weights)",
                            self.settings.model, st.version, n / 1e6)
            if self._pending_disk is not None:  # publish what we read from disk, as a new version
                tensors, self._pending_disk = self._pending_disk, None
                worker.publish_disk(st, tensors, model_config.model)
            _native.publish(st, model)
            keeping = self._pending_borrow is not None
            if keeping:  # the engine is up: the serving copy is made in the background
                borrowed, self._pending_borrow = self._pending_borrow, None
                st.keep_borrowed(borrowed, st.version)
            if self.settings.prefetch and st.prefetcher is None:
                from ._prefetch import Prefetcher

                st.prefetcher = Prefetcher(st).start()
            logger.info("tensorhub: engine worker (tp rank %d%s) runs %s v%s%s%s", st.rank,
                        f", pp stage {st.pp_rank}" if st.pp_size > 1 else "", self.settings.model,
                        st.version, " and serves its hf copy" if st.copy is not None else
                        " and serves its hf copy once copied (in the background)" if keeping else "",
                        f" and its parameters as layout {st.layout}" if st.native else "")
            return model

    return TensorHubModelLoader
