"""Moved to :mod:`integrations._core.ranks` (the adapters' engine-neutral core); this name
stays for the pages that cite it (docs/concepts/architecture.md)."""

from ._core.ranks import EngineRanks, label

__all__ = ["EngineRanks", "label"]
