"""Container sandboxes on an edge: overlayfs over the node's EROFS layer mounts, a
btrfs subvolume (with its quota) for the writable layer, crun with dsec-init as PID 1
executed from an fd, the workload in a child cgroup of its own, and the kernel's
freezer and swap for pause. Implements :class:`dsec.node.backends.api.SandboxRuntime`; its
state of a sandbox is a :class:`ContainerState`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import threading
from dataclasses import dataclass

from dsec.node.agent.initclient import ChannelLost, InitClient
from dsec.node.backends.api import Adopted, BackendState, InitLink, Launched, Sandbox
from dsec.node.backends.container import branching
from dsec.node.backends.container.runtime import CrunRuntime, Limits, oci_config
from dsec.node.host import linux, memory
from dsec.node.host.cgroup import WORKLOAD, Cgroup, is_v2
from dsec.node.host.process import alive, wait_gone
from dsec.node.host.volume import SandboxVolume
from dsec.node.storage.node import NodeLayers
from dsec.shared import tracing
from dsec.shared.errors import BranchUnsupported, DsecError, InvalidRequest, SandboxBusy, SandboxError
from dsec.shared.faults import failpoint
from dsec.shared.wire.models import ContainerArgs, SandboxState

KILL_TIMEOUT_S = 10.0  # SIGKILL through the cgroup for at most this long
FREEZE_TIMEOUT_S = 10.0  # a task in uninterruptible sleep (I/O) delays freezing: this long at most
_REROOT_BUILD = threading.Lock()  # dsec-reroot's compile, once (a snapshot starts it, a rollback may too)


def _listener(path: str) -> socket.socket:
    """dsec-init's listening socket at ``path`` (made in the namespace of the calling thread).

    It is bound through a descriptor of its directory (``/proc/self/fd/N/NAME``): the
    sandbox's network namespace lists the sockets made in it (``/proc/net/unix``) by the
    path they were bound with, and the host's layout is not the sandbox's to read (nor
    is that path anything it can reach: its own ``/proc/self/fd/N`` is not this one)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    d = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        lsock.bind(f"/proc/self/fd/{d}/{os.path.basename(path)}")
        os.chmod(path, 0o600)
        lsock.listen(64)
    except BaseException:
        lsock.close()
        raise
    finally:
        os.close(d)
    return lsock


def _cpu_shares(args: ContainerArgs) -> int:
    return 2 if args.qos == "best_effort" else 1024


@dataclass
class ContainerState(BackendState):
    qgroup: int | None = None  # its subvolume on the sandbox volume (disk quota)
    connected: bool = False  # its init answered this edge (a container paused across a restart has not)
    branch: str | None = None  # the branch image it starts from (a live branch's child), until it runs


