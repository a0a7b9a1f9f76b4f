"""Source choice, striping and cross-datacenter seeding, as pure functions.

No I/O, no clock, no coordinator state: the coordinator (``server.state.CoordinatorState.acquire_lease``)
and the flow-level simulation (``benchmarks/simulate.py``) call the same functions, so what
the simulation argues at 1,024 GPUs is the code that runs. The pipelined reader
(``_pipeline.PipelinedReader``) and the simulation also share :func:`pick_chunk`.

Rules (DESIGN.md, "Topology"; issue 4):

1. **Cost, then load.** ``locality_cost``: 0 same host, 1 same zone, 2 same datacenter,
   3 another datacenter. Candidates are ordered by (cost, open leases, more chunks held,
   registration time). A shard is striped over up to ``max_sources`` (K) replicas of the
   nearest cost tier.
2. **Partial replicas** (pipelined replication). A reader that is still receiving is a
   candidate, with the set of chunks it has *reported complete*; readers that asked for
   ``pipelined`` leases only. A chosen set made only of partial replicas that together
   miss some chunk also gets the nearest complete replica the reader may use, so every
   chunk stays reachable (no reader waits on a partial source that waits on it).
3. **Seeding, at every level** (host, zone, datacenter, from the inside out). While a
   pipelined reader's group at a level has no complete replica, exactly one reader of the
   group -- its *seeder* -- reads from outside the group; the others read only from the
   group's partial replicas. Across datacenters: one reader per (version, layout, shard,
   datacenter) crosses the slow link. A seeder keeps its group's partial replicas that
   hold chunks it lacks (so a new seeder resumes from what is already there). When the
   seeder is gone (dead, reported, unpublished, lease released), the next reader of that
   group that asks becomes the seeder (takeover).
4. **A scarce complete source is split, not raced for.** When a reader's sources are one
   complete replica plus partial ones (a publisher, or the far side of a slow link), the
   coordinator reserves for it the next chunks of its order that no reader within that
   distance receives or has reserved (:func:`reserve_chunks`), and tells it which chunks
   those readers are receiving (``claimed``); the reader reads only its reserved chunks from
   the complete source and the rest from the partial ones (:func:`pick_chunk`). Concurrent
   readers start at spread points of the chunk order and alternate direction.
5. **Baseline policy** ``single-source``: every reader reads from the version's first
   replica (the publisher). Only for benchmarks and the simulation's comparison.

Chunk grid: a shard's bytes, tensor after tensor, are cut into chunks of
:func:`grid_chunk_bytes` (the reader also splits at 2048 pieces per chunk). Every reader of
a shard uses the same grid, so chunk ``c`` means the same bytes on every replica.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence

from ._grid import grid_chunk_bytes  # noqa: F401 (also imported from here)
from .protocol import Locality

__all__ = [
    "COST_HOST", "COST_ZONE", "COST_DC", "COST_REMOTE", "POLICIES",
    "Candidate", "Choice", "LEVELS", "group_key", "locality_cost", "choose_sources", "grid_chunk_bytes",
    "start_fraction", "start_reverse", "pick_chunk", "chunk_order", "reserve_chunks", "RESERVE", "claims",
]

COST_HOST, COST_ZONE, COST_DC, COST_REMOTE = 0, 1, 2, 3
#: ``topology`` (the default) or ``single-source`` (baseline: everyone reads the publisher).
POLICIES = ("topology", "single-source")



def locality_cost(a: Locality, b: Locality) -> int:
    """0 same host, 1 same zone, 2 same datacenter, 3 elsewhere."""
    if a.datacenter != b.datacenter:
        return COST_REMOTE
    if a.zone != b.zone:
        return COST_DC
    if a.host != b.host:
        return COST_ZONE
    return COST_HOST


def start_fraction(k: int) -> float:
    """Where in the chunk order the k-th concurrent reader starts (golden-ratio spread),
    so concurrent readers pull different chunks from a complete source first."""
    return (k * 0.6180339887498949) % 1.0


def start_reverse(k: int) -> bool:
    """Whether the k-th concurrent reader walks the chunks downwards: readers alternate, so
    two readers closing in on the same gap split it from both ends instead of racing
    through it side by side (each pulling the same chunks from the complete source)."""
    return k % 2 == 1


def order_start(num_chunks: int, start: float) -> int:
    """The first chunk of ``chunk_order(num_chunks, start, ...)``."""
    return int(start * num_chunks) % max(1, num_chunks)


def chunk_order(num_chunks: int, start: float, reverse: bool = False) -> list[int]:
    """All chunk indices, starting at ``start`` (a fraction) and wrapping around; downwards
    when ``reverse``."""
    s = order_start(num_chunks, start)
    if reverse:
        return list(range(s, -1, -1)) + list(range(num_chunks - 1, s, -1))
    return list(range(s, num_chunks)) + list(range(s))


@dataclass(frozen=True)
class Candidate:
    """A replica the coordinator could hand to a reader."""

    replica_id: str
    worker_id: str
    locality: Locality
    load: int = 0  # open leases naming it
    registered_at: float = 0.0
    chunks: Optional[frozenset] = None  # chunks reported complete; None = complete replica
    coming: frozenset = frozenset()  # chunks a partial replica is receiving (a hint)

    @property
    def complete(self) -> bool:
        return self.chunks is None

    @property
    def held(self) -> int:
        return 1 << 62 if self.chunks is None else len(self.chunks)


@dataclass(frozen=True)
class Choice:
    """The planner's answer: sources as (candidate, cost), the group levels whose seeder the
    reader now is (``COST_HOST``/``COST_ZONE``/``COST_DC``), and why (for logs and tests)."""

    sources: tuple
    seed_levels: tuple
    reason: str

    @property
    def seed(self) -> bool:
        """Whether the reader is now its datacenter's seeder (it crosses to another one)."""
        return COST_DC in self.seed_levels


