"""One SGLang TP worker on CPU in a child process, driven over stdin/stdout (JSON lines).

Started by the SGLang tests as ``python _sgl_worker.py '<config JSON>'``. It does what an
SGLang scheduler process does before serving, with SGLang's own code: ``load_plugins()``
(entry points, hooks), ``ServerArgs`` + ``publish`` of the runtime context, a one-rank
gloo process group with SGLang's parallel state, ``ModelConfig.from_server_args``, then
``get_model_loader(LoadConfig(...)).load_model(...)`` builds the real
``LlamaForCausalLM``. No CUDA, no HTTP server, no scheduler loop.

Answers ``@@{"ready": {...}}`` (or ``@@{"error": ...}`` and exits), then runs commands:
``digest``, ``reload`` (the loader of the start reads the weight files of directory
``path`` into the model: a shared reference worker between answers), ``specs``, ``update``
(SGLang's ``WeightUpdater`` begin / update_weights_from_tensor / end with our pull
function), ``held``, ``seed_info`` / ``seed_read`` (SGLang's ``remote_instance``
transfer-engine client against a seed URL), ``exit``.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))


def _answer(obj: dict) -> None:
    sys.stdout.write("@@" + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _digest(model) -> dict:
    import torch

    return {n: hashlib.sha256(p.data.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for n, p in model.named_parameters()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(cfg: dict):
    sys.path.insert(0, HERE)
    import _torchvision_shim

    _torchvision_shim.install()
    from sglang.srt.plugins import load_plugins

    load_plugins()  # discovers tensorhub through the sglang.srt.plugins entry point
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.model_loader import get_model_loader
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    from tensorhub.integrations.sglang.pull import LOAD_FORMAT

    sa = ServerArgs(model_path=cfg["model_dir"], device="cpu", dtype="float32", load_format=cfg["load_format"],
                    model_loader_extra_config=json.dumps(cfg.get("extra", {})), custom_weight_loader=[LOAD_FORMAT],
                    tp_size=1, skip_server_warmup=True)
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
    initialize_model_parallel()
    mc = ModelConfig.from_server_args(sa)
    lc = LoadConfig(load_format=sa.load_format, model_loader_extra_config=sa.model_loader_extra_config)
    loader = get_model_loader(lc, mc)
    model = loader.load_model(model_config=mc, device_config=DeviceConfig("cpu"))
    return sa, mc, loader, model


def main() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = json.loads(sys.argv[1])
    try:
        sa, mc, loader, model = build(cfg)
    except BaseException as e:
        _answer({"error": f"{type(e).__name__}: {e}"})
        traceback.print_exc()
        sys.exit(3)
    _answer({"ready": {"loader": type(loader).__name__, "model": type(model).__name__}})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            if op == "exit":
                _answer({"ok": None})
                return
            _answer({"ok": run(op, cmd, mc, model, loader)})
        except BaseException as e:
            traceback.print_exc()
            _answer({"error": f"{type(e).__name__}: {e}"})


def run(op: str, cmd: dict, mc, model, loader):
    if op == "digest":
        return _digest(model)
    if op == "reload":  # the loader this worker started with reads another directory's weight files
        import torch

        mc.model_path = cmd["path"]
        loader.load_weights_and_postprocess(model, loader._get_all_weights(mc, model), torch.device("cpu"))
        return None
    if op == "specs":
        return {n: [p.numel(), p.element_size()] for n, p in model.named_parameters()}
    if op == "held":
        from tensorhub.integrations._core import worker

        st = worker.get_state()
        return {"held": [list(h) for h in st.hub.held()], "version": st.version, "layout": st.layout,
                "copy": st.copy is not None} if st else None
    if op == "update":
        return update(cmd, mc, model)
    if op == "seed_info":
        from sglang.srt.model_loader.remote_instance_weight_loader_utils import (
            get_remote_instance_transfer_engine_info_per_rank,
        )

        return get_remote_instance_transfer_engine_info_per_rank(cmd["seed_url"], cmd["rank"])
    if op == "seed_read":
        return seed_read(cmd, model)
    if op == "serve_http":
        return serve_http(mc, model)
    if op == "http_calls":
        return _HTTP["calls"]
    raise ValueError(f"unknown op {op}")


def update(cmd: dict, mc, model):
    """What the scheduler runs for begin_weight_update / update_weights_from_tensor /
    end_weight_update, with the payload SGLang's HTTP endpoint would deserialize."""
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.runtime_context import get_model
    from sglang.srt.utils import MultiprocessingSerializer

    wu = WeightUpdater(tp_rank=0, device="cpu", gpu_id=0, model_config=mc,
                       custom_weight_loaders=get_model().custom_weight_loader, get_model=lambda: model,
                       update_model_fields=lambda **kw: None, recapture_cuda_graph=lambda: None,
                       get_model_runner=lambda: None)
    named = MultiprocessingSerializer.deserialize(cmd["payload"])  # made by the client (the test)
    wu.begin_weight_update()
    ok, message = wu.update_weights_from_tensor(named_tensors=named, load_format=cmd.get("load_format",
                                                 "tensorhub.integrations.sglang.pull.pull"))
    wu.end_weight_update(run_post_load=not ok)
    return {"success": ok, "message": message}


