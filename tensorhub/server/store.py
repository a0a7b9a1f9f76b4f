"""Durable store of the coordinator: one SQLite file under the state dir.

Holds what must survive a restart: models with their version counters, allocated
versions, layouts and manifests. Each request's writes are committed in one
transaction (``synchronous=FULL``) before the coordinator answers. Replicas, leases and
liveness are soft state and live only in memory.
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path
from typing import Iterable

from .catalog import Write
from ..protocol import Manifest, manifest_json

__all__ = ["SqliteStore"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS models (model TEXT PRIMARY KEY, counter INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS versions (
    model TEXT NOT NULL, version INTEGER NOT NULL, created REAL NOT NULL,
    PRIMARY KEY (model, version));
CREATE TABLE IF NOT EXISTS layouts (
    model TEXT NOT NULL, version INTEGER NOT NULL, layout TEXT NOT NULL, num_shards INTEGER NOT NULL,
    PRIMARY KEY (model, version, layout));
CREATE TABLE IF NOT EXISTS manifests (
    model TEXT NOT NULL, version INTEGER NOT NULL, layout TEXT NOT NULL, shard INTEGER NOT NULL,
    manifest TEXT NOT NULL, PRIMARY KEY (model, version, layout, shard));
CREATE TABLE IF NOT EXISTS allocations (
    model TEXT NOT NULL, request_id TEXT NOT NULL, version INTEGER NOT NULL,
    PRIMARY KEY (model, request_id));
"""

SCHEMA_VERSION = "1"


class SqliteStore:
    """The coordinator process opens one; it is used under the coordinator's lock."""

    FILENAME = "tensorhub.sqlite3"

    def __init__(self, state_dir: str | os.PathLike) -> None:
        self.path = Path(state_dir) / self.FILENAME
        self._db: sqlite3.Connection | None = None

    def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.executescript(_SCHEMA)
        row = db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
        if row is None:
            db.execute("INSERT INTO meta VALUES ('schema', ?)", (SCHEMA_VERSION,))
        elif row[0] != SCHEMA_VERSION:
            raise RuntimeError(f"{self.path}: schema {row[0]} is not the supported {SCHEMA_VERSION}")
        self._db = db

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def load(self) -> list[Write]:
        """Every durable row, as the writes that would recreate it."""
        db = self._conn()
        rows: list[Write] = []
        for model, counter in db.execute("SELECT model, counter FROM models"):
            rows.append(("model", (model,), counter))
        for model, version, created in db.execute("SELECT model, version, created FROM versions"):
            rows.append(("version", (model, version), created))
        for model, version, layout, n in db.execute("SELECT model, version, layout, num_shards FROM layouts"):
            rows.append(("layout", (model, version, layout), n))
        for model, version, layout, shard, text in db.execute(
            "SELECT model, version, layout, shard, manifest FROM manifests"
        ):
            rows.append(("manifest", (model, version, layout, shard), Manifest.model_validate_json(text)))
        for model, request_id, version in db.execute("SELECT model, request_id, version FROM allocations"):
            rows.append(("allocation", (model, request_id), version))
        return rows

    def commit(self, writes: Iterable[Write]) -> None:
        """Apply ``writes`` in one transaction; returns once it is on disk."""
        writes = list(writes)
        if not writes:
            return
        db = self._conn()
        db.execute("BEGIN IMMEDIATE")
        try:
            for table, key, value in writes:
                if table == "model":
                    db.execute(
                        "INSERT INTO models VALUES (?, ?) ON CONFLICT(model) DO UPDATE SET counter=excluded.counter",
                        (*key, value),
                    )
                elif table == "version":
                    db.execute("INSERT OR IGNORE INTO versions VALUES (?, ?, ?)", (*key, value))
                elif table == "layout":
                    db.execute("INSERT OR IGNORE INTO layouts VALUES (?, ?, ?, ?)", (*key, value))
                elif table == "manifest":
                    db.execute(
                        "INSERT OR IGNORE INTO manifests VALUES (?, ?, ?, ?, ?)",
                        (*key, manifest_json(value).decode()),
                    )
                elif table == "allocation":
                    db.execute("INSERT OR IGNORE INTO allocations VALUES (?, ?, ?)", (*key, value))
                elif table == "retire":
                    for t in ("manifests", "layouts", "versions"):
                        db.execute(f"DELETE FROM {t} WHERE model=? AND version=?", key)
                elif table == "allocation_floor":
                    db.execute("DELETE FROM allocations WHERE model=? AND version<=?", (*key, value))
                else:  # pragma: no cover - programming error
                    raise ValueError(f"unknown table {table!r}")
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError("store is not open")
        return self._db
