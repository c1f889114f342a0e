"""Authentication and authorization, in one place: every request but the open ones
carries a bearer token (or, for E2B's envd and signed file URLs, the sandbox's own
credential); the token's role must allow the route, and a project token sees only its
project's sandboxes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi.responses import JSONResponse
from sqlalchemy.exc import SQLAlchemyError

from dsec.control.apiserver.core import Apiserver, error_response
from dsec.control.console import session
from dsec.control.iam import current_principal, permission_for, project_of_sandbox
from dsec.control.iam.bound import ENVD, TEMPLATE_FILES, token_of
from dsec.control.iam.tokens import Principal
from dsec.faces.e2b.envd import ENVD_PATHS, ENVD_PREFIXES, signed_file_sandbox
from dsec.faces.e2b.templates_api import FILES_PATH, upload_claim
from dsec.shared.errors import (
    DsecError,
    Forbidden,
    InvalidRequest,
    NotFound,
    Unauthorized,
)
from dsec.shared.meta.db import unavailable
from dsec.shared.wire.models import (
    SandboxState,
)

# what a console session may reach: the routes its pages read and act on. Never a sandbox's
# own ports (a page a sandbox serves there would be same-origin with the console), never
# tokens or the cluster's administration: those need the token itself.
COOKIE_PATHS = ("/v1/console/", "/v1/sandboxes", "/v1/jobs", "/v1/batches", "/v1/rollouts", "/v1/projects")
# a sandbox's own routes, dsec's and E2B's: a project's token reaches its project's sandboxes only
_SANDBOX_PATH = re.compile(r"^(?:/v1|/v2)?/sandboxes/([^/]+-[^/]+)(?:/|$)")
# a long-lived connection (a TTY, a streamed exec, a watch) asks again this often whether
# its token or session still stands, and ends when it does not
RECHECK_S = 2.0
log = logging.getLogger("dsec.apiserver")

Recheck = Callable[[], Awaitable[bool]]


class BearerAuth:
    """ASGI middleware: every route but the open ones needs ``Bearer <token>``.

    A middleware rather than a per-route dependency keeps it off FastAPI's dependency
    solver on the hot exec path, and covers websockets the same way (a refused
    websocket is accepted, then closed with code 4401 so the client learns why)."""

    OPEN = frozenset({"/healthz", "/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect"})
    OPEN_PREFIX = "/ui/"  # the console's page and files; its session route checks the token itself

    def __init__(self, app: Any, api: Apiserver) -> None:
        self.app = app
        self.api = api

    async def _refusal(self, scope: dict[str, Any]) -> DsecError | None:
        """Why the request is refused (None: it may go on). A request made with a token or a
        session leaves, in ``scope["dsec.recheck"]``, how to ask again whether it still stands."""
        if scope["type"] not in ("http", "websocket") or scope["path"] in self.OPEN or \
                scope["path"] == "/ui" or scope["path"].startswith(self.OPEN_PREFIX):
            return None
        headers = dict(scope["headers"])
        keys = self.api.tokens.bound
        if scope["path"] == "/files" and b"signature=" in scope.get("query_string", b""):
            return await self._signed_file(scope, headers)
        if scope["path"].startswith(FILES_PATH):  # a build context upload: signed for its files hash
            claim = upload_claim(scope["path"], scope.get("query_string", b""))
            if claim is not None and await keys.check(TEMPLATE_FILES, *claim) is not None:
                return None
            return Unauthorized("missing, wrong or revoked signature on this upload URL", field="signature")
        if scope["path"].startswith(ENVD_PREFIXES) or scope["path"] in ENVD_PATHS:  # E2B's envd: per-sandbox token
            sid = headers.get(b"e2b-sandbox-id", b"").decode(errors="replace")
            given = headers.get(b"x-access-token", b"").decode(errors="replace")
            token_id = await keys.check(ENVD, sid, given) if sid and given else None
            if token_id is None:
                return Unauthorized("missing, wrong or revoked X-Access-Token for this sandbox",
                                    field="x-access-token")
            scope["dsec.recheck"] = self._bound_recheck(token_id)  # a stream ends with its token
            return None
        header = headers.get(b"authorization", b"")
        if not header and b"x-api-key" in headers:  # E2B's SDKs send their key this way
            header = b"Bearer " + headers[b"x-api-key"]
        principal: Principal | None
        if not header and b"cookie" in headers and scope["path"].startswith(COOKIE_PATHS) \
                and "/ports/" not in scope["path"]:
            session_of = await self._session(scope, headers)
            if isinstance(session_of, DsecError):
                return session_of
            principal = session_of
            cookie = headers[b"cookie"]

            async def recheck() -> bool:
                return await session.principal_of(self.api.tokens, self.api.sessions, cookie) is not None
        else:
            scheme, _, cred = header.partition(b" ")
            if scheme.lower() != b"bearer" or not cred.strip():
                return Unauthorized("missing or malformed Authorization header; expected 'Bearer <token>'",
                                    field="authorization")
            principal = await self.api.tokens.verify(cred.strip())
            if principal is None:
                return Unauthorized("invalid token", field="authorization")
            secret = cred.strip()

            async def recheck() -> bool:
                return await self.api.tokens.verify(secret) is not None
        scope["dsec.recheck"] = recheck
        method = scope.get("method", "GET")
        need = permission_for(method, scope["path"], websocket=scope["type"] == "websocket")
        if not principal.may(need):
            return Forbidden(f"a {principal.role} token may not {method} {scope['path']} (needs {need!r})",
                             field="authorization")
        current_principal.set(principal)
        if not principal.all_projects and (m := _SANDBOX_PATH.match(scope["path"])):
            try:
                info = await self.api.edge_for(m.group(1)).get(m.group(1))
            except (NotFound, InvalidRequest) as e:
                if e.field == "sandbox_id":
                    return None  # a bad or unknown id is the route's to report
                return e
            except DsecError as e:  # the edge cannot say whose it is: refuse (never fail open)
                return e
            if not principal.covers(project_of_sandbox(info)):
                return NotFound(f"no sandbox {m.group(1)!r} in project {principal.project!r}", field="sandbox_id")
        return None

    async def _session(self, scope: dict[str, Any], headers: dict[bytes, bytes]) -> Principal | DsecError:
        """The web console's session cookie (dsec.control.console.session) in place of a bearer
        token: a change needs the console's header too, and a websocket a same-origin page."""
        principal = await session.principal_of(self.api.tokens, self.api.sessions, headers[b"cookie"])
        if principal is None:
            return Unauthorized("no valid session: log in again, or send 'Authorization: Bearer <token>'",
                                field="authorization")
        if scope["type"] == "websocket":
            origin = headers.get(b"origin", b"").decode(errors="replace")
            if origin and urllib.parse.urlsplit(origin).netloc != headers.get(b"host", b"").decode(errors="replace"):
                return Forbidden("a session's websocket must come from the console's own origin", field="origin")
        elif scope.get("method", "GET") not in ("GET", "HEAD") and session.CSRF_HEADER not in headers:
            return Forbidden(f"a request with a session cookie must send the {session.CSRF_HEADER.decode()} header",
                             field=session.CSRF_HEADER.decode())
        return principal

    def _bound_recheck(self, token_id: str) -> Recheck:
        async def recheck() -> bool:
            return await self.api.tokens.live(token_id)
        return recheck

    async def _signed_file(self, scope: dict[str, Any], headers: dict[bytes, bytes]) -> DsecError | None:
        """An E2B signed file URL: the signature is the credential, and names the sandbox. It
        is made with the sandbox's envd access token, so it ends with that token's token."""
        query = dict(urllib.parse.parse_qsl(scope["query_string"].decode(errors="replace")))
        named = headers.get(b"e2b-sandbox-id", b"").decode(errors="replace")
        # the signature is a hash over the envd token, which names no token: the sandbox's
        # label does (its edge's answer; a signed URL is not a hot path)
        if named:
            try:
                infos = [await self.api.edge_for(named).get(named)]
            except (NotFound, InvalidRequest):
                return Unauthorized("invalid signature", field="signature")
            except DsecError as e:  # its edge cannot say whose it is: refuse (never fail open)
                return e
        else:
            infos = [i for i in await self.api.list(None, {}) if i.state == SandboxState.running]
        token_of_sandbox = {i.sandbox_id: token_of(i) for i in infos}
        keys = self.api.tokens.bound
        try:
            sid = signed_file_sandbox(query, scope.get("method", "GET"), list(token_of_sandbox),
                                      lambda s: keys.mint(ENVD, s, token_of_sandbox[s]))
        except ValueError as e:
            return Unauthorized(str(e), field="signature")
        if not await self.api.tokens.live(token_of_sandbox[sid]):
            return Unauthorized("this URL's sandbox credentials were revoked with the token that made it",
                                field="signature")
        scope["dsec.recheck"] = self._bound_recheck(token_of_sandbox[sid])  # a long download ends with it
        scope["headers"] = [h for h in scope["headers"] if h[0] != b"e2b-sandbox-id"] + \
            [(b"e2b-sandbox-id", sid.encode())]
        return None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        try:
            err = await self._refusal(scope)
        except SQLAlchemyError as e:  # a token not seen before, looked up while the database is away
            err = unavailable(e)
            if err is None:
                raise
        if err is None:
            recheck = scope.pop("dsec.recheck", None)
            if recheck is None:
                await self.app(scope, receive, send)
            else:
                await while_valid(self.app, scope, receive, send, recheck)
        elif scope["type"] == "http" and (scope["path"] in ENVD_PATHS or scope["path"].startswith(ENVD_PREFIXES)):
            await JSONResponse({"code": err.status, "message": err.message}, status_code=err.status)(
                scope, receive, send)  # envd's own error shape
        elif scope["type"] == "http":
            await error_response(err)(scope, receive, send)
        else:
            await receive()  # websocket.connect
            await send({"type": "websocket.accept"})
            await send({"type": "websocket.close", "code": 4401, "reason": err.message[:120]})


