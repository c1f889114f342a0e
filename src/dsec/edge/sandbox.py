"""A live sandbox as its edge holds it, and the bounds of its teardown and re-adoption
(the process and mount helpers those use are in :mod:`dsec.host`)."""

from __future__ import annotations

import asyncio
import errno
import sqlite3
from collections import deque
from dataclasses import dataclass, field

from dsec.agent.aether import Aether
from dsec.backends.vm.runtime import VMInstance
from dsec.edge.state import Record
from dsec.errors import DsecError
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




def out_of_space(e: BaseException) -> bool:
    """ENOSPC or EDQUOT from the node's own disk, or SQLite saying the same."""
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(e, sqlite3.OperationalError) and "disk is full" in str(e)



def mem_total_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 1024
