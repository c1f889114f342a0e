"""The GRPO example (examples/grpo/, docs/rl.md "The GRPO example") at CI size, for real:
two tasks from PyPI sources, groups of 4 forked from each task's snapshot, a rollout worker
process, the toy policy trained in the loop, and the trainer SIGKILLed in the middle of
step 1 and preempted (SIGTERM: its job paused) in the middle of step 2, restarted each time.
Nothing may be lost or run twice, and the policy must learn: the probability it gives the
fix rises. (The sampled reward of 8 rollouts a step is too noisy to assert on at this size;
with binary rewards the expected reward is exactly that probability.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

from tests.conftest import TOKEN, Platform

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_grpo_example_survives_trainer_kill_and_preemption(platform: Platform, tmp_path: os.PathLike[str]) -> None:
    run = f"ci{uuid.uuid4().hex[:6]}"
    from tests.conftest import _free_port
    r = subprocess.run([sys.executable, "-m", "examples.grpo.run", "--url", platform.url, "--token", TOKEN,
                        "--run", run, "--tasks", "ci", "--group", "4", "--steps", "4", "--kill-at", "1",
                        "--preempt-at", "2", "--policy-port", str(_free_port()), "--state-dir", str(tmp_path),
                        "--timeout", "900"], cwd=REPO, capture_output=True, text=True, timeout=1000)
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    summary = lines[-1]
    print(json.dumps(summary))
    assert summary["event"] == "summary"
    assert summary["trainer_starts"] == 3 and summary["interruptions"] == ["kill", "preempt"]
    assert summary["rollouts"] == summary["expected"] == 2 * 4 * 4  # one rollout per key: none lost, none twice
    assert summary["states"] == {"done": 32} and summary["consumed"] == 32
    exits = [x["returncode"] for x in lines if x.get("event") == "trainer-exit"]
    assert exits == [-9, 143, 0]
    steps = [x for x in lines if x.get("event") == "step"]
    assert [s["step"] for s in steps] == [0, 1, 2, 3]  # each step completed once, across three processes
    assert len(summary["curve"]) == 4
    # Every candidate starts at 1/4. A GRPO step raises the fix's logit whenever a group has
    # both outcomes; all 8 groups of 4 missing the fix or all hitting it is a ~1e-4 chance.
    p_fix = summary["p_fix"]
    assert len(p_fix) == 4 and p_fix[-1] > 0.25, p_fix
