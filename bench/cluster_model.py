"""A discrete-event model of dsec at DSec's scale, driving dsec's real placement code.

What this module owns: the model, nothing else. 160 edges hold a steady-state population
(~380K sandboxes); apiserver replicas (each its own ``dsec.control.placement.engine.Placement``, with
its own in-flight overlay, all reading one shared watcher snapshot refreshed every second)
place a burst of creations; each edge admits or refuses with the real
``dsec.shared.admission.refusal`` on its exact state; a refused create is re-placed as
``Apiserver._place`` does (at most ``MAX_CREATE_ATTEMPTS`` tries). It reports, per placement
policy (power-of-2, random, least-loaded), refusals, failed creates, create latency (with
queueing at the replicas and at the edges), load imbalance across edges, and how many
replicas a rate needs, then raises the rate until the replicas saturate.

Time is scaled: the steady state is built directly (each sandbox's remaining lifetime drawn
from the equilibrium distribution of a heavy-tailed lifetime), not by simulating hours of
churn; only a short warm-up, the burst and its drain run event by event. The default burst is
10K creations, not DSec's 32K, to fit a minute here (``--burst 32000 --policies p2`` runs one
policy at full size); the rate sweeps replay the replicas' CPU queues only. It is a model: the
per-create costs are inputs (the placement cost is measured in-process here; the rest are
defaults taken from docs/benchmarks.md or assumed), see docs/cluster-model.md.

    .venv/bin/python bench/cluster_model.py
"""

from __future__ import annotations

import argparse
import heapq
import math
import os
import random
import statistics
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Literal

from dsec.control.apiserver.core import MAX_CREATE_ATTEMPTS
from dsec.control.placement.engine import Placement
from dsec.shared.admission import Room, refusal
from dsec.shared.errors import AdmissionRejected
from dsec.shared.wire.models import Backend, ContainerArgs, NodeStats

POLICIES: dict[str, str] = {"p2": "power-of-2 (k=2)", "random": "random (k=1)", "least": "least-loaded (k=all)"}


# ---- inputs -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """One kind of sandbox in the mix: its share of creations and the limits it asks for."""

    name: str
    share: float
    qos: Literal["best_effort", "latency_sensitive"]
    cpu_limits: tuple[float, ...]
    memory_limits_mb: tuple[int, ...]


# assumed: mostly small best-effort rollouts (admitted at 5% of their CPU limit and 1/8 of their
# memory limit, dsec's defaults), some latency-sensitive ones, a few large ones
SHAPES: tuple[Shape, ...] = (
    Shape("small", 0.85, "best_effort", (0.5, 1.0, 2.0), (1024, 2048, 4096)),
    Shape("medium", 0.12, "latency_sensitive", (1.0, 2.0), (2048, 4096)),
    Shape("large", 0.03, "latency_sensitive", (4.0, 8.0), (8192, 16384)),
)


@dataclass(frozen=True)
class Params:
    edges: int
    cores: int
    memory_gib: int
    cpu_overcommit: float
    memory_overcommit: float
    max_sandboxes: int
    steady: int
    life_median_min: float
    life_p99_h: float
    burst: int
    rate: float
    warmup_s: float
    replicas: int
    req_ms: float
    fwd_ms: float
    reply_ms: float
    choose_ms: dict[str, float]  # policy -> ms per call, overriding the measurement
    edge_create_ms: float
    edge_create_sigma: float
    edge_concurrency: int
    edge_refuse_ms: float
    net_ms: float
    view_interval_s: float
    view_lag_s: float
    slo_wait_ms: float
    sweep_creates: int
    policies: tuple[str, ...]
    seed: int
    db_ms: float = 0.0
    controller_ms: float = 0.0
    measured: dict[str, Any] | None = None

    @property
    def life_mu(self) -> float:
        return math.log(self.life_median_min * 60.0)

    @property
    def life_sigma(self) -> float:
        return math.log(self.life_p99_h * 3600.0 / (self.life_median_min * 60.0)) / 2.3263

    @property
    def life_mean_s(self) -> float:
        return math.exp(self.life_mu + self.life_sigma ** 2 / 2)

    @property
    def background_rate(self) -> float:
        """Creations per second that keep the steady state steady (Little's law)."""
        return self.steady / self.life_mean_s

    @property
    def cpu_cap(self) -> float:
        return self.cores * self.cpu_overcommit

    @property
    def memory_cap_mb(self) -> int:
        return int(self.memory_gib * 1024 * self.memory_overcommit)


