"""API tokens: stored as SHA-256 digests in the metadata database (SQLite embedded; PostgreSQL in cluster mode), each
with a project and a role; and the request-to-permission map the apiserver enforces."""

from __future__ import annotations

import asyncio
import builtins
import contextvars
import hashlib
import hmac
import json
import logging
import os
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass

from sqlalchemy import Connection, Engine, delete, insert, select
from sqlalchemy.exc import SQLAlchemyError

from dsec.control.iam.bound import ADMIN_TOKEN_ID, BoundKeys
from dsec.control.iam.quota import in_subtree
from dsec.shared.meta.schema import iam_events, projects, tokens
from dsec.shared.wire.iam import IamEvent, TokenInfo, TokenSpec, within

log = logging.getLogger("dsec.iam")

# what each role may do: "read" is cluster information (nodes, layers, storage);
# "sandbox:read" reading its sandboxes (not a terminal: that is "sandbox"); "iam" managing
# the projects, quotas and tokens of its subtree; "cluster" is the node's own token's alone
ROLE_PERMISSIONS: dict[str, frozenset[str]] = {
    "admin": frozenset({"read", "sandbox:read", "sandbox", "layers:write", "iam"}),
    "builder": frozenset({"read", "sandbox:read", "sandbox", "layers:write"}),
    "runner": frozenset({"read", "sandbox:read", "sandbox"}),
    "reader": frozenset({"read", "sandbox:read"}),
}


@dataclass(frozen=True)
class Principal:
    token_id: str
    project: str  # "*": every project (the cluster's admin)
    role: str
    expires_at: float | None = None

    def may(self, permission: str) -> bool:
        if self.all_projects and self.role == "admin":
            return True
        return permission in ROLE_PERMISSIONS.get(self.role, frozenset())

    @property
    def all_projects(self) -> bool:
        return self.project == "*"

    def administers(self, project: str) -> bool:
        """An admin of ``project`` or one of its ancestors (the cluster's admin: all)."""
        return self.role == "admin" and (self.all_projects or within(project, self.project))

    def covers(self, project: str | None) -> bool:
        """Whether it may see and act on ``project``'s things: its own project's; a subtree
        admin's, its subtree's. None (the platform's own sandboxes): the cluster's admin only."""
        if project is None:
            return self.all_projects
        return self.all_projects or project == self.project or self.administers(project)


ADMIN = Principal(ADMIN_TOKEN_ID, "*", "admin")


current_principal: contextvars.ContextVar[Principal] = contextvars.ContextVar("dsec_principal", default=ADMIN)


def acting_project(project: str | None) -> str:
    """The project a request acts in: its token's, or the one it names within what the
    token covers (the cluster admin's default: "default"). Naming another is refused."""
    from dsec.shared.errors import Forbidden
    p = current_principal.get()
    if project is None:
        return "default" if p.all_projects else p.project
    if not p.covers(project):
        raise Forbidden(f"a token of project {p.project!r} may not act in project {project!r}", field="project")
    return project


def project_scope(project: str | None) -> str | None:
    """The project a read is confined to: the one named (if the token covers it), else the
    token's own; the cluster admin's, all (None)."""
    p = current_principal.get()
    return project if p.all_projects else acting_project(project)


def record_event(c: Connection, actor: str, action: str, target: str, project: str | None,
                 detail: dict[str, object]) -> None:
    """One IAM change, in the transaction that makes it."""
    c.execute(insert(iam_events).values(at=time.time(), actor=actor, action=action, target=target, project=project,
                                        detail=json.dumps(detail)))


_SANDBOX_PREFIXES = ("/v1/sandboxes", "/v1/fork", "/v1/fncall", "/v1/jobs", "/v1/batches", "/v1/rollouts",
                     "/v1/projects")
# E2B's sandbox API answers every read with the sandbox's own envd and traffic tokens, which
# are enough to exec and write files: all of it is a write (its snapshots too: they are a team's)
_E2B_SANDBOXES = ("/sandboxes", "/v2/sandboxes", "/snapshots")


