"""Fleet fault detection at the default settings (docs/fault-tolerance.md): how long the
detector takes from a fault's start to ``suspect`` and to ``cordoned``, for each fault the
tests inject (slow creates, failing shared-store reads, a full disk, an edge that stops
answering), median of repeats; and false positives over an idle run of the fleet. Three
edge daemons over a MooseFS store behind one apiserver, on this machine (the fleet of
tests/test_health_fleet.py).

    .venv/bin/python bench/health.py --write docs/benchmarks.md [--idle-s 600 --repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from container import report  # noqa: E402

import dsec  # noqa: E402
from tests.conftest import TOKEN, Cluster  # noqa: E402
from tests.test_health_fleet import NAMES, fill_disk, inject, run_fleet  # noqa: E402

JOB = "bench-health"


async def _health(c: dsec.AsyncClient, edge: str) -> str:
    return (await c.nodes.get(edge)).health


async def _creates(c: dsec.AsyncClient, n: int) -> None:
    """``n`` creates one at a time (kept, so placement spreads them); failures are the fault's."""
    for _ in range(n):
        try:
            await c.run_container(dsec.ContainerArgs(image="base/busybox", job=JOB))
        except dsec.DsecError:
            pass


async def detect(c: dsec.AsyncClient, edge: str, start: Callable[[], None],
                 drive: Callable[[], Awaitable[None]] | None, timeout: float = 180.0) -> tuple[float, float]:
    """Seconds from ``start()`` to suspect and to cordoned, driving load meanwhile."""
    t0 = time.monotonic()
    start()
    suspect = None
    while time.monotonic() - t0 < timeout:
        h = await _health(c, edge)
        if h != "ok" and suspect is None:
            suspect = time.monotonic() - t0
        if h == "cordoned":
            print(f"{edge}: suspect after {suspect or 0:.1f} s, cordoned after {time.monotonic() - t0:.1f} s",
                  flush=True)
            return suspect or 0.0, time.monotonic() - t0
        if drive is not None:
            await drive()
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{edge} was not cordoned within {timeout:g} s")


async def reset(c: dsec.AsyncClient, fleet: Cluster, edge: str) -> None:
    """Everything back as before: no faults, no sandboxes, the cordon lifted, all ok."""
    for name in NAMES:
        inject(fleet, name, None)
    await c.stop_many(job=JOB)
    await c.nodes.uncordon(edge, "bench: fault cleared")
    for _ in range(300):
        if {n.health for n in await c.nodes()} == {"ok"}:
            return
        await asyncio.sleep(0.2)
    raise RuntimeError("the fleet did not come back to ok")


async def faults(c: dsec.AsyncClient, fleet: Cluster, repeats: int) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = {}
    for i in range(repeats):
        await _creates(c, 18)  # every edge has create samples of its own before a latency fault
        await c.stop_many(job=JOB)
        out.setdefault("creates slowed by 2 s (`create.attached=sleep:2`)", []).append(await detect(
            c, "n3", lambda: inject(fleet, "n3", "create.attached=sleep:2"), lambda: _creates(c, 1)))
        await reset(c, fleet, "n3")
        out.setdefault("shared-store reads fail (`store.read=error`)", []).append(await detect(
            c, "n2", lambda: inject(fleet, "n2", "store.read=error"), lambda: _creates(c, 1)))
        await reset(c, fleet, "n2")
        fill = os.path.join(fleet.root, "n1", "edges", "n1", "volume", f"bench-fill-{i}")
        try:
            async def top_up(path: str = fill) -> None:  # space btrfs gives back late is filled too
                fill_disk(path)
            out.setdefault("sandbox volume filled (all but 8 MiB)", []).append(await detect(
                c, "n1", functools.partial(fill_disk, fill), top_up))
        finally:
            os.unlink(fill)
            os.sync()
        await asyncio.sleep(6)  # btrfs reports the space back at its next commit (5 s)
        await reset(c, fleet, "n1")
        proc = fleet.edges["n3"].proc
        assert proc is not None
        try:
            out.setdefault("edge stops answering (SIGSTOP)", []).append(await detect(
                c, "n3", functools.partial(os.kill, proc.pid, signal.SIGSTOP), None))
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        await reset(c, fleet, "n3")
    return out


async def idle(c: dsec.AsyncClient, seconds: float) -> tuple[int, int]:
    """Detector events (false positives: nothing is wrong) and rounds over an idle run."""
    after = max([e.id for e in await c.nodes.events(limit=10_000)], default=0)
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        await asyncio.sleep(min(10.0, seconds))
    flagged = [e for e in await c.nodes.events(after=after, limit=10_000) if e.actor == "detector"]
    return len(flagged), int(seconds)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--idle-s", type=float, default=600.0, help="the idle run's length")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--write", metavar="MARKDOWN", help="replace this benchmark's section in that file")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dsec-bench-health-") as root:
        gen = run_fleet(root, {})  # the detector's defaults: no DSEC_HEALTH
        fleet = next(gen)
        try:
            async with dsec.AsyncClient(url=fleet.url, token=TOKEN) as c:
                found = await faults(c, fleet, a.repeats)
                false_pos, idle_s = await idle(c, a.idle_s)  # (after the faults: every edge back to ok)
                print(f"idle: {false_pos} detector events in {idle_s} s", flush=True)
        finally:
            for _ in gen:  # stops the fleet and its store
                pass
    rows = ["| fault | to suspect (median) | to cordoned (median) | runs |", "|---|---|---|---|"]
    for name, runs in found.items():
        rows.append(f"| {name} | {statistics.median(r[0] for r in runs):.1f} s | "
                    f"{statistics.median(r[1] for r in runs):.1f} s | {len(runs)} |")
    body = "\n".join(rows) + (
        f"\n\nIdle run: 3 edges, {idle_s} s (about {idle_s} detector rounds: one a second), {false_pos} detector "
        "events (false positives). Settings: the defaults (`dsec.control.health.detector.Settings`): cordon after 10 s "
        "suspect, 5 create samples for a latency verdict, 3 rounds without an answer. Slow creates and store "
        "errors need creates to show: the bench makes one at a time while it waits, so their times include "
        "waiting for placement to send creates to the sick edge. A round waits up to 2 s for an edge's "
        "answer, so rounds without one are 3 s apart.")
    report(body, a.write, f"health.py --idle-s {a.idle_s:g} --repeats {a.repeats}", "health",
           "Fault detection (`bench/health.py`)")


if __name__ == "__main__":
    asyncio.run(main())
