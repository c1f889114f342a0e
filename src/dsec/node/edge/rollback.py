"""In-place snapshots of running containers and the rollback to them (docs/snapshots.md).

Owns a container's snapshots on its edge: taking one (the sandbox frozen for a btrfs
snapshot of its directory, the subvolume holding its overlay's upper and work dirs),
listing and dropping them, bounding them per sandbox and against its disk quota, and the
rollback (dropping them all when the sandbox ends is dsec.node.edge.inplace's):

1. a writable snapshot of the snapshot (constant time) gets a fresh overlay over the same
   lower layers, mounted on the host;
2. the sandbox is frozen, every process of its workload (everything but dsec-init, which
   is not in the workload's cgroup) is SIGKILLed and, once thawed, gone;
3. dsec-reroot swaps the container's root for the new overlay in its mount namespace
   (/proc, /dev, /sys and tmpfs mounts move over; pivot_root moves init's root and cwd);
4. on the host the copy takes the sandbox directory's name (two renames), the old root is
   unmounted and its subvolume destroyed, and the disk limit is set on the new one;
5. shell sessions restart (lazily, at their next command) in the working directory they
   had at the snapshot; command log records after the snapshot are dropped.

Nothing is copied file by file: both the snapshot and the rollback cost the same with 1 KiB
or 1 GiB written. The snapshots live on the edge's sandbox volume under
``inplace/<sandbox id>/<name>`` (a subvolume and a ``.json`` beside it); they are not in
the shared store and do not move with the sandbox (a checkpoint does).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
import time

from dsec.node.edge.cmdlog import CommandLog
from dsec.node.edge.core import EdgeNode
from dsec.node.edge.inplace import GROUP_FILE, group_of, inplace_dir
from dsec.node.edge.lifecycle import Lifecycle, Op
from dsec.node.edge.sandbox import Sandbox
from dsec.node.edge.table import SandboxTable
from dsec.node.host import linux
from dsec.node.host.linux import unmount_all
from dsec.shared.errors import InvalidRequest, NotFound, NotSupported, SandboxError, SandboxNotRunning, SnapshotLimit
from dsec.shared.wire.models import ContainerArgs, SandboxState
from dsec.shared.wire.snapshots import RollbackResult, SandboxSnapshot, valid_snapshot_name

log = logging.getLogger("dsec.edge")

MAX_SNAPSHOTS = 32  # per sandbox: each one pins the blocks the sandbox has changed since
KILL_TIMEOUT_S = 10.0  # the workload's SIGKILL, as in a teardown
INFLIGHT_WAIT_S = 5.0  # keyed commands killed by a rollback: their records settle before the log is cut
MS_MOVE = 8192
FULL_SLACK = 1 << 20  # a sandbox within this of its disk limit takes no snapshot more
_DISCARDS: set[asyncio.Future[None]] = set()  # old roots being removed (a reference keeps each task alive)


class InplaceSnapshots:
    """snapshot, list_snapshots, drop_snapshot, rollback (containers on the btrfs volume)."""

    def __init__(self, node: EdgeNode, table: SandboxTable, lifecycle: Lifecycle, cmdlog: CommandLog) -> None:
        self.node = node
        self.volume, self.layers = node.volume, node.layers
        self.table = table
        self.lifecycle = lifecycle
        self.cmdlog = cmdlog
        # sandbox id -> (snapshot, the task making its spare copy: the next rollback's)
        self.spares: dict[str, tuple[str, asyncio.Task[str | None]]] = {}
        self.reroot_built = False  # the rollback's helper binary, compiled at the edge's first snapshot

    # ---- where they are ---------------------------------------------------------------
    def _inplace_dir(self, sandbox_id: str) -> str:
        return inplace_dir(self.volume, sandbox_id)

    def _inplace_sandbox(self, op: Op, sandbox_id: str) -> Sandbox:
        """The running container whose snapshots these are, or a typed error saying why not."""
        sb, _ = self.lifecycle.attached(op, sandbox_id)
        if not isinstance(sb.rec.args, ContainerArgs):
            raise NotSupported(f"sandbox {sandbox_id} is a {sb.rec.args.backend}: in-place snapshots are for "
                               "containers for now (a VM's checkpoint keeps its memory: POST .../checkpoint)",
                               field="sandbox_id")
        if not self.volume.is_subvolume(sb.dir):
            raise NotSupported(f"edge {self.node.name} has no btrfs sandbox volume ({self.volume.status}): an in-place "
                               "snapshot needs one (a copy would take time in proportion to the data)",
                               field="sandbox_id")
        return sb

    def _group(self, sb: Sandbox) -> int | None:
        """The level-1 qgroup holding the sandbox's subvolume and all its snapshots under its
        disk limit, so the kernel counts blocks shared among them once and refuses writes
        past it (EDQUOT) however they are split; made at its first snapshot. None: no limit,
        or btrfs could not account the sandbox in a group without a rescan (then the edge
        checks live + each snapshot's exclusive bytes at each snapshot instead)."""
        assert isinstance(sb.rec.args, ContainerArgs)
        limit = sb.rec.args.disk_limit_mb
        if limit is None:
            return None
        d = self._inplace_dir(sb.id)
        if os.path.exists(os.path.join(d, GROUP_FILE)):  # decided at its first snapshot
            return group_of(d)
        live = self.volume.subvolume_id(sb.dir)
        assert live is not None
        group = (1 << 48) | live
        # a subvolume sharing extents (a checkpoint's snapshot of it under way) cannot join a
        # group without btrfs marking every qgroup inconsistent until a rescan: not then
        shares = self.volume.referenced(live, live).get(live) != self.volume.referenced(live, live, True).get(live)
        if not shares:
            with contextlib.suppress(FileExistsError):
                self.volume.group_create(group)
        if not shares and self.volume.group_assign(live, group):
            self.volume.group_limit(group, limit)
        else:
            if not shares:
                self.volume.group_assign(live, group, assign=False)
                self.volume.group_remove(group)
            log.warning("sandbox %s: its subvolume shares extents; snapshots are checked against its disk limit "
                        "by the edge, not by a qgroup", sb.id)
            group = -1
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, GROUP_FILE), "w") as f:
            json.dump({"group": group}, f)
        return group if group > 0 else None

    @staticmethod
    def _check_name(name: str) -> str:
        try:
            return valid_snapshot_name(name)
        except ValueError as e:
            raise InvalidRequest(str(e), field="name") from None

    def _read_snapshots(self, sandbox_id: str) -> list[SandboxSnapshot]:
        d = self._inplace_dir(sandbox_id)
        out = []
        with contextlib.suppress(FileNotFoundError):
            for entry in os.listdir(d):
                if not entry.endswith(".json"):
                    continue
                try:
                    with open(os.path.join(d, entry)) as f:
                        snap = SandboxSnapshot.model_validate_json(f.read())
                except (OSError, ValueError):
                    continue
                if self.volume.is_subvolume(os.path.join(d, snap.name)):
                    out.append(snap)
        return sorted(out, key=lambda s: s.taken_at)

    def _read_one(self, path: str) -> SandboxSnapshot | None:
        try:
            with open(f"{path}.json") as f:
                snap = SandboxSnapshot.model_validate_json(f.read())
        except (OSError, ValueError):
            return None
        return snap if self.volume.is_subvolume(path) else None

    # ---- a spare copy: the next rollback's copy, made while the sandbox runs ----------------
    def _make_spare(self, sb: Sandbox, name: str) -> None:
        """Start a writable copy of snapshot ``name``, just rolled back to, for the sandbox's
        next rollback to it (a tree search rolls back to the same node for each of its
        children). One spare per sandbox: the one for another snapshot goes."""
        spares = self.spares
        for sid in [sid for sid in spares if sid not in self.table.sandboxes]:  # ended: their directory went with them
            del spares[sid]
        prev = spares.pop(sb.id, None)
        d = self._inplace_dir(sb.id)

        async def make() -> str | None:
            if prev is not None:
                with contextlib.suppress(BaseException):
                    if (old := await prev[1]) is not None:
                        await asyncio.to_thread(self.volume.remove, old)
            path = os.path.join(d, f".spare-{name}")
            if sb.stopping:
                return None
            try:
                await asyncio.to_thread(self.volume.snapshot, os.path.join(d, name), path, group_of(d))
            except OSError:
                return None
            return path

        spares[sb.id] = (name, asyncio.create_task(make()))

    async def _take_spare(self, sb: Sandbox, name: str) -> str | None:
        """The spare copy of ``name`` if there is one (waiting for it if it is being made)."""
        entry = self.spares.pop(sb.id, None)
        if entry is None:
            return None
        path = await entry[1]
        if entry[0] == name or path is None:
            return path
        await asyncio.to_thread(self.volume.remove, path)  # a copy of another snapshot
        return None

    def _measured(self, snaps: list[SandboxSnapshot]) -> list[SandboxSnapshot]:
        """Their exclusive bytes from their qgroups (as of the last commit)."""
        if not snaps:
            return snaps
        ids = {s.name: self.volume.subvolume_id(os.path.join(self._inplace_dir(s.sandbox_id), s.name))
               for s in snaps}
        excl = self.volume.referenced(exclusive=True)
        return [s.model_copy(update={"bytes": excl.get(ids[s.name] or -1)}) for s in snaps]

    # ---- the operations ---------------------------------------------------------------
    async def snapshot(self, sandbox_id: str, name: str | None = None) -> SandboxSnapshot:
        """Freeze the container, snapshot its writable layer's subvolume, thaw: its files as
        they are now, kept on this edge until dropped, rolled back to, or the sandbox ends."""
        sb = self._inplace_sandbox(Op.SNAPSHOT, sandbox_id)
        if name is not None:
            self._check_name(name)
        async with sb.lock:
            if sb.stopping:
                raise SandboxNotRunning(f"sandbox {sandbox_id} is stopping")
            snaps = await asyncio.to_thread(self._read_snapshots, sb.id)
            if len(snaps) >= MAX_SNAPSHOTS:
                raise SnapshotLimit(f"sandbox {sandbox_id} holds {len(snaps)} snapshots, the most it may "
                                    f"({MAX_SNAPSHOTS}); drop one first (DELETE .../snapshots/NAME)", field="name")
            if name is None:
                taken = [int(m.group(1)) for s in snaps if (m := re.fullmatch(r"snap-(\d+)", s.name))]
                name = f"snap-{max(taken, default=0) + 1}"
            elif any(s.name == name for s in snaps):
                raise InvalidRequest(f"sandbox {sandbox_id} already has a snapshot {name!r}", field="name")
            group = await asyncio.to_thread(self._group, sb)
            await asyncio.to_thread(self._check_quota, sb, snaps, group)
            d = self._inplace_dir(sb.id)
            os.makedirs(d, exist_ok=True)
            frozen = sb.rec.info.state == SandboxState.paused
            if not frozen:
                await self.node.containers.freeze(sb)
            t0, wall = time.perf_counter(), time.time()
            try:
                await asyncio.to_thread(self.volume.snapshot, sb.dir, os.path.join(d, name), group)
                freeze_ms = (time.perf_counter() - t0) * 1e3
            finally:
                if not frozen:
                    await self.node.containers.thaw(sb)
            agent = sb.agent
            snap = SandboxSnapshot(
                sandbox_id=sb.id, name=name, taken_at=wall, freeze_ms=freeze_ms,
                commands_seq=self.cmdlog.last_seq(sb.id),
                sessions={n: s.cwd for n, s in agent.sessions.items()} if agent else {})
            with open(os.path.join(d, f"{name}.json"), "w") as f:
                f.write(snap.model_dump_json())
        if not self.reroot_built:  # the first rollback's helper, compiled now
            self.reroot_built = True
            asyncio.get_running_loop().run_in_executor(None, self.node.containers.reroot_binary)
        self.node.on_event(sb.id, "snapshot", f"{name}: frozen {freeze_ms:.1f} ms")
        return snap

    def _check_quota(self, sb: Sandbox, snaps: list[SandboxSnapshot], group: int | None) -> None:
        """Snapshots count against the sandbox's disk quota: the blocks it and its snapshots
        reference, each counted once (its qgroup group's), must leave room under its limit
        (without a group: what it references plus what each snapshot alone holds)."""
        assert isinstance(sb.rec.args, ContainerArgs)
        limit_mb = sb.rec.args.disk_limit_mb
        if limit_mb is None or not snaps:
            return
        live = self.volume.usage(sb.dir) or 0
        if group is not None:
            held = max(0, self.volume.referenced(group, group).get(group, 0) - live)
        else:
            held = sum(s.bytes or 0 for s in self._measured(snaps))
        if live + held >= (limit_mb << 20) - FULL_SLACK:  # full: the kernel already refuses its writes
            raise SnapshotLimit(f"sandbox {sb.id}'s snapshots hold {held >> 20} MiB beside its {live >> 20} MiB, "
                                f"its whole disk quota ({limit_mb} MiB): drop one first", field="name")

    async def list_snapshots(self, sandbox_id: str) -> list[SandboxSnapshot]:
        sb = self._inplace_sandbox(Op.LIST_SNAPSHOTS, sandbox_id)
        return await asyncio.to_thread(lambda: self._measured(self._read_snapshots(sb.id)))

    async def drop_snapshot(self, sandbox_id: str, name: str) -> None:
        sb = self._inplace_sandbox(Op.DROP_SNAPSHOT, sandbox_id)
        self._check_name(name)
        async with sb.lock:
            path = os.path.join(self._inplace_dir(sb.id), name)
            if not self.volume.is_subvolume(path):
                raise NotFound(f"sandbox {sandbox_id} has no snapshot {name!r}", field="name")
            if (spare := await self._take_spare(sb, name)) is not None:
                await asyncio.to_thread(self.volume.remove, spare)
            await asyncio.to_thread(self._drop_one, path)

    def _drop_one(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{path}.json")
        self.volume.remove(path)

    async def rollback(self, sandbox_id: str, snapshot: str) -> RollbackResult:
        """Bring the sandbox's files back to snapshot ``snapshot`` exactly: every process of
        the workload is killed (dsec-init stays), shell sessions restart at the working
        directory they had then, and command log records after it are dropped."""
        t_start = time.perf_counter()
        # a paused sandbox resumes first (any request resumes it)
        sb, _ = await self.lifecycle.ready(Op.ROLLBACK, sandbox_id)
        sb = self._inplace_sandbox(Op.ROLLBACK, sandbox_id)
        self._check_name(snapshot)
        src = os.path.join(self._inplace_dir(sb.id), snapshot)
        async with sb.lock:
            if sb.stopping:
                raise SandboxNotRunning(f"sandbox {sandbox_id} is stopping")
            snap = self._read_one(src)
            if snap is None:
                raise NotFound(f"sandbox {sandbox_id} has no snapshot {snapshot!r}", field="snapshot")
            info = sb.rec.info
            steps: dict[str, float] = {}
            # requests arriving meanwhile wait for the lock (_ready resumes a paused sandbox)
            info.state = SandboxState.paused
            try:
                killed, frozen_ms = await self._swap_root(sb, src, steps)
            except BaseException:
                if sb.agent is None or sb.stopping:
                    raise
                info.state = SandboxState.running
                raise
            # still read as paused: a command arriving now waits for the lock, so it neither
            # runs in a session about to restart nor has its record cut from the log
            t = time.perf_counter()
            try:
                sessions = await self._restart_sessions(sb, snap)
                dropped = await self._cut_command_log(sb, snap)
            finally:
                if not sb.stopping:
                    info.state = SandboxState.running
            steps["sessions_and_log"] = round((time.perf_counter() - t) * 1e3, 3)
        ms = (time.perf_counter() - t_start) * 1e3
        self._make_spare(sb, snapshot)
        self.node.on_event(sb.id, "rollback", f"to {snapshot} in {ms:.1f} ms (frozen {frozen_ms:.1f} ms): {killed} "
                      f"processes killed, {len(sessions)} sessions restarted, {dropped} command records dropped")
        return RollbackResult(sandbox_id=sb.id, snapshot=snapshot, rollback_ms=ms, frozen_ms=frozen_ms, killed=killed,
                              sessions=sessions, commands_dropped=dropped, steps_ms=steps)

    async def _swap_root(self, sb: Sandbox, src: str, steps: dict[str, float]) -> tuple[int, float]:
        """Steps 1-4 of the module's docstring; (processes killed, ms frozen). ``steps``
        gets each step's milliseconds."""
        parent, name = os.path.split(sb.dir)
        fresh = os.path.join(parent, f".{name}.{secrets.token_hex(4)}")
        t = time.perf_counter()

        def lap(step: str) -> None:
            nonlocal t
            now = time.perf_counter()
            steps[step] = round((now - t) * 1e3, 3)
            t = now

        lowers = await self.node.containers.lowers(sb)
        spare = await self._take_spare(sb, os.path.basename(src))
        if spare is not None:
            os.rename(spare, fresh)
        else:
            await asyncio.to_thread(self.volume.snapshot, src, fresh, group_of(os.path.dirname(src)))
        lap("copy")  # (a snapshot takes its source's qgroup limit: the copy has the sandbox's)
        try:
            await asyncio.to_thread(self._mount_copy, sb, fresh, lowers)
            lap("mount")
            await self.node.containers.freeze(sb)
            lap("freeze")
        except BaseException:
            await asyncio.to_thread(self._discard, fresh)
            raise
        t0 = time.perf_counter()
        try:
            killed = self.node.containers.signal_workload(sb)
            # init is frozen too: pivot_root moves its root all the same, and nothing of the
            # workload runs again before it dies
            await self.node.containers.reroot(sb, os.path.join(fresh, "rootfs"))
            lap("reroot")
        except BaseException:
            await self.node.containers.thaw(sb)
            await asyncio.to_thread(self._discard, fresh)
            raise
        await self.node.containers.thaw(sb)
        frozen_ms = (time.perf_counter() - t0) * 1e3
        try:
            await asyncio.to_thread(self.node.containers.workload_gone, sb, KILL_TIMEOUT_S)
            lap("killed")
        finally:
            # the container runs on the copy from here whatever happens (a process slow to
            # die, a cancel): its directory, quota and disk must follow it (a few renames)
            old = self._take_place(sb, fresh)
            lap("swap")
            # the old root is detached (nothing of the sandbox reaches it): unmounted and
            # destroyed off the rollback's path, which need not wait for btrfs to let go of it
            task = asyncio.create_task(asyncio.to_thread(self._discard, old))
            _DISCARDS.add(task)
            task.add_done_callback(_DISCARDS.discard)
        return killed, frozen_ms

    def _mount_copy(self, sb: Sandbox, fresh: str, lowers: list[str]) -> None:
        """The copy's overlay. Mounting writes a little (its work dir): a sandbox at its disk
        limit (a reason to roll back) gets room for that, its group's limit raised by
        ``FULL_SLACK`` for the mount only (the old root's blocks go once it is destroyed).
        An overlay that went read-only anyway is refused, not swapped in."""
        assert isinstance(sb.rec.args, ContainerArgs)
        group, limit = group_of(self._inplace_dir(sb.id)), sb.rec.args.disk_limit_mb
        if group is not None and limit is not None:
            self.volume.group_limit(group, limit + (FULL_SLACK >> 20))
        try:
            self.node.containers.mount_root(fresh, lowers)
        finally:
            if group is not None and limit is not None:
                self.volume.group_limit(group, limit)
        if os.statvfs(os.path.join(fresh, "rootfs")).f_flag & os.ST_RDONLY:
            raise SandboxError(f"sandbox {sb.id}: the snapshot's copy mounted read-only (its disk is full?); "
                               "the sandbox was left as it was")

    def _take_place(self, sb: Sandbox, fresh: str) -> str:
        """The new subvolume becomes the sandbox's directory; where the old one is now."""
        assert isinstance(sb.rec.args, ContainerArgs)
        old = f"{fresh}.old"
        os.rename(sb.dir, old)
        os.rename(fresh, sb.dir)
        if sb.rec.args.record_access:  # its private layer mounts live in the old directory
            for i in range(len(sb.rec.digests)):
                mp = os.path.join(old, "lower", str(i))
                if os.path.ismount(mp):
                    linux.mount(mp, os.path.join(sb.dir, "lower", str(i)), "", MS_MOVE)
        self.node.containers.directory_replaced(sb)
        return old

    def _discard(self, path: str) -> None:
        try:
            unmount_all(path)
            self.volume.remove(path)
        except OSError as e:  # the sandbox runs on regardless; the edge's next start sweeps it
            log.warning("rollback: %s not removed: %s", path, e)

    async def _restart_sessions(self, sb: Sandbox, snap: SandboxSnapshot) -> list[str]:
        """Every shell session died with the workload: close them, and make those of the
        snapshot again, each to start in its working directory of then at its next command."""
        from dsec.node.agent.sessions import ShellSession

        agent = sb.agent
        if agent is None:
            return []
        for s in list(agent.sessions.values()):
            await s.close()
        agent.sessions.clear()
        for name, cwd in snap.sessions.items():
            sess = agent.sessions[name] = ShellSession(agent.init, agent.ctx, name)
            sess.cwd = cwd
        return sorted(snap.sessions)

    async def _cut_command_log(self, sb: Sandbox, snap: SandboxSnapshot) -> int:
        """Keyed commands the rollback killed settle first (their records finish), then every
        record after the snapshot goes: a retry of such a key runs the command again."""
        running = [f.task for (sid, _), f in self.cmdlog.inflight.items() if sid == sb.id]
        if running:
            await asyncio.wait(running, timeout=INFLIGHT_WAIT_S)
        return self.cmdlog.roll_back(sb.id, snap.commands_seq, snap.taken_at)
