"""dsec.client.rl against the real platform: the grader grades in a fresh sandbox of the task's
pristine stack plus the agent's diff, the hidden tests never reach the agent, attacks on
the test runner from the agent's sandbox earn nothing, and the gymnasium environment runs
episodes (docs/rl.md, "Grading without reward hacking", "A gymnasium environment")."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

import dsec
from dsec.client.rl import Grader, Task
from tests.conftest import TOKEN, Platform

MARKER = f"HIDDEN-{uuid.uuid4().hex}"
BUGGY = "def add(a, b):\n    return a - b\n"
FIX = "sed -i 's/a - b/a + b/' /work/proj/calc.py"
HIDDEN = {
    "test_calc.py": f"# {MARKER}\nfrom calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
                    "def test_add_negative():\n    assert add(-1, 1) == 0\n",
}


def _uniq(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def task(platform: Platform) -> Iterator[Task]:
    """A tiny task: /work/proj/calc.py with a bug, packed as a workspace layer; its hidden
    tests live only in this process."""
    with dsec.Client(url=platform.url, token=TOKEN) as c:
        sb = c.run_container(dsec.ContainerArgs(image="base/debian:12"))
        try:
            sb.exec("mkdir -p /work/proj")
            sb.write_file("/work/proj/calc.py", BUGGY)
            layer = sb.pack_diff(f"ws/{_uniq('rl-task')}:v1")
        finally:
            sb.stop()
    yield Task(image="base/debian:12", layers=[layer.ref], hidden_tests=HIDDEN, workspace="/work",
               solution_path="/work/proj", prompt="Fix add() in /work/proj/calc.py, then submit.",
               max_turns=5, expected_tests=2, test_timeout_s=60)


async def _agent(client: dsec.AsyncClient, task: Task, script: str) -> dsec.AsyncSandbox:
    sb = await client.run_container(dsec.ContainerArgs(image=task.image, layers=task.layers))
    if script:
        r = await sb.exec(script, timeout=60)
        assert r.exit_code == 0, r.stdout + r.stderr
    return sb


async def _hidden_anywhere(sb: dsec.AsyncSandbox) -> list[str]:
    r = await sb.exec(f"grep -rlF --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev {MARKER} / ; true",
                      timeout=240)
    return r.stdout.split()


async def test_a_fix_earns_1_the_bug_0_and_the_tests_never_reach_the_agent(client: dsec.AsyncClient,
                                                                            task: Task) -> None:
    grader = Grader(client)
    fixed = await _agent(client, task, FIX)
    buggy = await _agent(client, task, "echo 'looked around' > /work/notes")
    try:
        good = await grader.grade(task, fixed)
        assert (good.reward, good.passed, good.total, good.failure) == (1.0, 2, 2, None), good
        bad = await grader.grade(task, buggy)
        assert (bad.reward, bad.passed, bad.failed, bad.failure) == (0.0, 0, 2, "workload"), bad
        assert "assert" in bad.output_tail
        frac = await Grader(client, reward="fraction").grade(task, buggy)
        assert frac.reward == 0.0 and frac.total == 2
        # nothing of the tests in the agent's sandbox, before or after grading it; the
        # search itself finds the marker where it is (it is not a search that finds nothing)
        assert await _hidden_anywhere(fixed) == []
        assert await _hidden_anywhere(buggy) == []
        await buggy.write_file("/work/probe", MARKER)
        assert await _hidden_anywhere(buggy) == ["/work/probe"]
        # no grading sandbox left behind, and the diffs are removed
        live = [s for s in await client.list(labels={"dsec.rl/role": "grader"})
                if s.state not in (dsec.SandboxState.stopped, dsec.SandboxState.failed)]
        assert live == []
        with pytest.raises(dsec.NotFound):
            await client.layer(str(good.diff_ref))
    finally:
        await fixed.stop()
        await buggy.stop()


# Each attack leaves the bug in place and tries to make the tests pass anyway: files it
# writes (path -> content) and a shell script it runs, in its own sandbox.
FORCE_PASS_CONFTEST = """import pytest
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    out = yield
    rep = out.get_result()
    rep.outcome = "passed"
    rep.longrepr = None
