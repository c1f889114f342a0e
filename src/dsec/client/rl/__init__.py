"""dsec for RL: grading rollouts without reward hacking, preemption for trainers, and a gymnasium environment
(docs/rl.md). ``SandboxEnv``/``AsyncSandboxEnv`` need the ``gymnasium`` package and are
imported on first use, so ``dsec.client.rl`` itself does not."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dsec.client.rl.grader import Grader, GradeResult, Task
from dsec.client.rl.preemption import Preempted, Preemptible, preemptible

if TYPE_CHECKING:
    from dsec.client.rl.env import AsyncSandboxEnv, SandboxEnv

__all__ = ["AsyncSandboxEnv", "GradeResult", "Grader", "Preempted", "Preemptible", "SandboxEnv", "Task",
           "preemptible"]


def __getattr__(name: str) -> Any:
    if name in ("SandboxEnv", "AsyncSandboxEnv"):
        from dsec.client.rl import env
        return getattr(env, name)
    raise AttributeError(f"module 'dsec.client.rl' has no attribute {name!r}")
