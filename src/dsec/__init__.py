"""dsec: elastic sandboxes for agentic RL training and evaluation."""

from dsec.errors import (
    AdmissionRejected,
    DeadlineExceeded,
    DsecError,
    EdgeUnavailable,
    Forbidden,
    InsufficientStorage,
    InvalidRequest,
    LayerInUse,
    NotFound,
    PayloadTooLarge,
    SandboxBusy,
    SandboxError,
    SandboxNotRunning,
    Unauthorized,
)
from dsec.sdk import AsyncClient, AsyncSandbox, Client, Sandbox
from dsec.wire.layers import Layer
from dsec.wire.models import (
    ContainerArgs,
    ExecEvent,
    ExecResult,
    FileStat,
    FnCallArgs,
    FnCallResult,
    MicroVMArgs,
    NetworkInfo,
    SandboxInfo,
    SandboxState,
    SandboxUsage,
    TestCase,
    VMArgs,
    VMInfo,
)

__all__ = [
    "AdmissionRejected", "AsyncClient", "AsyncSandbox", "Client", "ContainerArgs", "DeadlineExceeded", "DsecError",
    "EdgeUnavailable", "Forbidden", "ExecEvent", "ExecResult", "FileStat", "FnCallArgs", "FnCallResult",
    "InsufficientStorage", "InvalidRequest", "Layer", "LayerInUse", "MicroVMArgs", "NetworkInfo", "NotFound",
    "PayloadTooLarge", "Sandbox", "SandboxBusy", "SandboxError", "SandboxInfo", "SandboxNotRunning", "SandboxState",
    "SandboxUsage",     "TestCase", "Unauthorized", "VMArgs", "VMInfo",
]
