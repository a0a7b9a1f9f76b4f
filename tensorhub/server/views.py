"""What the coordinator observes and shows: fetch reports, ``/metrics`` and
``tensorhub status``.

Read-only over a :class:`~tensorhub.server.state.CoordinatorState` (``st``; no decision depends
on these; ``server.state`` calls them, so they do not import it); the shell calls them under its
lock.
"""

from __future__ import annotations

from typing import Any, Optional

from .._planner import locality_cost
from ..protocol.answers import LayoutView, ReplicaView, VersionView

__all__ = ["metrics_view", "status_view", "version_view", "record_fetch", "FETCH_STALE", "DISTANCES"]

#: A running fetch not reported for this long is dropped from the live table (seconds).
FETCH_STALE = 10.0
#: Most running fetches the live table keeps (more are not shown, still counted at the end).
MAX_LIVE_FETCHES = 10_000
#: ``locality_cost`` -> the ``distance`` label of fetched bytes.
DISTANCES = ("same_host", "same_zone", "same_datacenter", "other_datacenter")


def record_fetch(st: Any, now: float, req: Any) -> dict[str, int]:
    """A reader's fetch report: running (kept in the live table ``status`` shows) or ended
    (dropped from it; its bytes are credited to the source workers, which learn them on
    their heartbeats). Returns an ended fetch's bytes by distance (``DISTANCES``, or
    ``unknown`` for a worker no longer registered); ``{}`` for a running one."""
    key = (req.worker_id, req.model, req.version, req.layout, req.shard)
    if req.state == "running":
        if key in st.fetching or len(st.fetching) < MAX_LIVE_FETCHES:
            st.fetching[key] = (req, now)
        return {}
    st.fetching.pop(key, None)
    reader = st.workers.get(req.worker_id)
    by_distance: dict[str, int] = {}
    for wid, n in req.sources.items():
        src = st.workers.get(wid)
        if src is not None and wid != req.worker_id:
            src.served_bytes += n
        d = "unknown" if src is None or reader is None else \
            DISTANCES[locality_cost(reader.locality, src.locality)]
        by_distance[d] = by_distance.get(d, 0) + n
    return by_distance


def metrics_view(st: Any, now: float) -> dict:
    """Per model: its latest complete version, version counter, versions with a replica,
    replicas by state (``fenced``: tombstones of dropped workers that leases still name),
    bytes held by serving complete replicas, open leases; the worker count, and how often a
    pause gave every worker a fresh ttl."""
    models: dict[str, dict] = {}
    for name, m in st.models.items():
        models[name] = {"latest": m.newest, "counter": m.counter, "held_versions": set(),
                        "replicas": {"serving": 0, "partial": 0, "suspect": 0, "draining": 0, "fenced": 0},
                        "bytes": 0, "leases": 0}
    for r in st.replicas.values():
        mv = models.get(r.model)
        if mv is None:
            continue
        state = "draining" if r.draining else "suspect" if r.suspect_until > now else \
            "partial" if r.chunks is not None else "serving"
        mv["replicas"][state] += 1
        if state == "serving":
            mv["held_versions"].add(r.version)
            li = st.models[r.model].versions[r.version].layouts.get(r.layout)
            man = li.manifests.get(r.shard) if li is not None else None
            mv["bytes"] += man.nbytes if man is not None else 0
    for r in st.tombstones.values():
        if r.model in models:
            models[r.model]["replicas"]["fenced"] += 1
    for l in st.leases.values():
        if l.expires >= now and l.model in models:
            models[l.model]["leases"] += 1
    for mv in models.values():
        mv["held_versions"] = len(mv["held_versions"])
    return {"workers": len(st.workers), "models": models, "pauses": st.pauses}


def _layouts(vi: Any) -> dict:
    """A version's layouts as both views show them."""
    return {lname: {"num_shards": li.num_shards, "complete": li.complete,
                    "nbytes": sum(mf.nbytes for mf in li.manifests.values())}
            for lname, li in vi.layouts.items()}


