"""The coordinator's serialized manifests: each shard's answer to ``GET .../manifest``
encoded once, not once per reader.

A version's manifests never change (the first registered one is final), so the JSON of
(model, version, layout, shard) -- and its gzip, for clients that accept it (httpx, the
Hub's client, does) -- is built on the first request and reused by every reader after it.
A 50,000-tensor manifest is ~5.6 MB of JSON and ~0.1-0.2 s of CPU to serialize: 1,024
readers of one version were ~2 minutes of coordinator CPU, now they are one encoding.

Correctness never depends on this cache. The route asks the state machine first (a
retired or unknown version is refused there, as before) and is served from here only
when the entry was built from *that very* manifest object (identity, not equality: a
catalog reloaded from the store holds new objects, which are encoded again). Entries
of retired versions are dropped when the retirement is applied (``forget``), and the
whole cache is bounded by bytes (least recently used first).

Lives in the coordinator process (``server.core.Coordinator.manifests``); thread-safe:
the HTTP routes call it from the event loop and build entries on a worker thread.
"""

from __future__ import annotations

import asyncio
import gzip
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

from ..protocol import Manifest, VersionSums, manifest_json

__all__ = ["ManifestCache", "Encoded", "LeaseAnswers", "CACHE_BYTES", "GZIP_OVER", "ADDRESSES_BYTES"]

#: Bytes of encoded manifests kept (JSON + gzip), least recently used dropped first.
CACHE_BYTES = 256 << 20
#: Answers longer than this are also kept gzipped (smaller ones are sent as they are).
GZIP_OVER = 4096

Key = tuple  # (model, version, layout, shard)


@dataclass(frozen=True)
class Encoded:
    """One manifest's answer: its JSON (what the route answered before this cache, byte
    for byte) and, for large ones, that JSON gzipped."""

    manifest: Manifest  # the object it was built from (entries match by identity)
    json: bytes
    gzip: Optional[bytes]

    @property
    def size(self) -> int:
        return len(self.json) + len(self.gzip or b"")


def encode(manifest: Manifest) -> Encoded:
    """Serialize a manifest as the route's ``response_model`` did (pydantic's JSON of the
    model: compact, ``slices`` left out for full tensors; no field has an alias)."""
    data = manifest_json(manifest)  # (shared with its digest: serialized once)
    packed = gzip.compress(data, 6, mtime=0) if len(data) > GZIP_OVER else None
    return Encoded(manifest, data, packed)


class ManifestCache:
    """Encoded manifests by (model, version, layout, shard), bounded by ``max_bytes``."""

    def __init__(self, max_bytes: int = CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: "OrderedDict[Key, Encoded]" = OrderedDict()
        self._bytes = 0
        #: Encodings in flight on the event loop (one per key: concurrent readers of a new
        #: version wait for the first one's instead of each encoding it again).
        self._building: dict[Key, asyncio.Future] = {}
        #: Answers served from the cache / encoded (what ``/metrics`` and tests can read).
        self.hits = self.misses = 0

    def get(self, key: Key, manifest: Manifest) -> Optional[Encoded]:
        """The entry built from ``manifest`` itself, or None."""
        with self._lock:
            e = self._entries.get(key)
            if e is None or e.manifest is not manifest:
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return e

    def put(self, key: Key, manifest: Manifest) -> Encoded:
        """Encode ``manifest`` (outside the lock) and keep it; returns the entry."""
        e = encode(manifest)
        with self._lock:
            self.misses += 1
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.size
            if e.size <= self.max_bytes:
                self._entries[key] = e
                self._bytes += e.size
                while self._bytes > self.max_bytes:
                    _, dropped = self._entries.popitem(last=False)
                    self._bytes -= dropped.size
        return e

    async def aget(self, key: Key, manifest: Manifest) -> Encoded:
        """``get``, else encode on a worker thread -- once per key however many readers
        ask at the same moment (call it from the event loop)."""
        e = self.get(key, manifest)
        if e is not None:
            return e
        fut = self._building.get(key)
        if fut is None or fut.done():
            fut = asyncio.ensure_future(asyncio.to_thread(self.put, key, manifest))
            self._building[key] = fut
            fut.add_done_callback(lambda f, k=key: self._building.pop(k, None) if self._building.get(k) is f else None)
        e = await asyncio.shield(fut)
        return e if e.manifest is manifest else await asyncio.to_thread(self.put, key, manifest)

    def forget(self, model: str, version: int) -> None:
        """A version was retired: drop its entries (every layout and shard)."""
        with self._lock:
            for key in [k for k in self._entries if k[0] == model and k[1] == version]:
                self._bytes -= self._entries.pop(key).size

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)


