"""The GRPO example's agent loop, run by dsec's rollout workers (``examples.grpo.agent:solve``).

One rollout: the sandbox was forked from the task's snapshot (the buggy package under
/work/<package>); the agent shows the model the bug report and the candidate edits, asks
which to apply, applies it, checks that the package still imports, and has the grader run
the hidden tests in a sandbox of its own (the tests live in the worker, in
examples/grpo/tasks.py, and never enter the agent's sandbox). Every model call, command and
the grading are steps of the rollout's journal, so a rollout whose worker died is finished
by another without redoing any of them.
"""

from __future__ import annotations

import re

from dsec.client.rl import Grader
from dsec.client.rollouts import RolloutContext
from examples.grpo.tasks import TaskDef, task_by_name, to_task

ANSWER = re.compile(r"APPLY\s+(\d+)")


def prompt(td: TaskDef) -> str:
    """What the model sees. The "TASK:" and "CANDIDATES:" lines are all the toy policy
    reads (examples/grpo/policy.py); a language model reads the rest."""
    edits = "\n".join(f"  {i}: {c}" for i, c in enumerate(td.candidates))
    return (f"TASK: {td.name}\nCANDIDATES: {len(td.candidates)}\n\n{td.prompt}\n"
            f"The source of {td.package} {td.version} is in {td.workspace_dir}. One of these shell edits, run "
            f"there, fixes the bug:\n{edits}\nAnswer with exactly one line: APPLY <number>.")


async def solve(ctx: RolloutContext) -> dict[str, object]:
    td = task_by_name(str(ctx.task["task"]))
    sb = ctx.require_sandbox()
    if ctx.llm is None:
        raise ValueError("the GRPO example needs an inference endpoint")
    reply = await ctx.llm.chat([{"role": "user", "content": prompt(td)}], temperature=1.0,
                               seed=int(ctx.task.get("seed", 0)), max_tokens=16)
    text = str(reply["choices"][0]["message"].get("content") or "")
    m = ANSWER.search(text)
    action = int(m.group(1)) if m and int(m.group(1)) < len(td.candidates) else None
    if action is not None:
        await sb.exec(td.candidates[action], cwd=td.workspace_dir, timeout=60)
    check = await sb.exec(["python3", "-c", f"import sys; sys.path.insert(0, {td.solution_path!r}); "
                           f"import {td.modules[0].removesuffix('.py')}"], timeout=60)

    async def grade() -> dict[str, object]:
        g = await Grader(ctx.client).grade(to_task(td, str(ctx.task["snapshot"])), sb.raw)
        return {"reward": g.reward, "passed": g.passed, "total": g.total, "failure": g.failure}
    verdict = await ctx.record("grade", grade)
    return {"reward": verdict["reward"], "action": action, "task": td.name, "imports": check.exit_code == 0,
            "grade": verdict, "failure": verdict["failure"] if verdict["failure"] == "infra" else None}
