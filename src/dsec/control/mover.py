"""Moving checkpointed sandboxes between edges (TRANSOM's TOL at sandbox granularity):
bringing a lost node's sandboxes back on other edges, moving a live one (an operator's
move, a drain), and the bookkeeping that makes the move visible: the index says where the
sandbox runs now (routing follows it), and every step is a fleet event.

Used by the cluster's controller (node loss) and by the apiserver (drain, move, a restore
asked for by hand). It reaches edges only through the edge contract; every call is
bounded, and so is the number of moves at once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping

from dsec.control.health.events import FleetEvents
from dsec.control.placement.engine import Placement
from dsec.node.checkpoints.store import CheckpointStore
from dsec.node.edge.api import EdgeAPI
from dsec.shared.errors import (
    AdmissionRejected,
    DsecError,
    InvalidRequest,
    NotFound,
    SandboxBusy,
    SandboxError,
    SandboxNotRunning,
)
from dsec.shared.meta.registry import RESTORE_FAILED, RESTORING, Registry
from dsec.shared.wire.fleet import DrainReport, RestoreSpec
from dsec.shared.wire.models import ContainerArgs, CreateRequest, MicroVMArgs, SandboxInfo, SandboxState, VMArgs

log = logging.getLogger("dsec.checkpoints")
AnyArgs = ContainerArgs | MicroVMArgs | VMArgs
RESTORE_TIMEOUT_S = 180.0  # one restore on one edge: mounts, container start, command log
MOVE_TIMEOUT_S = 300.0  # a live move: pause, final checkpoint, restore, evict
MOVES_AT_ONCE = 4
MAX_TARGETS = 3  # edges tried for one restore before it is reported failed


class Mover:
    def __init__(self, edges: Callable[[], Mapping[str, EdgeAPI]], placement: Placement, registry: Registry,
                 checkpoints: CheckpointStore, events: FleetEvents,
                 on_moved: Callable[[SandboxInfo], None] = lambda _: None) -> None:
        """``on_moved``: told at once where a sandbox runs now (this process's routing;
        other processes read the index)."""
        self.edges, self.placement, self.registry, self.on_moved = edges, placement, registry, on_moved
        self.checkpoints, self.events = checkpoints, events
        self._gate = asyncio.Semaphore(MOVES_AT_ONCE)

    async def _event(self, edge: str, kind: str, actor: str, reason: str, sandbox_id: str | None = None,
                     **detail: object) -> None:
        try:
            await asyncio.to_thread(self.events.record, edge, kind, actor, reason, sandbox_id, dict(detail))
        except Exception as e:  # an event is a record, never a reason to fail the move
            log.warning("fleet event %s not recorded: %s", kind, e)

    async def _restore_somewhere(self, sandbox_id: str, seq: int, args: AnyArgs, reason: str,
                                 exclude: set[str]) -> SandboxInfo:
        """Restore on the first edge that takes it (placement's choice, up to MAX_TARGETS)."""
        tried = set(exclude)
        last: Exception | None = None
        for _ in range(MAX_TARGETS):
            try:
                name = self.placement.choose(args, exclude=tried)
            except AdmissionRejected as e:
                last = last or e
                break
            tried.add(name)
            edge = self.edges().get(name)
            if edge is None:
                continue
            try:
                with self.placement.reserve(name, args):
                    return await asyncio.wait_for(edge.restore(RestoreSpec(sandbox_id=sandbox_id, seq=seq,
                                                                           reason=reason)), RESTORE_TIMEOUT_S)
            except (DsecError, OSError, TimeoutError) as e:
                last = e
                log.warning("restore of %s on %s failed: %s", sandbox_id, name, e)
        raise SandboxError(f"no edge restored it: {last}" if last else "no edge to restore it on")

    async def _settle(self, info: SandboxInfo) -> None:
        """Record where a restored sandbox runs now; one stopped meanwhile (its row is gone)
        is evicted from its new edge at once."""
        if await asyncio.to_thread(self.registry.moved, info):
            self.on_moved(info)
            return
        with contextlib.suppress(DsecError, OSError, TimeoutError):
            await asyncio.wait_for(self.edges()[info.edge].stop(info.sandbox_id), RESTORE_TIMEOUT_S)
        raise SandboxNotRunning(f"sandbox {info.sandbox_id} was stopped while it moved")

    async def restore_lost(self, sandbox_id: str, lost_edge: str, actor: str = "controller") -> SandboxInfo:
        """Bring back a sandbox of a lost edge from its newest checkpoint."""
        cp = await asyncio.to_thread(self.checkpoints.latest, sandbox_id)
        if cp is None:
            raise NotFound(f"sandbox {sandbox_id} has no checkpoint to restore", field="sandbox_id")
        args = _args(cp.record["args"])
        async with self._gate:
            if not await asyncio.to_thread(self.registry.claim_move, sandbox_id, RESTORING):
                raise SandboxBusy(f"sandbox {sandbox_id} is being restored or moved already")
            try:
                info = await self._restore_somewhere(sandbox_id, cp.seq, args, f"edge {lost_edge} lost",
                                                     {lost_edge})
            except (DsecError, OSError) as e:
                why = f"{RESTORE_FAILED}{e}"
                await asyncio.to_thread(self.registry.set_restore, sandbox_id, why)
                await self._event(lost_edge, "restore_failed", actor, why, sandbox_id, seq=cp.seq)
                raise
            await self._settle(info)
        await self._event(info.edge, "restored", actor, f"edge {lost_edge} lost", sandbox_id, seq=cp.seq,
                          taken_at=cp.taken_at, previous=lost_edge)
        return info

    async def move(self, sandbox_id: str, source: str, reason: str, actor: str) -> SandboxInfo:
        """Move a live checkpointed sandbox off ``source``: pause it there (so nothing is
        written after its last checkpoint), take that checkpoint, restore it elsewhere, and
        evict it from ``source``. Should the restore fail, it is resumed where it was."""
        src = self.edges().get(source)
        if src is None:
            raise NotFound(f"no edge {source!r}", field="edge")
        if not await asyncio.to_thread(self.registry.claim_move, sandbox_id, "moving"):
            raise SandboxBusy(f"sandbox {sandbox_id} is being moved or restored already (or is not in this "
                              "cluster's index)")
        try:
            async with self._gate, asyncio.timeout(MOVE_TIMEOUT_S):
                return await self._move(src, sandbox_id, source, reason, actor)
        finally:  # moved: its row no longer says so; not moved: it stays where it was
            with contextlib.suppress(Exception):
                await asyncio.shield(asyncio.to_thread(self.registry.release_move, sandbox_id, "moving"))

    async def _move(self, src: EdgeAPI, sandbox_id: str, source: str, reason: str, actor: str) -> SandboxInfo:
        before = await src.get(sandbox_id)
        if before.checkpoint_every_s is None:
            raise InvalidRequest(f"sandbox {sandbox_id} was not created with checkpoint_every_s: it cannot move",
                                 field="sandbox_id")
        was_paused = before.state == SandboxState.paused
        if not was_paused:
            await src.pause(sandbox_id)
        try:
            cp = await src.checkpoint(sandbox_id)
            args = _args((await asyncio.to_thread(self.checkpoints.get, sandbox_id, cp.seq)).record["args"])  # type: ignore[union-attr]
            info = await self._restore_somewhere(sandbox_id, cp.seq, args, reason, {source})
        except BaseException:
            if not was_paused:
                try:
                    await asyncio.shield(src.resume(sandbox_id))
                except (DsecError, OSError) as e:
                    log.warning("sandbox %s not resumed on %s after a failed move: %s", sandbox_id, source, e)
            raise
        await self._settle(info)
        if was_paused:  # it moves as it was: paused (and its quota counts it so)
            with contextlib.suppress(DsecError, OSError):
                info = await asyncio.wait_for(self.edges()[info.edge].pause(sandbox_id), RESTORE_TIMEOUT_S)
        try:
            await src.evict(sandbox_id, info.edge)
        except (DsecError, OSError) as e:  # it is frozen there; the controller's sweep evicts it later
            log.warning("sandbox %s not evicted from %s: %s", sandbox_id, source, e)
        await self._event(info.edge, "moved", actor, reason, sandbox_id, seq=cp.seq, previous=source,
                          freeze_ms=cp.freeze_ms)
        return info

    async def drain(self, source: str, actor: str, reason: str = "drain") -> DrainReport:
        """Move every checkpointed sandbox off ``source``; the others are left running
        (they end there, or fail with the node)."""
        src = self.edges().get(source)
        if src is None:
            raise NotFound(f"no edge {source!r}", field="edge")
        report = DrainReport()
        infos = await asyncio.wait_for(src.list_sandboxes(), 30)
        todo = []
        for i in infos:
            if i.state not in (SandboxState.running, SandboxState.paused):
                continue
            if i.checkpoint_every_s is None:
                report.left[i.sandbox_id] = "not checkpointed (created without checkpoint_every_s)"
            else:
                todo.append(i.sandbox_id)
        await self._event(source, "drain", actor, reason, None, to_move=len(todo), left=len(report.left))

        async def one(sid: str) -> None:
            try:
                report.moved[sid] = (await self.move(sid, source, reason, actor)).edge
            except (DsecError, OSError, TimeoutError) as e:
                report.failed[sid] = str(e) or type(e).__name__

        await asyncio.gather(*(one(sid) for sid in todo))
        await self._event(source, "drained", actor, reason, None, moved=len(report.moved),
                          failed=len(report.failed), left=len(report.left))
        return report


def _args(raw: dict[str, object]) -> AnyArgs:
    return CreateRequest.model_validate({"args": raw}).args