async def while_valid(app: Any, scope: dict[str, Any], receive: Any, send: Any, recheck: Recheck) -> None:
    """Run the request; once it turns long-lived (a websocket, or a response that streams),
    ask every RECHECK_S whether its credential still stands, and end it when it does not:
    a websocket is closed with 4401, a streamed response ends there. A plain request is
    served with no watch at all (the check at its start is the one that counts)."""
    task = asyncio.current_task()
    assert task is not None
    revoked = False
    watch: asyncio.Task[None] | None = None

    async def watchdog() -> None:
        nonlocal revoked
        while True:
            await asyncio.sleep(RECHECK_S)
            try:
                ok = await recheck()
            except Exception:  # the token store cannot say: the connection goes on, asked again soon
                log.debug("re-check of a long-lived connection failed", exc_info=True)
                continue
            if not ok:
                revoked = True
                task.cancel()
                return

    def arm() -> None:
        nonlocal watch
        if watch is None:
            watch = asyncio.create_task(watchdog())

    async def watched_send(msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.body" and msg.get("more_body"):
            arm()
        await send(msg)

    if scope["type"] == "websocket":
        arm()
    try:
        await app(scope, receive, watched_send)
    except asyncio.CancelledError:
        if not revoked:
            raise
    finally:
        if watch is not None:
            watch.cancel()
    if revoked:
        if task.cancelling():
            task.uncancel()
        log.info("ended a %s on %s: its token or session was revoked or expired", scope["type"], scope["path"])
        with contextlib.suppress(Exception):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 4401, "reason": "token revoked or expired"})
            else:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
