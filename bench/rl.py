"""RL co-design: what the RL features (fork, batches, jobs, the command log) cost and save,
each against a baseline measured in the same run on a private ``dsec serve``.

- ``grpo``: a GRPO group of 8 from one prepared state. Setup (a base/debian:12 sandbox runs
  commands that build a venv-like tree of ~4 MB of modules, byte-compile it and write 4 MB
  of data: ~1-2 s) is pack_diffed once into a snapshot; then (a) ``client.fork(snapshot, n=8)``
  until all 8 answered a first exec, against (b) 8 concurrent fresh ``run_container`` each
  running the same setup commands. Medians over rounds, and the ratio.
- ``batch``: a 10,000-sandbox ``job.create_many`` on one 2-core node, under a job quota (the
  node cannot hold 10,000): the rest fail per item with ``quota_exceeded``. Time to accept
  (the POST), time until every item has an outcome, counts, the control plane's (the
  ``dsec serve`` process) RSS before and at its peak, sampled every 20 ms; the same for
  n=1,000 as the baseline.
- ``turns``: 256 concurrent rollouts, each an async loop of turns (``run_shell`` of a small
  command) for a fixed time: turns/s and turn latency p50/p99 with ``key=`` (recorded in the
  command log) against without (the baseline), alternating rounds.
- ``pause``: a job of 500 idle sandboxes (a shell session and an idle python3 each):
  ``job.pause()`` time, memory charged before/after (job status, usage=true), ``job.resume()``
  time, then time to first exec (one sandbox, and all of them).
- ``ff``: a keyed command run for the first time against the same key replayed
  (fast-forward), for ``true`` and for ``sleep 1``; an unkeyed ``true`` as the baseline.

Every part has a hard deadline and cleans up (its job's sandboxes stopped) on error or
Ctrl-C; the server is stopped at the end.

    .venv/bin/python bench/rl.py --write docs/benchmarks.md
    .venv/bin/python bench/rl.py --parts grpo,ff --rounds 2 --ff-n 5        # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import signal
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

from container import pct, private_server, write_section  # noqa: E402

import dsec  # noqa: E402

PARTS = ("grpo", "batch", "turns", "pause", "ff")
DEBIAN = "base/debian:12"
BUSYBOX = "base/busybox"

# The setup a GRPO group shares: a venv-like tree of generated modules (~4 MB), byte-compiled
# (the CPU-bound part, ~1 s here), plus 4 MB of data. What a task's "pip install" leaves behind.
GEN_PY = ("import os\n"
          "root = '/opt/env/lib/python3/site-packages'\n"
          "for p in range(40):\n"
          "    d = os.path.join(root, f'pkg{p}')\n"
          "    os.makedirs(d, exist_ok=True)\n"
          "    for m in range(10):\n"
          "        with open(os.path.join(d, f'mod{m}.py'), 'w') as f:\n"
          "            f.write(''.join(f'def f{i}(x):\\n    return x * {i} + {p}\\n' for i in range(400)))\n")
SETUP = ["mkdir -p /opt/env/bin && printf '#!/bin/sh\\nexec python3 \"$@\"\\n' > /opt/env/bin/python && "
         "chmod +x /opt/env/bin/python",
         f"python3 -c \"{GEN_PY}\"",
         "python3 -m compileall -q /opt/env/lib/python3/site-packages",
         "dd if=/dev/urandom of=/opt/env/data.bin bs=1M count=4 2>/dev/null",
         "echo ready > /opt/env/READY"]
READY = "test -f /opt/env/READY && test -f /opt/env/lib/python3/site-packages/pkg39/__pycache__/mod9.cpython-311.pyc"

IDLE_PY = "import json, re, sqlite3, subprocess, http.client, time\nwhile True: time.sleep(3600)\n"


def ms(x: float) -> str:
    return f"{x * 1000:.1f}"


class RssSampler:
    """The control plane's resident memory (``dsec serve``: apiserver, placement, watcher and
    the edge in one process), sampled every ``period`` s from /proc/PID/status in a thread, so a
    busy event loop in this process does not skip samples."""

    def __init__(self, pid: int, period: float = 0.02) -> None:
        self.pid, self.period = pid, period
        self.peak_kb = 0
        self._stop = threading.Event()
        self._t: threading.Thread | None = None

    def now_kb(self, field: str = "VmRSS") -> int:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
        return 0

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError):
                self.peak_kb = max(self.peak_kb, self.now_kb())
            self._stop.wait(self.period)

    def __enter__(self) -> RssSampler:
        self.peak_kb = self.now_kb()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._t:
            self._t.join()


async def gather_bounded(n: int, conc: int, make: Callable[[int], Awaitable[Any]]) -> list[Any]:
    """``make(i)`` for i in 0..n-1, at most ``conc`` at a time; exceptions returned, not raised."""
    gate = asyncio.Semaphore(conc)

    async def one(i: int) -> Any:
        async with gate:
            return await make(i)

    return list(await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True))


async def stop_job_label(c: dsec.AsyncClient, job: str) -> None:
    """Every sandbox carrying ``job`` stopped, whatever happened before (cleanup)."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(c.stop_many(job=job), 300)


