"""End-to-end chunk checksums: computed once by the publisher, verified by every reader.

A shard's bytes (its tensors concatenated in manifest order) are cut on the shard's chunk
grid, :func:`grid`: chunks of ``_planner.grid_chunk_bytes(nbytes)`` bytes, a chunk also
ending after ``MAX_BATCH_ENTRIES`` tensor pieces. These are exactly the chunks pipelined
readers read and report (``_pipeline``), so chunk ``c`` names the same bytes on every
replica. The manifest carries one hash per chunk (``Manifest.checksums``) and the name of
the algorithm (``Manifest.checksum``, so it can change later).

Who does what:

* holder (``Hub.publish`` -> ``_tensors.manifest_of``): :func:`compute` hashes the tensors
  it registers, reading them in place (no copy for CPU memory).
* coordinator: validates the list (one value per grid chunk, each in range); a replica
  whose checksums differ from the registered ones (same algorithm) is refused like any
  other manifest difference. It never reads tensor bytes.
* reader (``_reader.ShardReader``, ``_pipeline.PipelinedReader``): a :class:`Verifier`
  hashes each chunk in local memory once the transport said DONE, before the chunk counts
  as read (and, pipelined, before it is reported to the coordinator and so offered to
  other readers). A mismatch fails the source like a failed read: reported to the
  coordinator (suspect), excluded, the chunk re-read from another source.

Which memory is hashed (``TENSORHUB_CHECKSUM`` / ``Hub(checksum=...)``):

* ``auto`` (default): CPU memory only. A publish hashes when every tensor is in CPU
  memory; a reader verifies when its destination is in CPU memory. CUDA tensors are
  neither hashed nor verified (their manifests carry no checksums).
* ``on``: CUDA memory too: each piece is copied into a (pinned, when CUDA is up) host
  staging buffer and hashed there, so CPU and GPU holders share one algorithm and any
  reader can check any publisher. This path has not run on a GPU yet; its cost is
  bounded by the host hash (tens of GB/s per core, below) plus the device-to-host copy.
* ``off``: nothing is hashed or verified.

Algorithm: ``xxh3_64`` (PyPI ``xxhash``), chosen by measurement (benchmarks/bench_checksum.py
prints the table): on this project's shared 2-core VMs one core hashes 19-35 GB/s with
xxh3_64, 16-23 GB/s with xxh64, 10-16 GB/s with CRC32C (``crc32c``), 4-7 GB/s with
``zlib.crc32``; ``google-crc32c`` only takes ``bytes`` (a copy per chunk: 4-10 GB/s). ``crc32`` (stdlib) is kept as
a second algorithm: a reader verifies any algorithm in :data:`ALGORITHMS`, and skips
(logging once) one it does not know, e.g. from a newer client.

What is not verified: bytes of a partial read (``fetch(names=...)``) in chunks it reads
only part of (a chunk hash covers the whole chunk); destinations in CUDA memory under
``auto``; manifests without checksums (older clients, CUDA publishers under ``auto``).
"""

from __future__ import annotations

import ctypes
import logging
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, Optional, Sequence

from ._exceptions import ConfigError
from ._grid import grid_chunk_bytes
from .transport import MAX_BATCH_ENTRIES

__all__ = ["ALGORITHMS", "DEFAULT", "MODES", "Verifier", "check_mode", "compute", "count", "cut", "grid",
           "hash_bytes", "verifier"]

logger = logging.getLogger(__name__)

#: Settings of ``TENSORHUB_CHECKSUM`` / ``Hub(checksum=...)`` (see the module docstring).
MODES = ("auto", "on", "off")

#: A chunk: its (tensor index, offset in tensor, length) pieces, in order.
Chunk = list[tuple[int, int, int]]


class _Crc:
    """A streaming wrapper around a ``crc(data, value)`` function."""

    def __init__(self, fn: Callable[[Any, int], int]) -> None:
        self._fn, self._v = fn, 0

    def update(self, data: Any) -> None:
        self._v = self._fn(data, self._v)

    def intdigest(self) -> int:
        return self._v


def _xxh3_64() -> Any:
    import xxhash

    return xxhash.xxh3_64()


#: algorithm name -> a new streaming hasher (``update(buffer)``, ``intdigest()``).
ALGORITHMS: dict[str, Callable[[], Any]] = {
    "xxh3_64": _xxh3_64,
    "crc32": lambda: _Crc(zlib.crc32),
}
#: What a publish computes.
DEFAULT = "xxh3_64"

_unknown_warned: set[str] = set()


