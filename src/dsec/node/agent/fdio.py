"""Waiting on raw fds from the event loop, and writing to them without blocking it.

The watcher is removed synchronously when the wait ends: its fd is often closed right after,
and a watcher still registered for a closed number would be attached to whatever file gets
that number next.
"""

from __future__ import annotations

import asyncio
import os


class FdWait:
    """A wait for ``fd`` to be readable (or writable): await ``fut``, then ``close()``."""

    def __init__(self, fd: int, write: bool = False) -> None:
        loop = asyncio.get_running_loop()
        self.fd, self.write = fd, write
        self.fut: asyncio.Future[None] = loop.create_future()
        (loop.add_writer if write else loop.add_reader)(fd, self._fire)
        self.closed = False

    def _fire(self) -> None:
        if not self.fut.done():
            self.fut.set_result(None)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            loop = asyncio.get_running_loop()
            (loop.remove_writer if self.write else loop.remove_reader)(self.fd)
            self.fut.cancel()


async def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to the non-blocking ``fd``, waiting while it is full."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            w = FdWait(fd, write=True)
            try:
                await w.fut
            finally:
                w.close()
