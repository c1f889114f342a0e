"""``dsec top``: a live terminal view of the fleet, like ``top`` for dsec (docs/console.md).

Every ``--interval`` seconds it reads what the web console reads (``client.console``), all
scoped to the token's project: the fleet overview (each edge's load and health, the
sandboxes by state, the newest history sample), the busiest running sandboxes by CPU or
memory, the jobs and the newest batches. A sandbox's CPU % is the difference of its CPU
time between two polls over the time between them (% of one core, as ``top`` shows it);
the first frame, with one poll behind it, shows CPU time instead.

In a terminal it redraws on the alternate screen until Ctrl-C; piped, it prints a frame
per poll; ``--once`` prints one frame (two polls apart, so CPU % is there) and exits.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Annotated

import typer
from rich.console import Group, RenderableType
from rich.live import Live
from rich.markup import escape
from rich.table import Column, Table
from rich.text import Text

from dsec.client.cli.common import TokenOpt, UrlOpt, _errors, console, interruptible
from dsec.client.sdk.client import AsyncClient
from dsec.shared.errors import DeadlineExceeded, EdgeUnavailable
from dsec.shared.wire.batches import BatchInfo
from dsec.shared.wire.console import MAX_PAGE, FleetOverview, FleetSample, SandboxPage
from dsec.shared.wire.jobs import JobInfo
from dsec.shared.wire.models import SandboxInfo
from dsec.shared.wire.nodes import NodeInfo

MIB = 1 << 20
JOBS_SHOWN = 10
BATCHES_PER_JOB = 2
# sorting by CPU: the edges rank by CPU time used so far, which is not CPU in use now, so a
# wider page than shown is read and ranked here by CPU % between polls
CPU_WINDOW = 3
# a sandbox not seen for this long is forgotten (its next CPU % starts over)
FORGET_S = 120.0
_HEALTH = {"ok": "green", "suspect": "yellow", "cordoned": "red"}
_STATE = {"up": "green", "unreachable": "red", "lost": "red"}
_STATE_ORDER = ("running", "creating", "restoring", "paused", "stopping", "stopped", "failed")


class SortBy(StrEnum):
    cpu = "cpu"
    memory = "memory"


# ---- CPU % between polls ------------------------------------------------------------------


def cpu_pct(before_s: float, after_s: float, seconds: float) -> float | None:
    """CPU % of one core over ``seconds``, from two reads of a sandbox's CPU time (None: no
    time passed, or the counter went back: the sandbox was restored elsewhere)."""
    if seconds <= 0 or after_s < before_s:
        return None
    return 100.0 * (after_s - before_s) / seconds


class CpuRates:
    """Each sandbox's CPU time at the poll that last saw it; ``update`` gives the CPU % of
    those seen at two polls."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[float, float]] = {}  # sandbox id -> (cpu_s, monotonic time)

    def update(self, items: Iterable[SandboxInfo], at: float) -> dict[str, float]:
        rates: dict[str, float] = {}
        for i in items:
            if i.usage is None:
                continue
            prev = self._seen.get(i.sandbox_id)
            if prev is not None and (pct := cpu_pct(prev[0], i.usage.cpu_s, at - prev[1])) is not None:
                rates[i.sandbox_id] = pct
            self._seen[i.sandbox_id] = (i.usage.cpu_s, at)
        self._seen = {k: v for k, v in self._seen.items() if at - v[1] < FORGET_S}
        return rates


# ---- polling -----------------------------------------------------------------------------


@dataclass
class Options:
    interval: float = 2.0
    sort: SortBy = SortBy.cpu
    limit: int = 15
    job: str | None = None
    project: str | None = None

    @property
    def filtered(self) -> bool:
        return self.job is not None or self.project is not None


