"""The coordinator's lease decisions (``CoordinatorState.acquire_lease`` and its helpers):
pure, no I/O and no clock, like the rest of the state machine (its invariants are listed in
``server.state``). :class:`Grants` is given what it decides over, explicitly: the catalog, the
registry, the timing knobs, and ``now`` on every call (the state's clamped clock); it owns
only its own tables (plans, seeders, answered requests).

Two paths (issue 13: the coordinator's work per reader must not grow with the fleet):

* **under a striped plan** (``server.stripes``; most pipelined readers of a version at scale):
  the answer is made from the shard's complete replicas (``Registry.complete_of_shard``),
  the datacenter's seeder and the reader's parents, each looked up by id. Its work does
  not grow with the number of readers: at 1,024 readers of one shard the serving lease and
  its refresh scanned all 1,024 partial replicas (2.7 ms and 2.4 ms of the coordinator's
  CPU each, ``benchmarks/bench_routes.py``);
* **otherwise** (no plan: small shards, ``--no-plans``, readers that do not serve, a plan
  with nobody left to read from) every replica of the shard is a candidate for
  ``_planner.choose_sources``, as before plans.
"""

from __future__ import annotations

import itertools
import secrets
from typing import Callable, Iterator, Optional

from .. import _addresses
from .catalog import Catalog
from .._checksum import count
from .._exceptions import ConflictError, InvalidRequestError, NotFoundError
from .._kept import KeptBy
from .._planner import (
    COST_DC, LEVELS, Candidate, Choice, choose_sources, chunk_order, claims, grid_chunk_bytes, group_key, locality_cost,
    reserve_chunks, start_fraction, start_reverse,
)
from .registry import Lease, Registry, Replica, ShardKey, Worker
from .state_config import StateConfig
from .._slices import SLICED
from .stripes import HOSTS_IN_PLANS, MIN_CHUNKS, NONE, STRIPES, WAN, Plan, plan_root, relayed, wan_root, wan_stripes
from ..protocol import AcquireLease, LeaseGrant, Manifest, RegisterReplica, ReplicaInfo

__all__ = ["Grants", "KEPT", "grid_of", "keep_grid"]

#: Per-shard memos kept (chunk grids, arrival counters): the newest this many shards.
KEPT = 256
#: The empty chunk set (shared: most partial replicas report none, chunk maps never do).
_NONE: frozenset = frozenset()


#: Each manifest's chunk grid, by identity (:func:`grid_of`).
_GRIDS = KeptBy(KEPT)


def grid_of(man: Manifest) -> tuple[int, int]:
    """(chunk bytes, chunks) of a shard's grid (``grid_chunk_bytes`` of its size;
    ``_checksum.count``: pieces per chunk are capped too, so not simply size / chunk bytes):
    sums over every tensor (~20 ms for 50,000), made once per manifest and kept by identity,
    so the registration's parse thread can make them before the state call
    (``server.ahead.warm``)."""
    def make() -> tuple[int, int]:
        sizes = [t.nbytes for t in man.tensors]
        return grid_chunk_bytes(sum(sizes)), count(sizes)

    return _GRIDS.get(man, make)


def keep_grid(man: Manifest, grid: tuple[int, int]) -> None:
    """Keep ``grid`` as ``man``'s (a manifest made from another with the same tensors)."""
    _GRIDS.get(man, lambda: grid)


#: Registers a new pipelined lease's partial replica (``CoordinatorState.register_replica``):
#: (now, its registration) -> (replica id, complete).
Offer = Callable[[float, RegisterReplica], tuple[str, bool]]


