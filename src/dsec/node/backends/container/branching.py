"""Live branches of a running container through CRIU: the container backend's half of
``branch_image`` and of starting a child from one (docs/snapshots.md, "Live branch of a container: CRIU").

Owns finding the criu binary, the dump of a container's process tree (dsec-init, PID 1 of
its pid namespace, and everything under it) with ``--leave-running``, what of that tree is
the host's and so is passed to CRIU as external, the restore of a child into its own
namespaces, cgroup and root, and CRIU's refusals as :class:`BranchUnsupported` in CRIU's
own words.

What of a container belongs to the host, and how a child gets its own:

- its network namespace (made by the edge, ``linux.new_netns``): external at the dump; the
  child is restored into a fresh one (``--inherit-fd``), which the edge wires as any other;
- dsec-init's binary (run from an fd of a host file: its executable and its text mappings)
  and the workload cgroup's ``cgroup.procs`` files it holds (host cgroupfs): external files,
  handed to the child as the same binary and the child's own ``S/w/cgroup.procs``;
- the masked paths of /proc and /sys (bind mounts of the host's /dev/null): external mounts;
- init's listening socket (bound at a host path) and its connections to the edge (the
  SOCK_SEQPACKET ones): the child's own listener at its own path, and for each connection
  a socket whose peer is already closed, so the restored init drops it and the edge
  connects afresh.

Everything else (memory, threads, pids, the mount tree over the overlay root, /dev's tmpfs,
pipes and sockets among its processes, its cgroups' limits) CRIU carries itself. That
includes shell sessions: a session's channels are made in the sandbox's network namespace
(InitClient.channels) and both ends of each are the sandbox's (the shell's, and the copy
dsec-init holds for the edge), so CRIU restores each pair as it is, queued bytes included,
and the child's edge takes the session back from its init as after an edge restart. A
process holding any other channel to the host (a command's output channel while it runs)
has a socket CRIU cannot find in the sandbox's namespace: the dump fails and says which.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from dsec.node.host import linux
from dsec.shared.errors import BranchUnsupported, SandboxError

CRIU_PREFIX = "/usr/local/lib/dsec/criu"  # where scripts/criu.sh builds it
KIND = "container-criu"  # the restore dict of a container's branch image
DUMP_TIMEOUT_S = 60.0
RESTORE_TIMEOUT_S = 60.0
NET_KEY = "extnet"
# CRIU says this on every run here (root without CAP_SYS_RESOURCE cannot raise the hard
# RLIMIT_NOFILE); it is not why anything failed
_NOISE = ("Can't setup RLIMIT_NOFILE",)


def criu_binary() -> str:
    """The criu that scripts/criu.sh built (or ``DSEC_CRIU``); BranchUnsupported if none."""
    path = os.environ.get("DSEC_CRIU") or os.path.join(CRIU_PREFIX, "sbin", "criu")
    if not os.access(path, os.X_OK):
        raise BranchUnsupported(f"CRIU is not installed at {path} (scripts/setup.sh builds it): a live branch "
                                "of a container needs it")
    return path


@dataclass
class Image:
    """What a dump left beside CRIU's images: enough to restore a child from them."""

    cgroup: str  # the parent's cgroup path (``/dsec/ID``): its files map onto the child's
    files: dict[str, str] = field(default_factory=dict)  # CRIU external file id -> host path
    mounts: dict[str, str] = field(default_factory=dict)  # external mount key -> host path bound there
    listener: str = ""  # init's listening socket, ``socket:[ino]``
    conns: list[str] = field(default_factory=list)  # init's connections to the edge, ``socket:[ino]``
    dump_ms: float = 0.0

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f)

    @classmethod
    def load(cls, path: str) -> Image:
        with open(path) as f:
            return cls(**json.load(f))


def _mnt_id(fdinfo: str) -> int | None:
    m = re.search(r"^mnt_id:\s*(\d+)", fdinfo, re.M)
    return int(m.group(1)) if m else None


