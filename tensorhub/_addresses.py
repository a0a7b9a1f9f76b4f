"""A replica's tensor addresses on the wire: a plain list, or a few runs (``AddressRuns``).

Why: a replica names one address per tensor. For a 50,000-tensor shard that is ~0.8 MB of
JSON in each registration (the serving lease's offer, the release + complete call) and in
each lease answer per source, so the coordinator's CPU per reader-version grew with the
tensor count. Memory the Hub allocates (``_tensors.allocate_like``: ``hub.empty_like`` and
every fetched copy) places tensors in manifest order at a fixed alignment, so its addresses
are one run: ``[start, count]``, each next address the previous one plus the previous
tensor's ``nbytes`` rounded up to ``align``. Tensors at arbitrary addresses (a user's own,
an engine's parameters) stay a plain list: runs are sent only when they are much shorter.

Who calls what:

- holder / reader (``Session``): :func:`encode` once per held replica, when the coordinator
  said it reads runs (``WorkerRegistered.address_runs``); :func:`expand_grant` on every
  lease answer, so the rest of the client sees plain addresses as before.
- coordinator (``server.state``): :func:`check` on every registration (count against the
  manifest, bounds; O(runs) after one O(tensors) pass per manifest), :func:`stored` keeps
  the form it was sent (never expanded), :func:`answer` writes a source into a lease answer:
  its runs to readers that asked for them, else its addresses (expanded once per replica
  for readers that predate runs).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

from ._exceptions import InvalidRequestError
from ._kept import KeptBy
from .protocol import AddressRuns, LeaseGrant, Manifest

__all__ = ["ALIGNS", "encode", "expand", "check", "checked", "invalid", "stored", "answer", "expand_grant", "same_tensors"]

#: Alignments :func:`encode` tries: the Hub's own (``_tensors.ALIGN``) and the CUDA caching
#: allocator's block size (engines' parameters are often allocated back to back).
ALIGNS = (64, 512)
#: Runs are sent when there are at most this fraction of the tensors (else the plain list).
RUNS_FRACTION = 4
#: One past the largest address.
ADDRESS_END = 1 << 64

#: (manifest, align) -> (offsets, sizes): offsets[i] = sum of the rounded sizes of the
#: tensors before i (int64, n + 1 entries), and the sizes themselves.
_prefixes = KeptBy(16)
#: runs -> expanded list: what old readers are answered, built once per replica.
_expanded = KeptBy(16)

Addresses = Union[list, AddressRuns]


#: manifest -> the manifest with the same tensors whose prefixes it uses (:func:`same_tensors`).
_same = KeptBy(16)


def same_tensors(manifest: Manifest, earlier: Manifest) -> None:
    """``manifest`` has ``earlier``'s tensors (``ManifestLike``): use its prefixes."""
    root = _same.get(earlier, lambda: earlier)
    _same.get(manifest, lambda: root)


def _prefix(manifest: Manifest, align: int) -> tuple[np.ndarray, np.ndarray]:
    """Each tensor's offset inside a run (relative to the run's first tensor's, by
    subtraction) and each tensor's size; kept for the last few manifests (by identity)."""
    base = _same.get(manifest, lambda: manifest)
    return _prefixes.get(base, lambda: _offsets(base, align), align)


