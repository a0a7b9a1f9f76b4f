"""Engine adapters: ``tensorhub.integrations.vllm``, ``.sglang`` (inference engines) and ``.verl``
(the RL framework's checkpoint engine), on the engine-neutral core ``._core``. Each imports its
engine lazily, inside functions; engines load them through the entry points in
``pyproject.toml``, so no user imports them by hand. The rest of ``tensorhub`` imports none of
them. The old paths ``integrations.<engine>...`` still import for one release (``._legacy``)."""