class Catalog:
    """Every sandbox request of the mix, built once as real ContainerArgs."""

    def __init__(self) -> None:
        self.args: list[ContainerArgs] = []
        self.weights: list[float] = []
        for s in SHAPES:
            combos = [(c, m) for c in s.cpu_limits for m in s.memory_limits_mb]
            for c, m in combos:
                self.args.append(ContainerArgs(cpu_cores_limit=c, memory_limit_mb=m, qos=s.qos))
                self.weights.append(s.share / len(combos))
        self.cpu = [a.cpu_admitted for a in self.args]
        self.mem = [a.memory_admitted_mb for a in self.args]
        self._cum = [sum(self.weights[: i + 1]) for i in range(len(self.weights))]

    def draw(self, rng: random.Random, n: int) -> list[int]:
        return rng.choices(range(len(self.args)), cum_weights=self._cum, k=n)

    def mean(self) -> tuple[float, float]:
        return (sum(w * c for w, c in zip(self.weights, self.cpu, strict=True)),
                sum(w * m for w, m in zip(self.weights, self.mem, strict=True)))


# ---- the simulated cluster ----------------------------------------------------------------------
@dataclass
class Edge:
    """An edge's exact state: what it has admitted (its reservations) and its create slots."""

    name: str
    cpu: float = 0.0
    mem: int = 0
    n: int = 0
    busy: int = 0
    waiting: deque[Create] = field(default_factory=deque)
    peak_waiting: int = 0


@dataclass
class Create:
    """One create request as Apiserver._place handles it: the turns of its loop, the edges
    that refused it, the reservation it holds in its replica's Placement."""

    kind: int
    arrived: float
    burst: bool
    replica: int
    tried: set[str] = field(default_factory=set)
    iteration: int = 0
    attempts: int = 0  # forwarded to an edge
    refusals: int = 0
    refreshed: bool = False
    edge: str = ""
    cm: AbstractContextManager[None] | None = None
    cpu_s: float = 0.0  # replica CPU it cost
    queue_s: float = 0.0  # time it waited for a replica
    outcome: str = ""


@dataclass
class Replica:
    """An apiserver replica: its own Placement (and in-flight overlay) and one CPU, serving
    requests and edges' answers in arrival order."""

    placement: Placement
    queue: deque[tuple[Create, bool]] = field(default_factory=deque)  # (create, is_reply)
    busy: bool = False
    busy_s: float = 0.0
    enqueued: deque[float] = field(default_factory=deque)


@dataclass
class Result:
    policy: str
    choose_ms: float
    creates: int = 0
    refusals: int = 0
    failed_refused: int = 0
    failed_no_room: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    queue_ms: list[float] = field(default_factory=list)
    cpu_ms: list[float] = field(default_factory=list)
    attempts: list[int] = field(default_factory=list)
    load_before: list[float] = field(default_factory=list)
    load_after: list[float] = field(default_factory=list)
    peak_edge_waiting: int = 0
    replica_util: float = 0.0
    wall_s: float = 0.0


