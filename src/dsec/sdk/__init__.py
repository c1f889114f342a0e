"""The dsec SDK: :class:`AsyncClient` (async-first) and its sync twin :class:`Client`."""

from dsec.sdk.client import AsyncClient, AsyncSandbox
from dsec.sdk.jobs import AsyncJob
from dsec.sdk.sync import Client, Job, Sandbox

__all__ = ["AsyncClient", "AsyncJob", "AsyncSandbox", "Client", "Job", "Sandbox"]
