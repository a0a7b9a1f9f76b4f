"""Observability (issue #7): the coordinator's /metrics, each Hub process's metrics, fetch
progress, swap stalls, ``status --watch`` and ``tensorhub fetch``.

Figures are checked against what really moved: the bytes a real fetch between real
processes reports, the sources that really failed."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tensorhub.testing import make_weights

MiB = 1 << 20
TOKEN = "metrics-Token-1"


def scrape(url: str, token: str | None = None) -> dict:
    """/metrics as {(name, frozenset(labels)): value}."""
    h = {"Authorization": f"Bearer {token}"} if token else {}
    r = httpx.get(f"{url}/metrics", headers=h, timeout=10)
    r.raise_for_status()
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(m: dict, name: str, **labels: str) -> float:
    return m.get((name, frozenset(labels.items())), 0.0)


def wait_for(fn, timeout: float = 15.0, what: str = "condition"):
    end = time.monotonic() + timeout
    while True:
        got = fn()
        if got:
            return got
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def shard_bytes(seed: int, nbytes: int) -> int:
    return sum(t.nbytes for t in make_weights(seed, nbytes).values())


@pytest.mark.multiprocess
def test_metrics_show_a_real_fetch_between_processes(coordinator, workers):
    url = coordinator.url
    pub = workers(url, "pub")
    reader = workers(url, "reader")
    v = pub.call("publish", seed=3, nbytes=32 * MiB)
    total = shard_bytes(3, 32 * MiB)
    before = scrape(url)
    assert value(before, "tensorhub_latest_version", model="policy") == v
    assert value(before, "tensorhub_replicas", model="policy", state="serving") == 1
    assert value(before, "tensorhub_fetches_total", model="policy", outcome="ok") == 0

    got = reader.call("fetch", version=v)
    assert got["nbytes"] == total and got["sources"] == {"pub": total}
    m = wait_for(lambda: (lambda m: m if value(m, "tensorhub_fetches_total", model="policy", outcome="ok") == 1
                          else None)(scrape(url)), what="the fetch report")
    assert value(m, "tensorhub_fetch_bytes_total", model="policy", distance="same_host") == total
    assert value(m, "tensorhub_fetch_seconds_count", model="policy") == 1
    assert value(m, "tensorhub_fetch_seconds_sum", model="policy") == pytest.approx(got["seconds"], rel=1e-3)
    assert value(m, "tensorhub_fetch_gbps_sum", model="policy") == pytest.approx(
        total / got["seconds"] / 1e9, rel=1e-3)
    assert value(m, "tensorhub_replicas", model="policy", state="serving") == 2
    assert value(m, "tensorhub_replica_bytes", model="policy") == 2 * total
    assert value(m, "tensorhub_versions_held", model="policy") == 1
    assert value(m, "tensorhub_workers") == 2
    assert value(m, "tensorhub_leases_granted_total", model="policy") >= 1
    assert value(m, "tensorhub_leases_open", model="policy") == 0
    assert value(m, "tensorhub_source_failures_total", model="policy") == 0
    # what the publisher served, as the coordinator counts it (and answers on its heartbeats)
    st = httpx.get(f"{url}/v1/status", timeout=10).json()
    served = {w["worker_id"]: w["served_bytes"] for w in st["workers"]}
    assert served == {"pub": total, "reader": 0}


@pytest.mark.multiprocess
def test_a_failing_source_counts_as_a_failure(coordinator, workers):
    url = coordinator.url
    a = workers(url, "holder-a")
    b = workers(url, "holder-b")
    v = a.call("publish", seed=5, nbytes=64 * MiB)
    b.call("fetch", version=v)
    a.kill()  # still registered (its heartbeat has not lapsed yet): readers find it dead
    c = workers(url, "reader-c")
    got = c.call("fetch", version=v)
    assert got["digest"] and got["nbytes"] == shard_bytes(5, 64 * MiB)
    assert got["failed_sources"], f"the reader never tried the dead holder: {got['sources']}"
    assert set(got["sources"]) == {"holder-b"}
    m = wait_for(lambda: (lambda m: m if value(m, "tensorhub_fetches_total", model="policy", outcome="ok") == 2
                          else None)(scrape(url)), what="both fetch reports")
    assert value(m, "tensorhub_source_failures_total", model="policy") == len(got["failed_sources"])
    assert value(m, "tensorhub_replicas", model="policy", state="suspect") == 1


def test_metrics_need_the_token_and_reports_are_bounded(tmp_path):
    from tensorhub.coordinator import EmbeddedCoordinator

    with EmbeddedCoordinator(tmp_path / "s", token=TOKEN) as c, \
            httpx.Client(base_url=c.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10) as http:
        assert httpx.get(f"{c.url}/metrics", timeout=10).status_code == 401
        assert value(scrape(c.url, TOKEN), "tensorhub_workers") == 0
        http.post("/v1/workers", json={"worker_id": "w", "endpoint": "x:1"}).raise_for_status()
        http.post("/v1/models/m/versions", json={}).raise_for_status()
        ok = {"worker_id": "w", "model": "m", "version": 1, "nbytes": 10, "seconds": 0.5, "sources": {"w2": 10}}
        bad = [
            dict(ok, model="unknown"),                       # 404: unknown models are never counted
            dict(ok, nbytes=-1),
            dict(ok, seconds=1e30),
            dict(ok, state="weird"),
            dict(ok, sources={f"w{i}": 1 for i in range(1025)}),
            dict(ok, sources={"bad id": 1}),
            dict(ok, extra=1),
        ]
        for body in bad:
            r = http.post("/v1/fetches", json=body)
            assert r.status_code in (404, 422), (body, r.status_code)
        assert http.post("/v1/swaps", json={"worker_id": "w", "model": "m", "version": 1, "stall": -1}).status_code == 422
        assert http.post("/v1/fetches", json=ok).status_code == 200
        m = scrape(c.url, TOKEN)
        assert value(m, "tensorhub_fetches_total", model="m", outcome="ok") == 1
        assert value(m, "tensorhub_fetch_bytes_total", model="m", distance="unknown") == 10  # w2 never registered
        assert not any(dict(k[1]).get("model") == "unknown" for k in m)
        # a running fetch is listed by status until its final report
        running = dict(ok, state="running", total=100)
        http.post("/v1/fetches", json=running).raise_for_status()
        assert [f["nbytes"] for f in http.get("/v1/status").json()["fetches"]] == [10]
        http.post("/v1/fetches", json=dict(ok, state="failed")).raise_for_status()
        assert http.get("/v1/status").json()["fetches"] == []
        assert value(scrape(c.url, TOKEN), "tensorhub_fetches_total", model="m", outcome="failed") == 1


def _sample(name: str, **labels: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_progress_live_status_and_hub_metrics_during_a_slow_fetch(embedded, monkeypatch, caplog):
    """In-process hubs over the memory transport, throttled so the fetch takes ~1 s."""
    import logging

    import torch

    import tensorhub
    from tensorhub.testing import InMemoryTransport

    monkeypatch.setenv("TENSORHUB_PROGRESS_INTERVAL", "0.2")
    url = embedded.url
    pub = tensorhub.connect(url, worker_id="p-pub", transport=InMemoryTransport(bandwidth=16e6),
                            heartbeat_interval=0.2)
    rd = tensorhub.connect(url, worker_id="p-rd", transport=InMemoryTransport(bandwidth=16e6))
    rd2 = tensorhub.connect(url, worker_id="p-rd2", transport=InMemoryTransport(bandwidth=64e6))
    try:
        w = {"a": torch.arange(1 << 21, dtype=torch.float32), "b": torch.ones(1 << 21, dtype=torch.float32)}
        total = 16 << 20
        v = pub.publish("prog", w)
        assert _sample("tensorhub_hub_held_bytes", model="prog") >= total
        base = {k: _sample(f"tensorhub_hub_{k}", model="prog") for k in ("fetch_bytes_total", "fetches_total")}
        base_served = _sample("tensorhub_hub_served_bytes_total")

        live: list[dict] = []
        stop = threading.Event()

        def poll() -> None:
            with httpx.Client(base_url=url, timeout=10) as http:
                while not stop.is_set():
                    live.extend(f for f in http.get("/v1/status").json()["fetches"] if f["model"] == "prog")
                    time.sleep(0.05)

        t = threading.Thread(target=poll)
        t.start()
        seen = []
        try:
            f = rd.fetch("prog", v, progress=seen.append, serve=False)
        finally:
            stop.set()
            t.join()
        assert f["a"].equal(w["a"]) and f["b"].equal(w["b"])
        assert f.seconds > 0.5, f"too fast to see progress ({f.seconds:.2f}s)"
        assert len(seen) >= 2 and seen[-1].done and not any(p.done for p in seen[:-1])
        assert [p.nbytes for p in seen] == sorted(p.nbytes for p in seen)
        assert seen[-1].nbytes == total == seen[-1].total and seen[-1].sources == {"p-pub": total}
        assert 0 < seen[0].nbytes < total and "GB/s from p-pub" in seen[0].line()
        assert live and all(x["worker_id"] == "p-rd" and x["total"] == total for x in live)
        assert any(0 < x["nbytes"] < total and x["sources"].get("p-pub") for x in live)
        # this process's metrics: the fetch's bytes, and (via the heartbeat) what pub served
        assert _sample("tensorhub_hub_fetch_bytes_total", model="prog") - base["fetch_bytes_total"] == total
        assert _sample("tensorhub_hub_fetches_total", model="prog", outcome="ok") - base["fetches_total"] == 1
        wait_for(lambda: _sample("tensorhub_hub_served_bytes_total") - base_served == total, what="served bytes")
        wait_for(lambda: httpx.get(f"{url}/v1/status").json()["fetches"] == [], what="the live entry to go")

        # without a callback the library logs the progress instead of drawing it
        caplog.set_level(logging.INFO, logger="tensorhub._metrics")
        rd2.fetch("prog", v, serve=False)
        lines = [r.getMessage() for r in caplog.records if r.name == "tensorhub._metrics"]
        assert lines and all(l.startswith("fetching prog v") and "(worker p-rd2)" in l for l in lines)
    finally:
        for h in (rd2, rd, pub):
            h.close()


def test_swap_reports_feed_the_stall_histogram(embedded):
    import tensorhub

    with tensorhub.connect(embedded.url, worker_id="engine-1", transport=_memory()) as hub:
        hub.api.post("/v1/models/swapm/versions", {})
        before = _sample("tensorhub_hub_swap_stall_seconds_count", model="swapm")
        hub.report_swap("swapm", 1, 2.0, fetch_seconds=1.5, apply_seconds=0.5)
        hub.report_swap("swapm", 1, 7.0, ok=False)
        assert _sample("tensorhub_hub_swap_stall_seconds_count", model="swapm") - before == 1
        m = wait_for(lambda: (lambda m: m if value(m, "tensorhub_swaps_total", model="swapm", outcome="failed")
                              else None)(scrape(embedded.url)), what="the swap reports")
        assert value(m, "tensorhub_swaps_total", model="swapm", outcome="ok") == 1
        assert value(m, "tensorhub_swap_stall_seconds_count", model="swapm") == 1
        assert value(m, "tensorhub_swap_stall_seconds_sum", model="swapm") == 2.0
        assert value(m, "tensorhub_swap_stall_seconds_bucket", model="swapm", le="2.5") == 1
        assert value(m, "tensorhub_swap_stall_seconds_bucket", model="swapm", le="1.0") == 0


def _memory():
    from tensorhub.testing import InMemoryTransport

    return InMemoryTransport()


def test_start_metrics_server_serves_the_hub_metrics():
    import tensorhub

    url, server = tensorhub.start_metrics_server(0)
    try:
        text = httpx.get(url, timeout=10).text
    finally:
        server.shutdown()
    assert "tensorhub_hub_fetch_bytes_total" in text or "# TYPE tensorhub_hub_fetch_bytes counter" in text
    assert "tensorhub_hub_served_bytes_total" in text


def _run_on_a_tty(cmd: list[str], env: dict, during=None, timeout: float = 60.0) -> tuple[int, str]:
    """Run ``cmd`` with stdout and stderr on a pseudo-terminal; ``during(text_so_far)`` is
    called as output arrives. Returns (exit code, everything written)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, stdout=slave, stderr=slave, stdin=subprocess.DEVNULL, env=env)
    os.close(slave)
    out = b""
    end = time.monotonic() + timeout
    try:
        while time.monotonic() < end:
            r, _, _ = select.select([master], [], [], 0.1)
            if r:
                try:
                    chunk = os.read(master, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                out += chunk
                if during is not None:
                    during(out.decode(errors="replace"))
            elif proc.poll() is not None:
                break
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    return proc.returncode, out.decode(errors="replace")


@pytest.mark.multiprocess
def test_status_watch_redraws_in_place(coordinator, workers):
    url = coordinator.url
    env = dict(os.environ)
    published = []

    def publish_after_first_frame(text: str) -> None:
        if not published and "no models yet" in text:
            pub.send("publish", seed=1, nbytes=MiB)  # answered below; the watch goes on meanwhile
            published.append(True)

    pub = workers(url, "watch-pub")
    rc, out = _run_on_a_tty([sys.executable, "-m", "tensorhub", "status", "--coordinator", url,
                             "--watch", "0.5", "--count", "12"], env, during=publish_after_first_frame)
    assert rc == 0, out
    v = pub.result()
    frames = out.split("\x1b[H\x1b[2J")[1:]
    assert len(frames) == 12, out
    assert "no models yet" in frames[0]
    assert f"model policy: latest complete version {v}" in frames[-1] and "watch-pub" in frames[-1]
    # not a terminal: framed snapshots, no escape codes
    r = subprocess.run([sys.executable, "-m", "tensorhub", "status", "--coordinator", url, "--watch", "0.1",
                        "--count", "2"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.count("--- ") == 2 and "\x1b" not in r.stdout


@pytest.mark.multiprocess
def test_fetch_cli_draws_progress_on_a_tty(coordinator, workers):
    url = coordinator.url
    pub = workers(url, "cli-pub")
    v = pub.call("publish", seed=2, nbytes=256 * MiB)
    total = shard_bytes(2, 256 * MiB)
    env = dict(os.environ, TENSORHUB_PROGRESS_INTERVAL="0.02", TENSORHUB_WORKER_ID="cli-reader")
    rc, out = _run_on_a_tty([sys.executable, "-m", "tensorhub", "fetch", "--coordinator", url, "--model", "policy"],
                            env, timeout=120)
    assert rc == 0, out
    draws = [d for d in out.split("\r") if d.startswith(f"policy v{v}: ") and "GB/s" in d]
    assert draws, out  # the progress line, redrawn in place
    assert all("from cli-pub" in d for d in draws if not d.startswith(f"policy v{v}: 0.0 MB")), draws
    assert f"policy v{v} layout hf shard 0: {total / 1e6:.1f} MB in " in out and "from cli-pub" in out
    m = scrape(url)
    assert value(m, "tensorhub_fetch_bytes_total", model="policy", distance="same_host") == total


def test_progress_line_off_a_terminal_writes_few_plain_lines():
    import io

    from tensorhub.cli import ProgressLine

    buf = io.StringIO()
    line = ProgressLine(buf, every=60)
    for i in range(5):
        line.draw(f"step {i}")
    line.done()
    assert buf.getvalue() == "step 0\n"


def test_follow_progress_line_from_the_coordinators_running_fetches():
    from tensorhub.follow import progress_text

    st = {"fetches": [
        {"worker_id": "engine-b", "model": "policy", "version": 3, "layout": "hf", "shard": 0,
         "nbytes": 600_000_000, "total": 1_200_000_000, "seconds": 1.5, "failed_sources": 1,
         "sources": {"pub": 400_000_000, "engine-a": 200_000_000}},
        {"worker_id": "engine-c", "model": "policy", "version": 2, "layout": "hf", "shard": 0,
         "nbytes": 1, "total": 2, "seconds": 1.0, "failed_sources": 0, "sources": {"pub": 1}},
    ]}
    assert progress_text(st, "policy", 3, 2.04) == (
        "swap policy v3: 0.60 GB/1.20 GB (50%) in 1.5s, 0.40 GB/s from pub 0.40 GB, engine-a 0.20 GB; "
        "1 source(s) failed (reader engine-b; stall 2.0s)")
    assert progress_text(st, "policy", 4, 1.2) == "v4: swapping, stall 1.2s"


def test_status_table_lists_running_fetches():
    from tensorhub.cli import format_status

    st = {"epoch": "e", "workers": [], "models": [], "leases": [], "fetches": [
        {"worker_id": "engine-b", "model": "policy", "version": 3, "layout": "hf", "shard": 0,
         "nbytes": 600_000_000, "total": 1_200_000_000, "seconds": 2.0, "failed_sources": 0,
         "sources": {"pub": 100, "engine-a": 500}, "reported_ago": 0.3}]}
    rows = format_status(st).splitlines()
    head = next(i for i, r in enumerate(rows) if r.startswith("FETCHING"))
    assert rows[head + 1].split() == ["engine-b", "policy", "3", "hf#0", "600.0", "MB/1.2", "GB", "(50%)", "0.30",
                                      "engine-a,pub"]
