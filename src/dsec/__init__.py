"""dsec: elastic sandboxes for agentic RL training and evaluation."""

from dsec.errors import (
    AdmissionRejected,
    DsecError,
    EdgeUnavailable,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    SandboxError,
    SandboxNotRunning,
    Unauthorized,
)
from dsec.models import ContainerArgs, ExecEvent, ExecResult, FileStat, SandboxInfo, SandboxState
from dsec.sdk import AsyncClient, AsyncSandbox, Client, Sandbox

__all__ = [
    "AdmissionRejected", "AsyncClient", "AsyncSandbox", "Client", "ContainerArgs", "DsecError",
    "EdgeUnavailable", "ExecEvent", "ExecResult", "FileStat", "InvalidRequest", "NotFound", "PayloadTooLarge",
    "Sandbox", "SandboxError", "SandboxInfo", "SandboxNotRunning", "SandboxState", "Unauthorized",
]