"""
# at exit: a junit report of every test passed wherever the runner asked for one, and exit 0
FORGE = """import atexit, os, sys
def _forge():
    a = sys.argv
    for i, x in enumerate(a):
        path = a[i + 1] if x == "--junitxml" and i + 1 < len(a) else x.partition("=")[2] \
            if x.startswith("--junitxml=") else None
        if path:
            with open(path, "w") as f:
                f.write('<testsuite tests="2" failures="0" errors="0" skipped="0"></testsuite>')
    os._exit(0)
atexit.register(_forge)
"""
FAKE_PYTHON = """#!/bin/sh
while [ $# -gt 0 ]; do
  if [ "$1" = --junitxml ]; then
    echo '<testsuite tests="2" failures="0" errors="0" skipped="0"></testsuite>' > "$2"
  fi
  shift
done
exit 0
"""
SITE = "/usr/lib/python3/dist-packages"
ATTACKS: dict[str, tuple[dict[str, str], str]] = {
    # a conftest that turns every failure into a pass, wherever pytest could look for one;
    # passing tests of the hidden tests' name and a pytest.ini in the workspace
    "conftest": ({**{f"{d}/conftest.py": FORCE_PASS_CONFTEST for d in ("", "/work", "/work/proj", SITE)},
                  "/work/proj/test_calc.py": "def test_add():\n    pass\n",
                  "/work/proj/pytest.ini": "[pytest]\naddopts = -p no:junitxml\n"}, ""),
    # a sitecustomize (imported by every python) that forges the report, in the site dirs
    # and in the workspace
    "sitecustomize": ({f"{d}/sitecustomize.py": FORGE for d in ("/work/proj", SITE, "/usr/lib/python3.11")}, ""),
    # a modified pytest that forges the report, and a shadowing pytest module
    "modified-pytest": ({"/work/proj/pytest.py": "import sys\nsys.exit(0)\n"},
                        f"cat >> {SITE}/pytest/__init__.py <<'EOF'\n{FORGE}EOF"),
    # python3 itself replaced by something that reports success
    "fake-python": ({"/tmp/python3": FAKE_PYTHON}, "rm /usr/bin/python3 && install -m 755 /tmp/python3 /usr/bin/"),
    # the solution ends the test process with 0 as soon as it is imported
    "exit-at-import": ({}, "printf 'import os\\nos._exit(0)\\n' >> /work/proj/calc.py"),
}


async def _naive_grade(sb: dsec.AsyncSandbox) -> bool:
    """What the attacks are aimed at: the hidden tests run in the agent's own sandbox, from
    its workspace, judged by pytest's exit code."""
    await sb.exec("mkdir -p /work/proj/hidden")
    await sb.write_file("/work/proj/hidden/test_calc.py", HIDDEN["test_calc.py"])
    r = await sb.exec("cd /work/proj && python3 -m pytest -q hidden", timeout=60)
    return r.exit_code == 0


@pytest.mark.parametrize("attack", sorted(ATTACKS))
async def test_attacks_from_the_agents_sandbox_earn_nothing(client: dsec.AsyncClient, task: Task,
                                                            attack: str) -> None:
    files, script = ATTACKS[attack]
    sb = await _agent(client, task, "")
    for path, text in files.items():
        await sb.write_file(path, text)
    if script:
        r = await sb.exec(script)
        assert r.exit_code == 0, r.stderr
    try:
        g = await Grader(client).grade(task, sb)
        assert g.reward == 0.0 and g.failure == "workload", g
        # the attack is real: graded in its own sandbox, the wrong solution would pass
        assert await _naive_grade(sb), f"{attack} does not fool even a naive grader"
    finally:
        await sb.stop()


async def test_in_process_tampering_by_the_solution_is_not_defended(client: dsec.AsyncClient, task: Task) -> None:
    """The documented gap: the tests import the agent's code, which then runs inside the
    test process and can forge whatever that process reports. If this starts failing, the
    grader learned to defend it: update docs/rl.md."""
    sb = await _agent(client, task, "")
    try:
        await sb.write_file("/work/proj/calc.py", BUGGY + FORGE)
        g = await Grader(client).grade(task, sb)
        assert g.reward == 1.0, g
    finally:
        await sb.stop()


async def test_the_grader_refuses_a_diff_of_another_stack(client: dsec.AsyncClient, task: Task) -> None:
    other = await client.run_container(dsec.ContainerArgs(image="base/debian:12"))
    try:
        diff = await other.pack_diff(f"ws/{_uniq('other')}:v1")
    finally:
        await other.stop()
    with pytest.raises(dsec.InvalidRequest, match="not the task's"):
        await Grader(client).grade_diff(task, diff)
    with pytest.raises(dsec.InvalidRequest):
        Task(image="base/debian:12", layers=[], hidden_tests={"../x.py": ""})


def _live(c: dsec.Client, label: str) -> list[str]:
    return [s.sandbox_id for s in c.list(labels={"t": label})
            if s.state not in (dsec.SandboxState.stopped, dsec.SandboxState.failed)]


def test_gymnasium_episode_with_a_scripted_policy(platform: Platform, task: Task) -> None:
    from dsec.client.rl import SandboxEnv

    label = _uniq("env")
    with dsec.Client(url=platform.url, token=TOKEN) as c:
        env = SandboxEnv(c, task, args=dsec.ContainerArgs(labels={"t": label}), step_timeout_s=30)
        try:
            obs, info = env.reset(seed=1)
            assert obs == task.prompt and _live(c, label) == [info["sandbox_id"]]
            assert env.observation_space.contains(obs)
            obs, reward, term, trunc, info = env.step("cat proj/calc.py")  # from the workspace
            assert "a - b" in obs and (reward, term, trunc) == (0.0, False, False)
            assert env.observation_space.contains(obs)
            obs, reward, term, trunc, info = env.step("ls /dsec-grader-* proj/test_calc.py")
            assert info["exit_code"] != 0 and info["failure"] == "workload"
            obs, reward, term, trunc, info = env.step(FIX)
            assert info["exit_code"] == 0
            obs, reward, term, trunc, info = env.step("submit")
            assert (reward, term, trunc) == (1.0, True, False), obs
            assert info["grade"].passed == 2 and "reward 1" in obs
            assert _live(c, label) == []  # the episode's sandbox is stopped once graded
            with pytest.raises(RuntimeError, match="reset"):
                env.step("true")
            # a second episode starts from the pristine task again, and runs out of turns
            obs, info = env.reset(seed=2)
            for i in range(task.max_turns):
                obs, reward, term, trunc, info = env.step("grep -c 'a - b' proj/calc.py")
                assert (term, trunc) == (False, i == task.max_turns - 1)
                assert "1" in obs
            assert reward == 0.0 and info["grade"].failed == 2
            env.reset()
            assert len(_live(c, label)) == 1
        finally:
            env.close()
        assert _live(c, label) == []


def test_gymnasium_env_checker(platform: Platform, task: Task) -> None:
    from gymnasium.utils.env_checker import check_env

    from dsec.client.rl import SandboxEnv

    label = _uniq("check")
    with dsec.Client(url=platform.url, token=TOKEN) as c:
        env = SandboxEnv(c, task, args=dsec.ContainerArgs(labels={"t": label}), step_timeout_s=10,
                         max_obs_chars=2048, max_action_chars=64)
        try:
            check_env(env, skip_render_check=True)
        finally:
            env.close()
        assert _live(c, label) == []


def test_dsec_imports_without_gymnasium() -> None:
    code = ("import sys; sys.modules['gymnasium'] = None; import dsec, dsec.client.rl; "
            "assert dsec.client.rl.Grader\n"
            "try:\n    dsec.client.rl.SandboxEnv\nexcept ImportError:\n    print('lazy')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "lazy", r.stderr
