"""Density: memory per idle sandbox running vs paused, pause and resume latency, and the
step latency of a latency-sensitive task under best-effort load with and without QoS.

- N idle container sandboxes, each with a live shell session and an idle ``python3`` that
  imported a few stdlib modules; memory charged to each sandbox's cgroup, running and
  paused (frozen, memory pushed to zram); pause latency and resume-to-first-exec latency.
- One latency-sensitive sandbox runs a CPU-bound step (a fixed Python loop) repeatedly,
  pinned to core 0, and times each step inside the sandbox, while a best-effort sandbox
  spins on the same core 0, 25 or 50% of the time; once with the spinner as ``best_effort``
  (SCHED_IDLE, cpu.idle) and once as ``latency_sensitive`` (the same as no QoS). The
  baseline is the unloaded step.

    .venv/bin/python bench/density.py --write docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

from container import pct, private_server, write_section  # noqa: E402

import dsec  # noqa: E402
from dsec.node.host.memory import cgroup_memory  # noqa: E402

# best-effort load: a spinner on the latency-sensitive task's core, busy a given share of each 100 ms
SPIN_PY = ("import os, time\n"
           "os.sched_setaffinity(0, {{0}})\n"
           "while True:\n"
           "    t = time.perf_counter()\n"
           "    while time.perf_counter() - t < {duty} * 0.1: pass\n"
           "    time.sleep((1 - {duty}) * 0.1)\n")
IDLE_PY = "import json, re, sqlite3, subprocess, http.client, time\nwhile True: time.sleep(3600)\n"
STEP_PY = ("import os, time\n"
           "os.sched_setaffinity(0, {{0}})\n"
           "out = []\n"
           "for _ in range({steps}):\n"
           "    t = time.perf_counter()\n"
           "    x = 0\n"
           "    for i in range(200000): x += i * i\n"
           "    out.append(time.perf_counter() - t)\n"
           "    time.sleep(0.02)\n"
           "print(' '.join(f'{{v:.6f}}' for v in out))\n")


def cgroup_of(sandbox_id: str) -> str:
    for root, dirs, _ in os.walk("/sys/fs/cgroup/memory"):
        if sandbox_id in dirs:
            return os.path.join(root, sandbox_id).removeprefix("/sys/fs/cgroup/memory")
        if root.count("/") > 5:
            dirs.clear()
    raise RuntimeError(f"no cgroup for {sandbox_id}")


async def idle_fleet(c: dsec.AsyncClient, n: int) -> dict[str, list[float]]:
    sbs = await asyncio.gather(*(c.run_container(dsec.ContainerArgs(memory_limit_mb=128, cpu_cores_limit=0.1,
                                                                     job="density-idle")) for _ in range(n)))
    try:
        for sb in sbs:
            await sb.write_file("/root/idle.py", IDLE_PY.encode())
            await sb.run_shell("cd /root && export IDLE=1")  # a live session shell
            await sb.exec("nohup python3 /root/idle.py >/dev/null 2>&1 &")
        await asyncio.sleep(3)
        groups = {sb.sandbox_id: cgroup_of(sb.sandbox_id) for sb in sbs}
        running = [cgroup_memory(groups[sb.sandbox_id]).get("total", 0) / 2**20 for sb in sbs]
        pause, resume, paused = [], [], []
        for sb in sbs:
            t0 = time.monotonic()
            await sb.pause()
            pause.append(time.monotonic() - t0)
            paused.append(cgroup_memory(groups[sb.sandbox_id]).get("total", 0) / 2**20)
        for sb in sbs:
            t0 = time.monotonic()
            r = await sb.exec("true")
            resume.append(time.monotonic() - t0)
            assert r.exit_code == 0
        return {"running_mb": running, "paused_mb": paused, "pause": pause, "resume": resume}
    finally:
        await c.stop_many(job="density-idle")


def mem_available_mb() -> float:
    with open("/proc/meminfo") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("MemAvailable")) / 1024


async def capacity(c: dsec.AsyncClient, memory_mb: int, limit: int) -> dict[str, Any]:
    """Create idle sandboxes (session + idle python3 each) until admission refuses or
    ``limit``; then pause them all and create more until refused again or 2 x ``limit``.
    ``curve``: after each batch, (phase, sandboxes, MemAvailable MiB, the batch's seconds)."""
    made: list[dsec.AsyncSandbox] = []
    curve: list[tuple[str, int, float, float]] = [("running", 0, mem_available_mb(), 0.0)]

    async def one() -> bool:
        try:
            sb = await c.run_container(dsec.ContainerArgs(memory_limit_mb=memory_mb, cpu_cores_limit=0.1,
                                                          job="density-cap", ttl_running_stop=None))
        except dsec.AdmissionRejected:
            return False
        made.append(sb)
        await sb.write_file("/root/idle.py", IDLE_PY.encode())
        await sb.run_shell("cd /root")
        await sb.exec("nohup python3 /root/idle.py >/dev/null 2>&1 &")
        return True

    async def fill(upto: int, phase: str) -> None:
        while len(made) < upto:
            tb = time.monotonic()
            ok = await asyncio.gather(*(one() for _ in range(min(8, upto - len(made)))))
            curve.append((phase, len(made), mem_available_mb(), time.monotonic() - tb))
            if not all(ok):
                return

    t0 = time.monotonic()
    try:
        await fill(limit, "running")
        running = len(made)
        avail_running = mem_available_mb()
        t_fill = time.monotonic() - t0
        await c.pause_many(job="density-cap")
        curve.append(("paused", running, mem_available_mb(), 0.0))
        await fill(2 * limit, "paused")
        avail_after = mem_available_mb()
        return {"running": running, "with_paused": len(made), "fill_s": t_fill,
                "avail_running_mb": avail_running, "avail_after_mb": avail_after, "curve": curve}
    finally:
        await c.stop_many(job="density-cap")


async def ls_steps(c: dsec.AsyncClient, load_pct: int, qos: str, steps: int) -> list[float]:
    spinners = [await c.run_container(dsec.ContainerArgs(cpu_cores_limit=1.0, qos=qos, job="density-load"))
                for _ in range(1 if load_pct else 0)]
    ls = await c.run_container(dsec.ContainerArgs(qos="latency_sensitive", cpu_cores_limit=1.0))
    try:
        for s in spinners:
            await s.write_file("/root/spin.py", SPIN_PY.format(duty=load_pct / 100).encode())
            await s.exec("nohup python3 /root/spin.py >/dev/null 2>&1 &")
        await asyncio.sleep(0.5)
        r = await ls.exec(["python3", "-c", STEP_PY.format(steps=steps)], timeout=300)
        return [float(v) for v in r.stdout.split()][5:]  # the first steps warm up
    finally:
        await ls.stop()
        if spinners:
            await c.stop_many(job="density-load")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=50, help="idle sandboxes")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--capacity", type=int, default=0, metavar="N",
                    help="also fill the node with up to N running idle sandboxes, pause them, fill again")
    ap.add_argument("--capacity-memory-mb", type=int, default=32)
    ap.add_argument("--data-dir", default=os.environ.get("DSEC_DATA_DIR", "/var/lib/dsec"))
    ap.add_argument("--write", metavar="MARKDOWN")
    a = ap.parse_args()
    # idle sandboxes with a 0.1-core cap each: 1,000 of them need CPU overcommit beyond the default 8
    extra = ["--cpu-overcommit", "100"] if a.capacity else []
    proc, url, token, data_dir = private_server(a.data_dir, extra, log=True)
    cores = os.cpu_count() or 1
    steps: dict[tuple[int, str], list[float]] = {}
    try:
        async with dsec.AsyncClient(url=url, token=token, timeout=600) as c:
            idle = await idle_fleet(c, a.n)
            print({k: round(statistics.median(v), 3) for k, v in idle.items()}, flush=True)
            for pct_load in (0, 25, 50):
                for qos in (("best_effort", "latency_sensitive") if pct_load else ("best_effort",)):
                    steps[(pct_load, qos)] = await ls_steps(c, pct_load, qos, a.steps)
                    print(pct_load, qos, round(statistics.median(steps[(pct_load, qos)]) * 1000, 2), flush=True)
            # last: tearing down thousands of sandboxes keeps the node busy for a while
            cap = await capacity(c, a.capacity_memory_mb, a.capacity) if a.capacity else None
            print(cap, flush=True)
    finally:
        proc.terminate()
        proc.wait()
    ms = 1000.0
    run_mb, paused_mb = statistics.median(idle["running_mb"]), statistics.median(idle["paused_mb"])
    base = statistics.median(steps[(0, "best_effort")])
    out = [f"{a.n} idle container sandboxes (base/debian:12, a live shell session and an idle python3 that "
           f"imported json, re, sqlite3, subprocess, http.client); {cores} cores, kernel {platform.release()}", "",
           "| idle sandbox | median | p90 | ratio | target |", "|---|---|---|---|---|",
           f"| memory charged, running (MiB) | {run_mb:.1f} | {pct(idle['running_mb'], 90):.1f} | 1.00 | |",
           f"| memory charged, paused (MiB) | {paused_mb:.2f} | {pct(idle['paused_mb'], 90):.2f} | "
           f"{paused_mb / run_mb:.3f} | <= 0.10 |",
           f"| pause (ms) | {statistics.median(idle['pause']) * ms:.0f} | {pct(idle['pause'], 90) * ms:.0f} | "
           f"| <= 100 |",
           f"| resume to first exec (ms) | {statistics.median(idle['resume']) * ms:.0f} | "
           f"{pct(idle['resume'], 90) * ms:.0f} | | <= 100 |",
           *([] if cap is None else [
               "", f"Capacity: idle sandboxes as above, {a.capacity_memory_mb} MiB and 0.1 cores limit each (CPU "
               f"overcommit 100, memory overcommit 1.5), created 8 at a time until admission refused or "
               f"{a.capacity}, then all paused and more created:", "",
               "| | sandboxes | MemAvailable after (MiB) | target |", "|---|---|---|---|",
               f"| running idle | {cap['running']:.0f} (in {cap['fill_s']:.0f} s) | {cap['avail_running_mb']:.0f} | "
               f">= 1000 |",
               f"| with the first ones paused | {cap['with_paused']:.0f} | {cap['avail_after_mb']:.0f} | >= 2000 |"]),
           "", f"Latency-sensitive step (a fixed CPU-bound Python loop, {a.steps} steps, pinned to core 0) under a "
           "best-effort spinner pinned to the same core, busy 25% or 50% of each 100 ms:",
           "", "| best-effort load | spinners as | step p50 (ms) | step p90 (ms) | slowdown vs unloaded | target |",
           "|---|---|---|---|---|---|"]
    for (load, qos), v in steps.items():
        label = "best_effort (QoS: SCHED_IDLE)" if qos == "best_effort" and load else (
            "latency_sensitive (no QoS)" if load else "-")
        slow = statistics.median(v) / base - 1
        out.append(f"| {load}% | {label} | {statistics.median(v) * ms:.2f} | {pct(v, 90) * ms:.2f} | "
                   f"{slow * 100:+.0f}% | {'<= +25%' if load == 50 and qos == 'best_effort' else ''} |")
    body = "\n".join(out)
    if a.write:
        body += "\n\n" + figures(idle, steps, cap, a, a.write)
    print(body)
    if a.write:
        cmd = "python bench/density.py" + (f" -n {a.n} --capacity {a.capacity}" if a.capacity else "")
        write_section(a.write, body, cmd + " --write docs/benchmarks.md", name="density",
                      title="Density (`bench/density.py`)")


