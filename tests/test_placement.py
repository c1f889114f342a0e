"""Placement logic on a synthetic fleet view (plain data, no components involved):
filtering, power-of-k choice, and the in-flight overlay that spreads a burst."""

from __future__ import annotations

import random
import time

import pytest

import dsec
from dsec.control.placement.engine import Placement
from dsec.shared.wire.models import Backend, NodeStats


def node(name: str, cpu_reserved: float = 0, healthy: bool = True, mem_reserved: int = 0) -> NodeStats:
    return NodeStats(edge=name, healthy=healthy, backends=[Backend.container], cpus=4, memory_mb=8192,
                     cpu_overcommit=1.0, memory_overcommit=1.0, sandboxes=0, cpu_reserved=cpu_reserved,
                     memory_reserved_mb=mem_reserved, max_sandboxes=100)


# placement reserves what a sandbox requests (its limits when it asks for guaranteed resources)
ARGS = dsec.ContainerArgs(image="base/busybox", cpu_cores_limit=1, memory_limit_mb=512, cpu_request=1,
                          memory_request_mb=512)
BEST_EFFORT = dsec.ContainerArgs(image="base/busybox", cpu_cores_limit=1, memory_limit_mb=512)


def test_best_effort_reserves_a_fraction_of_its_limits() -> None:
    assert BEST_EFFORT.cpu_admitted == pytest.approx(0.05) and BEST_EFFORT.memory_admitted_mb == 64
    view = {"a": node("a", cpu_reserved=3.5)}  # half a core left: room for best-effort sandboxes, not one core
    p = Placement(lambda: view, k=2)
    for _ in range(8):
        with p.reserve(p.choose(BEST_EFFORT), BEST_EFFORT):
            pass
    with pytest.raises(dsec.AdmissionRejected):
        p.choose(ARGS)


def test_filters_unhealthy_and_full_nodes() -> None:
    view = {"a": node("a", healthy=False), "b": node("b", cpu_reserved=3.5), "c": node("c", mem_reserved=8000),
            "d": node("d")}
    p = Placement(lambda: view, k=2, rng=random.Random(1))
    assert {p.choose(ARGS) for _ in range(20)} == {"d"}
    with pytest.raises(dsec.AdmissionRejected):
        p.choose(ARGS, exclude={"d"})


def test_power_of_k_prefers_the_less_loaded() -> None:
    view = {"busy": node("busy", cpu_reserved=3), "idle": node("idle")}
    p = Placement(lambda: view, k=2, rng=random.Random(2))
    assert all(p.choose(ARGS) == "idle" for _ in range(20))


def test_in_flight_overlay_spreads_a_burst_on_one_snapshot() -> None:
    view = {n: node(n) for n in ("a", "b")}
    p = Placement(lambda: view, k=2, rng=random.Random(3))
    placed = []
    for _ in range(8):  # 8 one-core sandboxes on a stale snapshot of two empty 4-core nodes
        name = p.choose(ARGS)
        with p.reserve(name, ARGS):
            placed.append(name)
    assert sorted(placed) == ["a"] * 4 + ["b"] * 4
    with pytest.raises(dsec.AdmissionRejected):  # both full until a new snapshot says otherwise
        p.choose(ARGS)
    fresh = {n: node(n) for n in ("a", "b")}
    p2 = Placement(lambda: fresh, k=2)
    assert p2.choose(ARGS) in ("a", "b")