def check_mode(value: Any) -> str:
    """A checksum setting as one of :data:`MODES` (``True``/``False`` mean on/off)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    mode = str(value).strip().lower()
    if mode not in MODES:
        raise ConfigError(f"checksum setting {value!r} is not one of {', '.join(MODES)}")
    return mode


# ------------------------------------------------------------------ the grid
def cut(sizes: Sequence[int], chunk_bytes: int) -> list[Chunk]:
    """Cut tensors of ``sizes`` bytes (concatenated) into chunks of at most ``chunk_bytes``
    bytes and at most ``MAX_BATCH_ENTRIES`` pieces; empty tensors have no piece."""
    chunks: list[Chunk] = []
    cur: Chunk = []
    room = chunk_bytes
    for i, n in enumerate(sizes):
        off = 0
        while off < n:
            take = min(n - off, room)
            cur.append((i, off, take))
            off += take
            room -= take
            if room == 0 or len(cur) == MAX_BATCH_ENTRIES:
                chunks.append(cur)
                cur, room = [], chunk_bytes
    if cur:
        chunks.append(cur)
    return chunks


def grid(sizes: Sequence[int]) -> list[Chunk]:
    """The shard's chunk grid: what one checksum covers, and what pipelined readers read."""
    return cut(sizes, grid_chunk_bytes(sum(sizes)))


def count(sizes: Sequence[int], limit: Optional[int] = None) -> int:
    """``len(grid(sizes))`` without building it; stops early once past ``limit``."""
    chunk_bytes = grid_chunk_bytes(sum(sizes))
    n, room, pieces = 0, chunk_bytes, 0
    for size in sizes:
        off = 0
        while off < size:
            take = min(size - off, room)
            off += take
            room -= take
            pieces += 1
            if room == 0 or pieces == MAX_BATCH_ENTRIES:
                n, room, pieces = n + 1, chunk_bytes, 0
                if limit is not None and n > limit:
                    return n
    return n + (1 if pieces else 0)


# ------------------------------------------------------------------ reading bytes
class _Bytes:
    """Reads pieces of a list of tensors as buffers to hash: CPU memory in place (a
    ``memoryview`` over the address, no copy), other devices through a host staging buffer."""

    def __init__(self, tensors: Sequence[Any], staged: Optional[bool] = None) -> None:
        self.tensors = list(tensors)
        self.addrs = [t.data_ptr() for t in self.tensors]
        self.staged = [t.device.type != "cpu" for t in self.tensors] if staged is None else \
            [staged] * len(self.tensors)
        self._flat: dict[int, Any] = {}
        self._staging: Any = None

    def piece(self, i: int, off: int, n: int) -> memoryview:
        if not self.staged[i]:
            return memoryview((ctypes.c_char * n).from_address(self.addrs[i] + off)).cast("B")
        import torch

        flat = self._flat.get(i)
        if flat is None:
            flat = self._flat[i] = self.tensors[i].reshape(-1).view(torch.uint8)
        if self._staging is None or self._staging.numel() < n:
            pin = torch.cuda.is_available()
            self._staging = torch.empty(max(n, 1 << 20), dtype=torch.uint8, pin_memory=pin)
        dst = self._staging[:n]
        dst.copy_(flat[off:off + n])  # synchronous: the bytes are on the host when it returns
        return memoryview(dst.numpy()).cast("B")


def _hash_chunk(algo: str, chunk: Chunk, data: _Bytes) -> int:
    h = ALGORITHMS[algo]()
    for i, off, n in chunk:
        h.update(data.piece(i, off, n))
    return h.intdigest()


def hash_bytes(algo: str, data: Any) -> int:
    """Hash one buffer with ``algo`` (tests and benchmarks check :func:`compute` against it)."""
    h = ALGORITHMS[algo]()
    h.update(data)
    return h.intdigest()


# ------------------------------------------------------------------ holder
def compute(tensors: Sequence[Any], mode: str, algo: str = DEFAULT) -> Optional[tuple[str, list[int]]]:
    """``(algorithm, one hash per grid chunk)`` of ``tensors`` (manifest order), or None when
    ``mode`` does not cover their memory (``auto``: a tensor is not in CPU memory; ``off``).
    Runs in the publishing process, reading the tensors in place."""
    mode = check_mode(mode)
    if mode == "off" or (mode == "auto" and any(t.device.type != "cpu" for t in tensors)):
        return None
    sizes = [t.numel() * t.element_size() for t in tensors]
    t0 = time.perf_counter()
    data = _Bytes(tensors)
    sums = [_hash_chunk(algo, c, data) for c in grid(sizes)]
    dt = time.perf_counter() - t0
    nbytes = sum(sizes)
    logger.debug("checksummed %.1f MB in %d chunks with %s in %.3fs (%.1f GB/s)", nbytes / 1e6, len(sums), algo,
                 dt, nbytes / dt / 1e9 if dt > 0 else 0.0)
    return algo, sums