class Sim:
    """The cluster, event by event: edges, replicas, the watcher's ticks, creations."""

    def __init__(self, p: Params, catalog: Catalog, policy: str, rng: random.Random) -> None:
        self.p, self.cat, self.policy, self.rng = p, catalog, policy, rng
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self.edges = [Edge(f"edge{i:03d}") for i in range(p.edges)]
        self.by_name = {e.name: e for e in self.edges}
        self.view: dict[str, NodeStats] = {}
        k = policy_k(policy, p.edges)
        self.replicas = [Replica(Placement(lambda: self.view, k=k, rng=random.Random(rng.random())))
                         for _ in range(p.replicas)]
        self.choose_s = 0.0
        self.res = Result(policy, 0.0)
        self.outstanding = 0
        self.arrivals_left = 0
        self.burst_left = 0
        self.busy_at_last_burst = 0.0
        self.last_burst_at = 0.0
        self._rr = 0

    # -- event loop
    def at(self, t: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn))

    def run_until(self, done: Callable[[], bool]) -> None:
        while self._heap and not done():
            self.now, _, fn = heapq.heappop(self._heap)
            fn()

    # -- the steady state, built directly
    def fill(self, kinds: list[int], residual_s: list[float], horizon_s: float) -> None:
        """Place the steady-state population with the policy's rule on exact state (a fresh
        view: what hours of churn at a low rate approach), and schedule the departures that
        fall inside the simulated window."""
        p, cat, rng = self.p, self.cat, self.rng
        cpu_cap, mem_cap, cap_n, ne = p.cpu_cap, p.memory_cap_mb, p.max_sandboxes, p.edges
        cpu = [0.0] * ne
        mem = [0] * ne
        cnt = [0] * ne

        def fits(i: int, c: float, m: int) -> bool:
            return cnt[i] + 1 <= cap_n and cpu[i] + c <= cpu_cap and mem[i] + m <= mem_cap

        def load(i: int) -> float:
            return max(cpu[i] / cpu_cap, mem[i] / mem_cap)

        heap = [(0.0, i) for i in range(ne)]
        for kind, res in zip(kinds, residual_s, strict=True):
            c, m = cat.cpu[kind], cat.mem[kind]
            chosen = -1
            if self.policy == "least":
                aside = []
                while heap:
                    ld, i = heapq.heappop(heap)
                    if ld != load(i):
                        continue  # stale entry
                    if fits(i, c, m):
                        chosen = i
                        break
                    aside.append((ld, i))
                for item in aside:
                    heapq.heappush(heap, item)
            else:
                picks: list[int] = []
                for _ in range(64):
                    i = rng.randrange(ne)
                    if i not in picks and fits(i, c, m):
                        picks.append(i)
                        if len(picks) == (2 if self.policy == "p2" else 1):
                            break
                if picks:
                    chosen = min(picks, key=load)
            if chosen < 0:
                continue  # the fleet is full for this one: the steady state holds fewer
            cpu[chosen] += c
            mem[chosen] += m
            cnt[chosen] += 1
            if self.policy == "least":
                heapq.heappush(heap, (load(chosen), chosen))
            if res < horizon_s:
                self.at(res, self._departure(self.edges[chosen], c, m))
        for e, c, m, n in zip(self.edges, cpu, mem, cnt, strict=True):
            e.cpu, e.mem, e.n = c, m, n

    def _departure(self, e: Edge, c: float, m: int) -> Callable[[], None]:
        def go() -> None:
            e.cpu -= c
            e.mem -= m
            e.n -= 1
        return go

    # -- the watcher
    def room(self, e: Edge) -> Room:
        p = self.p
        return Room(p.cores, p.cpu_overcommit, p.memory_gib * 1024, p.memory_overcommit, p.max_sandboxes,
                    e.cpu, e.mem, e.n)

    def snapshot(self) -> dict[str, NodeStats]:
        p = self.p
        return {e.name: NodeStats(edge=e.name, healthy=True, backends=[Backend.container], cpus=p.cores,
                                  memory_mb=p.memory_gib * 1024, cpu_overcommit=p.cpu_overcommit,
                                  memory_overcommit=p.memory_overcommit, sandboxes=e.n, cpu_reserved=e.cpu,
                                  memory_reserved_mb=e.mem, max_sandboxes=p.max_sandboxes)
                for e in self.edges}

    def tick(self) -> None:
        view = self.snapshot()
        if self.p.view_lag_s > 0:
            self.at(self.now + self.p.view_lag_s, lambda: self._publish(view))
        else:
            self._publish(view)
        self.at(self.now + self.p.view_interval_s, self.tick)

    def _publish(self, view: dict[str, NodeStats]) -> None:
        self.view = view

    def loads(self) -> list[float]:
        return [self.room(e).load() for e in self.edges]

    # -- creations
    def arrive(self, burst: bool) -> None:
        c = Create(self.cat.draw(self.rng, 1)[0], self.now, burst, self._rr % self.p.replicas)
        self._rr += 1
        self.outstanding += 1
        self.enqueue(c, reply=False)

    def enqueue(self, c: Create, reply: bool) -> None:
        r = self.replicas[c.replica]
        r.queue.append((c, reply))
        r.enqueued.append(self.now)
        if not r.busy:
            self.serve(r)

    def serve(self, r: Replica) -> None:
        """The replica's CPU: one request at a time, in arrival order."""
        if not r.queue:
            r.busy = False
            return
        r.busy = True
        c, reply = r.queue.popleft()
        c.queue_s += self.now - r.enqueued.popleft()
        p = self.p
        if reply:
            cost = p.reply_ms / 1e3
            nxt = self._after_reply(c)
        else:
            cost = (p.req_ms / 1e3 if c.iteration == 0 else 0.0) + self.choose_s
            nxt = self._attempt(c)
            if c.cm is not None:
                cost += p.fwd_ms / 1e3
        c.cpu_s += cost
        r.busy_s += cost

        def done() -> None:
            nxt()
            self.serve(r)
        self.at(self.now + cost, done)

    def _attempt(self, c: Create) -> Callable[[], None]:
        """One turn of Apiserver._place's loop: choose, reserve, forward (or give up)."""
        c.iteration += 1
        pl = self.replicas[c.replica].placement
        args = self.cat.args[c.kind]
        try:
            name = pl.choose(args, exclude=c.tried)
        except AdmissionRejected:
            if c.refusals:
                return lambda: self.finish(c, "refused")
            if not c.refreshed and c.iteration < MAX_CREATE_ATTEMPTS:
                c.refreshed = True  # a replica's refresh reads the shared view: nothing newer until the tick
                return lambda: self.enqueue(c, reply=False)
            return lambda: self.finish(c, "no_room")
        c.edge = name
        c.cm = pl.reserve(name, args)
        c.cm.__enter__()
        c.attempts += 1
        return lambda: self.at(self.now + self.p.net_ms / 1e3, lambda: self.edge_create(c))

    def edge_create(self, c: Create) -> None:
        """The edge's admission, the real arithmetic on its exact reservations, then a create slot."""
        e = self.by_name[c.edge]
        args = self.cat.args[c.kind]
        if refusal(self.room(e), args) is not None:
            c.outcome = "refused"
            self.at(self.now + (self.p.edge_refuse_ms + self.p.net_ms) / 1e3, lambda: self.enqueue(c, reply=True))
            return
        e.cpu += self.cat.cpu[c.kind]
        e.mem += self.cat.mem[c.kind]
        e.n += 1
        if e.busy < self.p.edge_concurrency:
            self._start_slot(e, c)
        else:
            e.waiting.append(c)
            e.peak_waiting = max(e.peak_waiting, len(e.waiting))

    def _start_slot(self, e: Edge, c: Create) -> None:
        e.busy += 1
        svc = self.p.edge_create_ms / 1e3 * math.exp(self.rng.gauss(0.0, self.p.edge_create_sigma))
        self.at(self.now + svc, lambda: self._slot_done(e, c))

    def _slot_done(self, e: Edge, c: Create) -> None:
        e.busy -= 1
        if e.waiting:
            self._start_slot(e, e.waiting.popleft())
        c.outcome = "ok"
        life = math.exp(self.rng.gauss(self.p.life_mu, self.p.life_sigma))
        if life < 600:  # ends inside any window this model runs
            self.at(self.now + life, self._departure(e, self.cat.cpu[c.kind], self.cat.mem[c.kind]))
        self.at(self.now + self.p.net_ms / 1e3, lambda: self.enqueue(c, reply=True))

    def _after_reply(self, c: Create) -> Callable[[], None]:
        assert c.cm is not None
        cm, c.cm = c.cm, None
        if c.outcome == "ok":
            cm.__exit__(None, None, None)
            return lambda: self.finish(c, "ok")
        err = AdmissionRejected(f"edge {c.edge} refused")
        cm.__exit__(AdmissionRejected, err, None)  # the reservation is dropped, as when edge.create raises
        c.refusals += 1
        c.tried.add(c.edge)
        if c.iteration >= MAX_CREATE_ATTEMPTS:
            return lambda: self.finish(c, "refused")
        return lambda: self.enqueue(c, reply=False)

    def finish(self, c: Create, outcome: str) -> None:
        self.outstanding -= 1
        if not c.burst:
            return
        res = self.res
        res.creates += 1
        res.refusals += c.refusals
        res.attempts.append(c.attempts)
        res.cpu_ms.append(c.cpu_s * 1e3)
        res.queue_ms.append(c.queue_s * 1e3)
        if outcome == "ok":
            res.latencies_ms.append((self.now - c.arrived) * 1e3)
        elif outcome == "refused":
            res.failed_refused += 1
        else:
            res.failed_no_room += 1

    def arrivals(self, t0: float, t1: float | None, rate: float, count: int | None, burst: bool) -> None:
        """A Poisson stream of creations from t0: until t1, or ``count`` of them."""
        t, n = t0, 0
        times: list[float] = []
        while (t1 is None or t < t1) and (count is None or n < count):
            t += self.rng.expovariate(rate)
            times.append(t)
            n += 1
        self.arrivals_left += len(times)
        if burst:
            self.burst_left += len(times)
        for t in times:
            self.at(t, lambda: self._arrive_one(burst))

    def _arrive_one(self, burst: bool) -> None:
        self.arrivals_left -= 1
        if burst:
            self.burst_left -= 1
            if self.burst_left == 0:
                self.busy_at_last_burst = sum(r.busy_s for r in self.replicas)
                self.last_burst_at = self.now
        self.arrive(burst)


