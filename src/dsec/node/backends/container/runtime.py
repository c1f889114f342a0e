"""The OCI runtime under the container backend: crun, driven through its CLI.

Owns the OCI config (namespaces, cgroup limits, capabilities, seccomp, masked paths)
and the crun lifecycle (run, kill, delete, state). dsec-init is executed through
``/proc/self/fd/3`` with crun's ``--preserve-fds``, and its listening socket arrives
as fd 4, so nothing of the agent exists inside the container's filesystem.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import shutil
import signal
from dataclasses import dataclass

from dsec.node.host.cgroup import MEMORY_RESERVE_MB, PIDS_RESERVE
from dsec.shared.errors import DeadlineExceeded, SandboxError

# every crun call has a deadline: crun talks to the kernel only, so a miss means the
# kernel is stuck on this sandbox (say, a freezer that cannot settle); the caller moves on
CRUN_TIMEOUT_S = 30.0

CAPS = [
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_SETGID", "CAP_SETUID",
    "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
]
MASKED_PATHS = [
    "/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats", "/proc/timer_list",
    "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi", "/proc/kpagecgroup", "/proc/kpageflags",
    "/proc/kpagecount", "/proc/sysrq-trigger", "/proc/kmsg", "/proc/kallsyms", "/proc/vmallocinfo",
    "/sys/firmware", "/sys/devices/virtual/powercap", "/sys/kernel/debug", "/sys/kernel/tracing",
    "/proc/iomem", "/proc/ioports", "/proc/slabinfo", "/proc/pagetypeinfo", "/proc/modules", "/proc/config.gz",
    "/proc/key-users", "/proc/mtrr", "/sys/kernel/mm/page_idle", "/sys/kernel/security", "/sys/fs/bpf",
    "/sys/kernel/vmcoreinfo",
]
READONLY_PATHS = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys"]
# Denied outright (EPERM): kernel-wide state, module and kexec loading, tracing and
# BPF, keyrings, new mounts, raw handles. Allowed-by-default keeps ordinary workloads
# (compilers, package managers, test runners) working.
DENIED_SYSCALLS = [
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "create_module",
    "bpf", "perf_event_open", "keyctl", "add_key", "request_key", "userfaultfd", "mount", "umount2",
    "pivot_root", "swapon", "swapoff", "reboot", "open_by_handle_at", "name_to_handle_at", "acct",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "iopl", "ioperm", "quotactl", "syslog",
    "vhangup", "lookup_dcookie", "unshare", "setns", "fsopen", "fsmount", "fsconfig", "move_mount",
    "open_tree", "mount_setattr", "process_vm_readv", "process_vm_writev", "ptrace", "personality",
    "fanotify_init", "nfsservctl", "get_kernel_syms", "query_module", "uselib", "kcmp", "pidfd_getfd",
    # io_uring runs file and socket operations the filter never sees
    "io_uring_setup", "io_uring_enter", "io_uring_register", "quotactl_fd", "move_pages", "migrate_pages",
]
# ioctls that move or share extents between files (XFS_IOC_SWAPEXT read protected files and
# corrupted a filesystem in production): every XFS-private ioctl (type 'X'), ext4's
# EXT4_IOC_MOVE_EXT; reflink and dedupe answer "not supported", so cp falls back to copying
IOCTL_TYPE_X = 0x5800
EXT4_IOC_MOVE_EXT = 0xC028660F
FICLONE, FICLONERANGE, FIDEDUPERANGE = 0x40049409, 0x4020940D, 0xC0189436
EPERM, EOPNOTSUPP, ENOSYS = 1, 95, 38
CLONE_NEWUSER = 0x10000000


def _cmd_is(cmd: int) -> dict[str, object]:
    # the kernel reads an ioctl's command as 32 bits: compare only those, or a caller could
    # set high bits to slip past an exact match
    return {"index": 1, "value": 0xFFFFFFFF, "valueTwo": cmd, "op": "SCMP_CMP_MASKED_EQ"}


def seccomp_profile() -> dict[str, object]:
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
        "syscalls": [
            {"names": DENIED_SYSCALLS, "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM},
            {"names": ["ioctl"], "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM,
             "args": [{"index": 1, "value": 0xFF00, "valueTwo": IOCTL_TYPE_X, "op": "SCMP_CMP_MASKED_EQ"}]},
            {"names": ["ioctl"], "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM,
             "args": [_cmd_is(EXT4_IOC_MOVE_EXT)]},
            *({"names": ["ioctl"], "action": "SCMP_ACT_ERRNO", "errnoRet": EOPNOTSUPP,
               "args": [_cmd_is(cmd)]} for cmd in (FICLONE, FICLONERANGE, FIDEDUPERANGE)),
            # new user namespaces would hand the workload a full capability set
            {"names": ["clone"], "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM,
             "args": [{"index": 0, "value": CLONE_NEWUSER, "valueTwo": CLONE_NEWUSER,
                       "op": "SCMP_CMP_MASKED_EQ"}]},
            # clone3 passes flags in memory seccomp cannot read; glibc falls back to clone
            {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS},
        ],
    }


@dataclass(frozen=True)
class Limits:
    memory_mb: int
    cpu_cores: float
    pids: int
    cpu_shares: int = 1024  # best-effort sandboxes get the minimum: CPU only when others leave it idle


def oci_config(sandbox_id: str, rootfs: str, limits: Limits, cgroup_path: str,
               tmpfs: dict[str, int] | None = None, readonly: bool = False,
               netns: str | None = None) -> dict[str, object]:
    """``tmpfs``: extra size-bounded tmpfs mounts (path -> MiB), charged to the sandbox's memory.
    ``readonly``: the root filesystem read-only inside the sandbox. ``netns``: the network
    namespace it joins (made by the caller), instead of a new one of crun's.

    The limits here are the sandbox cgroup's, which holds dsec-init: the workload's own plus
    a reserve, and no CPU quota. The workload's exact limits go on its child cgroup
    (:meth:`dsec.node.host.cgroup.Cgroup.split_workload`), so it can never starve init."""
    outer_mb = limits.memory_mb + MEMORY_RESERVE_MB
    extra = [{"destination": path, "type": "tmpfs", "source": "tmpfs",
              "options": ["nosuid", "nodev", "mode=1777", f"size={mb}m"]} for path, mb in sorted((tmpfs or {}).items())]
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": ["/proc/self/fd/3"],
            "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
            "cwd": "/",
            "capabilities": {k: CAPS for k in ("bounding", "effective", "permitted")},
            "noNewPrivileges": True,
        },
        "root": {"path": rootfs, "readonly": readonly},
        "hostname": sandbox_id,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
            {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
             "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs",
             "options": ["nosuid", "noexec", "nodev", "ro"]},
            *extra,
        ],
        "linux": {
            "cgroupsPath": cgroup_path,
            "resources": {
                # memory+swap capped at the same limit: the node's swap (there for paused
                # sandboxes) must not stretch a running sandbox's memory past what it asked for
                "memory": {"limit": outer_mb << 20, "swap": outer_mb << 20},
                "cpu": {"shares": 1024},
                "pids": {"limit": limits.pids + PIDS_RESERVE},
            },
            "namespaces": [{"type": t, **({"path": netns} if t == "network" and netns else {})}
                           for t in ("pid", "network", "ipc", "uts", "mount", "cgroup")],
            "maskedPaths": MASKED_PATHS,
            "readonlyPaths": READONLY_PATHS,
            "seccomp": seccomp_profile(),
        },
    }


class CrunRuntime:
    """Runs containers with crun under a private state root."""

    def __init__(self, state_root: str, cgroup_parent: str = "dsec") -> None:
        self.state_root = state_root
        self.cgroup_parent = cgroup_parent
        os.makedirs(state_root, exist_ok=True)
        crun = shutil.which("crun")
        if crun is None:
            raise RuntimeError("crun is not installed (run scripts/setup.sh)")
        self.crun = crun

    def cgroup_path(self, sandbox_id: str) -> str:
        return f"/{self.cgroup_parent}/{sandbox_id}"

    def remove_cgroup_parent(self) -> None:
        """Remove this runtime's (empty) parent cgroup in every hierarchy."""
        import glob

        for d in glob.glob(f"/sys/fs/cgroup/{self.cgroup_parent}") + glob.glob(
                f"/sys/fs/cgroup/*/{self.cgroup_parent}"):
            try:
                os.rmdir(d)
            except OSError:
                pass  # still holds a sandbox, or already gone

    def _argv(self, *args: str) -> list[str]:
        return [self.crun, "--root", self.state_root, *args]

    async def _run(self, *args: str, check: bool = True, timeout: float = CRUN_TIMEOUT_S) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(
            *self._argv(*args), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        try:
            async with asyncio.timeout(timeout):
                out, _ = await proc.communicate()
        except BaseException as e:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            if isinstance(e, TimeoutError):
                raise DeadlineExceeded(f"crun {' '.join(args)} did not finish within {timeout:g} s") from None
            raise
        text = out.decode(errors="replace").strip()
        if check and proc.returncode != 0:
            raise SandboxError(f"crun {args[0]} failed: {text}")
        return proc.returncode or 0, text

    async def run(self, sandbox_id: str, bundle: str, init_fd: int, sock_fd: int) -> int:
        """Start the container detached; returns dsec-init's host pid."""
        err_path = os.path.join(bundle, "crun.err")
        pid_path = os.path.join(bundle, "init.pid")
        # every source fd above the targets: were the listening socket fd 3 and the binary
        # fd 4, the dup of the binary onto 3 would replace the socket before its own dup onto
        # 4, and init would start with no listener (its socket refusing every connect)
        opened = [os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC),
                  os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)]
        null, err, init_src, sock_src = high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
                                                for fd in (*opened, init_fd, sock_fd)]
        for fd in opened:
            os.close(fd)
        try:
            pid = os.posix_spawn(  # noqa: ASYNC221 - posix_spawn returns at once; the wait is off-loop
                self.crun, self._argv("run", "-d", "--preserve-fds", "2", "--pid-file", pid_path,
                                       "--bundle", bundle, sandbox_id),
                dict(os.environ),
                file_actions=[(os.POSIX_SPAWN_DUP2, null, 0), (os.POSIX_SPAWN_DUP2, null, 1),
                              (os.POSIX_SPAWN_DUP2, err, 2), (os.POSIX_SPAWN_DUP2, init_src, 3),
                              (os.POSIX_SPAWN_DUP2, sock_src, 4)])
        finally:
            for fd in high:
                os.close(fd)
        status = await _wait_child(pid, CRUN_TIMEOUT_S, f"crun run {sandbox_id}")
        if os.waitstatus_to_exitcode(status) != 0:
            with open(err_path, errors="replace") as f:
                msg = f.read().strip()
            raise SandboxError(f"crun run failed for {sandbox_id}: {msg}")
        try:
            with open(pid_path) as f:
                pid = int(f.read().strip())
        except (OSError, ValueError) as e:
            raise SandboxError(f"container {sandbox_id} did not start: {e}") from None
        # init is out of the OOM killer's reach where the host may say so (CAP_SYS_RESOURCE;
        # some hosts withhold it). Either way the workload's OOM kills happen in its own child
        # cgroup, where init is not, and every child init spawns takes score 500.
        with contextlib.suppress(OSError), open(f"/proc/{pid}/oom_score_adj", "w") as f:
            f.write("-1000")
        return pid

    async def state(self, sandbox_id: str) -> dict[str, object] | None:
        rc, out = await self._run("state", sandbox_id, check=False)
        if rc != 0:
            return None
        try:
            return json.loads(out)  # type: ignore[no-any-return]
        except json.JSONDecodeError:
            return None

    async def list(self) -> list[str]:
        rc, out = await self._run("list", "-q", check=False)
        return out.split() if rc == 0 else []

    async def kill(self, sandbox_id: str, sig: str = "KILL") -> None:
        await self._run("kill", sandbox_id, sig, check=False)

    async def delete(self, sandbox_id: str) -> None:
        await self._run("delete", "--force", sandbox_id, check=False)

    def forget(self, sandbox_id: str) -> None:
        """Drop the record of a container whose processes are all gone and whose cgroups are
        removed: all that ``crun delete`` has left to do then, without its fork and exec
        (4 ms of a 13 ms stop). Its state is one directory under the state root."""
        shutil.rmtree(os.path.join(self.state_root, sandbox_id), ignore_errors=True)


async def _wait_child(pid: int, timeout: float, what: str) -> int:
    """Wait for a child without a thread per wait: its pidfd turns readable on the loop the
    moment it exits (a waitpid poll with a backoff noticed a crun that took 17 ms at 31).
    Killed (and reaped) if it runs past ``timeout`` or the waiter is cancelled."""
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not exited.done():
            exited.set_result(None)

    pidfd = os.pidfd_open(pid)
    loop.add_reader(pidfd, readable)
    try:
        async with asyncio.timeout(timeout):
            await exited
        done, status = os.waitpid(pid, os.WNOHANG)  # noqa: ASYNC222 - exited: never blocks
        if not done:  # (a pidfd is readable only once the process is a zombie)
            raise SandboxError(f"{what}: its pidfd said it exited, waitpid did not")
        return status
    except BaseException as e:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)  # noqa: ASYNC222 - SIGKILLed: reaped at once
        except (ChildProcessError, ProcessLookupError):
            pass
        if isinstance(e, TimeoutError):
            raise DeadlineExceeded(f"{what} did not finish within {timeout:g} s") from None
        raise
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
