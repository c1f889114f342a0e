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
from typing import Literal

from sqlalchemy import Connection, Engine, delete, insert, select
from sqlalchemy.exc import SQLAlchemyError

from dsec.meta.schema import iam_events, tokens
from dsec.wire.iam import IamEvent, TokenInfo, TokenSpec

log = logging.getLogger("dsec.iam")

Role = Literal["admin", "builder", "runner"]
PROJECT_LABEL = "dsec.project"

# what each role may do; "read" is cluster information (nodes, layers, storage)
ROLE_PERMISSIONS: dict[str, frozenset[str]] = {
    "admin": frozenset({"read", "sandbox", "layers:write", "admin"}),
    "builder": frozenset({"read", "sandbox", "layers:write"}),
    "runner": frozenset({"read", "sandbox"}),
}


@dataclass(frozen=True)
class Principal:
    token_id: str
    project: str  # "*": every project (admin)
    role: str
    expires_at: float | None = None

    def may(self, permission: str) -> bool:
        return permission in ROLE_PERMISSIONS.get(self.role, frozenset())

    @property
    def all_projects(self) -> bool:
        return self.project == "*"


ADMIN = Principal("admin", "*", "admin")
current_principal: contextvars.ContextVar[Principal] = contextvars.ContextVar("dsec_principal", default=ADMIN)


def acting_project(project: str | None) -> str:
    """The project a request acts in: its token's, or for an admin token the one it names
    (default "default"). A project token naming another project is refused."""
    from dsec.errors import Forbidden
    p = current_principal.get()
    if p.all_projects:
        return project or "default"
    if project is not None and project != p.project:
        raise Forbidden(f"a token of project {p.project!r} may not act in project {project!r}", field="project")
    return p.project


def project_scope(project: str | None) -> str | None:
    """The project a read is confined to: the token's; an admin token's, the one named or all (None)."""
    return project if current_principal.get().all_projects else acting_project(project)


def _event(c: Connection, actor: str, action: str, target: str, detail: dict[str, object]) -> None:
    c.execute(insert(iam_events).values(at=time.time(), actor=actor, action=action, target=target,
                                        detail=json.dumps(detail)))


def permission_for(method: str, path: str) -> str:
    """The permission a request needs."""
    if path.startswith(("/v1/tokens", "/v1/iam")):
        return "admin"
    writes = method not in ("GET", "HEAD")
    if writes and (path.startswith("/v1/layers") or path.endswith("/pack_diff")):
        return "layers:write"
    if writes and path.startswith(("/v3/templates", "/v2/templates", "/templates")):
        return "layers:write"  # E2B's template builds publish layers
    if path.startswith(("/v1/sandboxes", "/v1/fork", "/v1/fncall", "/v1/jobs", "/v1/batches", "/v1/rollouts",
                        "/sandboxes",
                        "/v2/sandboxes")):
        return "sandbox"
    if not writes:
        return "read"
    return "admin"


class TokenStore:
    """Tokens in the metadata database (SQLite embedded, PostgreSQL in a cluster), and an
    in-memory map every request is checked against. Another replica's new token is
    looked up on its first use (misses are remembered for a second, so a flood of bad
    tokens costs one query per distinct token per second); revocations reach the other
    replicas within ``REFRESH_S`` (the revoking replica drops the token at once)."""

    REFRESH_S = 5.0
    MISS_TTL_S = 1.0
    MAX_MISSES = 10_000

    def __init__(self, db: Engine, admin_token: str) -> None:
        self._admin = admin_token.encode()
        self._db = db
        self._lock = threading.Lock()
        self._by_digest: dict[str, Principal] = {}
        self._misses: dict[str, float] = {}
        self._load()

    def _load(self) -> None:
        with self._db.connect() as c:
            rows = c.execute(select(tokens.c.id, tokens.c.digest, tokens.c.project, tokens.c.role,
                                    tokens.c.expires_at)).all()
        self._by_digest = {d: Principal(i, p, r, e) for i, d, p, r, e in rows}

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
        if p is None:
            if len(self._misses) >= self.MAX_MISSES:
                self._misses.clear()
            self._misses[digest] = now
        else:
            self._by_digest[digest] = p
        return p

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
        """A secret bound to ``value`` (say, one sandbox's envd access token), derived from
        the cluster's admin token: verifiable later, on any replica, without storing it."""
        return hmac.new(self._admin, f"{purpose}\0{value}".encode(), hashlib.sha256).hexdigest()[:40]

    def create(self, spec: TokenSpec, actor: str = "admin") -> TokenInfo:
        """A new token, recorded with who made it (``actor``, a token id) in the IAM events."""
        secret = "dsec_" + secrets.token_urlsafe(32)
        digest = hashlib.sha256(secret.encode()).hexdigest()
        now = time.time()
        info = TokenInfo(id=digest[:12], project=spec.project, role=spec.role, name=spec.name, created_at=now,
                         expires_at=now + spec.ttl_s if spec.ttl_s is not None else None, created_by=actor)
        with self._lock, self._db.begin() as c:
            c.execute(insert(tokens).values(id=info.id, digest=digest, project=info.project, role=info.role,
                                            name=info.name, created_at=now, expires_at=info.expires_at,
                                            created_by=actor))
            _event(c, actor, "token.create", info.id, {"project": info.project, "role": info.role,
                                                       "name": info.name, "expires_at": info.expires_at})
        self._by_digest[digest] = Principal(info.id, info.project, info.role, info.expires_at)
        return info.model_copy(update={"token": secret})

    def list(self) -> list[TokenInfo]:
        with self._db.connect() as c:
            rows = c.execute(select(tokens.c.id, tokens.c.project, tokens.c.role, tokens.c.name,
                                    tokens.c.created_at, tokens.c.expires_at, tokens.c.created_by)
                             .order_by(tokens.c.created_at)).all()
        return [TokenInfo(id=i, project=p, role=r, name=n, created_at=t, expires_at=e, created_by=b)
                for i, p, r, n, t, e, b in rows]

    def revoke(self, token_id: str, actor: str = "admin") -> bool:
        with self._lock, self._db.begin() as c:
            n = c.execute(delete(tokens).where(tokens.c.id == token_id)).rowcount
            if n:
                _event(c, actor, "token.revoke", token_id, {})
        self._by_digest = {d: p for d, p in self._by_digest.items() if p.token_id != token_id}
        return n > 0

    def events(self, after: int = 0, limit: int = 1000) -> builtins.list[IamEvent]:
        """IAM changes after event ``after``, oldest first."""
        with self._db.connect() as c:
            rows = c.execute(select(iam_events).where(iam_events.c.id > after).order_by(iam_events.c.id)
                             .limit(limit)).mappings().all()
        return [IamEvent(id=r["id"], at=r["at"], actor=r["actor"], action=r["action"], target=r["target"],
                         detail=json.loads(r["detail"] or "{}")) for r in rows]

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
