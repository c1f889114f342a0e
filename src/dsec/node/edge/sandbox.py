"""The bounds of a sandbox's teardown and re-adoption on its edge, and how a failure is
said. The sandbox itself (:class:`~dsec.node.backends.api.Sandbox`) is the backend boundary's,
re-exported here for the edge's modules."""

from __future__ import annotations

import asyncio
import errno
import sqlite3

from dsec.node.backends.api import Sandbox
from dsec.shared.errors import DsecError

__all__ = ["KILL_TIMEOUT_S", "READOPT_CONCURRENCY", "READOPT_TIMEOUT_S", "STEP_TIMEOUT_S", "Sandbox", "explain",
           "mem_total_mb", "out_of_space"]

# teardown: SIGKILL through the cgroup for at most this long, then every other step
# (agent, network, crun, unmounts) bounded on its own
KILL_TIMEOUT_S = 10.0
STEP_TIMEOUT_S = 10.0
# an edge restart re-adopts sandboxes concurrently, each within this bound
READOPT_TIMEOUT_S = 15.0
READOPT_CONCURRENCY = 32


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