@dataclass
class View:
    """What one frame shows: the newest answers, the CPU % between the last two polls, and
    the error of the poll that failed since (the frame then shows older answers)."""

    opts: Options
    url: str
    fleet: FleetOverview | None = None
    counts: SandboxPage | None = None  # the caller's sandboxes (within --job/--project) by state and job
    busiest: SandboxPage | None = None
    jobs: list[JobInfo] = field(default_factory=list)
    batches: list[BatchInfo] = field(default_factory=list)
    sample: FleetSample | None = None  # the newest history sample
    rates: dict[str, float] = field(default_factory=dict)
    polled_at: float = 0.0  # time.time() of the last poll that answered
    error: str | None = None
    _cpu: CpuRates = field(default_factory=CpuRates)

    async def poll(self, c: AsyncClient) -> None:
        """One poll of everything, concurrently; raises what the SDK raises."""
        o = self.opts
        window = min(MAX_PAGE, max(o.limit * CPU_WINDOW, 30)) if o.sort == SortBy.cpu else o.limit
        since = self.sample.at if self.sample else 0.0
        fleet, busiest, jobs, batches, counts = await asyncio.gather(
            c.console.fleet(since),
            c.console.sandboxes(state=["running"], job=o.job, project=o.project, limit=window,
                                sort="-cpu" if o.sort == SortBy.cpu else "-memory", usage=True),
            c.jobs(project=o.project),
            c.console.batches(job=o.job, limit=10),
            c.console.sandboxes(job=o.job, project=o.project, limit=0) if o.filtered else _none())
        at = time.monotonic()
        self.fleet, self.busiest, self.counts = fleet, busiest, counts or fleet.sandboxes
        self.jobs = [j for j in jobs if o.job is None or j.name == o.job]
        self.batches = [b for b in batches if o.project is None or b.project == o.project]
        if fleet.history.samples:
            self.sample = max(fleet.history.samples, key=lambda s: s.at)
        self.rates = self._cpu.update(busiest.items, at)
        self.polled_at = time.time()
        self.error = None

    def busiest_items(self) -> list[SandboxInfo]:
        """The ``limit`` busiest: by CPU % once two polls saw them (else by CPU time), or by memory."""
        items = list(self.busiest.items) if self.busiest else []
        if self.opts.sort == SortBy.cpu and self.rates:
            items.sort(key=lambda i: (self.rates.get(i.sandbox_id, -1.0), i.usage.cpu_s if i.usage else 0.0),
                       reverse=True)
        return items[:self.opts.limit]


async def _none() -> None:
    return None


# ---- formatting --------------------------------------------------------------------------


def _size(n: float) -> str:
    """Bytes, short: 512K, 37M, 1.2G, 3.4T."""
    for unit, scale in (("T", 1 << 40), ("G", 1 << 30), ("M", MIB), ("K", 1 << 10)):
        if n >= scale:
            v = n / scale
            return f"{v:.1f}{unit}" if v < 10 and unit in ("G", "T") else f"{v:.0f}{unit}"
    return f"{n:.0f}"


def _rate(per_s: float) -> str:
    return "0" if not per_s else f"{per_s:.0f}" if per_s >= 10 else f"{per_s:.1f}" if per_s >= 1 else f"{per_s:.2f}"


def _used(used: float, total: float) -> str:
    return f"{_size(used)}/{_size(total)}" if total else "-"