async def stop_job(c: dsec.AsyncClient, job: dsec.AsyncJob | None, name: str) -> float:
    t0 = time.monotonic()
    if job is not None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(job.stop(), 300)
    await stop_job_label(c, name)
    return time.monotonic() - t0


# ---------------------------------------------------------------- 1. GRPO group: fork vs fresh

async def grpo(c: dsec.AsyncClient, group: int, rounds: int) -> dict[str, Any]:
    tag = os.urandom(3).hex()
    name = f"rl-grpo-{tag}"
    args = dsec.ContainerArgs(image=DEBIAN, memory_limit_mb=512, cpu_cores_limit=1.0, job=name)
    out: dict[str, Any] = {"fork": [], "fresh": [], "fork_first": [], "fresh_setup_each": []}
    try:
        t0 = time.monotonic()
        src = await c.run_container(args)
        for cmd in SETUP:
            r = await src.exec(cmd, timeout=120)
            assert r.exit_code == 0, (cmd, r.stderr)
        out["setup_s"] = time.monotonic() - t0
        t0 = time.monotonic()
        snap = await src.pack_diff(f"ws/rl-grpo-{tag}:v1")
        out["pack_s"] = time.monotonic() - t0
        out["snap_mb"] = snap.size / 2**20
        await src.stop()

        async def by_fork() -> float:
            t0 = time.monotonic()
            sbs = await c.fork(snap, n=group, args=args)
            t_fork = time.monotonic() - t0
            rs = await asyncio.gather(*(sb.exec(READY) for sb in sbs))
            dt = time.monotonic() - t0
            assert all(r.exit_code == 0 for r in rs), "forked sandbox lacks the setup's files"
            out["fork_first"].append(t_fork)
            await asyncio.gather(*(sb.stop() for sb in sbs))
            return dt

        async def fresh_one() -> tuple[dsec.AsyncSandbox, float]:
            t0 = time.monotonic()
            sb = await c.run_container(args)
            for cmd in SETUP:
                r = await sb.exec(cmd, timeout=120)
                assert r.exit_code == 0, (cmd, r.stderr)
            r = await sb.exec(READY)
            assert r.exit_code == 0
            return sb, time.monotonic() - t0

        async def by_fresh() -> float:
            t0 = time.monotonic()
            res = await asyncio.gather(*(fresh_one() for _ in range(group)))
            dt = time.monotonic() - t0
            out["fresh_setup_each"] += [x[1] for x in res]
            await asyncio.gather(*(sb.stop() for sb, _ in res))
            return dt

        for i in range(rounds):
            # alternate which goes first, so drift of this VM's speed hits both alike
            for kind in (("fork", "fresh") if i % 2 == 0 else ("fresh", "fork")):
                dt = await (by_fork() if kind == "fork" else by_fresh())
                out[kind].append(dt)
                print(f"grpo round {i} {kind}: {dt:.2f} s", flush=True)
        with contextlib.suppress(Exception):
            await c.remove_layer(snap.ref)
    finally:
        await stop_job_label(c, name)
    return out


# ---------------------------------------------------------------- 2. batch of 10,000 under a quota

