"""A shard's chunk grid: the unit of pipelined replication and of checksums.

Imports nothing of ours: the wire models (which validate a manifest's checksum count),
the planner and the checksums all stand on it.
"""

from __future__ import annotations

__all__ = ["GRID_CHUNKS", "GRID_MIN_BYTES", "GRID_MAX_BYTES", "grid_chunk_bytes"]

_MiB = 1 << 20
#: Chunks per shard the grid aims at (more chunks = finer pipelining, more bookkeeping).
GRID_CHUNKS = 64
GRID_MIN_BYTES = 1 * _MiB
GRID_MAX_BYTES = 64 * _MiB


def grid_chunk_bytes(nbytes: int) -> int:
    """The pipelining chunk size of a shard of ``nbytes``: about ``GRID_CHUNKS`` chunks,
    a whole number of MiB in [1 MiB, 64 MiB]."""
    per = -(-max(1, nbytes) // GRID_CHUNKS)
    per = -(-per // _MiB) * _MiB
    return max(GRID_MIN_BYTES, min(GRID_MAX_BYTES, per))
