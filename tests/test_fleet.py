"""Fleet switch groups (tensorhub/server/fleet.py): the two-phase rules on a fake clock, then the
routes, status and metrics on a real coordinator. The engines' side (tensorhub follow
--group with real vLLM engines) is tests/engine/test_vllm_fleet.py."""

from __future__ import annotations

import httpx
import pytest

from tensorhub._exceptions import ConflictError, NotFoundError
from tensorhub.server.fleet import FleetApplied, FleetGroups, FleetJoin, FleetReady, FleetSwitch


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def groups(**kw):
    clock = Clock()
    return FleetGroups(clock, **kw), clock


def join(f, member, version, switch="auto", wait=10.0, model="m"):
    return f.join("g", FleetJoin(member=member, model=model, version=version, switch=switch, wait=wait))


def members(view):
    return {m["member"]: (m["version"], m["in_group"]) for m in view["members"]}


def test_every_member_ready_then_all_apply_and_the_group_moves_together():
    f, _ = groups()
    join(f, "a", 1)
    join(f, "b", 1)
    assert f.ready("g", FleetReady(member="a", version=2))["state"] == "ready"  # b not yet: nobody applies
    r = f.ready("g", FleetReady(member="b", version=2))
    assert r["state"] == "apply" and r["go"] == ["a", "b"] and r["left"] == []
    assert f.view("g")["version"] == 1  # until the round is done the group says v1
    f.applied("g", FleetApplied(member="a", version=2, ok=True))
    assert f.round("g", 2)["state"] == "apply"
    r = f.applied("g", FleetApplied(member="b", version=2, ok=True))
    assert r["state"] == "done" and r["applied"] == ["a", "b"]
    v = f.view("g")
    assert v["version"] == 2 and members(v) == {"a": (2, True), "b": (2, True)} and not v["mixed"]


def test_a_member_not_ready_by_the_deadline_leaves_for_that_version_and_comes_back_after_catching_up():
    f, clock = groups()
    join(f, "a", 1)
    join(f, "b", 1)
    f.ready("g", FleetReady(member="a", version=2))
    clock.t += 9.9
    assert f.round("g", 2)["state"] == "ready"
    clock.t += 0.2  # past the round's 10 s
    r = f.round("g", 2)
    assert r["state"] == "apply" and r["go"] == ["a"] and r["left"] == ["b"]
    v = f.view("g")
    assert v["left_total"] == 1 and members(v)["b"] == (1, False)
    assert "not ready for v2" in next(m["why_out"] for m in v["members"] if m["member"] == "b")
    f.applied("g", FleetApplied(member="a", version=2, ok=True))
    assert not f.view("g")["mixed"]  # b is out: the group (a) is all v2
    with pytest.raises(ConflictError) as e:  # b is not in the round: it cannot report an outcome
        f.applied("g", FleetApplied(member="b", version=2, ok=True))
    assert e.value.code == "fleet_not_in_round"
    v = join(f, "b", 2)  # b swapped alone and says so: back in the group
    assert members(v) == {"a": (2, True), "b": (2, True)} and not v["mixed"]
    f.ready("g", FleetReady(member="b", version=3))
    assert f.ready("g", FleetReady(member="a", version=3))["go"] == ["a", "b"]


def test_with_switch_caller_a_round_waits_for_the_caller_even_when_everyone_is_ready():
    f, clock = groups()
    join(f, "a", 1, switch="caller")
    join(f, "b", 1, switch="caller")
    f.ready("g", FleetReady(member="a", version=2))
    f.ready("g", FleetReady(member="b", version=2))
    for _ in range(10):  # 100 s, the members refreshing themselves: no deadline before the caller asks
        clock.t += 10
        join(f, "a", 1, switch="caller")
        join(f, "b", 1, switch="caller")
    assert f.round("g", 2)["state"] == "ready"
    r = f.switch("g", FleetSwitch(model="m", version=2))
    assert r["state"] == "apply" and r["go"] == ["a", "b"]


