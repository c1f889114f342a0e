"""The checkpoint records (the ``checkpoints`` table of the metadata database) and the
blobs they name in the shared layer store: writing a checkpoint, finding the one to
restore, retention, and deleting what no record needs any more.

A checkpoint's ``stack`` is complete: the blobs to stack over the sandbox's own layers
to get its files back, bottom to top. Retention keeps the newest ``keep_chains`` chains
(a full checkpoint and the deltas over it), so a restore always finds the newest
checkpoint whole, and a full checkpoint being written never leaves a sandbox without one.
Blocking calls: services run them in a thread."""

from __future__ import annotations

import builtins
import json
import logging
import os
import time
from typing import Any

from sqlalchemy import Engine, and_, delete, func, insert, select

from dsec.node.layers.store import LayerStore
from dsec.shared.errors import SandboxBusy
from dsec.shared.meta.schema import checkpoints, sandboxes
from dsec.shared.wire.fleet import CheckpointInfo
from dsec.shared.wire.models import SandboxInfo

log = logging.getLogger("dsec.checkpoints")
KEEP_CHAINS = 2
COMMANDS_EXT = "cmdlog"  # a checkpoint's command log: JSON rows, in the store beside the blobs
VM_FILES = ("vmstate", "vmdisk")  # a VM's checkpoint: its memory snapshot and disk, by these extensions



def had_checkpoints(info: SandboxInfo) -> bool:
    """Whether the catalog may hold checkpoints of this sandbox: one taken (or being taken
    on a schedule), or the checkpoint it was restored from. A stop of any other sandbox
    has nothing to drop there and skips the round trip (2 ms of a stop)."""
    return info.checkpoint is not None or info.restored_from is not None or info.checkpoint_every_s is not None

class Checkpoint(CheckpointInfo):
    """A record as stored: the info plus what a restore needs."""

    project: str
    record: dict[str, Any]  # {"args": ContainerArgs JSON, "info": SandboxInfo JSON}
    commands: str | None = None  # the command log's blob name in the store


