"""One engine's ranks, every pipeline stage and every TP rank: one decides, all follow.

A TP x PP engine runs one worker process per (PP stage, TP rank); each stage has its own
TP group. Anything the engine must agree on (which version to load, whether every rank
fetched it) is decided over all of them, not per TP group: otherwise two stages could
resolve ``"latest"`` on either side of a publish and run halves of two versions, and one
stage could swap while another refused.

:class:`EngineRanks` is built from the engine's own process groups (vLLM's or SGLang's
``GroupCoordinator``: ``ranks``, ``rank_in_group``, ``world_size``, ``cpu_group``), one
per axis, outermost first (``pp``, then ``tp``). The engine's root is the rank that is
rank 0 on every axis (PP stage 0, TP rank 0). A collective over the whole engine is one
collective per axis over the groups the engine already has (gloo ``cpu_group``): no new
group is created, and ranks outside the engine (other data-parallel replicas) take no
part. With PP = 1 it is exactly the TP-group collective of before.

Every rank of the engine must make the same calls in the same order; a rank that raises
before one leaves the others waiting in it. Callers therefore turn a rank's failure into
a value (``("error", text)`` or an error string) and raise only after the collective:
:meth:`EngineRanks.decide` (the root decides) and :meth:`EngineRanks.first_error`
(all-or-none) are those two patterns.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

__all__ = ["EngineRanks", "label"]


class EngineRanks:
    """The engine this worker process belongs to; see the module docstring.

    ``axes``: ``(name, group)`` pairs, outermost first; axes of size 1 are ignored, and no
    axes at all means a single-process engine (every call returns at once)."""

    def __init__(self, axes: Sequence[tuple[str, Any]] = ()) -> None:
        self.axes = [(name, g) for name, g in axes if g is not None and g.world_size > 1]

    @property
    def size(self) -> int:
        n = 1
        for _, g in self.axes:
            n *= g.world_size
        return n

    @property
    def root(self) -> bool:
        """Whether this rank decides for the engine (rank 0 on every axis)."""
        return all(g.rank_in_group == 0 for _, g in self.axes)

    def rank_on(self, axis: str) -> int:
        """This worker's rank on ``axis`` (``"tp"``, ``"pp"``); 0 where the engine has no such axis."""
        return next((g.rank_in_group for name, g in self.axes if name == axis), 0)

    def size_on(self, axis: str) -> int:
        """The engine's size on ``axis``; 1 where it has no such axis."""
        return next((g.world_size for name, g in self.axes if name == axis), 1)

    def where(self) -> str:
        """This rank in words, e.g. ``"pp stage 1, tp rank 0"`` (``""`` alone)."""
        return label(tuple((name, g.rank_in_group) for name, g in self.axes))

    def broadcast(self, obj: Any) -> Any:
        """The root's ``obj`` on every rank of the engine (collective: every rank calls it).

        One broadcast per axis from that axis' rank 0: after the ``pp`` step every stage's
        TP rank 0 holds the root's object, after the ``tp`` step every rank does."""
        import torch.distributed as dist

        for _, g in self.axes:
            box = [obj]
            dist.broadcast_object_list(box, src=g.ranks[0], group=g.cpu_group)
            obj = box[0]
        return obj

    def decide(self, fn: Callable[[], Any], error: Callable[[str], Exception]) -> Any:
        """The root's ``fn()`` on every rank (collective): only the root calls ``fn``; an
        exception there reaches every rank as ``error(its one-line text)``."""
        answer: Any = None
        if self.root:
            try:
                answer = fn()
            except Exception as e:  # hand the one-line error to every rank
                answer = ("error", str(e))
        answer = self.broadcast(answer)
        if isinstance(answer, tuple) and len(answer) == 2 and answer[0] == "error":
            raise error(answer[1])
        return answer

    def gather(self, obj: Any) -> list[tuple[str, Any]]:
        """Every rank's ``obj`` with its place (:meth:`where`), in (pp, tp) order, the same
        list on every rank of the engine (collective: every rank calls it)."""
        import torch.distributed as dist

        items = [(tuple((name, g.rank_in_group) for name, g in self.axes), obj)]
        for _, g in reversed(self.axes):  # innermost first: a stage's list, then every stage's
            out: list = [None] * g.world_size
            dist.all_gather_object(out, items, group=g.cpu_group)
            items = [it for part in out for it in part]
        items.sort(key=lambda it: tuple(r for _, r in it[0]))
        return [(label(place), o) for place, o in items]

    def first_error(self, error: Optional[str]) -> Optional[tuple[str, str]]:
        """All-or-none over the engine (collective): every rank's ``error`` (None: this rank
        is fine) gathered, and the first failed rank's ``(place, error)``, the same on every
        rank; None when every rank is fine."""
        return next(((where, e) for where, e in self.gather(error) if e is not None), None)


def label(place: tuple[tuple[str, int], ...]) -> str:
    """``(("pp", 1), ("tp", 0))`` -> ``"pp stage 1, tp rank 0"``."""
    return ", ".join(f"pp stage {r}" if name == "pp" else f"{name} rank {r}" for name, r in place)

