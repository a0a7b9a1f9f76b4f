"""Durable store of highly available coordinators: etcd v3 (``--store etcd://h1:2379,h2:2379``).

Same interface as :class:`~tensorhub.server.store.SqliteStore` (``open/close/load/commit``) and
the same rows, kept under a key prefix (default ``/tensorhub/``)::

    {prefix}leader                      the elected coordinator (``server.election``), on its lease
    {prefix}members/{id}                every running coordinator's URL, on its lease
    {prefix}d/{table}/{json key}        one durable row (value: JSON)

``commit`` is ONE etcd transaction, conditioned on

* this coordinator still holding leadership: the leader key's ``create_revision`` equals
  the one its campaign created (a key on an expired lease is gone; a newer leader's key
  has a newer revision), so a deposed (paused, partitioned) leader cannot write;
* every version counter it raises still having the value this store last saw, so no
  two coordinators ever hand out the same version number even if both believed they led.

A refused transaction raises :class:`Fenced`; the coordinator then steps down and never
answers the request whose writes were refused.

The client is ``etcd3gw`` (etcd's v3 JSON gateway over HTTP; docs/operations/ha.md says
why): imported lazily, so SQLite-only installs need nothing more. Endpoints are tried in
turn: a dead etcd member costs one connection attempt, not the service.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional
from urllib.parse import urlsplit

from .._exceptions import ConfigError, TensorHubError
from .catalog import Write
from ..protocol import Manifest, manifest_json

__all__ = ["EtcdStore", "EtcdEndpoints", "EtcdUnavailable", "Fenced", "parse_store_url"]

logger = logging.getLogger(__name__)

TABLES = ("model", "version", "layout", "manifest", "allocation")


class EtcdUnavailable(TensorHubError):
    """No etcd endpoint answered."""


class Fenced(TensorHubError):
    """etcd refused a write: this coordinator no longer leads (or a counter moved)."""


@dataclass(frozen=True)
class StoreURL:
    """A parsed ``--store`` value: ``etcd://h1:2379,h2:2379[/prefix]`` (``etcds://`` = TLS)."""

    endpoints: tuple[tuple[str, int], ...]
    prefix: str
    tls: bool


def parse_store_url(url: str) -> StoreURL:
    """``etcd://HOST:PORT[,HOST:PORT...][/PREFIX]``; ``etcds://`` speaks TLS to etcd.
    Raises :class:`ConfigError` naming what is wrong."""
    parts = urlsplit(url)
    if parts.scheme not in ("etcd", "etcds"):
        raise ConfigError(f"--store {url!r}: expected sqlite (the default) or etcd://HOST:PORT[,HOST:PORT...]")
    if parts.query or parts.fragment or "@" in parts.netloc:
        raise ConfigError(f"--store {url!r}: no user, query or fragment allowed (TLS files: --etcd-ca-file ...)")
    endpoints = []
    for hp in parts.netloc.split(","):
        host, sep, port = hp.rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"--store {url!r}: endpoint {hp!r} is not HOST:PORT")
        endpoints.append((host, int(port)))
    prefix = parts.path.strip("/")
    prefix = f"/{prefix}/" if prefix else "/tensorhub/"
    return StoreURL(tuple(endpoints), prefix, parts.scheme == "etcds")


def _b64(s: str | bytes) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


def _unb64(s: str) -> bytes:
    return base64.b64decode(s)


def prefix_end(prefix: str) -> str:
    """The range end covering every key that starts with ``prefix``."""
    b = prefix.encode()
    return (b[:-1] + bytes([b[-1] + 1])).decode()