# ------------------------------------------------------------------ reader
class Verifier:
    """What a reader checks: its chunks (on the grid, in its own tensor indices) and, per
    chunk, the expected hash (None: not verifiable, a partial read's cut chunk).

    Built by :func:`verifier`; used by ``ShardReader`` in the reader process."""

    def __init__(self, algo: str, chunks: list[Chunk], expected: list[Optional[int]], data: _Bytes) -> None:
        self.algo = algo
        self.chunks = chunks
        self.expected = expected
        self.data = data
        #: Bytes hashed and seconds spent hashing (benchmarks report them).
        self.nbytes = 0
        self.seconds = 0.0

    @property
    def in_place(self) -> bool:
        """Whether every destination is in CPU memory (hashable where it lies, no staging)."""
        return not any(self.data.staged)

    def hasher(self) -> Any:
        """A new streaming hasher of this manifest's algorithm (a transport that copies a
        chunk itself hashes it as it lands: ``SameHostTransport.submit_from``)."""
        return ALGORITHMS[self.algo]()

    def check(self, c: int, digest: Optional[int] = None) -> Optional[str]:
        """None if chunk ``c`` (in local memory) matches or cannot be verified, else why not.
        ``digest``: the chunk's hash already computed from its landed bytes (by the copy
        that landed them, in chunk order); None: hashed here."""
        want = self.expected[c]
        if want is None:
            return None
        t0 = time.perf_counter()
        got = _hash_chunk(self.algo, self.chunks[c], self.data) if digest is None else digest
        self.seconds += time.perf_counter() - t0
        self.nbytes += sum(p[2] for p in self.chunks[c])
        return None if got == want else self._mismatch(c, got)

    def _mismatch(self, c: int, got: int) -> str:
        return f"checksum mismatch on chunk {c}: {self.algo} {got:#x}, the manifest says {self.expected[c]:#x}"


    def first_mismatch(self, threads: int = 2) -> Optional[str]:
        """Check every chunk; why the first (in chunk order) that fails, else None. Data in
        CPU memory is hashed by ``threads`` threads at once (the hash releases the GIL: on a
        mapped holder's memory the page-table faults of the first touch overlap too);
        staged data (one staging buffer) chunk by chunk."""
        n = len(self.chunks)
        if threads <= 1 or n <= 1 or not self.in_place:
            return next((why for c in range(n) if (why := self.check(c))), None)
        t0 = time.perf_counter()
        todo = [c for c in range(n) if self.expected[c] is not None]
        with ThreadPoolExecutor(min(threads, len(todo) or 1), thread_name_prefix="tensorhub-verify") as pool:
            got = list(pool.map(lambda c: _hash_chunk(self.algo, self.chunks[c], self.data), todo))
        self.seconds += time.perf_counter() - t0
        self.nbytes += sum(p[2] for c in todo for p in self.chunks[c])
        return next((self._mismatch(c, h) for c, h in zip(todo, got) if h != self.expected[c]), None)


def verifier(manifest: Any, into: Mapping[str, Any], mode: str,
             keep: Optional[Sequence[int]] = None) -> Optional[Verifier]:
    """The reader's :class:`Verifier` for reading ``manifest`` (the full shard's, as the
    lease gave it) into ``into`` (name -> destination tensor; for a partial read, the
    tensors at the ``keep`` indices of the manifest), or None when there is nothing to
    verify: the manifest has no checksums, ``mode`` is ``off`` (or ``auto`` and a
    destination is not in CPU memory), or the algorithm is unknown here.

    A partial read is cut on the shard's grid too; a chunk it reads only part of (a
    tensor it skips shares the chunk) is not verified."""
    mode = check_mode(mode)
    algo, sums = getattr(manifest, "checksum", None), getattr(manifest, "checksums", None)
    if sums is None or algo is None or mode == "off":
        return None
    specs = manifest.tensors if keep is None else [manifest.tensors[g] for g in keep]
    tensors = [into[s.name] for s in specs]
    if mode == "auto" and any(t.device.type != "cpu" for t in tensors):
        return None
    if algo not in ALGORITHMS:
        if algo not in _unknown_warned:
            _unknown_warned.add(algo)
            logger.warning("manifest checksums use %r, which this client does not know; not verified", algo)
        return None
    full = grid([s.nbytes for s in manifest.tensors])
    if keep is None:
        return Verifier(algo, full, list(sums), _Bytes(tensors))
    local = {g: i for i, g in enumerate(keep)}
    chunks: list[Chunk] = []
    expected: list[Optional[int]] = []
    for c, pieces in enumerate(full):
        mine = [(local[g], off, n) for g, off, n in pieces if g in local]
        if mine:
            chunks.append(mine)
            expected.append(sums[c] if len(mine) == len(pieces) else None)
    return Verifier(algo, chunks, expected, _Bytes(tensors))