async def one_batch(c: dsec.AsyncClient, pid: int, n: int, quota: int, deadline: float) -> dict[str, Any]:
    name = f"rl-batch-{n}-{os.urandom(3).hex()}"
    job = None
    res: dict[str, Any] = {"n": n, "quota": quota}
    try:
        job = await c.create_job(name, quota=dsec.JobQuota(sandboxes=quota))
        args = dsec.ContainerArgs(image=BUSYBOX, memory_limit_mb=32, cpu_cores_limit=0.1)
        sampler = RssSampler(pid)
        res["rss_before_mb"] = sampler.now_kb() / 1024
        with sampler:
            t0 = time.monotonic()
            batch = await job.create_many(args, n)
            res["accept_s"] = time.monotonic() - t0
            counts = batch.info.counts
            first_fail = None
            async with asyncio.timeout(deadline):
                async for counts in batch.progress(timeout=deadline):
                    if first_fail is None and counts.failed:
                        first_fail = time.monotonic() - t0
            res["drain_s"] = time.monotonic() - t0
            res["first_refusal_s"] = first_fail
            res["running"], res["failed"] = counts.running, counts.failed
            res["cancelled"], res["queued"] = counts.cancelled, counts.queued + counts.starting
            items = await batch.items()
            res["reasons"] = sorted({i.error for i in items if i.error})
        res["rss_peak_mb"] = sampler.peak_kb / 1024
        st = await job.status()
        res["live"] = st.usage.sandboxes
    finally:
        res["stop_s"] = await stop_job(c, job, name)
    print(f"batch n={n}: {res}", flush=True)
    return res


async def batches(c: dsec.AsyncClient, pid: int, n: int, base_n: int, quota: int, deadline: float
                  ) -> list[dict[str, Any]]:
    # the smaller one first: it is the baseline, and the server's RSS only grows
    return [await one_batch(c, pid, m, quota, deadline) for m in (base_n, n)]


# ---------------------------------------------------------------- 3. turns/s of concurrent rollouts

async def turns(c: dsec.AsyncClient, n: int, duration: float, rounds: int) -> dict[str, Any]:
    name = f"rl-turns-{os.urandom(3).hex()}"
    args = dsec.ContainerArgs(image=BUSYBOX, memory_limit_mb=32, cpu_cores_limit=0.25, job=name)
    out: dict[str, Any] = {"keyed": {"turns": 0, "lat": [], "secs": 0.0, "errors": 0},
                           "plain": {"turns": 0, "lat": [], "secs": 0.0, "errors": 0}}
    try:
        made = await gather_bounded(n, 8, lambda i: c.run_container(args))
        sbs = [s for s in made if isinstance(s, dsec.AsyncSandbox)]
        out["sandboxes"] = len(sbs)
        out["create_errors"] = sorted({type(e).__name__ for e in made if isinstance(e, BaseException)})
        # each rollout's shell session started before the clock runs
        await gather_bounded(len(sbs), 16, lambda i: sbs[i].run_shell("cd /tmp"))

        async def rollout(i: int, sb: dsec.AsyncSandbox, keyed: bool, rnd: int, end: float,
                          acc: dict[str, Any]) -> None:
            t = 0
            while time.monotonic() < end:
                t0 = time.monotonic()
                try:
                    r = await sb.run_shell(f"echo turn {t}", timeout=30, key=f"r{i}/k{rnd}-t{t}" if keyed else None)
                    assert r.exit_code == 0 and not r.replayed
                except Exception:
                    acc["errors"] += 1
                else:
                    acc["lat"].append(time.monotonic() - t0)
                    acc["turns"] += 1
                t += 1

        for rnd in range(rounds):
            for kind in (("plain", "keyed") if rnd % 2 == 0 else ("keyed", "plain")):
                acc = out[kind]
                t0 = time.monotonic()
                end = t0 + duration
                # the hard deadline: a turn stuck past it is cancelled, not waited for
                async with asyncio.timeout(duration + 60):
                    await asyncio.gather(*(rollout(i, sb, kind == "keyed", rnd, end, acc) for i, sb in enumerate(sbs)))
                acc["secs"] += time.monotonic() - t0
                print(f"turns round {rnd} {kind}: {acc['turns']} turns so far, {acc['errors']} errors", flush=True)
    finally:
        await stop_job_label(c, name)
    return out


# ---------------------------------------------------------------- 4. pause / resume a job

