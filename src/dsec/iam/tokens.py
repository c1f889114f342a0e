"""API tokens: stored as SHA-256 digests (SQLite here; PostgreSQL in cluster mode), each
with a project and a role; and the request-to-permission map the apiserver enforces."""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass
from typing import Literal

from dsec.wire.iam import TokenInfo, TokenSpec

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

    def may(self, permission: str) -> bool:
        return permission in ROLE_PERMISSIONS.get(self.role, frozenset())

    @property
    def all_projects(self) -> bool:
        return self.project == "*"


ADMIN = Principal("admin", "*", "admin")
current_principal: contextvars.ContextVar[Principal] = contextvars.ContextVar("dsec_principal", default=ADMIN)


def permission_for(method: str, path: str) -> str:
    """The permission a request needs."""
    if path.startswith("/v1/tokens"):
        return "admin"
    writes = method not in ("GET", "HEAD")
    if writes and (path.startswith("/v1/layers") or path.endswith("/pack_diff")):
        return "layers:write"
    if path.startswith(("/v1/sandboxes", "/v1/fork", "/v1/fncall")):
        return "sandbox"
    if not writes:
        return "read"
    return "admin"


class TokenStore:
    def __init__(self, path: str, admin_token: str) -> None:
        self._admin = admin_token.encode()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("CREATE TABLE IF NOT EXISTS tokens (id TEXT PRIMARY KEY, digest TEXT UNIQUE NOT NULL,"
                         " project TEXT NOT NULL, role TEXT NOT NULL, name TEXT NOT NULL, created_at REAL NOT NULL)")
        self._lock = threading.Lock()
        self._by_digest: dict[str, Principal] = {}
        self._load()

    def _load(self) -> None:
        rows = self._db.execute("SELECT id, digest, project, role FROM tokens").fetchall()
        self._by_digest = {d: Principal(i, p, r) for i, d, p, r in rows}

    def verify(self, secret: bytes) -> Principal | None:
        if hmac.compare_digest(secret, self._admin):
            return ADMIN
        return self._by_digest.get(hashlib.sha256(secret).hexdigest())

    def derive(self, purpose: str, value: str) -> str:
        """A secret bound to ``value`` (say, one sandbox's envd access token), derived from
        the node's own token: verifiable later without storing it."""
        return hmac.new(self._admin, f"{purpose}\0{value}".encode(), hashlib.sha256).hexdigest()[:40]

    def create(self, spec: TokenSpec) -> TokenInfo:
        secret = "dsec_" + secrets.token_urlsafe(32)
        digest = hashlib.sha256(secret.encode()).hexdigest()
        info = TokenInfo(id=digest[:12], project=spec.project, role=spec.role, name=spec.name,
                         created_at=time.time())
        with self._lock:
            self._db.execute("INSERT INTO tokens VALUES (?,?,?,?,?,?)",
                             (info.id, digest, info.project, info.role, info.name, info.created_at))
            self._load()
        return info.model_copy(update={"token": secret})

    def list(self) -> list[TokenInfo]:
        rows = self._db.execute("SELECT id, project, role, name, created_at FROM tokens ORDER BY created_at")
        return [TokenInfo(id=i, project=p, role=r, name=n, created_at=c) for i, p, r, n, c in rows]

    def revoke(self, token_id: str) -> bool:
        with self._lock:
            n = self._db.execute("DELETE FROM tokens WHERE id=?", (token_id,)).rowcount
            self._load()
        return n > 0