def _offsets(manifest: Manifest, align: int) -> tuple[np.ndarray, np.ndarray]:
    sizes = np.fromiter((t.nbytes for t in manifest.tensors), dtype=np.int64, count=len(manifest.tensors))
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(-(-sizes // align) * align, out=offsets[1:])  # <= 1 PiB + 2^30 per tensor: fits
    return offsets, sizes


def encode(addresses: Sequence[int], manifest: Manifest) -> Optional[AddressRuns]:
    """The runs that place exactly ``addresses`` (one per tensor of ``manifest``), with the
    alignment of :data:`ALIGNS` that needs the fewest; None when the plain list is about
    as short (fewer than :data:`RUNS_FRACTION` tensors per run)."""
    n = len(addresses)
    if n != len(manifest.tensors) or n < RUNS_FRACTION:
        return None
    a = np.asarray(addresses, dtype=np.uint64)
    best: Optional[tuple[int, np.ndarray]] = None
    for align in ALIGNS:
        offsets, _ = _prefix(manifest, align)
        step = np.diff(offsets[:-1]).astype(np.uint64)  # each tensor's rounded size (not the last's)
        # a continues when it is the previous address plus its rounded size, without wrapping
        cont = (a[1:] == a[:-1] + step) & (a[1:] >= a[:-1])
        starts = np.concatenate(([0], np.flatnonzero(~cont) + 1))
        if best is None or len(starts) < len(best[1]):
            best = (align, starts)
    assert best is not None
    align, starts = best
    if len(starts) * RUNS_FRACTION > n:
        return None
    counts = np.diff(np.append(starts, n))
    return AddressRuns.model_construct(align=align, runs=[(int(a[s]), int(c)) for s, c in zip(starts, counts)])


def check(addresses: Sequence[int], runs: Optional[AddressRuns], manifest: Manifest,
          error: Callable[[str], Exception]) -> None:
    """Refuse (``raise error(why)``) addresses that do not place the manifest's tensors:
    a count other than its tensor count, or a run that ends past the 64-bit address space.
    Runs are not expanded: O(runs) once the manifest's offsets are known."""
    n = len(manifest.tensors)
    if runs is None:
        if len(addresses) != n:
            raise error(f"{len(addresses)} addresses for {n} tensors")
        return
    if runs.count != n:
        raise error(f"address_runs place {runs.count} tensors in {len(runs.runs)} runs; the manifest has {n}")
    offsets, sizes = _prefix(manifest, runs.align)
    i = 0
    for k, (start, c) in enumerate(runs.runs):
        last = i + c - 1
        if start + int(offsets[last] - offsets[i]) + int(sizes[last]) > ADDRESS_END:
            raise error(f"address run #{k} [{start}, {c}] (align {runs.align}) ends past the 64-bit address space")
        i += c


def expand(runs: AddressRuns, manifest: Manifest) -> list[int]:
    """The address of every tensor (``check`` first: refused runs raise ValueError)."""
    check([], runs, manifest, ValueError)
    offsets, _ = _prefix(manifest, runs.align)
    out = np.empty(len(manifest.tensors), dtype=np.uint64)
    i = 0
    for start, c in runs.runs:
        out[i:i + c] = (offsets[i:i + c] - offsets[i]).astype(np.uint64) + np.uint64(start)
        i += c
    return out.tolist()


# ------------------------------------------------------------------ coordinator
def checked(req: Any) -> Any:
    """A registration that carries its manifest (``RegisterReplica``), once :func:`check`
    accepts its addresses (else ``InvalidRequestError``, a 422 ``invalid_request``)."""
    check(req.addresses, req.address_runs, req.manifest, invalid)
    return req


def invalid(why: str) -> Exception:
    return InvalidRequestError(why, "invalid_request")


def stored(req: Any) -> Addresses:
    """What the coordinator keeps of a registration's addresses (``RegisterReplica`` or
    ``ServeOffer``): the runs as sent, or the list. Never expanded."""
    return req.address_runs if req.address_runs is not None else list(req.addresses)


def answer(addresses: Addresses, runs_ok: bool, manifest: Manifest) -> dict:
    """A source's address fields in a lease answer (``ReplicaInfo``): runs to a reader that
    reads them, else one address per tensor (the same list object for every answer naming
    the replica, so ``LeaseAnswers`` encodes it once)."""
    if not isinstance(addresses, AddressRuns):
        return {"addresses": addresses}
    if runs_ok:
        return {"addresses": [], "address_runs": addresses}
    return {"addresses": _expanded.get(addresses, lambda: expand(addresses, manifest))}


# ------------------------------------------------------------------ client
def expand_grant(grant: LeaseGrant, manifest: Callable[[], Manifest]) -> LeaseGrant:
    """The grant with every source's runs expanded to its addresses (``manifest()``, the
    shard's, is asked only when some source has runs). Raises ValueError for runs that do
    not fit the manifest."""
    if all(r.address_runs is None for r in grant.replicas):
        return grant
    m = manifest()
    replicas = [r if r.address_runs is None else
                r.model_copy(update={"addresses": expand(r.address_runs, m), "address_runs": None})
                for r in grant.replicas]
    return grant.model_copy(update={"replicas": replicas})
