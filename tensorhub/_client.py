"""HTTP client of the coordinator API: one method per route, answers as models of
``tensorhub.protocol``, errors mapped to our tree. Its paths and answer models are the
route table's (``protocol.routes``), which the server registers its routes from.

Connection failures and 5xx answers are retried with backoff for up to ``retry_timeout``
seconds (a coordinator restart looks like that); 4xx answers are not retried.

Highly available coordinators: ``url`` may list several, comma-separated
(``"http://c1:7777,http://c2:7777"``). A follower answers ``307`` with the leader's URL
(``Location``, and ``leader`` in the body) or ``503 not_leader`` while an election runs: the
client switches to the leader at once, and on a connection failure or a 503 it moves to
the next URL, sleeping with backoff and jitter once per round of the list. One URL behaves
as before (and follows a follower's redirect).
"""

from __future__ import annotations

import contextlib
import logging
import random
import ssl
import threading
import time
from typing import Any, Iterator, Mapping, Optional, Sequence

import httpx

from . import envs
from ._exceptions import (
    ConfigError,
    ConflictError,
    CoordinatorError,
    CoordinatorUnavailableError,
    InvalidRequestError,
    ManifestMismatchError,
    NotFoundError,
    RetentionError,
    UnauthorizedError,
)

from .protocol import (HeartbeatAnswer, LeaseGrant, Manifest, ReplicaRegistered, Unpublished, VersionView,
                       WorkerRegistered, WorkerRemoved)
from .protocol.routes import ROUTES

__all__ = ["CoordinatorClient"]

logger = logging.getLogger(__name__)

_BY_CODE = {"manifest_mismatch": ManifestMismatchError, "slice_overlap": ManifestMismatchError,
            "slice_gap": ManifestMismatchError, "retention": RetentionError}
_BY_STATUS = {401: UnauthorizedError, 404: NotFoundError, 409: ConflictError,
              400: InvalidRequestError, 411: InvalidRequestError, 413: InvalidRequestError,
              422: InvalidRequestError}


def coordinator_urls(url: str) -> list[str]:
    """The URLs in ``url`` (comma-separated), without trailing slashes; raises
    :class:`ConfigError` for an empty or non-http(s) entry."""
    urls = [u.strip().rstrip("/") for u in url.split(",")]
    if len(urls) > 1 or not url.strip():
        for u in urls:
            if not u.startswith(("http://", "https://")) or len(u) <= len("https://"):
                raise ConfigError(f"coordinator URL {u!r} (in {url!r}) is not http(s)://HOST:PORT")
    return urls


def error_from_response(resp: httpx.Response) -> CoordinatorError:
    try:
        body = resp.json()
        code, detail = str(body.get("code", "")), str(body.get("detail", resp.text))
    except Exception:
        code, detail = "", resp.text[:500]
    cls = _BY_CODE.get(code) or _BY_STATUS.get(resp.status_code) or CoordinatorError
    return cls(detail, code, status=resp.status_code)


def _code(resp: httpx.Response) -> str:
    try:
        return str(resp.json().get("code", ""))
    except Exception:
        return ""


def tls_verify(ca_file: Optional[str] = None, verify: bool = True) -> Any:
    """What httpx's ``verify`` gets for an https coordinator: an SSL context trusting
    ``ca_file`` (argument > ``TENSORHUB_CA_FILE``), else the system's CAs; ``False`` when
    ``verify`` is false (no check at all: tests only)."""
    if not verify:
        return False
    ca_file = envs.pick(ca_file, "TENSORHUB_CA_FILE")
    if not ca_file:
        return True
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"cannot use CA file {ca_file!r}: {e}") from None


