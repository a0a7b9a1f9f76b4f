"""Follow mode: keep an SGLang server on the newest version of a model.

``tensorhub follow --engine sglang+http://HOST:PORT --model NAME [--mode abort|retract|in_place]``
watches the coordinator and, for each new complete version, drives SGLang's endpoints:
``/pause_generation``, ``/begin_weight_update``, ``/update_weights_from_tensor`` (with
``load_format`` = :data:`integrations.sglang.pull.LOAD_FORMAT` and the version as the
payload, one entry per TP rank), ``/end_weight_update``, ``/continue_generation``. It
prints one line per swap (the version, the stall, the bytes and the holders), like the
vLLM follow mode. A failed swap is printed, the engine continued on its old version, and
following goes on. The server must run with ``--custom-weight-loader
integrations.sglang.pull.pull``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from integrations.vllm.follow import _holders

__all__ = ["main", "swap", "engine_version"]

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


def main(argv: Optional[Sequence[str]] = None) -> int:
    import httpx

    import tensorhub

    p = argparse.ArgumentParser(prog="tensorhub follow", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True, help="SGLang server URL, e.g. sglang+http://127.0.0.1:30000")
    p.add_argument("--model", required=True, help="model name on the coordinator")
    p.add_argument("--mode", choices=("abort", "retract", "in_place"), default="abort",
                   help="what /pause_generation does with in-flight requests (default abort)")
    p.add_argument("--coordinator", help="coordinator URL (default: $TENSORHUB_COORDINATOR)")
    p.add_argument("--token-file", help="file holding the API token (default: $TENSORHUB_TOKEN)")
    p.add_argument("--max-swaps", type=int, default=0, help="stop after this many swaps (0: never)")
    args = p.parse_args(argv)
    url = args.engine.removeprefix(PREFIX).rstrip("/")
    token = Path(args.token_file).read_text().strip() if args.token_file else None
    try:
        hub = tensorhub.connect(args.coordinator, token=token)
    except tensorhub.TensorHubError as e:
        print(f"tensorhub follow: {e}", file=sys.stderr)
        return 2
    swaps = 0
    with hub, httpx.Client(base_url=url, timeout=600) as client:
        current = engine_version(client)
        tp = tp_size(client)
        print(f"following {args.model} for SGLang at {url} (tp {tp}, engine at v{current})", flush=True)
        while not args.max_swaps or swaps < args.max_swaps:
            try:
                v = hub.wait_for_version(args.model, newer_than=current, timeout=60)
            except tensorhub.HubTimeoutError:
                continue
            except KeyboardInterrupt:
                return 130
            nbytes, holders = _holders(hub, args.model, v)
            try:
                stall = swap(client, v, args.mode, tp)
            except RuntimeError as e:
                print(f"v{v}: swap failed, engine kept v{current}: {e}", file=sys.stderr, flush=True)
                time.sleep(1)
                continue
            swaps += 1
            current = v
            print(f"v{v}: stall {stall:.3f}s, {nbytes / 1e6:.1f} MB from holders {', '.join(holders)}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
