"""How a replica's registration names its shard's manifest without sending it, checked
against the catalog: by the digest of the registered one (readers, ``manifest_digest``), or
as an earlier version's with this version's sums (``ManifestLike``: publishers of a model
trained in place); and a partial replica's chunk grid checked against the shard's.
"""

from __future__ import annotations

from typing import Optional

from .. import _addresses
from .catalog import Catalog
from .._exceptions import ConflictError, InvalidRequestError, ManifestMismatchError, NotFoundError
from .grants import KEPT, grid_of, keep_grid
from ..protocol import Manifest, RegisterReplica, keep_like, manifest_digest, shape_digest

__all__ = ["ManifestRefs", "DIGESTS_KEPT"]

#: Manifest digests kept (computed once per shard of a version; ~100 ms for 50,000 tensors):
#: as many shards as the other per-shard memos (``server.grants.KEPT``).
DIGESTS_KEPT = KEPT


class ManifestRefs:
    """The manifests registrations refer to, in ``catalog``."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        #: (model, version, layout, shard) -> digest of its manifest (registration by digest).
        self._digests: dict[tuple, str] = {}

    def by_digest(self, req: RegisterReplica) -> RegisterReplica:
        """The request with the registered manifest its digest names (refused if the shard
        has none yet, or another one)."""
        known = self.catalog.manifest(req.model, req.version, req.layout, req.shard)
        digest = self.digest_of(req.model, req.version, req.layout, req.shard, known)
        if digest != req.manifest_digest:
            raise ManifestMismatchError(
                f"{req.model!r} v{req.version} layout {req.layout!r} shard {req.shard}: manifest digest "
                f"{req.manifest_digest} != registered {digest}", "manifest_mismatch")
        _addresses.check(req.addresses, req.address_runs, known, _addresses.invalid)
        return req.model_copy(update={"manifest": known})

    def by_like(self, req: RegisterReplica) -> RegisterReplica:
        """The request with its manifest made from an earlier version's (``ManifestLike``: a
        publisher of a model trained in place sends that version's number and shape digest,
        and this version's sums): the earlier version's registered manifest of the shard,
        its tensors checked by shape digest, the sums by the count of its grid's chunks.
        What follows from the earlier manifest (its canonical JSON's tensors, shape digest,
        grid) is reused, not made again."""
        like = req.like
        assert like is not None
        where = f"{req.model!r} v{like.version} layout {req.layout!r} shard {req.shard}"
        try:
            earlier = self.catalog.manifest(req.model, like.version, req.layout, req.shard)
        except (NotFoundError, ConflictError):
            raise ConflictError(f"{where} is not known here (any more): send the manifest", "like_unknown") from None
        if earlier.slices is not None or shape_digest(earlier) != like.shape_digest:
            raise ConflictError(f"the tensors of {where} are not this replica's (shape digest): send the manifest",
                                "like_mismatch")
        grid = grid_of(earlier)
        if like.checksums is not None and len(like.checksums) != grid[1]:
            raise InvalidRequestError(f"{len(like.checksums)} checksums for a shard of {grid[1]} chunks (one per "
                                      "chunk of its grid)")
        m = like.manifest(earlier)
        keep_like(m, earlier, like.shape_digest)
        keep_grid(m, grid)
        _addresses.same_tensors(m, earlier)
        return _addresses.checked(req.model_copy(update={"manifest": m, "like": None}))

    def digest_of(self, model: str, version: int, layout: str, shard: int, known: Manifest) -> str:
        """``manifest_digest`` of a shard's registered manifest ``known`` (kept per shard)."""
        key = (model, version, layout, shard)
        digest = self._digests.get(key)
        if digest is None:
            digest = manifest_digest(known)
            self._digests[key] = digest
            while len(self._digests) > DIGESTS_KEPT:
                self._digests.pop(next(iter(self._digests)))
        return digest

    def check_partial(self, req: RegisterReplica, known: Optional[Manifest]) -> None:
        where = f"{req.model!r} v{req.version} layout {req.layout!r} shard {req.shard}"
        if known is None:
            raise ConflictError(f"partial replica of {where}, which has no complete replica yet", "unknown_layout")
        grid, chunks = grid_of(known)
        if req.chunk_bytes != grid or req.num_chunks != chunks:
            raise ConflictError(
                f"partial replica of {where}: chunk grid {req.chunk_bytes} bytes x {req.num_chunks} "
                f"!= the shard's {grid} bytes x {chunks}", "bad_chunk_grid")
