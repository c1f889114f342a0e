"""The boundary between an edge and its sandbox backends: the sandbox as both see it, and
the interface every backend offers. It runs one way: the edge asks, the backend answers,
and no backend module imports the edge's package.

A backend owns how one kind of sandbox exists on a node (a crun container on overlayfs,
a QEMU VM on its disks, the hollow runtime's nothing): building its root, starting it with
dsec-init reachable, freezing and thawing it, killing and releasing it, and taking it back
after an edge restart. Everything else (admission, records, the agent, networking, TTLs,
the order and bounds of a teardown) is the edge's, the same for every backend.

What each keeps of one sandbox is separate, after containerd's container, task and
snapshot: :class:`Record` is the edge-neutral record (what was asked, what it is, its
init's pid), the edge's own handles sit beside it in :class:`Sandbox`, and the backend's
state is one opaque field, :attr:`Sandbox.state`, that only its backend reads. What the
edge needs to know of that state, it asks (:meth:`SandboxRuntime.host_pid`, ...).

A create is driven by the edge: :meth:`~SandboxRuntime.prepare`, then
:meth:`~SandboxRuntime.launch` (its init's pid, which the edge records), the edge wires
its network, then :meth:`~SandboxRuntime.connect` gives the channel to dsec-init
(:class:`InitLink`) over which the edge makes the sandbox's agent. Another backend
implements :class:`SandboxRuntime` and is chosen in ``EdgeNode.backend_of`` (dsec.node.edge.core);
tests/test_backend_contract.py runs the same tests against each.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from dsec.node.agent.aether import Aether
from dsec.node.agent.interfaces import InitChannel, SandboxFiles
from dsec.shared.errors import SandboxError
from dsec.shared.wire.models import ContainerArgs, MicroVMArgs, SandboxEvent, SandboxInfo, VMArgs, VMInfo


class SandboxLost(SandboxError):
    """The sandbox cannot come back (its snapshot is unreadable, its process is gone):
    the edge tears it down as failed."""


@dataclass
class Record:
    """What a sandbox is, as its edge's SQLite record keeps it (node/edge/state.py): enough for
    a restarted edge to find it again."""

    info: SandboxInfo
    args: ContainerArgs | MicroVMArgs | VMArgs
    init_pid: int
    digests: list[str]


class BackendState:
    """A backend's own state of one sandbox (its VM, its quota group, ...). Opaque to the
    edge: each backend subclasses it, sets it in ``prepare`` or ``adopt``, and reads only
    its own."""


@dataclass
class Sandbox:
    """A live sandbox on an edge: its record, the edge's handles of it, and (``state``)
    its backend's state, which the edge never reads."""

    rec: Record
    dir: str
    state: BackendState | None = None  # the backend's (see BackendState)
    agent: Aether | None = None
    stopping: bool = False
    watch: asyncio.Task[None] | None = None
    ops: int = 0
    dirty: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    events: deque[SandboxEvent] = field(default_factory=lambda: deque(maxlen=200))
    teardown: asyncio.Task[None] | None = None
    oom_seen: int = 0
    pids_seen: int = 0
    pids_reported: float = 0.0
    cpu_seen: tuple[float, float] = (0.0, 0.0)  # (when, throttled seconds) at the last look
    cpu_reported: float = 0.0
    quota_full: bool = False
    disk: tuple[float, int] = (0.0, 0)  # (when measured, bytes): a tree walk, so cached
    creator: asyncio.Task[SandboxInfo] | None = None  # the create under way, which a stop cancels
    memory_held_mb: int = 0  # charged to its cgroup at the last look (admission counts it)
    memfail_seen: int = 0
    limits_at: float = 0.0  # (monotonic) when its limit events were last read
    memfail_reported: float = 0.0
    keep_checkpoints: bool = False  # its end here is not its end: it moved, or its restore here failed

    @property
    def id(self) -> str:
        return self.rec.info.sandbox_id


@dataclass(frozen=True)
class Launched:
    """What a launch started: its init's host pid (0: none, a hollow sandbox) for the
    edge to record, and a VM's facts for its info."""

    init_pid: int
    vm: VMInfo | None = None


@dataclass(frozen=True)
class InitLink:
    """A channel to a sandbox's dsec-init, and its files where they are not the init's
    /proc root (a VM's, a hollow sandbox's): what the edge makes its agent over."""

    init: InitChannel
    files: SandboxFiles | None = None


