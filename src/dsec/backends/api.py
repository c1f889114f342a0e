"""The interface every sandbox backend offers its edge, and what it may ask of the edge.

A backend owns how one kind of sandbox exists on a node (a crun container on overlayfs,
a QEMU VM on its disks): building its root, starting it with dsec-init reachable,
freezing and thawing it, killing and releasing it, and taking it back after an edge
restart. Everything else (admission, records, the agent, networking policy, TTLs, the
order and bounds of a teardown) is the edge's, the same for every backend. A fifth
backend implements :class:`SandboxRuntime` and is chosen in ``EdgeCore.backend_of``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from dsec.agent.interfaces import InitChannel, SandboxFiles
from dsec.errors import SandboxError
from dsec.wire.models import NetworkInfo

if TYPE_CHECKING:
    from dsec.edge.sandbox import Sandbox
    from dsec.storage.node import NodeLayers


class SandboxLost(SandboxError):
    """The sandbox cannot come back (its snapshot is unreadable, its process is gone):
    the edge tears it down as failed."""


class BackendHost(Protocol):
    """What a backend may ask of the edge it runs under."""

    node_layers: NodeLayers

    def record(self, sb: Sandbox) -> None:
        """Write the sandbox's record now (a restart must find what was started)."""

    def on_event(self, sandbox_id: str, kind: str, message: str) -> None: ...

    async def bind_agent(self, sb: Sandbox, init: InitChannel, files: SandboxFiles | None) -> None:
        """dsec-init answers on ``init``: make the sandbox's agent over it."""

    async def wire_network(self, sb: Sandbox, rules: dict[str, bool]) -> NetworkInfo:
        """Give the sandbox its link under these egress rules."""


class SandboxRuntime(Protocol):
    """One backend's half of a sandbox's life on an edge. Each call is bounded by the
    backend or by its caller; none asks anything of the workload."""

    def cgroup_path(self, sandbox_id: str) -> str:
        """The cgroup holding everything the sandbox runs (its accounting and its kill)."""

    async def prepare(self, sb: Sandbox, digests: list[str]) -> None:
        """Its storage: the layer images (bottom to top) made into its root or disks."""

    async def start(self, sb: Sandbox, digests: list[str]) -> None:
        """Start it; returns once its agent is bound (``host.bind_agent``)."""

    async def pause(self, sb: Sandbox) -> str:
        """Stop it running and give back its memory; returns what was done, for its event."""

    async def resume(self, sb: Sandbox) -> str:
        """Running again with its agent bound; raises :class:`SandboxLost` if it cannot be."""

    async def kill(self, sb: Sandbox) -> None:
        """Every process of it gone, without asking it (the first step of every teardown)."""

    async def destroy(self, sb: Sandbox) -> None:
        """Release its runtime state once it is dead and its agent and network are gone."""

    async def known(self) -> set[str]:
        """The sandboxes the runtime itself knows of now (what a restart can take back)."""

    async def adopt(self, sb: Sandbox, known_to_runtime: bool) -> bool:
        """Take it back after an edge restart: True if it runs (its agent bound), False if
        it stays paused; raises :class:`~dsec.errors.SandboxError` saying why it cannot be."""

    async def reap_strays(self, known: set[str]) -> list[str]:
        """Kill and release whatever of this backend no sandbox record owns; their names."""