class CheckpointStore:
    def __init__(self, db: Engine, layers: LayerStore | None, keep_chains: int = KEEP_CHAINS) -> None:
        """``layers``: the store the blobs are in (None: a reader that deletes no blob)."""
        self.db, self.layers, self.keep_chains = db, layers, keep_chains

    def add(self, cp: Checkpoint) -> None:
        """Record ``cp``, then drop the chains past retention (and their blobs). Fenced: an
        edge the cluster's index no longer names as the sandbox's (it was restored elsewhere
        while this edge was away) records nothing."""
        with self.db.begin() as c:
            holder = c.execute(select(sandboxes.c.edge).where(sandboxes.c.id == cp.sandbox_id)).scalar()
            if holder is not None and holder != cp.edge:
                raise SandboxBusy(f"sandbox {cp.sandbox_id} runs on edge {holder} now; edge {cp.edge}'s copy is "
                                  "stale and records no checkpoint")
            c.execute(insert(checkpoints).values(
                sandbox_id=cp.sandbox_id, seq=cp.seq, kind=cp.kind, edge=cp.edge, project=cp.project,
                digest=cp.digest, stack=json.dumps(cp.stack), bytes=cp.bytes, files=cp.files,
                freeze_ms=cp.freeze_ms, build_ms=cp.build_ms, taken_at=cp.taken_at, record=json.dumps(cp.record),
                commands=cp.commands))
        if cp.kind == "full":
            self._retain(cp.sandbox_id)

    def latest(self, sandbox_id: str) -> Checkpoint | None:
        with self.db.connect() as c:
            row = c.execute(select(checkpoints).where(checkpoints.c.sandbox_id == sandbox_id)
                            .order_by(checkpoints.c.seq.desc()).limit(1)).mappings().first()
        return _checkpoint(row) if row else None

    def get(self, sandbox_id: str, seq: int) -> Checkpoint | None:
        with self.db.connect() as c:
            row = c.execute(select(checkpoints).where(and_(checkpoints.c.sandbox_id == sandbox_id,
                                                           checkpoints.c.seq == seq))).mappings().first()
        return _checkpoint(row) if row else None

    def list(self, sandbox_id: str) -> list[Checkpoint]:
        with self.db.connect() as c:
            rows = c.execute(select(checkpoints).where(checkpoints.c.sandbox_id == sandbox_id)
                             .order_by(checkpoints.c.seq)).mappings().all()
        return [_checkpoint(r) for r in rows]

    def sandboxes(self, ids: builtins.list[str]) -> set[str]:
        """Which of ``ids`` have a checkpoint."""
        found: set[str] = set()
        with self.db.connect() as c:
            for i in range(0, len(ids), 500):
                q = select(checkpoints.c.sandbox_id).where(checkpoints.c.sandbox_id.in_(ids[i:i + 500])).distinct()
                found.update(c.execute(q).scalars())
        return found

    def next_seq(self, sandbox_id: str) -> int:
        with self.db.connect() as c:
            top = c.execute(select(func.max(checkpoints.c.seq)).where(checkpoints.c.sandbox_id == sandbox_id)).scalar()
        return int(top or 0) + 1

    def _retain(self, sandbox_id: str) -> None:
        with self.db.connect() as c:
            fulls = list(c.execute(select(checkpoints.c.seq).where(and_(
                checkpoints.c.sandbox_id == sandbox_id, checkpoints.c.kind == "full"))
                .order_by(checkpoints.c.seq.desc())).scalars())
        if len(fulls) <= self.keep_chains:
            return
        oldest_kept = fulls[self.keep_chains - 1]
        self._drop(and_(checkpoints.c.sandbox_id == sandbox_id, checkpoints.c.seq < oldest_kept))

    def drop_sandbox(self, sandbox_id: str, holder: str | None = None) -> int:
        """Forget every checkpoint of ``sandbox_id`` (it was stopped for good). ``holder``:
        only if the cluster's index names that edge as the sandbox's (or has no row): a stale
        copy ending on another edge drops nothing."""
        return self._drop(checkpoints.c.sandbox_id == sandbox_id, sandbox_id if holder else None, holder)

    def _drop(self, where: Any, sandbox_id: str | None = None, holder: str | None = None) -> int:
        with self.db.begin() as c:
            if sandbox_id is not None:
                now = c.execute(select(sandboxes.c.edge).where(sandboxes.c.id == sandbox_id)).scalar()
                if now is not None and now != holder:
                    return 0
            rows = c.execute(delete(checkpoints).where(where).returning(
                checkpoints.c.stack, checkpoints.c.commands, checkpoints.c.record)).all()
        if not rows:
            return 0
        blobs, files = _named(rows)
        try:
            self._delete_unreferenced(blobs, files)
        except OSError as e:  # the store is away: gc() finds them later
            log.warning("checkpoint blobs not deleted: %s", e)
        return len(rows)

    def referenced(self) -> tuple[set[str], set[str]]:
        """Every blob (its stack's, and its own layers' as recorded) and named file (command
        logs, a VM's memory and disk) some checkpoint still names."""
        with self.db.connect() as c:
            rows = c.execute(select(checkpoints.c.stack, checkpoints.c.commands, checkpoints.c.record)).all()
        blobs, files = _named(rows)
        blobs |= {d for _, _, record in rows for d in json.loads(record).get("digests") or []}
        return blobs, files

    def _delete_unreferenced(self, blobs: set[str], commands: set[str]) -> None:
        if self.layers is None:
            log.warning("%d checkpoint blobs left for the layer gc: no store here", len(blobs))
            return
        live_blobs, live_cmds = self.referenced()
        layer_blobs = {b for layer in self.layers.list() for b in layer.all_blobs}
        for digest in blobs - live_blobs - layer_blobs:
            data = self.layers.data_of(digest)
            for name in (f"{digest}.erofs", *((f"{data}.data", f"{data}.chunks") if data else ())):
                if self.layers.backend.exists(name):
                    self.layers.backend.remove(name)
        for name in commands - live_cmds:
            if self.layers.backend.exists(name):
                self.layers.backend.remove(name)

    def gc(self) -> int:
        """Command logs and VM files in the store no checkpoint names (a crash between
        writing one and recording it), older than an hour (so not one being written now);
        blobs are the layer store's gc's, which keeps what checkpoints name."""
        _, live = self.referenced()
        n = 0
        if self.layers is None:
            return 0
        for name in self.layers.backend.names():
            if (name.rpartition(".")[2] in (COMMANDS_EXT, *VM_FILES) and name not in live
                    and time.time() - os.path.getmtime(self.layers.backend.path(name)) > 3600):
                self.layers.backend.remove(name)
                n += 1
        return n


def _named(rows: Any) -> tuple[set[str], set[str]]:
    """The blobs (stacks) and the named files (command logs; a VM's memory and disk) of rows
    of (stack, commands, record)."""
    blobs = {d for stack, _, _ in rows for d in json.loads(stack)}
    files = {cmd for _, cmd, _ in rows if cmd}
    for _, _, record in rows:
        vm = json.loads(record).get("vm") or {}
        files |= {vm[k] for k in VM_FILES if k in vm}
    return blobs, files


def _checkpoint(row: Any) -> Checkpoint:
    r = dict(row)
    return Checkpoint(**{**r, "stack": json.loads(r["stack"]), "record": json.loads(r["record"])})
