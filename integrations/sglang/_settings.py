"""Settings of the SGLang adapter, from ``--model-loader-extra-config`` JSON.

The same keys, defaults, precedence (JSON key > ``TENSORHUB_*`` environment variable >
default) and one-line errors as the vLLM adapter (:mod:`integrations.vllm._settings`),
so a user switching engines relearns nothing; one key is added:

* ``native`` (default ``true``): after loading, every TP rank also registers its
  parameters in place as the engine-native layout (see :func:`._runtime.fingerprint`),
  which same-layout SGLang peers read raw and SGLang's own ``remote_instance`` loader can
  read through :mod:`integrations.sglang.seed`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from integrations.vllm._settings import Settings as _Base
from integrations.vllm._settings import SettingsError

__all__ = ["Settings", "SettingsError"]


@dataclass(frozen=True)
class Settings(_Base):
    """One SGLang engine's TensorHub settings (every key of the extra-config JSON); the
    vLLM adapter's keys (worker id default ``sglang-<host>-<pid>``) plus ``native``."""

    #: Register each TP rank's parameters in place as the engine-native layout.
    native: bool = True

    @classmethod
    def from_config(cls, extra: Optional[Mapping[str, Any]], *, require_model: bool = True) -> "Settings":
        s = super().from_config(extra, require_model=require_model)
        if not isinstance(s.native, bool):
            raise SettingsError(f"tensorhub: setting 'native': must be true or false, got {s.native!r}")
        return s
