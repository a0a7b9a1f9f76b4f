"""Processes playing verl's trainer ranks and rollout workers, and the driver's sync step.

What is real: verl 0.9.1's ``CheckpointEngineRegistry`` (the backend is looked up by name,
after verl's own entry-point discovery or ``custom_backend_module`` import), its
``CheckpointEngineConfig`` / ``RolloutConfig`` / ``HFModelConfig``, its
``CheckpointEngineWorker`` on the rollout side (it builds the backend from the rollout
config and drives ``receive_weights`` into the server adapter), the backend's classmethod
``build_topology``, a coordinator process and Mooncake over TCP between the processes.

What stands in: Ray (test_verl_ray.py runs verl's manager over real Ray; here each worker is
a ``spawn`` process answering commands on a pipe, so the tests can look inside; the
driver's :func:`sync_step` makes the calls of ``CheckpointEngineManager.update_weights``
in the same order: prepare everywhere, build_topology, init_process_group, send and
receive concurrently, finalize), the trainer's model engine (a generator of seeded
HF-named tensors, as ``get_per_tensor_param`` yields), and the rollout server adapter (it
hashes every tensor it is handed, or feeds a real vLLM engine in ``test_verl_vllm.py``).
"""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing as mp
import os
import resource
import socket
import time
import traceback
from typing import Any, Optional

BACKEND = "tensorhub"


def make_weights(seed: int, layers: int = 4) -> dict:
    """HF-named tensors: float32 and bfloat16, an int buffer, one (2 MiB) larger than a 1 MiB
    bucket; 0.5 MiB per layer."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {"model.embed_tokens.weight": torch.randn(512, 1024, generator=g)}  # 2 MiB: oversized
    for i in range(layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = torch.randn(256, 256, generator=g)
        out[p + "mlp.up_proj.weight"] = torch.randn(512, 256, generator=g).to(torch.bfloat16)
        out[p + "input_layernorm.weight"] = torch.randn(256, generator=g)
    out["model.norm.weight"] = torch.randn(256, generator=g)
    out["model.rotary.inv_freq_steps"] = torch.arange(64, dtype=torch.int64) * (seed + 1)
    return out


def tiny_llama(seed: int) -> dict:
    """The tiny Llama of the engine tests (tests/engine/_tiny.py), seeded."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
    from _tiny import make_weights as tiny

    return tiny(seed)


def digest(t: Any) -> str:
    import torch

    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return f"{t.dtype}:{tuple(t.shape)}:" + hashlib.sha256(raw.tobytes()).hexdigest()


def digests(tensors: dict) -> dict:
    return {n: digest(t) for n, t in tensors.items()}


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class _Peak:
    """Samples this process's RSS on a thread (the high-water mark of one call)."""

    def __init__(self) -> None:
        import threading

        self.base = _rss_mb()
        self.peak = self.base
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss_mb())

    def stop(self) -> float:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss_mb())
        return self.peak - self.base


def _load_backend(how: str) -> None:
    """Make verl know the backend as verl would: ``plugins`` (its entry-point discovery on
    ``import verl``) or ``module`` (the config's ``custom_backend_module``, imported by
    ``CheckpointEngineWorker`` itself)."""
    if how == "module":
        os.environ["VERL_USE_EXTERNAL_PLUGINS"] = "none"  # verl's switch: no entry-point discovery
    import verl  # noqa: F401  (discovers the verl.plugins entry points)
    from verl.checkpoint_engine import CheckpointEngineRegistry

    assert (BACKEND in CheckpointEngineRegistry._registry) == (how == "plugins"), \
        sorted(CheckpointEngineRegistry._registry)


