"""The version-stamp middleware's pure parts, without vLLM: an ASGI app and an engine client
stand in (the real server is ``test_vllm_stamps.py``)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace as NS

from tensorhub.integrations.vllm import stamps


def _out(index: int, spans: list) -> NS:
    return NS(index=index, weight_versions=[NS(version=v, start=s, end=e) for v, s, e in spans])


class _Engine:
    """``generate(prompt, params, request_id)``: an async generator whose last output is
    finished with the given spans."""

    def __init__(self, spans: dict) -> None:
        self.spans = spans

    def generate(self, prompt, params, request_id):
        async def gen():
            yield NS(finished=False, outputs=[])
            yield NS(finished=True, outputs=[_out(i, s) for i, s in enumerate(self.spans[prompt])])
        return gen()


def _app(engine: _Engine, prompts: list, n: int, stream: bool, status: int = 200):
    async def app(scope, receive, send):
        outs = []
        for i, p in enumerate(prompts):
            async for o in engine.generate(p, NS(n=n), f"cmpl-x-{i}"):
                outs.append(o)
        choices = [{"index": j, "text": "t", "finish_reason": "length"} for j in range(len(prompts) * n)]
        if stream:
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
            for c in choices:
                await send({"type": "http.response.body", "more_body": True,
                            "body": b"data: " + json.dumps({"choices": [c]}).encode() + b"\n\n"})
            await send({"type": "http.response.body", "more_body": True,
                        "body": b'data: {"choices":[],"system_fingerprint":"vllm-x"}\n\ndata: [DONE]\n\n'})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        raw = json.dumps({"choices": choices, "system_fingerprint": "vllm-x"}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]})
        await send({"type": "http.response.body", "body": raw})
    return app


def _call(app, engine, path="/v1/completions", method="POST") -> tuple[dict, bytes]:
    sent: list = []

    async def send(m):
        sent.append(m)

    async def receive():
        return {"type": "http.request", "body": b""}

    scope = {"type": "http", "method": method, "path": path, "app": NS(state=NS(engine_client=engine))}
    asyncio.run(stamps.WeightVersionMiddleware(app)(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_json_answer_is_stamped_per_choice_and_oldest_first():
    eng = _Engine({"a": [[("3", 0, 4), ("4", 4, 9)], [("3", 0, 9)]], "b": [[("4", 0, 9)], [("4", 0, 9)]]})
    start, body = _call(_app(eng, ["a", "b"], n=2, stream=False), eng)
    headers = dict(start["headers"])
    assert headers[b"x-tensorhub-weight-version"] == b"3"
    assert headers[b"x-tensorhub-weight-versions"] == b"3,4"
    assert int(headers[b"content-length"]) == len(body)
    got = json.loads(body)
    assert got["system_fingerprint"] == "tensorhub-v3"
    assert [c["weight_versions"] for c in got["choices"]] == [
        [{"version": "3", "start": 0, "end": 4}, {"version": "4", "start": 4, "end": 9}],
        [{"version": "3", "start": 0, "end": 9}], [{"version": "4", "start": 0, "end": 9}],
        [{"version": "4", "start": 0, "end": 9}]]


def test_versions_sort_numerically():
    assert stamps.stamp_of([[("10", 0, 1)], [("9", 0, 1)]]) == ["9", "10"]
    assert stamps.stamp_of([[("default", 0, 1)]]) == ["default"]
    assert stamps.stamp_of([[], None]) is None
    assert stamps.fingerprint("default") == "tensorhub-default"


def test_stream_terminal_chunks_and_usage_chunk_are_stamped():
    eng = _Engine({"a": [[("5", 0, 2), ("6", 2, 7)]]})
    start, body = _call(_app(eng, ["a"], n=1, stream=True), eng)
    assert b"x-tensorhub-weight-version" not in dict(start["headers"])  # headers leave before any token
    events = [json.loads(e[6:]) for e in body.split(b"\n\n") if e.startswith(b"data: {")]
    assert events[0]["choices"][0]["weight_versions"] == [{"version": "5", "start": 0, "end": 2},
                                                          {"version": "6", "start": 2, "end": 7}]
    assert events[0]["system_fingerprint"] == "tensorhub-v5"
    assert events[1] == {"choices": [], "system_fingerprint": "tensorhub-v5"}
    assert body.endswith(b"data: [DONE]\n\n")


def test_other_routes_and_errors_pass_untouched():
    eng = _Engine({"a": [[("5", 0, 2)]]})
    start, body = _call(_app(eng, ["a"], n=1, stream=False), eng, path="/v1/models", method="GET")
    assert b"x-tensorhub-weight-version" not in dict(start["headers"])
    assert json.loads(body)["system_fingerprint"] == "vllm-x"
    start, body = _call(_app(eng, ["a"], n=1, stream=False, status=400), eng)
    assert start["status"] == 400 and json.loads(body)["system_fingerprint"] == "vllm-x"


def test_server_hook_adds_the_middleware_only_for_tensorhub_servers(monkeypatch):
    import sys
    import types

    seen = []
    entry = types.ModuleType("vllm.entrypoints.launchers.api_server.entry")
    entry.build_app = lambda args, *a, **kw: seen.append(list(args.middleware))
    monkeypatch.setitem(sys.modules, entry.__name__, entry)
    assert stamps.install_server_hook() and stamps.install_server_hook()  # idempotent
    entry.build_app(NS(load_format="auto", weight_transfer_config=None, middleware=[]))
    entry.build_app(NS(load_format="auto", weight_transfer_config='{"backend": "tensorhub"}', middleware=["m.X"]))
    entry.build_app(NS(load_format="tensorhub", weight_transfer_config=None, middleware=[stamps.MIDDLEWARE]))
    assert seen == [[], ["m.X", stamps.MIDDLEWARE], [stamps.MIDDLEWARE]]
