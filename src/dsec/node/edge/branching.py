"""Live branch of a running sandbox on its edge (docs/snapshots.md, "Live branch"): ``n``
new sandboxes that continue from the parent's running state, processes and memory
included, while the parent runs on.

Owns the flow, the same for every backend: the parent must be running; ``n`` is bounded;
the edge must have room for all ``n`` before anything is captured; one capture of the
parent (:meth:`~dsec.node.backends.api.SandboxRuntime.branch_image`, the backend's:
QEMU's memory for a VM); ``n`` children made through the edge's own create path from
that capture (new ids, their own identity and network, the parent's arguments: its
limits, labels, job and lifetime); each child's command log starts as a copy of the
parent's; events on both sides; the capture's files released once the children are made
(each child holds what it needs itself, so nothing is left once they and the parent stop);
and a failure stops the children already made, so a branch is all or nothing.

Its collaborators are handed in (the running-sandbox lookup, the backend of a sandbox,
admission, the create and stop of the edge, the command log, the event sink): it is a
part of the edge, not a mixin of it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from dsec.node.backends.api import Sandbox, SandboxRuntime
from dsec.node.edge.cmdlog import CommandLog
from dsec.shared.errors import InsufficientStorage, InvalidRequest, SandboxNotRunning
from dsec.shared.wire.models import ContainerArgs, MicroVMArgs, SandboxInfo, SandboxState, VMArgs
from dsec.shared.wire.snapshots import MAX_BRANCH

log = logging.getLogger("dsec.edge")
AnyArgs = ContainerArgs | MicroVMArgs | VMArgs
CAPTURES_AT_ONCE = 2  # a capture writes the parent's memory out (CRIU's pages, a VM's RAM file): disk and I/O
SPARE_MB = 1024  # free space a capture leaves on the sandbox volume for everyone else's writes


class CreateChild(Protocol):
    """The edge's create path, for a child started from a branch image."""

    def __call__(self, args: AnyArgs, *, base: list[str], restore: dict[str, str],
                 branched_from: str) -> Awaitable[SandboxInfo]: ...


class Brancher:
    """``branch(sandbox_id, n)`` on one edge."""

    def __init__(self, *, running: Callable[[str], Sandbox], backend_of: Callable[[Sandbox], SandboxRuntime],
                 admit: Callable[[AnyArgs, int], None], create: CreateChild,
                 stop: Callable[[str], Awaitable[object]], cmdlog: CommandLog,
                 on_event: Callable[[str, str, str], None], work_dir: str, max_n: int = MAX_BRANCH) -> None:
        self.running = running
        self.backend_of = backend_of
        self.admit = admit
        self.create = create
        self.stop = stop
        self.cmdlog = cmdlog
        self.on_event = on_event
        self.max_n = max_n
        self._captures = asyncio.Semaphore(CAPTURES_AT_ONCE)
        # next to the sandboxes' directories (one filesystem: a child links the image's RAM
        # file into its own directory rather than copying it)
        self.work_dir = work_dir
        if os.path.isdir(work_dir):  # images a previous process left half-made: no child needs them
            for name in os.listdir(work_dir):
                shutil.rmtree(os.path.join(work_dir, name), ignore_errors=True)
        os.makedirs(work_dir, exist_ok=True)

    async def branch(self, sandbox_id: str, n: int = 1) -> list[SandboxInfo]:
        if not 1 <= n <= self.max_n:
            raise InvalidRequest(f"n must be 1 to {self.max_n} children per branch, got {n}", field="n")
        sb = self.running(sandbox_id)
        self._check_running(sb)
        args = sb.rec.args
        self.admit(args, n)  # room for all n before the parent is paused for its capture
        backend = self.backend_of(sb)
        work = os.path.join(self.work_dir, f"{sb.id}.{secrets.token_hex(4)}")
        t0 = time.monotonic()
        async with self._captures, sb.lock:  # no pause, checkpoint or rollback of the parent meanwhile
            self._check_running(sb)
            self._check_space(sb, args)
            at = time.time()  # the capture's instant, at the latest (the parent stops right after)
            image = await backend.branch_image(sb, work)
        captured_s = time.monotonic() - t0
        tasks: list[asyncio.Task[SandboxInfo]] = []
        try:
            # the log as of the capture: the records finished by then, as a rollback keeps them
            # (one finishing later ran on in the parent; a child retrying its key runs it again)
            commands = [r for r in await asyncio.to_thread(self.cmdlog.export, sb.id)
                        if isinstance(f := r.get("finished_at"), int | float) and f <= at]
            tasks = [asyncio.create_task(self._child(args, sb, image, commands)) for _ in range(n)]
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            ok = [t for t in tasks if t.done() and not t.cancelled() and t.exception() is None]
            made = [t.result() for t in ok]
            if len(ok) < n:  # all or nothing: no half-made branch is left (a cancelled call's neither)
                await asyncio.shield(asyncio.gather(*(self.stop(i.sandbox_id) for i in made),
                                                    return_exceptions=True))
            await asyncio.shield(backend.released(image))
        if len(made) < n:
            errors = [e for t in tasks if not t.cancelled() and (e := t.exception()) is not None]
            raise errors[0] if errors else SandboxNotRunning(f"a child of {sb.id} was stopped while it was made")
        ids = [i.sandbox_id for i in made]
        self.on_event(sb.id, "branched", f"branched into {', '.join(ids)} (paused {image.get('paused_ms', '?')} ms, "
                      f"captured in {captured_s * 1e3:.0f} ms, {n} children in "
                      f"{(time.monotonic() - t0) * 1e3:.0f} ms)")
        return made

    async def _child(self, args: AnyArgs, parent: Sandbox, image: dict[str, str],
                     commands: list[dict[str, object]]) -> SandboxInfo:
        info = await self.create(args, base=list(parent.rec.digests), restore=image, branched_from=parent.id)
        try:
            await asyncio.to_thread(self.cmdlog.restore, info.sandbox_id, commands)
        except BaseException:
            await asyncio.shield(self.stop(info.sandbox_id))
            raise
        self.on_event(info.sandbox_id, "branched", f"branched from {parent.id}")
        return info

    def _check_space(self, sb: Sandbox, args: AnyArgs) -> None:
        """Room on the sandbox volume for the image (up to the parent's memory: CRIU's pages,
        a VM's RAM file) with :data:`SPARE_MB` left over, or a 507 before anything is frozen:
        the image sits on the volume every sandbox of the edge writes to."""
        need = args.memory_admitted_mb + SPARE_MB
        free = shutil.disk_usage(self.work_dir).free >> 20
        if free < need:
            raise InsufficientStorage(f"a live branch of {sb.id} needs up to {args.memory_admitted_mb} MiB for its "
                                      f"image and {SPARE_MB} MiB to spare on the sandbox volume; {free} MiB are free",
                                      field="sandbox_id")

    @staticmethod
    def _check_running(sb: Sandbox) -> None:
        state = sb.rec.info.state
        if sb.stopping or state != SandboxState.running:
            raise SandboxNotRunning(f"sandbox {sb.id} is {'stopping' if sb.stopping else state.value}: only a "
                                    "running sandbox can be branched (resume it first)", field="sandbox_id")
