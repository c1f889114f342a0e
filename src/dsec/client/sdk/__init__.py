"""The dsec SDK: :class:`AsyncClient` (async-first) and its sync twin :class:`Client`."""

from dsec.client.sdk.batches import AsyncBatch
from dsec.client.sdk.client import AsyncClient, AsyncSandbox
from dsec.client.sdk.jobs import AsyncJob
from dsec.client.sdk.rollouts import AsyncRollouts
from dsec.client.sdk.sync import Batch, Client, Job, Rollouts, Sandbox

__all__ = ["AsyncBatch", "AsyncClient", "AsyncJob", "AsyncRollouts", "AsyncSandbox", "Batch", "Client", "Job",
           "Rollouts", "Sandbox"]
