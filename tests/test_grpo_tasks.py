"""The GRPO example's task set (examples/grpo/tasks.py): every task's bug, hidden tests
and candidate edits checked against the real sources on this host (no platform), and the
CI tasks built as layers on a real platform and graded: the untouched workspace earns 0,
the right edit 1, a wrong one 0."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

import dsec
from dsec.client.rl import Grader
from examples.grpo.tasks import (
    CI_TASKS,
    TASKS,
    TaskDef,
    _unpack,
    build_task_layers,
    fetch_sources,
    task_by_name,
    to_task,
)
from tests.conftest import TOKEN, Platform

# the sdists are fetched once per machine, not once per run (a download builds their
# metadata, which takes most of a minute for the whole set)
CACHE = os.environ.get("DSEC_GRPO_CACHE", os.path.expanduser("~/.cache/dsec-grpo-sources"))


@pytest.fixture(scope="module")
def sources() -> dict[str, str]:
    return fetch_sources(CACHE, TASKS)


def _run_hidden(td: TaskDef, ws: Path) -> subprocess.CompletedProcess[str]:
    """The hidden tests, in a directory of their own, against the package in ``ws``."""
    tdir = ws.parent / "hidden"
    shutil.rmtree(tdir, ignore_errors=True)
    tdir.mkdir()
    (tdir / "pytest.ini").write_text("[pytest]\naddopts =\n")
    for rel, text in td.hidden_tests.items():
        (tdir / rel).parent.mkdir(parents=True, exist_ok=True)
        (tdir / rel).write_text(text)
    env = {**os.environ, "PYTHONPATH": str(ws / td.module_dir), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
           "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("FORCE_COLOR", None)
    env.pop("NO_COLOR", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
                           str(tdir / "pytest.ini"), "--rootdir", str(tdir), str(tdir)],
                          cwd=tdir, env=env, capture_output=True, text=True, timeout=120)


def _copy(root: str, dest: Path, td: TaskDef, buggy: bool) -> Path:
    shutil.copytree(root, dest)
    if buggy:
        f = dest / td.file
        f.write_text(td.inject(f.read_text()))
    return dest


@pytest.mark.parametrize("td", TASKS, ids=[t.name for t in TASKS])
def test_bug_hidden_tests_and_candidates_on_the_real_source(td: TaskDef, sources: dict[str, str],
                                                           tmp_path: Path) -> None:
    root = sources[td.package]
    assert (Path(root) / td.file).read_text().count(td.original) == 1
    assert 0 <= td.fix < len(td.candidates) == 4
    ok = _run_hidden(td, _copy(root, tmp_path / "orig" / "pkg", td, buggy=False))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = _run_hidden(td, _copy(root, tmp_path / "buggy" / "pkg", td, buggy=True))
    assert bad.returncode == 1 and " failed" in bad.stdout, bad.stdout + bad.stderr
    for i, cmd in enumerate(td.candidates):
        ws = _copy(root, tmp_path / f"cand{i}" / "pkg", td, buggy=True)
        subprocess.run(["bash", "-c", cmd], cwd=ws, check=True, timeout=60)
        r = _run_hidden(td, ws)
        if i == td.fix:
            assert r.returncode == 0, f"candidate {i} ({cmd}) is the fix:\n{r.stdout}{r.stderr}"
        else:
            assert r.returncode == 1, f"candidate {i} ({cmd}) is not the fix but passes:\n{r.stdout}{r.stderr}"


@pytest.mark.parametrize("name", ["../evil.py", "/abs.py", "pkg/../../evil.py"])
def test_unpack_refuses_paths_outside_the_destination(name: str, tmp_path: Path) -> None:
    archive = tmp_path / "x-1.0.tar.gz"
    with tarfile.open(archive, "w:gz") as t:
        ti = tarfile.TarInfo(name)
        t.addfile(ti, io.BytesIO(b""))
    with pytest.raises(ValueError, match="unsafe path"):
        _unpack(str(archive), str(tmp_path / "out"))
    assert not (tmp_path / "evil.py").exists()


def test_task_set_shape() -> None:
    assert len(TASKS) == 6 and len({t.name for t in TASKS}) == 6
    assert len({t.package for t in TASKS}) >= 4
    assert len(CI_TASKS) == 2 and all(task_by_name(n) for n in CI_TASKS)
    for td in TASKS:
        t = to_task(td, f"ws/grpo-{td.name}:v1")
        assert t.solution_path == td.solution_path and t.solution_path.startswith(td.workspace_dir)
        assert t.expected_tests and t.expected_tests >= 3


async def test_no_task_package_is_installed_in_the_image(debian: dsec.AsyncSandbox) -> None:
    # the grader appends the workspace to sys.path: an installed copy would be imported instead
    mods = sorted({m.removesuffix(".py") for td in TASKS for m in td.modules})
    r = await debian.exec(["python3", "-c", "import importlib.util, sys\n"
                           "print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m)))", *mods])
    assert (r.exit_code, r.stdout.strip()) == (0, ""), r.stdout + r.stderr


@pytest.fixture(scope="module")
async def ci_layers(platform: Platform) -> dict[str, str]:
    async with dsec.AsyncClient(url=platform.url, token=TOKEN) as c:
        t0 = time.monotonic()
        refs = await build_task_layers(c, CACHE, [task_by_name(n) for n in CI_TASKS])
        print(f"built {len(refs)} task layers in {time.monotonic() - t0:.1f} s")
        return refs


async def _agent(client: dsec.AsyncClient, td: TaskDef, layer: str, cmd: str | None) -> dsec.AsyncSandbox:
    sb = await client.run_container(dsec.ContainerArgs(image="base/debian:12", layers=[layer]))
    if cmd is not None:
        r = await sb.exec(cmd, cwd=td.workspace_dir, timeout=60)
        assert r.exit_code == 0, r.stdout + r.stderr
    return sb


@pytest.mark.parametrize("name", CI_TASKS)
async def test_ci_task_grades_untouched_0_fix_1_wrong_0(name: str, client: dsec.AsyncClient,
                                                        ci_layers: dict[str, str]) -> None:
    td = task_by_name(name)
    layer = ci_layers[name]
    task = to_task(td, layer)
    # the layer is reused, not rebuilt, when it exists
    assert await build_task_layers(client, CACHE, [td]) == {name: layer}
    wrong = next(i for i in range(len(td.candidates)) if i != td.fix)
    agents = [await _agent(client, td, layer, cmd) for cmd in (None, td.candidates[td.fix], td.candidates[wrong])]
    try:
        # the workspace holds the package with the bug, and no tests of its own
        src = (await agents[0].read_file(f"{td.workspace_dir}/{td.file}")).decode()
        assert td.buggy in src and td.original not in src
        listing = await agents[0].exec(f"find {td.workspace_dir} -name 'test*'", timeout=30)
        assert listing.stdout.strip() == ""
        grader = Grader(client)
        untouched, fixed, wrong_g = [await grader.grade(task, sb) for sb in agents]
        n = task.expected_tests
        assert (untouched.reward, untouched.failure) == (0.0, "workload"), untouched
        assert untouched.failed >= 1 and untouched.total == n, untouched
        assert (fixed.reward, fixed.passed, fixed.total, fixed.failure) == (1.0, n, n, None), fixed
        assert (wrong_g.reward, wrong_g.failure) == (0.0, "workload"), wrong_g
    finally:
        for sb in agents:
            await sb.stop()
