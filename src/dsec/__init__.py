"""dsec: elastic sandboxes for agentic RL training and evaluation."""

from dsec.errors import (
    AdmissionRejected,
    DsecError,
    EdgeUnavailable,
    InvalidRequest,
    LayerInUse,
    NotFound,
    PayloadTooLarge,
    SandboxError,
    SandboxNotRunning,
    Unauthorized,
)
from dsec.layers.store import Layer
from dsec.models import (
    ContainerArgs,
    ExecEvent,
    ExecResult,
    FileStat,
    FnCallArgs,
    FnCallResult,
    SandboxInfo,
    SandboxState,
    TestCase,
)
from dsec.sdk import AsyncClient, AsyncSandbox, Client, Sandbox

__all__ = [
    "AdmissionRejected", "AsyncClient", "AsyncSandbox", "Client", "ContainerArgs", "DsecError",
    "EdgeUnavailable", "ExecEvent", "ExecResult", "FileStat", "FnCallArgs", "FnCallResult",
    "InvalidRequest", "Layer", "LayerInUse", "NotFound",
    "PayloadTooLarge",
    "Sandbox", "SandboxError", "SandboxInfo", "SandboxNotRunning", "SandboxState", "TestCase", "Unauthorized",
]
