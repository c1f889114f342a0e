"""dsec: elastic sandboxes for agentic RL training and evaluation."""

from dsec.client.sdk import (
    AsyncBatch,
    AsyncClient,
    AsyncJob,
    AsyncRollouts,
    AsyncSandbox,
    Batch,
    Client,
    Job,
    Rollouts,
    Sandbox,
)
from dsec.shared.errors import (
    AdmissionRejected,
    BranchUnsupported,
    CommandForgotten,
    DeadlineExceeded,
    DsecError,
    EdgeUnavailable,
    Forbidden,
    InsufficientStorage,
    InvalidRequest,
    JobExists,
    JobNotActive,
    KeyConflict,
    LayerInUse,
    MetadataUnavailable,
    NotFound,
    NotSupported,
    PayloadTooLarge,
    ProjectExists,
    ProjectNotEmpty,
    QuotaConflict,
    QuotaExceeded,
    RateLimited,
    RequestTimeout,
    SandboxBusy,
    SandboxError,
    SandboxNotRunning,
    SnapshotLimit,
    Unauthorized,
)
from dsec.shared.wire.batches import BatchCounts, BatchInfo, BatchItem, BatchRequest
from dsec.shared.wire.fleet import CheckpointInfo, DrainReport, FleetEvent
from dsec.shared.wire.iam import ProjectInfo, ProjectQuota, Usage
from dsec.shared.wire.jobs import JobAction, JobInfo, JobQuota, JobStatus
from dsec.shared.wire.layers import Layer
from dsec.shared.wire.models import (
    CommandRecord,
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
from dsec.shared.wire.rollouts import Inference, RolloutCounts, RolloutInfo, RolloutSpec, Step
from dsec.shared.wire.snapshots import BranchRequest, RollbackResult, SandboxSnapshot

__all__ = [
    "CheckpointInfo", "DrainReport", "FleetEvent",
    "AdmissionRejected", "AsyncClient", "AsyncSandbox", "Client", "ContainerArgs", "DeadlineExceeded", "DsecError",
    "EdgeUnavailable", "Forbidden", "ExecEvent", "ExecResult", "FileStat", "FnCallArgs", "FnCallResult",
    "InsufficientStorage", "InvalidRequest", "Layer", "LayerInUse", "MicroVMArgs", "NetworkInfo", "NotFound",
    "PayloadTooLarge", "Sandbox", "SandboxBusy", "SandboxError", "SandboxInfo", "SandboxNotRunning", "SandboxState",
    "SandboxUsage",     "TestCase", "Unauthorized", "VMArgs", "VMInfo",
    "CommandForgotten", "CommandRecord", "KeyConflict",
    "AsyncJob", "Job", "JobAction", "JobExists", "JobInfo", "JobNotActive", "JobQuota", "JobStatus", "QuotaExceeded",
    "AsyncBatch", "Batch", "BatchCounts", "BatchInfo", "BatchItem", "BatchRequest",
    "ProjectExists", "ProjectInfo", "ProjectNotEmpty", "ProjectQuota", "QuotaConflict", "Usage",
    "MetadataUnavailable", "RateLimited", "RequestTimeout",
    "AsyncRollouts", "Inference", "RolloutCounts", "RolloutInfo", "RolloutSpec", "Rollouts", "Step",
    "NotSupported", "RollbackResult", "SandboxSnapshot", "SnapshotLimit",
    "BranchUnsupported", "BranchRequest",
]
