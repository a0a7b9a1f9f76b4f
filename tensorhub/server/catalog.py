"""The coordinator's durable catalog: models, version counters, versions, layouts,
manifests and the allocation answers kept for retries.

Pure (no I/O, no clock of its own). Every change is queued as a *write* (table, key,
value); the shell commits them to its store (``server.store.py``) before it answers, and
``Catalog.restore(rows)`` rebuilds the catalog from those rows after a restart. Nothing
here knows about workers, replicas or leases: that soft state is ``server.registry``'s, and
the decisions that need both are ``server.state``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

from .._exceptions import ConflictError, ManifestMismatchError, NotFoundError
from .._slices import check_register
from ..protocol import Manifest, RegisterReplica, first_difference, is_delta_layout

__all__ = ["Catalog", "ModelInfo", "VersionInfo", "LayoutInfo", "Write", "ALLOCATIONS_KEPT"]

#: A durable change: (table, key tuple, value). See ``server.store.py``.
Write = tuple

#: Allocation answers kept per model for retries (``allocate``'s ``request_id``).
ALLOCATIONS_KEPT = 1024

#: The order ``restore`` applies tables in (a row needs the rows of the tables before).
_TABLES = {"model": 0, "version": 1, "layout": 2, "manifest": 3, "allocation": 4}


@dataclass
class LayoutInfo:
    num_shards: int
    manifests: dict[int, Manifest] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.manifests) == self.num_shards


@dataclass
class VersionInfo:
    created: float
    layouts: dict[str, LayoutInfo] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        """Some full layout has every shard. A delta layout (``is_delta_layout``) never
        completes a version: its publisher registers it *before* the full layout, so a
        reader woken by the completion finds the delta already there."""
        return any(li.complete for name, li in self.layouts.items() if not is_delta_layout(name))


@dataclass
class ModelInfo:
    counter: int = 0  # highest version number ever handed out
    versions: dict[int, VersionInfo] = field(default_factory=dict)
    #: The newest complete version (None: none yet). Versions only ever become complete,
    #: so this only grows; ``latest`` reads it in O(1).
    newest: Optional[int] = None

    def completed(self, version: int) -> bool:
        """A version became complete; True if it is the new newest."""
        if self.newest is None or version > self.newest:
            self.newest = version
            return True
        return False


class Catalog:
    """Durable facts, each change queued as a write for the store."""

    def __init__(self) -> None:
        self.models: dict[str, ModelInfo] = {}
        #: (model, request_id) -> version: allocations already answered (bounded per model).
        self.allocations: dict[tuple[str, str], int] = {}
        self._writes: list[Write] = []
        #: Models whose newest complete version changed since ``take_completed``.
        self._completed: set[str] = set()

    # ----------------------------------------------------------------- durability
    def take_writes(self) -> list[Write]:
        """Changes since the last call, in order; the shell commits them."""
        w, self._writes = self._writes, []
        return w

    def take_completed(self) -> set[str]:
        """Models with a new newest complete version since the last call (the shell wakes
        whoever waits for one)."""
        c, self._completed = self._completed, set()
        return c

    def rows(self) -> list[Write]:
        """Every durable fact as writes (what a store holds)."""
        rows: list[Write] = []
        for name, m in self.models.items():
            rows.append(("model", (name,), m.counter))
            for v, vi in m.versions.items():
                rows.append(("version", (name, v), vi.created))
                for lname, li in vi.layouts.items():
                    rows.append(("layout", (name, v, lname), li.num_shards))
                    for shard, man in li.manifests.items():
                        rows.append(("manifest", (name, v, lname, shard), man))
        for key, v in self.allocations.items():
            rows.append(("allocation", key, v))
        return rows

    @classmethod
    def restore(cls, rows: Iterable[Write]) -> "Catalog":
        """Rebuild from durable rows (tables in any order)."""
        cat = cls()
        for table, key, value in sorted(rows, key=lambda r: _TABLES[r[0]]):
            if table == "model":
                cat.models[key[0]] = ModelInfo(counter=value)
            elif table == "version":
                cat.models.setdefault(key[0], ModelInfo()).versions[key[1]] = VersionInfo(created=value)
            elif table == "layout":
                cat.models[key[0]].versions[key[1]].layouts[key[2]] = LayoutInfo(num_shards=value)
            elif table == "manifest":
                li = cat.models[key[0]].versions[key[1]].layouts[key[2]]
                li.manifests[key[3]] = value
                if li.complete and not is_delta_layout(key[2]):
                    cat.models[key[0]].completed(key[1])
            elif table == "allocation":
                cat.allocations[tuple(key)] = value
        return cat

    # ----------------------------------------------------------------- lookups
    def model(self, model: str) -> ModelInfo:
        m = self.models.get(model)
        if m is None:
            raise NotFoundError(f"unknown model {model!r}", "unknown_model")
        return m

    def version(self, model: str, version: int) -> VersionInfo:
        m = self.model(model)
        vi = m.versions.get(version)
        if vi is None:
            why = "it was retired (or skipped)" if version <= m.counter else f"newest allocated: {m.counter}"
            raise NotFoundError(f"model {model!r} has no version {version} ({why})", "unknown_version")
        return vi

    def layout(self, model: str, version: int, layout: str, shard: int) -> LayoutInfo:
        """The layout of (model, version) that has a manifest for ``shard``."""
        vi = self.version(model, version)
        li = vi.layouts.get(layout)
        if li is None or shard not in li.manifests:
            raise NotFoundError(
                f"{model!r} v{version} has no layout {layout!r} shard {shard} "
                f"(layouts: {sorted(vi.layouts) or 'none'})",
                "unknown_layout",
            )
        return li

    def manifest(self, model: str, version: int, layout: str, shard: int) -> Manifest:
        return self.layout(model, version, layout, shard).manifests[shard]

    def latest(self, model: str, newer_than: Optional[int] = None) -> Optional[int]:
        """Newest complete version (or None); ``newer_than`` only filters. O(1)."""
        best = self.model(model).newest
        if best is not None and newer_than is not None and best <= newer_than:
            return None
        return best

    # ----------------------------------------------------------------- changes
    def allocate(self, now: float, model: str, version: Optional[int] = None,
                 request_id: Optional[str] = None) -> int:
        """A new version number (``None``) or an explicit one claimed.

        An explicit version above the counter raises the counter to it; one at or below it
        must already exist (versions are never reused). A new version asked for again with
        the same ``request_id`` (a client retry whose first answer was lost) gets the same
        number: retries never skip one."""
        if version is None and request_id is not None:
            hit = self.allocations.get((model, request_id))
            if hit is not None:
                if hit not in self.models[model].versions:  # abandoned and retired since
                    raise ConflictError(
                        f"version {hit} of {model!r}, allocated for request {request_id!r}, was retired "
                        "(abandoned: nothing was registered for it in time); publish again with a new "
                        "request id", "version_retired")
                return hit
        m = self.models.get(model)
        if m is None:
            m = self.models[model] = ModelInfo()
        if version is None:
            version = m.counter + 1
        elif version <= m.counter:
            if version in m.versions:
                return version
            raise ConflictError(
                f"version {version} of {model!r} was skipped or retired (counter is {m.counter}); "
                "versions are never reused",
                "version_reused",
            )
        m.counter = version
        m.versions[version] = VersionInfo(created=now)
        self._writes.append(("model", (model,), m.counter))
        self._writes.append(("version", (model, version), now))
        if request_id is not None:
            self.allocations[(model, request_id)] = version
            self._writes.append(("allocation", (model, request_id), version))
            if version % 64 == 0:  # keep the answers of the last ALLOCATIONS_KEPT allocations
                floor = version - ALLOCATIONS_KEPT
                for key in [k for k, v in self.allocations.items() if k[0] == model and v <= floor]:
                    del self.allocations[key]
                self._writes.append(("allocation_floor", (model,), floor))
        return version

    def retire(self, model: str, version: int) -> None:
        """Forget a version's metadata (layouts, manifests). Its number is never handed
        out again: the model's counter stays."""
        del self.models[model].versions[version]
        self._writes.append(("retire", (model, version), None))

    def add_manifest(self, req: RegisterReplica, check_partial=None) -> LayoutInfo:
        """Record the layout and the shard's manifest a replica registers: the first
        manifest of (model, version, layout, shard) is final, a different one is refused
        naming the first difference. ``check_partial(req, known manifest or None)`` runs
        before anything is recorded (a partial replica needs a complete one first)."""
        vi = self.version(req.model, req.version)
        li = vi.layouts.get(req.layout)
        if li is not None and li.num_shards != req.num_shards:
            raise ManifestMismatchError(
                f"{req.model!r} v{req.version} layout {req.layout!r}: num_shards {req.num_shards} "
                f"!= registered {li.num_shards}",
                "manifest_mismatch",
            )
        known = li.manifests.get(req.shard) if li is not None else None
        if check_partial is not None:
            check_partial(req, known)
        if known is None and (req.manifest.slices is not None or (li is not None and any(
                m.slices is not None for m in li.manifests.values()))):
            # A sliced publish (``_slices``): agreeing, no overlap, and no gap once the last shard is in.
            check_register(li.manifests if li is not None else {}, req.shard, req.manifest, req.num_shards,
                           f"{req.model!r} v{req.version} layout {req.layout!r}")
        if li is None:
            li = vi.layouts[req.layout] = LayoutInfo(num_shards=req.num_shards)
            self._writes.append(("layout", (req.model, req.version, req.layout), req.num_shards))
        if known is None:
            li.manifests[req.shard] = req.manifest
            self._writes.append(("manifest", (req.model, req.version, req.layout, req.shard), req.manifest))
            if li.complete and not is_delta_layout(req.layout) and self.models[req.model].completed(req.version):
                self._completed.add(req.model)
        elif req.manifest is not known:  # (registered by digest: the very manifest, nothing to compare)
            diff = first_difference(known, req.manifest)
            if diff is not None:
                raise ManifestMismatchError(
                    f"{req.model!r} v{req.version} layout {req.layout!r} shard {req.shard}: {diff}",
                    "manifest_mismatch",
                )
        return li