#: Group levels, innermost first: the readers with cost <= level to a reader form its group.
LEVELS = (COST_HOST, COST_ZONE, COST_DC)


def group_key(loc: Locality, level: int) -> tuple:
    """The group of ``loc`` at ``level``: its host, zone or datacenter."""
    return (loc.datacenter,) if level == COST_DC else \
        (loc.datacenter, loc.zone) if level == COST_ZONE else (loc.datacenter, loc.zone, loc.host)


def _key(c: Candidate, cost: int, have: frozenset = frozenset()) -> tuple:
    """Sort key: cost, then (partial replicas with nothing the reader lacks, held or coming,
    last), load, then most chunks the reader lacks."""
    if c.chunks is None:
        return (cost, False, c.load, -(1 << 62), c.registered_at, c.replica_id)
    useful = len(c.chunks - have)
    useless = not useful and not (c.coming - have)
    return (cost, useless, c.load, -useful, c.registered_at, c.replica_id)


def _stripe(pool: list[tuple[Candidate, int]], k: int, backup: list[tuple[Candidate, int]],
            have: frozenset = frozenset()) -> list[tuple[Candidate, int]]:
    """Up to ``k`` of the nearest tier of ``pool``; if those are all partial and miss a
    chunk some complete replica in ``backup`` has, the best such replica takes the last slot."""
    if not pool:
        return []
    pool = sorted(pool, key=lambda p: _key(p[0], p[1], have))
    tier = pool[0][1]
    chosen = [p for p in pool if p[1] == tier][:k]
    if any(c.complete for c, _ in chosen):
        return chosen
    complete = sorted((p for p in backup if p[0].complete), key=lambda p: _key(*p))
    if complete:
        chosen = chosen[: max(0, k - 1)] + [complete[0]]
    return chosen


