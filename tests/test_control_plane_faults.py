"""Faults of the control plane only, between real processes over real Mooncake: the data
plane keeps working while a holder is cut off from the coordinator, or the coordinator is
paused (DESIGN.md, "Faults come one plane at a time").

Each test runs on an emulated cluster (``benchmarks/testbed.py``): every worker is a host
in a network namespace of its own, the coordinator runs in the core namespace, and links
are shaped with tc so that a read spans the fault. A control-plane cut is a blackhole route
to the coordinator's address inside one host's namespace (``Faults.cut``): its Mooncake
traffic to the other hosts goes on. Every fetch is checked tensor by tensor (sha256)
against the bytes of the version it asked for; the Hubs run without per-chunk checksums
(``checksum="off"``), so only the protocol (leases, fencing) stands between a reader and
overwritten memory.

* A: a holder cut off for longer than ``worker_ttl`` while a reader reads from it; it heals,
  re-registers, publishes the next version from its other buffer, unpublishes the old one
  and overwrites it at once (the README's double-buffered RL loop).
* B: the coordinator SIGSTOPped for longer than ``worker_ttl`` mid-read, then resumed.
* C: a failed pipelined fetch into caller memory: quarantined when its partial replica
  cannot be confirmed drained; withdrawn alone (not the worker's other replicas) when it can.

Skipped where network namespaces are unavailable (not root, no iproute2); CI runs as root.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from tensorhub.testing import CoordinatorProcess, Faults, Worker, WorkerError, digest, make_weights

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import testbed  # noqa: E402  (benchmarks/testbed.py)

_ok, _why = testbed.available()
if not _ok and os.environ.get("CI", "").lower() in ("1", "true", "yes"):
    raise RuntimeError(f"the control-plane fault tests must run in CI: {_why}")

pytestmark = [pytest.mark.multiprocess, pytest.mark.skipif(not _ok, reason=f"testbed unavailable: {_why}")]

MiB = 1 << 20
WORKER_TTL = 1.5
LEASE_TTL = 5.0
HEARTBEAT = 0.5
#: Errors a fetch may end with under a fault (never wrong bytes); anything else is a defect.
CLEAR = {"FetchError", "NotFoundError", "HubTimeoutError", "ConflictError", "CoordinatorUnavailableError",
         "LeaseLapsedError", "TransferError"}
MODES = [pytest.param(True, id="pipelined"), pytest.param(False, id="plain")]


class Bed:
    """Three hosts a0..a2 in one datacenter, the coordinator in the core namespace."""

    def __init__(self, tb: testbed.Testbed, coord: CoordinatorProcess) -> None:
        self.tb, self.coord = tb, coord
        self.faults = Faults(coord.url, netns=tb.core)
        self.made: list[Worker] = []

    def ns(self, host: str) -> str:
        return self.tb.hosts[host]["ns"]

    def downlink(self, host: str) -> tuple[str, str]:
        return self.tb.downlink(host)

    def worker(self, host: str, name: str, **opts: Any) -> Worker:
        opts.setdefault("heartbeat_interval", HEARTBEAT)
        # The protocol alone must keep the bytes right: with per-chunk checksums, bytes
        # overwritten under a reader would end as a clear error and hide a fencing defect.
        opts.setdefault("checksum", "off")
        w = Worker(self.coord.url, name, netns=self.ns(host), data_host=self.tb.hosts[host]["ip"],
                   locality=f"dc=a,zone=z,host={host}", **opts)
        self.made.append(w)
        return w

    def status(self) -> dict:
        return self.faults.status()

    def cut(self, host: str, *, reset: bool = True) -> None:
        self.faults.cut(self.ns(host), self.tb.coordinator_ip, reset=reset)

    def heal(self, host: str) -> None:
        self.faults.heal(self.ns(host), self.tb.coordinator_ip)


@pytest.fixture
def bed(tmp_path):
    with testbed.Testbed({"a": 3}, host_rate="1gbit", tag=f"cp{os.getpid() % 100000}") as tb:
        coord = CoordinatorProcess(tmp_path / "state", netns=tb.core, host=tb.coordinator_ip,
                                   extra=("--worker-ttl", str(WORKER_TTL), "--lease-ttl", str(LEASE_TTL)))
        coord.start()
        b = Bed(tb, coord)
        try:
            yield b
        finally:
            b.faults.resume_all()
            b.faults.heal_all()
            for w in b.made:
                w.kill()
            coord.stop()
            log = coord.log_path.read_text() if coord.log_path.exists() else ""
            if log.strip():
                print("coordinator log:\n" + log[-4000:])


# ---------------------------------------------------------------------- helpers
def expected(seed: int, nbytes: int) -> dict:
    return digest(make_weights(seed, nbytes))


def wait_for(pred: Callable[[], Any], timeout: float, what: str, every: float = 0.05) -> Any:
    end = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        assert time.monotonic() < end, f"{what} (waited {timeout:.0f}s)"
        time.sleep(every)


def workers_in(st: dict) -> set[str]:
    return {w["worker_id"] for w in st["workers"]}


def replicas(st: dict, version: int, worker: Optional[str] = None) -> list[dict]:
    return [r for m in st["models"] for v in m["versions"] if v["version"] == version for r in v["replicas"]
            if worker is None or r["worker_id"] == worker]


def serving(st: dict, version: int, worker: str) -> bool:
    return any(not r["draining"] and r["partial"] is None for r in replicas(st, version, worker))


def reading(st: dict, reader: str, source: str) -> bool:
    return Faults._reading(st, reader, source)


def which(got_digest: dict, seeds: dict[str, int], nbytes: int) -> str:
    """Which version's bytes each tensor holds, for the failure message."""
    by = {d: name for name, s in seeds.items() for d in expected(s, nbytes).values()}
    return ", ".join(f"{k}: {by.get(d, 'other bytes')}" for k, d in got_digest.items())


