"""Grading a rollout without letting it grade itself (docs/rl.md, "Grading without reward
hacking").

The agent's sandbox is never trusted with the verdict. Its writes are taken with
``pack_diff`` (only those under the task's workspace: everything else is scrubbed), a
FRESH sandbox is made from the task's pristine image and layers plus that diff, the hidden
tests are written into it afterwards, into a directory of a random name outside the
workspace, and pytest runs there in isolated mode with its configuration, rootdir and
conftest search pinned to that directory. The tests exist only in this process and in the
grading sandbox, which is stopped when the verdict is in.
"""

from __future__ import annotations

import posixpath
import secrets
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Literal

from dsec.client.sdk.client import AsyncClient, AsyncSandbox
from dsec.shared.errors import DsecError, InvalidRequest
from dsec.shared.wire.layers import Layer
from dsec.shared.wire.models import ContainerArgs

# top-level directories of a Linux root that are never part of a workspace: scrubbed from
# the agent's diff even if a listing of / raced with the agent creating or renaming them
_SYSTEM_DIRS = ("bin", "boot", "dev", "etc", "home", "lib", "lib32", "lib64", "libx32", "media", "mnt", "opt",
                "proc", "root", "run", "sbin", "srv", "sys", "tmp", "usr", "var")
_OUTPUT_TAIL = 4096
_MAX_JUNIT_BYTES = 4 << 20


@dataclass(frozen=True)
class Task:
    """One RL task: a prepared workspace (``image`` + ``layers``, e.g. a pack_diff of a
    sandbox where the repository was checked out), the hidden tests that grade it (relative
    path -> content; they are never written into the agent's stack), and the episode budget."""

    image: str
    layers: list[str]
    hidden_tests: dict[str, str]
    workspace: str = "/work"
    solution_path: str | None = None  # put on the tests' sys.path (appended); default: workspace
    prompt: str = ""
    max_turns: int = 20
    expected_tests: int | None = None  # when known, fewer reported tests is a failure
    test_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        ws = posixpath.normpath(self.workspace)
        if not ws.startswith("/") or ws == "/" or ws.count("/") != 1:
            raise InvalidRequest(f"workspace {self.workspace!r} must be a top-level directory such as /work",
                                 field="workspace")
        for rel in self.hidden_tests:
            norm = posixpath.normpath(rel)
            if rel.startswith("/") or norm.startswith("..") or norm == ".":
                raise InvalidRequest(f"hidden test path {rel!r} must be relative and stay inside the tests' "
                                     "directory", field="hidden_tests")
        if not self.hidden_tests:
            raise InvalidRequest("a task needs hidden tests", field="hidden_tests")


@dataclass
class GradeResult:
    """The verdict on one rollout. ``failure``: None when every test passed, "workload" when
    the agent's work failed them (or hung past the timeout), "infra" when the platform failed
    while grading: mask such a rollout out, its ``reward`` means nothing."""

    reward: float
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    total: int = 0
    exit_code: int | None = None
    timed_out: bool = False
    failure: Literal["workload", "infra"] | None = None
    reason: str = ""
    output_tail: str = ""
    diff_ref: str | None = None
    duration_s: float = 0.0
    details: dict[str, str] = field(default_factory=dict)


def _junit_counts(xml: bytes) -> tuple[int, int, int, int]:
    """(tests, failures, errors, skipped) summed over the testsuites of a junit xml."""
    root = ET.fromstring(xml)
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    if not suites:
        raise ValueError("no testsuite in the junit xml")
    tot = [0, 0, 0, 0]
    for s in suites:
        for i, k in enumerate(("tests", "failures", "errors", "skipped")):
            tot[i] += int(s.get(k, "0"))
    return tot[0], tot[1], tot[2], tot[3]