def policy_k(policy: str, edges: int) -> int:
    return {"p2": 2, "random": 1, "least": edges}[policy]


def measure_choose(p: Params, cat: Catalog, kinds: list[int], residual_s: list[float]) -> dict[str, float]:
    """The real Placement.choose, timed in-process on the steady-state view of all the edges:
    ms per call for each policy, the fastest of 15 interleaved batches of 20 (the batches least
    disturbed by other work on this machine). ``--choose-ms`` overrides."""
    sim = Sim(p, cat, "random", random.Random(p.seed))
    sim.fill(kinds, residual_s, 0.0)
    view = sim.snapshot()
    args = cat.args[0]
    pls = {pol: Placement(lambda: view, k=policy_k(pol, p.edges), rng=random.Random(p.seed))
           for pol in p.policies if pol not in p.choose_ms}
    best = {pol: math.inf for pol in pls}
    for _ in range(15):
        for pol, pl in pls.items():
            t0 = time.perf_counter()
            for _ in range(20):
                pl.choose(args, set())
            best[pol] = min(best[pol], (time.perf_counter() - t0) / 20 * 1e3)
    return {**best, **p.choose_ms}


def run_policy(p: Params, cat: Catalog, policy: str, kinds: list[int], residual_s: list[float],
               choose_ms: float) -> Result:
    t_wall = time.perf_counter()
    sim = Sim(p, cat, policy, random.Random(p.seed * 7919 + 17))
    burst_s = p.burst / p.rate
    horizon = p.warmup_s + burst_s * 3 + 10.0
    sim.fill(kinds, residual_s, horizon)
    sim.view = sim.snapshot()
    sim.choose_s = choose_ms / 1e3
    sim.res.choose_ms = choose_ms
    sim.at(p.view_interval_s * sim.rng.random(), sim.tick)
    bg_rate = p.background_rate
    sim.arrivals(0.0, p.warmup_s + burst_s, bg_rate, None, burst=False)
    sim.run_until(lambda: sim.now >= p.warmup_s)
    sim.res.load_before = sim.loads()
    busy0 = sum(r.busy_s for r in sim.replicas)
    sim.arrivals(p.warmup_s, None, p.rate, p.burst, burst=True)
    sim.run_until(lambda: sim.arrivals_left == 0 and sim.outstanding == 0)
    sim.res.load_after = sim.loads()
    span = max(sim.last_burst_at - p.warmup_s, 1e-9)
    sim.res.replica_util = (sim.busy_at_last_burst - busy0) / span / p.replicas
    sim.res.peak_edge_waiting = max(e.peak_waiting for e in sim.edges)
    sim.res.wall_s = time.perf_counter() - t_wall
    return sim.res