async def pause_resume(c: dsec.AsyncClient, n: int) -> dict[str, Any]:
    name = f"rl-pause-{os.urandom(3).hex()}"
    job = None
    out: dict[str, Any] = {"asked": n}
    try:
        job = await c.create_job(name)
        args = dsec.ContainerArgs(image=DEBIAN, memory_limit_mb=64, cpu_cores_limit=0.1, ttl_running_stop=None)
        t0 = time.monotonic()
        made = await gather_bounded(n, 8, lambda i: job.run(args))  # type: ignore[union-attr]
        sbs = [s for s in made if isinstance(s, dsec.AsyncSandbox)]
        out["create_s"] = time.monotonic() - t0
        out["sandboxes"] = len(sbs)
        out["create_errors"] = sorted({f"{type(e).__name__}: {e}"[:160] for e in made if isinstance(e, BaseException)})

        async def prime(i: int) -> None:
            sb = sbs[i]
            await sb.write_file("/root/idle.py", IDLE_PY.encode())
            await sb.run_shell("cd /root && export IDLE=1")  # a live session shell
            await sb.exec("nohup python3 /root/idle.py >/dev/null 2>&1 &")

        await gather_bounded(len(sbs), 8, prime)
        await asyncio.sleep(3)  # the idle pythons done importing
        before = await job.status(usage=True)
        out["avail_before_mb"], out["zram_before_mb"] = node_mem_mb()
        out["mem_before_mb"] = (before.usage.memory_bytes or 0) / 2**20
        t0 = time.monotonic()
        act = await job.pause()
        out["pause_s"] = time.monotonic() - t0
        out["paused"], out["pause_skipped"] = len(act.changed), len(act.skipped)
        await asyncio.sleep(1)
        after = await job.status(usage=True)
        out["avail_paused_mb"], out["zram_paused_mb"] = node_mem_mb()
        await asyncio.sleep(4)  # reclaim may go on after the pause returned: look again
        later = await job.status(usage=True)
        out["mem_paused_5s_mb"] = (later.usage.memory_bytes or 0) / 2**20
        out["mem_paused_mb"] = (after.usage.memory_bytes or 0) / 2**20
        out["swap_paused_mb"] = (after.usage.swap_bytes or 0) / 2**20
        out["by_state_paused"] = dict(after.by_state)
        t0 = time.monotonic()
        act = await job.resume()
        out["resume_s"] = time.monotonic() - t0
        out["resumed"] = len(act.changed)
        t1 = time.monotonic()
        r = await sbs[0].exec("true")
        out["first_exec_s"] = time.monotonic() - t1
        assert r.exit_code == 0

        async def first(i: int) -> float:
            t = time.monotonic()
            r = await sbs[i].exec("true")
            assert r.exit_code == 0
            return time.monotonic() - t

        t1 = time.monotonic()
        lat = await gather_bounded(len(sbs) - 1, 32, lambda i: first(i + 1))
        out["all_exec_s"] = time.monotonic() - t1
        out["exec_lat"] = [x for x in lat if isinstance(x, float)]
        out["exec_errors"] = len(lat) - len(out["exec_lat"])
    finally:
        out["stop_s"] = await stop_job(c, job, name)
    print(f"pause: { {k: v for k, v in out.items() if k != 'exec_lat'} }", flush=True)
    return out


# ---------------------------------------------------------------- 5. fast-forward vs running

async def fast_forward(c: dsec.AsyncClient, n: int, n_slow: int) -> dict[str, list[float]]:
    name = f"rl-ff-{os.urandom(3).hex()}"
    out: dict[str, list[float]] = {}
    try:
        sb = await c.run_container(dsec.ContainerArgs(image=BUSYBOX, memory_limit_mb=64, job=name))
        for _ in range(5):  # warm the path (connection, edge's log database)
            await sb.exec("true")
        for label, cmd, count in (("true", "true", n), ("sleep 1", "sleep 1", n_slow)):
            plain, run, replay = [], [], []
            for i in range(count):
                key = f"ff/{label.replace(' ', '-')}/{i}"
                if label == "true":
                    t0 = time.monotonic()
                    await sb.exec(cmd)
                    plain.append(time.monotonic() - t0)
                t0 = time.monotonic()
                r = await sb.exec(cmd, key=key)
                run.append(time.monotonic() - t0)
                assert not r.replayed
                t0 = time.monotonic()
                r = await sb.exec(cmd, key=key)
                replay.append(time.monotonic() - t0)
                assert r.replayed
            if plain:
                out[f"{label}|unkeyed"] = plain
            out[f"{label}|run"], out[f"{label}|replay"] = run, replay
            print(f"ff {label}: run {ms(statistics.median(run))} ms, replay {ms(statistics.median(replay))} ms",
                  flush=True)
    finally:
        await stop_job_label(c, name)
    return out


