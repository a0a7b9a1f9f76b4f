"""Follow mode: keep a vLLM server on the newest version of a model.

``tensorhub follow --engine http://HOST:PORT --model NAME [--mode abort|wait|keep]`` (or
``python -m tensorhub.integrations.vllm.follow ...``; the loop is ``tensorhub.follow``'s) watches the coordinator and, for
each new complete version, drives the server's dev-mode endpoints: ``/pause?mode=``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``, ``/resume``.
It prints one line per swap: the version, the stall (pause to resume), the bytes and the
replicas that held the version; a swap longer than a second draws a progress line on a
terminal (stderr) from the coordinator's live table of running fetches: bytes, GB/s and
sources of the engine's fetch. A failed swap is printed, the engine resumed on its old
version, and following goes on. The server must run with ``VLLM_SERVER_DEV_MODE=1`` and
``--weight-transfer-config '{"backend": "tensorhub"}'``.

``--lora K`` (LoRA adapter versions, :mod:`.lora`): each new version is loaded with
``POST /v1/load_lora_adapter`` (name ``<model>@v<N>``, path ``tensorhub://<model>/<N>``)
and the ones older than the newest K are dropped with ``/v1/unload_lora_adapter``: vLLM's
server then takes no new request for that name, and requests already running with it
finish with it (their LoRA request travels with them; the worker keeps the adapter in its
LoRA cache and, had it evicted it, reads it again from peers). The server must run with
``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``; no dev mode, no pause.

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

from tensorhub.follow import Driver, LoraOps, run

from .lora import lora_name, lora_path

__all__ = ["DRIVER", "main", "swap", "engine_version", "engine_workers", "LORA"]


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


def _lora_load(client, model: str, version: int) -> None:
    _post(client, "/v1/load_lora_adapter", json={"lora_name": lora_name(model, version),
                                                 "lora_path": lora_path(model, version)})


def _lora_unload(client, model: str, version: int) -> None:
    _post(client, "/v1/unload_lora_adapter", json={"lora_name": lora_name(model, version)})


def _lora_loaded(client, model: str) -> list:
    """Versions of ``model`` the server has loaded as ``<model>@v<N>`` (``/v1/models``)."""
    r = client.get("/v1/models")
    if r.status_code >= 400:
        raise RuntimeError(f"/v1/models answered {r.status_code}: {r.text[:300]}")
    prefix = f"{model}@v"
    ids = [m.get("id", "") for m in r.json().get("data", [])]
    return sorted(int(i[len(prefix):]) for i in ids if i.startswith(prefix) and i[len(prefix):].isdigit())


#: vLLM's LoRA API for ``tensorhub follow --lora K``.
LORA = LoraOps(_lora_load, _lora_unload, _lora_loaded)


def _banner(client: Any, args: argparse.Namespace) -> tuple[Optional[int], str]:
    current = engine_version(client)
    return current, f"following {args.model} for {args.engine} (engine at v{current})"


#: The ``tensorhub follow`` driver (entry point ``tensorhub.engines: vllm``).
DRIVER = Driver("vllm", "", "vLLM server URL, e.g. http://127.0.0.1:8000", ("abort", "wait", "keep"), __doc__,
                _banner, lambda client, v, args, show: swap(client, v, args.mode, on_wait=show), engine_workers,
                LORA)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run(DRIVER, argv)


if __name__ == "__main__":
    sys.exit(main())
