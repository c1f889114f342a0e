"""The agent bench/rl_service.py submits (imported by its rollout worker with ``--path bench``)."""

from __future__ import annotations

from dsec.client.rollouts import RolloutContext


async def loop(ctx: RolloutContext) -> float:
    """``task["turns"]`` turns of a small shell command, each a journaled step."""
    sb = ctx.require_sandbox()
    for t in range(int(ctx.task["turns"])):
        await sb.run_shell(f"echo {t} >> /tmp/turns")
    return 1.0