def permission_for(method: str, path: str, websocket: bool = False) -> str:
    """The permission a request needs."""
    if path.startswith(("/v1/tokens", "/v1/iam", "/v1/projects")):
        return "iam" if method not in ("GET", "HEAD") or path.startswith(("/v1/tokens", "/v1/iam")) \
            else "sandbox:read"
    writes = websocket or method not in ("GET", "HEAD") or "/ports/" in path  # a port's server may act on a GET
    if writes and (path.startswith("/v1/layers") or path.endswith(("/pack_diff", "/snapshots"))):
        return "layers:write"  # publishing: pack_diff, E2B's snapshots
    if path.startswith(("/v3/templates", "/v2/templates", "/templates")) and (writes or "/files/" in path):
        return "layers:write"  # E2B's template builds publish layers; a files URL is an upload's
    if writes and path.startswith("/v1/sandboxes/") and path.endswith(("/move", "/restore")):
        return "cluster"  # moving a sandbox between edges is the operator's
    if path.startswith("/v1/fleet"):
        return "cluster"  # the fleet's event log names operators' tokens and every project's sandboxes
    if path.startswith(_E2B_SANDBOXES):
        return "sandbox"
    if path.startswith(_SANDBOX_PREFIXES):
        return "sandbox" if writes else "sandbox:read"
    if path.startswith(_SANDBOX_PREFIXES):
        return "sandbox" if writes else "sandbox:read"
    if not writes:
        return "read"
    return "cluster"