class EtcdEndpoints:
    """The etcd members, tried in turn; one is current until it fails to answer.

    ``post(path, body)`` sends one v3 gateway request (``/v3/kv/txn`` ...) and returns the
    JSON answer. Connection failures and timeouts move to the next member; an answer
    (even an error) does not. Thread-safe (one ``requests`` session per member)."""

    def __init__(self, url: StoreURL, *, timeout: float = 1.0, ca_file: Optional[str] = None,
                 cert_file: Optional[str] = None, key_file: Optional[str] = None) -> None:
        try:
            from etcd3gw.client import Etcd3Client
        except ImportError:
            raise ConfigError("the etcd store needs etcd3gw: pip install 'tensorhub-ros[etcd]'") from None

        self.url = url
        self._clients = [
            Etcd3Client(host=h, port=p, protocol="https" if url.tls else "http", ca_cert=ca_file,
                        cert_key=key_file, cert_cert=cert_file, timeout=timeout, api_path="/v3/")
            for h, p in url.endpoints
        ]
        self._current = 0
        self._lock = threading.Lock()

    def post(self, path: str, body: dict) -> dict:
        from etcd3gw import exceptions as ex

        with self._lock:
            start = self._current
        errors = []
        n = len(self._clients)
        for i in range(n):
            k = (start + i) % n
            c = self._clients[k]
            try:
                out = c.post(c.get_url(path), json=body)
            except (ex.ConnectionFailedError, ex.ConnectionTimeoutError) as e:
                errors.append(f"{self.url.endpoints[k][0]}:{self.url.endpoints[k][1]}: {type(e).__name__}")
                continue
            except ex.Etcd3Exception as e:
                raise EtcdUnavailable(f"etcd {path} failed: {e}") from None
            if k != start:
                with self._lock:
                    self._current = k
            return out
        raise EtcdUnavailable(f"no etcd member answered {path}: {'; '.join(errors)}")

    def close(self) -> None:
        for c in self._clients:
            c.session.close()

    # ------------------------------------------------------------ small helpers
    def range(self, key: str, range_end: Optional[str] = None) -> list[dict]:
        body: dict[str, Any] = {"key": _b64(key)}
        if range_end is not None:
            body["range_end"] = _b64(range_end)
        return self.post("/kv/range", body).get("kvs", [])

    def get(self, key: str) -> Optional[dict]:
        kvs = self.range(key)
        return kvs[0] if kvs else None

    def txn(self, compare: list, success: list, failure: Optional[list] = None) -> dict:
        return self.post("/kv/txn", {"compare": compare, "success": success, "failure": failure or []})

    @staticmethod
    def value(kv: dict) -> str:
        return _unb64(kv.get("value", "")).decode()


def _put(key: str, value: str, lease: Optional[int] = None) -> dict:
    p: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease is not None:
        p["lease"] = str(lease)
    return {"request_put": p}


def _delete(key: str) -> dict:
    return {"request_delete_range": {"key": _b64(key)}}


