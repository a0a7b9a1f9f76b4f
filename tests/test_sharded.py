"""Sliced publishing without a gather (issue #15 item 3): trainer ranks register their own
shards in place, readers assemble the full tensors or read row/column ranges of them.

Tiers: the pure coverage checks and byte plans; Hubs on an embedded coordinator (plain
per-rank ``Slice`` objects, the errors users see); then real FSDP2 ranks (a gloo group of
2 and of 4 spawned processes, ``fully_shard``) publishing to a real coordinator process
over real Mooncake, read by real Hubs.
"""

from __future__ import annotations

import random

import pytest
import torch

import tensorhub
from tensorhub import Slice
from tensorhub._exceptions import ManifestMismatchError
from tensorhub._slices import SLICED, check_register, runs
from tensorhub.protocol import Manifest, SliceSpec, TensorSpec


# ---------------------------------------------------------------------- pure
def _m(*entries):
    """A sliced manifest of (name, local shape, full shape, offsets)."""
    specs = [TensorSpec(name=n, dtype="float32", shape=ls, nbytes=4 * int(torch.tensor(ls).prod()))
             for n, ls, _, _ in entries]
    return Manifest(tensors=specs, slices=[SliceSpec(shape=fs, offsets=o) for _, _, fs, o in entries])


def test_coverage_overlap_gap_and_disagreement_are_refused_naming_the_ranges():
    a = _m(("w", (4, 6), (10, 6), (0, 0)))
    check_register({}, 0, a, 3, "w1")
    with pytest.raises(ManifestMismatchError, match=r"'w': shard 1's slice \[3:7, 0:6\] overlaps shard 0's \[0:4, 0:6\]"):
        check_register({0: a}, 1, _m(("w", (4, 6), (10, 6), (3, 0))), 3, "w1")
    with pytest.raises(ManifestMismatchError, match=r"full shape \[11, 6\] in shard 1 but \[10, 6\] in shard 0"):
        check_register({0: a}, 1, _m(("w", (4, 6), (11, 6), (4, 0))), 3, "w1")
    b = _m(("w", (4, 6), (10, 6), (4, 0)))
    check_register({0: a}, 1, b, 3, "w1")
    with pytest.raises(ManifestMismatchError, match=r"cover 54 of its 60 elements .*shard 2 is the last"):
        check_register({0: a, 1: b}, 2, _m(("w", (1, 6), (10, 6), (8, 0))), 3, "w1")
    check_register({0: a, 1: b}, 2, _m(("w", (2, 6), (10, 6), (8, 0))), 3, "w1")  # exact cover
    full = Manifest(tensors=[TensorSpec(name="w", dtype="float32", shape=(10, 6), nbytes=240)])
    with pytest.raises(ManifestMismatchError, match="shard 1 is full tensors but shard 0 is sliced"):
        check_register({0: a}, 1, full, 2, "w1")


def test_manifest_slices_validate_and_old_manifests_serialize_unchanged():
    with pytest.raises(ValueError, match=r"slice \[8, 12\) of dimension 0 is outside the full tensor's 10"):
        _m(("w", (4, 6), (10, 6), (8, 0)))
    plain = Manifest(tensors=[TensorSpec(name="w", dtype="float32", shape=(10, 6), nbytes=240)])
    assert "slices" not in plain.model_dump(mode="json") and "slices" not in plain.model_dump_json()
    sl = _m(("w", (4, 6), (10, 6), (4, 0)))
    assert Manifest.model_validate_json(sl.model_dump_json()) == sl


