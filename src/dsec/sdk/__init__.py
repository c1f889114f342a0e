"""The dsec SDK: :class:`AsyncClient` (async-first) and its sync twin :class:`Client`."""

from dsec.sdk.batches import AsyncBatch
from dsec.sdk.client import AsyncClient, AsyncSandbox
from dsec.sdk.jobs import AsyncJob
from dsec.sdk.rollouts import AsyncRollouts
from dsec.sdk.sync import Batch, Client, Job, Rollouts, Sandbox

__all__ = ["AsyncBatch", "AsyncClient", "AsyncJob", "AsyncRollouts", "AsyncSandbox", "Batch", "Client", "Job",
           "Rollouts", "Sandbox"]
