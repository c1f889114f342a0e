"""A live sandbox as its edge holds it, the bounds of its teardown and re-adoption, and
the small process and mount helpers those use."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import sqlite3
import time
from collections import deque
from dataclasses import dataclass, field

from dsec.agent.aether import Aether
from dsec.backends.vm.runtime import VMInstance
from dsec.edge.state import Record
from dsec.errors import DsecError
from dsec.host import linux
from dsec.wire.models import (
    SandboxEvent,
    SandboxInfo,
)

# teardown: SIGKILL through the cgroup for at most this long, then every other step
# (agent, network, crun, unmounts) bounded on its own
KILL_TIMEOUT_S = 10.0
STEP_TIMEOUT_S = 10.0
# an edge restart re-adopts sandboxes concurrently, each within this bound
READOPT_TIMEOUT_S = 15.0
READOPT_CONCURRENCY = 32


@dataclass
class Sandbox:
    rec: Record
    dir: str
    agent: Aether | None = None
    stopping: bool = False
    watch: asyncio.Task[None] | None = None
    ops: int = 0
    dirty: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    events: deque[SandboxEvent] = field(default_factory=lambda: deque(maxlen=200))
    teardown: asyncio.Task[None] | None = None
    vm: VMInstance | None = None
    oom_seen: int = 0
    pids_seen: int = 0
    pids_reported: float = 0.0
    cpu_seen: tuple[float, float] = (0.0, 0.0)  # (when, throttled seconds) at the last look
    cpu_reported: float = 0.0
    qgroup: int | None = None  # its subvolume on the sandbox volume (disk quota)
    quota_full: bool = False
    disk: tuple[float, int] = (0.0, 0)  # (when measured, bytes): a tree walk, so cached
    creator: asyncio.Task[SandboxInfo] | None = None  # the create under way, which a stop cancels
    memory_held_mb: int = 0  # charged to its cgroup at the last look (admission counts it)
    memfail_seen: int = 0
    limits_at: float = 0.0  # (monotonic) when its limit events were last read
    memfail_reported: float = 0.0
    keep_checkpoints: bool = False  # its end here is not its end: it moved, or its restore here failed
    from_vm: dict[str, str] | None = None  # a VM restored from a checkpoint: its state, meta and disk files

    @property
    def id(self) -> str:
        return self.rec.info.sandbox_id



def explain(e: BaseException) -> str:
    if isinstance(e, asyncio.CancelledError):
        return "cancelled"
    return (e.message if isinstance(e, DsecError) else str(e)) or type(e).__name__


def unmount_all(root: str) -> None:
    for mp in linux.mounted_under(root):
        try:
            linux.umount(mp)
        except OSError:
            linux.umount(mp, detach=True)


def alive(pid: int) -> bool:
    """Running, not a zombie: a killed init waits for whoever reaps it (the host's init,
    which may take its time), but holds nothing of the sandbox any more."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def out_of_space(e: BaseException) -> bool:
    """ENOSPC or EDQUOT from the node's own disk, or SQLite saying the same."""
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(e, sqlite3.OperationalError) and "disk is full" in str(e)


async def wait_gone(pid: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < deadline:
        await asyncio.sleep(0.002)
    # the edge is the child subreaper of the inits it started: reap this one (only this
    # one: a wait for any child would take asyncio's subprocesses' statuses)
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)  # noqa: ASYNC222 - WNOHANG never blocks


def mem_total_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 1024