def figures(idle: dict[str, list[float]], steps: dict[tuple[int, str], list[float]], cap: dict[str, Any] | None,
            a: argparse.Namespace, markdown: str) -> str:
    """Memory per idle sandbox, the capacity fill and step latency against load, as PNGs beside
    ``markdown``: their markdown links."""
    import plots

    out = plots.img_dir(markdown)
    links = [plots.image_link(
        "memory charged per idle sandbox, running vs paused",
        plots.latency_histogram({"running": idle["running_mb"], "paused (frozen, pushed to zram)": idle["paused_mb"]},
                                bench="density", name="memory", logx=True, unit="MiB",
                                xlabel="memory charged to the sandbox's cgroup (MiB)",
                                title=f"Memory per idle sandbox, {a.n} sandboxes", out_dir=out))]
    if cap is not None:
        run = [(n, m, dt) for ph, n, m, dt in cap["curve"] if ph == "running"]
        paused = [(n, m, dt) for ph, n, m, dt in cap["curve"] if ph == "paused"]
        mem = {"creating, all running": ([n for n, _, _ in run], [m for _, m, _ in run])}
        if len(paused) > 1:
            mem[f"creating more, the first {cap['running']:.0f} paused"] = ([n for n, _, _ in paused],
                                                                             [m for _, m, _ in paused])
        links.append(plots.image_link(
            "MemAvailable on the node as idle sandboxes are created",
            plots.density_curve(mem, bench="density", name="capacity-memory", markers=False,
                                xlabel="idle sandboxes on the node", ylabel="MemAvailable (MiB)",
                                title=f"Node memory as idle sandboxes are added ({a.capacity_memory_mb} MiB limit "
                                      "each, 8 at a time)", out_dir=out)))
        lat = {"all running": ([n for n, _, dt in run[1:]], [dt * 1000 for _, _, dt in run[1:]])}
        if len(paused) > 1:
            lat["the first ones paused"] = ([n for n, _, dt in paused[1:]], [dt * 1000 for _, _, dt in paused[1:]])
        links.append(plots.image_link(
            "time to create a batch of 8 idle sandboxes as the node fills",
            plots.density_curve(lat, bench="density", name="capacity-latency", markers=False,
                                xlabel="idle sandboxes on the node (after the batch)",
                                ylabel="batch of 8: create + set up (ms)",
                                title="Creating 8 idle sandboxes at once as the node fills", out_dir=out)))
    base = statistics.median(steps[(0, "best_effort")]) * 1000
    loads = sorted({load for load, _ in steps})
    curve, styles = {}, {}
    spinners = (("best_effort", "spinner best_effort (SCHED_IDLE)"),
                ("latency_sensitive", "spinner latency_sensitive (no QoS)"))
    for color, (qos, label) in zip(plots.COLORS[1:3], spinners, strict=True):
        xs = [load for load in loads if (load, qos) in steps or load == 0]
        for p, line in ((50, "-"), (90, "--")):
            ys = [pct(steps[(load, qos if load else "best_effort")], p) * 1000 for load in xs]
            curve[f"{label}, p{p}"] = (xs, ys)
            styles[f"{label}, p{p}"] = {"color": color, "linestyle": line}
    links.append(plots.image_link(
        "latency-sensitive step latency against best-effort load on the same core",
        plots.density_curve(curve, bench="density", name="qos-step-latency", styles=styles,
                            hlines={f"unloaded p50 + 25% (target, {base * 1.25:.1f} ms)": base * 1.25},
                            xlabel="best-effort spinner load on the same core (% of each 100 ms)",
                            ylabel="latency-sensitive step (ms)",
                            title="A latency-sensitive step under best-effort load", out_dir=out)))
    return "\n\n".join(links)


if __name__ == "__main__":
    asyncio.run(main())
