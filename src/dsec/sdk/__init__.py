"""The dsec SDK: :class:`AsyncClient` (async-first) and its sync twin :class:`Client`."""

from dsec.sdk.client import AsyncClient, AsyncSandbox
from dsec.sdk.sync import Client, Sandbox

__all__ = ["AsyncClient", "AsyncSandbox", "Client", "Sandbox"]
