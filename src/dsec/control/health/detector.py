"""The fleet's anomaly detector (TRANSOM's TEE, at edge granularity): each round it takes
what every edge answered (or that it did not), and says which edges look sick and why.

Pure logic over :class:`~dsec.shared.wire.models.NodeStats` and the time: no I/O, so it is
tested on synthetic sequences (tests/test_health.py) and driven by whoever polls the
fleet (dsec.control.health.fleet).

How an edge is judged, per round:

- **Rates come from counter deltas.** An edge keeps counters since it started
  (:class:`~dsec.shared.wire.fleet.EdgeSignals`); the detector differences the newest poll with the
  oldest one inside ``window_s``. A new ``started_at`` (or a counter going backwards) is a
  restart: that edge's history starts again.
- **Hard thresholds** where comparing with peers makes no sense because a healthy edge has
  none of it: the disk over ``disk_full`` of its size, ``store_errors`` failed shared-store
  reads in the window, creates failing (``create_failure_ratio`` of at least
  ``min_attempts``), execs failing for the platform, and no answer for
  ``unreachable_rounds`` rounds in a row while its node is alive.
- **Peers** where load moves everything together: create latency, agent deadline misses
  and pressure stalls are compared with the other edges' median, robustly (median and MAD,
  which one sick edge cannot drag along), and only with at least ``min_peers`` edges
  reporting; a fleet under uniform load is then never flagged, since every edge moves.
- **Own history** for create latency when there are too few peers: an EWMA baseline fed only
  by rounds that were not anomalous.
- **Samples before verdicts**: latency needs ``min_samples`` creates (looking back at most
  ``latency_lookback_s``); an idle edge gets no latency verdict, and an edge that got none
  since it was flagged keeps its flag (placement sends it nothing to prove otherwise).

An anomalous edge goes ``ok -> suspect``; still anomalous ``cordon_after_s`` later it goes
``cordoned``, unless that would make more than ``max_cordoned_fraction`` of the fleet the
detector's cordons (a fleet-wide problem is not one edge's: it needs a person, and a
one- or two-edge fleet is never emptied). A suspect edge clean for ``clear_rounds`` rounds
is ``ok`` again; a cordon the detector set stays until an operator lifts it (``reset``).
Cordons an operator sets are not the detector's: dsec.control.health.fleet keeps them as they are.
"""

from __future__ import annotations

import os
import statistics
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace

from dsec.shared.wire.fleet import EdgeSignals, Evidence, Health
from dsec.shared.wire.models import NodeStats

ENV = "DSEC_HEALTH"  # "name=value,..." over the defaults below (tests shorten the windows)


@dataclass(frozen=True)
class Settings:
    window_s: float = 30.0  # counters are differenced over this window
    latency_lookback_s: float = 120.0  # how far back create samples are gathered
    min_samples: int = 5  # creates needed for a latency verdict
    latency_ratio: float = 3.0  # slower than the peers' median (or own baseline) by this factor
    latency_floor_s: float = 0.5  # ... and by at least this much
    peer_z: float = 4.0  # ... and this many robust deviations
    min_peers: int = 3  # edges reporting a signal for a peer comparison (this one included)
    baseline_alpha: float = 0.2  # EWMA weight of a new latency sample in the own baseline
    disk_full: float = 0.95  # fraction of the sandbox volume (or data dir filesystem)
    store_errors: int = 3  # failed shared-store reads in the window
    create_failure_ratio: float = 0.5
    min_attempts: int = 4  # creates (ok or failed) in the window before their failure ratio counts
    exec_failure_ratio: float = 0.5
    min_execs: int = 10
    deadline_misses: int = 5  # agent calls past their deadline in the window (and an outlier)
    psi_floor: float = 40.0  # % stalled (some, avg10) before pressure can be an outlier
    unreachable_rounds: int = 3  # rounds without an answer while the node is alive
    cordon_after_s: float = 10.0  # suspect this long, still anomalous: cordoned
    clear_rounds: int = 3  # clean rounds in a row before a suspect edge is ok again
    max_cordoned_fraction: float = 0.34  # of the fleet, at most, cordoned by the detector

    @classmethod
    def from_env(cls, spec: str | None = None) -> Settings:
        """The defaults with ``$DSEC_HEALTH`` (``name=value,...``) applied; a bad name or
        value is refused, so a typo cannot silently keep a default."""
        spec = os.environ.get(ENV, "") if spec is None else spec
        known = {f.name: f.type for f in fields(cls)}
        out: dict[str, float | int] = {}
        for item in filter(None, (x.strip() for x in spec.split(","))):
            name, _, value = item.partition("=")
            if name not in known:
                raise ValueError(f"{ENV}: unknown setting {name!r} (known: {', '.join(sorted(known))})")
            try:
                out[name] = int(value) if known[name] == "int" else float(value)
            except ValueError:
                raise ValueError(f"{ENV}: {item!r}: not a number") from None
        return replace(cls(), **out)  # type: ignore[arg-type]


