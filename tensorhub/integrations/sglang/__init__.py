"""TensorHub's SGLang plug-in (SGLang >= 0.5.23; ``pip install 'tensorhub-ros[sglang]'``).

SGLang runs :func:`register` through the ``sglang.srt.plugins`` entry point in every
process it starts (``load_plugins()``: launcher, scheduler/TP workers, detokenizer), then
applies the hooks registered here with ``HookRegistry.apply_hooks()``. SGLang has no
loader registry, so the plug-in adds the load format ``tensorhub`` in three places:

* the CLI: ``--load-format`` choices (``add_load_format_choices``);
* ``LoadConfig``: an AROUND hook on ``LoadConfig._verify_load_format`` keeps
  ``"tensorhub"`` (``LoadFormat`` is a closed enum);
* ``get_model_loader``: an AROUND hook returns
  :class:`~tensorhub.integrations.sglang.loader` 's loader for it (every other format goes to SGLang);
* ``WeightUpdater.update_weights_from_tensor``: an AROUND hook makes a failed pull
  (:mod:`.pull`) answer ``success: false`` with its message instead of an exception;
* the scheduler's ``update_weights_from_tensor``: an AROUND hook refuses our pull with
  ``"flush_cache": false`` before anything changes (one-line ``success: false``). SGLang
  itself flushes the radix (prefix/KV) cache after a successful update when
  ``flush_cache`` is true (its default), and records the update's ``weight_version`` so
  every completion carries it (``meta_info.weight_version``, per-token
  ``weight_versions``); ``tensorhub follow`` passes both. With ``false`` the cache would
  keep KV computed with the old weights.

Then ``python -m sglang.launch_server --model-path DIR --load-format tensorhub
--model-loader-extra-config '{"coordinator": URL, "model": NAME, "version": "latest"|N,
"on_missing": "disk"|"wait"|"error"}'`` starts from peers: the settings both adapters share
(:class:`~tensorhub.integrations._core.settings.Settings`). Hot-swap: :mod:`.pull`; follow mode:
:mod:`.follow`; a seed for SGLang's own ``remote_instance`` loader: :mod:`.seed`.

Importing this package imports no SGLang; :func:`register` does.
"""

from __future__ import annotations

from typing import Any

__all__ = ["register", "LOAD_FORMAT"]

#: The ``--load-format`` value this plug-in adds.
LOAD_FORMAT = "tensorhub"

_LOADER: Any = None


def register() -> None:
    """Add the ``tensorhub`` load format to SGLang (choices + hooks). Idempotent; the hooks
    take effect at ``HookRegistry.apply_hooks()``, which ``load_plugins()`` calls next."""
    from sglang.srt.arg_groups.choices import LOAD_FORMAT_CHOICES, add_load_format_choices
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if LOAD_FORMAT not in LOAD_FORMAT_CHOICES:
        add_load_format_choices([LOAD_FORMAT])
    for target, hook in ((_VERIFY, _verify_load_format), (_GET_LOADER, _get_model_loader),
                         (_UPDATE, _update_weights_from_tensor),
                         (_SCHED_UPDATE, _scheduler_update_weights_from_tensor)):
        if not any(h is hook for _, h, _ in HookRegistry._hooks.get(target, [])):
            HookRegistry.register(target, hook, HookType.AROUND)


_VERIFY = "sglang.srt.configs.load_config.LoadConfig._verify_load_format"
_GET_LOADER = "sglang.srt.model_loader.loader.get_model_loader"
_UPDATE = "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater.update_weights_from_tensor"
_SCHED_UPDATE = ("sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"
                 ".update_weights_from_tensor")


def _verify_load_format(original: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    """``LoadConfig(load_format="tensorhub")`` keeps the string; SGLang checks the rest."""
    if isinstance(self.load_format, str) and self.load_format.lower() == LOAD_FORMAT:
        self.load_format = LOAD_FORMAT
        return None
    return original(self, *args, **kwargs)


def _get_model_loader(original: Any, load_config: Any, *args: Any, **kwargs: Any) -> Any:
    """Our loader for ``tensorhub``, SGLang's choice for every other format."""
    if load_config.load_format == LOAD_FORMAT:
        global _LOADER
        if _LOADER is None:
            from .loader import make_loader_class

            _LOADER = make_loader_class()
        return _LOADER(load_config)
    return original(load_config, *args, **kwargs)


def _update_weights_from_tensor(original: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    """SGLang ignores a custom loader's result and lets its exceptions take the scheduler
    down. For our pull function, turn a failure (version missing, fetch failed, readers
    not drained: the old weights still serve) into SGLang's ``(False, message)``, which
    ``/update_weights_from_tensor`` answers with HTTP 400."""
    load_format = kwargs.get("load_format", args[1] if len(args) > 1 else None)
    from .pull import LOAD_FORMAT as PULL

    if load_format != PULL:
        return original(self, *args, **kwargs)
    try:
        return original(self, *args, **kwargs)
    except Exception as e:
        import logging

        logging.getLogger(__name__).error("%s", e)
        return False, str(e)


def _scheduler_update_weights_from_tensor(original: Any, self: Any, recv_req: Any, *args: Any, **kwargs: Any) -> Any:
    """Runs in each scheduler (TP rank) process. A swap through our pull function always
    flushes SGLang's radix cache: ``flush_cache: false`` would let requests after the swap
    reuse KV blocks computed with the old weights, so it is refused on every rank before
    any weight changes (the old weights keep serving). Every other update goes to SGLang."""
    from .pull import LOAD_FORMAT as PULL

    if getattr(recv_req, "load_format", None) == PULL and getattr(recv_req, "flush_cache", True) is False:
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqOutput

        return UpdateWeightsFromTensorReqOutput(success=False, message=_FLUSH_REFUSED)
    return original(self, recv_req, *args, **kwargs)


#: The answer to a tensorhub swap asked with ``"flush_cache": false``.
_FLUSH_REFUSED = ("tensorhub: \"flush_cache\": false refused: the prefix/KV cache must be flushed at a swap "
                 "(its entries were computed with the old weights); leave flush_cache out or true; "
                 "no weight was changed")