def _trainer(conn: Any, rank: int, engine_kwargs: dict, bucket_mb: int, how: str) -> None:
    _load_backend(how)
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs
    from verl.workers.config import CheckpointEngineConfig

    # As verl's engine_workers.ActorRolloutRefWorker builds it (rank 0 is the master).
    cfg = CheckpointEngineConfig(backend=BACKEND, update_weights_bucket_megabytes=bucket_mb,
                                 engine_kwargs={BACKEND: dict(engine_kwargs)},
                                 custom_backend_module="tensorhub.integrations.verl.engine" if how == "module" else None)
    import_external_libs(cfg.custom_backend_module or None)
    engine = CheckpointEngineRegistry.new(cfg.backend, is_master=(rank == 0),
                                          bucket_size=cfg.update_weights_bucket_megabytes << 20,
                                          **cfg.engine_kwargs.get(cfg.backend, {}))

    def send(seed: int, layers: int = 4, global_steps: Optional[int] = None) -> dict:
        w = make_weights(seed, layers) if layers else tiny_llama(seed)
        metrics = asyncio.run(engine.send_weights(iter(list(w.items())), global_steps=global_steps))
        return {"metrics": metrics, "digests": digests(w)}

    _serve(conn, {"engine": lambda m, *a, **k: getattr(engine, m)(*a, **k), "send": send})


class _Hashing:
    """The rollout server adapter's stand-in: a verl ``BaseRollout`` that hashes every
    tensor it is handed (no copy), and samples its process's RSS while it consumes."""

    def __init__(self, config: Any, model_config: Any) -> None:
        from verl.workers.rollout import BaseRollout

        class Adapter(BaseRollout):
            async def resume(self, tags):  # pragma: no cover - not called
                pass

            async def release(self):  # pragma: no cover - not called
                pass

            async def update_weights(self_, weights, **kwargs):
                self_.got = {}
                self_.kwargs = kwargs
                async for name, t in weights:
                    assert name not in self_.got, f"{name} handed twice"
                    self_.got[name] = digest(t)

        self.adapter = Adapter(config, model_config, None)


