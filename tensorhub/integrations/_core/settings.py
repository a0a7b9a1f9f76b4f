"""Settings of an engine adapter, from ``--model-loader-extra-config`` JSON.

One class for both engines (vLLM and SGLang take the same keys, defaults and errors, so a
user switching engines relearns nothing); ``reuse_buffers`` and ``prefetch`` act in the
vLLM adapter only (SGLang accepts them, to no effect). The default worker id is
``<engine>-<host>-<pid>`` (``vllm-...``, ``sglang-...``).

Precedence, as everywhere in TensorHub: a key in the JSON > the environment variable
(``TENSORHUB_COORDINATOR``, ``TENSORHUB_TOKEN``, ``TENSORHUB_WORKER_ID``,
``TENSORHUB_LOCALITY``, read by :mod:`tensorhub.envs`) > the default. A key counts as
given when it is present and not ``null``.

Every error names the setting, in one line: vLLM prints it at the bottom of its start-up
traceback, and the adapter also logs it once.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional, Union

from tensorhub import ConfigError, HubConfig, envs

__all__ = ["Settings", "SettingsError"]

ON_MISSING = ("disk", "wait", "error")


class SettingsError(ConfigError):
    """A setting of an engine adapter is wrong or unusable; the message names it."""


@dataclass(frozen=True)
class Settings:
    """One engine's TensorHub settings (every key of the extra-config JSON)."""

    #: Coordinator URL; default ``TENSORHUB_COORDINATOR``.
    coordinator: Optional[str] = None
    #: Model name on the coordinator (required), e.g. ``"policy"``.
    model: Optional[str] = None
    #: ``"latest"`` (newest complete version; every TP rank gets the same) or a version number.
    version: Union[str, int] = "latest"
    #: What to do when the coordinator has no complete version of ``model``:
    #: ``"disk"`` loads the weight files in ``--model DIR`` and publishes them as a new
    #: version; ``"wait"`` waits up to ``wait_timeout`` s for one; ``"error"`` stops the start.
    on_missing: str = "error"
    #: API token; default ``TENSORHUB_TOKEN``. Never logged.
    token: Optional[str] = None
    #: Worker id prefix; default ``TENSORHUB_WORKER_ID`` or ``<engine>-<host>-<pid>``. With TP/PP > 1
    #: each rank appends ``-tp<r>`` / ``-pp<r>``.
    worker_id: Optional[str] = None
    #: Locality labels ``dc=..,zone=..,host=..``; default ``TENSORHUB_LOCALITY``.
    locality: Optional[str] = None
    #: Seconds to wait for the coordinator to answer ``/healthz`` at start.
    connect_timeout: float = 20.0
    #: Seconds ``on_missing="wait"`` waits for a first version.
    wait_timeout: float = 600.0
    #: Seconds one fetch may take (including waiting for a serving replica).
    fetch_timeout: float = 300.0
    #: Seconds a hot-swap waits for readers of the old version to drain before it keeps the
    #: old copy registered-off but allocated (it is freed at a later swap).
    drain_timeout: float = 60.0
    #: Largest group of tensors handed to ``model.load_weights`` in one call.
    bucket_bytes: int = 256 << 20
    #: Which ranks keep (and serve) the ``hf`` copy: ``"first"`` (TP rank 0 of each PP stage)
    #: or ``"all"``.
    serve_ranks: str = "first"
    #: Also serve each rank's parameters in place as the engine-native layout, and start
    #: from a peer's native layout when one matches this engine exactly (GPU engines; on
    #: CPU vLLM prepacks weights and the hf copy is served instead).
    native: bool = True
    #: Keep the previous version's ``hf`` copy, once its readers drained, as the next swap's
    #: fetch destination: memory already paged in fetches several times faster than new
    #: memory, at the cost of that copy staying allocated between swaps (vLLM).
    reuse_buffers: bool = True
    #: Fetch each new version in the background as soon as it is complete, while the engine
    #: still generates; a later swap to it then only applies it (one more model-size copy
    #: until the swap; vLLM). On by default: an engine that follows a trainer then stalls
    #: only for the apply. ``false`` fetches inside the swap instead (the pause then covers
    #: the transfer too), e.g. when host memory cannot take the extra copy.
    prefetch: bool = True

    @classmethod
    def from_extra(cls, extra: Any) -> "Settings":
        """From the engine's ``model_loader_extra_config``: a mapping (vLLM parses the JSON)
        or the JSON text itself (SGLang passes it on as given)."""
        if isinstance(extra, str):
            import json

            extra = json.loads(extra or "{}")
        if not isinstance(extra, dict):
            raise SettingsError("tensorhub: --model-loader-extra-config must be a JSON object")
        return cls.from_config(extra)

    @classmethod
    def from_config(cls, extra: Optional[Mapping[str, Any]], *, require_model: bool = True) -> "Settings":
        """Validate the extra-config mapping (``None`` = empty) and apply env defaults."""
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise SettingsError(f"tensorhub: unknown setting {unknown[0]!r} in --model-loader-extra-config; "
                                f"known: {', '.join(sorted(known))}")
        given = {k: v for k, v in extra.items() if v is not None}
        coordinator = given.get("coordinator", envs.TENSORHUB_COORDINATOR)
        token = given.get("token", envs.TENSORHUB_TOKEN)
        s = cls(**{**given, "coordinator": coordinator, "token": token})
        s._check(require_model)
        return s

    def _check(self, require_model: bool) -> None:
        def bad(key: str, why: str) -> SettingsError:
            return SettingsError(f"tensorhub: setting {key!r}: {why}")

        if not self.coordinator:
            raise bad("coordinator", "no coordinator URL; set it in --model-loader-extra-config "
                                     "or TENSORHUB_COORDINATOR")
        if not str(self.coordinator).startswith(("http://", "https://")):
            raise bad("coordinator", f"{self.coordinator!r} is not an http(s) URL")
        if require_model and not self.model:
            raise bad("model", "missing; name the model on the coordinator, e.g. \"model\": \"policy\"")
        if self.model is not None and not isinstance(self.model, str):
            raise bad("model", f"must be a string, got {self.model!r}")
        v = self.version
        if not (v == "latest" or (isinstance(v, int) and not isinstance(v, bool) and v >= 1)):
            raise bad("version", f"must be \"latest\" or a positive integer, got {v!r}")
        if self.on_missing not in ON_MISSING:
            raise bad("on_missing", f"must be one of {', '.join(ON_MISSING)}, got {self.on_missing!r}")
        for key in ("native", "reuse_buffers", "prefetch"):
            if not isinstance(getattr(self, key), bool):
                raise bad(key, f"must be true or false, got {getattr(self, key)!r}")
        if self.serve_ranks not in ("first", "all"):
            raise bad("serve_ranks", f"must be \"first\" or \"all\", got {self.serve_ranks!r}")
        for key in ("connect_timeout", "wait_timeout", "fetch_timeout", "drain_timeout", "bucket_bytes"):
            val = getattr(self, key)
            if not isinstance(val, (int, float)) or isinstance(val, bool) or val <= 0:
                raise bad(key, f"must be a positive number, got {val!r}")

    def hub_config(self, worker_id: str) -> HubConfig:
        """The Hub's configuration for one rank (``tensorhub.HubConfig``: the same
        argument > environment > default resolution as every Hub); a bad value is a
        one-line settings error."""
        try:
            return HubConfig.resolve(self.coordinator, worker_id=worker_id, locality=self.locality,
                                     token=self.token, fetch_timeout=self.fetch_timeout)
        except ConfigError as e:
            raise SettingsError(f"tensorhub: {e}") from None

    def redacted(self) -> dict:
        """For logs: every setting, the token masked."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        if d["token"]:
            d["token"] = "***"
        return d
