"""``--load-format tensorhub``: start an SGLang engine from the weights its peers hold.

Runs in every SGLang TP worker (scheduler process), inside ``ModelRunner``'s
``get_model_loader(load_config).load_model(...)``:

1. build the model SGLang's way (``_initialize_model`` under the config's dtype and
   device), connect to the coordinator and resolve the version (the engine's root, PP
   stage 0's TP rank 0, decides; every rank of every stage loads that number);
2. fetch it: this rank's native shard when the version is complete in this engine's
   native layout (raw parameter bytes, copied in place), else the ``hf`` layout fed to
   ``model.load_weights`` in buckets -- read in place from a same-host holder's Hub
   memory when there is one (``load.borrow_into``: no copy of our own before the engine
   is up; the serving rank makes its ``hf`` copy from it in the background afterwards,
   ``WorkerState.keep_borrowed``); then SGLang's post-processing, as its default
   loader does. With no complete version, ``on_missing`` decides: ``disk`` reads
   ``--model-path DIR``'s safetensors (and publishes them), ``wait`` waits, ``error``
   stops the start with one line naming the setting;
3. register: every rank its parameters in place (native layout), the serving rank(s)
   the ``hf`` copy (a fetched copy is registered by the fetch, a disk copy is published
   once, by the engine's root, as a new version that the other ranks then learn).
"""

from __future__ import annotations

import logging
from typing import Any

from .._core import load, worker
from . import _native, _runtime
from .pull import swap

logger = logging.getLogger(__name__)

__all__ = ["make_loader_class"]


def make_loader_class() -> type:
    """Build the loader class (SGLang is imported here, not at module import)."""
    from sglang.srt.model_loader.loader import BaseModelLoader

    class TensorHubModelLoader(load.LoaderMixin, BaseModelLoader):
        """SGLang model loader for ``--load-format tensorhub``; see the module docstring."""

        def load_model(self, *, model_config: Any, device_config: Any) -> Any:
            import torch
            from sglang.srt.model_loader.loader import (
                _get_quantization_config,
                _initialize_model,
                set_default_torch_dtype,
            )

            target = torch.device(device_config.device)
            quant_config = _get_quantization_config(model_config, self.load_config)
            with set_default_torch_dtype(model_config.dtype):
                with target:
                    model = _initialize_model(model_config, self.load_config, quant_config)
                with self.one_line_errors():
                    self._load(model, model_config, target)
            return model.eval()

        def _load(self, model: Any, model_config: Any, target: Any) -> None:
            from sglang.srt.model_loader.loader import DefaultModelLoader, post_load_weights

            s = self.settings
            st = _runtime.connect(s)
            v, layout = swap(st, model, s.version, what="setting 'version'", on_missing=s.on_missing,
                             publish=False)
            if v is None:  # on_missing="disk"
                self._from_disk(st, model, model_config.model_path, target)
                return
            borrowed, st.pending_borrow = st.pending_borrow, None  # a start in place (same-host holder)
            try:
                if layout != "hf":
                    post_load_weights(model)  # raw native bytes: SGLang's fix-up, as its remote_instance loader
                DefaultModelLoader.postprocess_weights(model, target)
                _native.publish(st, model, v)
            except BaseException:
                if borrowed is not None:
                    borrowed.release_quietly()
                raise
            if borrowed is not None:  # the serving rank's hf copy, made in the background from it
                st.keep_borrowed(borrowed, v)
            logger.info("tensorhub: tp rank %d runs %s v%d%s", st.rank, s.model, v,
                        " and serves its hf copy" if st.copy is not None else
                        " and serves its hf copy once copied (in the background)" if borrowed is not None else "")

        def _from_disk(self, st: Any, model: Any, model_dir: str, target: Any) -> None:
            from sglang.srt.model_loader.loader import DefaultModelLoader

            tensors = worker.read_disk(model_dir)
            load.load_into(model, tensors, self.settings.bucket_bytes, st.hooks.groups)
            DefaultModelLoader.postprocess_weights(model, target)
            v = worker.publish_disk(st, tensors, model_dir)
            _native.publish(st, model, v)

    return TensorHubModelLoader