def _tls_failure(e: BaseException) -> bool:
    """Is a failed certificate check (or https to a plain-http port) in ``e``'s causes?
    Other SSL errors (a peer that died mid-handshake) stay retryable."""
    seen: Optional[BaseException] = e
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, ssl.SSLCertVerificationError) or (
            isinstance(seen, ssl.SSLError) and getattr(seen, "reason", None) == "WRONG_VERSION_NUMBER"
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class CoordinatorClient:
    """One per Hub; thread-safe (httpx.Client is).

    ``ca_file``: PEM CA bundle that signed an https coordinator's certificate (default
    ``TENSORHUB_CA_FILE``, else the system's CAs); ``verify=False`` turns checking off."""

    def __init__(self, url: str, token: Optional[str] = None, *, timeout: float = 30.0,
                 retry_timeout: float = 60.0, verify: bool = True, ca_file: Optional[str] = None) -> None:
        #: Every coordinator URL given (a leader named by a redirect is added).
        self.urls = coordinator_urls(url)
        #: The coordinator this client talks to now (the leader, once found).
        self.url = self.urls[0]
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(headers=headers, timeout=timeout, verify=tls_verify(ca_file, verify))
        self.retry_timeout = retry_timeout
        self._local = threading.local()
        self._switch = threading.Lock()

    def _next(self, failed: str) -> bool:
        """``failed`` did not answer: move to the next URL; True when a round of the
        list is complete (time to sleep)."""
        with self._switch:
            if self.url != failed:  # another thread moved already
                return False
            i = self.urls.index(failed) if failed in self.urls else -1
            self.url = self.urls[(i + 1) % len(self.urls)]
            return (i + 1) % len(self.urls) == 0

    def _follow(self, resp: httpx.Response, current: str) -> bool:
        """A follower's answer (307 / 503 ``not_leader``): switch to the leader it names.
        False when it names none (or itself)."""
        leader: Optional[str] = None
        try:
            leader = resp.json().get("leader")
        except Exception:
            pass
        if not leader and resp.status_code == 307:
            loc = resp.headers.get("location", "")
            path = httpx.URL(loc).path
            leader = loc.split(path, 1)[0] if path and path != "/" else loc
        if not isinstance(leader, str) or not leader.startswith(("http://", "https://")):
            return False
        leader = leader.rstrip("/")
        if current.startswith("https://") and not leader.startswith("https://"):
            return False  # never downgrade to plain http on a follower's word
        with self._switch:
            if leader == current:
                return False
            if leader not in self.urls:
                self.urls.append(leader)
            self.url = leader
        logger.info("coordinator %s is a follower; leader is %s", current, leader)
        return True

    def close(self) -> None:
        self._http.close()

    @contextlib.contextmanager
    def bounded(self, deadline: float) -> Iterator[None]:
        """Within this block (this thread only), no request retries past ``deadline``
        (``time.monotonic()``): a caller's own deadline wins over the retry budget."""
        outer = getattr(self._local, "deadline", None)
        self._local.deadline = deadline if outer is None else min(outer, deadline)
        try:
            yield
        finally:
            self._local.deadline = outer

    def request(self, method: str, path: str, *, json: Any = None, params: Any = None,
                retry_timeout: Optional[float] = None, timeout: Optional[float] = None) -> Any:
        budget = self.retry_timeout if retry_timeout is None else retry_timeout
        deadline = time.monotonic() + budget
        cap = getattr(self._local, "deadline", None)
        if cap is not None and cap < deadline:
            deadline, budget = cap, max(0.0, cap - time.monotonic())
        delay = 0.05
        several = len(self.urls) > 1
        hops = 0  # redirects followed without an answer (a loop between confused followers)
        while True:
            url = self.url
            sleep = True
            try:
                kw: dict[str, Any] = {"json": json, "params": params}
                if timeout is not None:
                    kw["timeout"] = timeout
                resp = self._http.request(method, url + path, **kw)
            except httpx.TransportError as e:
                if _tls_failure(e):  # permanent: retrying cannot help
                    raise CoordinatorUnavailableError(
                        f"TLS handshake with {url} failed ({e}); pass ca_file= / --ca-file or set "
                        "TENSORHUB_CA_FILE to the CA that signed the coordinator's certificate", "tls",
                    ) from None
                problem: str = f"{type(e).__name__}: {e}"
                if several:
                    sleep = self._next(url)
            else:
                if resp.status_code < 300:
                    return resp.json()
                not_leader = resp.status_code == 307 or (
                    resp.status_code == 503 and resp.headers.get("content-type", "").startswith("application/json")
                    and _code(resp) == "not_leader")
                if not_leader:
                    problem = f"{url} is not the leader"
                    if hops < 8 and self._follow(resp, url):
                        hops += 1
                        continue  # ask the leader at once
                    if several:
                        sleep = self._next(url)
                elif resp.status_code < 500:
                    raise error_from_response(resp)
                else:
                    problem = f"HTTP {resp.status_code}: {resp.text[:200]}"
                    if several and resp.status_code == 503:
                        sleep = self._next(url)
            if not sleep and time.monotonic() < deadline:
                continue  # try the next coordinator of this round at once
            if time.monotonic() + delay > deadline:
                where = f"coordinators {','.join(self.urls)}" if several else f"coordinator {url}"
                raise CoordinatorUnavailableError(
                    f"{where} unreachable for {budget:.0f}s ({method} {path}): {problem}",
                    "unavailable",
                )
            logger.debug("coordinator %s %s failed (%s); retrying in %.2fs", method, path, problem, delay)
            if several:  # several clients after one failover: spread their retries
                time.sleep(delay * random.uniform(0.5, 1.0))
                delay = min(delay * 2, 0.5)
            else:
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
            hops = 0

    def get(self, path: str, **kw: Any) -> Any:
        return self.request("GET", path, **kw)

    def post(self, path: str, json: Any = None, **kw: Any) -> Any:
        return self.request("POST", path, json=json if json is not None else {}, **kw)

    def delete(self, path: str, **kw: Any) -> Any:
        return self.request("DELETE", path, **kw)

    # ------------------------------------------------------------------ routes
    def call(self, name: str, body: Any = None, *, params: Any = None, kw: Optional[dict] = None,
             **path: Any) -> Any:
        """Route ``name`` of ``protocol.routes.ROUTES`` (its method, its path filled from
        ``path``), its answer read as its answer model (a plain dict or list where it has none)."""
        r = ROUTES[name]
        if r.method == "POST" and body is None:
            body = {}
        answer = self.request(r.method, r.url(**path), json=body, params=params, **(kw or {}))
        return answer if r.answer is None else r.answer.model_validate(answer)

    def info(self, **kw: Any) -> dict:
        """The coordinator's epoch, time and timing settings (``protocol.Info``), as a dict."""
        return self.call("info", kw=kw).model_dump(exclude_unset=True)

    def status(self, **kw: Any) -> dict:
        """Everything ``tensorhub status`` shows (models, versions, replicas, workers, leases, fetches)."""
        return self.call("status", kw=kw)

    def version(self, model: str, version: int, **kw: Any) -> VersionView:
        """One version now (layouts, replicas); NotFoundError if the coordinator has none."""
        return self.call("version", model=model, version=version, kw=kw)

    def models(self, **kw: Any) -> list:
        """Every model: ``{"model", "counter", "latest"}`` each (``protocol.ModelEntry``)."""
        return [m.model_dump(exclude_unset=True) for m in self.call("models", kw=kw).root]

    def register_worker(self, worker_id: str, endpoint: str, locality: Mapping[str, str], **kw: Any) -> WorkerRegistered:
        return self.call("register_worker", {"worker_id": worker_id, "endpoint": endpoint, "locality": dict(locality)},
                         kw=kw)

    def heartbeat(self, worker_id: str, fetches: Sequence[Mapping[str, Any]] = (), **kw: Any) -> HeartbeatAnswer:
        """``fetches``: fetch reports carried in the body (progress folded into heartbeats)."""
        return self.call("heartbeat", {"fetches": list(fetches)} if fetches else None, worker_id=worker_id, kw=kw)

    def remove_worker(self, worker_id: str, **kw: Any) -> WorkerRemoved:
        return self.call("remove_worker", worker_id=worker_id, kw=kw)

    def allocate_version(self, model: str, version: Optional[int] = None, request_id: Optional[str] = None,
                         **kw: Any) -> int:
        body: dict[str, Any] = {"version": version}
        if request_id is not None:
            body["request_id"] = request_id
        return self.call("allocate_version", body, model=model, kw=kw).version

    def latest(self, model: str, *, newer_than: Optional[int] = None, wait: Optional[float] = None,
               **kw: Any) -> Optional[int]:
        params: dict[str, Any] = {}
        if wait is not None:
            params["wait"] = wait
        if newer_than is not None:
            params["newer_than"] = newer_than
        return self.call("latest", params=params or None, model=model, kw=kw).version

    # fleet switch groups (``server.fleet``): plain JSON answers
    def fleet_join(self, group: str, member: str, model: str, version: Optional[int], switch: str = "auto",
                   wait: float = 60.0, engine: Optional[str] = None, **kw: Any) -> dict:
        return self.call("fleet_join", {"member": member, "model": model, "version": version, "switch": switch,
                                        "wait": wait, "engine": engine}, group=group, kw=kw)

    def fleet_ready(self, group: str, member: str, version: int, **kw: Any) -> dict:
        return self.call("fleet_ready", {"member": member, "version": version}, group=group, kw=kw)

    def fleet_switch(self, group: str, model: str, version: int, wait: Optional[float] = None, **kw: Any) -> dict:
        return self.call("fleet_switch", {"model": model, "version": version, "wait": wait}, group=group, kw=kw)

    def fleet_round(self, group: str, version: int, member: Optional[str] = None, **kw: Any) -> dict:
        return self.call("fleet_round", params={"member": member} if member else None, group=group, version=version,
                         kw=kw)

    def fleet_applied(self, group: str, member: str, version: int, ok: bool, error: Optional[str] = None,
                      **kw: Any) -> dict:
        return self.call("fleet_applied", {"member": member, "version": version, "ok": ok,
                                           "error": None if error is None else error[:2000]}, group=group, kw=kw)

    def fleet(self, group: str, **kw: Any) -> dict:
        return self.call("fleet", group=group, kw=kw)

    def resolve(self, model: str, group: Optional[str] = None, **kw: Any) -> int:
        return self.call("resolve", {"group": group}, model=model, kw=kw).version

    def register_replica(self, body: Mapping[str, Any], **kw: Any) -> ReplicaRegistered:
        return self.call("register_replica", dict(body), kw=kw)

    def manifest(self, model: str, version: int, layout: str = "hf", shard: int = 0, **kw: Any) -> Manifest:
        return self.call("manifest", params={"layout": layout, "shard": shard}, model=model, version=version, kw=kw)

    def unpublish(self, model: str, version: int, worker_id: str, replica_ids: Optional[Sequence[str]] = None,
                  **kw: Any) -> Unpublished:
        body: dict[str, Any] = {"worker_id": worker_id}
        if replica_ids is not None:
            body["replica_ids"] = list(replica_ids)
        return self.call("unpublish", body, model=model, version=version, kw=kw)

    def report_replica(self, replica_id: str, worker_id: str, reason: str, **kw: Any) -> None:
        self.call("report_replica", {"worker_id": worker_id, "reason": reason[:1000]}, replica_id=replica_id, kw=kw)

    def report_chunks(self, replica_id: str, worker_id: str, chunks: Sequence[int], lease_ids: Sequence[str],
                      coming: Sequence[int], **kw: Any) -> int:
        return self.call("report_chunks", {"worker_id": worker_id, "chunks": list(chunks), "lease_ids": list(lease_ids),
                                           "coming": list(coming)}, replica_id=replica_id, kw=kw).held

    def acquire_lease(self, body: Mapping[str, Any], *, wait: Optional[float] = None, **kw: Any) -> LeaseGrant:
        """A lease (``body``: the ``AcquireLease`` fields). Asked ahead (``ahead``), held up to
        ``wait`` seconds: None when no version came meanwhile (ask again, same request id)."""
        if wait is None:
            return self.call("acquire_lease", dict(body), kw=kw)
        kw.setdefault("timeout", wait + 30.0)
        r = ROUTES["acquire_lease"]
        answer = self.request(r.method, r.path, json=dict(body), params={"wait": wait}, **kw)
        return None if answer.get("pending") else LeaseGrant.model_validate(answer)  # type: ignore[return-value]

    def renew_lease(self, lease_id: str, **kw: Any) -> float:
        return self.call("renew_lease", lease_id=lease_id, kw=kw).ttl

    def release_lease(self, lease_id: str, **kw: Any) -> bool:
        return self.call("release_lease", lease_id=lease_id, kw=kw).valid

    def lease_covers(self, lease_id: str, replica_id: str, worker_id: str, proof: str, endpoint: str,
                     **kw: Any) -> bool:
        """Is the lease valid now, ``worker_id``'s, naming ``replica_id``, and ``proof`` its
        reader's ``lease_proof`` for the holder at ``endpoint``? (same-host reads, holder side)"""
        return self.call("lease_covers", {"replica_id": replica_id, "worker_id": worker_id, "proof": proof,
                                          "endpoint": endpoint}, lease_id=lease_id, kw=kw).valid

    #: Telemetry kinds ``report`` sends (``FetchReport``, ``SwapReport``): their routes.
    REPORTS = {"fetch": "report_fetch", "swap": "report_swap"}

    def report(self, kind: str, body: Mapping[str, Any], **kw: Any) -> None:
        self.call(self.REPORTS[kind], dict(body), kw=kw)