def finish(*workers: Worker, timeout: float = 120.0) -> dict[str, tuple[float, Any]]:
    """Wait for every worker's answer to its pending command: name -> (arrival time, answer
    or WorkerError), arrival times on this process's monotonic clock."""
    out: dict[str, tuple[float, Any]] = {}
    end = time.monotonic() + timeout
    while len(out) < len(workers):
        for w in workers:
            if w.name not in out and w.conn.poll(0.01):
                try:
                    out[w.name] = (time.monotonic(), w.result(1))
                except WorkerError as e:
                    out[w.name] = (time.monotonic(), e)
        assert time.monotonic() < end, f"no answer within {timeout:.0f}s from " \
                                       f"{[w.name for w in workers if w.name not in out]}"
    return out


def check_read(got: Any, version: int, seed: int, nbytes: int, others: dict[str, int]) -> str:
    """The exact bytes of ``version``, or a clear error; never wrong bytes. Returns which."""
    if isinstance(got, WorkerError):
        assert got.kind in CLEAR, f"unclear error: {got}"
        return f"failed clearly: {got.kind}: {got.message.splitlines()[0]}"
    assert got["version"] == version, f"asked for v{version}, got v{got['version']}"
    assert got["digest"] == expected(seed, nbytes), \
        "WRONG BYTES for v%d: %s" % (version, which(got["digest"], dict(others, asked=seed), nbytes))
    return "exact bytes"