def _rollout(conn: Any, rank: int, engine_kwargs: dict, bucket_mb: int, how: str, model_dir: str) -> None:
    os.environ.update(WORLD_SIZE="1", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    _load_backend(how)
    from verl.checkpoint_engine import CheckpointEngineWorker
    from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig

    ce = CheckpointEngineConfig(backend=BACKEND, update_weights_bucket_megabytes=bucket_mb,
                                engine_kwargs={BACKEND: dict(engine_kwargs)},
                                custom_backend_module="tensorhub.integrations.verl.engine" if how == "module" else None)
    rc = RolloutConfig(name="vllm", checkpoint_engine=ce)
    mc = HFModelConfig(path=model_dir, load_tokenizer=False)
    adapter = _Hashing(rc, mc).adapter
    worker = CheckpointEngineWorker(rc, mc, server_adapter=adapter)  # verl's own: builds the backend

    def update(global_steps: Optional[int] = None) -> dict:
        peak = _Peak()
        asyncio.run(worker.update_weights(global_steps=global_steps))
        grew = peak.stop()
        st = worker.checkpoint_engine.receiver.stats
        return {"digests": adapter.got, "rss_growth_mb": grew, "wire_format": adapter.kwargs.get("wire_format"),
                "stats": {k: getattr(st, k) for k in ("version", "source", "buckets", "nbytes", "largest_bucket",
                                                      "buffer_bytes", "oversized", "sources")}}

    def get_weights() -> dict:
        async def run() -> dict:
            return {n: digest(t) async for n, t in worker.checkpoint_engine.get_weights()}

        return asyncio.run(run())

    def generate(newer_than: int, max_seconds: float) -> dict:
        """Rollouts running: busy on this thread until the prefetched copy is newer than
        ``newer_than`` (or ``max_seconds`` passed); returns the versions it saw meanwhile."""
        c = worker.checkpoint_engine.receiver.cache
        t0 = time.monotonic()
        seen = []
        n = 0
        while time.monotonic() - t0 < max_seconds:
            n += sum(i * i for i in range(2000))
            if c.version not in seen:
                seen.append(c.version)
            if c.version is not None and c.version > newer_than:
                break
        return {"versions_seen": seen, "seconds": time.monotonic() - t0}

    def cached() -> Optional[int]:
        return worker.checkpoint_engine.receiver.cache.version

    def layouts(version: int) -> dict:
        info = worker.checkpoint_engine.hub.version_info(worker.checkpoint_engine.settings.model, version)
        return {k: (li.num_shards, li.complete) for k, li in info.layouts.items()}

    _serve(conn, {"engine": lambda m, *a, **k: worker.execute_checkpoint_engine(m, *a, **k),
                  "update": update, "get_weights": get_weights, "generate": generate, "cached": cached,
                  "layouts": layouts})


class _VllmAdapter:
    """The rollout server adapter's stand-in for vLLM: a verl ``BaseRollout`` that, like verl's
    vLLM ``ServerAdapter`` + ``BucketedWeightSender``, copies what it is handed into buckets of
    ``bucket_size`` and hands each bucket to the engine's workers (here ``collective_rpc`` to an
    in-process ``vllm.LLM``, where verl uses ZMQ + CUDA IPC / shared memory)."""

    def __init__(self, config: Any, model_config: Any, llm: Any, bucket_size: int) -> None:
        from verl.workers.rollout import BaseRollout

        class Adapter(BaseRollout):
            async def resume(self, tags):  # pragma: no cover - not called
                pass

            async def release(self):  # pragma: no cover - not called
                pass

            async def update_weights(self_, weights, **kwargs):
                import torch

                self_.got, self_.buckets = {}, 0
                buf = torch.empty(bucket_size, dtype=torch.uint8)
                bucket, off = [], 0

                def flush() -> None:
                    llm.collective_rpc("verl_load", args=(bucket,))
                    self_.buckets += 1

                llm.collective_rpc("verl_begin")
                async for name, t in weights:
                    self_.got[name] = digest(t)
                    n = t.numel() * t.element_size()
                    off = -(-off // 64) * 64
                    if bucket and off + n > bucket_size:
                        flush()
                        buf = torch.empty(bucket_size, dtype=torch.uint8)  # the engine may keep views
                        bucket, off = [], 0
                    view = buf[off:off + n].view(t.dtype).view(t.shape)
                    view.copy_(t)
                    bucket.append((name, view))
                    off += n
                if bucket:
                    flush()
                llm.collective_rpc("verl_end")

        self.adapter = Adapter(config, model_config, None)


def _rollout_vllm(conn: Any, engine_kwargs: dict, bucket_mb: int, model_dir: str) -> None:
    os.environ.update(WORLD_SIZE="1", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                      VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    _load_backend("plugins")
    from vllm import LLM, SamplingParams

    from verl.checkpoint_engine import CheckpointEngineWorker
    from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig

    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=128,
              worker_extension_cls="_verl_vllm_ext.LoadBuckets")
    ce = CheckpointEngineConfig(backend=BACKEND, update_weights_bucket_megabytes=bucket_mb,
                                engine_kwargs={BACKEND: dict(engine_kwargs)})
    rc = RolloutConfig(name="vllm", checkpoint_engine=ce)
    mc = HFModelConfig(path=model_dir, load_tokenizer=False)
    adapter = _VllmAdapter(rc, mc, llm, bucket_mb << 20).adapter
    worker = CheckpointEngineWorker(rc, mc, server_adapter=adapter)

    def update(global_steps: Optional[int] = None) -> dict:
        asyncio.run(worker.update_weights(global_steps=global_steps))
        return {"digests": adapter.got, "adapter_buckets": adapter.buckets,
                "stats": {"version": worker.checkpoint_engine.receiver.stats.version,
                          "buckets": worker.checkpoint_engine.receiver.stats.buckets}}

    def generate(prompts: list) -> list:
        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]

    _serve(conn, {"engine": lambda m, *a, **k: worker.execute_checkpoint_engine(m, *a, **k),
                  "update": update, "generate": generate})


def rollout_vllm(engine_kwargs: dict, model_dir: str, bucket_mb: int = 1) -> "Proc":
    return Proc(_rollout_vllm, engine_kwargs, bucket_mb, model_dir)


def _serve(conn: Any, handlers: dict) -> None:
    conn.send(("ready", None))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        cmd, args, kw = msg
        try:
            conn.send(("ok", handlers[cmd](*args, **kw)))
        except BaseException as e:  # sent back: the test checks what the user would see
            conn.send(("err", (type(e).__name__, str(e), traceback.format_exc())))
    for h in ("engine",):
        try:
            handlers[h]("close")
        except Exception:
            pass


class RemoteError(Exception):
    def __init__(self, kind: str, message: str, tb: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind, self.message, self.tb = kind, message, tb


class Proc:
    """One worker process; ``call`` runs a command there, ``start``/``result`` split it."""

    def __init__(self, target: Any, *args: Any) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.p = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.p.start()
        self._ready = False

    def ready(self, timeout: float = 180) -> "Proc":
        if not self._ready:
            if not self.conn.poll(timeout):
                raise TimeoutError("worker did not start")
            self.conn.recv()
            self._ready = True
        return self

    def start(self, cmd: str, *args: Any, **kw: Any) -> None:
        self.ready()
        self.conn.send((cmd, args, kw))

    def result(self, timeout: float = 300) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError("worker did not answer")
        status, value = self.conn.recv()
        if status == "err":
            raise RemoteError(*value)
        return value

    def call(self, cmd: str, *args: Any, timeout: float = 300, **kw: Any) -> Any:
        self.start(cmd, *args, **kw)
        return self.result(timeout)

    def close(self) -> None:
        try:
            self.conn.send(None)
        except Exception:
            pass
        self.p.join(20)
        if self.p.is_alive():
            self.p.kill()
            self.p.join(5)


def trainer(rank: int, engine_kwargs: dict, bucket_mb: int = 1, how: str = "plugins") -> Proc:
    return Proc(_trainer, rank, engine_kwargs, bucket_mb, how)


def rollout(rank: int, engine_kwargs: dict, model_dir: str, bucket_mb: int = 1, how: str = "plugins") -> Proc:
    return Proc(_rollout, rank, engine_kwargs, bucket_mb, how, model_dir)


def sync_step(trainers: list, rollouts: list, seed: int, global_steps: int, layers: int = 4) -> dict:
    """One ``CheckpointEngineManager.update_weights`` (steps 4-6), Ray standing aside: every
    worker's ``prepare``, the backend's own ``build_topology``, ``init_process_group``, then
    ``send_weights`` on the trainer ranks and ``update_weights`` (receive_weights into the
    server adapter) on the rollout workers concurrently, then ``finalize`` everywhere."""
    from verl.checkpoint_engine import CheckpointEngineRegistry

    cls = CheckpointEngineRegistry.get(BACKEND)
    meta = [w.call("engine", "prepare") for w in trainers + rollouts]
    actor_kw, rollout_kw = cls.build_topology(len(trainers), len(rollouts), meta)
    for group, kw in ((trainers, actor_kw), (rollouts, rollout_kw)):
        for i, w in enumerate(group):
            w.call("engine", "init_process_group", **{k: v[i] for k, v in kw.items()})
    for t in trainers:
        t.start("send", seed, layers, global_steps=global_steps)
    for r in rollouts:
        r.start("update", global_steps=global_steps)
    sent = [t.result() for t in trainers]
    got = [r.result() for r in rollouts]
    for w in trainers + rollouts:
        w.call("engine", "finalize")
    return {"sent": sent, "got": got, "version": actor_kw["version"][0], "meta": meta}