def choose_sources(reader: Locality, reader_id: str, cands: Iterable[Candidate], *, max_sources: int,
                   pipelined: bool = True, seeders: Optional[Mapping[int, tuple]] = None,
                   seeder: Optional[str] = None, seeder_alive: bool = False, policy: str = "topology",
                   have: Optional[frozenset] = None) -> Choice:
    """Pick the replicas a reader reads from.

    ``cands``: serving replicas of the shard other than the reader's own (the caller drops
    draining, suspect, excluded ones). ``seeders``: level -> (seeder worker id, still
    counts) for the reader's groups (``seeder``/``seeder_alive``: the datacenter level's,
    for short). Partial candidates are ignored unless ``pipelined``. ``have``: chunks the
    reader already holds (a seeder keeps inner partial replicas only for chunks it lacks).

    Seeding, at every level from the inside out (host, zone, datacenter): while the
    reader's group at that level has no complete replica, one reader of the group (its
    seeder) reads from outside it; the others read only from the group's partial replicas.
    A seeder keeps its group's best partial replicas (to resume from what is there) and
    takes the rest by the usual rule (nearest tier, then load) from outside the group."""
    k = max(1, max_sources)
    levels = dict(seeders or {})
    if seeder is not None:
        levels.setdefault(COST_DC, (seeder, seeder_alive))
    pool = [(c, locality_cost(reader, c.locality)) for c in cands if c.worker_id != reader_id]
    if not pipelined:
        pool = [p for p in pool if p[0].complete]
    if policy == "single-source":
        complete = sorted((p for p in pool if p[0].complete), key=lambda p: (p[0].registered_at, p[0].replica_id))
        return Choice(tuple(complete[:1]), (), "single-source baseline: the first replica")
    if policy != "topology":
        raise ValueError(f"unknown planner policy {policy!r}; known: {', '.join(POLICIES)}")
    mine = have or frozenset()
    if not pipelined or not any(c.complete for c, _ in pool):
        # Complete replicas only, or none anywhere: nearest tier, then least loaded.
        return Choice(tuple(_stripe(pool, k, pool, mine)), (), "nearest tier, then least loaded")
    seeded: list[int] = []
    top = COST_REMOTE
    for lvl in LEVELS:
        group = [p for p in pool if p[1] <= lvl]
        if any(c.complete for c, _ in group):
            top = lvl
            break
        who, alive = levels.get(lvl, (None, False))
        if alive and who is not None and who != reader_id:
            follow = sorted(group, key=lambda p: (-p[0].held, p[1], p[0].load, p[0].replica_id))[:k]
            return Choice(tuple(sorted(follow, key=lambda p: _key(*p))), tuple(seeded),
                          f"follower: reads inside its {_NAMES[lvl]} (seeder {who})")
        seeded.append(lvl)
    if not seeded:
        return Choice(tuple(_stripe([p for p in pool if p[1] <= top], k, pool, mine)), (),
                      "nearest tier, then least loaded")
    inner = seeded[-1]
    useful = [p for p in pool if p[1] <= inner and (p[0].complete or not p[0].chunks <= mine)]
    keep = sorted(useful, key=lambda p: (-p[0].held, p[1], p[0].load, p[0].replica_id))[: k // 2]
    outside = [p for p in pool if inner < p[1] <= top]
    chosen = _stripe(outside, max(1, k - len(keep)), outside, mine) + keep
    prior = levels.get(seeded[-1], (None, False))[0]
    why = f"seeder of its {_NAMES[inner]}" + (f" (takes over from {prior})" if prior not in (None, reader_id) else "")
    if COST_DC in seeded:
        why += ": crosses to another datacenter once for its datacenter"
    return Choice(tuple(chosen), tuple(seeded), why)


_NAMES = {COST_HOST: "host", COST_ZONE: "zone", COST_DC: "datacenter", COST_REMOTE: "fleet"}


#: How many chunks a reader reserves at a time for reading from a complete replica.
RESERVE = 4


def claims(chosen: Sequence[tuple], nearby: Iterable[tuple]) -> Optional[frozenset]:
    """What a reader should leave to the readers near it, or None when nothing is scarce.

    ``chosen``: its sources as (candidate, cost); ``nearby``: other readers' partial
    replicas of the shard as (cost, chunks they are receiving, chunks reserved for them).
    Only while the chosen sources are exactly one complete replica, not on the reader's
    host, among partial ones (a publisher's uplink, or the far side of a slow link): the
    chunks that readers no farther than it are receiving or have reserved."""
    complete = [cost for c, cost in chosen if c.complete]
    if len(complete) != 1 or len(chosen) < 2 or complete[0] < COST_ZONE:
        return None
    near = [coming | reserved for cost, coming, reserved in nearby if cost <= complete[0]]
    return frozenset().union(*near) if near else None


def reserve_chunks(order: Sequence[int], have: frozenset, taken: frozenset, kept: frozenset,
                   n: int = RESERVE) -> frozenset:
    """The chunks a reader is to read from a complete replica next, when other readers
    nearby read the same shard: those it reserved before and still lacks, topped up to
    ``n`` with the first chunks in its ``order`` that it lacks and that no reader nearby
    holds, receives or has reserved (``taken``). Reserved atomically by the coordinator,
    so concurrent readers split a publisher's (or a slow link's) bytes instead of each
    pulling the same chunks; the rest they read from each other."""
    out = set(kept - have)
    for c in order:
        if len(out) >= n:
            break
        if c not in have and c not in taken:
            out.add(c)
    return frozenset(out)


def pick_chunk(order: Sequence[int], have: Optional[frozenset], others: Sequence[Optional[frozenset]],
               skip: set, coming: frozenset = frozenset()) -> Optional[int]:
    """The next chunk a reader should read from one source.

    ``order``: chunks the reader still needs, in its preferred order; ``have``: what the
    source holds (None = everything); ``others``: what each of the reader's other sources
    holds; ``skip``: chunks already in flight. Picks a chunk the source holds, held by the
    fewest other sources (rarest first), earliest in ``order``. A complete source is not
    asked for a chunk one of the reader's partial sources holds or is receiving
    (``coming``): partial sources can only serve what they hold, and a complete source's
    uplink (a publisher's, or the one crossing datacenters) is spent on what nobody near
    has or gets yet. Never a chunk the source does not hold."""
    best, best_n = None, None
    for c in order:
        if c in skip or (have is not None and c not in have):
            continue
        if have is None and (c in coming or any(o is not None and c in o for o in others)):
            continue
        n = sum(1 for o in others if o is None or c in o)
        if best_n is None or n < best_n:
            best, best_n = c, n
            if n == 0:
                break
    return best
