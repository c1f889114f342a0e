"""Rollouts as the API takes and shows them (docs/rl.md, "Rollouts that outlive the trainer").

A rollout is one run of an agent loop (user code: ``module:function``, an async function
given a :class:`dsec.client.rollouts.RolloutContext`) on one task, run by a rollout worker on the
platform, not in the trainer. The trainer submits specs (idempotently, by ``key``) and
consumes finished rollouts by id; the platform keeps the rollout's journal of steps (each
inference call and each command, with its result) so a rollout whose worker died is run
again by another worker without any step being done twice.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator

from dsec.shared.wire.jobs import check_job_name, check_labels
from dsec.shared.wire.models import ContainerArgs, ExecRequest, Strict

MAX_SUBMIT = 10_000
MAX_STEP_BYTES = 1 << 20  # one journal step (a command's result, a completion), JSON
# a journaled command's output per stream: two streams of it, every byte a control character
# escaped as six, fit a step with room for its request
MAX_JOURNALED_OUTPUT = 64 << 10
MAX_STEPS = 10_000  # steps per rollout
ROLLOUT_LABEL = "dsec.rollout"  # on the sandbox a worker made for a rollout: its id
RolloutState = Literal["queued", "running", "done", "failed", "cancelled"]
ROLLOUT_STATES: tuple[RolloutState, ...] = ("queued", "running", "done", "failed", "cancelled")
FINISHED: tuple[RolloutState, ...] = ("done", "failed", "cancelled")
StepKind = Literal["llm", "exec", "shell", "note"]
AGENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")
KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_./:=-]{0,255}$")


class Inference(Strict):
    """An OpenAI-compatible endpoint (vLLM, SGLang, a trainer's own server): what the agent's
    ``ctx.llm`` calls. ``api_key`` is sent as a Bearer header and never shown back."""

    base_url: str = Field(description="up to /v1, e.g. http://10.0.0.5:8000/v1")
    model: str = ""
    api_key: str | None = None
    timeout_s: Annotated[float, Field(gt=0, le=3600)] = Field(
        default=600.0, description="how long one call may wait for the endpoint, retries included "
        "(an endpoint restarting with its trainer is waited for)")

    @field_validator("base_url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("base_url must be an http:// or https:// URL")
        return v.rstrip("/")


class RolloutSpec(Strict):
    agent: str = Field(description="the agent loop, 'package.module:function' importable by the workers")
    task: dict[str, Any] = Field(default_factory=dict, description="given to the agent as ctx.task (JSON)")
    key: str | None = Field(default=None, description="idempotency key, unique per project: submitting a key "
                            "again returns the rollout it made (a restarted trainer resubmits safely)")
    job: str | None = Field(default=None, description="the job it belongs to: its sandbox counts against the "
                            "job's quota, and it holds while the job is paused")
    args: ContainerArgs | None = Field(default=None, description="the sandbox the worker makes for it (stopped "
                                       "when it ends); None: the agent makes its own, if any")
    snapshot: str | None = Field(default=None, description="start its sandbox from this pack_diff snapshot, as "
                                 "fork does (a GRPO group: n rollouts of one snapshot); args then sets limits, "
                                 "TTLs and labels")
    inference: Inference | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    timeout_s: Annotated[float, Field(gt=0, le=7 * 86400)] = Field(
        default=3600.0, description="an attempt running longer fails the rollout (a workload failure)")
    max_attempts: Annotated[int, Field(ge=1, le=20)] = Field(
        default=3, description="runs after a worker or its sandbox was lost, before the rollout is failed as infra")
    keep_sandbox: bool = Field(default=False, description="leave its sandbox running when it ends")

    @property
    def wants_sandbox(self) -> bool:
        return self.args is not None or self.snapshot is not None

    @field_validator("agent")
    @classmethod
    def _agent(cls, v: str) -> str:
        if not AGENT_RE.match(v):
            raise ValueError(f"agent {v!r} must be 'package.module:function'")
        return v

    @field_validator("key")
    @classmethod
    def _key(cls, v: str | None) -> str | None:
        if v is not None and not KEY_RE.match(v):
            raise ValueError("key: letters, digits and _ . / : = -, at most 256, starting with a letter or digit")
        return v

    @field_validator("job")
    @classmethod
    def _job(cls, v: str | None) -> str | None:
        return None if v is None else check_job_name(v)

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        return check_labels(v)


class SubmitRequest(Strict):
    rollouts: Annotated[list[RolloutSpec], Field(min_length=1, max_length=MAX_SUBMIT)]


class Step(BaseModel):
    """One journal entry: what the agent asked (an inference call, a command) and what came
    back. A rerun of the rollout is answered from here instead of doing it again."""

    seq: int
    kind: StepKind
    request: Any = None
    response: Any = None
    digest: str = Field(default="", description="of the request: a rerun asking something else at this step "
                        "is an agent that is not deterministic given its journal (an error)")
    at: float = 0.0
    attempt: int = 1


class RolloutInfo(BaseModel):
    id: str
    project: str
    key: str | None = None
    job: str | None = None
    agent: str
    state: RolloutState
    attempts: int = Field(default=0, description="runs started (1 unless a worker was lost)")
    worker: str | None = None
    sandbox_id: str | None = None
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    consumed: bool = False
    reward: float | None = None
    result: Any = Field(default=None, description="what the agent returned (JSON)")
    failure: Literal["workload", "infra"] | None = None
    error: str | None = None
    n_steps: int = 0
    spec: RolloutSpec | None = Field(default=None, description="with ?spec=true (api_key removed)")
    steps: list[Step] | None = Field(default=None, description="the trajectory, with ?steps=true")


class SubmitResult(BaseModel):
    rollouts: list[RolloutInfo]
    created: int = Field(description="how many were new (the others existed under their key)")


class RolloutCounts(BaseModel):
    queued: int = 0
    running: int = 0
    done: int = 0
    failed: int = 0
    cancelled: int = 0
    unconsumed: int = Field(default=0, description="finished and not yet acknowledged by a trainer")


# --- the worker's side ---

class ClaimRequest(Strict):
    worker: str = Field(min_length=1, max_length=200)
    n: Annotated[int, Field(ge=0, le=1000)] = 1
    lease_s: Annotated[float, Field(ge=2, le=600)] = 30.0
    wait_s: Annotated[float, Field(ge=0, le=30)] = Field(default=0.0, description="long-poll for work")


class Claimed(BaseModel):
    """A rollout for a worker to run: its spec (with the api key) and its journal so far."""

    rollout: RolloutInfo
    spec: RolloutSpec
    steps: list[Step]
    attempt: int


class HeartbeatRequest(Strict):
    worker: str
    ids: Annotated[list[str], Field(max_length=10_000)]
    lease_s: Annotated[float, Field(ge=2, le=600)] = 30.0


class Held(BaseModel):
    id: str
    owned: bool = Field(description="false: lost (cancelled, or taken by another worker): stop running it")
    state: RolloutState | None = Field(default=None, description="its state now (None: no such rollout)")
    hold: bool = Field(default=False, description="its job is paused: take no new step until it is resumed")


class HeartbeatResult(BaseModel):
    rollouts: list[Held]


class StepRequest(Strict):
    worker: str
    attempt: int
    step: Step


class ExecStepRequest(Strict):
    """A command and its journal entry in one call (``POST /v1/rollouts/{id}/exec``): the
    apiserver runs ``exec`` in ``sandbox_id`` and journals its result as ``step``'s response
    before it answers, saving the worker a round trip per command. ``exec.key`` is
    required: a retry after a lost answer gets the command log's record, never a second run."""

    worker: str
    attempt: int
    sandbox_id: str
    step: Step = Field(description="seq, kind, request, digest and at; its response is the command's result")
    exec: ExecRequest


class FinishRequest(Strict):
    worker: str
    attempt: int
    state: Literal["done", "failed"]
    result: Any = None
    reward: float | None = None
    failure: Literal["workload", "infra"] | None = None
    error: Annotated[str, Field(max_length=16384)] | None = None
    requeue: bool = Field(default=False, description="an infra failure the next attempt may not hit: queue it "
                          "again while attempts are left")
    release: bool = Field(default=False, description="the worker is shutting down: queued again at once, the "
                          "attempt not counted, journal and sandbox kept")
    reset: bool = Field(default=False, description="with requeue: its sandbox was lost, so the next attempt "
                        "starts over (the journal is dropped)")


class SandboxRecord(Strict):
    worker: str
    attempt: int
    sandbox_id: str


class AckRequest(Strict):
    ids: Annotated[list[str], Field(min_length=1, max_length=MAX_SUBMIT)]
