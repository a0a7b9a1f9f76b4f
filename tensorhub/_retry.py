"""Retry pacing shared by every client loop that waits on the coordinator.

A coordinator restart (or a failover) fails every client at the same moment; if all of
them retried on the same schedule they would arrive as one synchronized storm. Every
retry sleep and periodic call goes through :func:`jittered`.
"""

from __future__ import annotations

import random

__all__ = ["jittered", "next_delay"]


def jittered(delay: float) -> float:
    """The sleep for a retry planned ``delay`` seconds out: uniform in [delay/2, delay]
    ("equal jitter": never sooner than half the backoff, never in step with others)."""
    return delay * (0.5 + 0.5 * random.random())


def next_delay(delay: float, cap: float = 1.0, factor: float = 2.0) -> float:
    """Exponential backoff: the next planned delay, at most ``cap``."""
    return min(delay * factor, cap)