#: Bytes of replicas' encoded address lists kept (``LeaseAnswers``).
ADDRESSES_BYTES = 64 << 20
_STUB = b'"addresses":[]'
#: A grant's ``sums`` while it is encoded (``LeaseAnswers``): a control character in a string
#: is always written escaped, and no other field of a grant holds one (ids, endpoints and
#: reasons are printable), so its JSON marks the one place the version's sums go.
_SUMS_STUB = VersionSums.model_construct(checksum="\x01sums\x01", checksums=None, meta=None)
_SUMS_STUB_JSON = _SUMS_STUB.model_dump_json().encode()
#: Versions whose sums' JSON is kept (``LeaseAnswers``): the newest few of each model are read.
SUMS_KEPT = 16


class LeaseAnswers:
    """``POST /v1/leases`` answers with each source's addresses encoded once per replica.

    A lease answer names up to ``max_sources`` replicas with one address per tensor each
    (4 x 50,000 addresses: ~1.8 MB of JSON), and a replica's addresses never change while it
    is registered. The answer is the grant's own JSON (``LeaseGrant.model_dump_json``) byte
    for byte: the grant is written with empty address lists, and each is replaced by that
    replica's list, encoded the first time a lease named it (kept by the list's identity,
    bounded by bytes).

    A lease asked ahead carries its version's checksums (``LeaseGrant.sums``): one 64-bit
    sum per chunk, which pydantic writes at ~0.75 us each (integers past 2**63 take its
    slow path): 256 sums were ~190 us of every subscriber's answer, 1,024 subscribers
    ~0.2 s of the coordinator between the first answer and the last. They are the same for
    every reader of the version: encoded once (kept by the sums list's identity, like the
    addresses) and spliced. Coordinator process only; thread-safe."""

    def __init__(self, max_bytes: int = ADDRESSES_BYTES) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._kept: "OrderedDict[str, tuple[list, bytes]]" = OrderedDict()
        self._bytes = 0
        #: id(checksums list) -> (the list, the meta object, checksum name, the sums' JSON)
        self._sums: "OrderedDict[int, tuple[list, object, Optional[str], bytes]]" = OrderedDict()

    def _addresses(self, replica_id: str, addresses: list) -> bytes:
        with self._lock:
            hit = self._kept.get(replica_id)
            if hit is not None and hit[0] is addresses:
                self._kept.move_to_end(replica_id)
                return hit[1]
        data = b'"addresses":[' + ",".join(map(str, addresses)).encode() + b"]"
        with self._lock:
            old = self._kept.pop(replica_id, None)
            if old is not None:
                self._bytes -= len(old[1])
            if len(data) <= self.max_bytes:
                self._kept[replica_id] = (addresses, data)
                self._bytes += len(data)
                while self._bytes > self.max_bytes:
                    self._bytes -= len(self._kept.popitem(last=False)[1][1])
        return data

    def _sums_json(self, sums: VersionSums) -> bytes:
        key = id(sums.checksums)
        with self._lock:
            hit = self._sums.get(key)
            if hit is not None and hit[0] is sums.checksums and hit[1] is sums.meta and hit[2] == sums.checksum:
                self._sums.move_to_end(key)
                return hit[3]
        data = sums.model_dump_json().encode()
        with self._lock:
            self._sums[key] = (sums.checksums, sums.meta, sums.checksum, data)  # (the list kept: its id stays its own)
            while len(self._sums) > SUMS_KEPT:
                self._sums.popitem(last=False)
        return data

    def encode(self, grant) -> bytes:  # type: ignore[no-untyped-def]
        """The grant's JSON (``grant.model_dump_json()``, the same bytes)."""
        sums = grant.sums
        splice_sums = sums is not None and sums.checksums is not None and len(sums.checksums) >= 16
        lists = bool(grant.replicas) and any(len(r.addresses) >= 64 for r in grant.replicas)
        if not (splice_sums or lists):
            return grant.model_dump_json().encode()
        update: dict = {"sums": _SUMS_STUB} if splice_sums else {}
        if lists:
            update["replicas"] = [r.model_copy(update={"addresses": []}) for r in grant.replicas]
        data = grant.model_copy(update=update).model_dump_json().encode()
        if lists:
            parts = data.split(_STUB)
            if len(parts) != len(grant.replicas) + 1:  # (cannot happen: quotes in strings are escaped)
                return grant.model_dump_json().encode()
            out = [parts[0]]
            for r, tail in zip(grant.replicas, parts[1:]):
                # (a source answered as runs, ``_addresses``, has no list: nothing to splice)
                out += [self._addresses(r.replica_id, r.addresses) if r.addresses else _STUB, tail]
            data = b"".join(out)
        if splice_sums:
            head, mark, tail = data.partition(_SUMS_STUB_JSON)
            if not mark or _SUMS_STUB_JSON in tail:  # (cannot happen: see _SUMS_STUB)
                return grant.model_dump_json().encode()
            data = head + self._sums_json(sums) + tail
        return data
