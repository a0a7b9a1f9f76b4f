"""Follow mode: keep a vLLM server on the newest version of a model.

``tensorhub follow --engine http://HOST:PORT --model NAME [--mode abort|wait|keep]`` (or
``python -m integrations.vllm.follow ...``; the loop is ``tensorhub.follow``'s) watches the coordinator and, for
each new complete version, drives the server's dev-mode endpoints: ``/pause?mode=``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``, ``/resume``.
It prints one line per swap: the version, the stall (pause to resume), the bytes and the
replicas that held the version; a swap longer than a second draws a progress line on a
terminal (stderr) from the coordinator's live table of running fetches: bytes, GB/s and
sources of the engine's fetch. A failed swap is printed, the engine resumed on its old
version, and following goes on. The server must run with ``VLLM_SERVER_DEV_MODE=1`` and
``--weight-transfer-config '{"backend": "tensorhub"}'``.

At start it asks the engine for its TensorHub workers (dev route ``/collective_rpc``, method
``weight_transfer_engine``: each worker's id, model and whether it prefetches); with
``prefetch`` on (the default) each swap first waits until the engine holds the new
version, so the pause covers only the apply. ``--engine-worker ID`` names the worker instead.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import Any, Callable, Optional, Sequence

from tensorhub.follow import Driver, run

__all__ = ["DRIVER", "main", "swap", "engine_version", "engine_workers"]


def _post(client, path: str, **kw) -> None:
    r = client.post(path, **kw)
    if r.status_code >= 400:
        raise RuntimeError(f"{path} answered {r.status_code}: {r.text[:500]}")


def engine_version(client) -> Optional[int]:
    v = client.get("/weight_info").json().get("weight_version")
    return int(v) if v is not None and str(v).isdigit() else None


def engine_workers(client) -> list:
    """Each worker's TensorHub identity (``worker_id``, ``model``, ``version``, ``serving``,
    ``prefetch``), asked through vLLM's dev route: ``collective_rpc`` calls the worker's
    ``weight_transfer_engine`` (the tensorhub backend's engine is callable for this)."""
    r = client.post("/collective_rpc", json={"method": "weight_transfer_engine", "timeout": 30})
    if r.status_code >= 400:
        raise RuntimeError(f"/collective_rpc answered {r.status_code}: {r.text[:300]}")
    return list(r.json().get("results") or [])


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


def _banner(client: Any, args: argparse.Namespace) -> tuple[Optional[int], str]:
    current = engine_version(client)
    return current, f"following {args.model} for {args.engine} (engine at v{current})"


#: The ``tensorhub follow`` driver (entry point ``tensorhub.engines: vllm``).
DRIVER = Driver("vllm", "", "vLLM server URL, e.g. http://127.0.0.1:8000", ("abort", "wait", "keep"), __doc__,
                _banner, lambda client, v, args, show: swap(client, v, args.mode, on_wait=show), engine_workers)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run(DRIVER, argv)


if __name__ == "__main__":
    sys.exit(main())
