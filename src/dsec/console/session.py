"""Browser sessions: a token given once at the console's login becomes an HttpOnly,
SameSite=Strict cookie that names the token by id, with an expiry, signed with a key
derived from the cluster's secret (any replica verifies it; nothing is stored). The
session ends when it expires, at logout (the cookie is cleared), or when its token is
revoked or expires. The token itself never goes into the cookie."""

from __future__ import annotations

import hmac
import os
import time
from dataclasses import dataclass
from typing import Protocol

from dsec.iam.tokens import Principal

COOKIE = "dsec_session"
SESSION_S = int(os.environ.get("DSEC_CONSOLE_SESSION_S", str(12 * 3600)))
# a request carrying only the cookie must also carry this header to change anything: a
# page of another site cannot set it without a CORS preflight, which dsec never grants
CSRF_HEADER = b"x-dsec-console"


class Keys(Protocol):
    def derive(self, purpose: str, value: str) -> str: ...
    async def principal(self, token_id: str) -> Principal | None: ...


@dataclass(frozen=True)
class Session:
    token_id: str
    expires_at: float


def issue(keys: Keys, principal: Principal, now: float | None = None) -> tuple[str, Session]:
    """The cookie value for a session of ``principal`` (never longer than its token lives)."""
    now = time.time() if now is None else now
    expires = now + SESSION_S
    if principal.expires_at is not None:
        expires = min(expires, principal.expires_at)
    payload = f"{principal.token_id}.{int(expires)}"
    return f"v1.{payload}.{keys.derive('console-session', payload)}", Session(principal.token_id, int(expires))


def parse(keys: Keys, value: str, now: float | None = None) -> Session | None:
    """The session a cookie value names, if its signature holds and it has not expired."""
    parts = value.split(".")
    if len(parts) != 4 or parts[0] != "v1" or not parts[2].isdigit():
        return None
    payload = f"{parts[1]}.{parts[2]}"
    if not hmac.compare_digest(parts[3], keys.derive("console-session", payload)):
        return None
    if int(parts[2]) <= (time.time() if now is None else now):
        return None
    return Session(parts[1], int(parts[2]))


async def principal_of(keys: Keys, cookie_header: bytes) -> Principal | None:
    """The principal of the session in a Cookie header (None: no valid session)."""
    for part in cookie_header.decode(errors="replace").split(";"):
        name, _, value = part.strip().partition("=")
        if name == COOKIE and (s := parse(keys, value)) is not None:
            return await keys.principal(s.token_id)
    return None


def cookie_header(value: str, max_age: int, secure: bool) -> str:
    flags = "; Secure" if secure else ""
    return f"{COOKIE}={value}; Path=/; Max-Age={max_age}; HttpOnly; SameSite=Strict{flags}"
