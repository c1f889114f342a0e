"""Wire models of in-place snapshots (docs/snapshots.md): a snapshot of a running
container's files taken in milliseconds on its own edge, the rollback to one, and the live
branch of a running sandbox into new ones."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, Field

# a snapshot's name: also its subvolume's name on the edge, so no slash and nothing odd; and
# not NAME.json, the name of the file beside each snapshot
SNAPSHOT_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
NAME_RULE = "letters, digits, '.', '_' and '-', 1 to 64, not starting with '.', '_' or '-', not ending in '.json'"


def valid_snapshot_name(name: str) -> str:
    if not re.fullmatch(SNAPSHOT_NAME, name) or name.endswith(".json"):
        raise ValueError(f"snapshot name {name!r}: {NAME_RULE}")
    return name


SnapshotName = Annotated[str, AfterValidator(valid_snapshot_name), Field(description=NAME_RULE)]


class SnapshotRequest(BaseModel):
    name: SnapshotName | None = Field(default=None, description="default: snap-N, N one more than the last one's")


class RollbackRequest(BaseModel):
    snapshot: SnapshotName = Field(description="the name of the snapshot to go back to")


MAX_BRANCH = 16  # children of one branch call (each a running sandbox: the edge admits all n first)


class BranchRequest(BaseModel):
    """A live branch of a running sandbox: ``n`` new sandboxes continuing from its state."""

    n: Annotated[int, Field(ge=1, le=MAX_BRANCH, description=f"how many children, 1 to {MAX_BRANCH}")] = 1


class SandboxSnapshot(BaseModel):
    """One in-place snapshot: the sandbox's writable layer as it was at ``taken_at``."""

    sandbox_id: str
    name: str
    taken_at: float
    freeze_ms: float = Field(description="how long the sandbox was frozen for it")
    commands_seq: int = Field(description="the command log's last record at the snapshot: later ones are dropped "
                                          "by a rollback to it")
    sessions: dict[str, str] = Field(default_factory=dict, description="shell sessions at the snapshot and their "
                                                                       "working directories")
    bytes: int | None = Field(default=None, description="disk the snapshot alone holds (data the sandbox changed "
                              "since), counted against its disk quota; None until measured")


class RollbackResult(BaseModel):
    """What a rollback did."""

    sandbox_id: str
    snapshot: str
    rollback_ms: float = Field(description="from the request reaching the edge to the sandbox running again")
    frozen_ms: float = Field(description="how long the sandbox was frozen (its processes killed, its root swapped)")
    killed: int = Field(description="processes of the workload killed (every process but dsec-init)")
    sessions: list[str] = Field(description="shell sessions restarted, at their snapshot working directories")
    commands_dropped: int = Field(description="command log records after the snapshot, dropped (their keys run "
                                              "again)")
    steps_ms: dict[str, float] = Field(default_factory=dict, description="where the time went: copy (the snapshot's "
                                       "writable copy), mount, freeze, reroot, killed, swap, sessions_and_log")
