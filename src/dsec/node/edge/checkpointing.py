"""Checkpoints on the edge: taking them on schedule (containers created with
``checkpoint_every_s``) or on request, restoring one here under the sandbox's own id, and
evicting a sandbox that now runs elsewhere.

A checkpoint freezes the sandbox only for a btrfs snapshot of its directory (a few
milliseconds: btrfs writes its dirty data out first, so the snapshot holds every write that
returned before it), thaws it, and does the rest while it runs: the snapshot is pruned to
what changed since the last checkpoint (dsec.node.checkpoints.delta), built into an EROFS blob
in the shared store, and recorded with the sandbox's record and command log. Every
``FULL_EVERY``-th checkpoint is full, so a restore stacks at most that many deltas. Without
the btrfs volume the changed files are copied while frozen instead (longer freezes).

What comes back on another edge: the files, the command log (keyed commands replay), the
record (labels, job, limits, lifetime). What does not: processes, memory, tmpfs contents,
network connections (docs/fault-tolerance.md says why there is no CRIU here).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import secrets
import shutil
import subprocess
import tempfile
import time

from sqlalchemy.exc import IntegrityError

from dsec.node.backends.api import SandboxLost
from dsec.node.checkpoints import delta
from dsec.node.checkpoints.store import COMMANDS_EXT, Checkpoint
from dsec.node.edge.chains import Chain, CheckpointChains
from dsec.node.edge.cmdlog import CommandLog
from dsec.node.edge.core import EdgeNode
from dsec.node.edge.creation import Creation
from dsec.node.edge.lifecycle import Lifecycle, Op
from dsec.node.edge.sandbox import Sandbox, explain
from dsec.node.edge.table import SandboxTable
from dsec.node.edge.teardown import MOVED_TO, Teardown
from dsec.node.layers.store import ImportOptions
from dsec.shared.errors import InvalidRequest, NotFound, SandboxBusy, SandboxNotRunning
from dsec.shared.faults import failpoint
from dsec.shared.wire.fleet import CheckpointInfo, RestoreSpec
from dsec.shared.wire.models import ContainerArgs, CreateRequest, MicroVMArgs, SandboxInfo, SandboxState, VMArgs

log = logging.getLogger("dsec.edge")
FULL_EVERY = 8  # a chain: one full checkpoint and up to FULL_EVERY - 1 deltas over it
CHECKPOINT_TIMEOUT_S = 600.0  # a checkpoint's build and upload; a sandbox's next waits for it


class Checkpointing:
    """checkpoint, the scheduled checkpoints, restore and evict."""

    def __init__(self, node: EdgeNode, table: SandboxTable, chains: CheckpointChains, lifecycle: Lifecycle,
                 creation: Creation, teardown: Teardown, cmdlog: CommandLog) -> None:
        self.node = node
        self.volume, self.layers = node.volume, node.layers
        self.table = table
        self.chains = chains
        self.lifecycle = lifecycle
        self.creation = creation
        self.teardown = teardown
        self.cmdlog = cmdlog

    # ---- taking one --------------------------------------------------------------------
    async def checkpoint(self, sandbox_id: str, full: bool = False) -> CheckpointInfo:
        """Take a checkpoint now (after the one under way, if any) and return it."""
        sb = self._checkpointable(sandbox_id)
        task = asyncio.create_task(self._take(sb, full=full, forced=True))
        cp = await asyncio.shield(task)
        if cp is None:
            raise SandboxNotRunning(f"sandbox {sandbox_id} was stopped while it was being checkpointed")
        return cp

    def _checkpointable(self, sandbox_id: str) -> Sandbox:
        sb = self.lifecycle.check(Op.CHECKPOINT, sandbox_id)
        assert sb is not None
        return sb

    def schedule(self, sb: Sandbox, now: float) -> None:
        """From the TTL loop's visit of ``sb``: start its checkpoint if one is due (one at a time)."""
        args = sb.rec.args
        if (not args.checkpoint_every_s or sb.stopping or sb.rec.info.state != SandboxState.running
                or sb.agent is None or (sb.ops and self.node.backend_of(sb).snapshot_files(sb) is not None)):
            # (a VM's, taken whole with QEMU down, waits for a quiet moment)
            return
        task = self.chains.tasks.get(sb.id)
        if task is not None and not task.done():
            return
        last = self.chains.chains[sb.id].taken_at if sb.id in self.chains.chains else sb.rec.info.created_at
        if now - last >= args.checkpoint_every_s:
            self.chains.tasks[sb.id] = asyncio.create_task(self._take(sb, full=False, forced=False))

    async def _take(self, sb: Sandbox, full: bool, forced: bool) -> CheckpointInfo | None:
        """One checkpoint of ``sb``; scheduled ones log their failures and are tried again
        at the next interval, forced ones raise."""
        lock = self.chains.locks.setdefault(sb.id, asyncio.Lock())
        try:
            async with lock, asyncio.timeout(CHECKPOINT_TIMEOUT_S):
                return await self._take_one(sb, full, forced)
        except Exception as e:
            if forced:
                raise
            self.node.on_event(sb.id, "checkpoint_failed", explain(e))
            # not again before the next interval (a first one that fails too)
            self.chains.chains.setdefault(sb.id, Chain(deltas=-1)).taken_at = time.time()
            return None

    async def _take_one(self, sb: Sandbox, full: bool, forced: bool) -> CheckpointInfo | None:
        if (files := self.node.backend_of(sb).snapshot_files(sb)) is not None:
            return await self._take_vm(sb, files, forced)
        chain, before = await asyncio.to_thread(self.chains.read, sb)
        if full or chain.deltas < 0 or chain.deltas + 1 >= FULL_EVERY:
            full, before = True, {}
        commands = await asyncio.to_thread(self.cmdlog.export, sb.id)
        commands_seq = max((int(c["seq"]) for c in commands), default=0)  # type: ignore[call-overload]
        work = os.path.join(self.chains.ckpt_dir, f"{sb.id}.{chain.seq + 1}.{secrets.token_hex(4)}")
        # the build slot first: a sandbox waiting for one holds no snapshot meanwhile
        async with self.chains.builds:
            try:
                freeze_ms = await self._snapshot(sb, work)
                t0 = time.monotonic()
                upper = os.path.join(work, "upper")
                now = await asyncio.to_thread(delta.scan, upper)
                d = await asyncio.to_thread(delta.prune, upper, now, before)
                if d.files == 0 and commands_seq == chain.commands_seq and not forced and not full:
                    chain.taken_at = time.time()
                    self.chains.chains[sb.id] = chain
                    return None  # nothing changed: nothing to write
                digest = None
                if d.files or full:
                    digest = await asyncio.to_thread(self.layers.build_blob, upper, ImportOptions())
                cmd_name = await asyncio.to_thread(self._put_commands, sb.id, commands)
                await failpoint("checkpoint.built")
            finally:
                await asyncio.shield(asyncio.to_thread(self._drop_work, work))
        stack = [*chain.inherited, *([digest] if digest else [])] if full else \
            [*chain.stack, *([digest] if digest else [])]
        info = sb.rec.info
        cp = Checkpoint(
            sandbox_id=sb.id, seq=chain.seq + 1, kind="full" if full else "delta", edge=self.node.name, digest=digest,
            stack=stack, bytes=self._blob_bytes(digest), files=d.files, freeze_ms=freeze_ms,
            build_ms=(time.monotonic() - t0) * 1e3, taken_at=time.time(),
            project=info.labels.get("dsec.project", "default"), commands=cmd_name,
            record=self._ckpt_record(sb, len(chain.inherited)))
        if sb.teardown is not None and not sb.keep_checkpoints:
            return None  # stopped meanwhile: its checkpoints are being dropped
        try:
            await asyncio.to_thread(self.chains.store.add, cp)
        except IntegrityError:  # another edge recorded this seq: it holds the sandbox now
            raise SandboxBusy(f"sandbox {sb.id}'s checkpoint {cp.seq} was recorded by another edge") from None
        await asyncio.to_thread(self.chains.save, sb.id, Chain(
            seq=cp.seq, stack=stack, inherited=chain.inherited, deltas=0 if full else chain.deltas + 1,
            commands_seq=commands_seq, taken_at=cp.taken_at), now)
        return self._taken(sb, cp, d.files)

    def _ckpt_record(self, sb: Sandbox, inherited: int, **extra: object) -> dict[str, object]:
        """What a restore needs besides the files: create arguments, info, and its own
        layers' blobs as it was made (a restore does not look the names up again)."""
        return {"args": sb.rec.args.model_dump(mode="json"),
                "info": sb.rec.info.model_dump(mode="json", exclude={"checkpoint", "usage"}),
                "digests": sb.rec.digests[:len(sb.rec.digests) - inherited], **extra}

    def _taken(self, sb: Sandbox, cp: Checkpoint, entries: int) -> CheckpointInfo:
        public = CheckpointInfo(**cp.model_dump(include=set(CheckpointInfo.model_fields)))
        sb.rec.info.checkpoint = public
        self.node.on_event(sb.id, "checkpoint", f"{cp.kind} #{cp.seq}: {entries} entries, {cp.bytes} bytes, "
                      f"frozen {cp.freeze_ms:.1f} ms, built in {cp.build_ms:.0f} ms")
        return public

    # ---- VMs: memory and disk, whole -------------------------------------------------------
    async def _take_vm(self, sb: Sandbox, files: dict[str, str], forced: bool) -> CheckpointInfo | None:
        """A VM's checkpoint: its RAM and devices (QEMU's migration stream, as a pause writes
        it) and its disk, copied while QEMU is down, then it runs on from that very state;
        stored whole. A restore brings the VM back running, processes and all."""
        seq = await asyncio.to_thread(self.chains.store.next_seq, sb.id)
        work = os.path.join(self.chains.ckpt_dir, f"{sb.id}.{seq}.{secrets.token_hex(4)}")
        async with self.chains.builds:
            try:
                os.makedirs(work)
                freeze_ms = await self._vm_snapshot(sb, files, work, forced)
                if freeze_ms is None:
                    return None  # requests in flight: the next interval
                t0 = time.monotonic()
                names = {kind: await asyncio.to_thread(self._put_vm_file, sb.id, seq, os.path.join(work, f), kind)
                         for kind, f in (("vmstate", "snapshot.state"), ("vmdisk", "upper.img"))}
                with open(os.path.join(work, "snapshot.json")) as f:
                    meta = json.load(f)
                commands = await asyncio.to_thread(self.cmdlog.export, sb.id)
                cmd_name = await asyncio.to_thread(self._put_commands, sb.id, commands)
                size = sum(os.stat(self.layers.backend.path(n)).st_blocks * 512 for n in names.values())
            finally:
                await asyncio.shield(asyncio.to_thread(shutil.rmtree, work, True))
        cp = Checkpoint(
            sandbox_id=sb.id, seq=seq, kind="full", edge=self.node.name, digest=None, stack=[], bytes=size, files=0,
            freeze_ms=freeze_ms, build_ms=(time.monotonic() - t0) * 1e3, taken_at=time.time(),
            project=sb.rec.info.labels.get("dsec.project", "default"), commands=cmd_name,
            record=self._ckpt_record(sb, 0, vm={**names, "meta": meta}))
        if sb.teardown is not None and not sb.keep_checkpoints:
            return None
        try:
            await asyncio.to_thread(self.chains.store.add, cp)
        except IntegrityError:
            raise SandboxBusy(f"sandbox {sb.id}'s checkpoint {cp.seq} was recorded by another edge") from None
        self.chains.chains[sb.id] = Chain(seq=seq, taken_at=cp.taken_at)
        return self._taken(sb, cp, 0)

    async def _vm_snapshot(self, sb: Sandbox, files: dict[str, str], work: str, forced: bool) -> float | None:
        """Pause the VM (unless it is), copy its snapshot and disk (``files``) to ``work``
        (reflinks on the volume), resume it; the time QEMU was down, in ms (None: it is busy)."""
        async with sb.lock:
            if sb.stopping:
                raise SandboxNotRunning(f"sandbox {sb.id} is stopping")
            if sb.ops:
                if forced:
                    raise SandboxBusy(f"sandbox {sb.id} has {sb.ops} request(s) in flight; a VM's checkpoint "
                                      "waits for them to end")
                return None
            info, backend = sb.rec.info, self.node.backend_of(sb)
            running = info.state == SandboxState.running
            t0 = time.perf_counter()
            if running:
                info.state = SandboxState.paused  # requests arriving meanwhile wait for the lock (_ready)
                self.table.held.update(sb)
                try:
                    await backend.pause(sb)
                except BaseException:
                    info.state = SandboxState.running
                    self.table.held.update(sb)
                    raise
            try:
                for src, name in ((files["state"], "snapshot.state"), (files["meta"], "snapshot.json"),
                                  (files["disk"], "upper.img")):
                    await asyncio.to_thread(subprocess.run, ["cp", "--reflink=auto", "--sparse=always", src,
                                                            os.path.join(work, name)], check=True)
            finally:
                if running:
                    try:
                        _, link = await backend.resume(sb)
                    except SandboxLost as e:
                        self.node.on_event(sb.id, "snapshot_error", e.message)
                        asyncio.create_task(self.teardown.teardown(sb, SandboxState.failed, f"checkpoint: {e.message}"))
                        raise
                    if link is not None:
                        await self.lifecycle.bind_agent(sb, link)
                    info.state = SandboxState.running
                    self.table.held.update(sb)
            return (time.perf_counter() - t0) * 1e3

    def _put_vm_file(self, sandbox_id: str, seq: int, path: str, kind: str) -> str:
        """A VM's file in the store, under a name of its own, as a sparse tar (GNU tar
        records the holes: a mostly empty 2 GiB disk is its written blocks, on a store that
        keeps no holes of its own). Not hashed: the memory snapshot has its own checksum."""
        name = f"{sandbox_id}-{seq}-{secrets.token_hex(6)}.{kind}"
        tmp = os.path.join(self.layers.backend.tempdir(), name)
        subprocess.run(["tar", "-C", os.path.dirname(path), "-cSf", tmp, os.path.basename(path)], check=True,
                       capture_output=True)
        self.layers.backend.put(tmp, name)
        return name

    async def _snapshot(self, sb: Sandbox, work: str) -> float:
        """Freeze ``sb`` (unless paused), copy its directory to ``work``, thaw; the freeze in ms."""
        async with sb.lock:
            if sb.stopping:
                raise SandboxNotRunning(f"sandbox {sb.id} is stopping")
            frozen = sb.rec.info.state == SandboxState.paused  # already: leave it so
            if not frozen:
                await self.node.containers.freeze(sb)
            t0 = time.perf_counter()
            try:
                await failpoint("checkpoint.frozen")
                if self.volume.is_subvolume(sb.dir):
                    await asyncio.to_thread(self.volume.snapshot, sb.dir, work)
                else:
                    os.makedirs(work)
                    await asyncio.to_thread(subprocess.run, ["cp", "-a", "--reflink=auto",
                                                            os.path.join(sb.dir, "upper"), work], check=True)
                return (time.perf_counter() - t0) * 1e3
            finally:
                if not frozen:
                    await self.node.containers.thaw(sb)

    def _drop_work(self, work: str) -> None:
        if os.path.lexists(work):
            self.volume.remove(work) if self.volume.is_subvolume(work) else shutil.rmtree(work, ignore_errors=True)

    def _blob_bytes(self, digest: str | None) -> int:
        if digest is None:
            return 0
        size = os.path.getsize(self.layers.blob_path(digest))
        if data := self.layers.data_of(digest):
            size += os.path.getsize(self.layers.data_path(data))
        return size

    def _put_commands(self, sandbox_id: str, commands: list[dict[str, object]]) -> str | None:
        """The command log as a blob in the store (named by its content)."""
        if not commands:
            return None
        raw = json.dumps(commands, separators=(",", ":")).encode()
        name = f"{hashlib.sha256(raw).hexdigest()}.{COMMANDS_EXT}"
        if not self.layers.backend.exists(name):
            fd, tmp = tempfile.mkstemp(dir=self.layers.backend.tempdir())
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
            self.layers.backend.put(tmp, name)
        return name

    # ---- restore and evict ----------------------------------------------------------------
    async def restore(self, spec: RestoreSpec) -> SandboxInfo:
        """Bring checkpoint ``spec.seq`` of ``spec.sandbox_id`` back here, under its own id:
        its layers with the checkpoint's stack over them, its command log, its record."""
        cp = await asyncio.to_thread(self.chains.store.get, spec.sandbox_id, spec.seq)
        if cp is None:
            raise NotFound(f"sandbox {spec.sandbox_id} has no checkpoint {spec.seq}", field="seq")
        if spec.sandbox_id in self.table.sandboxes:
            sb = self.table.sandboxes[spec.sandbox_id]
            if not sb.stopping:  # a retry of a restore that went through
                return sb.rec.info
        args = _args(cp.record["args"])
        old = SandboxInfo.model_validate(cp.record["info"])
        commands = await asyncio.to_thread(self._get_commands, cp.commands)
        vm = cp.record.get("vm")
        restore = None
        if isinstance(vm, dict):  # the VM's files: read from the store by its backend's launch
            restore = {"state": self.layers.backend.path(vm["vmstate"]), "disk": self.layers.backend.path(vm["vmdisk"]),
                       "meta": json.dumps(vm["meta"])}
        info = await self.creation.create_sandbox(args, sandbox_id=spec.sandbox_id, extra=cp.stack, origin=old,
                                  restored_from=f"{old.edge} ({spec.reason})", base=cp.record.get("digests"),
                                  restore=restore)
        await asyncio.to_thread(self.cmdlog.restore, spec.sandbox_id, commands)
        chain = Chain(seq=cp.seq, stack=cp.stack, inherited=cp.stack, deltas=-1,
                      commands_seq=max((int(c.get("seq") or 0) for c in commands), default=0),  # type: ignore[call-overload]
                      taken_at=time.time())
        await asyncio.to_thread(self.chains.save, spec.sandbox_id, chain, {})
        info.checkpoint = CheckpointInfo(**cp.model_dump(include=set(CheckpointInfo.model_fields)))
        self.node.on_event(spec.sandbox_id, "restored", f"from checkpoint #{cp.seq} of edge {old.edge} ({spec.reason})")
        return info

    def _get_commands(self, name: str | None) -> list[dict[str, object]]:
        """The checkpoint's command log; one that cannot be read costs the log, not the restore."""
        if not name:
            return []
        try:
            with open(self.layers.backend.path(name), "rb") as f:
                rows: list[dict[str, object]] = json.loads(f.read())
            return rows
        except (OSError, ValueError) as e:
            log.warning("command log %s not read (restored without it): %s", name, e)
            return []

    async def evict(self, sandbox_id: str, moved_to: str) -> SandboxInfo:
        """Stop ``sandbox_id`` here because it now runs on ``moved_to``; its checkpoints stay."""
        sb = self.lifecycle.check(Op.EVICT, sandbox_id)
        if sb is None:
            return self.table.tombstone(sandbox_id)
        sb.keep_checkpoints = True
        await self.teardown.teardown(sb, SandboxState.stopped, f"{MOVED_TO}{moved_to}")
        sb.rec.info.error = f"{MOVED_TO}{moved_to}"
        await asyncio.to_thread(self.table.state.put, sb.rec)
        return sb.rec.info


def _args(raw: dict[str, object]) -> ContainerArgs | MicroVMArgs | VMArgs:
    try:
        return CreateRequest.model_validate({"args": raw}).args
    except ValueError as e:
        raise InvalidRequest(f"the checkpoint's record holds no sandbox's arguments: {e}", field="seq") from None
