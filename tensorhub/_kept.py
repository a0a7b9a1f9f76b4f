"""Values derived from an object, kept by the object's identity for the last few objects.

Manifests and address lists are immutable once made, and large: what is derived from one
(its JSON, its digest, its offsets, its expanded addresses) is computed once per object
and reused while the object is among the last few seen. The entry holds the object
itself, so an id reused by a new object after the old one was freed never matches.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Hashable, TypeVar

__all__ = ["KeptBy"]

T = TypeVar("T")


class KeptBy:
    """``get(obj, make)``: ``make()`` for ``obj`` (and ``extra``, part of the key), kept for
    the last ``size`` keys (least recently used goes first). Thread-safe; ``make`` runs
    outside the lock."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._kept: "OrderedDict[tuple, tuple[Any, Any]]" = OrderedDict()

    def get(self, obj: Any, make: Callable[[], T], extra: Hashable = None) -> T:
        key = (id(obj), extra)
        with self._lock:
            hit = self._kept.get(key)
            if hit is not None and hit[0] is obj:
                self._kept.move_to_end(key)
                return hit[1]
        value = make()
        with self._lock:
            self._kept[key] = (obj, value)
            self._kept.move_to_end(key)
            while len(self._kept) > self.size:
                self._kept.popitem(last=False)
        return value
