"""The fleet's event log (the ``fleet_events`` table): every health change, cordon,
uncordon, drain, move and restore, with who did it and why. Blocking calls: services run
them in a thread."""

from __future__ import annotations

import builtins
import json
import time
from typing import Any

from sqlalchemy import Engine, and_, delete, insert, select

from dsec.shared.meta.schema import fleet_events
from dsec.shared.wire.fleet import FleetEvent

KEEP_S = 30 * 24 * 3600.0  # events older than this are dropped by prune()


class FleetEvents:
    def __init__(self, db: Engine) -> None:
        self.db = db

    def record(self, edge: str, kind: str, actor: str, reason: str, sandbox_id: str | None = None,
               detail: dict[str, Any] | None = None) -> None:
        with self.db.begin() as c:
            c.execute(insert(fleet_events).values(at=time.time(), edge=edge, sandbox_id=sandbox_id, kind=kind,
                                                  actor=actor, reason=reason, detail=json.dumps(detail or {})))

    def list(self, edge: str | None = None, sandbox_id: str | None = None, kind: str | None = None,
             after: int = 0, limit: int = 200) -> list[FleetEvent]:
        """Oldest first from ``after`` (an event id), at most ``limit``."""
        cond = [fleet_events.c.id > after]
        if edge is not None:
            cond.append(fleet_events.c.edge == edge)
        if sandbox_id is not None:
            cond.append(fleet_events.c.sandbox_id == sandbox_id)
        if kind is not None:
            cond.append(fleet_events.c.kind == kind)
        with self.db.connect() as c:
            rows = c.execute(select(fleet_events).where(and_(*cond)).order_by(fleet_events.c.id)
                             .limit(limit)).mappings().all()
        return [FleetEvent(**{**r, "detail": json.loads(r["detail"] or "{}")}) for r in rows]

    def newest(self, limit: int) -> builtins.list[FleetEvent]:
        """The ``limit`` newest events, newest first."""
        with self.db.connect() as c:
            rows = c.execute(select(fleet_events).order_by(fleet_events.c.id.desc()).limit(limit)).mappings().all()
        return [FleetEvent(**{**r, "detail": json.loads(r["detail"] or "{}")}) for r in rows]

    def prune(self, keep_s: float = KEEP_S) -> int:
        with self.db.begin() as c:
            return c.execute(delete(fleet_events).where(fleet_events.c.at < time.time() - keep_s)).rowcount