# ---------------------------------------------------------------------- A (item 1)
@pytest.mark.parametrize("pipelined", MODES)
def test_holder_cut_off_and_expired_mid_read_never_serves_overwritten_bytes(bed, pipelined):
    size = 24 * MiB
    holder = bed.worker("a0", "holder", pipelined=pipelined)
    reader = bed.worker("a1", "reader", pipelined=pipelined, chunk_bytes=MiB, progress_timeout=30.0)
    v1 = holder.call("publish", seed=101, nbytes=size)
    bed.faults.slow(*bed.downlink("a1"), "16mbit")  # the read takes ~13 s: it spans the whole fault
    reader.send("fetch", version=v1, serve=False, fetch_timeout=120)
    wait_for(lambda: reading(bed.status(), "reader", "holder"), 30, "the reader never read the holder's replica")
    time.sleep(0.5)

    # The holder loses the coordinator (not its peers) for longer than worker_ttl: expired.
    bed.cut("a0")
    t_cut = time.monotonic()
    wait_for(lambda: "holder" not in workers_in(bed.status()), 3 * WORKER_TTL + 2,
             "the coordinator never expired the cut-off holder")
    time.sleep(max(0.0, t_cut + 2 * WORKER_TTL - time.monotonic()))
    bed.heal("a0")
    # Its Hub re-registers by itself (heartbeat answered 404), replicas included.
    wait_for(lambda: "holder" in workers_in(st := bed.status()) and serving(st, v1, "holder"), 15,
             "the healed holder did not re-register v1")
    assert not reader.conn.poll(), "the read ended before the holder came back: the scenario needs a slower read"

    # The double-buffered loop: next version from the other buffer, unpublish the old one,
    # and the moment unpublish returns, write the version after into the old buffer.
    v2 = holder.call("publish", seed=102, nbytes=size)
    holder.send("unpublish", version=v1, refill=103)
    t_unpublish = time.monotonic()
    done = finish(reader, holder)
    (t_read, got), (t_unp, unp) = done["reader"], done["holder"]
    outcome = check_read(got, v1, 101, size, {"v2": 102, "v3 (written after unpublish)": 103})
    assert not isinstance(unp, WorkerError), f"unpublish failed: {unp}"
    assert unp["version"] == v2 + 1
    # The reader's lease never lapsed (its own control plane was fine): unpublish waits for it.
    assert t_unp > t_read - 0.5, f"unpublish returned {t_read - t_unp:.1f}s before the read ended"
    print(f"{'pipelined' if pipelined else 'plain'}: read {outcome}; unpublish waited {unp['waited']:.1f}s "
          f"(returned {t_unp - t_unpublish:.1f}s after it was called); faults: {bed.faults.log}")


# ---------------------------------------------------------------------- B (item 4)
def _paused_mid_read(bed: Bed, pipelined: bool, pause: float, serve: bool) -> tuple[dict, Any, Any, float, float]:
    """A reader reads v1 from the holder while the coordinator is SIGSTOPped for ``pause``
    seconds; right after SIGCONT the holder publishes v2 and unpublishes v1, refilling its
    memory with v3. Returns (status right after resume, read outcome, unpublish outcome,
    their arrival times)."""
    size = 24 * MiB
    bystander = bed.worker("a2", "bystander", pipelined=pipelined)
    holder = bed.worker("a0", "holder", pipelined=pipelined)
    reader = bed.worker("a1", "reader", pipelined=pipelined, chunk_bytes=MiB, progress_timeout=30.0)
    vb = bystander.call("publish", seed=201, nbytes=MiB)
    v1 = holder.call("publish", seed=202, nbytes=size)
    assert v1 > vb
    bed.faults.slow(*bed.downlink("a1"), "16mbit")
    reader.send("fetch", version=v1, serve=serve, fetch_timeout=90)
    wait_for(lambda: reading(bed.status(), "reader", "holder"), 30, "the reader never read the holder's replica")
    time.sleep(0.5)
    before = bed.status()
    ids_before = {(r["worker_id"], r["replica_id"]) for v in (vb, v1) for r in replicas(before, v)
                  if r["partial"] is None}
    assert {w for w, _ in ids_before} == {"bystander", "holder"}

    # SIGSTOP: every request now waits in the coordinator's socket queues; no heartbeat is
    # answered for longer than worker_ttl.
    bed.faults.hang(bed.coord.pid)
    time.sleep(pause)
    bed.faults.resume(bed.coord.pid)
    after = bed.status()
    ids_after = {(r["worker_id"], r["replica_id"]) for v in (vb, v1) for r in replicas(after, v)
                 if r["partial"] is None}
    assert {"bystander", "holder", "reader"} <= workers_in(after), \
        f"the resumed coordinator expired workers that were alive all along: {sorted(workers_in(after))}"
    assert ids_before <= ids_after, f"replicas were dropped at resume: {sorted(ids_before - ids_after)}"
    assert not reader.conn.poll(), "the read ended before the coordinator resumed: make it slower"

    # The holder moves on while the reader still reads.
    v2 = holder.call("publish", seed=203, nbytes=size)
    holder.send("unpublish", version=v1, refill=204)
    done = finish(reader, holder)
    (t_read, got), (t_unp, unp) = done["reader"], done["holder"]
    outcome = check_read(got, v1, 202, size, {"v2": 203, "v3 (written after unpublish)": 204})
    assert not isinstance(unp, WorkerError), f"unpublish failed: {unp}"
    assert unp["version"] == v2 + 1
    print(f"{'pipelined' if pipelined else 'plain'}, paused {pause}s: read {outcome}; "
          f"unpublish waited {unp['waited']:.1f}s")
    return after, got, unp, t_read, t_unp


