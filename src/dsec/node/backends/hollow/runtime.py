"""A runtime that starts no process and mounts nothing, after Kubernetes' kubemark hollow
nodes: a hollow edge (``EdgeConfig.hollow``) runs the real edge (admission, records,
stats, the watcher's signals, sweepers, the command log, the wire) over it, so that 160
edges fit on one machine and the control plane can be measured at DSec's scale
(bench/scale.py). It is never a backend a user can choose: an edge is hollow as a whole,
from its own command line (its ``edge hollow`` command), and says so in its stats.

A hollow sandbox's "init" answers every spawn with a process that has already exited 0
and wrote nothing (so a one-shot exec answers exit 0, empty output); its files are a
dict in memory. Implements :class:`dsec.node.backends.api.SandboxRuntime`; its state of a
sandbox is a :class:`HollowState`."""

from __future__ import annotations

import asyncio
import itertools
import posixpath
import socket
import time
from dataclasses import dataclass

from dsec.node.agent.initclient import SETSID, channel
from dsec.node.agent.watch import DirWatch
from dsec.node.backends.api import Adopted, BackendState, InitLink, Launched, Sandbox, SandboxLost
from dsec.shared.errors import BranchUnsupported, InvalidRequest, NotFound
from dsec.shared.wire.models import FileStat, Owner

_PIDS = itertools.count(1000)


class HollowInit:
    """dsec-init's interface, answered with processes that have already exited 0."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()
        self._held: dict[str, list[int]] = {}

    async def spawn(self, argv: list[str], env: dict[str, str], cwd: str, fds: list[int],
                    flags: int = SETSID, user: tuple[int, int] | None = None) -> tuple[int, asyncio.Future[int]]:
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        done.set_result(0)
        return next(_PIDS), done

    async def kill_tree(self, pid: int, sig: int, since_ticks: int = 0, include_self: bool = False) -> int:
        return 0

    async def hold(self, key: str, fds: list[int]) -> None:
        self._held[key] = fds

    async def retrieve(self, key: str) -> list[int] | None:
        return self._held.get(key)

    async def drop(self, key: str) -> None:
        self._held.pop(key, None)

    async def held_keys(self) -> list[str]:
        return list(self._held)

    def channels(self, n: int) -> list[tuple[int, int]]:
        return [channel() for _ in range(n)]

    async def adopt(self, pid: int) -> asyncio.Future[int] | None:
        return None

    async def resize(self, master: int, cols: int, rows: int) -> None:
        return None

    def close(self) -> None:
        self.closed.set()


class MemoryFiles:
    """A sandbox's files as a dict in memory: enough for the agent's own checks and for
    callers that write and read back a file."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.dirs: set[str] = {"/", "/tmp", "/root"}

    @staticmethod
    def _norm(path: str) -> str:
        return posixpath.normpath("/" + path)

    def _stat(self, path: str) -> FileStat:
        p = self._norm(path)
        if p in self.dirs:
            return FileStat(name=posixpath.basename(p) or "/", path=p, type="dir", size=0, mode=0o755,
                            mtime=time.time())
        if p in self.files:
            return FileStat(name=posixpath.basename(p), path=p, type="file", size=len(self.files[p]), mode=0o644,
                            mtime=time.time())
        raise NotFound(f"no such file or directory: {path}", field="path")

    async def exists(self, path: str) -> bool:
        p = self._norm(path)
        return p in self.dirs or p in self.files

    async def mkdirs(self, path: str, owner: Owner | None = None) -> None:
        p = self._norm(path)
        while p not in self.dirs:
            self.dirs.add(p)
            p = posixpath.dirname(p)

    async def read_file(self, path: str, limit: int) -> bytes:
        p = self._norm(path)
        if p not in self.files:
            raise NotFound(f"no such file: {path}", field="path")
        return self.files[p][:limit]

    async def write_file(self, path: str, data: bytes, mode: int = 0o644, owner: Owner | None = None) -> None:
        p = self._norm(path)
        await self.mkdirs(posixpath.dirname(p))
        self.files[p] = bytes(data)

    async def stat(self, path: str) -> FileStat:
        return self._stat(path)

    async def list_dir(self, path: str) -> list[FileStat]:
        p = self._norm(path)
        if p not in self.dirs:
            raise NotFound(f"no such directory: {path}", field="path")
        return [self._stat(q) for q in sorted({*self.dirs, *self.files}) if q != p and posixpath.dirname(q) == p]

    async def remove(self, path: str, recursive: bool) -> None:
        p = self._norm(path)
        self.files = {k: v for k, v in self.files.items() if k != p and not (recursive and k.startswith(p + "/"))}
        self.dirs = {d for d in self.dirs if d != p and not (recursive and d.startswith(p + "/"))} | {"/"}

    async def move(self, source: str, destination: str) -> None:
        s, d = self._norm(source), self._norm(destination)
        if s not in self.files:
            raise NotFound(f"no such file: {source}", field="source")
        self.files[d] = self.files.pop(s)

    async def set_xattrs(self, path: str, prefix: str, values: dict[str, str]) -> None:
        self._stat(path)

    def watch(self, path: str, recursive: bool) -> DirWatch:
        raise InvalidRequest("a hollow sandbox has no file events", field="path")

    async def connect(self, port: int) -> socket.socket:
        raise InvalidRequest("a hollow sandbox listens on no port", field="port")


