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
from dsec.models import ContainerArgs, ExecEvent, ExecResult, FileStat, SandboxInfo, SandboxState
from dsec.sdk import AsyncClient, AsyncSandbox, Client, Sandbox

__all__ = [
    "AdmissionRejected", "AsyncClient", "AsyncSandbox", "Client", "ContainerArgs", "DsecError",
    "EdgeUnavailable", "ExecEvent", "ExecResult", "FileStat", "InvalidRequest", "Layer", "LayerInUse", "NotFound",
    "PayloadTooLarge",
    "Sandbox", "SandboxError", "SandboxInfo", "SandboxNotRunning", "SandboxState", "Unauthorized",
]
