"""FSDP2 trainer ranks for tests and benchmarks: a real ``torch.distributed`` gloo group on
CPU, each rank's model sharded with ``fully_shard``, publishing its shards in place.

:class:`ShardedTrainer` spawns ``world`` ranks (``torch.multiprocessing``, spawn) and
drives them by command; each rank answers on a queue. A rank's model is built from a seed
(every rank the same), so the parent can build the same full tensors to compare with:
:func:`build_model` with ``state_dict()``; or ask rank 0 for ``full`` (a gather, made only
for the comparison).
"""

from __future__ import annotations

import os
import traceback
from typing import Any, Optional

__all__ = ["ShardedTrainer", "build_model", "tiny_llama"]


def build_model(seed: int, kind: str = "mlp") -> Any:
    """The model every rank builds (same seed, same weights): ``mlp`` has uneven FSDP shards
    for 4 ranks (10 and 7 rows); ``llama`` is the engine tests' tiny Llama (HF names)."""
    import torch

    torch.manual_seed(seed)
    if kind == "llama":
        return tiny_llama(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 10), torch.nn.ReLU(), torch.nn.Linear(10, 7),
                               torch.nn.Linear(7, 2048, bias=False))


def tiny_llama(seed: int) -> Any:
    """The engine tests' tiny Llama (``tests/engine/_tiny.py`` config), weights seeded as there."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
               rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1,
               eos_token_id=2, pad_token_id=3, hidden_act="silu")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return model


def _rank_main(rank: int, world: int, init: str, url: str, kind: str, seed: int, cmds: Any, answers: Any,
               die_before_publish: int) -> None:
    os.environ.setdefault("GLOG_minloglevel", "2")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # ``collect``'s timeout: where each thread waits
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        import tensorhub

        model = build_model(seed, kind)
        mesh = init_device_mesh("cpu", (world,))
        for m in list(model.modules())[1:]:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        hub = tensorhub.connect(url, worker_id=f"trainer-{rank}")
        held: list[tuple[int, dict]] = []
        answers.put(("ready", rank, None))
        while True:
            cmd, arg = cmds[rank].get()
            try:
                if cmd == "quit":
                    break
                if cmd == "full":  # every rank takes part in the gather; rank 0 answers
                    full = {n: p.full_tensor().clone() for n, p in model.state_dict().items()}
                    answers.put(("full", rank, full if rank == 0 else None))
                elif cmd == "publish":  # arg: the key every rank passes, or (key, the rank that dies first)
                    key, dies = (arg, die_before_publish) if isinstance(arg, str) else arg
                    if rank == dies:
                        os._exit(3)  # before registering anything of this version
                    snap = {n: p.detach().clone() for n, p in model.state_dict().items()}  # this rank's shards
                    v = hub.publish("policy", snap, key=key)
                    held.append((v, snap))
                    answers.put(("published", rank, v))
                elif cmd == "step":  # one SGD step (changes every parameter), arg: the lr
                    with torch.no_grad():
                        for p in model.parameters():
                            p.add_(torch.ones_like(p) * arg)
                    answers.put(("stepped", rank, None))
                elif cmd == "unpublish":
                    hub.unpublish("policy", arg, timeout=60)
                    held[:] = [(v, s) for v, s in held if v != arg]
                    answers.put(("unpublished", rank, arg))
                elif cmd == "shards":  # this rank's local shard shapes (uneven shards check)
                    answers.put(("shards", rank, {n: tuple(p.to_local().shape)
                                                  for n, p in model.state_dict().items()}))
                else:
                    answers.put(("error", rank, f"unknown command {cmd!r}"))
            except BaseException:
                answers.put(("error", rank, traceback.format_exc()))
        hub.close()
    finally:
        dist.destroy_process_group()


class ShardedTrainer:
    """``world`` FSDP2 ranks publishing to ``url`` (see the module docstring). ``kill``-free
    by default; ``die_before_publish=r`` makes rank ``r`` exit at its first publish."""

    def __init__(self, url: str, world: int, init_file: str, *, kind: str = "mlp", seed: int = 0,
                 die_before_publish: int = -1) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.world = world
        self.cmds = [ctx.Queue() for _ in range(world)]
        self.answers = ctx.Queue()
        self.ctx = mp.start_processes(_rank_main, args=(world, f"file://{init_file}", url, kind, seed, self.cmds,
                                                        self.answers, die_before_publish),
                                      nprocs=world, join=False, start_method="spawn")
        self.collect("ready", range(world), timeout=180)

    def collect(self, what: str, ranks: Any, timeout: float = 120) -> dict[int, Any]:
        import queue

        import time

        want, got = set(ranks), {}
        deadline = time.monotonic() + timeout
        while want - set(got):
            try:
                kind, rank, val = self.answers.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r in want - set(got) if not self.ctx.processes[r].is_alive()]
                if dead:
                    raise RuntimeError(f"ranks {dead} exited (codes {[self.ctx.processes[r].exitcode for r in dead]}) "
                                       f"before answering {what!r}") from None
                if time.monotonic() > deadline:
                    import signal

                    stuck = sorted(want - set(got))
                    for r in stuck:  # their threads' stacks to stderr (the test's captured output)
                        pid = self.ctx.processes[r].pid
                        if pid is not None:
                            try:
                                os.kill(pid, signal.SIGUSR1)
                            except ProcessLookupError:
                                pass
                    time.sleep(1.0)
                    raise TimeoutError(f"ranks {stuck} did not answer {what!r} in {timeout}s (their stacks: "
                                       "stderr)") from None
                continue
            if kind == "error":
                raise RuntimeError(f"rank {rank}: {val}")
            if kind == what:
                got[rank] = val
        return got

    def all(self, cmd: str, arg: Any = None, answer: Optional[str] = None, ranks: Any = None,
            timeout: float = 120) -> dict[int, Any]:
        ranks = list(range(self.world)) if ranks is None else list(ranks)
        for r in ranks:
            self.cmds[r].put((cmd, arg))
        return self.collect(answer or cmd, ranks, timeout)

    def full(self) -> dict:
        return self.all("full")[0]

    def alive(self) -> list[bool]:
        return [p.is_alive() for p in self.ctx.processes]

    def close(self) -> None:
        for r, p in enumerate(self.ctx.processes):
            if p.is_alive():
                self.cmds[r].put(("quit", None))
        for p in self.ctx.processes:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)