@dataclass(frozen=True)
class Adopted:
    """A sandbox taken back after an edge restart: ``running`` (its agent is to be bound
    over ``link``), or paused (``link``, if any, is bound only when it resumes)."""

    running: bool
    link: InitLink | None = None


class Display(Protocol):
    """A sandbox's screen and input (a full VM with ``display=True``)."""

    async def screenshot(self) -> bytes: ...

    async def send_keys(self, keys: str) -> None: ...

    async def click(self, x: int, y: int, button: str = "left") -> None: ...


class SandboxRuntime(Protocol):
    """One backend's half of a sandbox's life on an edge. Each call is bounded by the
    backend or by its caller; none asks anything of the workload, and none calls back
    into the edge."""

    def cgroup_path(self, sandbox_id: str) -> str:
        """The cgroup holding everything the sandbox runs (its accounting and its kill)."""

    async def prepare(self, sb: Sandbox, digests: list[str], restore: dict[str, str] | None = None
                      ) -> list[tuple[str, str]]:
        """Its storage: the layer images (bottom to top) made into its root or disks;
        ``restore``: a VM checkpoint's files, or a :meth:`branch_image`, to start from. Returns events (kind, message)
        for the sandbox's log."""

    async def launch(self, sb: Sandbox, digests: list[str]) -> Launched:
        """Start it; returns once its init runs (the edge records its pid next)."""

    async def connect(self, sb: Sandbox) -> InitLink:
        """The channel to the init that :meth:`launch` started, configured for the workload."""

    async def pause(self, sb: Sandbox) -> str:
        """Stop it running and give back its memory; returns what was done, for its event."""

    async def resume(self, sb: Sandbox) -> tuple[str, InitLink | None]:
        """Running again; returns what was done and, where its agent must be bound anew
        (paused across an edge restart), the link; raises :class:`SandboxLost` if it cannot be."""

    async def branch_image(self, sb: Sandbox, work: str) -> dict[str, str]:
        """Capture the running sandbox (memory, processes, devices, and its disk at the same
        instant) into files under ``work`` while it runs on (a brief pause at most); returns
        the ``restore`` that :meth:`prepare` and :meth:`launch` start a child from (a live
        branch: dsec.node.edge.branching). Raises
        :class:`~dsec.shared.errors.BranchUnsupported` saying why where it cannot."""

    async def released(self, restore: dict[str, str]) -> None:
        """The children of a :meth:`branch_image` are made (or failed): drop what of its files
        they do not hold themselves."""

    async def kill(self, sb: Sandbox) -> None:
        """Every process of it gone, without asking it (the first step of every teardown)."""

    async def destroy(self, sb: Sandbox) -> None:
        """Release its runtime state once it is dead and its agent and network are gone."""

    async def known(self) -> set[str]:
        """The sandboxes the runtime itself knows of now (what a restart can take back)."""

    async def adopt(self, sb: Sandbox, known_to_runtime: bool) -> Adopted:
        """Take it back after an edge restart (its state rebuilt from what the node holds);
        raises :class:`~dsec.shared.errors.SandboxError` saying why it cannot be."""

    async def reap_strays(self, known: set[str]) -> list[str]:
        """Kill and release whatever of this backend no sandbox record owns; their names."""

    def detach(self, sb: Sandbox) -> None:
        """The edge is going away, the sandbox is not: let go of the edge's own connections
        to it (a VM's monitor, which takes one client at a time) and leave it running."""

    # ---- what the edge may ask of a sandbox's backend state ---------------------------
    def host_pid(self, sb: Sandbox) -> int | None:
        """The host pid whose /proc root and namespaces are the sandbox's (network wiring,
        file detectors), or None where the workload is not a host process tree (a VM)."""

    def writable_dir(self, sb: Sandbox) -> str | None:
        """The host directory holding its writes (a container's overlay upper), or None."""

    def disk_path(self, sb: Sandbox) -> str:
        """The file or tree whose allocated bytes are its disk use."""

    def disk_quota(self, sb: Sandbox) -> int | None:
        """Its quota group on the sandbox volume (cheap usage, quota events), or None."""

    def snapshot_files(self, sb: Sandbox) -> dict[str, str] | None:
        """Where its checkpoint is taken whole (a VM: ``state``, ``meta`` and ``disk`` files
        as a pause leaves them), or None when its writes are checkpointed as layers."""

    def display(self, sb: Sandbox) -> Display | None:
        """Its screen, if it has one."""

    def agent_lost(self, sb: Sandbox) -> str:
        """Why a sandbox whose init channel closed has failed, in its owner's words."""
