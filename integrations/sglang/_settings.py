"""Settings of the SGLang adapter, from ``--model-loader-extra-config`` JSON.

The vLLM adapter's settings class itself (:mod:`integrations.vllm._settings`): the same
keys, defaults, precedence (JSON key > ``TENSORHUB_*`` environment variable > default)
and one-line errors, so a user switching engines relearns nothing. ``native`` (default
``true``) makes every TP rank also register its parameters in place as the engine-native
layout (see :func:`._runtime.fingerprint`), which same-layout SGLang peers read raw and
SGLang's own ``remote_instance`` loader can read through :mod:`integrations.sglang.seed`.
``reuse_buffers`` is the vLLM adapter's only (accepted, no effect here). The default
worker id is ``sglang-<host>-<pid>``.
"""

from __future__ import annotations

from integrations.vllm._settings import Settings, SettingsError

__all__ = ["Settings", "SettingsError"]
