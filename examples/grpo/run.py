"""The GRPO example end to end on a running dsec platform (docs/rl.md, "The GRPO example"):
build the tasks, start a rollout worker, run the trainer, SIGKILL it in the middle of one
step and SIGTERM it (a preemption: the job is paused) in the middle of another, restart it
each time, and check that every rollout of every step was run exactly once and used.

    python -m examples.grpo.run                       # 6 tasks, groups of 8, 6 steps
    python -m examples.grpo.run --tasks ci --group 4 --steps 4 --kill-at 1 --preempt-at 2

The last line is a JSON summary; the exit status is 0 when nothing was lost or redone.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter

import dsec
from examples.grpo.trainer import task_names

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _common(a: argparse.Namespace) -> list[str]:
    return [*(["--url", a.url] if a.url else []), *(["--token", a.token] if a.token else [])]


def _trainer(a: argparse.Namespace) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "examples.grpo.trainer", *_common(a), "--run", a.run, "--job", a.job,
           "--tasks", a.tasks, "--steps", str(a.steps), "--group", str(a.group), "--lr", str(a.lr),
           "--state-dir", a.state_dir, "--policy-port", str(a.policy_port),
           *(["--llm-url", a.llm_url, "--model", a.model] if a.llm_url else [])]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True, start_new_session=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None)
    p.add_argument("--token", default=None)
    p.add_argument("--run", default=f"r{int(time.time())}")
    p.add_argument("--tasks", default="all")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--lr", type=float, default=2.0)
    p.add_argument("--kill-at", type=int, default=1, help="SIGKILL the trainer once this step is submitted (-1: no)")
    p.add_argument("--preempt-at", type=int, default=3, help="SIGTERM it once this step is submitted (-1: no)")
    p.add_argument("--concurrency", type=int, default=32, help="the rollout worker's")
    p.add_argument("--policy-port", type=int, default=8461)
    p.add_argument("--llm-url", default=None, help="an OpenAI-compatible endpoint instead of the toy policy")
    p.add_argument("--model", default="toy-softmax")
    p.add_argument("--state-dir", default=None)
    p.add_argument("--timeout", type=float, default=1800.0, help="the whole run, seconds")
    a = p.parse_args()
    a.job = f"grpo-{a.run}"
    a.state_dir = a.state_dir or tempfile.mkdtemp(prefix=f"grpo-{a.run}-")
    deadline = time.monotonic() + a.timeout
    worker = subprocess.Popen([sys.executable, "-m", "dsec.client.cli.main", "rollout-worker", *_common(a), "--path",
                               REPO,
                               "--concurrency", str(a.concurrency), "--log-level", "warning"],
                              cwd=REPO, start_new_session=True)
    starts, interruptions = 0, []
    gaps: list[float] = []  # seconds from a trainer's death to its successor resubmitting the step
    died_at: float | None = None
    ok = False
    try:
        while time.monotonic() < deadline:
            proc = _trainer(a)
            starts += 1
            assert proc.stdout is not None
            for line in proc.stdout:
                print(line, end="", flush=True)
                ev = json.loads(line)
                if ev.get("event") != "submitted":
                    continue
                if died_at is not None:
                    gaps.append(round(time.monotonic() - died_at, 2))
                    died_at = None
                if ev["step"] == a.kill_at and "kill" not in interruptions:
                    interruptions.append("kill")
                    proc.kill()  # no handler runs: the trainer just vanishes
                elif ev["step"] == a.preempt_at and "preempt" not in interruptions:
                    interruptions.append("preempt")
                    proc.send_signal(signal.SIGTERM)  # Preemptible pauses the job, then exits 143
            rc = proc.wait()
            died_at = time.monotonic()
            print(json.dumps({"event": "trainer-exit", "returncode": rc}), flush=True)
            if rc == 0:
                ok = True
                break
            if rc not in (-signal.SIGKILL, 128 + signal.SIGTERM):
                return rc
        with dsec.Client(url=a.url, token=a.token) as c:
            mine = c.rollouts.list(labels={"run": a.run})
            with open(os.path.join(a.state_dir, "checkpoint.json")) as f:
                curve = json.load(f)["curve"]
            states = Counter(r.state for r in mine)
            expected = a.steps * a.group * len(task_names(a.tasks))
            summary = {"event": "summary", "run": a.run, "trainer_starts": starts, "interruptions": interruptions,
                       "rollouts": len(mine), "expected": expected, "states": dict(states),
                       "consumed": sum(r.consumed for r in mine), "rerun_attempts": sum(r.attempts > 1 for r in mine),
                       "infra_failures": sum(r.failure == "infra" for r in mine),
                       "curve": [pt["mean_reward"] for pt in curve],
                       "p_fix": [round(statistics.fmean(pt["p_fix"].values()), 3) for pt in curve],
                       "reconnect_s": gaps,
                       "state_dir": a.state_dir}
            print(json.dumps(summary), flush=True)
            ok = ok and len(mine) == expected and states.get("done", 0) == expected and \
                summary["consumed"] == expected and len(curve) == a.steps
            try:
                c.job(a.job).stop()
            except dsec.DsecError:
                pass
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout=60)
        except subprocess.TimeoutExpired:
            worker.kill()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
