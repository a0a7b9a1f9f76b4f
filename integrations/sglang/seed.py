"""A seed for SGLang's own ``remote_instance`` loader, answered from TensorHub replicas.

Unmodified SGLang engines start with::

    python -m sglang.launch_server --model-path DIR --load-format remote_instance \\
        --remote-instance-weight-loader-backend transfer_engine \\
        --remote-instance-weight-loader-seed-instance-ip SEED_HOST \\
        --remote-instance-weight-loader-seed-instance-service-port SEED_PORT

and each of their TP ranks asks the seed ``GET /get_remote_instance_transfer_engine_info
?rank=R`` (SGLang's ``remote_instance_weight_loader_utils``), then reads every parameter
with one Mooncake ``batch_transfer_sync_read`` from the answer: the seed's Transfer Engine
session ``host:port`` and, per parameter name, ``[address, numel, element_size]``.

This server (``python -m integrations.sglang.seed --coordinator URL --model NAME
[--version N] [--layout L] [--port P]``, or :class:`SeedServer` in any process) answers
from the coordinator instead of from one engine: for rank R it takes a read lease on
shard R of the model's engine-native layout (what SGLang engines started with
``--load-format tensorhub`` register in place) and returns the chosen replica's Mooncake
endpoint and tensor addresses. Any TensorHub replica of that layout is the seed, the
least loaded and nearest first; the seed process itself holds no weights and opens no
Mooncake engine. The lease is kept (renewed) for ``lease_seconds`` so the holder cannot
unpublish and overwrite the memory while the SGLang reader copies it (SGLang never says
when it is done), then released.

Limits, from SGLang's side: the reader must have the same TP size (rank R reads shard R)
and the same parameter names, sizes and dtypes (the layout fingerprint); its own
``transfer_engine`` must reach the holders (Mooncake has no authentication: trusted
network only). The ``nccl`` backend (``/init_weights_send_group_for_remote_instance``,
``/send_weights_to_remote_instance``) needs a GPU process group with the seed and is
answered with an error naming the ``transfer_engine`` backend.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence, Union

logger = logging.getLogger(__name__)

__all__ = ["SeedServer", "main"]


class SeedError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class SeedServer:
    """SGLang's seed endpoints for one model; see the module docstring.

    Lifecycle: ``start()`` connects a Hub (control plane only) and serves on a background
    thread, returning the URL; ``stop()`` releases every lease and closes the Hub."""

    def __init__(self, coordinator: Optional[str], model: str, *, version: Union[int, str] = "latest",
                 layout: Optional[str] = None, token: Optional[str] = None, host: str = "127.0.0.1",
                 port: int = 0, lease_seconds: float = 120.0, worker_id: Optional[str] = None) -> None:
        self.coordinator, self.model, self.version, self.layout = coordinator, model, version, layout
        self.token, self.host, self.port, self.lease_seconds = token, host, port, lease_seconds
        self.worker_id = worker_id
        self.url: Optional[str] = None
        self.hub: Any = None
        self._leases: list[tuple[str, float]] = []  # (lease id, release at)
        self._lock = threading.Lock()
        self._stop = threading.Event()

    # ------------------------------------------------------------------ answers
    def info(self, rank: int) -> dict:
        """The answer for TP rank ``rank``: ``{"rank", "remote_instance_transfer_engine_info":
        [session_id, {name: [address, numel, element_size]}]}``; SeedError when none."""
        import tensorhub
        from tensorhub._wire import DTYPE_SIZES

        if rank < 0:
            raise SeedError(400, "Missing or invalid rank parameter")
        try:
            v = self.hub.latest(self.model) if self.version == "latest" else int(self.version)
        except tensorhub.NotFoundError as e:
            raise SeedError(404, f"tensorhub seed: {e.message}") from None
        if v is None:
            raise SeedError(404, f"tensorhub seed: {self.model!r} has no complete version yet")
        layout, num_shards = self._layout(v)
        if rank >= num_shards:
            raise SeedError(404, f"tensorhub seed: {self.model!r} v{v} layout {layout} has {num_shards} TP "
                                 f"shard(s); rank {rank} needs a reader with the same TP size")
        try:
            grant = self.hub._acquire(self.model, v, layout, rank, set(), time.monotonic() + 10)
        except tensorhub.TensorHubError as e:
            raise SeedError(404, f"tensorhub seed: {e}") from None
        full = [x for x in grant.replicas if x.chunks is None]  # never a replica still receiving
        if not full:
            self.hub._release(grant.lease_id)
            raise SeedError(404, f"tensorhub seed: no complete replica of {self.model!r} v{v} shard {rank} yet")
        with self._lock:
            self._leases.append((grant.lease_id, time.monotonic() + self.lease_seconds))
        r = full[0]
        weights = {}
        for spec, addr in zip(grant.manifest.tensors, r.addresses):
            numel = math.prod(spec.shape)
            weights[spec.name] = [addr, numel, DTYPE_SIZES[spec.dtype]]
        logger.info("tensorhub seed: rank %d of %s v%d (%s) -> %s at %s (%d tensors, %.1f MB)", rank,
                    self.model, v, layout, r.worker_id, r.endpoint, len(weights), grant.manifest.nbytes / 1e6)
        return {"rank": rank, "remote_instance_transfer_engine_info": [r.endpoint, weights]}

    def _layout(self, v: int) -> tuple[str, int]:
        st = self.hub.api.get("/v1/status")
        m = next((m for m in st["models"] if m["model"] == self.model), None)
        vi = None if m is None else next((x for x in m["versions"] if x["version"] == v), None)
        if vi is None:
            raise SeedError(404, f"tensorhub seed: {self.model!r} has no version {v}")
        native = {k: li for k, li in vi["layouts"].items() if k != "hf" and li["complete"]}
        if self.layout is not None:
            li = vi["layouts"].get(self.layout)
            if li is None or not li["complete"]:
                raise SeedError(404, f"tensorhub seed: {self.model!r} v{v} has no complete layout {self.layout} "
                                     f"(complete engine-native layouts: {sorted(native) or 'none'})")
            return self.layout, li["num_shards"]
        if len(native) != 1:
            why = "none; start an engine with --load-format tensorhub (native on)" if not native else \
                f"several ({', '.join(sorted(native))}); pass --layout"
            raise SeedError(404, f"tensorhub seed: {self.model!r} v{v}: complete engine-native layouts: {why}")
        (name, li), = native.items()
        return name, li["num_shards"]

    # ------------------------------------------------------------------ leases
    def _lease_loop(self) -> None:
        while not self._stop.wait(1.0):
            self._tend(time.monotonic())

    def _tend(self, now: float, release_all: bool = False) -> None:
        with self._lock:
            due = [lid for lid, until in self._leases if release_all or until <= now]
            keep = [(lid, u) for lid, u in self._leases if not (release_all or u <= now)]
            self._leases = keep
        for lid in due:
            try:
                self.hub._release(lid)
            except Exception as e:  # expired or coordinator away: the lease lapses by itself
                logger.debug("tensorhub seed: release %s: %s", lid, e)
        for lid, _ in keep:
            try:
                self.hub.api.post(f"/v1/leases/{lid}/renew", retry_timeout=2.0)
            except Exception as e:
                logger.debug("tensorhub seed: renew %s: %s", lid, e)

    # ------------------------------------------------------------------ server
    def app(self) -> Any:
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse, PlainTextResponse

        app = FastAPI(title="tensorhub seed for SGLang remote_instance")

        @app.get("/health")
        def health() -> Any:
            return PlainTextResponse("OK")

        def answer(rank: Optional[int]) -> Any:
            try:
                if rank is None:
                    raise SeedError(400, "Missing or invalid rank parameter")
                return self.info(rank)
            except SeedError as e:
                return JSONResponse({"error": {"message": e.message}}, status_code=e.status)

        @app.get("/get_remote_instance_transfer_engine_info")
        def get_info_old(rank: Optional[int] = None) -> Any:
            return answer(rank)

        @app.get("/remote_instance_transfer_engine_info")
        def get_info(rank: Optional[int] = None) -> Any:
            return answer(rank)

        @app.get("/get_transfer_engine_info")
        def get_info_bootstrap(rank: Optional[int] = None) -> Any:
            return answer(rank)

        def nccl() -> Any:
            return JSONResponse({"success": False, "message": (
                "tensorhub seed: the nccl backend needs a GPU process group with the seed; start the reader "
                "with --remote-instance-weight-loader-backend transfer_engine")}, status_code=400)

        app.post("/init_weights_send_group_for_remote_instance")(nccl)
        app.post("/send_weights_to_remote_instance")(nccl)
        return app

    def start(self) -> str:
        import uvicorn

        import tensorhub
        from tensorhub.coordinator import _bind, _url

        self.hub = tensorhub.connect(self.coordinator, token=self.token, worker_id=self.worker_id)
        sock = _bind(self.host, self.port)
        self.url = _url(self.host, sock, False)
        self._server = uvicorn.Server(uvicorn.Config(self.app(), log_level="warning", access_log=False))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="tensorhub-seed", daemon=True)
        self._thread.start()
        self._leaser = threading.Thread(target=self._lease_loop, name="tensorhub-seed-leases", daemon=True)
        self._leaser.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("tensorhub seed did not start")
            time.sleep(0.01)
        return self.url

    def stop(self) -> None:
        self._stop.set()
        if getattr(self, "_server", None) is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
        if self.hub is not None:
            self._tend(time.monotonic(), release_all=True)
            self.hub.close()
            self.hub = None

    def __enter__(self) -> "SeedServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m integrations.sglang.seed", description=__doc__.split("\n\n")[0])
    p.add_argument("--coordinator", help="coordinator URL (default: $TENSORHUB_COORDINATOR)")
    p.add_argument("--model", required=True, help="model name on the coordinator")
    p.add_argument("--version", default="latest", help="version to serve (default: the newest complete)")
    p.add_argument("--layout", help="engine-native layout (default: the version's only one)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--token-file", help="file holding the API token (default: $TENSORHUB_TOKEN)")
    p.add_argument("--lease-seconds", type=float, default=120.0,
                   help="how long a reader's source stays pinned after it asked (default 120)")
    args = p.parse_args(argv)
    token = Path(args.token_file).read_text().strip() if args.token_file else None
    version: Union[int, str] = int(args.version) if str(args.version).isdigit() else args.version
    srv = SeedServer(args.coordinator, args.model, version=version, layout=args.layout, token=token,
                     host=args.host, port=args.port, lease_seconds=args.lease_seconds)
    try:
        url = srv.start()
    except Exception as e:
        print(f"tensorhub seed: {e}", file=sys.stderr)
        return 2
    print(f"tensorhub seed for SGLang serving on {url}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        srv.stop()


if __name__ == "__main__":
    sys.exit(main())