def externals(pid: int, cgroup: str) -> tuple[Image, list[str]]:
    """What of init's process is the host's, read from /proc (the sandbox frozen): the
    image's record of it and CRIU's ``--external`` arguments."""
    img, args = Image(cgroup=cgroup), []
    with open(f"/proc/{pid}/mountinfo") as f:
        mountinfo = [line.split() for line in f]
    mounts = {int(m[0]) for m in mountinfo}
    for m in mountinfo:
        fstype = m[m.index("-") + 1]
        if fstype == "devtmpfs":  # a host device node bound over a masked path
            key = f"m{m[0]}"
            img.mounts[key] = "/dev" + m[3]
            args.append(f"mnt[{m[4]}]:{key}")

    def external_file(link: str, fdinfo_path: str, st: os.stat_result) -> None:
        with open(fdinfo_path) as f:
            mnt = _mnt_id(f.read())
        if mnt is not None and mnt not in mounts:  # on a mount the sandbox does not have
            key = f"file[{mnt:x}:{st.st_ino:x}]"
            img.files[key] = link
            args.append(key)

    # init's executable (its text mappings are the same file): a host file run through an fd
    exe = os.open(f"/proc/{pid}/exe", os.O_PATH | os.O_CLOEXEC)
    try:
        external_file(os.readlink(f"/proc/{pid}/exe"), f"/proc/self/fdinfo/{exe}", os.fstat(exe))
    finally:
        os.close(exe)
    types = _unix_types(pid)
    for name in os.listdir(f"/proc/{pid}/fd"):
        path = f"/proc/{pid}/fd/{name}"
        try:
            link = os.readlink(path)
            if link.startswith("socket:["):
                if name == "4":  # (crun --preserve-fds: the listener is init's fd 4)
                    img.listener = link
                elif types.get(int(link[8:-1])) == socket.SOCK_SEQPACKET:  # its connections to the edge
                    img.conns.append(link)
                    args.append(f"unix[{link[8:-1]}]")
                # else a session's channel it holds for the edge: its peer is the shell's, in the
                # tree, so CRIU carries the pair (one of the host's namespace: not found, refused)
            elif link.startswith("/"):
                external_file(link, f"/proc/{pid}/fdinfo/{name}", os.stat(path))
        except FileNotFoundError:
            continue  # closed as it was read
    args.append(f"net[{os.stat(f'/proc/{pid}/ns/net').st_ino}]:{NET_KEY}")
    return img, args


def _unix_types(pid: int) -> dict[int, int]:
    """The socket type of each unix socket of ``pid``'s network namespace, by inode."""
    types = {}
    with open(f"/proc/{pid}/net/unix") as f:
        next(f)  # Num RefCount Protocol Flags Type St Inode Path
        for line in f:
            cols = line.split()
            if len(cols) >= 7:
                types[int(cols[6])] = int(cols[4], 16)
    return types


def _criu_errors(log_path: str, limit: int = 4) -> str:
    """CRIU's own error lines from its log, the noise left out."""
    try:
        with open(log_path, errors="replace") as f:
            lines = [ln.strip() for ln in f if "Error (" in ln and not any(n in ln for n in _NOISE)]
    except OSError:
        return "no log"
    # "(00.033) Error (criu/files-reg.c:1790): Can't lookup ..." -> "Can't lookup ..."
    msgs = [re.sub(r"^(\(\s*[\d.]+\)\s*)?(\d+:\s*)?Error \([^)]*\):\s*", "", ln) for ln in lines]
    # the specific lines, not the summaries after them ("Dump files (pid: 9) failed with -1")
    msgs = [m for m in msgs if not re.search(r"failed with -?\d+$|^Dumping FAILED|^Restoring FAILED", m)] or msgs
    return "; ".join(list(dict.fromkeys(m for m in msgs if m))[:limit]) or "no error logged"


def _explain(errors: str, pid: int) -> str:
    """What a CRIU refusal means for a sandbox, before CRIU's words."""
    m = re.search(r"Unix socket (\d+) not found", errors)
    if m:
        holder = _holder_of(int(m.group(1)), pid)
        return (f"{holder} holds a unix socket of the host (the output channel of a one-shot command, running "
                "or left in the background holding it): end it first")
    if re.search(r"Can't get 1:(16|34) opt", errors):  # SO_PASSCRED, SO_PASSSEC
        return ("a process holds an inet (TCP or UDP) socket, which CRIU cannot dump on this kernel (it cannot "
                "read the socket's SO_PASSCRED option): close it first")
    if "TCP" in errors:
        return "a process holds an established TCP connection (not carried into a child)"
    return "CRIU cannot checkpoint the sandbox's processes as they are"


def _holder_of(ino: int, init_pid: int) -> str:
    """Which process of the sandbox holds socket ``ino`` (for the error)."""
    want = f"socket:[{ino}]"
    pids = [init_pid]
    with contextlib.suppress(OSError), open(f"/proc/{init_pid}/task/{init_pid}/children") as f:
        pids += [int(p) for p in f.read().split()]
    for p in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{p}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{p}/fd/{fd}") == want:
                        with open(f"/proc/{p}/comm") as f:
                            comm = f.read().strip()
                        return "dsec-init" if p == init_pid else f"process {p} ({comm})"
    return "a process"


async def _run(argv: list[str], pass_fds: tuple[int, ...], timeout: float, what: str) -> int:
    proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.DEVNULL,
                                                stderr=asyncio.subprocess.DEVNULL, pass_fds=pass_fds)
    try:
        async with asyncio.timeout(timeout):
            return await proc.wait()
    except BaseException as e:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if isinstance(e, TimeoutError):
            raise SandboxError(f"{what} did not finish within {timeout:g} s") from None
        raise


