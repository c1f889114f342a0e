"""A sandbox's audit log, its file detectors, protected paths and events."""

from __future__ import annotations

import asyncio
import contextlib
import os

from dsec.node.agent.aether import ProcRootFiles
from dsec.node.edge.core import EdgeNode
from dsec.node.edge.lifecycle import Lifecycle, Op
from dsec.node.edge.sandbox import Sandbox
from dsec.shared.errors import InvalidRequest
from dsec.shared.wire.models import (
    AuditRecord,
    SandboxEvent,
    SandboxState,
)


class Auditing:
    """audit_log, events, protect, and the file detectors' runs."""

    def __init__(self, node: EdgeNode, lifecycle: Lifecycle) -> None:
        self.node = node
        self.lifecycle = lifecycle

    async def audit_log(self, sandbox_id: str, kind: str | None = None, flagged: bool = False,
                        limit: int = 1000) -> list[AuditRecord]:
        """The sandbox's audit records (also after it ended), detectors brought up to date first."""
        sb = self.lifecycle.check(Op.AUDIT_LOG, sandbox_id)
        if sb is None:
            self.lifecycle.table.tombstone(sandbox_id)
        elif not sb.stopping and sb.rec.info.state == SandboxState.running:
            await self.run_detectors(sb)
        return await asyncio.to_thread(self.node.audit.query, sandbox_id, kind, flagged, limit)

    async def protect(self, sandbox_id: str, paths: list[str]) -> int:
        """Fingerprint the files under ``paths`` now; later changes are flagged."""
        sb, _ = await self.lifecycle.ready(Op.PROTECT, sandbox_id)
        if (pid := self.node.backend_of(sb).host_pid(sb)) is None:
            raise InvalidRequest("protected paths are watched in container sandboxes", field="sandbox_id")
        files = ProcRootFiles(pid)
        try:
            n = await asyncio.to_thread(self.node.detectors.protect, sb.id, paths, files.tree, files.read_bytes)
        except ValueError as e:
            raise InvalidRequest(str(e), field="paths") from None
        self.node.audit.record(sb.id, "protect", f"{n} files under {', '.join(paths)}")
        return n

    async def run_detectors(self, sb: Sandbox) -> None:
        backend = self.node.backend_of(sb)
        pid, upper = backend.host_pid(sb), backend.writable_dir(sb)
        if pid is None or upper is None:
            return
        files = ProcRootFiles(pid)
        lowers = [p if os.path.isdir(p := os.path.join(sb.dir, "lower", str(i))) else
                  os.path.join(self.node.layer_mnt, d) for i, d in enumerate(sb.rec.digests)]

        def go() -> None:
            self.node.detectors.check_protected(sb.id, files.tree, files.read_bytes)
            self.node.detectors.check_replaced(sb.id, upper, lowers)
        with contextlib.suppress(OSError):
            await asyncio.to_thread(go)

    async def events(self, sandbox_id: str) -> list[SandboxEvent]:
        sb = self.lifecycle.check(Op.EVENTS, sandbox_id)
        if sb is None:
            self.lifecycle.table.tombstone(sandbox_id)
            return []
        return list(sb.events)
