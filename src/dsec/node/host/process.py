"""Host processes a node starts and ends (a sandbox's init, QEMU): whether one still runs,
and waiting for one to be gone and reaped."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time


def alive(pid: int) -> bool:
    """Running, not a zombie: a killed init waits for whoever reaps it (the host's init,
    which may take its time), but holds nothing of the sandbox any more."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


async def wait_gone(pid: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < deadline:
        await asyncio.sleep(0.002)
    # the edge is the child subreaper of the inits it started: reap this one (only this
    # one: a wait for any child would take asyncio's subprocesses' statuses)
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)  # noqa: ASYNC222 - WNOHANG never blocks
