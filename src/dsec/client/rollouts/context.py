"""What an agent loop is given (docs/rl.md, "Rollouts that outlive the trainer"): the task,
its sandbox and an inference client whose every call is a journaled step.

An agent is ``async def agent(ctx: RolloutContext) -> float | dict | None``. Its steps are
numbered in the order it takes them; each one's request and result go to the rollout's
journal on the platform. When a rollout runs again (its worker was lost), the agent runs
from the top and each step already in the journal is answered from it, so no inference
call and no command is done twice, as long as the agent is deterministic given the
answers it gets (a step asking something else than the journal recorded at its place is an
error: :class:`JournalMismatch`). Commands carry a command-log key (``dsec.rollout/<id>/<seq>``),
so one that ran but whose journal write was lost with the worker is not run again either.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from dsec.client.sdk.client import AsyncClient
from dsec.client.sdk.sandbox import AsyncSandbox, exec_request
from dsec.shared.errors import DsecError, InferenceRefused, SandboxError
from dsec.shared.wire.models import ExecRequest, ExecResult
from dsec.shared.wire.rollouts import MAX_JOURNALED_OUTPUT, Inference, Step, StepKind

RETRY_STATUSES = (408, 429, 500, 502, 503, 504)
# a journaled command's output kept per stream (more is cut and flagged): the platform's bound
JOURNAL_OUTPUT_BYTES = MAX_JOURNALED_OUTPUT


class JournalMismatch(DsecError):
    """The agent asked for something else at a step than its journal recorded: it is not
    deterministic given its journal, so the rollout cannot be replayed."""

    status = 409
    code = "journal_mismatch"


class InferenceError(DsecError):
    """The inference endpoint was not back within its ``timeout_s`` (down, or answering
    5xx/429/408 throughout): the platform's side of the run. A request the endpoint refuses
    outright is :class:`dsec.shared.errors.InferenceRefused` (the workload's)."""

    status = 502
    code = "inference_error"


def digest(kind: str, request: Any) -> str:
    blob = json.dumps([kind, request], sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


class Journal:
    """The rollout's steps: answered from what was recorded, else done and recorded."""

    def __init__(self, steps: list[Step], record: Callable[[Step], Awaitable[Step]],
                 hold: Callable[[], Awaitable[object]], attempt: int) -> None:
        self._recorded = {s.seq: s for s in steps}
        self._record = record
        self._hold = hold
        self.attempt = attempt
        self.seq = 0
        self.replayed = 0
        self.steps: list[Step] = []

    async def step(self, kind: StepKind, request: Any, do: Callable[[int], Awaitable[Any]]) -> Any:
        """``do(seq)``'s answer, journaled; or the journal's answer at this step."""
        async def do_and_record(step: Step) -> Step:
            return await self._record(step.model_copy(update={"response": await do(step.seq)}))
        return await self.step_recorded(kind, request, do_and_record)

    async def step_recorded(self, kind: StepKind, request: Any, do: Callable[[Step], Awaitable[Step]]) -> Any:
        """As :meth:`step`, for a ``do`` that journals the step itself (a command the
        platform runs and journals in one call): given the step without its response, it
        returns the step as journaled."""
        seq = self.seq
        self.seq += 1
        d = digest(kind, request)
        old = self._recorded.get(seq)
        if old is not None:
            if old.kind != kind or old.digest != d:
                raise JournalMismatch(f"step {seq}: the journal has a {old.kind} step with another request here; "
                                      "the agent must take the same steps given the same answers", field="agent")
            self.replayed += 1
            self.steps.append(old)
            return old.response
        await self._hold()
        stored = await do(Step(seq=seq, kind=kind, request=request, digest=d, at=time.time(), attempt=self.attempt))
        self.steps.append(stored)
        return stored.response


class RolloutSandbox:
    """The rollout's sandbox, its commands journaled and keyed. ``raw`` is the plain SDK
    handle (files, ports, pack_diff: not journaled)."""

    def __init__(self, raw: AsyncSandbox, journal: Journal, rollout_id: str,
                 run: Callable[[Step, ExecRequest], Awaitable[Step]]) -> None:
        self.raw = raw
        self._journal = journal
        self._rollout_id = rollout_id
        self._run = run

    @property
    def sandbox_id(self) -> str:
        return self.raw.sandbox_id

    async def exec(self, cmd: str | list[str], *, timeout: float = 300.0, env: dict[str, str] | None = None,
                   cwd: str | None = None, stdin: str | None = None) -> ExecResult:
        """One command (a string through the shell, a list directly), journaled; its output is
        kept up to 64 KiB per stream (``stdout_truncated``/``stderr_truncated`` say it was cut)."""
        req = {"cmd": cmd, "timeout": timeout, "env": env, "cwd": cwd, "stdin": stdin}
        return await self._command("exec", req, cmd, timeout=timeout, env=env, cwd=cwd, stdin=stdin)

    async def run_shell(self, cmd: str, *, session: str = "default", timeout: float = 300.0,
                        env: dict[str, str] | None = None, cwd: str | None = None) -> ExecResult:
        """A command in a persistent shell session (cwd, env, background jobs carry over),
        journaled, its output kept as :meth:`exec` keeps it."""
        req = {"cmd": cmd, "session": session, "timeout": timeout, "env": env, "cwd": cwd}
        return await self._command("shell", req, cmd, session=session, timeout=timeout, env=env, cwd=cwd)

    async def _command(self, kind: StepKind, request: dict[str, Any], cmd: str | list[str], *, timeout: float,
                       env: dict[str, str] | None, cwd: str | None, stdin: str | None = None,
                       session: str | None = None) -> ExecResult:
        """Run and journaled by the platform in one call, keyed ``dsec.rollout/<id>/<seq>``:
        one that ran but whose answer was lost with the worker is not run again."""
        async def run(step: Step) -> Step:
            ex = exec_request(cmd, timeout, env, cwd, stdin, session, JOURNAL_OUTPUT_BYTES,
                              key=f"dsec.rollout/{self._rollout_id}/{step.seq}")
            return await self._run(step, ex)
        return ExecResult.model_validate(await self._journal.step_recorded(kind, request, run))

    # files pass through: reading is idempotent, and a write of the same content twice is one write
    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        await self.raw.write_file(path, data, mode)

    async def read_file(self, path: str) -> bytes:
        return await self.raw.read_file(path)


class LLM:
    """An OpenAI-compatible endpoint's chat completions, journaled. A call waits for an
    endpoint that is down or overloaded (connection refused, 5xx, 429: a trainer's own
    server restarting with it) up to the endpoint's ``timeout_s``."""

    def __init__(self, endpoint: Inference, journal: Journal, session: aiohttp.ClientSession) -> None:
        self.endpoint = endpoint
        self.base_url = endpoint.base_url
        self.model = endpoint.model
        self._journal = journal
        self._session = session

    async def chat(self, messages: list[dict[str, Any]], **params: Any) -> dict[str, Any]:
        """``POST {base_url}/chat/completions``: the response JSON (``["choices"][0]["message"]["content"]``)."""
        body = {"model": self.model, "messages": messages, **params}
        out = await self._journal.step("llm", body, lambda _seq: self._post("/chat/completions", body))
        assert isinstance(out, dict)
        return out

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {self.endpoint.api_key}"} if self.endpoint.api_key else {}
        deadline = time.monotonic() + self.endpoint.timeout_s
        delay = 0.2
        last = ""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise InferenceError(f"inference endpoint {self.base_url} not answering for "
                                     f"{self.endpoint.timeout_s:g} s: {last}", field="inference")
            try:
                async with self._session.post(self.base_url + path, json=body, headers=headers,
                                              timeout=aiohttp.ClientTimeout(total=left)) as resp:
                    if resp.status == 200:
                        data = await resp.json(content_type=None)
                        if not isinstance(data, dict):
                            raise InferenceError(f"inference endpoint answered {type(data).__name__}, not an object",
                                                 field="inference")
                        return data
                    text = (await resp.text())[:500]
                    if resp.status not in RETRY_STATUSES:  # the request's own fault: asking again gets the same
                        raise InferenceRefused(f"inference endpoint: HTTP {resp.status}: {text}", field="inference")
                    last = f"HTTP {resp.status}: {text}"
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                last = f"{type(e).__name__}: {e}"
            await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 5.0)


class RolloutContext:
    """Given to the agent: ``task`` (the spec's JSON), ``sandbox`` (None when the spec has no
    ``args``), ``llm`` (None without ``inference``), ``client`` (the worker's SDK client, for
    anything else: a grader's sandbox, a fork), ``record`` for a step of the agent's own."""

    def __init__(self, *, rollout_id: str, attempt: int, task: dict[str, Any], job: str | None,
                 client: AsyncClient, journal: Journal, sandbox: AsyncSandbox | None, llm: LLM | None,
                 run: Callable[[Step, ExecRequest], Awaitable[Step]]) -> None:
        self.rollout_id = rollout_id
        self.attempt = attempt
        self.task = task
        self.job = job
        self.client = client
        self.journal = journal
        self.sandbox = RolloutSandbox(sandbox, journal, rollout_id, run) if sandbox is not None else None
        self.llm = llm

    def require_sandbox(self) -> RolloutSandbox:
        if self.sandbox is None:
            raise SandboxError("this rollout's spec has no sandbox args", field="args")
        return self.sandbox

    async def record(self, name: str, compute: Callable[[], Awaitable[Any]]) -> Any:
        """A step of the agent's own (a grading, a random draw, a call to another service):
        ``compute()`` the first time, its recorded JSON result when the rollout runs again."""
        return await self.journal.step("note", {"name": name}, lambda _seq: compute())
