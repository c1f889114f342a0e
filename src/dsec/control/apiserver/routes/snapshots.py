"""In-place snapshots of a running container (docs/snapshots.md): take one, list them,
drop one, roll back to one; and the live branch of a running sandbox. The sandbox's own
edge does the work (dsec.node.edge.rollback, dsec.node.edge.branching); the auth
middleware has already refused another project's token (404)."""

from __future__ import annotations

from fastapi import APIRouter, Response

from dsec.control.apiserver.core import Apiserver
from dsec.shared.wire.models import SandboxInfo
from dsec.shared.wire.snapshots import BranchRequest, RollbackRequest, RollbackResult, SandboxSnapshot, SnapshotRequest


def routes(api: Apiserver) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/sandboxes/{sandbox_id}/snapshot", status_code=201)
    async def snapshot(sandbox_id: str, req: SnapshotRequest | None = None) -> SandboxSnapshot:
        """Snapshot the container's files now (frozen for milliseconds); kept on its edge until dropped or
        it ends. 409 past the per-sandbox bound or its disk quota, 501 for a VM or an edge without btrfs."""
        return await api.edge_for(sandbox_id).snapshot(sandbox_id, req.name if req else None)

    @router.get("/v1/sandboxes/{sandbox_id}/snapshots")
    async def snapshots(sandbox_id: str) -> list[SandboxSnapshot]:
        """Its in-place snapshots, oldest first, with the disk each holds alone."""
        return await api.edge_for(sandbox_id).list_snapshots(sandbox_id)

    @router.delete("/v1/sandboxes/{sandbox_id}/snapshots/{name}", status_code=204)
    async def drop_snapshot(sandbox_id: str, name: str) -> Response:
        await api.edge_for(sandbox_id).drop_snapshot(sandbox_id, name)
        return Response(status_code=204)

    @router.post("/v1/sandboxes/{sandbox_id}/rollback")
    async def rollback(sandbox_id: str, req: RollbackRequest) -> RollbackResult:
        """Its files back to the snapshot exactly: every process but dsec-init is killed, shell sessions
        restart at their working directories of then, command log records after it are dropped."""
        return await api.edge_for(sandbox_id).rollback(sandbox_id, req.snapshot)

    @router.post("/v1/sandboxes/{sandbox_id}/branch", status_code=201)
    async def branch(sandbox_id: str, req: BranchRequest | None = None) -> list[SandboxInfo]:
        """Live branch: ``n`` new sandboxes continuing from this running one's state, its processes and memory
        included (microVMs and VMs through QEMU, containers through CRIU; what cannot be carried answers 409
        branch_unsupported naming it), on its edge; it runs on.
        Each child is counted in the parent's project and job like a create."""
        return await api.branch(sandbox_id, req.n if req else 1)

    return router
