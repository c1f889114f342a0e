"""A gymnasium environment over dsec sandboxes (docs/rl.md, "A gymnasium environment").

An episode is one rollout of a :class:`~dsec.client.rl.grader.Task`: ``reset`` starts a fresh
sandbox from the task's stack, ``step`` runs one shell command in it (the observation is its
output), and the ``submit`` action (or the last turn of the budget) ends the episode with
the reward of a :class:`~dsec.client.rl.grader.Grader`, which grades in a sandbox of its own.
"""

from __future__ import annotations

import string
from typing import Any, SupportsFloat

import gymnasium
from gymnasium import spaces

from dsec.client.rl.grader import Grader, GradeResult, Task
from dsec.client.sdk.client import AsyncClient, AsyncSandbox
from dsec.client.sdk.sync import Client
from dsec.shared.errors import DsecError
from dsec.shared.wire.models import ContainerArgs

SUBMIT = "submit"
# what an observation may hold: printable ASCII; anything else comes back as "?"
CHARSET = frozenset(string.printable)


def _clean(text: str, limit: int) -> str:
    text = "".join(c if c in CHARSET else "?" for c in text)
    if len(text) > limit:
        head = f"[... {len(text) - limit + 40} characters cut ...]\n"
        text = head + text[-(limit - len(head)):]
    return text


class AsyncSandboxEnv:
    """The episode logic, async: what :class:`SandboxEnv` drives through the sync SDK's
    event loop, and what an asyncio rollout worker uses directly (the same methods,
    awaited)."""

    def __init__(self, client: AsyncClient, task: Task, *, grader: Grader | None = None,
                 args: ContainerArgs | None = None, step_timeout_s: float = 60.0, max_obs_chars: int = 8192,
                 submit_action: str = SUBMIT, session: str | None = None) -> None:
        self.client = client
        self.session = session
        self.task = task
        self.grader = grader or Grader(client)
        self.args = args or ContainerArgs()
        self.step_timeout_s = step_timeout_s
        self.max_obs_chars = max_obs_chars
        self.submit_action = submit_action
        self.sandbox: AsyncSandbox | None = None
        self.turn = 0
        self.done = True
        self.last_grade: GradeResult | None = None

    async def reset(self) -> tuple[str, dict[str, Any]]:
        await self.close()
        args = self.args.model_copy(update={
            "image": self.task.image, "layers": list(self.task.layers),
            "labels": {**self.args.labels, "dsec.rl/role": "agent"}})
        self.sandbox = await self.client.run_container(ContainerArgs.model_validate(args.model_dump()))
        self.turn, self.done, self.last_grade = 0, False, None
        return _clean(self.task.prompt, self.max_obs_chars), {"sandbox_id": self.sandbox.sandbox_id,
                                                              "max_turns": self.task.max_turns}

    async def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.done or self.sandbox is None:
            raise RuntimeError("the episode is over: call reset()")
        if action.strip() == self.submit_action:
            return await self._finish("", {}, terminated=True)
        self.turn += 1
        info: dict[str, Any] = {"turn": self.turn}
        try:
            if self.session is None:  # one shell per action, from the workspace
                r = await self.sandbox.exec(action, timeout=self.step_timeout_s, cwd=self.task.workspace)
            else:  # a persistent shell: cd, env and background jobs carry over between turns
                r = await self.sandbox.run_shell(action, session=self.session, timeout=self.step_timeout_s)
        except DsecError as e:
            if not e.infra:
                raise
            # the platform lost the rollout: end it, and say so (a trainer masks it out)
            self.done = True
            info.update(failure="infra", error=str(e))
            return _clean(f"[platform error: {e}]", self.max_obs_chars), 0.0, False, True, info
        out = r.stdout + r.stderr + (f"\n[timed out after {self.step_timeout_s:g} s]" if r.timed_out else "") + \
            f"\n[exit code {r.exit_code}]"
        info.update(exit_code=r.exit_code, timed_out=r.timed_out, failure=r.failure)
        obs = _clean(out, self.max_obs_chars)
        if self.turn >= self.task.max_turns:
            return await self._finish(obs, info, terminated=False)
        return obs, 0.0, False, False, info

    async def _finish(self, obs: str, info: dict[str, Any], *, terminated: bool
                      ) -> tuple[str, float, bool, bool, dict[str, Any]]:
        assert self.sandbox is not None
        self.done = True
        g = await self.grader.grade(self.task, self.sandbox)
        self.last_grade = g
        info.update(grade=g, grade_failure=g.failure)
        if g.failure == "infra":
            info["failure"] = "infra"
        await self._stop()
        summary = f"[submitted: reward {g.reward:g}, {g.passed}/{g.total} hidden tests passed]"
        obs = f"{obs}\n{summary}" if obs else summary
        return _clean(obs, self.max_obs_chars), float(g.reward), terminated, not terminated, info

    async def _stop(self) -> None:
        sb, self.sandbox = self.sandbox, None
        if sb is not None:
            try:
                await sb.stop()
            except DsecError:
                pass  # already gone

    async def close(self) -> None:
        self.done = True
        await self._stop()


class SandboxEnv(gymnasium.Env[str, str]):
    """gymnasium's Env over a dsec sandbox: an action is a shell command (or ``submit``), an
    observation is its output (printable ASCII, at most ``max_obs_chars``), the reward is 0
    until the episode ends and then the grader's. ``terminated``: the agent submitted;
    ``truncated``: the turn budget ran out (graded all the same) or the platform lost the
    sandbox (``info["failure"] == "infra"``: mask the rollout out)."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, client: Client, task: Task, *, grader: Grader | None = None,
                 args: ContainerArgs | None = None, step_timeout_s: float = 60.0, max_obs_chars: int = 8192,
                 max_action_chars: int = 4096, submit_action: str = SUBMIT, session: str | None = None) -> None:
        self._client = client
        self.core = AsyncSandboxEnv(client._inner, task, grader=grader, args=args, step_timeout_s=step_timeout_s,
                                    max_obs_chars=max_obs_chars, submit_action=submit_action, session=session)
        charset = "".join(sorted(CHARSET))
        self.observation_space = spaces.Text(max_length=max_obs_chars, min_length=0, charset=charset)
        self.action_space = spaces.Text(max_length=max_action_chars, min_length=1, charset=charset)

    @property
    def sandbox_id(self) -> str | None:
        return self.core.sandbox.sandbox_id if self.core.sandbox else None

    @property
    def last_grade(self) -> GradeResult | None:
        return self.core.last_grade

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        return self._client._portal.call(self.core.reset())

    def step(self, action: str) -> tuple[str, SupportsFloat, bool, bool, dict[str, Any]]:
        return self._client._portal.call(self.core.step(action))

    def close(self) -> None:
        self._client._portal.call(self.core.close())
        super().close()