class ContainerSandboxes:
    def __init__(self, node_layers: NodeLayers, volume: SandboxVolume, run_dir: str, cgroup_parent: str,
                 init_binary: str) -> None:
        self.node_layers, self.volume = node_layers, volume
        self.run_dir, self.init_binary = run_dir, init_binary
        self.runtime = CrunRuntime(os.path.join(run_dir, "crun"), cgroup_parent=cgroup_parent)
        os.makedirs(os.path.join(run_dir, "s"), exist_ok=True)
        # one directory per child restored by CRIU (its log, its pid file): crun does not know
        # them, so this is how a restarted edge's known() finds them
        self.criu_dir = os.path.join(run_dir, "criu")

    def cgroup_path(self, sandbox_id: str) -> str:
        return self.runtime.cgroup_path(sandbox_id)

    def sock_path(self, sandbox_id: str) -> str:
        return os.path.join(self.run_dir, "s", sandbox_id)

    @staticmethod
    def _args(sb: Sandbox) -> ContainerArgs:
        assert isinstance(sb.rec.args, ContainerArgs)
        return sb.rec.args

    @staticmethod
    def _state(sb: Sandbox) -> ContainerState:
        if not isinstance(sb.state, ContainerState):  # (a record taken back to be torn down has none yet)
            sb.state = ContainerState()
        return sb.state

    async def prepare(self, sb: Sandbox, digests: list[str], restore: dict[str, str] | None = None
                      ) -> list[tuple[str, str]]:
        sid, args, layers = sb.id, self._args(sb), self.node_layers
        if args.record_access and not layers.on_demand:
            raise InvalidRequest("record_access needs a shared layer store read on demand", field="record_access")
        state = sb.state = ContainerState()
        events = []
        if restore is not None and restore.get("kind") == branching.KIND:
            # a live branch's child: its writable layer is the parent's at the captured instant
            if not self.volume.available:
                raise BranchUnsupported(f"no btrfs sandbox volume here ({self.volume.status})")
            image = restore["image"]
            await asyncio.to_thread(self.volume.snapshot, os.path.join(image, "root"), sb.dir)
            if args.disk_limit_mb is not None:
                self.volume.limit(sb.dir, args.disk_limit_mb)
            state.qgroup, state.branch = self.volume.subvolume_id(sb.dir), image
            events.append(("branch", "writable layer from the branch image"))
        elif self.volume.available:
            self.volume.create(sb.dir, args.disk_limit_mb)
            state.qgroup = self.volume.subvolume_id(sb.dir)
        if queued := await layers.prefetch(digests):
            events.append(("prefetch", f"{queued} chunks of recorded access lists queued"))
        with tracing.span("layers.mount", sandbox_id=sid, layers=len(digests)):
            if args.record_access:
                lowers = [await layers.mount(d, os.path.join(sb.dir, "lower", str(i)), record_tag=sid)
                          for i, d in reversed(list(enumerate(digests)))]
            else:
                lowers = [await layers.mount(d) for d in reversed(digests)]
        for sub in ("upper", "work", "rootfs"):
            os.makedirs(os.path.join(sb.dir, sub), exist_ok=True)
        with tracing.span("rootfs.mount", sandbox_id=sid, lowers=len(lowers)):
            # the layers named by this process's fds, not by their host paths: the options are
            # what the sandbox reads in /proc/self/mountinfo, and host paths are none of its business
            fds = [os.open(p, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
                   for p in (*lowers, f"{sb.dir}/upper", f"{sb.dir}/work")]
            try:
                *low, up, work = (f"/proc/self/fd/{fd}" for fd in fds)
                linux.mount("overlay", os.path.join(sb.dir, "rootfs"), "overlay", 0,
                            f"lowerdir={':'.join(low)},upperdir={up},workdir={work}")
            finally:
                for fd in fds:
                    os.close(fd)
        await failpoint("create.mounted")
        return events

    async def launch(self, sb: Sandbox, digests: list[str]) -> Launched:
        sid, args = sb.id, self._args(sb)
        if (image := self._state(sb).branch) is not None:
            with tracing.span("criu.restore", sandbox_id=sid):
                restored = await branching.restore(
                    os.path.join(image, "criu"), os.path.join(sb.dir, "rootfs"), self.cgroup_path(sid),
                    self.sock_path(sid), os.path.join(self.criu_dir, sid), sid, _listener)
            # CRIU gives its cgroups the parent's state at the dump, frozen among it
            await self.thaw(sb)
            return Launched(restored.pid)
        limits = Limits(args.memory_limit_mb, args.cpu_cores_limit, args.pids_limit, cpu_shares=_cpu_shares(args))
        sock_path = self.sock_path(sid)
        # its network namespace is made here, not by crun, and init's listening socket in it:
        # every socket of init's channel to the edge then belongs to the sandbox's own
        # namespace, which is what lets CRIU checkpoint it (node/backends/container/branching.py)
        with tracing.span("netns.new", sandbox_id=sid):
            netns, lsock = await asyncio.to_thread(linux.new_netns, lambda: _listener(sock_path))
        init_fd = -1
        try:
            with open(os.path.join(sb.dir, "config.json"), "w") as f:
                json.dump(oci_config(sid, os.path.join(sb.dir, "rootfs"), limits, self.cgroup_path(sid), args.tmpfs,
                                     args.readonly_rootfs, netns=f"/proc/{os.getpid()}/fd/{netns}"), f)
            init_fd = os.open(self.init_binary, os.O_RDONLY | os.O_CLOEXEC)
            with tracing.span("crun.run", sandbox_id=sid):
                pid = await self.runtime.run(sid, sb.dir, init_fd, lsock.fileno())
        finally:
            lsock.close()
            os.close(netns)
            if init_fd >= 0:
                os.close(init_fd)
        return Launched(pid)

    async def connect(self, sb: Sandbox) -> InitLink:
        args = self._args(sb)
        idle = args.qos == "best_effort"
        # the workload's limits on its own child cgroup; init keeps a reserve beside it
        # in place: a few mkdirs and writes in cgroupfs (~0.3 ms), where the hop to a thread
        # and back waited for the GIL under a burst of creates (docs/performance.md)
        procs = Cgroup(self.cgroup_path(sb.id)).split_workload(args.memory_limit_mb, args.cpu_cores_limit,
                                                              args.pids_limit, _cpu_shares(args), idle)
        state = self._state(sb)
        if state.branch is not None:  # restored: its init holds the child's S/w already; the limits are its own
            state.branch = None
            for fd in procs:
                os.close(fd)
            return await self._attach(sb)
        return await self._attach(sb, (procs, idle))

    async def branch_image(self, sb: Sandbox, work: str) -> dict[str, str]:
        """Frozen: a btrfs snapshot of its directory (the overlay's upper and work dirs) at
        ``work``/root and a CRIU dump of its process tree at ``work``/criu, taken at the
        same instant; thawed. ``work`` is a new directory in :meth:`branch_dir`; the caller
        removes it with :meth:`drop_branch_image` once its children are made (they hold
        nothing of it)."""
        branching.criu_binary()  # (BranchUnsupported before anything is frozen)
        if is_v2():
            # CRIU re-creates the child's cgroup itself and restores v1's device list, not v2's
            # device program (crun's eBPF filter): the child would open any device node
            raise BranchUnsupported("a container's live branch needs cgroup v1 on its node: on cgroup v2, CRIU does "
                                    "not restore the device filter of the sandbox's cgroup")
        if not self.volume.available or not self.volume.is_subvolume(sb.dir):
            raise BranchUnsupported(f"sandbox {sb.id} is not on a btrfs sandbox volume ({self.volume.status}): a "
                                    "live branch snapshots its writable layer")
        if self._args(sb).record_access:
            raise BranchUnsupported("a sandbox recording its file access (record_access) cannot be branched live")
        if os.path.dirname(os.path.abspath(work)) != self.branch_dir():
            raise SandboxError(f"a branch image goes under {self.branch_dir()} (the sandbox volume), not at {work}")
        images = os.path.join(work, "criu")
        os.makedirs(images)
        cg = Cgroup(self.cgroup_path(sb.id))
        paused = cg.frozen()  # (a paused sandbox is captured as it is, and stays paused)
        try:
            async with contextlib.AsyncExitStack() as stack:
                # each shell session idle through the capture (CRIU carries them): a command in
                # flight in one would run on in each child, its output reaching none of its
                # callers, so it is refused as a running one-shot command is (by its channel)
                busy = await stack.enter_async_context(sb.agent.sessions_quiet()) if sb.agent else []
                if busy:
                    raise BranchUnsupported(f"shell session {busy[0]!r} is running a command: let it finish "
                                            "(or time out) first")
                if not paused:
                    await self.freeze(sb)
                try:
                    await asyncio.to_thread(self.volume.snapshot, sb.dir, os.path.join(work, "root"))
                    with tracing.span("criu.dump", sandbox_id=sb.id):
                        await branching.dump(sb.rec.init_pid, self.cgroup_path(sb.id), cg.dir("freezer"), images)
                finally:
                    if not paused:
                        await self.thaw(sb)
        except BaseException:
            await asyncio.to_thread(self.drop_branch_image, work)
            raise
        return {"kind": branching.KIND, "image": work}

    def branch_dir(self) -> str:
        """Where branch images go: a directory on the sandbox volume (a btrfs snapshot of a
        sandbox's directory can only be made on the same filesystem)."""
        d = os.path.join(self.volume.mnt, "branches")
        os.makedirs(d, exist_ok=True)
        return d

    def drop_branch_image(self, work: str) -> None:
        """A branch image gone: its root's subvolume and its CRIU images."""
        root = os.path.join(work, "root")
        if self.volume.is_subvolume(root):
            self.volume.remove(root)
        branching.drop(work)

    async def _attach(self, sb: Sandbox, workload: tuple[list[int], bool] | None = None) -> InitLink:
        """Connect to the container's init (``workload``: at create, the cgroup.procs fds
        its children join, and whether they run SCHED_IDLE)."""
        init = InitClient(self.sock_path(sb.id), netns=f"/proc/{sb.rec.init_pid}/ns/net" if sb.rec.init_pid else None)
        try:
            try:
                await init.connect()
            except ChannelLost as e:  # say whether init is gone or only silent: they are different faults
                pid = sb.rec.init_pid
                alive = pid is not None and os.path.exists(f"/proc/{pid}")
                raise ChannelLost(f"{e.message} (init pid {pid} {'alive' if alive else 'gone'}; "
                                  f"{self._init_cgroup_state(sb.id)})") from None
            if workload is not None:
                await init.configure(*workload)
        except BaseException:
            init.close()
            raise
        finally:
            for fd in workload[0] if workload else []:
                os.close(fd)
        self._state(sb).connected = True
        return InitLink(init)

    def _init_cgroup_state(self, sid: str) -> str:
        """What the sandbox's cgroup says of it: processes left, OOM kills (for an error)."""
        cg = self.cgroup_path(sid)
        try:
            procs = len(Cgroup(cg).procs())
        except OSError:
            procs = -1
        return f"{procs} processes in its cgroup, {memory.oom_kills(cg)} OOM kills"

    async def freeze(self, sb: Sandbox) -> None:
        """Every task frozen through the cgroup's freezer, as ``crun pause`` would do it
        (without its fork and exec); SandboxBusy, thawed again, if a task will not freeze."""
        if not await asyncio.to_thread(Cgroup(self.cgroup_path(sb.id)).freeze_all, FREEZE_TIMEOUT_S):
            await self.thaw(sb)
            raise SandboxBusy(f"sandbox {sb.id}: its tasks did not all freeze within {FREEZE_TIMEOUT_S:g} s "
                              "(one is stuck in the kernel, say on I/O); it was left running")

    async def thaw(self, sb: Sandbox) -> None:
        await asyncio.to_thread(Cgroup(self.cgroup_path(sb.id)).freeze, False)

    # ---- in-place rollback (dsec.node.edge.rollback): the backend's half -------------------
    async def lowers(self, sb: Sandbox) -> list[str]:
        """The lower dirs of its root overlay, top first, as ``prepare`` mounted them
        (node mounts are shared and already there; a recording sandbox's are its own)."""
        digests, layers = sb.rec.digests, self.node_layers
        if self._args(sb).record_access:
            return [os.path.join(sb.dir, "lower", str(i)) for i in reversed(range(len(digests)))]
        return [await layers.mount(d) for d in reversed(digests)]

    def directory_replaced(self, sb: Sandbox) -> None:
        """Its directory is a new subvolume now (a rollback swapped it in): its quota follows."""
        if isinstance(sb.state, ContainerState):
            sb.state.qgroup = self.volume.subvolume_id(sb.dir)

    @staticmethod
    def mount_root(bundle: str, lowers: list[str]) -> None:
        """An overlay of ``lowers`` under ``bundle``'s upper and work dirs at ``bundle``/rootfs."""
        fds = [os.open(p, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
               for p in (*lowers, f"{bundle}/upper", f"{bundle}/work")]
        try:
            *low, up, work = (f"/proc/self/fd/{fd}" for fd in fds)
            linux.mount("overlay", os.path.join(bundle, "rootfs"), "overlay", 0,
                        f"lowerdir={':'.join(low)},upperdir={up},workdir={work}")
        finally:
            for fd in fds:
                os.close(fd)

    def signal_workload(self, sb: Sandbox) -> int:
        """SIGKILL every process of the workload (its cgroup ``S/w``: everything but
        dsec-init); how many. Called frozen: the signals are pending when it thaws, and
        nothing forks in between."""
        import signal

        pids = Cgroup(os.path.join(self.cgroup_path(sb.id), WORKLOAD)).procs()
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        return len(pids)

    def workload_gone(self, sb: Sandbox, timeout: float) -> None:
        """Wait (thawed) until the killed workload has exited: killed tasks only need a
        moment of CPU, so this polls often; past a few ms, Cgroup.kill's loop takes over."""
        import time

        work = Cgroup(os.path.join(self.cgroup_path(sb.id), WORKLOAD))
        deadline = time.monotonic() + 0.02
        while work.procs():
            if time.monotonic() > deadline:
                if not work.kill(timeout):
                    raise SandboxError(f"processes left in its workload cgroup after {timeout:g} s of SIGKILL: "
                                       f"{sorted(work.procs())[:10]}")
                return
            time.sleep(0.0002)

    def reroot_binary(self) -> str:
        """dsec-reroot beside dsec-init, compiled the first time (a snapshot starts that, so
        the first rollback does not wait for the compiler)."""
        from dsec.node.agent.native import ensure_binary

        with _REROOT_BUILD:  # one compile at a time (its temporary file is named by the pid)
            return ensure_binary("dsec-reroot", os.path.join(os.path.dirname(self.init_binary), "dsec-reroot"))

    async def reroot(self, sb: Sandbox, new_root: str) -> None:
        """Make the overlay mounted at ``new_root`` the container's root (dsec-reroot:
        moves /proc, /dev, /sys and its tmpfs mounts over, then pivot_root, so init's
        root and cwd follow). The workload must be dead: a survivor keeps the old root."""
        from dsec.node.backends.container.runtime import _wait_child

        binary = await asyncio.to_thread(self.reroot_binary)
        pid = sb.rec.init_pid
        err_path = os.path.join(self.run_dir, f"reroot-{sb.id}.err")
        err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            child = os.posix_spawn(  # noqa: ASYNC221 - returns at once; the wait is on the loop
                binary, [binary, str(pid), new_root, *(["ro"] if self._args(sb).readonly_rootfs else [])],
                {}, file_actions=[(os.POSIX_SPAWN_DUP2, err, 2)])
        finally:
            os.close(err)
        status = await _wait_child(child, FREEZE_TIMEOUT_S, f"dsec-reroot {sb.id}")
        with open(err_path, errors="replace") as f:
            msg = f.read().strip()
        os.unlink(err_path)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SandboxError(f"sandbox {sb.id}: its root was not swapped: {msg or 'dsec-reroot failed'}")

    async def pause(self, sb: Sandbox) -> str:
        await self.freeze(sb)  # frozen first: nothing touches the memory pushed out next
        await failpoint("pause.frozen")
        await asyncio.to_thread(memory.page_out, self.cgroup_path(sb.id))
        await failpoint("pause.paged")
        return "frozen, memory pushed out to swap"

    async def resume(self, sb: Sandbox) -> tuple[str, InitLink | None]:
        # swap-in starts (asynchronously) before the processes run and fault it in one page at a time
        await asyncio.to_thread(memory.prefetch, self.cgroup_path(sb.id))
        await self.thaw(sb)
        await failpoint("resume.thawed")
        link = None
        if not self._state(sb).connected:  # paused across an edge restart: bound now that init answers
            link = await self._attach(sb)
        return "memory prefetch started, thawed", link

    async def released(self, restore: dict[str, str]) -> None:
        # each child's root is its own snapshot and its processes are restored: the image goes
        await asyncio.to_thread(self.drop_branch_image, restore["image"])

    async def kill(self, sb: Sandbox) -> None:
        cg = Cgroup(self.cgroup_path(sb.id))
        if not await asyncio.to_thread(cg.kill, KILL_TIMEOUT_S):
            raise SandboxError(f"processes left in its cgroup after {KILL_TIMEOUT_S:g} s of SIGKILL: "
                               f"{sorted(cg.procs())[:10]}")

    async def destroy(self, sb: Sandbox) -> None:
        cg = Cgroup(self.cgroup_path(sb.id))
        try:
            if sb.rec.init_pid:
                await wait_gone(sb.rec.init_pid)
            left = await asyncio.to_thread(cg.remove)
            if left:  # something outlived the kill: crun's own delete kills again and removes what it made
                await self.runtime.delete(sb.id)
                left = await asyncio.to_thread(cg.remove)
            else:
                self.runtime.forget(sb.id)
        finally:
            await failpoint("stop.deleted")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.sock_path(sb.id))
            shutil.rmtree(os.path.join(self.criu_dir, sb.id), ignore_errors=True)
        if left:
            raise SandboxError(f"cgroups not removed: {left}")

    async def known(self) -> set[str]:
        try:
            restored = set(os.listdir(self.criu_dir))
        except FileNotFoundError:
            restored = set()
        return set(await self.runtime.list()) | restored

    async def adopt(self, sb: Sandbox, known_to_runtime: bool) -> Adopted:
        """The kernel's freezer, not the record, says whether it is paused: an edge killed
        in the middle of a pause, resume or pack_diff left the record one step behind."""
        rec = sb.rec
        sb.state = ContainerState(self.volume.subvolume_id(sb.dir))
        if not known_to_runtime or not alive(rec.init_pid):
            raise SandboxError("its container is gone")
        cg = Cgroup(self.cgroup_path(sb.id))
        if rec.info.state == SandboxState.paused and rec.info.pause is not None:
            if cg.frozen():
                return Adopted(running=False)
            # killed mid-resume: thawed already, so it runs
        elif cg.frozen():  # killed mid-pause or mid-pack_diff: the record says running
            await self.thaw(sb)
        return Adopted(running=True, link=await self._attach(sb))

    async def reap_strays(self, known: set[str]) -> list[str]:
        strays = sorted(await self.known() - known)
        for sid in strays:  # a container no record owns (killed mid-create)
            cg = Cgroup(self.cgroup_path(sid))
            await asyncio.to_thread(cg.kill, KILL_TIMEOUT_S)
            await asyncio.to_thread(cg.remove, True)
            with contextlib.suppress(DsecError):
                await self.runtime.delete(sid)
            await asyncio.to_thread(cg.remove)
            shutil.rmtree(os.path.join(self.criu_dir, sid), ignore_errors=True)
        return strays

    def detach(self, sb: Sandbox) -> None:
        return None  # nothing held: its init's socket is reconnected by path

    # ---- questions ---------------------------------------------------------------------
    def host_pid(self, sb: Sandbox) -> int | None:
        return sb.rec.init_pid or None

    def writable_dir(self, sb: Sandbox) -> str | None:
        return os.path.join(sb.dir, "upper")

    def disk_path(self, sb: Sandbox) -> str:
        return os.path.join(sb.dir, "upper")

    def disk_quota(self, sb: Sandbox) -> int | None:
        return sb.state.qgroup if isinstance(sb.state, ContainerState) else None

    def snapshot_files(self, sb: Sandbox) -> dict[str, str] | None:
        return None  # its writes are checkpointed as layers (node/edge/checkpointing.py)

    def display(self, sb: Sandbox) -> None:
        return None

    def agent_lost(self, sb: Sandbox) -> str:
        return "sandbox init exited"

    def close(self, sandboxes_left: bool) -> None:
        if not sandboxes_left:
            self.runtime.remove_cgroup_parent()
