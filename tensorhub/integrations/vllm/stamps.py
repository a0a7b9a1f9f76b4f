"""Version stamps: every completion of the OpenAI server names the weights that produced it.

Runs in vLLM's API-server process. The source of truth is vLLM's own per-token label:
each finished ``CompletionOutput`` carries ``weight_versions``, spans ``[start, end)`` of
its output tokens with the engine core's weight version when they were sampled (vLLM
changes that label only between steps; :mod:`tensorhub.integrations.vllm._engine_core` sets it to
the TensorHub version at start and in the same engine-core call as each swap). vLLM puts
these spans on its token-in/token-out route (``/inference/v1/generate``) but not on
``/v1/completions`` or ``/v1/chat/completions``; :class:`WeightVersionMiddleware` does:

* response header ``X-TensorHub-Weight-Version: N`` and ``system_fingerprint:
  "tensorhub-vN"``, where ``N`` is the **oldest** version that produced any output token of
  the response (a rollout is never reported fresher than it is);
* header ``X-TensorHub-Weight-Versions: 2,3``: every version that produced a token,
  oldest first (one entry unless a request spanned a swap);
* each choice gets ``"weight_versions": [{"version": "2", "start": 0, "end": 5},
  {"version": "3", "start": 5, "end": 16}]``, vLLM's own span shape.

Streaming (``"stream": true``): the headers leave before any token exists, so the stamp
rides on the chunks instead: a choice's terminal chunk (``finish_reason`` set) gets its
``weight_versions`` and ``system_fingerprint``; the usage chunk, when asked for, the
response's ``system_fingerprint``.

A request that spans a swap: ``/pause?mode=abort`` (the default) ends it before the swap,
so all its tokens are the old version's; ``mode=wait`` lets it finish on the old weights;
``mode=keep`` freezes it, and at the pause vLLM drops its KV (the cache is cleared) so it
recomputes the prompt and the tokens so far with the new weights when resumed: tokens
before the pause are the old version's, tokens after it the new one's, and the spans say
exactly that; the stamp (header, fingerprint) is the old one.

Installed on every OpenAI server that runs TensorHub's loader or weight-transfer backend
(:func:`install_server_hook`, called by the plug-in), through vLLM's own ``--middleware``
list; naming it yourself (``--middleware tensorhub.integrations.vllm.stamps.WeightVersionMiddleware``)
is the same. It observes the engine's outputs by wrapping ``engine_client.generate`` of the
app it serves (the one object; nothing in vLLM's modules changes).
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
from typing import Any, Optional

logger = logging.getLogger(__name__)

__all__ = ["WeightVersionMiddleware", "HEADER", "HEADER_ALL", "MIDDLEWARE", "stamp_of", "fingerprint",
           "install_server_hook"]

HEADER = "x-tensorhub-weight-version"
HEADER_ALL = "x-tensorhub-weight-versions"
MIDDLEWARE = f"{__name__}.WeightVersionMiddleware"
_FINISHED = re.compile(rb'"finish_reason":\s*"')  # a chunk that ends a choice (only those are parsed)

#: The collector of the HTTP request being served (set by the middleware around the app).
_COLLECT: contextvars.ContextVar[Optional["_Collector"]] = contextvars.ContextVar("tensorhub_stamps", default=None)


class _Collector:
    """The spans of every output of one HTTP request, in choice order: one slot per
    (engine request in the order the handler started them, output index)."""

    def __init__(self) -> None:
        self.calls: dict[str, list] = {}

    def start(self, request_id: str, n: int) -> None:
        self.calls[request_id] = [None] * max(1, n)

    def record(self, request_id: str, out: Any) -> None:
        slots = self.calls.setdefault(request_id, [])
        for o in getattr(out, "outputs", None) or ():
            spans = getattr(o, "weight_versions", None)
            if spans is None:
                continue
            while len(slots) <= o.index:
                slots.append(None)
            slots[o.index] = [(str(s.version), int(s.start), int(s.end)) for s in spans]

    def choices(self) -> list:
        return [slot for slots in self.calls.values() for slot in slots]


def _ordered(versions: list) -> list:
    """Distinct versions, oldest first (numerically when all are numbers, else as seen)."""
    seen = list(dict.fromkeys(versions))
    return sorted(seen, key=int) if all(v.isdigit() for v in seen) else seen


def stamp_of(spans_per_choice: list) -> Optional[list]:
    """Every version in these span lists, oldest first; None when no token was labelled."""
    vs = [v for spans in spans_per_choice if spans for v, _, _ in spans]
    return _ordered(vs) or None


def fingerprint(version: str) -> str:
    """The ``system_fingerprint`` of a response whose oldest token came from ``version``."""
    return f"tensorhub-v{version}" if version.isdigit() else f"tensorhub-{version}"


def _as_json(spans: list) -> list:
    return [{"version": v, "start": s, "end": e} for v, s, e in spans]


def _watch_generate(engine: Any) -> None:
    """Wrap ``engine.generate`` (this instance only, once) so that the outputs of a request
    served under the middleware are recorded in its collector."""
    if getattr(engine, "_tensorhub_stamps", False):
        return
    inner = engine.generate

    def generate(*args: Any, **kwargs: Any) -> Any:
        gen = inner(*args, **kwargs)
        col = _COLLECT.get()
        if col is None:
            return gen
        request_id = args[2] if len(args) > 2 else kwargs.get("request_id")
        params = args[1] if len(args) > 1 else kwargs.get("sampling_params")
        col.start(request_id, getattr(params, "n", 1) or 1)
        return _recording(gen, col, request_id)

    engine.generate = generate
    engine._tensorhub_stamps = True


async def _recording(gen: Any, col: _Collector, request_id: str) -> Any:
    try:
        async for out in gen:
            if getattr(out, "finished", False):
                col.record(request_id, out)
            yield out
    finally:
        await gen.aclose()  # vLLM's generate aborts the request when closed early


class WeightVersionMiddleware:
    """ASGI middleware for vLLM's OpenAI server: stamps ``/v1/completions`` and
    ``/v1/chat/completions`` answers with the weight version(s) that produced them (see the
    module docstring). Every other route passes through untouched."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST" \
                or not str(scope.get("path", "")).rstrip("/").endswith("completions"):
            await self.app(scope, receive, send)
            return
        engine = getattr(getattr(scope.get("app"), "state", None), "engine_client", None)
        if engine is None or not hasattr(engine, "generate"):
            await self.app(scope, receive, send)
            return
        _watch_generate(engine)
        col = _Collector()
        token = _COLLECT.set(col)
        try:
            await self.app(scope, receive, _Stamper(send, col))
        finally:
            _COLLECT.reset(token)