def test_runs_move_exactly_the_intersection():
    rng = random.Random(0)
    for _ in range(400):
        shape = [rng.randint(1, 6) for _ in range(rng.choice([1, 2, 3]))]
        full = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.int64).reshape(shape)

        def box():
            return tuple((a, b) if a < b else (0, n) for (a, b), n in
                         ((sorted(rng.sample(range(n + 1), 2)), n) for n in shape))

        src, want = box(), box()
        piece = full[tuple(slice(a, b) for a, b in src)].contiguous().view(-1)
        dst = torch.full([b - a for a, b in want], -1, dtype=torch.int64).view(-1)
        moved = 0
        for r in runs(src, want, 8, 0, "x"):
            dst[r.dst_off // 8:(r.dst_off + r.nbytes) // 8] = piece[r.src_off // 8:(r.src_off + r.nbytes) // 8]
            moved += r.nbytes
        expect = torch.full([b - a for a, b in want], -1, dtype=torch.int64)
        inter = [(max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(src, want)]
        if all(a < b for a, b in inter):
            expect[tuple(slice(a - w[0], b - w[0]) for (a, b), w in zip(inter, want))] = \
                full[tuple(slice(a, b) for a, b in inter)]
        assert torch.equal(dst.view(expect.shape), expect), (shape, src, want)
        assert moved == 8 * int((expect >= 0).sum())  # only the intersection's bytes


def test_state_sends_hf_readers_to_the_slices_until_an_assembled_copy_serves():
    from tensorhub._exceptions import ConflictError
    from tensorhub.server.state import CoordinatorState
    from tensorhub.protocol import AcquireLease, Locality, RegisterReplica

    st = CoordinatorState()
    for w in ("r0", "r1", "reader", "other"):
        st.register_worker(0.0, w, f"{w}:1", Locality())
    st.allocate_version(0.0, "m", 1)
    halves = [_m(("w", (4, 6), (8, 6), (0, 0))), _m(("w", (4, 6), (8, 6), (4, 0)))]
    ask = AcquireLease(worker_id="reader", model="m", version=1)
    for r, man in enumerate(halves):
        assert st.latest("m") is None
        st.register_replica(1.0, RegisterReplica(worker_id=f"r{r}", model="m", version=1, layout=SLICED, shard=r,
                                                 num_shards=2, manifest=man, addresses=[4096 * (r + 1)]))
    assert st.latest("m") == 1
    with pytest.raises(ConflictError) as e:
        st.acquire_lease(2.0, ask)
    assert e.value.code == "read_slices" and "2 shards of layout 'hf.slices'" in e.value.message
    full = Manifest(tensors=[TensorSpec(name="w", dtype="float32", shape=(8, 6), nbytes=192)])
    rid, _ = st.register_replica(3.0, RegisterReplica(worker_id="other", model="m", version=1, manifest=full,
                                                      addresses=[65536]))
    assert [r.worker_id for r in st.acquire_lease(4.0, ask).replicas] == ["other"]
    assert st.acquire_lease(4.0, AcquireLease(worker_id="reader", model="m", version=1, layout=SLICED,
                                              shard=1)).replicas[0].worker_id == "r1"
    st.report(5.0, rid, "reader", "bad")  # the only assembled copy is suspect: back to the slices
    with pytest.raises(ConflictError, match="read them and assemble"):
        st.acquire_lease(6.0, ask)
    # A reader that assembles slices itself says so: the answer names the layout, no lease.
    open_leases = dict(st.registry.leases)
    g = st.acquire_lease(6.0, ask.model_copy(update={"slices": True}))
    assert (g.layout, g.num_shards, g.lease_id, g.replicas) == (SLICED, 2, "", [])
    assert st.registry.leases == open_leases
    # ... and reads an assembled copy like any hf replica once one serves again.
    assert [r.worker_id for r in st.acquire_lease(40.0, ask.model_copy(update={"slices": True})).replicas] == ["other"]


# ---------------------------------------------------------------------- Hubs, plain slices
def _ranks(connect, n):
    return [connect(f"rank{i}") for i in range(n)]


def test_column_slices_assemble_and_serve(connect):
    full = {"w": torch.randn(6, 12), "b": torch.randn(5)}
    ranks = _ranks(connect, 3)
    snaps = []
    for r, h in enumerate(ranks):  # dim-1 slices: not contiguous in the full tensor
        s = {"w": Slice(full["w"][:, 4 * r:4 * r + 4].contiguous(), (6, 12), (0, 4 * r))}
        if r == 2:
            s["b"] = full["b"].clone()  # a plain tensor: whole, from this rank only
        snaps.append(s)
        v = h.publish("m", s, key="step-1", shard=r, num_shards=3)
        assert v == 1
        assert ranks[0].latest("m") == (1 if r == 2 else None)  # complete with the last rank only
    reader = connect("reader")
    assert [(t.name, t.shape) for t in reader.manifest("m", 1)] == [("w", (6, 12)), ("b", (5,))]
    got = reader.fetch("m", 1)
    assert torch.equal(got["w"], full["w"]) and torch.equal(got["b"], full["b"])
    assert got.nbytes == 6 * 12 * 4 + 5 * 4
    assert got.sources == {"rank0": 96, "rank1": 96, "rank2": 96 + 20}
    # The reader serves the assembled copy: the next reader reads it like any hf replica.
    again = connect("reader2").fetch("m", 1)
    assert again.sources == {"reader": got.nbytes} and torch.equal(again["w"], full["w"])
    part = connect("reader3").fetch("m", 1, ranges={"w": ((1, 4), (3, 9))}, serve=False)
    assert torch.equal(part["w"], full["w"][1:4, 3:9]) and part.nbytes == 3 * 6 * 4


@pytest.mark.parametrize("serve", [False, True])
def test_a_reader_learns_the_layout_from_its_lease_answer_not_a_refusal(connect, serve):
    """Plain (``serve=False``: the lease's answer says ``hf.slices``) and serving while
    receiving (no ``hf`` manifest yet: no lease asked before the slices' own): no lease of
    the reader is refused, and the assembled bytes are exact."""
    from tensorhub import ConflictError

    full = {"w": torch.randn(8, 6)}
    ranks = _ranks(connect, 2)
    for r, h in enumerate(ranks):
        h.publish("m", {"w": Slice(full["w"][4 * r:4 * r + 4].clone(), (8, 6), (4 * r, 0))}, key="k", shard=r,
                  num_shards=2)
    reader = connect("reader")
    api = reader._session.api
    answers = []
    real = api.acquire_lease

    def watched(body, **kw):
        try:
            g = real(body, **kw)
        except ConflictError as e:
            answers.append((body["layout"], e.code))
            raise
        answers.append((body["layout"], g.layout))
        return g

    api.acquire_lease = watched
    got = reader.fetch("m", 1, serve=serve)
    assert torch.equal(got["w"], full["w"]) and set(got.sources) == {"rank0", "rank1"}
    assert all(a[1] in ("hf", SLICED) for a in answers), answers  # no refusal
    assert (("hf", SLICED) in answers) == (not serve), answers  # the answer that named the layout
    assert sorted(a for a in answers if a[0] == SLICED) == [(SLICED, SLICED)] * 2  # one lease per rank's shard


def test_overlap_and_missing_slices_are_refused_and_the_version_stays_invisible(connect):
    w = torch.randn(8, 4)
    a, b, c = _ranks(connect, 3)
    a.publish("m", {"w": Slice(w[:5].clone(), (8, 4), (0, 0))}, key="k1", shard=0, num_shards=2)
    with pytest.raises(ManifestMismatchError, match=r"'w': shard 1's slice \[4:8, 0:4\] overlaps shard 0's \[0:5, 0:4\]"):
        b.publish("m", {"w": Slice(w[4:].clone(), (8, 4), (4, 0))}, key="k1", shard=1, num_shards=2)
    assert b.held() == [] and a.latest("m") is None
    with pytest.raises(ManifestMismatchError, match=r"cover 28 of its 32 elements"):
        b.publish("m", {"w": Slice(w[6:].clone(), (8, 4), (6, 0))}, key="k1", shard=1, num_shards=2)
    assert a.latest("m") is None and not a.version_info("m", 1).complete
    with pytest.raises(tensorhub.NotFoundError):
        c.fetch("m", 1, timeout=3)
    with pytest.raises(ManifestMismatchError, match="is bfloat16 in shard 1 but float32 in shard 0"):
        b.publish("m", {"w": Slice(w[5:].to(torch.bfloat16), (8, 4), (5, 0))}, key="k1", shard=1, num_shards=2)
    b.publish("m", {"w": Slice(w[5:].clone(), (8, 4), (5, 0))}, key="k1", shard=1, num_shards=2)
    assert torch.equal(c.fetch("m", a.latest("m"))["w"], w)


def test_bad_slices_get_clear_errors_before_anything_is_registered(connect):
    h = connect("r")
    t = torch.zeros(4, 4)
    with pytest.raises(tensorhub.ConfigError, match="needs shard= .* and num_shards="):
        h.publish("m", {"w": Slice(t, (8, 4), (0, 0))})
    with pytest.raises(tensorhub.ConfigError, match="needs one version: pass version= .* or the same key="):
        h.publish("m", {"w": Slice(t, (8, 4), (0, 0))}, shard=0, num_shards=2)
    with pytest.raises(tensorhub.ConfigError, match=r"rows \[6, 10\) of dimension 0 are outside the full tensor's 8"):
        h.publish("m", {"w": Slice(t, (8, 4), (6, 0))}, key="k", shard=0, num_shards=2)
    with pytest.raises(tensorhub.ConfigError, match="shard 2 is not in"):
        h.publish("m", {"w": Slice(t, (8, 4), (0, 0))}, key="k", shard=2, num_shards=2)
    assert h.held() == []
    with pytest.raises(tensorhub.ConfigError, match="cannot be served"):
        h.fetch("m", 1, ranges={"w": ((0, 1), None)})


def test_assembled_bytes_are_checked_against_each_ranks_checksums(connect):
    w = torch.randn(8, 4)
    a, b = _ranks(connect, 2)
    sa = w[:4].clone()
    a.publish("m", {"w": Slice(sa, (8, 4), (0, 0))}, key="k", shard=0, num_shards=2)
    b.publish("m", {"w": Slice(w[4:].clone(), (8, 4), (4, 0))}, key="k", shard=1, num_shards=2)
    sa[1, 2] += 1.0  # rank 0's memory changes under a registered version (a holder bug)
    reader = connect("reader")
    with pytest.raises(tensorhub.FetchError, match=r"excluded after a checksum mismatch .*checksum mismatch on chunk 0"):
        reader.fetch("m", 1, timeout=3)  # rank 0's shard has no other replica to fail over to
    assert reader.held() == []  # nothing served
    # A second holder of rank 0's slice (same manifest): the corrupt source fails over to it.
    spare = connect("spare")
    spare.publish("m", {"w": Slice(w[:4].clone(), (8, 4), (0, 0))}, key="k", shard=0, num_shards=2)
    got = reader.fetch("m", 1, timeout=10, serve=False)
    assert torch.equal(got["w"], w) and len(got.failed_sources) <= 1 and got.sources.get("spare") == 64
    # Slices cut along dim 1 land in pieces: checked where they landed, after the read.
    c, d = connect("c"), connect("d")
    sc = w[:, :2].contiguous()
    c.publish("m", {"w": Slice(sc, (8, 4), (0, 0))}, key="k2", shard=0, num_shards=2)
    d.publish("m", {"w": Slice(w[:, 2:].contiguous(), (8, 4), (0, 2))}, key="k2", shard=1, num_shards=2)
    sc[3, 1] -= 1.0
    with pytest.raises(tensorhub.FetchError, match=r"hf.slices shard 0: checksum mismatch on chunk 0"):
        reader.fetch("m", 2, timeout=3)
    assert reader.held() == []


def test_ranks_passing_the_same_key_get_one_version_for_full_shards_too(connect):
    a, b = _ranks(connect, 2)
    x, y = torch.randn(4), torch.randn(5)
    assert a.publish("m", {"x": x}, key="step-9", shard=0, num_shards=2) == 1
    assert a.latest("m") is None
    assert b.publish("m", {"y": y}, key="step-9", shard=1, num_shards=2) == 1
    assert a.latest("m") == 1
    assert a.publish("m", {"x": x}, key="step-10", shard=0, num_shards=2) == 2  # a new key: a new version
    with pytest.raises(tensorhub.ConfigError, match="version= or key=, not both"):
        a.publish("m", {"x": x}, key="k", version=3)


def test_range_reads_of_a_full_publish_move_only_their_bytes(connect):
    w = torch.randn(64, 32)
    connect("holder").publish("m", {"w": w, "x": torch.randn(3)})
    r = connect("reader")
    got = r.fetch("m", 1, ranges={"w": ((10, 20), (8, 16))}, names=["x"], serve=False)
    assert torch.equal(got["w"], w[10:20, 8:16])
    assert got.nbytes == 10 * 8 * 4 + 3 * 4
    with pytest.raises(tensorhub.ConfigError, match=r"rows \(10, 80\) of 'w' is outside its dimension 0 of size 64"):
        r.fetch("m", 1, ranges={"w": ((10, 80), None)}, serve=False)


# ---------------------------------------------------------------------- real FSDP2 ranks, real Mooncake
@pytest.fixture
def trainer(coordinator, tmp_path):
    from tensorhub.testing._fsdp import ShardedTrainer

    made = []

    def make(world, **kw):
        t = ShardedTrainer(coordinator.url, world, str(tmp_path / f"init{len(made)}"), **kw)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


def test_fsdp2_two_ranks_publish_in_place_and_readers_assemble_serve_and_swap(coordinator, trainer):
    from tensorhub.testing._fsdp import build_model

    tr = trainer(2)
    v1 = set(tr.all("publish", "step-1", answer="published").values())
    assert v1 == {1}
    ref = build_model(0).state_dict()
    with tensorhub.connect(coordinator.url, worker_id="reader-a") as a, \
            tensorhub.connect(coordinator.url, worker_id="reader-b") as b:
        assert a.latest("policy") == 1
        vi = a.version_info("policy", 1)
        assert vi.layouts[SLICED].num_shards == 2 and "hf" not in vi.layouts
        got = a.fetch("policy", 1)  # serves the assembled tensors
        assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
        total = sum(t.numel() * t.element_size() for t in ref.values())
        assert got.nbytes == total and set(got.sources) == {"trainer-0", "trainer-1"}
        assert sum(got.sources.values()) == total
        # Row range (uneven FSDP shards: 3.weight is 2048 rows, rank 0 holds 0-1023) and a column range.
        part = b.fetch("policy", 1, ranges={"3.weight": ((1000, 1100), (2, 5)), "0.weight": (None, (3, 4))},
                       serve=False)
        assert torch.equal(part["3.weight"], ref["3.weight"][1000:1100, 2:5])
        assert torch.equal(part["0.weight"], ref["0.weight"][:, 3:4])
        assert part.nbytes == (100 * 3 + 10 * 1) * 4  # only those bytes moved
        second = b.fetch("policy", 1)
        assert second.sources == {"reader-a": total}  # every reader becomes a source
        # Swap: a training step, v2 published sliced the same way, v1 unpublished by the ranks.
        tr.all("step", 0.25, answer="stepped")
        assert set(tr.all("publish", "step-2", answer="published").values()) == {2}
        tr.all("unpublish", 1, answer="unpublished")
        full2 = tr.full()
        got2 = b.fetch("policy", a.latest("policy"))
        assert got2.version == 2 and all(torch.equal(got2[k], full2[k]) for k in ref)
        assert all(torch.equal(full2[k], ref[k] + 0.25) for k in ref)
        assert all(torch.equal(a.fetch("policy", 1)[k], ref[k]) for k in ref)  # v1 still read from reader-a


def test_fsdp2_four_ranks_bit_exact_and_a_rank_dying_before_registering_leaves_it_incomplete(coordinator, trainer):
    from tensorhub.testing._fsdp import build_model

    tr = trainer(4)
    assert set(tr.all("publish", "step-1", answer="published").values()) == {1}
    ref = build_model(0).state_dict()
    with tensorhub.connect(coordinator.url, worker_id="reader") as r:
        got = r.fetch("policy", 1)  # served: v1 outlives rank 3 below
        assert all(torch.equal(got[k], ref[k]) for k in ref)
        assert set(got.sources) == {f"trainer-{i}" for i in range(4)}
        # 0.weight is 10 rows over 4 ranks (3, 3, 3, 1): rows 2-7 come from ranks 0-2 only.
        part = r.fetch("policy", 1, ranges={"0.weight": ((2, 8), None)}, serve=False)
        assert torch.equal(part["0.weight"], ref["0.weight"][2:8])
        assert part.nbytes == 6 * 16 * 4 and set(part.sources) == {"trainer-0", "trainer-1", "trainer-2"}
        tr.all("step", 1.0, answer="stepped")
        tr.cmds[3].put(("publish", ("step-2", 3)))  # rank 3 dies before it registers anything of v2
        done = tr.all("publish", ("step-2", 3), answer="published", ranks=[0, 1, 2])
        assert set(done.values()) == {2}
        tr.ctx.processes[3].join(30)
        assert tr.ctx.processes[3].exitcode == 3  # gone before registering v2
        vi = r.version_info("policy", 2)
        assert not vi.complete and not vi.layouts[SLICED].complete
        assert r.latest("policy") == 1  # no reader sees v2
        with pytest.raises(tensorhub.TensorHubError):
            r.fetch("policy", 2, timeout=3)
        with pytest.raises(tensorhub.TensorHubError):
            r.fetch("policy", 2, ranges={"0.weight": ((0, 1), None)}, serve=False, timeout=3)
        with tensorhub.connect(coordinator.url, worker_id="reader-2") as r2:
            # Rank 3's v1 slices died with it; the reader's assembled copy still serves v1.
            again = r2.fetch("policy", 1, serve=False, timeout=30)
            assert again.sources == {"reader": got.nbytes} and all(torch.equal(again[k], ref[k]) for k in ref)


def test_full_manifests_on_the_wire_carry_no_slices_field(embedded, connect):
    """Clients and coordinators that predate sliced publishing refuse unknown fields."""
    import httpx

    connect("holder").publish("m", {"x": torch.zeros(3)})
    body = httpx.get(f"{embedded.url}/v1/models/m/versions/1/manifest", params={"layout": "hf", "shard": 0}).json()
    assert set(body) == {"tensors", "checksum", "checksums"}
