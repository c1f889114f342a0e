"""Browser sessions: a token given once at the console's login becomes an HttpOnly,
SameSite=Strict cookie that names the token by id, when it was issued, its expiry and a
random session id, signed with a key derived from the cluster's secret (any replica
verifies it). The token itself never goes into the cookie.

A session ends when it expires, when its token is revoked or expires, at logout (its id
is recorded as ended, in the metadata database, until it would have expired), or when an
operator ends every session of a token (``DELETE /v1/console/sessions?token_id=``)."""

from __future__ import annotations

import asyncio
import hmac
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Protocol

from sqlalchemy import Engine, delete, select
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from dsec.control.iam.tokens import Principal
from dsec.shared.meta.schema import console_revocations

COOKIE = "dsec_session"
SESSION_S = int(os.environ.get("DSEC_CONSOLE_SESSION_S", str(12 * 3600)))
# a request carrying only the cookie must also carry this header to change anything: a
# page of another site cannot set it without a CORS preflight, which dsec never grants
CSRF_HEADER = b"x-dsec-console"
REFRESH_S = 5.0  # another replica's logouts are seen within this
_VALUE = re.compile(r"^v2\.([A-Za-z0-9_-]{1,64})\.(\d{1,15})\.(\d{1,12})\.([A-Za-z0-9_-]{16,64})\.([0-9a-f]{40})$")


class Keys(Protocol):
    def derive(self, purpose: str, value: str) -> str: ...
    async def principal(self, token_id: str) -> Principal | None: ...


@dataclass(frozen=True)
class Session:
    token_id: str
    issued_ms: int  # milliseconds: a login right after its token's sessions were ended is not one of them
    expires_at: int
    nonce: str


class Revocations:
    """Ended sessions, read from the database at most every REFRESH_S (this replica's own
    logouts count at once)."""

    def __init__(self, db: Engine) -> None:
        self.db = db
        self._cuts: dict[str, float] = {}
        self._loaded = 0.0
        self._lock = threading.Lock()

    def _load(self) -> None:
        now = time.time()
        with self.db.begin() as c:
            c.execute(delete(console_revocations).where(console_revocations.c.until < now))
            rows = c.execute(select(console_revocations.c.key, console_revocations.c.cut)).all()
        with self._lock:
            self._cuts = {k: cut for k, cut in rows}
            self._loaded = time.monotonic()

    async def ended(self, s: Session) -> bool:
        if time.monotonic() - self._loaded > REFRESH_S:
            try:
                await asyncio.to_thread(self._load)
            except SQLAlchemyError:  # the database is away: the last list stands
                pass
        cuts = self._cuts
        return f"s:{s.nonce}" in cuts or s.issued_ms < cuts.get(f"t:{s.token_id}", float("-inf"))

    def _put(self, key: str, cut: float, until: float) -> None:
        with self.db.begin() as c:
            c.execute(delete(console_revocations).where(console_revocations.c.key == key))
            try:
                c.execute(console_revocations.insert().values(key=key, cut=cut, until=until))
            except IntegrityError:  # another replica wrote it meanwhile: same effect
                pass
        with self._lock:
            self._cuts = {**self._cuts, key: cut}

    async def end(self, s: Session) -> None:
        await asyncio.to_thread(self._put, f"s:{s.nonce}", s.issued_ms, s.expires_at + 60)

    async def end_all(self, token_id: str) -> None:
        """Every session of ``token_id`` issued until now (logged in before this moment)."""
        now = time.time()
        await asyncio.to_thread(self._put, f"t:{token_id}", int(now * 1000) + 1, now + SESSION_S + 60)


def issue(keys: Keys, principal: Principal, now: float | None = None) -> tuple[str, Session]:
    """The cookie value for a new session of ``principal`` (never longer than its token lives)."""
    now = time.time() if now is None else now
    expires = now + SESSION_S
    if principal.expires_at is not None:
        expires = min(expires, principal.expires_at)
    s = Session(principal.token_id, int(now * 1000), int(expires), secrets.token_urlsafe(18))
    payload = f"{s.token_id}.{s.issued_ms}.{s.expires_at}.{s.nonce}"
    return f"v2.{payload}.{keys.derive('console-session', payload)}", s


def parse(keys: Keys, value: str, now: float | None = None) -> Session | None:
    """The session a cookie value names, if it is well formed, signed, and not expired."""
    m = _VALUE.match(value)
    if m is None:
        return None
    token_id, issued, expires, nonce, sig = m.groups()
    payload = f"{token_id}.{issued}.{expires}.{nonce}"
    if not hmac.compare_digest(sig.encode(), keys.derive("console-session", payload).encode()):
        return None
    if int(expires) <= (time.time() if now is None else now):
        return None
    return Session(token_id, int(issued), int(expires), nonce)


def session_of(keys: Keys, cookie_header: bytes) -> Session | None:
    """The one session a Cookie header carries; None for none, a bad one, or several (a
    second dsec_session, however it got there, is never guessed between)."""
    found = []
    for part in cookie_header.decode("latin-1").split(";"):
        name, _, value = part.strip().partition("=")
        if name == COOKIE:
            found.append(value)
    if len(found) != 1:
        return None
    return parse(keys, found[0])


async def principal_of(keys: Keys, revocations: Revocations | None, cookie_header: bytes) -> Principal | None:
    """The principal of the session in a Cookie header (None: no valid, live session)."""
    s = session_of(keys, cookie_header)
    if s is None or (revocations is not None and await revocations.ended(s)):
        return None
    return await keys.principal(s.token_id)


def without_session(cookie: str) -> str:
    """A Cookie header less the console's session (what a sandbox's server may see)."""
    return "; ".join(p.strip() for p in cookie.split(";") if p.strip().partition("=")[0] != COOKIE)


def cookie_header(value: str, max_age: int, secure: bool) -> str:
    flags = "; Secure" if secure else ""
    return f"{COOKIE}={value}; Path=/; Max-Age={max_age}; HttpOnly; SameSite=Strict{flags}"