class _Stamper:
    """The ``send`` of one response: a JSON answer is held until complete and stamped
    (headers and body); an event stream is stamped chunk by chunk."""

    def __init__(self, send: Any, col: _Collector) -> None:
        self.send, self.col = send, col
        self.mode = "pass"
        self.start: Optional[dict] = None
        self.body: list[bytes] = []

    async def __call__(self, message: dict) -> None:
        kind = message.get("type")
        if kind == "http.response.start":
            ctype = b""
            for k, v in message.get("headers", []):
                if k.lower() == b"content-type":
                    ctype = v.lower()
            if message.get("status") == 200 and ctype.startswith(b"application/json"):
                self.mode, self.start = "json", message
                return
            if message.get("status") == 200 and ctype.startswith(b"text/event-stream"):
                self.mode = "sse"
            await self.send(message)
            return
        if kind == "http.response.body" and self.mode == "json":
            self.body.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            await self._send_json(b"".join(self.body))
            return
        if kind == "http.response.body" and self.mode == "sse":
            body = message.get("body", b"")
            if _FINISHED.search(body) or b'"system_fingerprint"' in body:
                message = {**message, "body": self._stamp_events(body)}
        await self.send(message)

    async def _send_json(self, raw: bytes) -> None:
        assert self.start is not None
        headers = [(k, v) for k, v in self.start.get("headers", []) if k.lower() != b"content-length"]
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        per_choice = self.col.choices()
        versions = stamp_of(per_choice)
        if isinstance(body, dict) and isinstance(body.get("choices"), list) and versions:
            body["system_fingerprint"] = fingerprint(versions[0])
            if len(per_choice) == len(body["choices"]):
                for choice, spans in zip(body["choices"], per_choice):
                    if spans is not None and isinstance(choice, dict):
                        choice["weight_versions"] = _as_json(spans)
            raw = json.dumps(body, separators=(",", ":")).encode()
            headers += [(HEADER.encode(), versions[0].encode("latin-1")),
                        (HEADER_ALL.encode(), ",".join(versions).encode("latin-1"))]
        headers.append((b"content-length", str(len(raw)).encode()))
        await self.send({**self.start, "headers": headers})
        await self.send({"type": "http.response.body", "body": raw, "more_body": False})

    def _stamp_events(self, body: bytes) -> bytes:
        out = []
        for event in body.split(b"\n\n"):
            if event.startswith(b"data: {"):
                try:
                    chunk = json.loads(event[6:])
                except ValueError:
                    chunk = None
                if isinstance(chunk, dict):
                    event = b"data: " + json.dumps(self._stamp_chunk(chunk), separators=(",", ":")).encode()
            out.append(event)
        return b"\n\n".join(out)

    def _stamp_chunk(self, chunk: dict) -> dict:
        per_choice = self.col.choices()
        finished = []
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            i = choice.get("index")
            if choice.get("finish_reason") is not None and isinstance(i, int) and 0 <= i < len(per_choice) \
                    and per_choice[i] is not None:
                choice["weight_versions"] = _as_json(per_choice[i])
                finished.append(per_choice[i])
        versions = stamp_of(finished) if finished else (stamp_of(per_choice) if "system_fingerprint" in chunk else None)
        if versions:
            chunk["system_fingerprint"] = fingerprint(versions[0])
        return chunk


