"""The cluster's shared records, over the metadata database: the edge registry (who is in
the cluster, where, whether its node is lost, and its health: the detector's verdict or an
operator's cordon), the fleet view the controller's watcher
writes and every apiserver replica reads, the index of sandboxes by edge (what a lost
node held), and cluster settings (the apiservers' URLs). Blocking calls: services run
them in a thread."""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel
from sqlalchemy import Engine, Insert, bindparam, delete, false, insert, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import IntegrityError

from dsec.shared.meta.schema import edges, sandboxes, settings
from dsec.shared.wire.fleet import Evidence, Health
from dsec.shared.wire.models import NodeStats, SandboxInfo, SandboxState, parse_sandbox_id

EdgeState = Literal["active", "lost", "removed"]
RESTORING = "restoring"  # sandboxes.restore while a restore runs
RESTORE_FAILED = "restore failed: "  # ... after the last one failed (an operator may retry)


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
    # the health detector's verdict (dsec.control.health), or an operator's cordon
    health: Health = "ok"
    health_reason: str = ""
    health_at: float | None = None
    evidence: list[Evidence] = []
    cordoned_by: str = ""  # "" | "detector" | the operator's token id


_INDEX_VALUES: dict[str, Any] = {k: bindparam(k) for k in ("id", "edge", "project", "created_at", "info")}
_INDEX_INSERT = {pg: ins(sandboxes).values(_INDEX_VALUES).on_conflict_do_nothing(index_elements=["id"])
                 for pg, ins in ((True, pg_insert), (False, sqlite_insert))}


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

    def ensure(self, name: str, url: str) -> None:
        """An edge named by hand (``dsec serve``, ``dsec apiserver --edges``) has a row, for
        its health; one already there keeps its verdict and cordon."""
        with self.db.begin() as c:
            if c.execute(select(edges.c.name).where(edges.c.name == name)).first() is None:
                now = time.time()
                c.execute(insert(edges).values(name=name, url=url, node_id="", state="active", reason="",
                                               registered_at=now, changed_at=now))

    def set_health(self, name: str, health: Health, reason: str, evidence: list[Evidence], cordoned_by: str,
                   only_if_by: tuple[str, ...] | None = None) -> bool:
        """Record a verdict or a cordon; with ``only_if_by``, only while the edge's cordon is
        held by one of those ("" for none): the detector never overrides an operator who
        acted since it read the row. False: no such edge (or the condition failed)."""
        cond = [edges.c.name == name]
        if only_if_by is not None:
            cond.append(edges.c.cordoned_by.in_(only_if_by))
        with self.db.begin() as c:
            return bool(c.execute(update(edges).where(*cond).values(
                health=health, health_reason=reason, health_at=time.time(), cordoned_by=cordoned_by,
                evidence=json.dumps([e.model_dump() for e in evidence]))).rowcount)

    def put_stats(self, polled: dict[str, NodeStats]) -> None:
        now = time.time()
        with self.db.begin() as c:
            for name, st in polled.items():
                c.execute(update(edges).where(edges.c.name == name).values(stats=st.model_dump_json(), stats_at=now))

    # ---- the sandbox index ---------------------------------------------------------
    def index_insert(self, info: SandboxInfo, project: str) -> tuple[Insert, dict[str, object]]:
        """The statement that indexes a sandbox, and its parameters (nothing for an id
        indexed already: an edge reuses no id, so that is a retry), for a caller to run in a
        transaction of its own on this database (the quota bind's: one commit per create
        instead of two). The statement is built once per dialect: per create it cost more
        than running it."""
        return _INDEX_INSERT[self.db.dialect.name == "postgresql"], {
            "id": info.sandbox_id, "edge": info.edge, "project": project, "created_at": info.created_at,
            "info": info.model_dump_json()}

    def index_put(self, info: SandboxInfo, project: str) -> None:
        with self.db.begin() as c:
            c.execute(*self.index_insert(info, project))

    def index_drop(self, sandbox_ids: list[str]) -> None:
        if sandbox_ids:
            with self.db.begin() as c:
                c.execute(delete(sandboxes).where(sandboxes.c.id.in_(sandbox_ids)))

    def index_infos(self, edge_names: list[str]) -> list[tuple[str, str]]:
        """(edge, the sandbox's info at create, JSON) of every sandbox the index says these
        edges hold and the cluster has not reported lost."""
        with self.db.connect() as c:
            return [(e, i) for e, i in c.execute(select(sandboxes.c.edge, sandboxes.c.info).where(
                sandboxes.c.edge.in_(edge_names), sandboxes.c.lost_reason.is_(None)))]

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
        """The sandboxes a lost edge held, reported failed with the reason (``restoring``
        while one comes back elsewhere from its checkpoint)."""
        with self.db.connect() as c:
            rows = c.execute(select(sandboxes.c.info, sandboxes.c.lost_reason, sandboxes.c.restore)
                             .where(sandboxes.c.edge == edge, sandboxes.c.lost_reason.is_not(None))
                             .order_by(sandboxes.c.created_at)).all()
        out = []
        for info, why, restore in rows:
            state = SandboxState.restoring if restore == RESTORING else SandboxState.failed
            error = why if not restore or restore == RESTORING else f"{why}; {restore}"
            out.append(SandboxInfo.model_validate_json(info).model_copy(update={"state": state, "error": error}))
        return out

    # ---- sandboxes that moved (restored or drained onto another edge) ---------------------
    def set_restore(self, sandbox_id: str, restore: str | None) -> None:
        """Note a restore under way (RESTORING), or why the last one failed, or clear it."""
        with self.db.begin() as c:
            c.execute(update(sandboxes).where(sandboxes.c.id == sandbox_id).values(restore=restore))

    def moved(self, info: SandboxInfo) -> bool:
        """``info.sandbox_id`` now runs on ``info.edge``: routing goes there from now on.
        False: the sandbox has no row any more (it was stopped while it moved)."""
        values = {"edge": info.edge, "moved": info.edge != parse_sandbox_id(info.sandbox_id), "lost_reason": None,
                  "restore": None, "info": info.model_dump_json()}
        with self.db.begin() as c:
            return bool(c.execute(update(sandboxes).where(sandboxes.c.id == info.sandbox_id)
                                  .values(**values)).rowcount)

    def claim_move(self, sandbox_id: str, what: str) -> bool:
        """Take the sandbox for a move or a restore (``what``), unless another is under way
        (a compare-and-set on its row: two replicas or a controller never move it at once).
        A lost sandbox's RESTORING left by a controller that died is taken over."""
        with self.db.begin() as c:
            return bool(c.execute(update(sandboxes).where(
                sandboxes.c.id == sandbox_id,
                or_(sandboxes.c.restore.is_(None),
                    or_(sandboxes.c.restore == RESTORING, sandboxes.c.restore.startswith(RESTORE_FAILED))
                    if what == RESTORING else false()))
                .values(restore=what)).rowcount)

    def release_move(self, sandbox_id: str, what: str) -> None:
        with self.db.begin() as c:
            c.execute(update(sandboxes).where(sandboxes.c.id == sandbox_id, sandboxes.c.restore == what)
                      .values(restore=None))

    def holders(self) -> dict[str, str]:
        """Every moved sandbox -> the edge it runs on now."""
        with self.db.connect() as c:
            return dict(c.execute(select(sandboxes.c.id, sandboxes.c.edge).where(sandboxes.c.moved)).all())

    def holder(self, sandbox_id: str) -> str | None:
        """The edge the index says holds ``sandbox_id`` (None: not indexed)."""
        with self.db.connect() as c:
            return c.execute(select(sandboxes.c.edge).where(sandboxes.c.id == sandbox_id)).scalar()

    def restorable_ids(self, edge: str) -> list[str]:
        """A lost edge's sandboxes not yet restored, nor failed to restore."""
        with self.db.connect() as c:
            return list(c.execute(select(sandboxes.c.id).where(
                sandboxes.c.edge == edge, sandboxes.c.lost_reason.is_not(None),
                or_(sandboxes.c.restore.is_(None), sandboxes.c.restore == RESTORING))).scalars())

    def index_rows(self, sandbox_ids: list[str]) -> dict[str, tuple[str, str | None]]:
        """id -> (the edge the index says holds it, its restore note)."""
        out: dict[str, tuple[str, str | None]] = {}
        with self.db.connect() as c:
            for i in range(0, len(sandbox_ids), 500):
                q = select(sandboxes.c.id, sandboxes.c.edge, sandboxes.c.restore).where(
                    sandboxes.c.id.in_(sandbox_ids[i:i + 500]))
                out.update((sid, (edge, restore)) for sid, edge, restore in c.execute(q))
        return out

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

    def drop_setting(self, key: str) -> None:
        with self.db.begin() as c:
            c.execute(delete(settings).where(settings.c.key == key))

    def drop_settings(self, prefix: str) -> None:
        with self.db.begin() as c:
            c.execute(delete(settings).where(settings.c.key.startswith(prefix)))


def _edge(row: object) -> EdgeRow:
    r = dict(row)  # type: ignore[call-overload]
    stats = r.pop("stats")
    evidence = [Evidence.model_validate(e) for e in json.loads(r.pop("evidence") or "[]")]
    return EdgeRow(**r, stats=NodeStats.model_validate_json(stats) if stats else None, evidence=evidence)