# ---- the replicas alone, for the sweeps ---------------------------------------------------------
def replica_queue(p: Params, res: Result, rate: float, replicas: int, creates: int,
                  seed: int) -> tuple[float, int]:
    """Replay the replicas' CPU queues only: Poisson arrivals at ``rate`` (plus the background),
    round-robin over ``replicas``, each create costing what one of the main run's creates cost
    (its attempts, each followed by the edge's answer). Returns (p99 wait at a replica, ms;
    the backlog still queued when the last arrival came, creates)."""
    rng = random.Random(seed)
    req, fwd, rep, ch = p.req_ms / 1e3, p.fwd_ms / 1e3, p.reply_ms / 1e3, res.choose_ms / 1e3
    attempts = res.attempts or [1]
    total = rate + p.background_rate
    heap: list[tuple[float, int, int, int, int]] = []  # (time, seq, create id, job, jobs in all)
    free = [0.0] * replicas
    waits: list[float] = []
    t, seq = 0.0, 0
    for i in range(creates):
        t += rng.expovariate(total)
        seq += 1
        heapq.heappush(heap, (t, seq, i, 0, 2 * max(1, rng.choice(attempts))))
    last_arrival = t
    backlog = 0
    while heap:
        at, _, i, job, jobs = heapq.heappop(heap)
        r = i % replicas
        start = max(at, free[r])
        waits.append(start - at)
        attempt = job % 2 == 0
        cost = (ch + fwd + (req if job == 0 else 0.0)) if attempt else rep
        free[r] = start + cost
        if at <= last_arrival < start:
            backlog += 1
        if job + 1 < jobs:  # an attempt's answer comes back after the edge: created, or refused
            edge_s = (p.edge_create_ms if job + 2 == jobs else p.edge_refuse_ms) / 1e3 if attempt else 0.0
            seq += 1
            heapq.heappush(heap, (free[r] + edge_s, seq, i, job + 1, jobs))
    waits.sort()
    return waits[int(0.99 * (len(waits) - 1))] * 1e3, backlog