# ---------------------------------------------------------------- report

def render(a: argparse.Namespace, res: dict[str, Any]) -> str:
    med = statistics.median
    out = [f"Machine: {os.cpu_count()} cores, {mem_total_gb():.0f} GiB RAM, kernel {platform.release()}; "
           "one embedded `dsec serve` (apiserver, placement and edge in one process) on a private data dir."]
    if g := res.get("grpo"):
        f, r = med(g["fork"]), med(g["fresh"])
        out += ["", f"### GRPO group of {a.group}: fork vs fresh creates + setup", "",
                f"Setup ({len(SETUP)} commands: a venv-like tree of 400 generated modules, "
                f"byte-compiled, plus 4 MB of random data) took {g['setup_s']:.2f} s in one sandbox; pack_diff of it "
                f"({g['snap_mb']:.1f} MB layer) {g['pack_s'] * 1000:.0f} ms (once). {a.rounds} rounds, medians; "
                f"each side starts its "
                f"{a.group} concurrently and is done when all {a.group} answered a first exec that checks the "
                "setup's files.", "",
                f"| group of {a.group} ready | median s | min s | max s | vs fresh |", "|---|---:|---:|---:|---:|",
                f"| {a.group} fresh `run_container` + setup each (baseline) | {r:.2f} | {min(g['fresh']):.2f} | "
                f"{max(g['fresh']):.2f} | 1.00x |",
                f"| `fork(snapshot, n={a.group})` + first exec | {f:.3f} | {min(g['fork']):.3f} | "
                f"{max(g['fork']):.3f} | {f / r:.3f}x ({r / f:.0f}x faster) |",
                "", f"The fork call alone (all {a.group} created): median {med(g['fork_first']) * 1000:.0f} ms; "
                f"one fresh sandbox's create + setup within a group of {a.group}: median "
                f"{med(g['fresh_setup_each']):.2f} s."]
    if b := res.get("batch"):
        base, big = b[0], b[-1]
        out += ["", f"### Batch of {big['n']:,} under a job quota of {big['quota']} sandboxes", "",
                "busybox, 32 MiB, 0.1 cores each; `job.create_many(args, n)`, then `batch.progress()` until "
                "every item has an outcome; the RSS is the `dsec serve` process's, sampled every 20 ms.", "",
                "| n | accept (POST) ms | every item an outcome s | made | refused (quota) | first refusal s | "
                "serve RSS before MiB | peak MiB | job.stop s |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for x in b:
            ff = "" if x["first_refusal_s"] is None else f"{x['first_refusal_s']:.2f}"
            out.append(f"| {x['n']:,} | {x['accept_s'] * 1000:.1f} | {x['drain_s']:.2f} | {x['running']} | "
                       f"{x['failed']} | {ff} | {x['rss_before_mb']:.0f} | {x['rss_peak_mb']:.0f} | "
                       f"{x['stop_s']:.2f} |")
        out += ["", f"{big['n']:,} vs {base['n']:,}: accept {big['accept_s'] / base['accept_s']:.2f}x, "
                f"drain {big['drain_s'] / base['drain_s']:.2f}x, peak RSS growth during the batch "
                f"{big['rss_peak_mb'] - big['rss_before_mb']:.0f} MiB vs "
                f"{base['rss_peak_mb'] - base['rss_before_mb']:.0f} MiB. Refusal reasons: "
                f"{', '.join(sorted(set(big['reasons']) | set(base['reasons']))) or 'none'}."]
    if t := res.get("turns"):
        k, p = t["keyed"], t["plain"]
        kr, pr = k["turns"] / k["secs"], p["turns"] / p["secs"]
        out += ["", f"### {t['sandboxes']} concurrent rollouts: turns/s with and without the command log", "",
                f"{t['sandboxes']} busybox sandboxes (asked {a.rollouts}), each driven by its own async loop of "
                f"turns (`run_shell(\"echo turn N\")` in its session), one `AsyncClient` (256 connections); "
                f"{a.turn_rounds} alternating rounds of {a.turn_secs:.0f} s per side.", "",
                "| turns | turns/s | p50 ms | p99 ms | errors | vs unkeyed |", "|---|---:|---:|---:|---:|---:|",
                f"| unkeyed (baseline) | {pr:.0f} | {ms(med(p['lat']))} | {ms(pct(p['lat'], 99))} | {p['errors']} | "
                "1.00x |",
                f"| `key=f\"r{{i}}/t{{n}}\"` (recorded) | {kr:.0f} | {ms(med(k['lat']))} | {ms(pct(k['lat'], 99))} | "
                f"{k['errors']} | {kr / pr:.2f}x turns/s, {med(k['lat']) / med(p['lat']):.2f}x p50 |"]
    if p := res.get("pause"):
        lat = p["exec_lat"]
        out += ["", f"### Job pause and resume of {p['sandboxes']} sandboxes", "",
                f"{p['sandboxes']} idle base/debian:12 sandboxes (asked {p['asked']}; 64 MiB, 0.1 cores; a live "
                f"shell session and an idle python3 each), created in {p['create_s']:.1f} s, 8 at a time.", "",
                "| | value |", "|---|---:|",
                f"| `job.pause()` ({p['paused']} paused, {p['pause_skipped']} skipped) | {p['pause_s']:.2f} s |",
                f"| memory charged, running (sum) | {p['mem_before_mb']:.0f} MiB |",
                f"| memory charged, paused (sum) | {p['mem_paused_mb']:.0f} MiB "
                f"({p['mem_paused_mb'] / max(p['mem_before_mb'], 1e-9):.3f}x; swap {p['swap_paused_mb']:.0f} MiB) |",
                f"| memory charged, paused, 5 s later (sum) | {p['mem_paused_5s_mb']:.0f} MiB |",
                f"| node: zram RAM used, before -> paused | {p['zram_before_mb']:.0f} -> {p['zram_paused_mb']:.0f} MiB "
                f"(+{p['zram_paused_mb'] - p['zram_before_mb']:.0f}) |",
                f"| node: MemAvailable, before -> paused | {p['avail_before_mb']:.0f} -> "
                f"{p['avail_paused_mb']:.0f} MiB "
                f"(+{p['avail_paused_mb'] - p['avail_before_mb']:.0f}) |",
                f"| charged memory out of the cgroups (1 s after the pause) | "
                f"{p['mem_before_mb'] - p['mem_paused_mb']:.0f} MiB |",
                f"| `job.resume()` ({p['resumed']} resumed) | {p['resume_s']:.2f} s |",
                f"| first exec after resume | {ms(p['first_exec_s'])} ms |",
                f"| a first exec in every other sandbox, 32 at a time | {p['all_exec_s']:.2f} s "
                f"(p50 {ms(med(lat)) if lat else '-'} ms, p99 {ms(pct(lat, 99)) if lat else '-'} ms, "
                f"{p['exec_errors']} errors) |",
                f"| `job.stop()` | {p['stop_s']:.2f} s |"]
    if f := res.get("ff"):
        out += ["", "### Fast-forward: a keyed command replayed vs run", "",
                f"One busybox sandbox, sequential calls; `true` x{a.ff_n}, `sleep 1` x{a.ff_slow_n}; each key run "
                "once, then the same call again (replayed: nothing runs).", "",
                "| command | call | p50 ms | p90 ms | vs running it keyed |", "|---|---|---:|---:|---:|"]
        for label in ("true", "sleep 1"):
            run = med(f[f"{label}|run"])
            for call, desc in (("unkeyed", "unkeyed exec (baseline for the log's cost)"),
                               ("run", "keyed, first time (runs, recorded)"),
                               ("replay", "keyed, again (fast-forwarded)")):
                if xs := f.get(f"{label}|{call}"):
                    out.append(f"| `{label}` | {desc} | {ms(med(xs))} | {ms(pct(xs, 90))} | "
                               f"{med(xs) / run:.3f}x |")
    return "\n".join(out)


def node_mem_mb() -> tuple[float, float]:
    """(MemAvailable, RAM held by every zram device) in MiB: what a pause gives the node back
    is the memory charged that left the cgroups minus what zram keeps of it, compressed."""
    with open("/proc/meminfo") as f:
        avail = next(int(x.split()[1]) for x in f if x.startswith("MemAvailable")) / 1024
    zram = 0
    for d in os.listdir("/sys/block"):
        if d.startswith("zram"):
            with contextlib.suppress(OSError, IndexError, ValueError), open(f"/sys/block/{d}/mm_stat") as f:
                zram += int(f.read().split()[2])  # mem_used_total
    return avail, zram / 2**20


def mem_total_gb() -> float:
    with open("/proc/meminfo") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("MemTotal")) / 2**20


