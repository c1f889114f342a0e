"""Typed errors shared by every component; the apiserver maps them to HTTP statuses
and the SDK maps statuses back to the same classes.

Every error says whose it is (``infra``, docs/rl.md): the platform's (a 5xx, a 429
refusal, the sandbox lost under the call) or the caller's own request (any other 4xx).
"""

from __future__ import annotations


class DsecError(Exception):
    status = 500
    code = "internal"

    def __init__(self, message: str, field: str | None = None, *, sandbox_id: str | None = None,
                 operation: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        # which sandbox and which call, where known (the SDK fills them in from the request)
        self.sandbox_id = sandbox_id
        self.operation = operation

    @property
    def infra(self) -> bool:
        """Whether the platform failed, not the caller's request: an RL trainer masks such a
        rollout out instead of scoring it (docs/rl.md, "Whose failure is it")."""
        return self.status >= 500 or self.status == 429


class InvalidRequest(DsecError):
    status = 400
    code = "invalid_request"


class Unauthorized(DsecError):
    status = 401
    code = "unauthorized"


class Forbidden(DsecError):
    """The token is valid but its role may not do this (say, a runner publishing a layer)."""

    status = 403
    code = "forbidden"


class NotFound(DsecError):
    status = 404
    code = "not_found"


class MethodNotAllowed(DsecError):
    """The path exists, not for this method."""

    status = 405
    code = "method_not_allowed"


class RequestTimeout(DsecError):
    """The request's body stopped arriving: the server gave up waiting for it."""

    status = 408
    code = "request_timeout"


class SandboxNotRunning(DsecError):
    status = 409
    code = "sandbox_not_running"

    @property
    def infra(self) -> bool:  # the sandbox ended (or was lost) under the rollout
        return True


class KeyConflict(DsecError):
    """A command log key already names a different command (docs/rl.md)."""

    status = 409
    code = "key_conflict"


class CommandForgotten(DsecError):
    """A command log key whose record was dropped (the log's bound): it is not run again."""

    status = 410
    code = "command_forgotten"


class SandboxBusy(DsecError):
    """The sandbox has requests in flight and cannot be paused now."""

    status = 409
    code = "sandbox_busy"


class LayerInUse(DsecError):
    status = 409
    code = "layer_in_use"


class PayloadTooLarge(DsecError):
    status = 413
    code = "payload_too_large"


class AdmissionRejected(DsecError):
    """The node (or every node) lacks room; the caller may retry later."""

    status = 429
    code = "admission_rejected"


class QuotaExceeded(AdmissionRejected):
    """A job's or a project's quota has no room for this sandbox (the message names the job
    or project; ``field`` the resource: quota.sandboxes, quota.cpu_cores, ...); room comes
    back as its sandboxes stop."""

    code = "quota_exceeded"
    limit: float | None = None  # the cap that refused it, where known (in-process callers read it)


class RateLimited(AdmissionRejected):
    """A creation-rate budget (a job's ``creates_per_s``) has no token now: come back after
    ``retry_after`` seconds (the response's Retry-After header, rounded up; the body's
    ``retry_after``, exact). Backpressure, not a verdict on the request."""

    code = "rate_limited"

    def __init__(self, message: str, field: str | None = None, *, retry_after: float = 1.0,
                 sandbox_id: str | None = None, operation: str | None = None) -> None:
        super().__init__(message, field, sandbox_id=sandbox_id, operation=operation)
        self.retry_after = retry_after


class QuotaConflict(DsecError):
    """A quota change the project tree does not allow: delegating more than the parent
    holds, or capping a project below what it delegated (the message says what to shrink)."""

    status = 409
    code = "quota_conflict"


class ProjectExists(DsecError):
    status = 409
    code = "project_exists"


class ProjectNotEmpty(DsecError):
    """The project still has sub-projects or sandboxes."""

    status = 409
    code = "project_not_empty"


class JobExists(DsecError):
    status = 409
    code = "job_exists"


class JobNotActive(DsecError):
    """The job is paused or stopped: it takes no new sandboxes until resumed (a stopped job never)."""

    status = 409
    code = "job_not_active"


class EdgeUnavailable(DsecError):
    status = 503
    code = "edge_unavailable"
    # False only when the request surely never reached the edge (no connection could be
    # made): then a stateless call may go to another edge without running twice
    sent = True


class MetadataUnavailable(DsecError):
    """The cluster's database did not answer (restarting, unreachable, overloaded): the
    platform's failure, worth trying again in a moment; nothing was changed."""

    status = 503
    code = "metadata_unavailable"


class SandboxError(DsecError):
    """The sandbox or its runtime failed while serving the request."""

    status = 500
    code = "sandbox_error"


class InsufficientStorage(DsecError):
    """The node's own disk (its data dir) is full: nothing the request can change."""

    status = 507
    code = "insufficient_storage"


class NotSupported(DsecError):
    """The operation exists, but not for this sandbox or on this node (an in-place
    snapshot of a VM, or of a container on an edge without its btrfs volume)."""

    status = 501
    code = "not_supported"

    @property
    def infra(self) -> bool:  # the request asked for what this sandbox cannot do: the caller's to change
        return False


class BranchUnsupported(SandboxError):
    """A live branch (``Sandbox.branch``) of this sandbox cannot be taken here, and the
    message says exactly why: CRIU is missing on its node, a process holds what CRIU cannot
    checkpoint (a channel to the host, a TCP connection, ...: in CRIU's own words), a hollow
    sandbox. The request asked for what this sandbox cannot do, so it is the caller's (409,
    not infra)."""

    status = 409
    code = "branch_unsupported"

    @property
    def infra(self) -> bool:
        return False


class SnapshotLimit(DsecError):
    """A sandbox holds as many in-place snapshots as it may, or its snapshots hold its
    disk quota: drop one first."""

    status = 409
    code = "snapshot_limit"


class DeadlineExceeded(SandboxError):
    """A call did not finish within its deadline: the edge's call into a sandbox or helper
    (the sandbox's init, crun, the shared store), or the SDK's own request timeout."""

    status = 504
    code = "deadline_exceeded"


class RolloutLost(DsecError):
    """A rollout worker no longer holds the rollout: cancelled, finished, or taken by
    another worker after its lease ran out. It must stop running it."""

    status = 409
    code = "rollout_lost"


class InferenceRefused(DsecError):
    """The inference endpoint refused the request itself (a 4xx other than 408/429, such as
    a prompt past the model's context): the workload's failure, not the platform's."""

    status = 422
    code = "inference_refused"


ERRORS_BY_CODE: dict[str, type[DsecError]] = {
    cls.code: cls
    for cls in (
        DsecError,
        InvalidRequest,
        Unauthorized,
        Forbidden,
        MethodNotAllowed,
        NotFound,
        RequestTimeout,
        SandboxNotRunning,
        KeyConflict,
        CommandForgotten,
        SandboxBusy,
        LayerInUse,
        NotSupported,
        BranchUnsupported,
        SnapshotLimit,
        PayloadTooLarge,
        AdmissionRejected,
        QuotaExceeded,
        RateLimited,
        QuotaConflict,
        ProjectExists,
        ProjectNotEmpty,
        JobExists,
        JobNotActive,
        EdgeUnavailable,
        MetadataUnavailable,
        SandboxError,
        DeadlineExceeded,
        InsufficientStorage,
        RolloutLost,
        InferenceRefused,
    )
}
