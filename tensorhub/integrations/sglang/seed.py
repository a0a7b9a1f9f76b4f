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

This server (``python -m tensorhub.integrations.sglang.seed --coordinator URL --model NAME
[--version N] [--layout L] [--host H] [--port P] [--lease-seconds S] [--max-leases N]``,
or :class:`SeedServer` in any process) answers from the coordinator instead of from one
engine: for rank R it takes a read lease on shard R of the model's engine-native layout
(what SGLang engines started with ``--load-format tensorhub`` register in place) and
returns the chosen replica's Mooncake endpoint and tensor addresses. Any TensorHub
replica of that layout is the seed, the least loaded and nearest first; the seed process
itself holds no weights and opens no Mooncake engine.

Access. The seed listens on ``127.0.0.1`` unless told otherwise (``host`` /
``--host 0.0.0.0``): its answers are memory addresses and data-plane endpoints. When a
token is configured (``token`` / ``--token-file``, else ``$TENSORHUB_TOKEN``: the same
token the seed sends to the coordinator), every route but ``/health`` needs it, either
as ``Authorization: Bearer <token>`` or as HTTP Basic auth with the token as password
(any user name); anything else gets ``401 {"error": {"message": ...}}`` and opens no
lease. SGLang's client (``requests.get`` with no headers) cannot send a header, but
``requests`` sends Basic auth from a netrc file: give the reader's processes
``machine SEED_HOST login tensorhub password <token>`` (``SEED_HOST`` as written in
``--remote-instance-weight-loader-seed-instance-ip``) in ``~/.netrc`` or in the file
``$NETRC`` names. There is no query-parameter form: SGLang builds the URL itself, so it
could not send one either. Serving beyond loopback without a token logs a warning.

Leases. A reader is its client address plus what it asked for (model, resolved version,
layout, rank): SGLang sends nothing that names an engine. The first GET of a reader
opens one coordinator lease and keeps it (renewed at the coordinator before its TTL
runs out) until ``lease_seconds`` (default 120) after that reader's *last* GET; a GET
while it is held renews that same lease and answers the same replica (another one,
pinned by the same lease, only if the coordinator no longer offers that one). So several
engines on one host reading the same shard share one lease, and so do readers behind
one NAT or proxy. The table holds at most ``max_leases`` (default 1024) open leases; a
new reader beyond that gets ``503`` until one lapses. ``stop()`` releases every lease.

Consistency an unmodified SGLang reader gets. SGLang reads raw bytes, checks only each
parameter's ``numel`` and ``element_size``, never learns a version, never re-reads and
never says when it is done, so the guarantee is only as long as the lease:

* The answer names version v's replica of shard R (``version`` fixed, or the newest
  complete one when the GET arrives). A holder overwrites a replica only after
  unpublishing it, and unpublishing waits for every lease on it (DESIGN invariant 3), so
  a read that *ends* within ``lease_seconds`` of the reader's last GET copies exactly
  v's bytes.