def test_recent_placements_count_until_a_snapshot_shows_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """A snapshot taken while creates were finishing does not show them: in ranking edges
    they still count (a quick run of creates spreads), until a snapshot whose counts show
    them, or 5 s; against an edge's room only until the next snapshot (a create after a
    stop is not refused for a sandbox that is gone)."""
    views = [{n: node(n) for n in ("a", "b")}]
    p = Placement(lambda: views[-1], k=2, rng=random.Random(4))
    placed = []
    for _ in range(4):
        views.append({n: node(n) for n in ("a", "b")})  # a fresh snapshot each time, stale in what it shows
        name = p.choose(ARGS)
        with p.reserve(name, ARGS):
            placed.append(name)
    assert sorted(placed) == ["a", "a", "b", "b"]
    assert p._room(views[-1]["a"], unseen=True).sandboxes == 2
    views.append({n: node(n) for n in ("a", "b")})
    p.choose(ARGS)
    assert p._room(views[-1]["a"]).sandboxes == 0  # the room: only what this snapshot shows
    # a snapshot that shows the two on "a" (and not those on "b"): only "b"'s still count
    views.append({"a": node("a").model_copy(update={"sandboxes": 2, "cpu_reserved": 2}), "b": node("b")})
    p.choose(ARGS)
    assert (p._room(views[-1]["a"], unseen=True).sandboxes, p._room(views[-1]["b"], unseen=True).sandboxes) == (2, 2)
    # and no snapshot ever shows "b"'s: forgotten after 5 s
    later = time.monotonic() + 6
    monkeypatch.setattr("dsec.control.placement.engine.time.monotonic", lambda: later)
    views.append(dict(views[-1]))
    p.choose(ARGS)
    assert p._room(views[-1]["b"], unseen=True).sandboxes == 0


def test_never_a_cordoned_edge_and_a_suspect_one_only_when_no_ok_edge_has_room() -> None:
    view = {"a": node("a").model_copy(update={"health": "cordoned", "cordoned": True}),
            "b": node("b").model_copy(update={"health": "suspect"}),
            "c": node("c", cpu_reserved=2)}
    p = Placement(lambda: view, k=2, rng=random.Random(4))
    assert {p.choose(ARGS) for _ in range(50)} == {"c"}  # b is emptier, but suspect
    view["c"] = node("c", cpu_reserved=4)  # the ok edge is full: the suspect one takes it
    assert {p.choose(ARGS) for _ in range(50)} == {"b"}
    view["b"] = node("b", cpu_reserved=4).model_copy(update={"health": "suspect"})
    with pytest.raises(dsec.AdmissionRejected):  # the cordoned edge is empty, and still never chosen
        p.choose(ARGS)


def test_a_gang_plan_holds_room_for_all_or_refuses_naming_how_many_fit() -> None:
    view = {"a": node("a"), "b": node("b", cpu_reserved=2), "down": node("down", healthy=False)}
    p = Placement(lambda: view, k=2, rng=random.Random(5))
    with pytest.raises(dsec.AdmissionRejected) as e:
        p.plan(ARGS, 7)  # one-core sandboxes: 4 fit on a, 2 on b, the unhealthy one does not count
    assert "room for 6 of these 7" in e.value.message and e.value.field == "n"
    assert not p.planned  # a refusal holds nothing
    plan = p.plan(ARGS, 5)
    assert plan.left == {"a": 3, "b": 2} or plan.left == {"a": 4, "b": 1}, plan.left
    # the room is held against every other placement: one core is left in all
    with p.reserve(p.choose(ARGS), ARGS):
        with pytest.raises(dsec.AdmissionRejected):
            p.choose(ARGS)
    # the gang's items take it, one by one, most held first
    taken = [p.take(plan) for _ in range(5)]
    assert sorted(t for t in taken if t) == sorted(["a"] * 4 + ["b"] * 1) or \
        sorted(t for t in taken if t) == sorted(["a"] * 3 + ["b"] * 2)
    assert p.take(plan) is None and not p.planned


def test_a_gang_that_ends_early_lets_its_room_go() -> None:
    view = {"a": node("a")}
    p = Placement(lambda: view, k=2)
    plan = p.plan(ARGS, 4)
    assert p.take(plan) == "a"  # (the taken core is the item's own to reserve)
    with p.reserve("a", ARGS), pytest.raises(dsec.AdmissionRejected):
        p.choose(ARGS)  # 3 cores still held for the gang's other items
    p.release(plan)
    assert plan.held == 0 and not p.planned
    with p.reserve(p.choose(ARGS), ARGS), p.reserve(p.choose(ARGS), ARGS), p.reserve(p.choose(ARGS), ARGS):
        with pytest.raises(dsec.AdmissionRejected):
            p.choose(ARGS)  # the three freed, and the item made above
