"""The cluster's shared records, over the metadata database: the edge registry (who is in
the cluster, where, and whether its node is lost), the fleet view the controller's watcher
writes and every apiserver replica reads, the index of sandboxes by edge (what a lost
node held), and cluster settings (the apiservers' URLs). Blocking calls: services run
them in a thread."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel
from sqlalchemy import Engine, delete, insert, select, update
from sqlalchemy.exc import IntegrityError

from dsec.meta.schema import edges, sandboxes, settings
from dsec.wire.models import NodeStats, SandboxInfo, SandboxState

EdgeState = Literal["active", "lost", "removed"]


class EdgeRow(BaseModel):
    name: str
    url: str
    node_id: str
    state: EdgeState
    reason: str = ""
    registered_at: float
    changed_at: float
    stats: NodeStats | None = None
    stats_at: float | None = None


class Registry:
    def __init__(self, db: Engine) -> None:
        self.db = db

    # ---- edges --------------------------------------------------------------------
    def register(self, name: str, url: str, node_id: str) -> EdgeRow | None:
        """This edge is up at ``url`` on ``node_id``; returns what the registry held of it
        before (None: a new edge)."""
        now = time.time()
        with self.db.begin() as c:
            old = c.execute(select(edges).where(edges.c.name == name)).mappings().first()
            if old is None:
                c.execute(insert(edges).values(name=name, url=url, node_id=node_id, state="active", reason="",
                                               registered_at=now, changed_at=now))
            else:
                c.execute(update(edges).where(edges.c.name == name).values(
                    url=url, node_id=node_id, state="active", reason="", changed_at=now, stats=None, stats_at=None))
        return _edge(old) if old else None

    def edges(self) -> list[EdgeRow]:
        with self.db.connect() as c:
            return [_edge(r) for r in c.execute(select(edges).order_by(edges.c.name)).mappings()]

    def mark(self, name: str, state: EdgeState, reason: str) -> None:
        with self.db.begin() as c:
            c.execute(update(edges).where(edges.c.name == name).values(state=state, reason=reason,
                                                                      changed_at=time.time()))

    def put_stats(self, polled: dict[str, NodeStats]) -> None:
        now = time.time()
        with self.db.begin() as c:
            for name, st in polled.items():
                c.execute(update(edges).where(edges.c.name == name).values(stats=st.model_dump_json(), stats_at=now))

    # ---- the sandbox index ---------------------------------------------------------
    def index_put(self, info: SandboxInfo, project: str) -> None:
        with self.db.begin() as c:
            try:
                c.execute(insert(sandboxes).values(id=info.sandbox_id, edge=info.edge, project=project,
                                                   created_at=info.created_at, info=info.model_dump_json()))
            except IntegrityError:  # the same id again: an edge reuses no id, so this is a retry
                pass

    def index_drop(self, sandbox_ids: list[str]) -> None:
        if sandbox_ids:
            with self.db.begin() as c:
                c.execute(delete(sandboxes).where(sandboxes.c.id.in_(sandbox_ids)))

    def index_ids(self, edge: str) -> list[str]:
        with self.db.connect() as c:
            return list(c.execute(select(sandboxes.c.id).where(sandboxes.c.edge == edge)).scalars())

    def lost_ids(self, edge: str) -> list[str]:
        with self.db.connect() as c:
            return list(c.execute(select(sandboxes.c.id).where(sandboxes.c.edge == edge,
                                                               sandboxes.c.lost_reason.is_not(None))).scalars())

    def mark_lost(self, edge: str, reason: str) -> int:
        with self.db.begin() as c:
            return c.execute(update(sandboxes).where(sandboxes.c.edge == edge, sandboxes.c.lost_reason.is_(None))
                             .values(lost_reason=reason)).rowcount

    def lost(self, edge: str) -> list[SandboxInfo]:
        """The sandboxes a lost edge held, reported failed with the reason."""
        with self.db.connect() as c:
            rows = c.execute(select(sandboxes.c.info, sandboxes.c.lost_reason)
                             .where(sandboxes.c.edge == edge, sandboxes.c.lost_reason.is_not(None))
                             .order_by(sandboxes.c.created_at)).all()
        return [SandboxInfo.model_validate_json(info).model_copy(update={"state": SandboxState.failed, "error": why})
                for info, why in rows]

    # ---- settings ------------------------------------------------------------------
    def setting(self, key: str) -> str | None:
        with self.db.connect() as c:
            return c.execute(select(settings.c.value).where(settings.c.key == key)).scalar()

    def settings_like(self, prefix: str) -> dict[str, str]:
        with self.db.connect() as c:
            rows = c.execute(select(settings.c.key, settings.c.value).where(settings.c.key.startswith(prefix))).all()
        return {k: v for k, v in rows}

    def put_setting(self, key: str, value: str) -> None:
        with self.db.begin() as c:
            if c.execute(update(settings).where(settings.c.key == key).values(value=value)).rowcount == 0:
                c.execute(insert(settings).values(key=key, value=value))

    def setting_once(self, key: str, value: str) -> str:
        """``key``'s value, set to ``value`` if it had none (the first writer wins)."""
        with self.db.begin() as c:
            have = c.execute(select(settings.c.value).where(settings.c.key == key)).scalar()
            if have is not None:
                return str(have)
        try:
            with self.db.begin() as c:
                c.execute(insert(settings).values(key=key, value=value))
            return value
        except IntegrityError:
            return self.setting(key) or value

    def drop_settings(self, prefix: str) -> None:
        with self.db.begin() as c:
            c.execute(delete(settings).where(settings.c.key.startswith(prefix)))


def _edge(row: object) -> EdgeRow:
    r = dict(row)  # type: ignore[call-overload]
    stats = r.pop("stats")
    return EdgeRow(**r, stats=NodeStats.model_validate_json(stats) if stats else None)