def cpu_per_create_ms(p: Params, res: Result) -> float:
    return statistics.fmean(res.cpu_ms) if res.cpu_ms else p.req_ms + p.fwd_ms + p.reply_ms + res.choose_ms


def replicas_needed(p: Params, res: Result, rate: float) -> tuple[int, int]:
    """(fewest replicas with utilization < 1, fewest whose p99 wait stays within the SLO)."""
    cpu_s = cpu_per_create_ms(p, res) / 1e3
    n_min = max(1, math.ceil((rate + p.background_rate) * cpu_s + 1e-9))
    n = n_min
    while n < 4 * n_min + 8:
        wait, _ = replica_queue(p, res, rate, n, p.sweep_creates, p.seed)
        if wait <= p.slo_wait_ms:
            break
        n += 1
    return n_min, n


def saturation(p: Params, res: Result) -> list[tuple[float, float, float, int]]:
    """Raise the rate, with the run's replica count, until the replicas cannot keep up (a
    backlog builds: p99 wait over 100 ms). Rows: (rate, utilization, p99 wait ms, backlog)."""
    cpu_s = cpu_per_create_ms(p, res) / 1e3
    rows = []
    rate = p.rate
    for _ in range(40):
        util = (rate + p.background_rate) * cpu_s / p.replicas
        wait, backlog = replica_queue(p, res, rate, p.replicas, p.sweep_creates, p.seed)
        rows.append((rate, util, wait, backlog))
        if wait > 100.0:
            break
        rate += 500.0
    return rows


# ---- report -------------------------------------------------------------------------------------
def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


def imbalance(loads: list[float]) -> tuple[float, float, float]:
    mean = statistics.fmean(loads)
    return mean, max(loads) / mean, statistics.pstdev(loads)