def test_the_caller_can_switch_before_anyone_is_ready_and_the_deadline_counts_from_then():
    f, clock = groups()
    join(f, "a", 1, switch="caller", wait=5.0)
    join(f, "b", 1, switch="caller", wait=5.0)
    assert f.switch("g", FleetSwitch(model="m", version=2, wait=3.0))["state"] == "ready"
    f.ready("g", FleetReady(member="b", version=2))
    clock.t += 3.1
    r = f.round("g", 2)
    assert r["go"] == ["b"] and r["left"] == ["a"]


def test_a_failed_apply_takes_the_member_out_and_the_group_is_never_mixed():
    f, _ = groups()
    for m in "abc":
        join(f, m, 1)
    for m in "abc":
        f.ready("g", FleetReady(member=m, version=2))
    f.applied("g", FleetApplied(member="a", version=2, ok=True))
    f.applied("g", FleetApplied(member="b", version=2, ok=False, error="checksum mismatch on chunk 3"))
    r = f.applied("g", FleetApplied(member="c", version=2, ok=True))
    assert r["state"] == "done" and r["failed"] == {"b": "checksum mismatch on chunk 3"}
    v = f.view("g")
    assert v["version"] == 2 and v["failed_total"] == 1 and not v["mixed"]
    assert members(v) == {"a": (2, True), "b": (1, False), "c": (2, True)}  # b's engine kept v1
    v = join(f, "b", 1)  # its follow process says so too
    assert members(v)["b"] == (1, False) and not v["mixed"]


def test_mixed_is_the_alarm_when_a_member_in_the_group_reports_another_version():
    f, _ = groups()
    join(f, "a", 1)
    join(f, "b", 1)
    assert not f.view("g")["mixed"]
    v = join(f, "b", 7)  # e.g. its engine was restarted on another version by hand
    assert v["mixed"] and members(v)["b"] == (7, True)
    body = b"".join(_exposition(f))
    assert b'tensorhub_fleet_mixed{group="g"} 1.0' in body
    assert b'tensorhub_fleet_members{group="g",state="in"} 2.0' in body


def _exposition(f):
    from prometheus_client import CollectorRegistry, generate_latest

    r = CollectorRegistry()
    r.register(f.collector())
    yield generate_latest(r)


def test_silent_members_are_dropped_and_silent_appliers_fail_at_the_apply_timeout():
    f, clock = groups(member_ttl=15.0, apply_timeout=30.0)
    join(f, "a", 1)
    join(f, "b", 1)
    clock.t += 10
    join(f, "a", 1)  # a refreshes, b does not
    clock.t += 6
    assert set(members(f.view("g"))) == {"a"}
    f.ready("g", FleetReady(member="a", version=2))  # alone: everyone is ready
    for _ in range(3):  # a keeps calling, but never reports its outcome
        clock.t += 11
        join(f, "a", 1)
    r = f.round("g", 2)
    assert r["state"] == "done" and r["failed"] == {"a": "no outcome within 30s"}
    assert f.view("g")["version"] == 1  # nobody applied


def test_bad_calls_get_one_clear_error_and_change_nothing():
    f, _ = groups()
    join(f, "a", 1)
    with pytest.raises(ConflictError, match="follows 'm'") as e:
        join(f, "b", 1, model="other")
    assert e.value.code == "fleet_mismatch"
    with pytest.raises(ConflictError, match="switch='auto'"):
        join(f, "b", 1, switch="caller")
    with pytest.raises(NotFoundError, match="not a member") as e:
        f.ready("g", FleetReady(member="zz", version=2))
    assert e.value.code == "unknown_fleet_member"
    with pytest.raises(NotFoundError) as e:
        f.switch("nope", FleetSwitch(model="m", version=2))
    assert e.value.code == "unknown_fleet"
    with pytest.raises(ConflictError, match="already runs v1"):
        f.ready("g", FleetReady(member="a", version=1))
    assert members(f.view("g")) == {"a": (1, True)} and f.view("g")["rounds"] == []