@pytest.mark.parametrize("pipelined", MODES)
def test_paused_coordinator_resumes_without_expiring_everyone(bed, pipelined):
    # Longer than worker_ttl, shorter than what is left of the reader's lease: the lease
    # stays valid, so the holder's unpublish must still wait for the reader.
    pause = 1.5 * WORKER_TTL
    assert pause < LEASE_TTL - LEASE_TTL / 3 - 0.5
    _, got, unp, t_read, t_unp = _paused_mid_read(bed, pipelined, pause, serve=True)
    assert t_unp > t_read - 0.5, f"unpublish returned {t_read - t_unp:.1f}s before the read ended"


@pytest.mark.parametrize("pipelined", MODES)
def test_paused_longer_than_lease_ttl_the_reader_keeps_no_byte_read_past_its_lease(bed, pipelined):
    # The reader's lease lapses during the pause (real time passed): the holder may then
    # unpublish and overwrite at once, and the reader must not keep what it read after its
    # lease's bound (its own clock says so): exact bytes or a clear error.
    _paused_mid_read(bed, pipelined, LEASE_TTL + 1.5, serve=False)


# ---------------------------------------------------------------------- C (item 5)
def test_failed_fetch_into_caller_memory_that_cannot_drain_is_quarantined(bed):
    size = 16 * MiB
    pub = bed.worker("a0", "pub")
    r1 = bed.worker("a1", "r1", progress_timeout=30.0)
    r2 = bed.worker("a2", "r2", progress_timeout=30.0)
    v = pub.call("publish", seed=301, nbytes=size)
    bed.faults.slow(bed.ns("a0"), "eth0", "24mbit")  # the publisher's uplink: r1 alone needs ~6 s
    bed.faults.slow(*bed.downlink("a2"), "8mbit")  # r2 reads for ~17 s: it outlasts r1's failure
    fetch_timeout = 6.0
    r1.send("fetch", version=v, serve=True, into={"nbytes": size, "name": "buf"}, fetch_timeout=fetch_timeout)
    t1 = time.monotonic()

    def r1_has_chunks() -> bool:
        part = [r["partial"] for r in replicas(bed.status(), v, "r1") if r["partial"]]
        return bool(part) and int(part[0].split("/")[0]) >= 2  # (estimated from its progress reports)

    wait_for(r1_has_chunks, 30, "r1 never served chunks while receiving")
    r2.send("fetch", version=v, serve=False, fetch_timeout=90)
    # r2 reads from r1's partial replica; then r1 loses the coordinator until its fetch ends
    wait_for(lambda: reading(bed.status(), "r2", "r1"), 20, "r2 never read from r1's partial replica")
    bed.cut("a1")
    try:
        with pytest.raises(WorkerError) as e:
            r1.result(timeout=fetch_timeout + 60)
        took = time.monotonic() - t1
    finally:
        bed.heal("a1")
    msg = e.value.message
    assert e.value.kind in CLEAR, e.value
    assert re.search(r"quarantin", msg, re.I) and re.search(r"not (be )?reuse", msg, re.I), \
        f"the error does not say the `into` buffer is quarantined and must not be reused: {msg}"
    assert took < fetch_timeout + 10, f"the failed fetch took {took:.1f}s (timeout {fetch_timeout}s)"

    # The same memory again, in the same process, while r2's lease still names r1's partial
    # replica (nobody can confirm it drained): refused, clearly.
    assert not r2.conn.poll(), "r2's read ended before r1's: the scenario needs a slower r2"
    with pytest.raises(WorkerError) as e2:
        r1.call("fetch", version=v, serve=False, into={"name": "buf"}, fetch_timeout=30)
    assert re.search(r"quarantin", e2.value.message, re.I), \
        f"a fetch into the quarantined buffer was not refused clearly: {e2.value}"
    assert not r2.conn.poll(), "r2's read ended before the refused fetch: the scenario needs a slower r2"

    got = r2.result(timeout=90)
    outcome = check_read(got, v, 301, size, {})
    # Once the coordinator confirms nobody can read it any more, the memory is the caller's again.
    bed.faults.unslow(bed.ns("a0"), "eth0")
    end = time.monotonic() + 30
    while True:
        try:
            again = r1.call("fetch", version=v, serve=False, into={"name": "buf"}, fetch_timeout=30)
            break
        except WorkerError as e3:
            assert re.search(r"quarantin", e3.message, re.I), e3
            assert time.monotonic() < end, f"the quarantine was never lifted: {e3}"
            time.sleep(0.5)
    assert again["digest"] == expected(301, size)
    print(f"r2's read: {outcome}; r1 failed after {took:.1f}s: {msg.splitlines()[0]}")