def parse() -> Params:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    a = ap.add_argument
    a("--edges", type=int, default=160)
    a("--cores", type=int, default=192, help="per node")
    a("--memory-gib", type=int, default=2048, help="per node")
    a("--cpu-overcommit", type=float, default=8.0, help="dsec edge default")
    a("--memory-overcommit", type=float, default=1.5, help="dsec edge default")
    a("--max-sandboxes", type=int, default=4096, help="dsec edge default")
    a("--steady", type=int, default=380_000, help="sandboxes alive in the steady state")
    a("--life-median-min", type=float, default=10.0, help="lognormal sandbox lifetime: median")
    a("--life-p99-h", type=float, default=3.5, help="lognormal sandbox lifetime: p99")
    a("--burst", type=int, default=10_000, help="creations in the burst (DSec: 32000; see the docs for why less)")
    a("--rate", type=float, default=5000.0, help="burst creations per second (Poisson)")
    a("--warmup-s", type=float, default=3.0, help="steady-state churn simulated before the burst")
    a("--replicas", type=int, default=16, help="apiserver replicas")
    a("--req-ms", type=float, default=0.7, help="replica CPU to take a create request in (HTTP, parse), once")
    a("--fwd-ms", type=float, default=0.4, help="replica CPU to forward one attempt to an edge")
    a("--reply-ms", type=float, default=0.4, help="replica CPU to read an edge's answer and reply")
    a("--choose-ms", default="", help="Placement.choose CPU per call, e.g. p2=0.6,least=1.0 (default: measured "
      "here, in-process, on the model's 160-edge view)")
    a("--edge-create-ms", type=float, default=40.0, help="an edge's create, median wall time")
    a("--edge-create-sigma", type=float, default=0.35, help="its lognormal spread")
    a("--edge-concurrency", type=int, default=32, help="creates an edge builds at once (the rest queue)")
    a("--edge-refuse-ms", type=float, default=0.5, help="an edge's time to refuse")
    a("--net-ms", type=float, default=0.1, help="one-way network latency")
    a("--view-interval-s", type=float, default=1.0, help="watcher snapshot period")
    a("--view-lag-s", type=float, default=0.0, help="extra age of a snapshot when replicas get it")
    a("--slo-wait-ms", type=float, default=10.0, help="p99 replica queueing a replica count must keep")
    a("--sweep-creates", type=int, default=16_000, help="creations per step of the replica sweeps")
    a("--policies", default="p2,random,least", help=f"comma-separated, of {','.join(POLICIES)}")
    a("--seed", type=int, default=1)
    a("--db-ms", type=float, default=0.0, help="the database's CPU per create (its own cores; not modelled as a "
      "queue: reported as the cores it needs)")
    a("--controller-ms", type=float, default=0.0, help="the controller's CPU per create (likewise)")
    a("--measured", help="bench/scale.py --json output: its 1-replica row sets the replica's CPU per create "
      "(as --req-ms, less --fwd-ms and --reply-ms), --db-ms and --controller-ms, and the run is compared with it")
    ns = ap.parse_args()
    measured = None
    if ns.measured:
        import json
        with open(ns.measured) as f:
            measured = json.load(f)
        row = next(r for r in measured["sustained"] if r["replicas"] == 1)
        cpu = row["cpu_ms_per_create"]
        ns.req_ms = max(0.1, cpu["replicas"] - ns.fwd_ms - ns.reply_ms)
        ns.db_ms, ns.controller_ms = cpu["postgresql"], cpu["controller"]
        ns.edges = measured["args"]["edges"]
    pols = tuple(x.strip() for x in ns.policies.split(",") if x.strip())
    for x in pols:
        if x not in POLICIES:
            ap.error(f"unknown policy {x!r}")
    choose_ms: dict[str, float] = {}
    for item in (x.strip() for x in ns.choose_ms.split(",") if x.strip()):
        pol, _, ms = item.partition("=")
        if pol not in POLICIES:
            ap.error(f"--choose-ms: unknown policy {pol!r}")
        choose_ms[pol] = float(ms)
    return Params(ns.edges, ns.cores, ns.memory_gib, ns.cpu_overcommit, ns.memory_overcommit, ns.max_sandboxes,
                  ns.steady, ns.life_median_min, ns.life_p99_h, ns.burst, ns.rate, ns.warmup_s, ns.replicas,
                  ns.req_ms, ns.fwd_ms, ns.reply_ms, choose_ms, ns.edge_create_ms, ns.edge_create_sigma,
                  ns.edge_concurrency, ns.edge_refuse_ms, ns.net_ms, ns.view_interval_s, ns.view_lag_s,
                  ns.slo_wait_ms, ns.sweep_creates, pols, ns.seed, ns.db_ms, ns.controller_ms, measured)