def test_a_newer_version_overtakes_a_round_that_did_not_decide():
    f, _ = groups()
    join(f, "a", 1)
    join(f, "b", 1)
    f.ready("g", FleetReady(member="a", version=2))  # b never gets v2 ...
    f.ready("g", FleetReady(member="a", version=3))
    r = f.ready("g", FleetReady(member="b", version=3))  # ... both hold v3: v3 applies, v2 never does
    assert r["go"] == ["a", "b"]
    assert f.round("g", 2)["state"] == "done" and f.round("g", 2)["go"] == []


def test_routes_status_and_metrics_on_a_real_coordinator(embedded, connect):
    url = embedded.url
    hub = connect("trainer")
    api = hub.api
    if True:
        api.fleet_join("rl", "f-a", "policy", 1, "caller", 30.0, engine="http://127.0.0.1:1")
        api.fleet_join("rl", "f-b", "policy", 1, "caller", 30.0, engine="http://127.0.0.1:2")
        api.fleet_ready("rl", "f-a", 2)
        api.fleet_ready("rl", "f-b", 2)
        r = api.fleet_switch("rl", "policy", 2)
        assert r["state"] == "apply" and r["go"] == ["f-a", "f-b"]
        api.fleet_applied("rl", "f-a", 2, True)
        api.fleet_applied("rl", "f-b", 2, True)
        assert hub.fleet_switch("rl", "policy", 2, timeout=5)["applied"] == ["f-a", "f-b"]  # done: returns at once
        st = api.status()
        g = next(g for g in st["fleets"] if g["group"] == "rl")
        assert g["version"] == 2 and {m["engine"] for m in g["members"]} == {"http://127.0.0.1:1", "http://127.0.0.1:2"}
        from tensorhub.cli import format_status

        text = format_status(st)
        assert "fleet group rl (policy, switch caller): v2; left 0, failed 0" in text and "f-a" in text
        metrics = httpx.get(f"{url}/metrics").text
        assert 'tensorhub_fleet_mixed{group="rl"} 0.0' in metrics
        # bad input over HTTP: a clear 4xx naming it, and the coordinator keeps serving
        bad = httpx.post(f"{url}/v1/fleets/rl/ready", json={"member": "f-a", "version": -1})
        assert bad.status_code == 422 and "version" in bad.json()["detail"]
        bad = httpx.post(f"{url}/v1/fleets/rl/join", json={"member": "f-c", "model": "other", "version": 1})
        assert bad.status_code == 409 and bad.json()["code"] == "fleet_mismatch"
        bad = httpx.get(f"{url}/v1/fleets/nope")
        assert bad.status_code == 404 and bad.json()["code"] == "unknown_fleet"
        assert httpx.get(f"{url}/v1/fleets/rl").json()["version"] == 2


def test_a_follow_process_joins_again_when_the_coordinator_forgot_its_group(embedded, connect, capsys):
    """Groups are soft state: after a coordinator restart (here: its groups dropped, what a
    restart leaves) a member's next call is answered unknown_fleet_member and the follow
    process joins again with its engine's version; the round then runs as usual."""
    import argparse

    from tensorhub.follow import _Fleet

    hub = connect("f-a")
    args = argparse.Namespace(group="rl", model="policy", group_switch="auto", group_wait=30.0,
                              engine="http://127.0.0.1:9", prefetch_wait=1.0)
    f = _Fleet(hub, args, 1)
    assert "fleet group rl: member f-a, in the group at v1" in capsys.readouterr().err
    with embedded.coordinator.fleets.lock:
        embedded.coordinator.fleets.groups.clear()
    go, note = f.round(2, [])  # an engine without prefetch is ready at once; alone, it applies
    assert go is True and "1 apply together" in note
    assert "fleet group rl: member f-a, in the group at v1" in capsys.readouterr().err  # joined again
    f.applied(2, 2, True)
    view = hub.fleet("rl")
    assert view["version"] == 2 and [m["member"] for m in view["members"] if m["in_group"]] == ["f-a"]
