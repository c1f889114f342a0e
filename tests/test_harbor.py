"""Harbor (PyPI ``harbor``, the Terminal-Bench harness, unmodified) against dsec's E2B API:
``harbor run --env e2b --agent oracle`` on the tasks in tests/harbor/tasks, through
scripts/harbor (Harbor needs Python >= 3.12, so it runs from the Debian trixie root
scripts/harbor-env.sh builds). Each trial builds the task's environment/Dockerfile as an
E2B template (or reuses its tag), creates a sandbox from it, runs the oracle's
solution/solve.sh, then tests/test.sh, whose reward Harbor writes to the job's results."""

from __future__ import annotations

import glob
import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import TOKEN, Platform

import dsec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = os.path.join(ROOT, "tests", "harbor", "tasks")
HARBOR = os.path.join(ROOT, "scripts", "harbor")


@pytest.fixture(scope="module")
def harbor_env() -> None:
    """The Harbor root (built once per machine, ~1 min; a stamp check afterwards)."""
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "harbor-env.sh")], capture_output=True,
                       text=True, timeout=1800)
    if r.returncode != 0:
        pytest.fail(f"scripts/harbor-env.sh failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")


def harbor_run(platform: Platform, jobs_dir: str, job: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "E2B_API_URL": platform.url, "E2B_SANDBOX_URL": platform.url, "E2B_API_KEY": TOKEN}
    env.pop("E2B_DOMAIN", None)
    return subprocess.run([HARBOR, "run", "--env", "e2b", "--agent", "oracle", "--jobs-dir", jobs_dir,
                           "--job-name", job, "--yes", "--quiet", *args],
                          capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)


def trial_results(jobs_dir: str, job: str) -> dict[str, dict]:
    """Each trial's result.json (jobs/<job>/<trial>/result.json), by task name."""
    out = {}
    for path in glob.glob(os.path.join(jobs_dir, job, "*", "result.json")):
        with open(path) as f:
            r = json.load(f)
        out[r["task_name"]] = r
    return out


@pytest.mark.parametrize(("task", "reward"), [("pip-ok", 1.0), ("pip-broken", 0.0)])
def test_oracle(harbor_env: None, platform: Platform, tmp_path: Path, task: str, reward: float) -> None:
    """pip-ok first builds the template (FROM debian:12, a COPY from the build context, RUN
    pip install, WORKDIR); pip-broken has the same environment/, so it finds the template's
    tag and launches that build. ``harbor run`` exits 0 whatever the trials do: the
    reward and any exception are in the trial's result.json."""
    jobs = str(tmp_path)
    r = harbor_run(platform, jobs, task, "--path", os.path.join(TASKS, task))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    results = trial_results(jobs, task)
    assert set(results) == {task}, (r.stdout[-3000:], r.stderr[-3000:])
    result = results[task]
    assert result["exception_info"] is None, json.dumps(result["exception_info"], indent=1)
    assert result["verifier_result"]["rewards"] == {"reward": reward}
    with open(os.path.join(jobs, task, "result.json")) as f:
        job = json.load(f)
    assert job["stats"]["n_errored_trials"] == 0 and job["stats"]["n_completed_trials"] == 1
    # Harbor killed its sandbox (E2B metadata are dsec labels)
    with dsec.Client(url=platform.url, token=TOKEN) as c:
        left = [s.sandbox_id for s in c.list(labels={"harbor.trial_name": result["trial_name"]})
                if s.state.value not in ("stopped", "stopping", "failed")]
    assert left == []
