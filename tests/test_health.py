"""Fleet health (docs/fault-tolerance.md, "Detection" and "Cordon"): the detector on
synthetic sequences at its default settings. Each fault it knows found on the sick edge
only; idle and uniformly loaded fleets never flagged; counter resets; the cordon budget;
hysteresis; an operator's uncordon. End to end on real edge daemons: test_health_fleet.py.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from dsec.control.health.detector import Detector, Settings
from dsec.shared.wire.fleet import EdgeSignals
from dsec.shared.wire.models import Backend, NodeStats

GB = 1 << 30


def stats(name: str, **signals: Any) -> NodeStats:
    s = EdgeSignals(**{"started_at": 1000.0, "disk_used_bytes": 10 * GB, "disk_total_bytes": 100 * GB, **signals})
    return NodeStats(edge=name, healthy=True, backends=[Backend.container], cpus=8, memory_mb=16384,
                     cpu_overcommit=8, memory_overcommit=1.5, sandboxes=0, cpu_reserved=0, memory_reserved_mb=0,
                     max_sandboxes=4096, signals=s)


class Fleet:
    """Synthetic edges: cumulative counters a test moves each round, fed to a detector."""

    def __init__(self, names: tuple[str, ...] = ("a", "b", "c"), settings: Settings | None = None) -> None:
        self.d = Detector(settings)
        self.t = 0.0
        self.c: dict[str, dict[str, float]] = {n: {} for n in names}
        self.down: set[str] = set()
        self.history: list[dict[str, str]] = []

    def add(self, name: str, **inc: float) -> None:
        for k, v in inc.items():
            self.c[name][k] = self.c[name].get(k, 0) + v

    def step(self, gauges: dict[str, dict[str, float]] | None = None, dt: float = 1.0) -> dict[str, str]:
        gauges = gauges or {}
        self.t += dt
        polled = {n: None if n in self.down else stats(n, **c, **gauges.get(n, {})) for n, c in self.c.items()}
        verdicts = self.d.observe(self.t, polled)
        out: dict[str, str] = {n: v.health for n, v in verdicts.items()}
        self.history.append(out)
        self.verdicts = verdicts
        return out

    def flagged(self) -> set[str]:
        return {n for h in self.history for n, v in h.items() if v != "ok"}


def creates(f: Fleet, name: str, n: int, seconds: float) -> None:
    f.add(name, creates=n, create_seconds=n * seconds)


# ---- the detector at its defaults --------------------------------------------------
def test_idle_fleet_is_never_flagged() -> None:
    f = Fleet(("a", "b", "c", "d"))
    rng = random.Random(1)
    for _ in range(3600):  # an hour of rounds: PSI noise, a rare create, no faults
        if rng.random() < 0.02:
            creates(f, rng.choice("abcd"), 1, rng.uniform(0.1, 0.4))
        f.step({n: {"psi_cpu": rng.uniform(0, 5), "psi_io": rng.uniform(0, 10)} for n in "abcd"})
    assert f.flagged() == set()


def test_uniform_load_is_never_flagged() -> None:
    """Every edge slows down together (create latency x10, pressure up): a fleet-wide load,
    not one sick edge."""
    f = Fleet()
    rng = random.Random(2)
    for i in range(600):
        slow = 10.0 if i > 200 else 1.0
        for n in "abc":
            creates(f, n, rng.randint(2, 6), 0.2 * slow * rng.uniform(0.8, 1.25))
            f.add(n, execs=50, agent_deadline_misses=rng.randint(0, 3) if i > 200 else 0)
        f.step({n: {"psi_cpu": 70.0 if i > 200 else 3.0} for n in "abc"})
    assert f.flagged() == set()


def test_slow_creates_against_peers() -> None:
    f = Fleet()
    for _ in range(30):
        for n in "abc":
            creates(f, n, 2, 0.3)
        f.step()
    assert f.flagged() == set()
    seen: list[str] = []
    for _ in range(20):
        creates(f, "a", 2, 0.3)
        creates(f, "b", 2, 0.3)
        creates(f, "c", 2, 2.5)  # c got slow
        seen.append(f.step()["c"])
    assert seen[0] == "suspect" and seen[-1] == "cordoned"
    ev = f.verdicts["c"].evidence
    assert ev[0].signal == "create_latency" and ev[0].value > 2 and ev[0].baseline == pytest.approx(0.3)
    assert {f.history[-1]["a"], f.history[-1]["b"]} == {"ok"}
    # it gets no creates once cordoned: the verdict holds, and stays until an operator lifts it
    for _ in range(200):
        creates(f, "a", 2, 0.3)
        creates(f, "b", 2, 0.3)
        assert f.step()["c"] == "cordoned"


def test_a_latency_hovering_at_the_threshold_does_not_flap() -> None:
    f = Fleet()
    for i in range(40):
        creates(f, "a", 5, 0.05)
        creates(f, "b", 5, 0.05)
        # above the line (3x the peers and 0.5 s more) for two rounds, then just below it
        creates(f, "c", 5, 0.6 if i % 8 < 2 else 0.45)
        f.step()
    seen = [h["c"] for h in f.history]
    first = seen.index("suspect")
    assert "ok" not in seen[first:] and seen[-1] == "cordoned", seen


def test_no_latency_verdict_without_samples() -> None:
    """Fewer than min_samples creates: no verdict, however slow they were."""
    f = Fleet()
    for _ in range(100):
        for n in "ab":
            creates(f, n, 3, 0.3)
        if f.t % 40 == 0:
            creates(f, "c", 1, 30.0)  # one very slow create now and then: 3 per lookback
        f.step()
    assert f.flagged() == set()


def test_slow_creates_against_own_history_with_too_few_peers() -> None:
    f = Fleet(("solo",))
    for _ in range(60):
        creates(f, "solo", 2, 0.25)
        f.step()
    for _ in range(30):
        creates(f, "solo", 2, 2.0)
        f.step()
    v = f.verdicts["solo"]
    # suspect with the evidence, never cordoned: the detector may not empty a one-edge fleet
    assert v.health == "suspect" and v.evidence[0].signal == "create_latency"
    assert "own baseline" in v.evidence[0].detail


@pytest.mark.parametrize(("fault", "signal_name"), [
    ("store", "store_errors"), ("disk", "disk"), ("failures", "create_failures"), ("down", "unreachable"),
    ("execs", "exec_failures"), ("deadlines", "agent_deadline_misses"), ("psi", "psi_io")])
def test_each_fault_is_found_on_the_sick_edge_only(fault: str, signal_name: str) -> None:
    f = Fleet()
    for _ in range(30):
        for n in "abc":
            creates(f, n, 1, 0.3)
            f.add(n, execs=20)
        f.step()
    gauges: dict[str, dict[str, float]] = {}
    for _ in range(15):
        for n in "abc":
            creates(f, n, 1, 0.3)
            f.add(n, execs=20, agent_deadline_misses=0)
        if fault == "store":
            f.add("c", store_errors=1)
        elif fault == "disk":
            gauges = {"c": {"disk_used_bytes": 97 * GB}}
        elif fault == "failures":
            f.add("c", create_failures=3)
        elif fault == "down":
            f.down = {"c"}
        elif fault == "execs":
            f.add("c", exec_failures=15)
        elif fault == "deadlines":
            f.add("c", agent_deadline_misses=1)
        elif fault == "psi":
            gauges = {"a": {"psi_io": 2.0}, "b": {"psi_io": 4.0}, "c": {"psi_io": 85.0}}
        f.step(gauges)
    assert f.history[-1] == {"a": "ok", "b": "ok", "c": "cordoned"}, f.history[-1]
    assert f.verdicts["c"].evidence[0].signal == signal_name
    assert f.flagged() == {"c"}
    first = next(i for i, h in enumerate(f.history) if h["c"] != "ok")
    cordoned = next(i for i, h in enumerate(f.history) if h["c"] == "cordoned")
    assert f.history[first]["c"] == "suspect" and cordoned - first >= Settings().cordon_after_s


def test_a_blip_clears_without_a_cordon() -> None:
    f = Fleet()
    f.down = {"b"}
    for _ in range(5):  # an edge restart: a few rounds without an answer
        f.step()
    assert f.history[-1]["b"] == "suspect"
    f.down = set()
    for _ in range(5):
        f.step()
    assert f.history[-1]["b"] == "ok" and "cordoned" not in {h["b"] for h in f.history}


def test_counters_restarting_with_the_edge_are_no_fault() -> None:
    f = Fleet()
    for _ in range(30):
        for n in "abc":
            creates(f, n, 2, 0.3)
            f.add(n, store_errors=0)
        f.step()
    f.c["b"] = {}  # b restarted: its counters are back at zero (and its started_at is new)
    for _ in range(30):
        for n in "abc":
            creates(f, n, 2, 0.3)
        f.t += 1
        polled = {n: stats(n, **c, **({"started_at": 2000.0} if n == "b" else {})) for n, c in f.c.items()}
        assert {v.health for v in f.d.observe(f.t, polled).values()} == {"ok"}


def test_the_detector_cordons_at_most_a_third_of_the_fleet() -> None:
    f = Fleet(("a", "b", "c", "d", "e", "f"))
    for _ in range(30):
        f.add("a", store_errors=1)
        f.add("b", store_errors=1)
        f.add("c", store_errors=1)
        f.step()
    last = f.history[-1]
    assert sorted(n for n, h in last.items() if h == "cordoned") == ["a", "b"]  # 6 * 0.34 -> 2
    assert last["c"] == "suspect"


def test_reset_after_an_operator_uncordons() -> None:
    f = Fleet()
    for _ in range(20):
        f.add("c", store_errors=1)
        f.step()
    assert f.history[-1]["c"] == "cordoned"
    f.d.reset("c")  # the operator lifted it and the store works again
    for _ in range(20):
        f.step()
    assert f.history[-1]["c"] == "ok"


def test_settings_from_the_environment_are_checked() -> None:
    s = Settings.from_env("cordon_after_s=3, min_samples=2")
    assert s.cordon_after_s == 3.0 and s.min_samples == 2 and s.window_s == Settings().window_s
    with pytest.raises(ValueError, match="unknown setting 'cordon_after'"):
        Settings.from_env("cordon_after=3")
    with pytest.raises(ValueError, match="not a number"):
        Settings.from_env("min_samples=x")
