"""Layout names with a meaning of their own: deltas and sliced publishes."""

from __future__ import annotations

#: Layout names of deltas (``tensorhub._delta_path``) start with this: ``delta:<base>``
#: (the delta of layout ``hf``) or ``delta:<base>:<layout>``.
DELTA_PREFIX = "delta:"


def delta_layout(base: int, layout: str = "hf") -> str:
    """The layout name of the delta against v``base`` of ``layout``."""
    return f"{DELTA_PREFIX}{base}" if layout == "hf" else f"{DELTA_PREFIX}{base}:{layout}"


def is_delta_layout(layout: str) -> bool:
    """A delta layout (:func:`delta_layout`): one more replica of a version for readers that
    hold its base, never the version itself -- it alone does not complete a version."""
    return layout.startswith(DELTA_PREFIX)


#: The layout a sliced publish registers its shards under (``tensorhub._slices``: the
#: ``hf`` tensors, cut by rank; each slice placed by its :class:`SliceSpec`).
SLICED = "hf.slices"
