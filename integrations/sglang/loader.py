"""``--load-format tensorhub``: start an SGLang engine from the weights its peers hold.

Runs in every SGLang TP worker (scheduler process), inside ``ModelRunner``'s
``get_model_loader(load_config).load_model(...)``:

1. build the model SGLang's way (``_initialize_model`` under the config's dtype and
   device), connect to the coordinator and resolve the version (the engine's root, PP
   stage 0's TP rank 0, decides; every rank of every stage loads that number);
2. fetch it: this rank's native shard when the version is complete in this engine's
   native layout (raw parameter bytes, copied in place), else the ``hf`` layout fed to
   ``model.load_weights`` in buckets; then SGLang's post-processing, as its default
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

from integrations.vllm._runtime import read_disk

from . import _runtime
from ._settings import Settings, SettingsError
from .pull import swap

logger = logging.getLogger(__name__)

__all__ = ["make_loader_class"]


def settings_of(load_config: Any) -> Settings:
    extra = load_config.model_loader_extra_config
    if isinstance(extra, str):
        import json

        extra = json.loads(extra or "{}")
    if not isinstance(extra, dict):
        raise SettingsError("tensorhub: --model-loader-extra-config must be a JSON object")
    return Settings.from_config(extra)


def make_loader_class() -> type:
    """Build the loader class (SGLang is imported here, not at module import)."""
    from sglang.srt.model_loader.loader import BaseModelLoader

    class TensorHubModelLoader(BaseModelLoader):
        """SGLang model loader for ``--load-format tensorhub``; see the module docstring."""

        def __init__(self, load_config: Any) -> None:
            super().__init__(load_config)
            self.settings = settings_of(load_config)

        def download_model(self, model_config: Any) -> None:
            """Nothing to download: the weights come from peers."""

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
                try:
                    self._load(model, model_config, target)
                except SettingsError as e:
                    logger.error("%s", e)  # the one line; SGLang's traceback follows
                    raise
                except Exception as e:
                    logger.error("tensorhub: loading %r from peers failed: %s", self.settings.model, e)
                    raise
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
            if layout != "hf":
                post_load_weights(model)  # raw native bytes: SGLang's fix-up, as its remote_instance loader
            DefaultModelLoader.postprocess_weights(model, target)
            _runtime.publish_native(st, model, v)
            logger.info("tensorhub: tp rank %d runs %s v%d%s", st.rank, s.model, v,
                        " and serves its hf copy" if st.copy is not None else "")

        def _from_disk(self, st: Any, model: Any, model_dir: str, target: Any) -> None:
            from sglang.srt.model_loader.loader import DefaultModelLoader

            s = self.settings
            tensors = read_disk(model_dir)
            _runtime.load_into(model, tensors, s.bucket_bytes)
            DefaultModelLoader.postprocess_weights(model, target)
            eng = _runtime.engine()
            v: Any = None
            if eng.root:  # one new version for the whole engine, every stage
                try:
                    v = st.hub.publish(s.model, tensors, layout="hf")
                    logger.info("tensorhub: published the weight files of %s as %s v%d", model_dir, s.model, v)
                except Exception as e:  # the other ranks wait in the broadcast: hand them the error
                    v = ("error", f"tensorhub: publishing the weight files of {model_dir} failed: {e}")
            v = eng.broadcast(v)
            if isinstance(v, tuple):
                raise RuntimeError(v[1])
            if not eng.root and st.serving:
                st.hub.publish(s.model, tensors, version=v, layout="hf")
            st.version, st.specs = v, _runtime.specs_of(tensors)
            st.copy = tensors if st.serving else None
            _runtime.publish_native(st, model, v)

    return TensorHubModelLoader