class Grants:
    """The lease decisions over ``catalog`` and ``registry`` (``CoordinatorState`` holds one).
    ``new_id(prefix)`` names leases; ``offer`` registers a serving reader's partial replica;
    ``restored_at``: when a state restored from a store booted (None: not restored), whose
    re-registration window (``worker_ttl``) calls no version gone."""

    def __init__(self, catalog: Catalog, registry: Registry, config: StateConfig, *,
                 new_id: Callable[[str], str], offer: Offer, restored_at: Optional[float] = None):
        self.catalog, self.registry, self.config = catalog, registry, config
        self.new_id, self.offer, self.restored_at = new_id, offer, restored_at
        #: (model, version, layout, shard, level, *group) -> (seeder worker id, named at);
        #: level and group as in ``_planner.group_key`` (host, zone, datacenter).
        self.seeders: dict[tuple, tuple[str, float]] = {}
        #: (worker, request_id) -> (lease id, grant): leases already answered (soft).
        self.lease_requests: dict[tuple[str, str], tuple[str, LeaseGrant]] = {}
        #: shard key -> leases granted on it so far (:meth:`_arrival`).
        self._arrivals: dict[ShardKey, int] = {}
        #: Striped plans (``server.stripes``): (shard key, datacenter or ``WAN``, root) -> plan, and
        #: (shard key, worker) -> the plan it is a member of.
        self.plans: dict[tuple, Plan] = {}
        self.plan_of: dict[tuple, tuple] = {}
        #: (shard key, worker) -> its serve offer's answer, for subscribers put into a plan
        #: before their grant is made (:meth:`join_ahead`).
        self.joined: dict[tuple, tuple[Optional[str], str]] = {}

    @property
    def workers(self) -> dict[str, Worker]:
        return self.registry.workers

    def forget(self, now: float) -> None:
        """Expiry (``CoordinatorState.expire``): answered requests whose lease is gone,
        seeders that are gone, plans unused for two lease TTLs."""
        for key in [k for k, (lid, _) in self.lease_requests.items() if lid not in self.registry.leases]:
            del self.lease_requests[key]
        for key in [k for k, (wid, _) in self.seeders.items() if wid not in self.workers]:
            del self.seeders[key]
        for pk in [pk for pk, p in self.plans.items() if now > p.last_used + 2 * self.config.lease_ttl]:
            for w in self.plans.pop(pk).replicas:
                self.plan_of.pop((pk[0], w), None)

    def acquire_lease(self, now: float, req: AcquireLease) -> LeaseGrant:
        """A reader asks to read (model, version, layout, shard). Asked again with the same
        ``request_id`` while that lease is open, it answers the first grant again. Under a
        striped plan its work does not grow with the shard's readers (module docstring).
        ``now``: the state's clamped clock."""
        reader = self.workers.get(req.worker_id)
        if reader is None:
            raise NotFoundError(f"unknown worker {req.worker_id!r}; register again", "unknown_worker")
        leases = self.registry.leases
        if req.request_id is not None and req.lease_id is None:
            hit = self.lease_requests.get((req.worker_id, req.request_id))
            if hit is not None and hit[0] in leases and leases[hit[0]].expires >= now:
                # (granted before this retry arrived: the reader trusts it from then on)
                return hit[1].model_copy(update={"granted_after": min(0.0, leases[hit[0]].granted_at - now)})
        sliced = self._sliced(now, req)
        if sliced is not None:
            if not req.slices or req.ahead:
                raise ConflictError(f"{req.model!r} v{req.version} was published as slices ({sliced} shards of "
                                    f"layout {SLICED!r}); read them and assemble the full tensors", "read_slices")
            return LeaseGrant(lease_id="", model=req.model, version=req.version, layout=SLICED, shard=0,
                              num_shards=sliced, replicas=[], ttl=0.0)  # the layout, and no lease
        li = self.catalog.layout(req.model, req.version, req.layout, req.shard)
        excluded = set(req.exclude)
        key = ShardKey(req.model, req.version, req.layout, req.shard)
        refresh = leases.get(req.lease_id) if req.lease_id is not None else None
        if refresh is not None and (refresh.worker_id != req.worker_id or refresh.expires < now
                                    or refresh.key != key):
            raise ConflictError(f"lease {req.lease_id} has lapsed or is not this reader's; read again",
                                "lease_lapsed")
        reg = self.registry
        skeys, seeders = self._seeders_of(now, key, reader)
        fast, offered = self._planned(now, req, key, reader, refresh, seeders, excluded, li.num_shards)
        own: Optional[frozenset] = None
        own_num = 0
        partials: list[tuple[Replica, Worker]] = []
        if fast is not None:
            choice, row, again, by_id = fast
        else:
            row, again = [], 0.0
            choice, by_id, own, own_num, partials = self._choose(now, req, key, reader, refresh, seeders, excluded)
        if not choice.sources and not (req.pipelined and by_id):
            self._check_gone(now, key, req.worker_id)
            raise ConflictError(
                f"no replica of {req.model!r} v{req.version} layout {req.layout!r} shard {req.shard} "
                "is serving now",
                "no_replica",
            )
        for lvl in choice.seed_levels:
            if seeders[lvl][0] != req.worker_id:
                self.seeders[skeys[lvl]] = (req.worker_id, now)
        chosen = [(cost, by_id[c.replica_id][0], by_id[c.replica_id][1]) for c, cost in choice.sources]
        ids = tuple(r.replica_id for _, r, _ in chosen)
        if refresh is not None:
            lid, lease = refresh.lease_id, refresh
            # Keep naming replicas an earlier answer sent it to: reads from them may still run.
            self.registry.name_replicas(lease, ids)  # expiry: renew only
        else:
            lid = self.new_id("l")
            k = self._arrival(key)
            lease = Lease(lid, req.worker_id, req.model, req.version, req.layout, req.shard, ids, now,
                          now + self.config.lease_ttl, start_fraction(k), start_reverse(k),
                          secret=secrets.token_bytes(16))
            self.registry.add_lease(lease)
            for _, r, w in chosen:
                r.served += 1
                w.served_leases += 1
        # A scarce complete source (the publisher, the slow link) is split between readers
        # near each other, not raced for (_planner.claims / reserve_chunks).
        def nearby() -> Iterator[tuple]:  # consumed only when a source is scarce (``claims``)
            held_back: dict[str, frozenset] = {}
            for l in reg.leases_of_shard(key):
                if l.reserved and l is not lease and l.expires >= now:
                    held_back[l.worker_id] = held_back.get(l.worker_id, _NONE) | l.reserved
            for r, w in partials:
                yield (locality_cost(reader.locality, w.locality), frozenset(r.coming) if r.coming else _NONE,
                       held_back.get(r.worker_id, _NONE))

        claimed = None if fast is not None else claims([(c, cost) for c, cost in choice.sources], nearby())
        reserved: Optional[list[int]] = None
        if claimed is not None and own is not None:
            lease.reserved = reserve_chunks(chunk_order(own_num, lease.start, lease.reverse), own, claimed,
                                            lease.reserved)
            reserved = sorted(lease.reserved)
        chunk_bytes = grid_of(li.manifests[req.shard])[0] if req.pipelined else 0
        partial_id, refused = offered if offered is not None else \
            self._serve_offer(now, req, li.num_shards) if refresh is None else (None, "")
        grant = LeaseGrant(
            lease_id=lid,
            model=req.model,
            version=req.version,
            layout=req.layout,
            shard=req.shard,
            num_shards=li.num_shards,
            # Only clients that read manifests by version say so; older ones get it every time.
            manifest=li.manifests[req.shard] if req.manifest else None,
            # The registry's records, validated when registered: not again (~6 ms per 50,000 addresses).
            replicas=[
                ReplicaInfo.model_construct(
                    replica_id=r.replica_id, worker_id=w.worker_id, endpoint=w.endpoint,
                    locality=w.locality, cost=cost,
                    **_addresses.answer(r.addresses, req.address_runs, li.manifests[req.shard]),
                    chunks=None if r.chunks is None else sorted(r.chunks),
                    coming=sorted(r.coming) if r.chunks is not None else [],
                    status_addr=r.status_addr, status_tag=r.status_tag,
                    num_chunks=r.num_chunks if r.chunks is not None else 0,
                )
                for cost, r, w in chosen
            ],
            ttl=self.config.lease_ttl,
            chunk_bytes=chunk_bytes,
            start=lease.start if req.pipelined else 0.0,
            reverse=req.pipelined and lease.reverse,
            claimed=sorted(claimed or ()),
            reserved=reserved,
            seed=choice.seed,
            reason=choice.reason,
            partial_replica_id=partial_id,
            serve_refused=refused,
            stripes=len(row),
            stripe_sources=row,
            refresh_after=max(0.0, again - now) if again else 0.0,
            # (a refresh answers the same secret; a retried request the same grant)
            secret=lease.secret.hex() if req.lease_secret else "",
        )
        if req.request_id is not None and refresh is None:
            self.lease_requests[(req.worker_id, req.request_id)] = (lid, grant)
        return grant


    def _choose(self, now: float, req: AcquireLease, key: ShardKey, reader: Worker, refresh: Optional[Lease],
                seeders: dict, excluded: set) -> tuple:
        """Off a plan: every serving replica of the shard is a candidate
        (``_planner.choose_sources``). Returns (choice, by replica id (replica, worker), the
        reader's own reported chunks and chunk count, other readers' partial replicas)."""
        cands, by_id = [], {}
        own: Optional[frozenset] = None
        own_num = 0
        partials: list[tuple[Replica, Worker]] = []  # other readers' partial replicas
        workers, reg = self.workers, self.registry
        for r in reg.replicas_of_shard(key):
            partial, mine = r.chunks is not None, r.worker_id == req.worker_id
            if mine:
                if partial and r.status_addr is None:
                    # (a chunk-map replica reports nothing: no reservations from its reports)
                    own, own_num = frozenset(r.chunks | r.coming), r.num_chunks
                continue
            w = workers.get(r.worker_id)
            if partial and req.pipelined and w is not None:
                partials.append((r, w))
            if w is None or r.draining or r.suspect_until > now or r.replica_id in excluded:
                continue
            by_id[r.replica_id] = (r, w)
            cands.append(Candidate(r.replica_id, r.worker_id, w.locality, reg.load(r.replica_id, now, refresh),
                                   r.registered_at,
                                   None if not partial else frozenset(r.chunks) if r.chunks else _NONE,
                                   frozenset(r.coming) if partial and r.coming else _NONE))
        choice = choose_sources(reader.locality, req.worker_id, cands, max_sources=req.max_sources,
                                pipelined=req.pipelined, seeders=seeders, policy=self.config.policy, have=own)
        return choice, by_id, own, own_num, partials

    def _arrival(self, key: ShardKey) -> int:
        """How many leases of the shard were granted before this one: where a reader starts
        in the chunk order (``_planner.start_fraction``), so concurrent readers spread out."""
        k = self._arrivals.get(key, 0)
        self._arrivals[key] = k + 1
        while len(self._arrivals) > KEPT:
            self._arrivals.pop(next(iter(self._arrivals)))
        return k

    def _seeders_of(self, now: float, key: ShardKey, reader: Worker) -> tuple[dict, dict]:
        """The reader's seeder keys per locality level, and (seeder, alive) per level."""
        skeys = {lvl: key + (lvl,) + group_key(reader.locality, lvl) for lvl in LEVELS}
        seeders = {}
        for lvl, skey in skeys.items():
            who = self.seeders.get(skey, (None, 0.0))[0]
            seeders[lvl] = (who, self._seeder_alive(now, who, key))
        return skeys, seeders

    def _serving(self, now: float, key: ShardKey, reader_id: str, excluded: set
                 ) -> Callable[[str], Optional[tuple[Replica, Worker]]]:
        """``serving(rid)``: (replica, worker) if ``rid`` is a serving replica of the shard
        the reader may use, else None (each looked up once, by id)."""
        looked: dict[str, Optional[tuple[Replica, Worker]]] = {}

        def serving(rid: str) -> Optional[tuple[Replica, Worker]]:
            if rid not in looked:
                r = self.registry.replicas.get(rid)
                w = None if r is None else self.workers.get(r.worker_id)
                looked[rid] = (r, w) if w is not None and r.key == key and r.worker_id != reader_id \
                    and not r.draining and r.suspect_until <= now and rid not in excluded else None
            return looked[rid]

        return serving

    def join_ahead(self, now: float, req: AcquireLease) -> Optional[tuple]:
        """A subscriber bound to its version (``server.ahead.bind``): register its serve offer and
        put it into its datacenter's plan before any grant is made, so the plan's layout is
        fixed with every subscriber in it. Returns the plan's key, or None (no such plan:
        its grant is made the usual way)."""
        reader = self.workers.get(req.worker_id)
        if reader is None:
            return None
        key = ShardKey(req.model, req.version, req.layout, req.shard)
        _, seeders = self._seeders_of(now, key, reader)
        planned = self._plan(now, req, key, reader, None, seeders, self._serving(now, key, req.worker_id, set()))
        if planned is None or planned[1][1] == WAN or planned[0].fixed is not None:
            return None
        plan, pk = planned
        offered = self._serve_offer(now, req, self.catalog.layout(req.model, req.version, req.layout,
                                                                  req.shard).num_shards)
        if offered[0] is None:
            return None
        plan.join(req.worker_id, offered[0], now, reader.locality.host if HOSTS_IN_PLANS else None)
        self.plan_of[(key, req.worker_id)] = pk
        self.joined[(key, req.worker_id)] = offered
        return pk

    def _planned(self, now: float, req: AcquireLease, key: ShardKey, reader: Worker, refresh: Optional[Lease],
                 seeders: dict, excluded: set, num_shards: int) -> tuple:
        """Under a striped plan: ((choice, parents per stripe, when to ask again, by replica
        id (replica, worker)), the serve offer's answer if one was registered). (None, the
        offer's answer or None) off a plan, or when the plan leaves it nobody to read from.
        Every replica is looked up by id: nothing here grows with the shard's readers."""
        serving = self._serving(now, key, req.worker_id, excluded)

        def bad(rid: str) -> bool:
            return serving(rid) is None

        planned = self._plan(now, req, key, reader, refresh, seeders, serving)
        if planned is None:
            return None, None
        plan, pk = planned
        offered = None
        if refresh is None:
            # (a subscriber put into the plan already: its offer was registered then)
            offered = self.joined.pop((key, req.worker_id), None) or self._serve_offer(now, req, num_shards)
            if offered[0] is None:
                return None, offered  # (not serving: no member of a plan)
            plan.join(req.worker_id, offered[0], now, reader.locality.host if HOSTS_IN_PLANS else None)
            self.plan_of[(key, req.worker_id)] = pk
        wan = pk[1] == WAN
        row, again = plan.parents(req.worker_id, now, bad)
        if wan:  # the root's stripes from its own datacenter's plan, where it has one
            home = serving(plan.root)
            row = relayed(row, plan.root, None if home is None else
                          self.plans.get((key, home[1].locality.datacenter, plan.root)), bad)
        use = [x for x in dict.fromkeys(row) if x != NONE] or [plan.root]
        by_id = {rid: hit for rid in use if (hit := serving(rid)) is not None}
        if not by_id:
            return None, offered
        who = ("late carrier" if req.worker_id in plan.late else
               f"member {plan.order[req.worker_id] + 1}" if req.worker_id in plan.order else "late")
        # (across datacenters the reader seeds its groups: the others of its datacenter read
        # by a plan rooted at its partial replica)
        seed = tuple(lvl for lvl in LEVELS if not seeders[lvl][1] or seeders[lvl][0] == req.worker_id) \
            if wan else ()
        # (the plan chose these: a candidate here names its replica, nothing is ranked by its
        # load or chunks)
        sources = [(Candidate(rid, r.worker_id, w.locality), locality_cost(reader.locality, w.locality))
                   for rid, (r, w) in by_id.items()]
        choice = Choice(tuple(sources), seed, f"striped plan{' across datacenters' if wan else ''}, {who} of "
                        f"{len(plan.members)}" + (" (forming)" if again else ""))
        return (choice, row, again, by_id), offered

    def _plan(self, now: float, req: AcquireLease, key: ShardKey, reader: Worker, refresh: Optional[Lease],
              seeders: dict, serving: Callable[[str], Optional[tuple]]) -> Optional[tuple[Plan, tuple]]:
        """The striped plan (``server.stripes``) this reader reads by, and its key; None: the
        usual choice. A new serving pipelined lease joins one where one source is scarce
        (``server.stripes.plan_root``; across datacenters ``wan_root``); a refresh keeps the plan
        of its first grant. ``serving(rid)``: the replica and its worker if it may be used."""
        if refresh is not None or (key, req.worker_id) in self.joined:
            # (a subscriber bound ahead joined its plan in the publisher's call, ``join_ahead``:
            # that plan, not its root worked out again for each of a thousand grants)
            pk = self.plan_of.get((key, req.worker_id))
            return None if pk is None or pk not in self.plans else (self.plans[pk], pk)
        o = req.serve
        if not (req.pipelined and o is not None and self.config.plans and self.config.policy == "topology") \
                or o.num_chunks < MIN_CHUNKS:
            return None
        complete = [Candidate(r.replica_id, r.worker_id, hit[1].locality)
                    for r in self.registry.complete_of_shard(key) if (hit := serving(r.replica_id)) is not None]
        who, alive = seeders.get(COST_DC, (None, False))
        seeder_rid = None
        if alive and who is not None and who != req.worker_id:
            seeder_rid = next((r.replica_id for r in self.registry.replica_of(who, key)
                               if r.chunks is not None and serving(r.replica_id) is not None), None)
        root = plan_root(reader.locality, req.worker_id, complete, seeder_rid)
        scope = reader.locality.datacenter
        if root is None and not (alive and who not in (None, req.worker_id)):  # it seeds its datacenter
            root, scope = wan_root(reader.locality, req.worker_id, complete), WAN
        if root is None:
            return None
        pk = (key, scope, root)
        plan = self.plans.get(pk)
        if plan is None:
            stripes = STRIPES
            if scope == WAN:  # one stripe per datacenter that will seed (a scan once per version and shard)
                home = next(c.locality.datacenter for c in complete if c.replica_id == root)
                stripes = wan_stripes((w.locality.datacenter for w in self.workers.values()), home)
                if stripes < 2:
                    return None  # one datacenter to seed: nothing to stripe between (the usual choice)
            plan = self.plans[pk] = Plan(root, stripes, now)
        return plan, pk

    def _serve_offer(self, now: float, req: AcquireLease, num_shards: int) -> tuple[Optional[str], str]:
        """Register the partial replica a new pipelined lease offers (``req.serve``):
        (its id, "") or (None, why it was refused); the lease stands either way."""
        o = req.serve
        if o is None or not req.pipelined:
            return None, ""
        try:
            # Built from fields already validated (the lease request and its offer, the same
            # constraints): not validated again, which for 50,000 addresses is ~6 ms a lease.
            rid, _ = self.offer(now, RegisterReplica.model_construct(
                worker_id=req.worker_id, model=req.model, version=req.version, layout=req.layout, shard=req.shard,
                num_shards=num_shards, manifest=None, manifest_digest=o.manifest_digest, addresses=o.addresses,
                address_runs=o.address_runs,
                partial=True, chunk_bytes=o.chunk_bytes, num_chunks=o.num_chunks, status_addr=o.status_addr,
                status_tag=o.status_tag, release=[]))
            return rid, ""
        except (ConflictError, NotFoundError, InvalidRequestError) as e:
            return None, e.message

    def _sliced(self, now: float, req: AcquireLease) -> Optional[int]:
        """The one place that decides whether a reader of ``hf`` reads slices: its version was
        published sliced (``_slices``) and no assembled ``hf`` replica serves now. Then the
        number of shards of the sliced layout (the reader assembles the full tensors from the
        ranks' shards itself), else None."""
        if req.layout != "hf" or req.shard != 0:
            return None
        vi = self.catalog.version(req.model, req.version)
        sliced = vi.layouts.get(SLICED)
        if sliced is None or not sliced.complete:
            return None
        if "hf" in vi.layouts:
            for r in self.registry.replicas_of_shard(ShardKey(req.model, req.version, "hf", 0)):
                if not r.draining and r.suspect_until <= now and r.worker_id != req.worker_id \
                        and r.worker_id in self.workers and r.replica_id not in req.exclude:
                    return None  # an assembled copy serves: read it like any hf replica
        return sliced.num_shards

    def _check_gone(self, now: float, key: ShardKey, reader: str) -> None:
        """Raise ``version_gone`` when nobody serves the shard and nobody can again
        (invariant 11): it is not the newest complete version, no replica of it (complete,
        partial, draining, suspect or fenced) is left, no other reader holds a lease on it
        (a plain reader registers its copy after reading), and re-registration after a
        restart (within ``worker_ttl`` of boot) is over."""
        model, version = key.model, key.version
        newest = self.catalog.latest(model)
        if newest is None or version >= newest:
            return
        if self.restored_at is not None and now <= self.restored_at + self.config.worker_ttl:
            return
        if any(r.worker_id != reader for r in itertools.chain(self.registry.replicas_of_shard(key),
                                                              self.registry.tombstones_of_shard(key))):
            return  # (the reader's own partial replica holds nothing it could read)
        if any(l.expires >= now and l.worker_id != reader for l in self.registry.leases_of_shard(key)):
            return
        raise ConflictError(
            f"{model!r} v{version} (layout {key.layout!r} shard {key.shard}) is no longer held by anyone and "
            f"cannot come back (it is not the newest); the newest complete version is v{newest}",
            "version_gone",
        )

    def _seeder_alive(self, now: float, seeder: Optional[str], key: ShardKey) -> bool:
        """Does the seeder named for a datacenter still count: a live worker holding a
        serving replica (partial or complete) of the shard, or (before it registered its
        partial replica) still holding a lease on the shard."""
        if seeder is None or seeder not in self.workers:
            return False
        for r in self.registry.replica_of(seeder, key):
            return not r.draining and r.suspect_until <= now
        return any(l.expires >= now for l in self.registry.shard_leases_of(seeder, key))
