"""The engine adapters' engine-neutral core: what vLLM's and SGLang's adapters share.

Each adapter (``tensorhub.integrations.vllm``, ``tensorhub.integrations.sglang``) keeps only its engine's
hooks: the loader class, the hot-swap entry (vLLM's weight-transfer engine, SGLang's pull
function), the engine-native layout, the follow driver; it tells the core its ranks and
layer groups through one :class:`~tensorhub.integrations._core.worker.EngineHooks`. The core never
imports an adapter, and neither adapter imports the other.

* :mod:`.settings`: ``Settings`` (every ``--model-loader-extra-config`` key, env defaults,
  one-line errors) and ``SettingsError``;
* :mod:`.ranks`: ``EngineRanks``, the engine's ranks over every pipeline stage and TP
  rank: broadcast, gather, the root decides, all-or-none;
* :mod:`.worker`: the worker process's state, connect, resolve (which version the engine
  loads), fetch, and ``on_missing="disk"`` (read the weight files, publish them once);
* :mod:`.load`: putting weights into the model: ``load_weights`` in buckets, streaming
  through one buffer, layout checks, raw copies of a native shard, native layout names;
* :mod:`.rollback`: a failed swap puts the previous version's exact bytes back (the kept
  copy, else read again from peers), or marks the worker broken.

The follow loop (``tensorhub follow``) is engine-neutral too and lives below, in
:mod:`tensorhub.follow`; the adapters register their drivers as ``tensorhub.engines``
entry points.
"""
