"""Chunk availability read from the source itself: a partial replica's *chunk map*.

A reader that is still receiving a shard (pipelined replication, ``_pipeline``) serves the
chunks it has. Which ones it has is not told to the coordinator chunk by chunk: the
holder keeps one status byte per chunk of the shard's grid in memory it registers with
the transport next to the data, advertises that memory's address once when it registers
the partial replica (``RegisterReplica.status_addr`` / ``status_tag``), and other readers
read the (small) map one-sided, like the data, before they ask that source for a chunk.
The coordinator's work per reader per version then no longer grows with the chunk count.

Layout of the map (little-endian), ``HEADER`` + ``num_chunks`` bytes::

    [0, 8)    tag: a random non-zero 64-bit number chosen by the holder for this replica
    [8, 16)   num_chunks
    [16, ..)  one byte per chunk: READY (1) once the chunk is complete, COMING (2) while
              the holder is receiving it (a hint, never a source), else 0

Rules (who does what, and why a reader never reads a chunk that is not complete there):

* Only READY means readable. COMING tells other readers to leave that chunk to this
  holder rather than pull it from a complete replica too (the publisher's uplink is the
  scarce link); it may go back to 0 (the read failed).
* The holder (reader process of the fetch that receives the shard) sets a chunk's byte
  to READY only after the transport said the chunk's read is DONE, its checksum matched (when the
  manifest has checksums: ``_checksum``) and the lease it was read under is still trusted
  on the holder's own clock (``_fencing.LeaseClock``). A byte never goes back to 0 while the
  tag stands, so a reader's stale view is never wrong, only late.
* A reader accepts a map only if its tag and chunk count are the ones the coordinator
  advertised for that replica (``ReplicaInfo.status_tag``). Memory is reused only after
  the replica drained (``unpublish``: no lease names it) and the holder first zeroes the
  tag (:meth:`ChunkMap.retire`); a map in reused memory (another version's replica has a
  fresh tag) or in memory that is not a map any more therefore reads as *stale*: no chunk.
* The data memory is pinned by the lease as before (the holder drains before it reuses
  it); the map lives exactly as long as the data (same ``Held``, unregistered together).

Transports: the map is plain registered memory read with ``submit_read``; the in-memory,
Mooncake and same-host transports (whose same-host path leaves partial replicas to the
wrapped transport) all serve it under the same contract (``transport/_base``).
"""

from __future__ import annotations

import secrets
import struct
from typing import Any, Optional

__all__ = ["ChunkMap", "HEADER", "READY", "COMING", "parse", "parse_all", "map_bytes"]

#: Bytes before the per-chunk status bytes: tag (u64) and chunk count (u64).
HEADER = 16
#: The status byte of a chunk that is complete (and verified) in the holder's memory.
READY = 1
#: ... of a chunk the holder is receiving now (a hint for other readers; not readable).
COMING = 2


def map_bytes(num_chunks: int) -> int:
    """Size of the map of a shard of ``num_chunks`` chunks."""
    return HEADER + num_chunks


class ChunkMap:
    """The holder's side: one map per partial replica (lives as long as the replica's
    memory; see the module docstring). Not thread-safe: the fetch's thread writes it."""

    def __init__(self, num_chunks: int) -> None:
        import torch  # lazily: ``import tensorhub`` works without torch

        if num_chunks < 1:
            raise ValueError(f"a chunk map needs at least one chunk, not {num_chunks}")
        self.num_chunks = num_chunks
        #: Random, non-zero: the reader's proof that it reads this replica's map.
        self.tag = secrets.randbits(64) | 1
        self.buf = torch.zeros(map_bytes(num_chunks), dtype=torch.uint8)
        self._view = memoryview(self.buf.numpy())
        self._view[:HEADER] = struct.pack("<QQ", self.tag, num_chunks)
        self.ready: set[int] = set()
        self.coming: set[int] = set()

    @property
    def addr(self) -> int:
        return self.buf.data_ptr()

    @property
    def region(self) -> tuple[int, int]:
        """``(addr, nbytes)`` to register with the transport next to the data."""
        return self.addr, map_bytes(self.num_chunks)

    def mark(self, chunk: int) -> None:
        """Chunk ``chunk`` is complete and verified in this process's memory (see the rules)."""
        if not 0 <= chunk < self.num_chunks:
            raise ValueError(f"chunk {chunk} outside [0, {self.num_chunks})")
        self._view[HEADER + chunk] = READY
        self.ready.add(chunk)
        self.coming.discard(chunk)

    def receiving(self, now: "set[int]") -> None:
        """The chunks being received now (a hint for others): marked COMING; those no
        longer in flight and not ready go back to 0."""
        for c in self.coming - now:
            if c not in self.ready:
                self._view[HEADER + c] = 0
        for c in now - self.coming - self.ready:
            if 0 <= c < self.num_chunks:
                self._view[HEADER + c] = COMING
        self.coming = {c for c in now if c not in self.ready and 0 <= c < self.num_chunks}

    def retire(self) -> None:
        """Before the memory may be reused: no reader will take this map as valid again."""
        self._view[:8] = b"\0" * 8


def parse(raw: Any, tag: int, num_chunks: int) -> Optional[frozenset]:
    """The chunks a map read from a source says are ready; None if the map is stale (its
    tag or chunk count is not the advertised one: the memory is not that replica's map)."""
    got = parse_all(raw, tag, num_chunks)
    return None if got is None else got[0]


def parse_all(raw: Any, tag: int, num_chunks: int) -> Optional[tuple[frozenset, frozenset]]:
    """(ready, coming) chunks of a map read from a source; None if it is stale."""
    b = bytes(raw[:map_bytes(num_chunks)])
    if len(b) < map_bytes(num_chunks):
        return None
    got_tag, got_n = struct.unpack_from("<QQ", b)
    if got_tag != tag or got_n != num_chunks or tag == 0:
        return None
    body = b[HEADER:]
    return (frozenset(i for i, s in enumerate(body) if s == READY),
            frozenset(i for i, s in enumerate(body) if s == COMING))
