"""The GRPO example's trainer: a process that may be killed at any moment.

Each step submits, per task, a GRPO group of ``group`` rollouts forked from the task's
snapshot to dsec's rollout service (keys ``<run>/s<step>/<task>/<i>``, so a restarted
trainer resubmitting a step gets the same rollouts back, finished or not), collects them
by id, masks out rollouts the platform failed (``failure == "infra"``), computes
group-relative advantages, updates the policy, and checkpoints (policy, step, reward curve)
before the next step. It runs under :class:`dsec.client.rl.Preemptible`: SIGTERM pauses the job
(its sandboxes and the workers' steps hold), the next trainer resumes it.

The policy is served at ``--policy-port`` as an OpenAI-compatible endpoint (the toy in
examples/grpo/policy.py), or is any model server given with ``--llm-url`` (then nothing
here is trained: the example only measures its rewards).

    python -m examples.grpo.trainer --run r1 --steps 6 --state-dir /tmp/grpo-r1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import zlib

import dsec
from dsec.client.rl import Preemptible
from examples.grpo.policy import Policy, serve
from examples.grpo.tasks import CI_TASKS, TASKS, build_task_layers, task_by_name

AGENT = "examples.grpo.agent:solve"
FINISHED = ("done", "failed", "cancelled")


def task_names(spec: str) -> list[str]:
    """``all``, ``ci`` (the two quickest) or names, comma-separated."""
    return list(CI_TASKS) if spec == "ci" else [t.name for t in TASKS] if spec == "all" else spec.split(",")


def _load(path: str) -> dict[str, object] | None:
    try:
        with open(path) as f:
            data: dict[str, object] = json.load(f)
            return data
    except FileNotFoundError:
        return None


def _save(path: str, data: dict[str, object]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # a kill mid-write leaves the previous checkpoint whole


def _advantages(rewards: list[float]) -> list[float]:
    mean = statistics.fmean(rewards)
    std = statistics.pstdev(rewards)
    return [(r - mean) / (std + 1e-6) for r in rewards]


def _infra(r: dsec.RolloutInfo) -> bool:
    if r.failure == "infra" or r.state == "cancelled":
        return True
    return isinstance(r.result, dict) and r.result.get("failure") == "infra"  # the grading sandbox was lost


async def _collect(client: dsec.AsyncClient, ids: list[str]) -> list[dsec.RolloutInfo]:
    """Every rollout of the step, once finished (by id: the platform holds them meanwhile)."""
    done: dict[str, dsec.RolloutInfo] = {}
    while len(done) < len(ids):
        todo = [i for i in ids if i not in done]
        for r in await asyncio.gather(*(client.rollouts.get(i) for i in todo)):
            if r.state in FINISHED:
                done[r.id] = r
        if len(done) < len(ids):
            await asyncio.sleep(0.5)
    return [done[i] for i in ids]


async def train(a: argparse.Namespace) -> None:
    os.makedirs(a.state_dir, exist_ok=True)
    ckpt_path = os.path.join(a.state_dir, "checkpoint.json")
    ckpt = _load(ckpt_path) or {"step": 0, "policy": Policy(seed=a.seed).to_json(), "curve": []}
    policy = Policy.from_json(ckpt["policy"])  # type: ignore[arg-type]
    curve: list[dict[str, object]] = list(ckpt["curve"])  # type: ignore[call-overload]
    start = int(ckpt["step"])  # type: ignore[call-overload]
    tds = [task_by_name(n) for n in task_names(a.tasks)]
    print(json.dumps({"event": "start", "pid": os.getpid(), "step": start}), flush=True)
    async with dsec.AsyncClient(url=a.url, token=a.token) as client:
        try:
            await client.create_job(a.job)
        except dsec.JobExists:
            pass
        async with Preemptible(client, a.job):
            refs = await build_task_layers(client, a.cache_dir, tds)
            runner = None
            if a.llm_url is None:
                runner = await serve(policy, "127.0.0.1", a.policy_port)
            endpoint = dsec.Inference(base_url=a.llm_url or f"http://127.0.0.1:{a.policy_port}/v1",
                                      model=a.model, api_key=a.api_key)
            try:
                for step in range(start, a.steps):
                    specs = [dsec.RolloutSpec(
                        agent=AGENT, key=f"{a.run}/s{step}/{td.name}/{i}", job=a.job, snapshot=refs[td.name],
                        args=dsec.ContainerArgs(memory_limit_mb=512, cpu_cores_limit=1.0),
                        task={"task": td.name, "snapshot": refs[td.name],
                              "seed": zlib.crc32(f"{a.run}/{step}/{td.name}/{i}".encode())},
                        inference=endpoint, labels={"run": a.run, "step": str(step)}, timeout_s=900)
                        for td in tds for i in range(a.group)]
                    t0 = time.monotonic()
                    infos = await client.rollouts.submit(specs)
                    print(json.dumps({"event": "submitted", "step": step, "rollouts": len(infos)}), flush=True)
                    results = await _collect(client, [i.id for i in infos])
                    rewards, masked = [], 0
                    for k, td in enumerate(tds):
                        group = results[k * a.group:(k + 1) * a.group]
                        # the platform's failures say nothing of the policy: masked out of the group
                        kept = [r for r in group if not _infra(r)]
                        masked += len(group) - len(kept)
                        rs = [float(r.reward or 0.0) for r in kept]  # a workload failure scores 0
                        rewards += rs
                        acts = [r.result.get("action") if isinstance(r.result, dict) else None for r in kept]
                        pairs = [(int(x), adv) for x, adv in zip(acts, _advantages(rs), strict=True)
                                 if isinstance(x, int)] if len(rs) > 1 else []
                        if a.llm_url is None and pairs:
                            policy.update(td.name, len(td.candidates), [p[0] for p in pairs],
                                          [p[1] for p in pairs], a.lr)
                    point: dict[str, object] = {
                        "step": step, "mean_reward": statistics.fmean(rewards) if rewards else None,
                        "masked": masked, "seconds": round(time.monotonic() - t0, 2),
                        "p_fix": {td.name: round(policy.probs(td.name, len(td.candidates))[td.fix], 3)
                                  for td in tds}}
                    curve.append(point)
                    _save(ckpt_path, {"step": step + 1, "policy": policy.to_json(), "curve": curve})
                    await client.rollouts.ack([r.id for r in results])
                    print(json.dumps({"event": "step", **point}), flush=True)
            finally:
                if runner is not None:
                    await runner.cleanup()
    print(json.dumps({"event": "end", "curve": curve}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="dsec apiserver (default $DSEC_URL or local)")
    p.add_argument("--token", default=None, help="API token (default $DSEC_TOKEN or the local file)")
    p.add_argument("--run", default="grpo", help="run name: the rollouts' keys and labels")
    p.add_argument("--job", default=None, help="dsec job (default grpo-<run>)")
    p.add_argument("--tasks", default="all", help="'all', 'ci' or task names, comma-separated")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--group", type=int, default=8, help="GRPO group size: rollouts per task per step")
    p.add_argument("--lr", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--state-dir", required=True, help="the trainer's checkpoint directory")
    p.add_argument("--cache-dir", default=os.environ.get("DSEC_GRPO_CACHE",
                                                         os.path.expanduser("~/.cache/dsec-grpo-sources")))
    p.add_argument("--policy-port", type=int, default=8461, help="where the toy policy is served")
    p.add_argument("--llm-url", default=None, help="an OpenAI-compatible endpoint instead of the toy policy")
    p.add_argument("--model", default="toy-softmax")
    p.add_argument("--api-key", default=None)
    a = p.parse_args()
    a.job = a.job or f"grpo-{a.run}"
    asyncio.run(train(a))


if __name__ == "__main__":
    main()
