"""Typed errors shared by every component; the apiserver maps them to HTTP statuses
and the SDK maps statuses back to the same classes."""

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


class SandboxNotRunning(DsecError):
    status = 409
    code = "sandbox_not_running"


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


class EdgeUnavailable(DsecError):
    status = 503
    code = "edge_unavailable"


class SandboxError(DsecError):
    """The sandbox or its runtime failed while serving the request."""

    status = 500
    code = "sandbox_error"


class InsufficientStorage(DsecError):
    """The node's own disk (its data dir) is full: nothing the request can change."""

    status = 507
    code = "insufficient_storage"


class DeadlineExceeded(SandboxError):
    """A call did not finish within its deadline: the edge's call into a sandbox or helper
    (the sandbox's init, crun, the shared store), or the SDK's own request timeout."""

    status = 504
    code = "deadline_exceeded"


ERRORS_BY_CODE: dict[str, type[DsecError]] = {
    cls.code: cls
    for cls in (
        DsecError,
        InvalidRequest,
        Unauthorized,
        Forbidden,
        NotFound,
        SandboxNotRunning,
        SandboxBusy,
        LayerInUse,
        PayloadTooLarge,
        AdmissionRejected,
        EdgeUnavailable,
        SandboxError,
        DeadlineExceeded,
        InsufficientStorage,
    )
}