class Grader:
    """Grades rollouts of tasks. ``reward``: "binary" (1.0 only when every test passed) or
    "fraction" (passed / total). ``args``: limits of the grading sandboxes (their image,
    layers and network are always the grader's: no network at all)."""

    def __init__(self, client: AsyncClient, *, reward: Literal["binary", "fraction"] = "binary",
                 args: ContainerArgs | None = None, keep_diff: bool = False) -> None:
        self.client = client
        self.reward_mode = reward
        self.args = args or ContainerArgs()
        self.keep_diff = keep_diff

    def scrub_paths(self, task: Task, top_level: list[str]) -> list[str]:
        """What of the agent's writes is left out of its diff: every top-level entry but the
        workspace (so system files, site-packages, pytest, python, /conftest.py and the like
        never reach the grading sandbox)."""
        keep = task.workspace.strip("/")
        names = set(_SYSTEM_DIRS) | {n for n in top_level if n not in (".", "..")}
        names.discard(keep)
        return sorted(f"/{n}" for n in names)

    async def take_diff(self, task: Task, agent: AsyncSandbox) -> Layer:
        """The agent's workspace writes as a layer over the task's stack."""
        top = [f.name for f in await agent.list_dir("/")]
        ref = f"ws/grade-{agent.sandbox_id[:12].lower()}-{secrets.token_hex(4)}:v1"
        return await agent.pack_diff(ref, scrub_paths=self.scrub_paths(task, top))

    async def grade(self, task: Task, agent: AsyncSandbox) -> GradeResult:
        """Take the agent's diff and grade it (the agent's sandbox keeps running)."""
        t0 = time.monotonic()
        try:
            diff = await self.take_diff(task, agent)
        except DsecError as e:
            if not e.infra:
                raise  # the caller's mistake (a bad request), not a verdict on the rollout
            return GradeResult(0.0, failure="infra", reason=f"pack_diff of the agent's sandbox: {e}",
                               duration_s=time.monotonic() - t0)
        return await self.grade_diff(task, diff, t0=t0)

    async def grade_diff(self, task: Task, diff: Layer, *, t0: float | None = None) -> GradeResult:
        """Grade a diff taken from a sandbox of ``task``'s stack."""
        t0 = time.monotonic() if t0 is None else t0
        if diff.parent_image != task.image or diff.parent_layers != list(task.layers):
            raise InvalidRequest(f"diff {diff.ref!r} was taken over {diff.parent_image} + {diff.parent_layers}, "
                                 f"not the task's {task.image} + {task.layers}", field="diff")
        try:
            res = await self._run(task, diff)
        except DsecError as e:
            if not e.infra:
                raise
            res = GradeResult(0.0, failure="infra", reason=f"grading: {e}")
        finally:
            if not self.keep_diff:
                try:
                    await self.client.remove_layer(diff.ref)
                except DsecError:
                    pass  # in use or gone: gc takes it later
        res.diff_ref = diff.ref
        res.duration_s = time.monotonic() - t0
        return res

    async def _run(self, task: Task, diff: Layer) -> GradeResult:
        args = self.args.model_copy(update={
            "image": task.image, "layers": [*task.layers, diff.ref], "network_rules": None, "env": {},
            "labels": {**self.args.labels, "dsec.rl/role": "grader"}, "protected_paths": []})
        sb = await self.client.run_container(ContainerArgs.model_validate(args.model_dump()))
        try:
            return await self._test(task, sb)
        finally:
            try:
                await sb.stop()
            except DsecError:
                pass

    async def _test(self, task: Task, sb: AsyncSandbox) -> GradeResult:
        # written after the diff is applied, into a directory whose name the agent cannot know
        # (and whose parent, /, keeps nothing of the agent's: every top-level entry but the
        # workspace was scrubbed)
        d = f"/dsec-grader-{secrets.token_hex(8)}"
        mk = await sb.exec(["mkdir", "-m", "700", d], timeout=30)
        if mk.exit_code != 0:
            return GradeResult(0.0, failure="infra", reason=f"mkdir {d}: {mk.stderr.strip()}")
        solution = task.solution_path or task.workspace
        await sb.write_file(f"{d}/pytest.ini", "[pytest]\naddopts =\n")
        await sb.write_file(f"{d}/conftest.py",
                            f"import sys\nsys.path.append({solution!r})\n")
        for rel, text in task.hidden_tests.items():
            path = posixpath.join(d, posixpath.normpath(rel))
            parent = posixpath.dirname(path)
            if parent != d:
                await sb.exec(["mkdir", "-p", parent], timeout=30)
            await sb.write_file(path, text)
        junit = f"{d}/junit-{secrets.token_hex(6)}.xml"
        argv = ["python3", "-I", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", f"{d}/pytest.ini",
                "--rootdir", d, "--confcutdir", d, "--junitxml", junit, d]
        env = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": d}
        r = await sb.exec(argv, cwd=d, env=env, timeout=task.test_timeout_s, max_output_bytes=1 << 20)
        tail = (r.stdout + r.stderr)[-_OUTPUT_TAIL:]
        base = GradeResult(0.0, exit_code=r.exit_code, timed_out=r.timed_out, output_tail=tail)
        if r.failure == "infra":
            base.failure, base.reason = "infra", "the platform lost the test command"
            return base
        if r.timed_out:
            base.failure, base.reason = "workload", f"the tests ran past {task.test_timeout_s:g} s"
            return base
        try:
            st = await sb.stat(junit)
            if st.size > _MAX_JUNIT_BYTES:
                raise ValueError("junit xml too large")
            tests, failures, errors, skipped = _junit_counts(await sb.read_file(junit))
        except (DsecError, ValueError, ET.ParseError) as e:
            if isinstance(e, DsecError) and e.infra:
                base.failure, base.reason = "infra", f"reading the junit xml: {e}"
            else:  # the run never wrote a report: killed, exited early, or broke pytest
                base.failure, base.reason = "workload", f"no junit report from the test run ({e})"
            return base
        passed = max(0, tests - failures - errors - skipped)
        base.passed, base.failed, base.errors, base.skipped, base.total = passed, failures, errors, skipped, tests
        expected = task.expected_tests
        complete = tests > 0 and (expected is None or tests == expected)
        all_ok = r.exit_code == 0 and complete and passed == tests
        if self.reward_mode == "fraction":
            denom = max(tests, expected or 0)
            base.reward = passed / denom if denom and r.exit_code in (0, 1) else 0.0
        else:
            base.reward = 1.0 if all_ok else 0.0
        if not all_ok:
            base.failure = "workload"
            base.reason = (f"{passed}/{tests} passed, exit code {r.exit_code}"
                           + ("" if complete else f", {expected} tests expected"))
        return base