def main() -> None:
    p = parse()
    t0 = time.perf_counter()
    cat = Catalog()
    rng = random.Random(p.seed)
    kinds = cat.draw(rng, p.steady)
    # the remaining lifetime of a sandbox alive in the steady state: length-biased lifetime
    # (lognormal(mu + sigma^2, sigma)) times a uniform share of it
    residual = [rng.random() * math.exp(rng.gauss(p.life_mu + p.life_sigma ** 2, p.life_sigma))
                for _ in range(p.steady)]
    mc, mm = cat.mean()
    print(f"model: {p.edges} edges x {p.cores} cores, {p.memory_gib} GiB (overcommit cpu {p.cpu_overcommit:g}, "
          f"memory {p.memory_overcommit:g}, max {p.max_sandboxes} sandboxes); {p.steady} sandboxes in steady state, "
          f"lifetime lognormal p50 {p.life_median_min:g} min, p99 {p.life_p99_h:g} h, mean "
          f"{p.life_mean_s / 60:.1f} min -> background {p.background_rate:.0f} creates/s")
    per_edge = p.steady / p.edges
    print(f"mix: mean admitted {mc:.3f} cores, {mm:.0f} MiB per sandbox -> steady state at "
          f"{per_edge * mc / p.cpu_cap:.0%} of schedulable CPU, {per_edge * mm / p.memory_cap_mb:.0%}"
          f" of admissible memory; burst {p.burst} at {p.rate:g}/s ({p.burst / p.rate:.1f} s) adds "
          f"{p.burst / p.steady:.1%}")
    print(f"replicas: {p.replicas}, each one CPU: {p.req_ms:g} ms per create + ({p.fwd_ms:g} + choose + "
          f"{p.reply_ms:g}) ms per attempt; view every {p.view_interval_s:g} s (+{p.view_lag_s:g} s lag); edge create "
          f"{p.edge_create_ms:g} ms median, {p.edge_concurrency} at once per edge")
    choose = measure_choose(p, cat, kinds, residual)
    print("Placement.choose() per call, " + ", ".join(
        f"{POLICIES[pol]} {choose[pol]:.2f} ms{'' if pol in p.choose_ms else ' (measured)'}" for pol in p.policies))
    results = [run_policy(p, cat, pol, kinds, residual, choose[pol]) for pol in p.policies]

    print()
    hdr = ("| policy | choose() ms | replica CPU ms/create | edge refusals/create | failed: refused, "
           "tries out | failed: no room in view | create p50 ms | create p99 ms | replica wait p99 ms | load mean | "
           f"load max/mean | load stddev | edge queue peak | replica util | replicas for {p.rate:g}/s: util<1 / "
           f"p99 wait<={p.slo_wait_ms:g} ms |")
    print(hdr)
    print("|" + "---|" * hdr.count(" | ") + "---|")
    for r in results:
        mean, mx, sd = imbalance(r.load_after)
        n_min, n_slo = replicas_needed(p, r, p.rate)
        print(f"| {POLICIES[r.policy]} | {r.choose_ms:.2f} | {cpu_per_create_ms(p, r):.2f} | "
              f"{r.refusals / max(1, r.creates):.4f} | {r.failed_refused} | {r.failed_no_room} | "
              f"{pct(r.latencies_ms, 50):.1f} | {pct(r.latencies_ms, 99):.1f} | {pct(r.queue_ms, 99):.2f} | "
              f"{mean:.3f} | {mx:.3f} | {sd:.4f} | {r.peak_edge_waiting} | {r.replica_util:.0%} | "
              f"{n_min} / {n_slo} |")
    print()
    for r in results:
        mean, mx, sd = imbalance(r.load_before)
        print(f"{POLICIES[r.policy]}: {r.creates} burst creates; load before the burst mean {mean:.3f}, max/mean "
              f"{mx:.3f}, stddev {sd:.4f}; simulated in {r.wall_s:.1f} s")

    print()
    base = results[0]
    print(f"saturation ({POLICIES[base.policy]}, {p.replicas} replicas, {cpu_per_create_ms(p, base):.2f} ms CPU per "
          f"create, {p.sweep_creates} creates per step, replica queues replayed):")
    print("| burst rate /s | replica utilization | p99 wait at a replica ms | backlog at last arrival |")
    print("|---|---|---|---|")
    for rate, util, wait, backlog in saturation(p, base):
        print(f"| {rate:.0f} | {util:.0%} | {wait:.1f} | {backlog} |")
    per = 1e3 / cpu_per_create_ms(p, base)
    print(f"one replica saturates at ~{per:.0f} creates/s; {p.replicas} at ~{p.replicas * per:.0f}/s "
          f"(less the {p.background_rate:.0f}/s background)")
    control = cpu_per_create_ms(p, base) + p.db_ms + p.controller_ms
    print(f"control plane per create: replica {cpu_per_create_ms(p, base):.2f} + database {p.db_ms:.2f} + controller "
          f"{p.controller_ms:.2f} = {control:.2f} ms CPU: {p.rate:g} creations/s need {p.rate * control / 1e3:.1f} "
          f"cores ({p.rate * p.db_ms / 1e3:.1f} of them the database's)")
    if p.measured:
        rows = {r["replicas"]: r for r in p.measured["sustained"]}
        one = rows[1]
        whole = sum(one["cpu_ms_per_create"].values())
        cores = p.measured.get("cores") or os.cpu_count() or 1
        print(f"measured (bench/scale.py, {p.edges} hollow edges, one machine of {cores} cores shared by every "
              f"component): {one['creations_per_s']}/s with one replica; every component together spent "
              f"{whole:.1f} ms CPU per create, so this machine's ceiling is {cores * 1e3 / whole:.0f}/s; the "
              f"model's replica alone would saturate at {per:.0f}/s. With replicas 1 -> "
              + ", ".join(f"{n}: {r['creations_per_s']}/s" for n, r in sorted(rows.items()))
              + ": on one machine more replicas only add their own overhead; the model's linear scaling "
              "assumes each replica its own cores, and a database with cores to spare")
    print(f"\ntotal {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
