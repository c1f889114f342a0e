"""The rollout service: what running agent loops on the platform costs against running them
in the trainer, and what a trainer's death costs the GRPO example (docs/rl.md).

- ``service``: N rollouts (256) of T turns (10) each, a turn being a small ``run_shell``.
  Baseline: the trainer runs the N loops itself through the SDK (sandboxes made the same
  way, commands unkeyed). dsec: the same loops as rollouts on one ``dsec rollout-worker``
  (concurrency N): each command keyed and journaled. Both from submit (or first create) to
  every loop done; turns/s and the ratio.
- ``grpo``: ``python -m examples.grpo.run`` at full size (6 tasks, groups of 8), once
  undisturbed (the baseline) and once with the trainer SIGKILLed after submitting step 1 and
  preempted (SIGTERM, job paused) after submitting step 3: wall time of each, the time from
  each death to the successor resubmitting its step (reconnected and continuing), the
  reward curves.

    .venv/bin/python bench/rl_service.py
    .venv/bin/python bench/rl_service.py --parts service --rollouts 32 --turns 5     # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)

from container import private_server  # noqa: E402

import dsec  # noqa: E402

BUSYBOX = dsec.ContainerArgs(image="base/busybox:latest", memory_limit_mb=32, cpu_cores_limit=0.1)


async def trainer_loops(c: dsec.AsyncClient, n: int, turns: int) -> float:
    async def one(i: int) -> None:
        sb = await c.run_container(BUSYBOX)
        try:
            for t in range(turns):
                await sb.run_shell(f"echo {t} >> /tmp/turns")
        finally:
            await sb.stop()
    t0 = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(n)))
    return time.monotonic() - t0


async def service_loops(c: dsec.AsyncClient, n: int, turns: int, run: str) -> float:
    t0 = time.monotonic()
    made = await c.rollouts.submit([dsec.RolloutSpec(agent="rl_agents:loop", key=f"{run}/{i}", args=BUSYBOX,
                                                     task={"turns": turns}) for i in range(n)])
    ids = {r.id for r in made}
    left = set(ids)
    async for r in c.rollouts.finished(timeout=600):  # as a trainer takes them
        left.discard(r.id)
        if not left:
            break
    took = time.monotonic() - t0
    rs = [await c.rollouts.get(i) for i in ids]
    bad = [r for r in rs if r.state != "done"]
    if bad:
        raise RuntimeError(f"{len(bad)} rollouts not done: {bad[0].error}")
    await c.rollouts.ack(list(ids))
    return took


def service(url: str, token: str, n: int, turns: int, rounds: int) -> dict[str, list[float]]:
    worker = subprocess.Popen([sys.executable, "-m", "dsec.client.cli.main", "rollout-worker", "--url", url, "--token",
                               token, "--path", BENCH, "--concurrency", str(n), "--log-level", "warning"], cwd=REPO)
    out: dict[str, list[float]] = {"trainer": [], "service": []}

    async def go() -> None:
        async with dsec.AsyncClient(url=url, token=token, timeout=600) as c:
            for r in range(rounds):
                out["trainer"].append(await trainer_loops(c, n, turns))
                out["service"].append(await service_loops(c, n, turns, f"b{time.time_ns()}-{r}"))
                print(f"round {r}: trainer {out['trainer'][-1]:.1f} s, service {out['service'][-1]:.1f} s",
                      flush=True)
    try:
        asyncio.run(asyncio.wait_for(go(), 1800))
    finally:
        worker.terminate()
        worker.wait(60)
    return out


def grpo(url: str, token: str, steps: int, group: int) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    for name, extra in (("undisturbed", ["--kill-at", "-1", "--preempt-at", "-1"]),
                        ("killed+preempted", ["--kill-at", "1", "--preempt-at", "3"])):
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "examples.grpo.run", "--url", url, "--token", token, "--run",
                            f"bench{time.time_ns() % 10**8}", "--steps", str(steps), "--group", str(group),
                            "--timeout", "1500", *extra], cwd=REPO, capture_output=True, text=True, timeout=1600)
        summary = json.loads(r.stdout.strip().splitlines()[-1])
        summary["wall_s"] = round(time.monotonic() - t0, 1)
        summary["returncode"] = r.returncode
        out[name] = summary
        print(name, json.dumps(summary), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="service,grpo")
    ap.add_argument("--rollouts", type=int, default=256)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--data-dir", default=os.environ.get("DSEC_DATA_DIR", "/var/lib/dsec"))
    a = ap.parse_args()
    proc, url, token, _ = private_server(a.data_dir, ["--cpu-overcommit", "100"], log=True)
    try:
        if "service" in a.parts:
            s = service(url, token, a.rollouts, a.turns, a.rounds)
            tr, sv = statistics.median(s["trainer"]), statistics.median(s["service"])
            total = a.rollouts * a.turns
            print(f"\n| {a.rollouts} loops x {a.turns} turns | median s | turns/s | vs trainer |\n"
                  "|---|---:|---:|---:|\n"
                  f"| in the trainer (SDK, unkeyed) | {tr:.1f} | {total / tr:.0f} | 1.00x |\n"
                  f"| rollout service (1 worker, journaled) | {sv:.1f} | {total / sv:.0f} | {tr / sv:.2f}x |")
        if "grpo" in a.parts:
            g = grpo(url, token, a.steps, a.group)
            print("\n| GRPO example, 6 tasks x 8 | wall s | trainer starts | reconnect s | curve |\n"
                  "|---|---:|---:|---|---|")
            for name, v in g.items():
                print(f"| {name} | {v['wall_s']} | {v['trainer_starts']} | {v['reconnect_s']} | {v['curve']} |")
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
