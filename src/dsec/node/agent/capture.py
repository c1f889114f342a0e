"""A command's output pipe drained into a bounded buffer, handed on as it comes."""

from __future__ import annotations

import asyncio
import os

from dsec.node.agent.interfaces import OnData


class Capture:
    """Drains one pipe into a bounded buffer; past the bound it keeps draining (so the
    writer never blocks on a full pipe) but stores nothing."""

    def __init__(self, fd: int, name: str, limit: int, on_data: OnData | None) -> None:
        self.fd, self.name, self.limit, self.on_data = fd, name, limit, on_data
        self.buf = bytearray()
        self.truncated = False
        self.eof = asyncio.Event()
        self.active = True
        os.set_blocking(fd, False)
        asyncio.get_running_loop().add_reader(fd, self.drain)

    def reset(self, limit: int, on_data: OnData | None) -> None:
        self.buf = bytearray()
        self.truncated = False
        self.limit, self.on_data = limit, on_data

    def drain(self) -> None:
        # once closed, the fd number may already belong to something else (another
        # sandbox's pipe, a client's socket): reading it would steal its bytes or block
        while self.active:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:
                self.close()
                return
            room = self.limit - len(self.buf)
            if room > 0:
                self.buf += chunk[:room]
                if self.on_data is not None:
                    self.on_data(self.name, chunk[:room])
            if len(chunk) > room:
                self.truncated = True

    def close(self) -> None:
        if self.active:
            self.active = False
            asyncio.get_running_loop().remove_reader(self.fd)
            os.close(self.fd)
            self.eof.set()

    def text(self) -> str:
        return self.buf.decode("utf-8", errors="replace")