def _partial(st: Any, r: Any) -> Optional[str]:
    """"k/n" chunks a partial replica holds (None: complete). A replica with a chunk map
    (``_chunkmap``) reports no chunks: k is then estimated from its holder's last progress
    report (bytes read of the shard; 0 before the first)."""
    if r.chunks is None:
        return None
    if r.status_addr is None:
        return f"{len(r.chunks)}/{r.num_chunks}"
    hit = st.fetching.get((r.worker_id, r.model, r.version, r.layout, r.shard))
    k = 0
    if hit is not None and hit[0].total:
        k = min(r.num_chunks, hit[0].nbytes * r.num_chunks // hit[0].total)
    return f"{k}/{r.num_chunks}"


def version_view(st: Any, now: float, model: str, version: int) -> VersionView:
    """One version: complete or not, its layouts, its replicas now (by the registry's
    version index: no scan of the rest)."""
    vi = st.catalog.version(model, version)
    reps = sorted(st.registry.replicas_of_version(model, version), key=lambda r: r.registered_at)
    return VersionView(
        model=model, version=version, complete=vi.complete,
        layouts={k: LayoutView(**v) for k, v in _layouts(vi).items()},
        replicas=[ReplicaView(replica_id=r.replica_id, worker_id=r.worker_id, layout=r.layout, shard=r.shard,
                              draining=r.draining, suspect=r.suspect_until > now, partial=_partial(st, r))
                  for r in reps],
    )


def status_view(st: Any, now: float) -> dict:
    """Everything ``tensorhub status`` shows."""
    reg = st.registry
    models = []
    for name, m in sorted(st.models.items()):
        versions = []
        for v, vi in sorted(m.versions.items()):
            reps = reg.replicas_of_version(name, v)
            versions.append({
                "version": v,
                "complete": vi.complete,
                "layouts": _layouts(vi),
                "replicas": [
                    {
                        "replica_id": r.replica_id, "worker_id": r.worker_id, "layout": r.layout,
                        "shard": r.shard, "draining": r.draining,
                        "suspect": r.suspect_until > now,
                        "endpoint": st.workers[r.worker_id].endpoint,
                        "locality": st.workers[r.worker_id].locality.model_dump(),
                        "open_leases": reg.open_leases(now, (r.replica_id,)),
                        "served": r.served,
                        "partial": _partial(st, r),
                    }
                    for r in sorted(reps, key=lambda r: r.registered_at)
                ],
            })
        models.append({"model": name, "counter": m.counter, "latest": m.newest, "versions": versions})
    return {
        "epoch": st.epoch,
        "models": models,
        "workers": [
            {"worker_id": w.worker_id, "endpoint": w.endpoint, "locality": w.locality.model_dump(),
             "last_seen_ago": round(now - w.last_seen, 3), "served_leases": w.served_leases,
             "served_bytes": w.served_bytes}
            for w in st.workers.values()
        ],
        "leases": [
            {"lease_id": l.lease_id, "worker_id": l.worker_id, "model": l.model, "version": l.version,
             "layout": l.layout, "shard": l.shard, "replicas": list(l.replica_ids),
             "expires_in": round(l.expires - now, 3)}
            for l in st.leases.values() if l.expires >= now
        ],
        # Fetches running now (readers report about once a second, fetches over a second).
        "fetches": [
            {"worker_id": f.worker_id, "model": f.model, "version": f.version, "layout": f.layout,
             "shard": f.shard, "nbytes": f.nbytes, "total": f.total, "seconds": f.seconds,
             "sources": dict(f.sources), "failed_sources": f.failed_sources,
             "reported_ago": round(now - at, 3)}
            for f, at in st.fetching.values() if now <= at + FETCH_STALE
        ],
        # Leases asked ahead, held until their version is published (``server.ahead``).
        "subscribers": [
            {"worker_id": wid, "model": model, "layout": layout, "shard": shard, "version": sub.req.version,
             "since": round(now - sub.since, 3)}
            for (model, layout, shard), subs in st.ahead.pending.items() for wid, sub in subs.items()
        ],
    }
