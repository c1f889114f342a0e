"""The edge's sandbox table: the live sandboxes by id, their node-local records (SQLite,
dsec.node.edge.state) and what they reserve (dsec.node.edge.reservations), and the
lookups of an id that every part of the edge starts from.

It says what is there, never what may be done with it: that is the lifecycle's table
(dsec.node.edge.lifecycle.LEGAL).
"""

from __future__ import annotations

import secrets
import time

from dsec.node.edge.reservations import Reservations
from dsec.node.edge.sandbox import Sandbox
from dsec.node.edge.state import EdgeState
from dsec.shared.errors import InvalidRequest, NotFound
from dsec.shared.wire.models import SandboxInfo, parse_sandbox_id

ID_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"


class SandboxTable:
    """The sandboxes of edge ``name``: ``sandboxes`` (live, stopping ones until their
    teardown ends), ``state`` (every record, tombstones included) and ``held``."""

    def __init__(self, name: str, state_path: str) -> None:
        self.name = name
        self.sandboxes: dict[str, Sandbox] = {}
        self.state = EdgeState(state_path)
        self.held = Reservations()  # what they reserve, summed as they change (node/edge/reservations.py)

    def new_id(self) -> str:
        """The edge names its sandboxes (an id is a path on this host)."""
        return f"{self.name}-{''.join(secrets.choice(ID_ALPHABET) for _ in range(12))}"

    def find(self, sandbox_id: str) -> Sandbox | None:
        """The sandbox under ``sandbox_id`` (stopping ones too), after checking the id is
        well formed (InvalidRequest) and names this edge or one of its records (NotFound):
        an id names the edge that made it; a sandbox restored here from another keeps its id."""
        try:
            home = parse_sandbox_id(sandbox_id)
        except ValueError as e:
            raise InvalidRequest(str(e), field="sandbox_id") from None
        sb = self.sandboxes.get(sandbox_id)
        if home != self.name and sb is None and self.state.get(sandbox_id) is None:
            raise NotFound(f"sandbox {sandbox_id!r} does not live on edge {self.name}", field="sandbox_id")
        return sb

    def tombstone(self, sandbox_id: str) -> SandboxInfo:
        """The sandbox's last record (an ended one's tombstone); NotFound if it has none."""
        rec = self.state.get(sandbox_id)
        if rec is None:
            raise NotFound(f"no sandbox {sandbox_id!r} on edge {self.name}", field="sandbox_id")
        return rec.info

    def info(self, sandbox_id: str) -> SandboxInfo:
        """What the sandbox is now: its live info, else its tombstone."""
        sb = self.sandboxes.get(sandbox_id)
        return sb.rec.info if sb else self.tombstone(sandbox_id)

    def touch(self, sandbox_id: str) -> None:
        """It was used now (the sweep writes the time to its record)."""
        sb = self.sandboxes.get(sandbox_id)
        if sb:
            sb.rec.info.last_active_at = time.time()
            sb.dirty = True