# ---------------------------------------------------------------- installation
def _tensorhub_args(args: Any) -> bool:
    """The server's CLI arguments name TensorHub's loader or weight-transfer backend."""
    if getattr(args, "load_format", None) == "tensorhub":
        return True
    wt = getattr(args, "weight_transfer_config", None)
    if isinstance(wt, str):
        try:
            wt = json.loads(wt)
        except ValueError:
            return False
    backend = wt.get("backend") if isinstance(wt, dict) else getattr(wt, "backend", None)
    return backend == "tensorhub"


def install_server_hook() -> bool:
    """In the OpenAI server's process (its launcher module is loaded), add
    :data:`MIDDLEWARE` to ``args.middleware`` when the server runs TensorHub's loader or
    backend, just before vLLM builds its app (vLLM then installs it like any
    ``--middleware``). Idempotent; False where there is no such launcher (workers, engine
    core, offline ``LLM``)."""
    import sys

    entry = sys.modules.get("vllm.entrypoints.launchers.api_server.entry")
    build = getattr(entry, "build_app", None)
    if build is None:
        return False
    if getattr(build, "_tensorhub", False):
        return True

    def build_app(args: Any, *a: Any, **kw: Any) -> Any:
        middleware = list(getattr(args, "middleware", None) or [])
        if _tensorhub_args(args) and MIDDLEWARE not in middleware:
            args.middleware = [*middleware, MIDDLEWARE]
        return build(args, *a, **kw)

    build_app._tensorhub = True  # type: ignore[attr-defined]
    build_app.__doc__ = build.__doc__
    entry.build_app = build_app
    return True