@dataclass
class HollowState(BackendState):
    init: HollowInit | None = None  # the one its agent was last bound over


class HollowSandboxes:
    """The backend of every sandbox of a hollow edge."""

    def __init__(self, cgroup_root: str) -> None:
        self.cgroup_root = cgroup_root  # never made: usage reads find nothing there and count 0
        self.live: set[str] = set()

    def cgroup_path(self, sandbox_id: str) -> str:
        return f"{self.cgroup_root}/{sandbox_id}"

    async def prepare(self, sb: Sandbox, digests: list[str], restore: dict[str, str] | None = None
                      ) -> list[tuple[str, str]]:
        sb.state = HollowState()
        return []

    async def launch(self, sb: Sandbox, digests: list[str]) -> Launched:
        self.live.add(sb.id)
        return Launched(0)  # no process: nothing for a restart to find

    def _link(self, sb: Sandbox) -> InitLink:
        init = HollowInit()
        if isinstance(sb.state, HollowState):
            sb.state.init = init
        return InitLink(init, MemoryFiles())

    async def connect(self, sb: Sandbox) -> InitLink:
        return self._link(sb)

    async def pause(self, sb: Sandbox) -> str:
        return "hollow: nothing to freeze"

    async def resume(self, sb: Sandbox) -> tuple[str, InitLink | None]:
        if sb.id not in self.live:
            raise SandboxLost(f"hollow sandbox {sb.id} did not outlive its edge")
        return "hollow: nothing to thaw", self._link(sb)

    async def branch_image(self, sb: Sandbox, work: str) -> dict[str, str]:
        raise BranchUnsupported(f"sandbox {sb.id} is hollow (a load instrument): it runs nothing to branch")

    async def released(self, restore: dict[str, str]) -> None:
        return None

    async def kill(self, sb: Sandbox) -> None:
        if isinstance(sb.state, HollowState) and sb.state.init is not None:
            sb.state.init.close()

    async def destroy(self, sb: Sandbox) -> None:
        self.live.discard(sb.id)

    async def known(self) -> set[str]:
        return set(self.live)

    async def adopt(self, sb: Sandbox, known_to_runtime: bool) -> Adopted:
        raise SandboxLost(f"hollow sandbox {sb.id} did not outlive its edge (a hollow edge keeps nothing)")

    async def reap_strays(self, known: set[str]) -> list[str]:
        return []

    def detach(self, sb: Sandbox) -> None:
        return None

    # ---- questions: a hollow sandbox has no process, files on disk, quota or screen ----
    def host_pid(self, sb: Sandbox) -> int | None:
        return None

    def writable_dir(self, sb: Sandbox) -> str | None:
        return None

    def disk_path(self, sb: Sandbox) -> str:
        return sb.dir  # never made: it uses no disk

    def disk_quota(self, sb: Sandbox) -> int | None:
        return None

    def snapshot_files(self, sb: Sandbox) -> dict[str, str] | None:
        return None

    def display(self, sb: Sandbox) -> None:
        return None

    def agent_lost(self, sb: Sandbox) -> str:
        return "sandbox init exited"
