"""The rollout service (docs/rl.md, "Rollouts that outlive the trainer"): rollouts and their
journals in the metadata database (store), what an agent loop is given (context), and the
worker process that runs agent loops for trainers (worker)."""

from dsec.client.rollouts.context import LLM, InferenceError, JournalMismatch, RolloutContext, RolloutSandbox
from dsec.client.rollouts.worker import AgentNotFound, Worker

__all__ = ["LLM", "AgentNotFound", "InferenceError", "JournalMismatch", "RolloutContext", "RolloutSandbox", "Worker"]
