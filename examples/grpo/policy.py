"""The toy policy of the GRPO example, and the OpenAI-compatible endpoint that serves it.

THIS IS THE TOY PART: instead of a language model, a softmax over each task's candidate
edits (one logit per candidate, per task: a tabular policy over a discrete action space),
trained by the example's GRPO loop. It answers chat completions by reading only the prompt's
"TASK:" and "CANDIDATES:" lines and replying "APPLY <k>", so the agent, the rollout workers
and the trainer run exactly as they would against a model server (vLLM, SGLang) at the same
URL. Sampling is seeded by the request's ``seed``, so a run is reproducible.
"""

from __future__ import annotations

import math
import random
import re
from typing import Any

from aiohttp import web

TASK_LINE = re.compile(r"^TASK:\s*(\S+)\s*$", re.M)
N_LINE = re.compile(r"^CANDIDATES:\s*(\d+)\s*$", re.M)


class Policy:
    def __init__(self, logits: dict[str, list[float]] | None = None, seed: int = 0) -> None:
        self.logits = logits or {}
        self.seed = seed

    def probs(self, task: str, n: int) -> list[float]:
        z = self.logits.setdefault(task, [0.0] * n)
        m = max(z)
        e = [math.exp(x - m) for x in z]
        s = sum(e)
        return [x / s for x in e]

    def sample(self, task: str, n: int, seed: int) -> tuple[int, float]:
        p = self.probs(task, n)
        k = random.Random(f"{self.seed}/{seed}").choices(range(n), weights=p)[0]
        return k, math.log(p[k])

    def update(self, task: str, n: int, actions: list[int], advantages: list[float], lr: float) -> None:
        """One policy-gradient step of the group's GRPO objective: for a softmax,
        d log p(a) / d z = onehot(a) - p."""
        if not actions:
            return
        p = self.probs(task, n)
        grad = [0.0] * n
        for a, adv in zip(actions, advantages, strict=True):
            for j in range(n):
                grad[j] += adv * ((1.0 if j == a else 0.0) - p[j]) / len(actions)
        self.logits[task] = [z + lr * g for z, g in zip(self.logits[task], grad, strict=True)]

    def to_json(self) -> dict[str, Any]:
        return {"logits": self.logits, "seed": self.seed}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Policy:
        return cls({k: list(v) for k, v in d["logits"].items()}, int(d["seed"]))


def app(policy: Policy) -> web.Application:
    """``POST /v1/chat/completions`` and ``GET /v1/models`` over ``policy``."""
    calls = {"n": 0}

    async def chat(req: web.Request) -> web.Response:
        body = await req.json()
        text = str(body["messages"][-1]["content"])
        task, n = TASK_LINE.search(text), N_LINE.search(text)
        if task is None or n is None:
            return web.json_response({"error": {"message": "the toy policy reads a TASK: and a CANDIDATES: line"}},
                                     status=400)
        k, logprob = policy.sample(task.group(1), int(n.group(1)), int(body.get("seed") or 0))
        calls["n"] += 1
        answer = f"APPLY {k}"
        return web.json_response({
            "id": f"toy-{calls['n']}", "object": "chat.completion", "model": "toy-softmax",
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": answer},
                         "logprobs": {"content": [{"token": answer, "logprob": logprob}]}}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 1, "total_tokens": 1}})

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "toy-softmax", "object": "model"}]})

    a = web.Application()
    a.router.add_post("/v1/chat/completions", chat)
    a.router.add_get("/v1/models", models)
    return a


async def serve(policy: Policy, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(app(policy))
    await runner.setup()
    await web.TCPSite(runner, host, port, reuse_address=True).start()
    return runner