@dataclass
class Verdict:
    health: Health
    evidence: list[Evidence] = field(default_factory=list)
    changed: bool = False  # the health differs from the previous round's

    @property
    def reason(self) -> str:
        return "; ".join(e.detail for e in self.evidence)


@dataclass
class _Sample:
    at: float
    s: EdgeSignals


@dataclass
class _Edge:
    samples: deque[_Sample] = field(default_factory=deque)
    misses: int = 0
    health: Health = "ok"
    since: float = 0.0  # when it went suspect
    clean: int = 0
    baseline: float | None = None  # EWMA of create seconds, from rounds that were not anomalous
    held: Evidence | None = None  # the last latency verdict against it, kept while no creates come
    evidence: list[Evidence] = field(default_factory=list)


def _reset(prev: EdgeSignals, new: EdgeSignals) -> bool:
    return new.started_at != prev.started_at or new.creates < prev.creates or new.store_errors < prev.store_errors


class Detector:
    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or Settings()
        self.edges: dict[str, _Edge] = {}

    # ---- what the fleet's records say ----------------------------------------------
    def health(self, edge: str) -> Health:
        e = self.edges.get(edge)
        return e.health if e else "ok"

    def seed(self, edge: str, health: Health, since: float) -> None:
        """Take up a verdict recorded earlier (a restarted watcher, another controller)."""
        e = self.edges.setdefault(edge, _Edge())
        e.health, e.since, e.clean = health, since, 0

    def reset(self, edge: str) -> None:
        """An operator lifted the detector's cordon: start this edge afresh (its history too,
        so the errors that cordoned it do not cordon it again; new ones will)."""
        self.edges[edge] = _Edge()

    def forget(self, edge: str) -> None:
        self.edges.pop(edge, None)

    # ---- a round ---------------------------------------------------------------------
    def observe(self, now: float, polled: Mapping[str, NodeStats | None],
                alive: Mapping[str, bool] | None = None) -> dict[str, Verdict]:
        """``polled``: every edge of the fleet, with what it answered this round (None: no
        answer); ``alive``: whether its node is up, where something (Ray) knows."""
        cfg = self.settings
        for name in [n for n in self.edges if n not in polled]:
            del self.edges[name]
        for name, st in polled.items():
            e = self.edges.setdefault(name, _Edge())
            if st is None or st.signals is None:
                e.misses += 1
                continue
            e.misses = 0
            if e.samples and _reset(e.samples[-1].s, st.signals):
                e.samples.clear()
            e.samples.append(_Sample(now, st.signals))
            horizon = now - max(cfg.window_s, cfg.latency_lookback_s)
            while len(e.samples) > 1 and e.samples[1].at <= horizon:
                e.samples.popleft()
        found = self._score(now, polled, alive or {})
        budget = int(len(polled) * cfg.max_cordoned_fraction) - sum(
            1 for e in self.edges.values() if e.health == "cordoned")
        out: dict[str, Verdict] = {}
        for name in sorted(polled, key=lambda n: self.edges[n].since):  # the longest suspect first
            e, evidence = self.edges[name], found.get(name, [])
            before = e.health
            if evidence:
                e.clean = 0
                e.evidence = evidence
                if e.health == "ok":
                    e.health, e.since = "suspect", now
                elif e.health == "suspect" and now - e.since >= cfg.cordon_after_s and budget > 0:
                    e.health = "cordoned"
                    budget -= 1
            else:
                e.clean += 1
                if e.health == "suspect" and e.clean >= cfg.clear_rounds:
                    e.health, e.evidence = "ok", []
            out[name] = Verdict(e.health, list(e.evidence) if e.health != "ok" else [], e.health != before)
        return out

    def _score(self, now: float, polled: Mapping[str, NodeStats | None],
               alive: Mapping[str, bool]) -> dict[str, list[Evidence]]:
        cfg = self.settings
        found: dict[str, list[Evidence]] = {name: [] for name in polled}
        latency: dict[str, float] = {}
        misses: dict[str, float] = {}
        psi: dict[str, dict[str, float]] = {}
        for name, st in polled.items():
            e, ev = self.edges[name], found[name]
            if st is None or st.signals is None:
                if e.misses >= cfg.unreachable_rounds and alive.get(name, True):
                    ev.append(Evidence(signal="unreachable", value=e.misses, baseline=None,
                                       threshold=cfg.unreachable_rounds,
                                       detail=f"no answer for {e.misses} rounds while its node is up"))
                continue
            s = st.signals
            if s.disk_total_bytes and (full := s.disk_used_bytes / s.disk_total_bytes) >= cfg.disk_full:
                ev.append(Evidence(signal="disk", value=round(full, 4), baseline=None, threshold=cfg.disk_full,
                                   detail=f"disk {full:.1%} full ({s.disk_used_bytes >> 20} of "
                                          f"{s.disk_total_bytes >> 20} MiB)"))
            d = self._delta(e, now - cfg.window_s)
            if d is not None:
                if d.store_errors >= cfg.store_errors:
                    ev.append(Evidence(signal="store_errors", value=d.store_errors, baseline=None,
                                       threshold=cfg.store_errors,
                                       detail=f"{d.store_errors} shared-store reads failed in {cfg.window_s:g} s"))
                misses[name] = d.agent_deadline_misses
            # ratios over the newest attempts (enough of them, within the window), not the
            # whole window: an edge that starts failing shows it at once
            c = self._recent(e, now - cfg.window_s, lambda x: x.creates + x.create_failures, cfg.min_attempts)
            if c is not None and c.create_failures / (tried := c.creates + c.create_failures) \
                    >= cfg.create_failure_ratio:
                ev.append(Evidence(signal="create_failures", value=round(c.create_failures / tried, 3),
                                   baseline=None, threshold=cfg.create_failure_ratio,
                                   detail=f"{c.create_failures} of {tried} creates failed"))
            x = self._recent(e, now - cfg.window_s, lambda x: x.execs, cfg.min_execs)
            if x is not None and x.exec_failures / x.execs >= cfg.exec_failure_ratio:
                ev.append(Evidence(signal="exec_failures", value=round(x.exec_failures / x.execs, 3),
                                   baseline=None, threshold=cfg.exec_failure_ratio,
                                   detail=f"{x.exec_failures} of {x.execs} execs failed for the platform"))
            lat = self._recent(e, now - cfg.latency_lookback_s, lambda x: x.creates, cfg.min_samples)
            if lat is not None:
                latency[name] = lat.create_seconds / lat.creates
            psi[name] = {"psi_cpu": s.psi_cpu, "psi_memory": s.psi_memory, "psi_io": s.psi_io}
        self._judge_latency(found, latency)
        for name, n in misses.items():
            if n >= cfg.deadline_misses and self._outlier(n, [v for k, v in misses.items() if k != name],
                                                          cfg.latency_ratio, cfg.deadline_misses) is not False:
                found[name].append(Evidence(signal="agent_deadline_misses", value=n,
                                            baseline=_median(misses, name), threshold=cfg.deadline_misses,
                                            detail=f"{n:g} calls to sandbox agents missed their deadline in "
                                                   f"{cfg.window_s:g} s"))
        for kind in ("psi_cpu", "psi_memory", "psi_io"):
            vals = {n: p[kind] for n, p in psi.items()}
            for name, v in vals.items():
                if v >= cfg.psi_floor and self._outlier(v, [x for k, x in vals.items() if k != name],
                                                        cfg.latency_ratio, cfg.psi_floor / 2) is True:
                    found[name].append(Evidence(signal=kind, value=v, baseline=_median(vals, name),
                                                detail=f"{kind[4:]} pressure {v:.0f}% (peers' median "
                                                       f"{_median(vals, name):.0f}%)"))
        return found

    def _judge_latency(self, found: dict[str, list[Evidence]], latency: dict[str, float]) -> None:
        cfg = self.settings
        for name in found:
            e = self.edges[name]
            if name not in latency:  # no verdict without samples: an earlier one stands
                if e.held is not None and e.health != "ok":
                    found[name].append(e.held)
                continue
            lat = latency[name]
            peers = [v for k, v in latency.items() if k != name]
            # hysteresis: a flag already raised clears only well below the line that raised it,
            # so an estimate hovering at the threshold does not flap between suspect and ok
            ratio, floor = cfg.latency_ratio, cfg.latency_floor_s
            if e.held is not None:
                ratio, floor = (1 + ratio) / 2, floor / 2
            verdict = self._outlier(lat, peers, ratio, floor)
            if verdict is not None:
                base, against = _median(latency, name), "the peers' median"
            else:  # too few peers: this edge's own history
                base, against = e.baseline, "its own baseline"
                verdict = base is not None and lat >= ratio * base and lat - base >= floor
            if verdict:
                e.held = Evidence(signal="create_latency", value=round(lat, 3), baseline=base,
                                  threshold=cfg.latency_ratio,
                                  detail=f"creates take {lat:.2f} s, {against} {base or 0:.2f} s")
                found[name].append(e.held)
            else:
                e.held = None
                e.baseline = lat if e.baseline is None else (
                    cfg.baseline_alpha * lat + (1 - cfg.baseline_alpha) * e.baseline)

    def _outlier(self, x: float, peers: list[float], ratio: float, floor: float) -> bool | None:
        """Whether ``x`` stands out of ``peers`` (None: too few to say): above their median by
        ``ratio`` times and by ``floor``, and by ``peer_z`` robust deviations."""
        cfg = self.settings
        if len(peers) + 1 < cfg.min_peers:
            return None
        m = statistics.median(peers)
        mad = statistics.median(abs(p - m) for p in peers)
        spread = max(1.4826 * mad, 0.1 * m, floor / cfg.peer_z)
        return x >= ratio * m and x - m >= floor and (x - m) / spread >= cfg.peer_z

    def _delta(self, e: _Edge, since: float) -> EdgeSignals | None:
        """Counter increments from the oldest sample at or after ``since`` to the newest."""
        first = next((x for x in e.samples if x.at >= since), None)
        if first is None or first is e.samples[-1]:
            return None
        return _minus(e.samples[-1].s, first.s)

    def _recent(self, e: _Edge, since: float, count: Callable[[EdgeSignals], float], least: int
                ) -> EdgeSignals | None:
        """Counter increments over the newest ``least`` (or a few more) events that
        ``count`` counts, looking back to ``since``; None when there were fewer."""
        if len(e.samples) < 2:
            return None
        new = e.samples[-1].s
        for old in reversed(e.samples):
            if old.at < since:
                break
            if count(new) - count(old.s) >= least:
                return _minus(new, old.s)
        return None


_COUNTERS = ("creates", "create_failures", "create_seconds", "admission_refusals", "execs", "exec_failures",
             "agent_deadline_misses", "store_errors")


def _minus(new: EdgeSignals, old: EdgeSignals) -> EdgeSignals:
    return new.model_copy(update={k: getattr(new, k) - getattr(old, k) for k in _COUNTERS})


def _median(values: Mapping[str, float], without: str) -> float | None:
    rest = [v for k, v in values.items() if k != without]
    return statistics.median(rest) if rest else None
