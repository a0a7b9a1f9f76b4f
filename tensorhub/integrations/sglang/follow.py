"""Follow mode: keep an SGLang server on the newest version of a model.

``tensorhub follow --engine sglang+http://HOST:PORT --model NAME [--mode abort|retract|in_place]``
watches the coordinator and, for each new complete version, drives SGLang's endpoints:
``/pause_generation``, ``/begin_weight_update``, ``/update_weights_from_tensor`` (with
``load_format`` = :data:`tensorhub.integrations.sglang.pull.LOAD_FORMAT` and the version as the
payload, one entry per TP rank), ``/end_weight_update``, ``/continue_generation``. It
prints one line per swap (the version, the stall, the bytes and the holders), like the
vLLM follow mode. A failed swap is printed, the engine continued on its old version, and
following goes on. The server must run with ``--custom-weight-loader
tensorhub.integrations.sglang.pull.pull``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Optional, Sequence

from tensorhub.follow import Driver, run

__all__ = ["DRIVER", "main", "swap", "engine_version"]

PREFIX = "sglang+"


def _post(client, path: str, body: Optional[dict] = None) -> dict:
    r = client.post(path, json=body if body is not None else {})
    if r.status_code >= 400:
        raise RuntimeError(f"{path} answered {r.status_code}: {r.text[:500]}")
    try:
        out = r.json()
    except ValueError:
        return {}
    if isinstance(out, dict) and out.get("success") is False:
        raise RuntimeError(f"{path}: {out.get('message')}")
    return out if isinstance(out, dict) else {}


def engine_version(client) -> Optional[int]:
    v = client.get("/model_info").json().get("weight_version")
    return int(v) if v is not None and str(v).isdigit() else None


def tp_size(client) -> int:
    info = client.get("/server_info").json()
    return int(info.get("tp_size") or 1)


def swap(client, version: int, mode: str, tp: int) -> float:
    """One swap through the server's endpoints; returns the stall in seconds. On a failed
    update the weight-update session is closed, generation continued on the old weights,
    and the error re-raised."""
    from .pull import LOAD_FORMAT, payload

    entry = payload(version)
    t0 = time.monotonic()
    _post(client, "/pause_generation", {"mode": mode})
    try:
        _post(client, "/begin_weight_update")
        try:
            _post(client, "/update_weights_from_tensor", {
                "serialized_named_tensors": [entry] * tp, "load_format": LOAD_FORMAT,
                "weight_version": str(version), "flush_cache": True})
        finally:
            _post(client, "/end_weight_update")
    finally:
        _post(client, "/continue_generation")
    return time.monotonic() - t0


def _banner(client: Any, args: argparse.Namespace) -> tuple[Optional[int], str]:
    current, args.tp = engine_version(client), tp_size(client)
    return current, (f"following {args.model} for SGLang at {args.engine.removeprefix(PREFIX).rstrip('/')} "
                     f"(tp {args.tp}, engine at v{current})")


#: The ``tensorhub follow`` driver (entry point ``tensorhub.engines: sglang``).
DRIVER = Driver("sglang", PREFIX, "SGLang server URL, e.g. sglang+http://127.0.0.1:30000",
                ("abort", "retract", "in_place"), __doc__, _banner,
                lambda client, v, args, show: swap(client, v, args.mode, getattr(args, "tp", 1)))


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run(DRIVER, argv)


if __name__ == "__main__":
    sys.exit(main())
