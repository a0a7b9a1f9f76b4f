"""``tensorhub`` command line: ``coordinator`` runs the service, ``status`` shows its state
(``--watch``: redrawn in place), ``fetch`` reads a version here (progress, GB/s, sources),
``follow`` drives an engine server to each new version."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any, Optional, Sequence, TextIO

from ._exceptions import ConfigError, TensorHubError
from .config import HubConfig, read_token
from .follow import ProgressLine

__all__ = ["main", "format_status", "ProgressLine"]


def _coordinator(args: argparse.Namespace) -> int:
    from .server.state import StateConfig
    from .coordinator import serve

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.keep_versions < 1:
        raise ConfigError(f"--keep-versions must be >= 1, got {args.keep_versions}")
    if args.call_slots is not None and args.call_slots < 0:
        raise ConfigError(f"--call-slots must be >= 0 (0: no gate), got {args.call_slots}")
    if args.suspect_ttl <= 0:
        raise ConfigError(f"--suspect-ttl must be > 0, got {args.suspect_ttl}")
    config = StateConfig(lease_ttl=args.lease_ttl, worker_ttl=args.worker_ttl, policy=args.planner,
                         keep_versions=args.keep_versions, plans=args.plans, suspect_ttl=args.suspect_ttl)

    def ready(url: str) -> None:
        print(f"tensorhub coordinator serving on {url}", flush=True)

    serve(args.host, args.port, args.state_dir, token=read_token(args.token_file), config=config,
          ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile, on_ready=ready,
          store=args.store, advertise_url=args.advertise_url, election_ttl=args.election_ttl,
          etcd_ca_file=args.etcd_ca_file, etcd_cert_file=args.etcd_cert_file, etcd_key_file=args.etcd_key_file,
          call_slots=args.call_slots)
    return 0


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return str(n)  # pragma: no cover


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def format_status(st: dict) -> str:
    """A readable table of models, versions, replicas and open leases."""
    out = [f"coordinator epoch {st['epoch']}, {len(st['workers'])} worker(s)"]
    ha = st.get("coordinators")
    if ha:  # highly available coordinators (etcd store)
        out.append(f"leader {ha['leader']}; followers: {', '.join(ha['followers']) or 'none'}")
    if not st["models"]:
        out.append("no models yet")
    for m in st["models"]:
        out.append("")
        out.append(f"model {m['model']}: latest complete version {m['latest']}, counter {m['counter']}")
        rows = [["VERSION", "COMPLETE", "LAYOUT", "SHARDS", "SIZE", "REPLICA", "WORKER", "HOST",
                 "DC/ZONE", "ENDPOINT", "STATE", "LEASES", "SERVED"]]
        for v in m["versions"]:
            lay = v["layouts"]
            size = sum(li["nbytes"] for li in lay.values())
            first = [str(v["version"]), "yes" if v["complete"] else "no",
                     ",".join(lay) or "-", ",".join(str(li["num_shards"]) for li in lay.values()) or "-",
                     _size(size)]
            if not v["replicas"]:
                rows.append(first + ["-"] * 8)
            for i, r in enumerate(v["replicas"]):
                loc = r["locality"]
                state = "draining" if r["draining"] else ("suspect" if r["suspect"] else "serving")
                rows.append((first if i == 0 else [""] * 5) + [
                    f"{r['replica_id']} ({r['layout']}#{r['shard']})", r["worker_id"], loc["host"],
                    f"{loc['datacenter']}/{loc['zone']}", r["endpoint"], state, str(r["open_leases"]),
                    str(r.get("served", 0)),
                ])
        out.extend(_table(rows))
    if st.get("fetches"):
        out.append("")
        rows = [["FETCHING", "MODEL", "VERSION", "LAYOUT#SHARD", "PROGRESS", "GB/S", "FROM"]]
        for f in st["fetches"]:
            pct = f" ({100 * f['nbytes'] / f['total']:.0f}%)" if f["total"] else ""
            gbps = f["nbytes"] / f["seconds"] / 1e9 if f["seconds"] else 0.0
            rows.append([f["worker_id"], f["model"], str(f["version"]), f"{f['layout']}#{f['shard']}",
                         f"{_size(f['nbytes'])}/{_size(f['total'])}{pct}", f"{gbps:.2f}",
                         ",".join(sorted(f["sources"], key=lambda w: -f["sources"][w])) or "-"])
        out.extend(_table(rows))
    subs = st.get("subscribers") or []
    if subs:  # leases asked ahead, held until their version is published (_ahead)
        out.append("")
        held: dict = {}
        for x in subs:
            k = (x["model"], x["layout"], x["shard"], x["version"])
            held[k] = held.get(k, 0) + 1
        rows = [["SUBSCRIBED AHEAD", "LAYOUT#SHARD", "FOR VERSION", "READERS"]]
        for (model, layout, shard, v), n in sorted(held.items()):
            rows.append([model, f"{layout}#{shard}", f">= {v}", str(n)])
        out.extend(_table(rows))
    for g in st.get("fleets") or []:
        out.append("")
        out.append(f"fleet group {g['group']} ({g['model']}, switch {g['switch']}): v{g['version']}"
                   + (", MIXED" if g["mixed"] else "") + f"; left {g['left_total']}, failed {g['failed_total']}")
        rows = [["MEMBER", "ENGINE", "VERSION", "IN GROUP"]]
        for m in g["members"]:
            rows.append([m["member"], m.get("engine") or "-", str(m["version"]),
                         "yes" if m["in_group"] else f"no: {m['why_out']}"])
        out.extend(_table(rows))
    if st["leases"]:
        out.append("")
        rows = [["LEASE", "READER", "MODEL", "VERSION", "LAYOUT#SHARD", "SOURCES", "EXPIRES IN"]]
        for l in st["leases"]:
            rows.append([l["lease_id"], l["worker_id"], l["model"], str(l["version"]),
                         f"{l['layout']}#{l['shard']}", ",".join(l["replicas"]), f"{l['expires_in']:.1f}s"])
        out.extend(_table(rows))
    return "\n".join(out)


def _status(args: argparse.Namespace) -> int:
    from ._client import CoordinatorClient

    cfg = HubConfig.from_cli(args.coordinator, args.token_file, args.ca_file)
    api = CoordinatorClient(cfg.coordinator, cfg.token, retry_timeout=5.0, ca_file=cfg.ca_file)
    try:
        if args.watch is None:
            st = api.status()
            print(json.dumps(st, indent=2) if args.json else format_status(st))
            return 0
        return _watch(api, args, sys.stdout)
    finally:
        api.close()


def _watch(api: Any, args: argparse.Namespace, out: TextIO) -> int:
    """``status --watch``: on a terminal, redraw the screen in place every ``args.watch``
    seconds; elsewhere print each frame after a separator line. A coordinator that does not
    answer is shown as such, and watching goes on."""
    tty = out.isatty()
    frames = 0
    while True:
        try:
            st = api.status()
            body = json.dumps(st, indent=2) if args.json else format_status(st)
        except TensorHubError as e:
            body = f"coordinator {api.url} does not answer: {e}"
        head = f"{time.strftime('%H:%M:%S')}  {api.url}  every {args.watch:g}s"
        if tty:
            out.write("\x1b[H\x1b[2J" + head + "\n\n" + body + "\n")
        else:
            out.write(f"--- {head}\n{body}\n")
        out.flush()
        frames += 1
        if args.count and frames >= args.count:
            return 0
        time.sleep(args.watch)


def _fetch(args: argparse.Namespace) -> int:
    """``tensorhub fetch``: read a version into this process (not served, then dropped):
    checks that this host can reach the holders, and how fast."""
    import tensorhub

    cfg = HubConfig.from_cli(args.coordinator, args.token_file, args.ca_file)
    line = ProgressLine(sys.stderr)

    def show(p: Any) -> None:
        if p.done:
            line.done()
        else:
            line.draw(p.line())

    with tensorhub.connect(config=cfg) as hub:
        f = hub.fetch(args.model, args.version, layout=args.layout, shard=args.shard, serve=False,
                      timeout=args.timeout, progress=show)
        line.done()
        src = ", ".join(f"{w} {_size(n)}" for w, n in sorted(f.sources.items(), key=lambda kv: -kv[1]))
        print(f"{args.model} v{f.version} layout {f.layout} shard {f.shard}: {_size(f.nbytes)} in "
              f"{f.seconds:.2f}s ({f.gbps:.2f} GB/s) from {src or '-'}"
              + (f"; failed sources {', '.join(f.failed_sources)}" if f.failed_sources else ""), flush=True)
    return 0


def _follow(args: argparse.Namespace) -> int:
    # engine drivers register as entry points (tensorhub.follow); none is imported here
    from .follow import main as follow_main

    return follow_main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tensorhub", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    c = sub.add_parser("coordinator", help="run the coordinator service")
    c.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    c.add_argument("--port", type=int, default=0, help="port (0 picks a free one; the URL is printed)")
    c.add_argument("--state-dir", help="directory of the durable SQLite state (needed with the default store)")
    c.add_argument("--store", default="sqlite",
                   help="durable store: sqlite (default, a file in --state-dir) or etcd://HOST:PORT[,HOST:PORT...]"
                        "[/PREFIX] (etcds:// for TLS): several coordinators, one leader (docs: operations/ha)")
    c.add_argument("--advertise-url", help="etcd store: the URL clients reach this coordinator at "
                                           "(default: the URL it serves on)")
    c.add_argument("--election-ttl", type=float, default=2.0,
                   help="etcd store: seconds of the leader's etcd lease (whole seconds, >= 2); bounds failover")
    c.add_argument("--etcd-ca-file", help="etcd store: CA that signed etcd's certificate (etcds://)")
    c.add_argument("--etcd-cert-file", help="etcd store: client certificate for etcd (--client-cert-auth)")
    c.add_argument("--etcd-key-file", help="etcd store: private key of --etcd-cert-file")
    c.add_argument("--token-file", help="file holding the API token; every endpoint but /healthz needs it")
    c.add_argument("--lease-ttl", type=float, default=30.0, help="seconds a read lease lasts unrenewed")
    c.add_argument("--planner", choices=["topology", "single-source"], default="topology",
                   help="source choice: topology-aware (default), or the benchmarks' single-source baseline")
    c.add_argument("--plans", action=argparse.BooleanOptionalAction, default=True,
                   help="striped plans for pipelined readers where one source is scarce (default); "
                        "--no-plans: readers pick chunks by their sources' chunk maps alone (a baseline)")
    c.add_argument("--call-slots", type=int, default=None, metavar="N",
                   help="readers' and publishers' calls (leases, registrations, resolve, manifests) run "
                        "N at a time, so heartbeats are answered in a burst of them (default 4; 0: no gate)")
    c.add_argument("--worker-ttl", type=float, default=10.0,
                   help="seconds without heartbeat after which a worker's replicas are dropped")
    c.add_argument("--suspect-ttl", type=float, default=30.0,
                   help="seconds a replica a reader reported (failed, hung) gets no new leases; a reader "
                        "that judged it hung reads it again after this")
    c.add_argument("--keep-versions", type=int, default=16,
                   help="retention: manifests kept per model beyond what is still held (newest complete)")
    c.add_argument("--ssl-certfile", help="serve HTTPS with this certificate")
    c.add_argument("--ssl-keyfile", help="private key for --ssl-certfile")
    c.add_argument("--log-level", default="info")
    c.set_defaults(fn=_coordinator)

    s = sub.add_parser("status", help="show models, versions, replicas and leases")
    s.add_argument("--coordinator", help="coordinator URL, or several comma-separated "
                                          "(default: $TENSORHUB_COORDINATOR)")
    s.add_argument("--token-file", help="file holding the API token (default: $TENSORHUB_TOKEN)")
    s.add_argument("--ca-file", help="CA (or self-signed certificate, PEM) of an https coordinator "
                   "(default: $TENSORHUB_CA_FILE, else the system's CAs)")
    s.add_argument("--json", action="store_true", help="print the raw JSON")
    s.add_argument("--watch", type=float, nargs="?", const=2.0, metavar="SECONDS",
                   help="refresh every SECONDS (default 2), in place on a terminal; Ctrl-C stops")
    s.add_argument("--count", type=int, default=0, help="with --watch: stop after this many refreshes")
    s.set_defaults(fn=_status)

    g = sub.add_parser("fetch", help="read a version here, showing progress, GB/s and sources (not kept)")
    g.add_argument("--model", required=True)
    g.add_argument("--version", type=int, help="version (default: the newest complete)")
    g.add_argument("--layout", default="hf")
    g.add_argument("--shard", type=int, default=0)
    g.add_argument("--coordinator", help="coordinator URL (default: $TENSORHUB_COORDINATOR)")
    g.add_argument("--token-file", help="file holding the API token (default: $TENSORHUB_TOKEN)")
    g.add_argument("--ca-file", help="CA of an https coordinator (default: $TENSORHUB_CA_FILE)")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds the fetch may take")
    g.set_defaults(fn=_fetch)

    f = sub.add_parser("follow", add_help=False,
                       help="drive a vLLM server through pause/update/resume for each new version "
                            "(--engine URL --model NAME [--mode abort|wait|keep]; --help for all)")
    f.add_argument("rest", nargs=argparse.REMAINDER)
    f.set_defaults(fn=_follow)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["follow"]:  # its own parser: pass every argument through untouched
        args = argparse.Namespace(fn=_follow, rest=argv[1:])
    else:
        args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except TensorHubError as e:
        print(f"tensorhub: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
