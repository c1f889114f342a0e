"""Layer visibility: which project owns a published layer, and which projects may see and
use it. The ``layer_acl`` table in the metadata database holds one row per owned layer:

* ``public``: every project;
* ``project``: the owner project and every project in its subtree, and admins of the owner
  or of a project above it;
* ``private``: the owner project itself, and admins of it or above.

A layer without a row (base images, OCI imports, layers published before this table) is
public; the cluster's admin sees every layer. The apiserver answers a layer the caller may
not see exactly as it answers an unknown one (404), so a hidden layer's existence does not
leak through reads or creates. Blocking calls: the apiserver runs them in a thread.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, get_args

from sqlalchemy import Connection, Engine, Row, and_, bindparam, delete, insert, select, update
from sqlalchemy.exc import IntegrityError

from dsec.control.iam.tokens import Principal, record_event
from dsec.shared.errors import InvalidRequest
from dsec.shared.meta.schema import layer_acl
from dsec.shared.wire.iam import within

Visibility = Literal["public", "project", "private"]
VISIBILITIES: tuple[str, ...] = get_args(Visibility)
# a claim younger than this whose layer is not published yet is a pack_diff still running
# (an edge call is bounded well below: dsec.node.edge.remote.client.CALL_BOUND_S); an older one
# is what a publish that died half-way, or a removal outside the API, left behind
CLAIM_STALE_S = 3600.0
# refs per IN (...) list: SQLite builds before 3.32 take at most 999 bound parameters
_CHUNK = 500
# built once: building and keying the statement per create cost more than running it
_BY_REFS = select(layer_acl).where(layer_acl.c.ref.in_(bindparam("refs", expanding=True)))


@dataclass(frozen=True)
class AclRow:
    ref: str
    project: str  # the owner
    visibility: str
    created_by: str | None
    created_at: float


def may_see(principal: Principal, owner: str, visibility: str) -> bool:
    """Whether ``principal`` may see (list, read, run, fork, stack on) a layer of project
    ``owner`` with this visibility."""
    if principal.all_projects or visibility == "public":
        return True
    if principal.administers(owner):  # an admin of the owner or of a project above it
        return True
    if visibility == "project":
        return within(principal.project, owner)
    # "private", and any value this version does not know: fail closed, to the owner alone
    return principal.project == owner


def _row(r: Row[Any]) -> AclRow:
    m = r._mapping
    return AclRow(m["ref"], m["project"], m["visibility"], m["created_by"], m["created_at"])


def _check(visibility: str) -> None:
    if visibility not in VISIBILITIES:
        raise InvalidRequest(f"visibility {visibility!r} must be one of {', '.join(VISIBILITIES)}",
                             field="visibility")


class LayerAcl:
    """The ``layer_acl`` rows of the metadata database ``db``."""

    def __init__(self, db: Engine) -> None:
        self._db = db

    def get(self, ref: str) -> AclRow | None:
        """The layer's row; None: it is public (no project owns it)."""
        with self._db.connect() as c:
            r = c.execute(select(layer_acl).where(layer_acl.c.ref == ref)).first()
        return _row(r) if r is not None else None

    def rows(self, refs: Iterable[str] | None = None) -> dict[str, AclRow]:
        """The rows of ``refs`` (all rows when None: the whole catalog is being listed)."""
        with self._db.connect() as c:
            if refs is None:
                return {(a := _row(r)).ref: a for r in c.execute(select(layer_acl))}
            wanted = sorted(set(refs))
            out: dict[str, AclRow] = {}
            for i in range(0, len(wanted), _CHUNK):
                for r in c.execute(_BY_REFS, {"refs": wanted[i:i + _CHUNK]}):
                    a = _row(r)
                    out[a.ref] = a
            return out

    def filter(self, principal: Principal, refs: Iterable[str]) -> set[str]:
        """Those of ``refs`` ``principal`` may see (one query; none for the cluster's admin)."""
        refs = set(refs)
        if principal.all_projects or not refs:
            return refs
        rows = self.rows(refs)
        return {ref for ref in refs if (a := rows.get(ref)) is None or may_see(principal, a.project, a.visibility)}

    def visible(self, principal: Principal, ref: str) -> bool:
        return ref in self.filter(principal, [ref])

    def set(self, ref: str, project: str, visibility: str, by_token_id: str) -> AclRow:
        """Give ``ref`` this owner and visibility (a row for a layer that had none), recorded
        as an IAM event in the same transaction. Who may is the caller's to check."""
        _check(visibility)
        try:
            with self._db.begin() as c:
                return self._set(c, ref, project, visibility, by_token_id)
        except IntegrityError:  # another replica inserted the row between our read and insert: update it
            with self._db.begin() as c:
                return self._set(c, ref, project, visibility, by_token_id)

    @staticmethod
    def _set(c: Connection, ref: str, project: str, visibility: str, by_token_id: str) -> AclRow:
        old = c.execute(select(layer_acl).where(layer_acl.c.ref == ref).with_for_update()).first()
        if old is None:
            row = AclRow(ref, project, visibility, by_token_id, time.time())
            c.execute(insert(layer_acl).values(ref=ref, project=project, visibility=visibility,
                                               created_by=by_token_id, created_at=row.created_at))
            was: dict[str, object] = {"visibility": "public", "project": None}
        else:
            before = _row(old)
            # the publisher and time stay: the event says who changed it
            row = AclRow(ref, project, visibility, before.created_by, before.created_at)
            c.execute(update(layer_acl).where(layer_acl.c.ref == ref).values(project=project, visibility=visibility))
            was = {"visibility": before.visibility, "project": before.project}
        record_event(c, by_token_id, "layer.visibility", ref, project,
                     {"visibility": visibility, "was": was})
        return row

    def claim(self, ref: str, project: str, visibility: str, by_token_id: str) -> AclRow:
        """The row of a layer about to be published (pack_diff), written before the layer
        exists so it is never visible without its row. Another project's recent claim (a
        publish still running) refuses this one; the same project's, or a stale one (see
        CLAIM_STALE_S), is replaced."""
        _check(visibility)
        row = AclRow(ref, project, visibility, by_token_id, time.time())
        values = dict(ref=ref, project=project, visibility=visibility, created_by=by_token_id,
                      created_at=row.created_at)
        with self._db.begin() as c:
            old = c.execute(select(layer_acl.c.created_at, layer_acl.c.project).where(layer_acl.c.ref == ref)
                            .with_for_update()).first()
            # the same project's claim is replaced: a retry after a crash mid-publish (the edge
            # keeps one content per name whatever the claims say); another's fresh one refuses
            if old is not None and old[1] != project and row.created_at - old[0] < CLAIM_STALE_S:
                raise InvalidRequest(f"layer {ref!r} is being published by another request; "
                                     "publish a new version", field="ref")
            try:
                if old is not None:
                    c.execute(delete(layer_acl).where(layer_acl.c.ref == ref))
                c.execute(insert(layer_acl).values(**values))
            except IntegrityError:  # a claim inserted concurrently (SQLite/PostgreSQL both): that one wins
                raise InvalidRequest(f"layer {ref!r} is being published by another request; "
                                     "publish a new version", field="ref") from None
        return row

    def release(self, claim: AclRow) -> None:
        """Drop a claim whose publish failed, unless another has replaced it since."""
        with self._db.begin() as c:
            c.execute(delete(layer_acl).where(and_(layer_acl.c.ref == claim.ref,
                                                   layer_acl.c.created_at == claim.created_at)))

    def drop(self, ref: str, row: AclRow | None = None) -> None:
        """The layer was removed: its row goes with it (``row``: only that row, not a claim
        another publish of the same name made since)."""
        cond = layer_acl.c.ref == ref
        if row is not None:
            cond = and_(cond, layer_acl.c.created_at == row.created_at)
        with self._db.begin() as c:
            c.execute(delete(layer_acl).where(cond))
