"""Agent loops the rollout tests submit (imported by a real ``dsec rollout-worker`` process
started with ``--path`` at the repo root), and a trainer the tests run as a process and kill."""

from __future__ import annotations

import asyncio
import json
import sys

from dsec.client.rollouts import RolloutContext


async def turns(ctx: RolloutContext) -> dict[str, object]:
    """``task["turns"]`` turns, each an inference call (when the spec has an endpoint) and a
    shell command appending one line to /work/log, then counts the lines."""
    sb = ctx.require_sandbox()
    for t in range(int(ctx.task.get("turns", 3))):
        word = f"t{t}"
        if ctx.llm is not None:
            reply = await ctx.llm.chat([{"role": "user", "content": f"{ctx.rollout_id} turn {t}"}])
            word = reply["choices"][0]["message"]["content"]
        await sb.run_shell(f"mkdir -p /work && echo {word} >> /work/log && sleep {ctx.task.get('sleep', 0)}")
    r = await sb.exec("wc -l < /work/log")
    return {"reward": float(ctx.task.get("reward", 1.0)), "lines": int(r.stdout.strip()), "attempt": ctx.attempt}


async def noisy(ctx: RolloutContext) -> dict[str, object]:
    """A command that floods its output with control characters: the journaled result keeps
    the first 64 KiB and says it was cut."""
    sb = ctx.require_sandbox()
    r = await sb.run_shell("head -c 3000000 /dev/zero | tr '\\0' '\\1'; echo done >&2")
    return {"reward": 1.0, "len": len(r.stdout), "cut": r.stdout_truncated, "stderr": r.stderr}


async def broken(ctx: RolloutContext) -> None:
    raise ValueError("a bug in the agent")


async def loses_sandbox(ctx: RolloutContext) -> dict[str, object]:
    """Its first attempt loses its sandbox under a command (an infra failure): the platform
    runs it again from the start on a new one."""
    sb = ctx.require_sandbox()
    await sb.run_shell("echo one >> /tmp/log")
    if ctx.attempt == 1:
        await sb.raw.stop()
    await sb.run_shell("echo two >> /tmp/log")
    r = await sb.exec("cat /tmp/log")
    return {"reward": 1.0, "log": r.stdout.split(), "attempt": ctx.attempt}


async def noted(ctx: RolloutContext) -> float:
    """A step of the agent's own (a random draw) is recorded like the others."""
    import random
    return float(await ctx.record("draw", lambda: asyncio.sleep(0, random.random())))


async def trainer(url: str, token: str, keys: list[str], consume: int, out: str, hang: bool) -> None:
    """Submit a rollout per key (resubmitting is harmless), take ``consume`` finished ones
    (appending each to ``out`` and acknowledging it), then stop (or with ``hang``, wait to be killed)."""
    import dsec
    async with dsec.AsyncClient(url=url, token=token) as c:
        specs = [dsec.RolloutSpec(agent="tests.rollout_agents:turns", key=k, task={"turns": 2, "sleep": 0.5},
                                  args=dsec.ContainerArgs(image="base/busybox:latest")) for k in keys]
        await c.rollouts.submit(specs)
        taken = 0
        async for r in c.rollouts.finished(timeout=120):
            with open(out, "a") as f:
                f.write(json.dumps({"id": r.id, "key": r.key, "pid": __import__("os").getpid()}) + "\n")
            await c.rollouts.ack([r.id])
            taken += 1
            if taken >= consume:
                break
        while hang:
            await asyncio.sleep(3600)


if __name__ == "__main__":
    asyncio.run(trainer(sys.argv[1], sys.argv[2], sys.argv[3].split(","), int(sys.argv[4]), sys.argv[5],
                        sys.argv[6] == "hang"))