_HTTP: dict = {"calls": [], "version": None, "paused": False, "session": False}


def serve_http(mc, model) -> int:
    """SGLang's weight-update endpoints on a free port, for ``tensorhub follow``: the same
    paths and request types (``sglang.srt.managers.io_struct``) as SGLang's http_server,
    run the way its scheduler does (session, WeightUpdater, weight version). A stand-in
    for SGLang's tokenizer-manager/scheduler hop, which needs CUDA to start."""
    import base64
    import threading

    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from sglang.srt.managers import io_struct as io

    from tensorhub.integrations._core import worker

    st = worker.get_state()
    _HTTP["version"] = None if st is None or st.version is None else str(st.version)
    globals()["Request"] = Request  # FastAPI resolves the (postponed) annotations in module globals
    app = FastAPI()
    calls = _HTTP["calls"]

    def body_as(cls, body: dict):
        return cls(**body)  # SGLang's request struct: unknown fields are refused

    @app.get("/model_info")
    def model_info():
        return {"weight_version": _HTTP["version"]}

    @app.get("/server_info")
    def server_info():
        return {"tp_size": 1}

    @app.post("/pause_generation")
    async def pause(req: Request):
        body_as(io.PauseGenerationReqInput, await req.json())
        calls.append("pause_generation")
        _HTTP["paused"] = True
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def cont(req: Request):
        body_as(io.ContinueGenerationReqInput, await req.json())
        calls.append("continue_generation")
        _HTTP["paused"] = False
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/begin_weight_update")
    async def begin(req: Request):
        body_as(io.BeginWeightUpdateReqInput, await req.json())
        calls.append("begin_weight_update")
        _HTTP["session"] = True
        return {"success": True, "message": "Success"}

    @app.post("/end_weight_update")
    async def end(req: Request):
        body_as(io.EndWeightUpdateReqInput, await req.json())
        calls.append("end_weight_update")
        _HTTP["session"] = False
        return {"success": True, "message": "Success"}

    @app.post("/update_weights_from_tensor")
    async def update_from_tensor(req: Request):
        body = await req.json()
        body["serialized_named_tensors"] = [base64.b64decode(x) for x in body["serialized_named_tensors"]]
        obj = body_as(io.UpdateWeightsFromTensorReqInput, body)
        calls.append("update_weights_from_tensor")
        if not _HTTP["session"]:
            return JSONResponse({"success": False, "message": "no session"}, status_code=400)
        r = update({"payload": obj.serialized_named_tensors[0], "load_format": obj.load_format}, mc, model)
        if r["success"] and obj.weight_version is not None:
            _HTTP["version"] = obj.weight_version
        return JSONResponse(r, status_code=200 if r["success"] else 400)

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    import time

    while not server.started:
        time.sleep(0.05)
    return sock.getsockname()[1]


def seed_read(cmd: dict, model):
    """SGLang's remote_instance loader, transfer_engine backend, reading into ``model``."""
    from mooncake.engine import TransferEngine
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import RemoteInstanceModelLoader
    from sglang.srt.model_loader.remote_instance_weight_loader_utils import register_memory_region_v1

    te = TransferEngine()
    if te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("transfer engine did not start")
    register_memory_region_v1(model, te)  # the CPU variant of SGLang's registration
    lc = LoadConfig(load_format="remote_instance", remote_instance_weight_loader_backend="transfer_engine",
                    remote_instance_weight_loader_transfer_engine=te)
    ok = RemoteInstanceModelLoader(lc).load_model_from_remote_instance_by_transfer_engine(
        model, te, cmd["seed_url"], cmd.get("rank", 0))
    return {"success": ok, "digest": _digest(model)}


if __name__ == "__main__":
    main()