async def run_parts(a: argparse.Namespace, url: str, token: str, pid: int, parts: list[str]) -> dict[str, Any]:
    res: dict[str, Any] = {}
    async with dsec.AsyncClient(url=url, token=token, timeout=600) as c:
        for part in parts:
            t0 = time.monotonic()
            try:
                # each part's hard deadline: cancelled past it (its finally stops its sandboxes)
                async with asyncio.timeout(a.part_timeout):
                    if part == "grpo":
                        res[part] = await grpo(c, a.group, a.rounds)
                    elif part == "batch":
                        res[part] = await batches(c, pid, a.batch_n, a.batch_base_n, a.quota, a.part_timeout)
                    elif part == "turns":
                        res[part] = await turns(c, a.rollouts, a.turn_secs, a.turn_rounds)
                    elif part == "pause":
                        res[part] = await pause_resume(c, a.pause_n)
                    elif part == "ff":
                        res[part] = await fast_forward(c, a.ff_n, a.ff_slow_n)
            except TimeoutError:
                print(f"{part}: past its deadline of {a.part_timeout:.0f} s, skipped", flush=True)
            except Exception as e:  # one part failing should not lose the others' numbers
                print(f"{part}: failed: {type(e).__name__}: {e}", flush=True)
            print(f"{part}: {time.monotonic() - t0:.1f} s", flush=True)
    return res


