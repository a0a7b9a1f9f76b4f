"""Follow mode: keep a vLLM server on the newest version of a model.

``python -m integrations.vllm.follow --engine http://HOST:PORT --model NAME [--mode
abort|wait|keep]`` (meant to back ``tensorhub follow``) watches the coordinator and, for
each new complete version, drives the server's dev-mode endpoints: ``/pause?mode=``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``, ``/resume``.
It prints one line per swap: the version, the stall (pause to resume), the bytes and the
replicas that held the version; a swap longer than a second draws a progress line on a
terminal (stderr) from the coordinator's live table of running fetches: bytes, GB/s and
sources of the engine's fetch. A failed swap is printed, the engine resumed on its old
version, and following goes on. The server must run with ``VLLM_SERVER_DEV_MODE=1`` and
``--weight-transfer-config '{"backend": "tensorhub"}'``.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

__all__ = ["main", "swap", "follow", "parser"]


def _post(client, path: str, **kw) -> None:
    r = client.post(path, **kw)
    if r.status_code >= 400:
        raise RuntimeError(f"{path} answered {r.status_code}: {r.text[:500]}")


def engine_version(client) -> Optional[int]:
    v = client.get("/weight_info").json().get("weight_version")
    return int(v) if v is not None and str(v).isdigit() else None


def swap(client, version: int, mode: str, on_wait: Optional[Callable[[float], None]] = None) -> float:
    """One swap through the engine's endpoints; returns the stall in seconds. On a failed
    update the engine is resumed on its old weights and the error re-raised.
    ``on_wait(stall so far)`` is called about once a second while ``/update_weights`` runs."""
    t0 = time.monotonic()
    _post(client, "/pause", params={"mode": mode})
    try:
        _post(client, "/start_weight_update")
        update = lambda: _post(client, "/update_weights", json={"update_info": {"version": version}})  # noqa: E731
        if on_wait is None:
            update()
        else:
            _watching(update, lambda: on_wait(time.monotonic() - t0))
        _post(client, "/finish_weight_update", json={"weight_version": str(version)})
    finally:
        _post(client, "/resume")
    return time.monotonic() - t0


def _watching(fn: Callable[[], None], tick: Callable[[], None], every: float = 1.0) -> None:
    """Run ``fn`` on a thread, calling ``tick`` every ``every`` seconds until it returns;
    re-raise what it raised."""
    err: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # handed to the caller
            err.append(e)

    t = threading.Thread(target=run, name="tensorhub-follow-update", daemon=True)
    t.start()
    while True:
        t.join(every)
        if not t.is_alive():
            break
        try:
            tick()
        except Exception:  # progress never breaks the swap
            pass
    if err:
        raise err[0]


def progress_text(status: dict, model: str, version: int, stall: float) -> str:
    """The follow progress line from the coordinator's running fetches of ``model`` v``version``
    (the engine's fetch; several engines' fetches are summed)."""
    import tensorhub

    running = [f for f in status.get("fetches", []) if f["model"] == model and f["version"] == version]
    if not running:
        return f"v{version}: swapping, stall {stall:.1f}s"
    sources: dict[str, int] = {}
    for f in running:
        for w, n in f["sources"].items():
            sources[w] = sources.get(w, 0) + n
    p = tensorhub.FetchProgress(model, version, running[0]["layout"], running[0]["shard"],
                                sum(f["nbytes"] for f in running), sum(f["total"] for f in running),
                                max(f["seconds"] for f in running), sources,
                                sum(f["failed_sources"] for f in running))
    who = ", ".join(sorted(f["worker_id"] for f in running))
    return f"swap {p.line()} (reader {who}; stall {stall:.1f}s)"


def _holders(hub, model: str, version: int) -> tuple[int, list[str]]:
    st = hub.api.get("/v1/status")
    for m in st["models"]:
        if m["model"] == model:
            for v in m["versions"]:
                if v["version"] == version:
                    nbytes = v["layouts"].get("hf", {}).get("nbytes", 0)
                    return nbytes, sorted({r["worker_id"] for r in v["replicas"]})
    return 0, []


def parser(engine_help: str, modes: Sequence[str], doc: str) -> argparse.ArgumentParser:
    """The follow options, the same for every engine (``doc``: the engine module's docstring)."""
    p = argparse.ArgumentParser(prog="tensorhub follow", description=doc.split("\n\n")[0])
    p.add_argument("--engine", required=True, help=engine_help)
    p.add_argument("--model", required=True, help="model name on the coordinator")
    p.add_argument("--mode", choices=tuple(modes), default=modes[0],
                   help=f"what pausing does with in-flight requests (default {modes[0]})")
    p.add_argument("--coordinator", help="coordinator URL (default: $TENSORHUB_COORDINATOR)")
    p.add_argument("--token-file", help="file holding the API token (default: $TENSORHUB_TOKEN)")
    p.add_argument("--max-swaps", type=int, default=0, help="stop after this many swaps (0: never)")
    return p


def follow(args: argparse.Namespace, base_url: str, banner: Callable[[Any], tuple[Optional[int], str]],
           do_swap: Callable[[Any, int, Callable[[float], None]], float]) -> int:
    """The follow loop shared by the engine adapters: connect, then for each newer complete
    version ``do_swap(client, version, show)`` (``show(stall)`` draws the progress line),
    print one line per swap, and keep going after a failed one. ``banner(client)`` returns
    the engine's version and the first line to print."""
    import httpx

    import tensorhub
    from tensorhub.cli import ProgressLine

    token = Path(args.token_file).read_text().strip() if args.token_file else None
    try:
        hub = tensorhub.connect(args.coordinator, token=token)
    except tensorhub.TensorHubError as e:
        print(f"tensorhub follow: {e}", file=sys.stderr)
        return 2
    swaps = 0
    line = ProgressLine(sys.stderr)
    with hub, httpx.Client(base_url=base_url, timeout=600) as client:
        current, first = banner(client)
        print(first, flush=True)
        while not args.max_swaps or swaps < args.max_swaps:
            try:
                v = hub.wait_for_version(args.model, newer_than=current, timeout=60)
            except tensorhub.HubTimeoutError:
                continue
            except KeyboardInterrupt:
                return 130
            nbytes, holders = _holders(hub, args.model, v)

            def show(stall: float, v: int = v) -> None:
                line.draw(progress_text(hub.api.get("/v1/status", retry_timeout=1.0), args.model, v, stall))

            try:
                stall = do_swap(client, v, show)
            except RuntimeError as e:
                line.done()
                print(f"v{v}: swap failed, engine kept v{current}: {e}", file=sys.stderr, flush=True)
                time.sleep(1)
                continue
            line.done()
            swaps += 1
            current = v
            print(f"v{v}: stall {stall:.3f}s, {nbytes / 1e6:.1f} MB from holders {', '.join(holders)}",
                  flush=True)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser("vLLM server URL, e.g. http://127.0.0.1:8000", ("abort", "wait", "keep"), __doc__).parse_args(argv)

    def banner(client: Any) -> tuple[Optional[int], str]:
        current = engine_version(client)
        return current, f"following {args.model} for {args.engine} (engine at v{current})"

    return follow(args, args.engine.rstrip("/"), banner,
                  lambda client, v, show: swap(client, v, args.mode, on_wait=show))


if __name__ == "__main__":
    sys.exit(main())
