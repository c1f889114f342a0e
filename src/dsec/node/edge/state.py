"""The edge's node-local record of its sandboxes (SQLite), which is what lets a
restarted edge re-adopt the sandboxes that are still running."""

from __future__ import annotations

import sqlite3
import time

from pydantic import TypeAdapter

from dsec.node.backends.api import Record
from dsec.shared.wire.models import AnySandboxArgs, ContainerArgs, MicroVMArgs, SandboxInfo, SandboxState, VMArgs

TOMBSTONE_TTL_S = 3600.0
_ARGS: TypeAdapter[ContainerArgs | MicroVMArgs | VMArgs] = TypeAdapter(AnySandboxArgs)

__all__ = ["EdgeState", "Record", "open_local_db"]


def open_local_db(path: str) -> sqlite3.Connection:
    """An edge's own SQLite file (autocommit, WAL): its writes are single small rows that
    must survive the edge's crash, not the node's power loss."""
    db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    return db


class EdgeState:
    def __init__(self, path: str) -> None:
        self._db = open_local_db(path)
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS sandboxes (id TEXT PRIMARY KEY, state TEXT NOT NULL,"
            " info TEXT NOT NULL, args TEXT NOT NULL, init_pid INTEGER NOT NULL, digests TEXT NOT NULL,"
            " updated_at REAL NOT NULL)")

    def put(self, rec: Record) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO sandboxes VALUES (?,?,?,?,?,?,?)",
            (rec.info.sandbox_id, rec.info.state.value, rec.info.model_dump_json(), rec.args.model_dump_json(),
             rec.init_pid, ",".join(rec.digests), time.time()))

    def touch(self, sandbox_id: str, last_active_at: float) -> None:
        row = self._db.execute("SELECT info FROM sandboxes WHERE id=?", (sandbox_id,)).fetchone()
        if row:
            info = SandboxInfo.model_validate_json(row[0])
            info.last_active_at = last_active_at
            self._db.execute("UPDATE sandboxes SET info=? WHERE id=?", (info.model_dump_json(), sandbox_id))

    def get(self, sandbox_id: str) -> Record | None:
        row = self._db.execute("SELECT info, args, init_pid, digests FROM sandboxes WHERE id=?",
                               (sandbox_id,)).fetchone()
        return self._record(row) if row else None

    def live(self) -> list[Record]:
        rows = self._db.execute("SELECT info, args, init_pid, digests FROM sandboxes WHERE state NOT IN (?,?)",
                                (SandboxState.stopped.value, SandboxState.failed.value))
        return [self._record(r) for r in rows]

    def prune(self) -> None:
        self._db.execute("DELETE FROM sandboxes WHERE state IN (?,?) AND updated_at < ?",
                         (SandboxState.stopped.value, SandboxState.failed.value, time.time() - TOMBSTONE_TTL_S))

    @staticmethod
    def _record(row: tuple[str, str, int, str]) -> Record:
        return Record(SandboxInfo.model_validate_json(row[0]), _ARGS.validate_json(row[1]),
                      int(row[2]), [d for d in row[3].split(",") if d])