def _age(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _level(pct: float) -> str:
    return "red" if pct >= 90 else "yellow" if pct >= 70 else "green"


def _bar(pct: float | None, width: int = 10) -> Text:
    """A bar of ``width`` cells filled to ``pct`` (eighths of a cell), then the number."""
    if pct is None:
        return Text("-", style="dim")
    p = max(0.0, min(100.0, pct))
    eighths = round(p / 100 * width * 8)
    full, part = divmod(eighths, 8)
    bar = "█" * full + (" ▏▎▍▌▋▊▉"[part] if part else "")
    return Text.assemble((bar.ljust(width), _level(p)), (f" {pct:3.0f}%", ""))


def _by_state(counts: dict[str, int]) -> str:
    order = [s for s in _STATE_ORDER if counts.get(s)] + sorted(s for s in counts if s not in _STATE_ORDER)
    return ", ".join(f"{counts[s]} {s}" for s in order if counts[s]) or "none"


# ---- the frame ---------------------------------------------------------------------------


def _header(v: View) -> list[Text]:
    """The header's lines: what is watched, the edges and their load, the sandboxes, and
    (when there are any) edges that did not answer and the error of the last poll."""
    o = v.opts
    title = Text.assemble(("dsec top", "bold"), f"  {v.url}  {datetime.datetime.now():%H:%M:%S}  every "
                          f"{o.interval:g}s, busiest by {o.sort.value}")
    if o.job:
        title.append(f", job {o.job}")
    if o.project:
        title.append(f", project {o.project}")
    fleet = v.fleet
    if fleet is None:
        return [title]
    up = sum(1 for n in fleet.nodes if n.state == "up")
    cordoned = sum(1 for n in fleet.nodes if n.cordoned)
    load = Text("edges ")
    load.append(f"{up}/{len(fleet.nodes)} up", style="green" if up == len(fleet.nodes) else "red")
    if cordoned:
        load.append(f" ({cordoned} cordoned)", style="red")
    # the edges' load as the Edges table shows it (a history sample is up to its interval older)
    s = v.sample
    hosts = [n.host for n in fleet.nodes if n.host is not None]
    total = sum(h.memory_total_mb for h in hosts)
    if hosts:
        cpu = sum(h.cpu_pct for h in hosts) / len(hosts)
        mem = 100 * sum(h.memory_total_mb - h.memory_available_mb for h in hosts) / total if total else 0.0
    else:
        cpu, mem = (s.cpu_pct, s.memory_pct) if s else (0.0, 0.0)
    load.append("  CPU ")
    load.append(f"{cpu:.0f}%", style=_level(cpu))
    load.append("  memory ")
    load.append(f"{mem:.0f}%", style=_level(mem))
    if s is not None:
        load.append(f"  │  creates {_rate(s.creates_per_s)}/s")
        if s.create_ms is not None:
            load.append(f", mean {s.create_ms:.0f} ms")
        if s.create_failures_per_s:
            load.append(f", {_rate(s.create_failures_per_s)}/s failed", style="red")
        if s.refusals_per_s:
            load.append(f", {_rate(s.refusals_per_s)}/s refused", style="yellow")
    counts = v.counts or fleet.sandboxes
    lines = [title, load, Text(f"sandboxes {counts.total}: {_by_state(counts.states)}")]
    unreachable = sorted(set((v.busiest.unreachable if v.busiest else []) + counts.unreachable))
    if unreachable:
        lines.append(Text(f"not answering (their sandboxes are missing): {', '.join(unreachable)}", style="red"))
    if v.error:
        ago = time.time() - v.polled_at
        lines.append(Text(f"{v.error} (the answers of {ago:.0f}s ago; retrying)", style="red"))
    for line in lines:
        line.no_wrap, line.overflow = True, "ellipsis"
    return lines


def _table(title: str, *columns: Column | str) -> Table:
    return Table(*columns, title=title, title_justify="left", title_style="bold", expand=True, box=None,
                 pad_edge=False, header_style="bold cyan", caption_justify="left", caption_style="dim")


def _edge_row(n: NodeInfo) -> list[RenderableType]:
    h, s = n.host, n.signals
    health = Text(n.health, style=_HEALTH.get(n.health, ""))
    why = n.health_reason
    if n.cordoned_by and n.cordoned_by != "detector":
        why = f"by {n.cordoned_by}: {why}"
    mem = _used((h.memory_total_mb - h.memory_available_mb) * MIB, h.memory_total_mb * MIB) if h else "-"
    swap = _used((h.swap_total_mb - h.swap_free_mb) * MIB, h.swap_total_mb * MIB) if h else "-"
    disk = _used(s.disk_used_bytes, s.disk_total_bytes) if s else "-"
    full = n.max_sandboxes and n.sandboxes >= n.max_sandboxes
    boxes = Text(f"{n.sandboxes}/{n.max_sandboxes}", style="red" if full else "")
    return [n.edge, Text(n.state, style=_STATE.get(n.state, "")), health, _bar(h.cpu_pct if h else None),
            f"{h.load1:.2f}" if h else "-", mem, swap, disk, boxes, escape(why)]


def _edges(v: View, rows: int | None) -> Table:
    """Every edge by name; past ``rows``, those in trouble and then the busiest."""
    t = _table("Edges", Column("EDGE", no_wrap=True), Column("STATE", no_wrap=True), Column("HEALTH", no_wrap=True),
               Column("CPU", no_wrap=True, min_width=15), Column("LOAD", justify="right"),
               Column("MEMORY", justify="right"), Column("SWAP", justify="right"), Column("DISK", justify="right"),
               Column("SANDBOXES", justify="right"), Column("WHY", overflow="ellipsis", no_wrap=True, ratio=1))
    nodes = list(v.fleet.nodes) if v.fleet else []
    shown = nodes
    if rows is not None and len(nodes) > rows:
        ranked = sorted(nodes, key=lambda n: (n.state == "up" and n.health == "ok",
                                              -(n.host.cpu_pct if n.host else 0.0)))
        keep = {n.edge for n in ranked[:max(1, rows - 1)]}
        shown = [n for n in nodes if n.edge in keep]
        trouble = sum(1 for n in nodes if n.edge not in keep and not (n.state == "up" and n.health == "ok"))
        t.caption = f"and {len(nodes) - len(shown)} more" + (f", {trouble} of them not up and ok" if trouble else "")
    for n in shown:
        t.add_row(*_edge_row(n))
    if not nodes:
        t.add_row(Text("no edges", style="dim"))
    return t


def _batch(b: BatchInfo) -> Text:
    c = b.counts
    done = c.running + c.failed + c.cancelled
    t = Text(f"{b.id[:8]} {done}/{b.n} {b.state}")
    if c.failed:
        reasons = ", ".join(f"{k} {n}" for k, n in b.failure_reasons.items())
        t.append(f", {c.failed} failed" + (f": {reasons}" if reasons else ""), style="red")
    return t


def _batches(items: Sequence[BatchInfo]) -> Text:
    return Text("; ").join(_batch(b) for b in items[:BATCHES_PER_JOB]) if items else Text("-", style="dim")


def _job_rows(v: View) -> list[list[RenderableType]]:
    """A row per job that holds sandboxes, is not stopped, or has a batch running; the most
    sandboxes first. Batches of no job come last."""
    counts = v.counts or (v.fleet.sandboxes if v.fleet else None)
    per_job = counts.jobs if counts else {}
    batches: dict[str | None, list[BatchInfo]] = {}
    for b in sorted(v.batches, key=lambda b: -b.created_at):
        batches.setdefault(b.job, []).append(b)
    rows: list[tuple[int, list[RenderableType]]] = []
    for j in v.jobs:
        live = per_job.get(j.name, {})
        if j.state == "stopped" and not live and not any(b.state == "running" for b in batches.get(j.name, [])):
            continue
        state = Text(j.state, style={"active": "green", "paused": "yellow"}.get(j.state, "dim"))
        rows.append((sum(live.values()), [j.name, j.project, state, _by_state(live) if live else "-",
                                          _batches(batches.get(j.name, []))]))
    known = {j.name for j in v.jobs}
    for name, live in per_job.items():  # sandboxes labelled with a job that has no record here
        if name not in known:
            rows.append((sum(live.values()), [name, "-", "-", _by_state(live), _batches(batches.get(name, []))]))
    if batches.get(None):
        rows.append((-1, [Text("(no job)", style="dim"), "", "", "", _batches(batches[None])]))
    rows.sort(key=lambda r: -r[0])
    return [r for _, r in rows]


def _jobs(v: View, rows: int | None) -> Table:
    t = _table("Jobs", Column("JOB", no_wrap=True), Column("PROJECT", no_wrap=True), Column("STATE", no_wrap=True),
               Column("SANDBOXES", no_wrap=True),
               Column("NEWEST BATCHES", overflow="ellipsis", no_wrap=True, ratio=1))
    all_rows = _job_rows(v)
    cap = JOBS_SHOWN if rows is None else min(JOBS_SHOWN, rows)
    if len(all_rows) > cap:
        cap = max(1, cap - (rows is not None))  # the caption takes a line of the budget
        t.caption = f"and {len(all_rows) - cap} more"
    for row in all_rows[:cap]:
        t.add_row(*row)
    if not all_rows:
        t.add_row(Text("no jobs", style="dim"))
    return t


def _busiest(v: View, rows: int | None) -> Table:
    first = not v.rates  # one poll so far: CPU time, not CPU %
    page = v.busiest
    items = v.busiest_items()[:rows]
    title = f"Busiest sandboxes (by {v.opts.sort.value}"
    title += f", {len(items)} of {page.total} running)" if page else ")"
    t = _table(title, Column("SANDBOX", no_wrap=True), Column("CPU TIME" if first else "CPU %", justify="right"),
               Column("MEMORY", justify="right"), Column("SWAP", justify="right"), Column("PIDS", justify="right"),
               Column("JOB", no_wrap=True, overflow="ellipsis", max_width=24), Column("EDGE", no_wrap=True),
               Column("IMAGE", no_wrap=True, overflow="ellipsis", ratio=1), Column("AGE", justify="right"))
    now = time.time()
    for i in items:
        u = i.usage
        if u is None:
            cpu: RenderableType = "-"
        elif first:
            cpu = f"{u.cpu_s:.1f}s"
        else:
            pct = v.rates.get(i.sandbox_id)
            cpu = Text(f"{pct:.0f}%", style=_level(pct / max(i.cpu_cores_limit, 0.01))) if pct is not None else "-"
        mem = f"{_size(u.memory_bytes)}/{_size(i.memory_limit_mb * MIB)}" if u else f"-/{i.memory_limit_mb}M"
        t.add_row(i.sandbox_id, cpu, mem, _size(u.swap_bytes) if u else "-", str(u.pids) if u else "-",
                  escape(i.job or ""), i.edge, escape(i.image), _age(now - i.created_at))
    if not items:
        t.add_row(Text("no running sandboxes", style="dim"))
    return t


def render(v: View, height: int | None = None) -> RenderableType:
    """The frame; given the terminal's ``height``, its tables are cut to fit: the busiest
    sandboxes first, then the edges, then the jobs (each keeps three rows at least)."""
    header = _header(v)
    if height is None:
        caps: tuple[int | None, int | None, int | None] = (None, None, None)
    else:
        free = height - len(header) - 3 - 3 * 2  # three blank lines; a title and a heading per table
        want_b = max(1, min(v.opts.limit, len(v.busiest.items) if v.busiest else 1))
        want_e = max(1, len(v.fleet.nodes) if v.fleet else 1)
        want_j = max(1, min(JOBS_SHOWN, len(_job_rows(v))))
        least_e, least_j = min(want_e, 3), min(want_j, 3)
        b = min(want_b, max(3, free - least_e - least_j))
        e = min(want_e, max(least_e, free - b - least_j))
        j = max(1, min(want_j, free - b - e))
        caps = (e, j, b)
    return Group(*header, Text(""), _edges(v, caps[0]), Text(""), _jobs(v, caps[1]), Text(""), _busiest(v, caps[2]))


# ---- the command -------------------------------------------------------------------------


async def _main(url: str | None, token: str | None, opts: Options, once: bool) -> None:
    async with AsyncClient(url=url, token=token, timeout=max(10.0, 5 * opts.interval)) as c:
        v = View(opts, c.url)
        await v.poll(c)  # the first poll's error ends it (a wrong URL or token says so at once)
        if once:
            await asyncio.sleep(opts.interval)
            await v.poll(c)
            console.print(render(v))
            return
        if not console.is_terminal:  # piped: a frame per poll, one after another
            while True:
                console.print(render(v))
                console.print()
                await _next(c, v)
        with Live(render(v, console.height), console=console, screen=True, auto_refresh=False, redirect_stdout=False,
                  redirect_stderr=False, vertical_overflow="crop") as live:
            while True:
                await _next(c, v)
                live.update(render(v, console.height), refresh=True)


async def _next(c: AsyncClient, v: View) -> None:
    """Wait out the interval, then poll; an apiserver that stopped answering is said in
    the frame and tried again at the next interval (any other error ends ``dsec top``)."""
    await asyncio.sleep(v.opts.interval)
    try:
        await v.poll(c)
    except (EdgeUnavailable, DeadlineExceeded) as e:
        v.error = e.message


def top(interval: Annotated[float, typer.Option(min=0.2, help="seconds between polls")] = 2.0,
        sort: Annotated[SortBy, typer.Option(help="busiest by CPU in use or by memory")] = SortBy.cpu,
        limit: Annotated[int, typer.Option(min=1, max=MAX_PAGE, help="how many of the busiest")] = 15,
        job: Annotated[str | None, typer.Option(help="only this job's sandboxes, job and batches")] = None,
        project: Annotated[str | None, typer.Option(help="only this project's")] = None,
        once: Annotated[bool, typer.Option("--once", help="print one frame (two polls --interval apart, so "
                                           "CPU % is there) and exit")] = False,
        url: UrlOpt = None, token: TokenOpt = None) -> None:
    """A live view of the fleet, like top: edges with their load, jobs with their newest
    batches, and the busiest running sandboxes (CPU % between polls). Ctrl-C quits."""
    opts = Options(interval=interval, sort=sort, limit=limit, job=job, project=project)
    interruptible(exit_code=0)  # Ctrl-C: the way out, within a second
    with _errors():
        try:
            asyncio.run(_main(url, token, opts, once))
        except KeyboardInterrupt:
            pass
