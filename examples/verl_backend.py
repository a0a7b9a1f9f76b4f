"""verl with TensorHub as its checkpoint engine: ``checkpoint_engine.backend=tensorhub``.

The part of a verl PPO config that turns it on (``actor_rollout_ref.rollout.checkpoint_engine``)
is :data:`CONFIG` below, parsed with verl's own ``omega_conf_to_dataclass`` into its
``CheckpointEngineConfig``. On the command line of ``verl.trainer.main_ppo`` the same is::

    actor_rollout_ref.rollout.checkpoint_engine.backend=tensorhub \\
    actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=64 \\
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.tensorhub.coordinator=http://coord:7777

What runs here, on one machine: a coordinator (embedded), one trainer process and two
rollout processes, each building the backend as verl does (``CheckpointEngineRegistry.new``
on the trainer with ``is_master``; verl's own ``CheckpointEngineWorker`` on the rollouts),
and this script as the driver, making the calls of verl's
``CheckpointEngineManager.update_weights`` for three sync steps: ``prepare`` everywhere,
``build_topology``, ``init_process_group``, ``send_weights`` and ``receive_weights``
together, ``finalize``. Ray and the model engines stand aside: the trainer publishes
seeded tensors (as ``get_per_tensor_param`` yields them) and the rollouts' server adapter
checks every tensor it is handed against the trainer's sha256. Ends with
``all bytes verified`` and exit 0, or exits 1.

    python examples/verl_backend.py [--mib 16] [--json out/verl_backend.json]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time

# What a user writes in the verl config (here a dict; in verl a YAML section or overrides).
CONFIG = {
    "_target_": "verl.workers.config.CheckpointEngineConfig",
    "backend": "tensorhub",
    "update_weights_bucket_megabytes": 1,  # rollouts stream each version in 1 MiB buckets
    "engine_kwargs": {"tensorhub": {"coordinator": None, "model": "policy"}},  # coordinator: set below
    # Not needed once tensorhub is installed (its verl.plugins entry point registers the backend
    # on `import verl`); named so the example also runs from a source checkout.
    "custom_backend_module": "tensorhub.integrations.verl.engine",
}


def weights(seed: int, mib: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    n = max(1, mib * 2)  # 0.5 MiB per layer
    out = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(512, 256, generator=g) for i in range(n)}
    out["model.norm.weight"] = torch.randn(256, generator=g)
    return out


def sha(t) -> str:
    import torch

    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def checkpoint_engine_config(url: str):
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    cfg = OmegaConf.create(CONFIG)
    cfg.engine_kwargs.tensorhub.coordinator = url
    return omega_conf_to_dataclass(cfg)


# ------------------------------------------------------------------ workers (child processes)
def trainer(conn, url: str, mib: int) -> None:
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    ce = checkpoint_engine_config(url)
    import_external_libs(ce.custom_backend_module)  # as verl's actor worker does
    engine = CheckpointEngineRegistry.new(ce.backend, is_master=True, bucket_size=ce.update_weights_bucket_megabytes << 20,
                                          **ce.engine_kwargs.get(ce.backend, {}))
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        op, arg = msg
        if op == "send":
            w = weights(arg, mib)
            metrics = asyncio.run(engine.send_weights(iter(w.items()), global_steps=arg))
            conn.send({"metrics": metrics, "sha": {n: sha(t) for n, t in w.items()}})
        else:
            conn.send(getattr(engine, op)(**arg))
    engine.close()


def rollout(conn, url: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(WORLD_SIZE="1", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from verl.checkpoint_engine import CheckpointEngineWorker
    from verl.workers.config import HFModelConfig, RolloutConfig
    from verl.workers.rollout import BaseRollout

    class Checking(BaseRollout):  # the server adapter: where vLLM / SGLang would load the tensors
        async def resume(self, tags):
            pass

        async def release(self):
            pass

        async def update_weights(self, weights, **kwargs):
            self.got = {}
            async for name, t in weights:
                self.got[name] = sha(t)

    model_dir = tempfile.mkdtemp()
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 512,
                   "hidden_size": 256, "num_hidden_layers": 1, "num_attention_heads": 4,
                   "intermediate_size": 512}, f)
    rc = RolloutConfig(name="vllm", checkpoint_engine=checkpoint_engine_config(url))
    mc = HFModelConfig(path=model_dir, load_tokenizer=False)
    adapter = Checking(rc, mc, None)
    worker = CheckpointEngineWorker(rc, mc, server_adapter=adapter)  # verl's: builds the backend from rc
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        op, arg = msg
        if op == "update":
            asyncio.run(worker.update_weights(global_steps=arg))
            st = worker.checkpoint_engine.receiver.stats
            conn.send({"sha": adapter.got, "buckets": st.buckets, "largest_bucket": st.largest_bucket,
                       "sources": st.sources, "seconds": st.seconds})
        else:
            conn.send(worker.execute_checkpoint_engine(op, **arg))
    worker.checkpoint_engine.close()


# ------------------------------------------------------------------ driver
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=16, help="model size in MiB (default 16)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()

    from tensorhub.coordinator import EmbeddedCoordinator

    ctx = mp.get_context("spawn")
    with EmbeddedCoordinator(tempfile.mkdtemp()) as coord:
        procs = []
        for target, a in ((trainer, (coord.url, args.mib)), (rollout, (coord.url,)), (rollout, (coord.url,))):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=target, args=(child, *a), daemon=True)
            p.start()
            procs.append((p, parent))
        conns = [c for _, c in procs]
        for c in conns:
            assert c.recv() == "ready"
        t, rollouts = conns[0], conns[1:]

        import tensorhub.integrations.verl.engine  # noqa: F401  (the driver's import, as CheckpointEngineManager's)
        from verl.checkpoint_engine import CheckpointEngineRegistry

        backend = CheckpointEngineRegistry.get(CONFIG["backend"])
        results, ok = [], True
        for step in range(1, args.steps + 1):
            t0 = time.monotonic()
            meta = []
            for c in conns:
                c.send(("prepare", {}))
                meta.append(c.recv())
            actor_kw, rollout_kw = backend.build_topology(1, len(rollouts), meta)
            for c, kw in [(t, actor_kw)] + [(r, rollout_kw) for r in rollouts]:
                i = 0 if c is t else rollouts.index(c)
                c.send(("init_process_group", {k: v[i] for k, v in kw.items()}))
                c.recv()
            t.send(("send", step))
            for r in rollouts:
                r.send(("update", step))
            sent = t.recv()
            got = [r.recv() for r in rollouts]
            for c in conns:
                c.send(("finalize", {}))
                c.recv()
            v = actor_kw["version"][0]
            step_ok = all(g["sha"] == sent["sha"] for g in got)
            ok &= step_ok
            mb = sent["metrics"]["tensorhub/bytes"] / 2**20
            print(f"step {step}: trainer published policy v{v} ({mb:.1f} MiB, {len(sent['sha'])} tensors) in "
                  f"{sent['metrics']['tensorhub/publish_s'] + sent['metrics']['tensorhub/snapshot_s']:.2f}s; "
                  + "; ".join(f"rollout {i} got it in {g['buckets']} buckets of <= "
                              f"{CONFIG['update_weights_bucket_megabytes']} MiB in {g['seconds']:.2f}s, "
                              f"{'bytes ok' if g['sha'] == sent['sha'] else 'BYTES DIFFER'}"
                              for i, g in enumerate(got))
                  + f" (step {time.monotonic() - t0:.2f}s)")
            results.append({"step": step, "version": v, "bytes_ok": step_ok, "mib": mb,
                            "rollouts": [{k: g[k] for k in ("buckets", "largest_bucket", "sources", "seconds")}
                                         for g in got]})
        for p, c in procs:
            c.send(None)
            p.join(30)
    print("all bytes verified" if ok else "BYTE MISMATCH")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"all_bytes_ok": ok, "steps": results, "config": CONFIG}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