class TokenStore:
    """Tokens in the metadata database (SQLite embedded, PostgreSQL in a cluster), and an
    in-memory map every request is checked against. Another replica's new token is
    looked up on its first use (misses are remembered for a second, so a flood of bad
    tokens costs one query per distinct token per second); revocations reach the other
    replicas within ``REFRESH_S`` (the revoking replica drops the token at once, and a
    reload that read the table before the revocation does not bring it back). Tokens are
    kept by digest (a bearer token's check) and by id (a bound credential's, dsec.control.iam.bound):
    both O(1) in memory."""

    REFRESH_S = 2.0  # credentials bound to a token end within this (+ a stream's re-check) of its revocation
    MISS_TTL_S = 1.0
    MAX_MISSES = 10_000
    REVOKED_KEEP_S = 60.0  # far longer than any reload takes

    def __init__(self, db: Engine, admin_token: str) -> None:
        self._admin = admin_token.encode()
        # the key bound credentials are signed with: the admin token's, never the token itself
        self._bound_key = hmac.new(self._admin, b"dsec.control.iam.bound", hashlib.sha256).digest()
        self._db = db
        self._lock = threading.Lock()
        # guards swapping and pruning the in-memory maps (a reload, a revocation); the per-request
        # reads take no lock: each map is replaced whole or changed by one key at a time
        self._table = threading.Lock()
        self._by_digest: dict[str, Principal] = {}
        self._by_id: dict[str, Principal] = {}
        self._misses: dict[str, float] = {}
        self._id_misses: dict[str, float] = {}
        self._revoked: dict[str, float] = {}  # token id -> when this replica dropped it (monotonic)
        self.bound = BoundKeys(self)  # the credentials derived from tokens (E2B's, SWE-ReX's, upload URLs)
        self._load()

    def _load(self) -> None:
        with self._db.connect() as c:
            rows = c.execute(select(tokens.c.id, tokens.c.digest, tokens.c.project, tokens.c.role,
                                    tokens.c.expires_at)).all()
        # under the table's lock, after the query: a revocation made while the query ran is
        # filtered out here, one made after it drops the token from the new maps
        with self._table:
            now = time.monotonic()
            self._revoked = {i: t for i, t in self._revoked.items() if now - t < self.REVOKED_KEEP_S}
            by_digest = {d: Principal(i, p, r, e) for i, d, p, r, e in rows if i not in self._revoked}
            self._by_id = {p.token_id: p for p in by_digest.values()}
            self._by_digest = by_digest
            self._id_misses = {}

    def _lookup(self, digest: str) -> Principal | None:
        with self._db.connect() as c:
            row = c.execute(select(tokens.c.id, tokens.c.project, tokens.c.role, tokens.c.expires_at)
                            .where(tokens.c.digest == digest)).first()
        return Principal(row[0], row[1], row[2], row[3]) if row else None

    async def verify(self, secret: bytes) -> Principal | None:
        """The token's principal; None for an unknown, revoked or expired one."""
        p = await self._verify(secret)
        if p is not None and p.expires_at is not None and p.expires_at <= time.time():
            return None
        return p

    async def _verify(self, secret: bytes) -> Principal | None:
        if hmac.compare_digest(secret, self._admin):
            return ADMIN
        digest = hashlib.sha256(secret).hexdigest()
        if (p := self._by_digest.get(digest)) is not None:
            return p
        now = time.monotonic()
        if now - self._misses.get(digest, -self.MISS_TTL_S) < self.MISS_TTL_S:
            return None
        p = await asyncio.to_thread(self._lookup, digest)
        with self._table:
            if p is not None and p.token_id in self._revoked:  # read before this replica's revocation committed
                p = None
            if p is None:
                if len(self._misses) >= self.MAX_MISSES:
                    self._misses.clear()
                self._misses[digest] = now
            else:
                self._by_digest[digest] = p
                self._by_id[p.token_id] = p
        return p

    async def principal(self, token_id: str) -> Principal | None:
        """The principal of a live token by its id (a console session names its token by
        id); None once it is revoked or expired."""
        if token_id == ADMIN.token_id:
            p: Principal | None = ADMIN
        elif token_id in self._revoked:
            return None
        else:
            p = self._by_id.get(token_id)
            if p is None:  # made on another replica since the last reload; misses remembered a while
                now = time.monotonic()
                if now - self._id_misses.get(token_id, -self.MISS_TTL_S) < self.MISS_TTL_S:
                    return None
                p = await asyncio.to_thread(self._lookup_id, token_id)
                with self._table:
                    if token_id in self._revoked:  # read before this replica's revocation committed
                        return None
                    if p is None:
                        if len(self._id_misses) >= self.MAX_MISSES:
                            self._id_misses.clear()
                        self._id_misses[token_id] = now
                    else:
                        self._by_id[token_id] = p
        if p is not None and p.expires_at is not None and p.expires_at <= time.time():
            return None
        return p

    async def live(self, token_id: str) -> bool:
        """Whether the token with this id is neither revoked nor expired (a bound
        credential's check: the in-memory table, a query only for a token not seen yet)."""
        return await self.principal(token_id) is not None

    @property
    def secret(self) -> bytes:
        """The key credentials bound to tokens are signed with (dsec.control.iam.bound)."""
        return self._bound_key

    def _lookup_id(self, token_id: str) -> Principal | None:
        with self._db.connect() as c:
            row = c.execute(select(tokens.c.id, tokens.c.project, tokens.c.role, tokens.c.expires_at)
                            .where(tokens.c.id == token_id)).first()
        return Principal(row[0], row[1], row[2], row[3]) if row else None

    async def refresh_forever(self) -> None:
        """Reload every token now and then (what other replicas revoked); a database that
        does not answer keeps the last map."""
        while True:
            await asyncio.sleep(self.REFRESH_S)
            try:
                await asyncio.to_thread(self._load)
            except SQLAlchemyError as e:
                log.warning("tokens not refreshed: %s", e)

    @property
    def db(self) -> Engine:
        """The metadata database the tokens are in (other catalogs share it)."""
        return self._db

    def derive(self, purpose: str, value: str) -> str:
        """A secret bound to ``value`` (a console session's signature), derived from the
        cluster's admin token: verifiable later, on any replica, without storing it. Not for
        credentials a token hands out: those die with it (dsec.control.iam.bound)."""
        return hmac.new(self._admin, f"{purpose}\0{value}".encode(), hashlib.sha256).hexdigest()[:40]

    def create(self, spec: TokenSpec, by: Principal = ADMIN) -> TokenInfo:
        """A new token, recorded with who made it (``by``) in the IAM events. ``by`` must
        administer the project (a subtree admin: its own or a sub-project), and a project
        below the top level must exist."""
        from dsec.shared.errors import Forbidden, NotFound
        if not by.administers(spec.project):
            raise Forbidden(f"a token administering {by.project!r} may not make tokens of project {spec.project!r}",
                            field="project")
        secret = "dsec_" + secrets.token_urlsafe(32)
        digest = hashlib.sha256(secret.encode()).hexdigest()
        now = time.time()
        expires = now + spec.ttl_s if spec.ttl_s is not None else None
        if by.expires_at is not None:  # a token never outlives the one that made it
            expires = min(expires or by.expires_at, by.expires_at)
        info = TokenInfo(id=digest[:12], project=spec.project, role=spec.role, name=spec.name, created_at=now,
                         expires_at=expires, created_by=by.token_id)
        with self._lock, self._db.begin() as c:
            if "/" in spec.project and c.execute(select(projects.c.name).where(projects.c.name == spec.project)) \
                    .first() is None:
                raise NotFound(f"no project {spec.project!r}: create it first", field="project")
            c.execute(insert(tokens).values(id=info.id, digest=digest, project=info.project, role=info.role,
                                            name=info.name, created_at=now, expires_at=info.expires_at,
                                            created_by=by.token_id))
            record_event(c, by.token_id, "token.create", info.id, info.project,
                         {"role": info.role, "name": info.name, "expires_at": info.expires_at})
        p = Principal(info.id, info.project, info.role, info.expires_at)
        with self._table:
            self._by_digest[digest] = p
            self._by_id[info.id] = p
            self._id_misses.pop(info.id, None)
        return info.model_copy(update={"token": secret})

    def list(self, by: Principal = ADMIN) -> builtins.list[TokenInfo]:
        """The tokens of the projects ``by`` administers."""
        q = select(tokens.c.id, tokens.c.project, tokens.c.role, tokens.c.name, tokens.c.created_at,
                   tokens.c.expires_at, tokens.c.created_by).order_by(tokens.c.created_at)
        if not by.all_projects:
            q = q.where(in_subtree(tokens.c.project, by.project))
        with self._db.connect() as c:
            rows = c.execute(q).all()
        return [TokenInfo(id=i, project=p, role=r, name=n, created_at=t, expires_at=e, created_by=b)
                for i, p, r, n, t, e, b in rows]

    def revoke(self, token_id: str, by: Principal = ADMIN) -> bool:
        """False when there is no such token among those ``by`` administers."""
        with self._lock, self._db.begin() as c:
            project = c.execute(select(tokens.c.project).where(tokens.c.id == token_id)).scalar()
            if project is None or not by.administers(project):
                return False
            c.execute(delete(tokens).where(tokens.c.id == token_id))
            record_event(c, by.token_id, "token.revoke", token_id, project, {})
        self.forget([token_id])
        return True

    def forget(self, token_ids: builtins.list[str]) -> None:
        """Tokens revoked (here or with their project): refused from now on, on this replica."""
        gone = set(token_ids)
        with self._table:
            now = time.monotonic()
            for i in gone:
                self._revoked[i] = now
                self._by_id.pop(i, None)
            self._by_digest = {d: p for d, p in self._by_digest.items() if p.token_id not in gone}

    def events(self, after: int = 0, limit: int = 1000, by: Principal = ADMIN) -> builtins.list[IamEvent]:
        """IAM changes after event ``after``, oldest first: those of the projects ``by`` administers."""
        q = select(iam_events).where(iam_events.c.id > after)
        if not by.all_projects:
            q = q.where(in_subtree(iam_events.c.project, by.project))
        with self._db.connect() as c:
            rows = c.execute(q.order_by(iam_events.c.id).limit(limit)).mappings().all()
        return [IamEvent(id=r["id"], at=r["at"], actor=r["actor"], action=r["action"], target=r["target"],
                         project=r["project"], detail=json.loads(r["detail"] or "{}")) for r in rows]

    def import_sqlite(self, path: str) -> int:
        """Tokens of an older data dir (iam.db, before the metadata database), once."""
        if not os.path.exists(path):
            return 0
        old = sqlite3.connect(path)
        try:
            rows = old.execute("SELECT id, digest, project, role, name, created_at FROM tokens").fetchall()
        except sqlite3.Error:
            rows = []
        finally:
            old.close()
        with self._lock, self._db.begin() as c:
            have = set(c.execute(select(tokens.c.digest)).scalars())
            new = [dict(zip(("id", "digest", "project", "role", "name", "created_at"), r, strict=True))
                   for r in rows if r[1] not in have]
            if new:
                c.execute(insert(tokens), new)
        os.rename(path, path + ".imported")
        self._load()
        return len(new)