class EtcdStore:
    """Durable rows in etcd. The coordinator process opens one and uses it under its lock.

    ``fence()`` gives the compare that proves leadership (``server.election.Election.fence``);
    without one (a single coordinator on etcd, the contract tests) commits are
    conditioned on the counters only."""

    def __init__(self, url: str | StoreURL, *, fence: Optional[Callable[[], Optional[dict]]] = None,
                 timeout: float = 2.0, ca_file: Optional[str] = None, cert_file: Optional[str] = None,
                 key_file: Optional[str] = None) -> None:
        self.url = parse_store_url(url) if isinstance(url, str) else url
        self.path = ",".join(f"{h}:{p}" for h, p in self.url.endpoints) + self.url.prefix  # for logs
        self.prefix = self.url.prefix
        self.fence = fence
        self._tls = dict(timeout=timeout, ca_file=ca_file, cert_file=cert_file, key_file=key_file)
        self.etcd: Optional[EtcdEndpoints] = None
        #: model -> counter this store last read or wrote (the txn's compare).
        self._counters: dict[str, int] = {}

    def open(self) -> None:
        """Connect (raises :class:`EtcdUnavailable` if no member answers). Idempotent."""
        if self.etcd is not None:
            return
        self.etcd = EtcdEndpoints(self.url, **self._tls)
        try:
            self.etcd.post("/maintenance/status", {})
        except EtcdUnavailable as e:
            self.etcd.close()
            self.etcd = None
            raise EtcdUnavailable(f"cannot reach etcd at {self.path}: {e}") from None

    def close(self) -> None:
        if self.etcd is not None:
            self.etcd.close()
            self.etcd = None

    def _key(self, table: str, key: tuple) -> str:
        return f"{self.prefix}d/{table}/{json.dumps(list(key), separators=(',', ':'))}"

    def load(self) -> list[Write]:
        """Every durable row, as the writes that would recreate it (one consistent read)."""
        etcd = self._conn()
        base = f"{self.prefix}d/"
        rows: list[Write] = []
        counters = {}
        for kv in etcd.range(base, prefix_end(base)):
            table, _, key = _unb64(kv["key"]).decode()[len(base):].partition("/")
            key_t = tuple(json.loads(key))
            value = json.loads(etcd.value(kv))
            if table == "manifest":
                value = Manifest.model_validate(value)
            elif table == "model":
                counters[key_t[0]] = value
            if table in TABLES:
                rows.append((table, key_t, value))
        self._counters = counters
        return rows

    def commit(self, writes: Iterable[Write]) -> None:
        """Apply ``writes`` in one transaction (see the module docstring); raises
        :class:`Fenced` if etcd refused it, :class:`EtcdUnavailable` if no member answered
        (the writes may or may not have been applied: the caller steps down either way)."""
        writes = list(writes)
        if not writes:
            return
        etcd = self._conn()
        compare: list[dict] = []
        fence = self.fence() if self.fence is not None else None
        if self.fence is not None and fence is None:
            raise Fenced("not the leader")
        if fence is not None:
            compare.append(fence)
        ops: list[dict] = []
        counters: dict[str, int] = {}
        for table, key, value in writes:
            if table == "model":
                model = key[0]
                if model not in counters:  # compare against the value before this commit
                    k = self._key("model", key)
                    prev = self._counters.get(model)
                    if prev is None:
                        compare.append({"key": _b64(k), "target": "CREATE", "result": "EQUAL", "create_revision": "0"})
                    else:
                        compare.append({"key": _b64(k), "target": "VALUE", "result": "EQUAL",
                                        "value": _b64(json.dumps(prev))})
                counters[model] = value
            elif table == "retire":  # the version's rows: 3 ops whatever its shard count
                ops.append({"request_delete_range": {"key": _b64(self._key("version", key))}})
                for t in ("layout", "manifest"):
                    base = self._key(t, key)[:-1] + ","  # ["model",version,
                    ops.append({"request_delete_range": {"key": _b64(base), "range_end": _b64(prefix_end(base))}})
                continue
            elif table == "allocation_floor":
                base = self._key("allocation", (key[0],))[:-1] + ","  # ["model",
                for kv in etcd.range(base, prefix_end(base)):
                    if json.loads(etcd.value(kv)) <= value:
                        ops.append({"request_delete_range": {"key": kv["key"]}})
                continue
            elif table not in TABLES:  # pragma: no cover - programming error
                raise ValueError(f"unknown table {table!r}")
        # Later writes of a key win (as SQLite's upsert); first-writer-wins rows are
        # immutable in the state machine, so a plain put is equivalent there.
        last: dict[str, str] = {}
        for table, key, value in writes:
            if table in ("allocation_floor", "retire"):
                continue
            if table == "manifest":
                text = manifest_json(value).decode()
            else:
                text = json.dumps(value)
            last[self._key(table, key)] = text
        ops = [_put(k, v) for k, v in last.items()] + ops
        out = etcd.txn(compare, ops)
        if not out.get("succeeded"):
            raise Fenced("etcd refused the commit: this coordinator no longer leads, or a version "
                         "counter was moved by another coordinator")
        self._counters.update(counters)

    def _conn(self) -> EtcdEndpoints:
        if self.etcd is None:
            raise RuntimeError("store is not open")
        return self.etcd