* A read that ends later (a slow link, a large model, a long memory registration between
  SGLang's GET and its read) may copy bytes the holder has since overwritten with
  another version, in some tensors and not others. SGLang cannot notice; the engine
  then serves mixed weights. Set ``lease_seconds`` above the slowest full read.
* With ``version="latest"`` each TP rank resolves the version at its own GET: ranks whose
  GETs straddle a publish load different versions. Pin ``--version N`` for a TP group.
* The lease also ends early when the seed stops (``stop()`` releases every lease), when
  the seed process dies or cannot reach the coordinator for longer than the
  coordinator's lease TTL (30 s by default; logged as a warning when the seed notices),
  and whatever the lease says, a holder that dies takes its memory with it: SGLang's read
  then fails and the engine does not start (no retry from another replica).

Limits, from SGLang's side: the reader must have the same TP size (rank R reads shard R)
and the same parameter names, sizes and dtypes (the layout fingerprint); its own
``transfer_engine`` must reach the holders (Mooncake has no authentication: trusted
network only). The ``nccl`` backend (``/init_weights_send_group_for_remote_instance``,
``/send_weights_to_remote_instance``) needs a GPU process group with the seed and is
answered with an error naming the ``transfer_engine`` backend.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import hmac
import ipaddress
import logging
import math
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Hashable, Optional, Sequence, Union

logger = logging.getLogger(__name__)

__all__ = ["SeedServer", "main"]

#: How long a reader's source stays pinned after its last GET, by default (seconds).
LEASE_SECONDS = 120.0
#: How many leases the seed holds at once, by default.
MAX_LEASES = 1024
_TICK = 0.5  # how often the lease loop looks for leases to renew or release


class SeedError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


@dataclass
class _Lease:
    """One coordinator lease the seed holds for a reader (or for one direct ``info()`` call)."""

    lease_id: str
    replica_id: str
    answer: dict
    until: float  # monotonic: released then
    renew_at: float  # monotonic: renewed at the coordinator then


class SeedServer:
    """SGLang's seed endpoints for one model; see the module docstring.

    Lifecycle (all in the seed's process): ``start()`` connects a Hub (control plane only)
    and serves on a background thread, returning the URL; ``stop()`` releases every lease
    and closes the Hub.

    ``host`` defaults to loopback; ``token`` defaults to ``$TENSORHUB_TOKEN`` and is both
    sent to the coordinator and required from clients. ``lease_seconds``: how long a
    reader's replica stays pinned after its last GET. ``max_leases``: most leases held
    at once (new readers beyond get 503)."""

    def __init__(self, coordinator: Optional[str], model: str, *, version: Union[int, str] = "latest",
                 layout: Optional[str] = None, token: Optional[str] = None, host: str = "127.0.0.1",
                 port: int = 0, lease_seconds: float = LEASE_SECONDS, max_leases: int = MAX_LEASES,
                 worker_id: Optional[str] = None) -> None:
        if not lease_seconds > 0:
            raise ValueError(f"lease_seconds must be > 0, got {lease_seconds!r}")
        if max_leases < 1:
            raise ValueError(f"max_leases must be >= 1, got {max_leases!r}")
        self.coordinator, self.model, self.version, self.layout = coordinator, model, version, layout
        self.token, self.host, self.port, self.lease_seconds = token, host, port, lease_seconds
        self.max_leases, self.worker_id = max_leases, worker_id
        self.url: Optional[str] = None
        self.hub: Any = None
        self._expected: Optional[bytes] = None  # the token clients must send; None: open
        self._leases: dict[Hashable, _Lease] = {}  # reader key (or lease id) -> lease
        self._lock = threading.Lock()  # guards _leases
        self._serve = threading.Lock()  # one answer at a time: a reader's GETs never race into two leases
        self._stop = threading.Event()

    # ------------------------------------------------------------------ answers
    def info(self, rank: int, reader: Optional[str] = None) -> dict:
        """The answer for TP rank ``rank``: ``{"rank", "remote_instance_transfer_engine_info":
        [session_id, {name: [address, numel, element_size]}]}``; SeedError when none.

        ``reader`` names who asks (the HTTP routes pass the client's address): while that
        reader holds a lease on the same version, layout and rank, the lease is renewed
        and the same replica answered. ``None`` opens a new lease on every call."""
        import tensorhub

        if rank < 0:
            raise SeedError(400, "Missing or invalid rank parameter")
        with self._serve:
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
            key = None if reader is None else (reader, v, layout, rank)
            if key is not None:
                held = self._renewed(key, v, layout, rank)
                if held is not None:
                    return held
            with self._lock:
                open_ = sum(1 for e in self._leases.values() if e.until > time.monotonic())
            if open_ >= self.max_leases:
                raise SeedError(503, f"tensorhub seed: {open_} leases open (max_leases {self.max_leases}); "
                                     "ask again once one lapses")
            try:
                grant = self.hub.lease(self.model, v, layout=layout, shard=rank, timeout=10)
            except tensorhub.TensorHubError as e:
                raise SeedError(404, f"tensorhub seed: {e}") from None
            picked = self._answer(grant, rank)
            if picked is None:
                self.hub.release(grant.lease_id)
                raise SeedError(404, f"tensorhub seed: no complete replica of {self.model!r} v{v} shard {rank} yet")
            now = time.monotonic()
            lease = _Lease(grant.lease_id, picked[0], picked[1], now + self.lease_seconds, now + grant.ttl / 3)
            with self._lock:
                self._leases[key if key is not None else grant.lease_id] = lease
            logger.info("tensorhub seed: rank %d of %s v%d (%s) for %s -> %s (%d tensors, %.1f MB), lease %s",
                        rank, self.model, v, layout, reader or "a direct call",
                        picked[1]["remote_instance_transfer_engine_info"][0],
                        len(grant.manifest.tensors), grant.manifest.nbytes / 1e6, grant.lease_id)
            return picked[1]

    def _renewed(self, key: Hashable, v: int, layout: str, rank: int) -> Optional[dict]:
        """The held lease of reader ``key``, renewed, and its answer; None if it holds none
        (or the coordinator says it lapsed)."""
        import tensorhub

        now = time.monotonic()
        with self._lock:
            lease = self._leases.get(key)
            if lease is None or lease.until <= now:
                return None
            lease.until = now + self.lease_seconds  # the lease loop no longer releases it
        if not self._renew(key, lease):
            return None
        try:  # the same lease, re-pointed: the coordinator leaves out replicas gone or draining
            grant = self.hub.api.acquire_lease({
                "worker_id": self.hub.worker_id, "model": self.model, "version": v, "layout": layout,
                "shard": rank, "max_sources": self.hub.max_sources, "lease_id": lease.lease_id})
        except tensorhub.TensorHubError as e:  # e.g. no replica serving now; the lease stays
            raise SeedError(404, f"tensorhub seed: {e}") from None
        if any(r.replica_id == lease.replica_id for r in grant.replicas if r.chunks is None):
            logger.debug("tensorhub seed: %s asked again; lease %s renewed", key, lease.lease_id)
            return lease.answer
        picked = self._answer(grant, rank)
        if picked is None:
            raise SeedError(404, f"tensorhub seed: no complete replica of {self.model!r} v{v} shard {rank} now")
        with self._lock:
            lease.replica_id, lease.answer = picked
        logger.info("tensorhub seed: %s asked again; its replica is gone, now %s (lease %s)", key,
                    picked[1]["remote_instance_transfer_engine_info"][0], lease.lease_id)
        return lease.answer

    def _answer(self, grant: Any, rank: int) -> Optional[tuple[str, dict]]:
        """(replica id, SGLang's answer) for the grant's first complete replica; None if none."""
        from tensorhub.protocol import DTYPE_SIZES

        full = [x for x in grant.replicas if x.chunks is None]  # never a replica still receiving
        if not full:
            return None
        r = full[0]
        weights = {spec.name: [addr, math.prod(spec.shape), DTYPE_SIZES[spec.dtype]]
                   for spec, addr in zip(grant.manifest.tensors, r.addresses)}
        return r.replica_id, {"rank": rank, "remote_instance_transfer_engine_info": [r.endpoint, weights]}

    def _layout(self, v: int) -> tuple[str, int]:
        vi = self.hub.version_info(self.model, v)
        if vi is None:
            raise SeedError(404, f"tensorhub seed: {self.model!r} has no version {v}")
        native = {k: li for k, li in vi.layouts.items() if k != "hf" and li.complete}
        if self.layout is not None:
            li = vi.layouts.get(self.layout)
            if li is None or not li.complete:
                raise SeedError(404, f"tensorhub seed: {self.model!r} v{v} has no complete layout {self.layout} "
                                     f"(complete engine-native layouts: {sorted(native) or 'none'})")
            return self.layout, li.num_shards
        if len(native) != 1:
            why = "none; start an engine with --load-format tensorhub (native on)" if not native else \
                f"several ({', '.join(sorted(native))}); pass --layout"
            raise SeedError(404, f"tensorhub seed: {self.model!r} v{v}: complete engine-native layouts: {why}")
        (name, li), = native.items()
        return name, li.num_shards

    # ------------------------------------------------------------------ leases
    def _lease_loop(self) -> None:
        while not self._stop.wait(_TICK):
            self._tend(time.monotonic())

    def _tend(self, now: float, release_all: bool = False) -> None:
        """Release the leases whose ``lease_seconds`` ran out (all with ``release_all``);
        renew at the coordinator those a third into their TTL."""
        with self._lock:
            due = [k for k, e in self._leases.items() if release_all or e.until <= now]
            gone = [self._leases.pop(k) for k in due]
            renew = [(k, e) for k, e in self._leases.items() if e.renew_at <= now]
        for e in gone:
            try:
                self.hub.release(e.lease_id)
            except Exception as exc:  # expired or coordinator away: the lease lapses by itself
                logger.debug("tensorhub seed: release %s: %s", e.lease_id, exc)
        for k, e in renew:
            self._renew(k, e)

    def _renew(self, key: Hashable, lease: _Lease) -> bool:
        """Renew at the coordinator; False (and the lease dropped) once it says it lapsed."""
        import tensorhub

        try:
            ttl = self.hub.api.renew_lease(lease.lease_id, retry_timeout=2.0)
        except tensorhub.ConflictError as e:
            logger.warning("tensorhub seed: lease %s (%s) lapsed at the coordinator before its lease_seconds "
                           "ran out: its holder may now overwrite what that reader copies (%s)",
                           lease.lease_id, key, e.message)
            with self._lock:
                if self._leases.get(key) is lease:
                    del self._leases[key]
            return False
        except Exception as e:  # coordinator away for now: try again on the next tick
            logger.debug("tensorhub seed: renew %s: %s", lease.lease_id, e)
            lease.renew_at = time.monotonic() + _TICK
            return True
        lease.renew_at = time.monotonic() + ttl / 3
        return True

    # ------------------------------------------------------------------ server
    def _authorized(self, header: Optional[str]) -> bool:
        """``Authorization: Bearer <token>``, or Basic with the token as password."""
        if self._expected is None:
            return True
        given = b""
        scheme, _, cred = (header or "").strip().partition(" ")
        if scheme.lower() == "bearer":
            given = cred.strip().encode()
        elif scheme.lower() == "basic":
            try:
                given = base64.b64decode(cred.strip(), validate=True).partition(b":")[2]
            except (binascii.Error, ValueError):
                given = b""
        return hmac.compare_digest(given, self._expected)

    def app(self) -> Any:
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse, PlainTextResponse

        app = FastAPI(title="tensorhub seed for SGLang remote_instance")

        @app.middleware("http")
        async def guard(request: Request, call_next: Any) -> Any:
            if request.url.path != "/health" and not self._authorized(request.headers.get("authorization")):
                return JSONResponse({"error": {"message": (
                    "tensorhub seed: missing or wrong token; send 'Authorization: Bearer <token>' (the "
                    "coordinator's token), or Basic auth with it as password (SGLang: a netrc entry for this "
                    "host)")}}, status_code=401, headers={"WWW-Authenticate": 'Bearer, Basic realm="tensorhub seed"'})
            return await call_next(request)

        @app.get("/health")
        def health() -> Any:
            return PlainTextResponse("OK")

        def answer(request: Request, rank: Optional[int]) -> Any:
            try:
                if rank is None:
                    raise SeedError(400, "Missing or invalid rank parameter")
                return self.info(rank, request.client.host if request.client else "unknown")
            except SeedError as e:
                return JSONResponse({"error": {"message": e.message}}, status_code=e.status)

        def get_info(request: Request, rank: Optional[int] = None) -> Any:
            return answer(request, rank)

        # FastAPI reads annotations in this module's globals, where fastapi is not imported
        # (lazily, here): give it the class itself.
        get_info.__annotations__["request"] = Request
        for path in ("/get_remote_instance_transfer_engine_info", "/remote_instance_transfer_engine_info",
                     "/get_transfer_engine_info"):
            app.get(path)(get_info)

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
        from tensorhub import envs
        from tensorhub.coordinator import listen_socket, socket_url

        token = envs.pick(self.token, "TENSORHUB_TOKEN")
        self._expected = token.encode() if token else None
        self.hub = tensorhub.connect(self.coordinator, token=self.token, worker_id=self.worker_id)
        sock = listen_socket(self.host, self.port)
        self.url = socket_url(self.host, sock, False)
        if self._expected is None and not _loopback(self.host):
            logger.warning("tensorhub seed: serving on %s without a token: whoever reaches it learns the holders' "
                           "Mooncake endpoints and memory addresses; set TENSORHUB_TOKEN (the coordinator's)",
                           self.url)
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
        if getattr(self, "_leaser", None) is not None:
            self._leaser.join(timeout=10)
        if self.hub is not None:
            self._tend(time.monotonic(), release_all=True)
            self.hub.close()
            self.hub = None

    def __enter__(self) -> "SeedServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tensorhub.integrations.sglang.seed", description=__doc__.split("\n\n")[0])
    p.add_argument("--coordinator", help="coordinator URL (default: $TENSORHUB_COORDINATOR)")
    p.add_argument("--model", required=True, help="model name on the coordinator")
    p.add_argument("--version", default="latest", help="version to serve (default: the newest complete)")
    p.add_argument("--layout", help="engine-native layout (default: the version's only one)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; e.g. 0.0.0.0 for other hosts' readers)")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--token-file", help="file holding the API token, sent to the coordinator and required "
                                        "from readers (default: $TENSORHUB_TOKEN)")
    p.add_argument("--lease-seconds", type=float, default=LEASE_SECONDS,
                   help=f"how long a reader's source stays pinned after its last ask (default {LEASE_SECONDS:g})")
    p.add_argument("--max-leases", type=int, default=MAX_LEASES,
                   help=f"most leases held at once; new readers beyond get 503 (default {MAX_LEASES})")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    token = Path(args.token_file).read_text().strip() if args.token_file else None
    version: Union[int, str] = int(args.version) if str(args.version).isdigit() else args.version
    try:
        srv = SeedServer(args.coordinator, args.model, version=version, layout=args.layout, token=token,
                         host=args.host, port=args.port, lease_seconds=args.lease_seconds,
                         max_leases=args.max_leases)
        url = srv.start()
    except Exception as e:
        print(f"tensorhub seed: {e}", file=sys.stderr)
        return 2
    guard = "token required" if srv._expected is not None else "no token"
    print(f"tensorhub seed for SGLang serving on {url} ({guard})", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        srv.stop()


if __name__ == "__main__":
    sys.exit(main())
