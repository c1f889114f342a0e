"""What the host side of the agent talks to: dsec-init (InitChannel) and a sandbox's files
(SandboxFiles), whatever the sandbox runs on (a container's /proc root, a VM's channel),
and what it knows of its sandbox (AgentContext). No implementation here: procs, sessions
and aether import these, not each other."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from dsec.node.agent.initclient import SETSID
from dsec.node.agent.watch import DirWatch
from dsec.shared.errors import InvalidRequest
from dsec.shared.wire.models import FileStat, Owner

OnData = Callable[[str, bytes], None]
PATH_MAX = 4096


def check_path(path: str, field: str = "path") -> str:
    """A path a caller named in a sandbox, refused if the kernel would read it as another
    one: a NUL byte ends a C string, so ``/tmp/a\\0.b`` would be ``/tmp/a`` to the syscall
    while the audit log recorded the whole string."""
    if "\x00" in path:
        raise InvalidRequest(f"{field}: a path may not contain a NUL byte", field=field)
    if len(path.encode(errors="surrogateescape")) >= PATH_MAX:
        raise InvalidRequest(f"{field}: longer than {PATH_MAX - 1} bytes", field=field)
    return path


@dataclass
class AgentContext:
    """What aether needs to know about its sandbox."""

    sandbox_id: str
    init_pid: int  # host pid of dsec-init
    env: dict[str, str]
    workdir: str
    shell: str = "/bin/sh"


class SandboxFiles(Protocol):
    """Files and TCP inside one sandbox, whatever it runs on."""

    async def exists(self, path: str) -> bool: ...
    async def mkdirs(self, path: str, owner: Owner | None = None) -> None: ...
    async def read_file(self, path: str, limit: int) -> bytes: ...
    async def write_file(self, path: str, data: bytes, mode: int = 0o644, owner: Owner | None = None) -> None: ...
    async def stat(self, path: str) -> FileStat: ...
    async def list_dir(self, path: str) -> list[FileStat]: ...
    async def remove(self, path: str, recursive: bool) -> None: ...
    async def move(self, source: str, destination: str) -> None: ...
    async def set_xattrs(self, path: str, prefix: str, values: dict[str, str]) -> None: ...
    def watch(self, path: str, recursive: bool) -> DirWatch: ...
    async def connect(self, port: int) -> socket.socket: ...


class InitChannel(Protocol):
    """dsec-init's interface, over its unix socket (containers) or a VM's channel."""

    closed: asyncio.Event

    async def spawn(self, argv: list[str], env: dict[str, str], cwd: str, fds: list[int],
                    flags: int = SETSID, user: tuple[int, int] | None = None) -> tuple[int, asyncio.Future[int]]: ...
    async def kill_tree(self, pid: int, sig: int, since_ticks: int = 0, include_self: bool = False) -> int: ...
    async def hold(self, key: str, fds: list[int]) -> None: ...
    async def retrieve(self, key: str) -> list[int] | None: ...
    async def drop(self, key: str) -> None: ...
    async def held_keys(self) -> list[str]: ...
    def channels(self, n: int) -> list[tuple[int, int]]: ...  # (read end, write end) pairs for a session
    async def adopt(self, pid: int) -> asyncio.Future[int] | None: ...
    async def resize(self, master: int, cols: int, rows: int) -> None: ...
    def close(self) -> None: ...
