"""An interactive shell on a new pty inside the sandbox, and its window size."""

from __future__ import annotations

import asyncio
import fcntl
import os
import struct
import termios

from dsec.node.agent.initclient import CTTY, SETSID
from dsec.node.agent.interfaces import AgentContext, InitChannel


async def open_tty(init: InitChannel, ctx: AgentContext, cols: int, rows: int, argv: list[str] | None = None
                   ) -> tuple[int, int, asyncio.Future[int]]:
    """Start it; returns (master fd, pid, exit future)."""
    master, slave = os.openpty()
    os.set_inheritable(master, False)
    set_winsize(master, cols, rows)
    env = {**ctx.env, "TERM": "xterm-256color"}
    try:
        pid, exited = await init.spawn(argv or [ctx.shell, "-i"], env, ctx.workdir, [slave, slave, slave],
                                       SETSID | CTTY)
    except BaseException:
        os.close(master)
        raise
    finally:
        os.close(slave)
    return master, pid, exited


async def resize_tty(init: InitChannel, master: int, cols: int, rows: int) -> None:
    set_winsize(master, cols, rows)
    await init.resize(master, cols, rows)  # a VM's pty is in the guest: it is told too


def set_winsize(fd: int, cols: int, rows: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