def _sigterm(*_: object) -> None:
    raise KeyboardInterrupt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--group", type=int, default=8, help="GRPO group size")
    ap.add_argument("--rounds", type=int, default=5, help="GRPO rounds")
    ap.add_argument("--batch-n", type=int, default=10_000)
    ap.add_argument("--batch-base-n", type=int, default=1_000)
    ap.add_argument("--quota", type=int, default=300, help="the batch job's sandbox quota")
    ap.add_argument("--rollouts", type=int, default=256)
    ap.add_argument("--turn-secs", type=float, default=20.0, help="seconds per side per round")
    ap.add_argument("--turn-rounds", type=int, default=2)
    ap.add_argument("--pause-n", type=int, default=500)
    ap.add_argument("--ff-n", type=int, default=50)
    ap.add_argument("--ff-slow-n", type=int, default=50)
    ap.add_argument("--part-timeout", type=float, default=600.0, help="hard deadline of each part (s)")
    ap.add_argument("--data-dir", default=os.environ.get("DSEC_DATA_DIR", "/var/lib/dsec"))
    ap.add_argument("--write", metavar="MARKDOWN")
    a = ap.parse_args()
    parts = [p for p in a.parts.split(",") if p]
    if bad := set(parts) - set(PARTS):
        ap.error(f"unknown parts: {', '.join(sorted(bad))}")
    # hundreds of sandboxes at 0.1-0.25 cores need CPU overcommit beyond the default 8x
    proc, url, token, _ = private_server(a.data_dir, ["--cpu-overcommit", "100"], log=True)
    # SIGTERM as Ctrl-C: asyncio.run cancels the parts, whose finally blocks stop their sandboxes
    signal.signal(signal.SIGTERM, _sigterm)
    try:
        res = asyncio.run(run_parts(a, url, token, proc.pid, parts))
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except Exception:
            proc.kill()
    body = render(a, res)
    print(body)
    if a.write:
        cmd = "python " + " ".join(["bench/rl.py", *sys.argv[1:]])
        write_section(a.write, body, cmd, name="rl", title="RL co-design (`bench/rl.py`)")


if __name__ == "__main__":
    main()