async def dump(pid: int, cgroup: str, freezer: str, images: str) -> Image:
    """CRIU dump of the tree under ``pid`` into ``images``, left running (the sandbox is
    frozen by the caller; ``freezer``: its freezer cgroup, which CRIU finds frozen and
    leaves so). BranchUnsupported with CRIU's reason if it refuses."""
    criu = criu_binary()
    img, ext = await asyncio.to_thread(externals, pid, cgroup)
    log = os.path.join(images, "dump.log")
    argv = [criu, "dump", "--no-default-config", "-t", str(pid), "-D", images, "-o", log, "--leave-running",
            "--freeze-cgroup", freezer, "--network-lock", "skip", "--manage-cgroups",
            *(f"--external={e}" for e in ext)]
    t0 = time.monotonic()
    rc = await _run(argv, (), DUMP_TIMEOUT_S, "criu dump")
    img.dump_ms = (time.monotonic() - t0) * 1000
    if rc != 0:
        errors = _criu_errors(log)
        raise BranchUnsupported(f"{_explain(errors, pid)}; CRIU: {errors}")
    img.save(os.path.join(images, "dsec.json"))
    return img


@dataclass
class Restored:
    pid: int
    restore_ms: float


async def restore(images: str, rootfs: str, cgroup: str, sock_path: str, workdir: str, hostname: str,
                  listener: Callable[[str], socket.socket]) -> Restored:
    """A child from ``images``: its processes restored by CRIU over ``rootfs`` (mounted),
    in a new network namespace with a new listener of init's at ``sock_path``, in the
    cgroup ``cgroup`` (made here, with the parent's limits; the caller sets the child's),
    with ``hostname``. ``workdir`` (made here) takes CRIU's log and pid file."""
    criu = criu_binary()
    img = await asyncio.to_thread(Image.load, os.path.join(images, "dsec.json"))
    os.makedirs(workdir, exist_ok=True)

    def sockets() -> tuple[socket.socket, list[socket.socket]]:
        # made in the child's namespace: its init's channel is then its own, and a child
        # can be branched in turn
        pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in img.conns]
        for _, peer in pairs:
            peer.close()  # the restored init reads EOF on it and drops the parent's connection
        return listener(sock_path), [a for a, _ in pairs]

    netns, (lsock, conns) = await asyncio.to_thread(linux.new_netns, sockets)
    fds: list[int] = []
    opened: list[int] = []
    args: list[str] = []

    def inherit(fd: int, key: str) -> None:
        fds.append(fd)
        args.append(f"--inherit-fd=fd[{fd}]:{key}")

    try:
        inherit(netns, NET_KEY)
        inherit(lsock.fileno(), img.listener)
        for s, key in zip(conns, img.conns, strict=True):
            inherit(s.fileno(), key)
        parent_rel, child_rel = img.cgroup.strip("/"), cgroup.strip("/")
        for key, path in img.files.items():
            if f"/{parent_rel}/" in path:  # the parent's cgroup.procs: the child's own
                path = path.replace(f"/{parent_rel}/", f"/{child_rel}/", 1)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                opened.append(os.open(path, os.O_WRONLY | os.O_CLOEXEC))
            else:  # init's binary, /dev/null: the same host file
                opened.append(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
            inherit(opened[-1], key)
        for key, path in img.mounts.items():
            args.append(f"--ext-mount-map={key}:{path}")
        pidfile, log = os.path.join(workdir, "init.pid"), os.path.join(workdir, "restore.log")
        argv = [criu, "restore", "--no-default-config", "-D", images, "-W", workdir, "-o", log,
                "--root", rootfs, "--restore-detached", "--pidfile", pidfile, "--network-lock", "skip",
                "--cgroup-root", cgroup, "--manage-cgroups=full", *args]
        t0 = time.monotonic()
        rc = await _run(argv, tuple(fds), RESTORE_TIMEOUT_S, "criu restore")
        ms = (time.monotonic() - t0) * 1000
        if rc != 0:
            raise SandboxError(f"criu restore failed: {_criu_errors(log)}")
        with open(pidfile) as f:
            pid = int(f.read().strip())
    finally:
        lsock.close()
        for s in conns:
            s.close()
        for fd in (*opened, netns):
            os.close(fd)
    # its own name: CRIU brought back the parent's
    await asyncio.to_thread(linux.in_ns, f"/proc/{pid}/ns/uts", linux.CLONE_NEWUTS,
                            lambda: socket.sethostname(hostname))
    return Restored(pid, ms)


def drop(work: str) -> None:
    """A branch image's files gone (its root subvolume is the caller's to remove first)."""
    shutil.rmtree(work, ignore_errors=True)
