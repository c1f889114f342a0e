"""The rollout service's client side (docs/rl.md, "Rollouts that outlive the trainer"): what
an agent loop is given (context), and the worker process that runs agent loops for trainers
(worker). Both are SDK clients; the rollouts and their journals are the control plane's
(dsec.control.rollouts.store)."""

from dsec.client.rollouts.context import LLM, InferenceError, JournalMismatch, RolloutContext, RolloutSandbox
from dsec.client.rollouts.worker import AgentNotFound, Worker

__all__ = ["LLM", "AgentNotFound", "InferenceError", "JournalMismatch", "RolloutContext", "RolloutSandbox", "Worker"]