def test_withdrawing_a_failed_fetch_drops_only_its_partial_replica(bed):
    size = 16 * MiB
    pub = bed.worker("a0", "pub")
    r1 = bed.worker("a1", "r1", progress_timeout=30.0)
    v = pub.call("publish", seed=401, nbytes=size)
    # r1 already holds v in another layout (e.g. its engine-native one)
    assert r1.call("publish", seed=402, nbytes=MiB, version=v, layout="alt") == v
    alt_before = [r["replica_id"] for r in replicas(bed.status(), v, "r1") if r["layout"] == "alt"]
    assert len(alt_before) == 1
    bed.faults.slow(bed.ns("a0"), "eth0", "16mbit")
    with pytest.raises(WorkerError) as e:  # too slow for its timeout: fails, the coordinator reachable
        r1.call("fetch", version=v, serve=True, into={"nbytes": size, "name": "buf"}, fetch_timeout=2.0)
    assert e.value.kind in CLEAR, e.value
    st = bed.status()
    mine = replicas(st, v, "r1")
    assert not [r for r in mine if r["layout"] == "hf"], f"the failed fetch's partial replica stayed: {mine}"
    alt = [r for r in mine if r["layout"] == "alt"]
    assert [r["replica_id"] for r in alt] == alt_before and not alt[0]["draining"], \
        f"withdrawing the failed fetch also withdrew r1's other replica of v{v}: {mine}"
    assert ("r1" in workers_in(st)) and ("alt", 0) in {(k[2], k[3]) for k in r1.call("held")}
    # Its withdrawal was confirmed, so the memory is the caller's again: no quarantine.
    assert not re.search(r"quarantin", e.value.message, re.I), e.value.message
    bed.faults.unslow(bed.ns("a0"), "eth0")
    got = r1.call("fetch", version=v, serve=False, into={"name": "buf"}, fetch_timeout=60)
    assert got["digest"] == expected(401, size)
