"""The console's page and files under ``/ui/`` (open: the page holds no data; everything
it shows comes from the API with the session's rights), and its session routes: log in
with a token (a cookie comes back), who am I, log out. The browser libraries are served
from the npm packages ``scripts/setup.sh`` installs next to this module (or from
``$DSEC_CONSOLE_VENDOR``): nothing is fetched from a CDN."""

from __future__ import annotations

import os
import time

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response
from pydantic import BaseModel, Field

from dsec.control.console import session
from dsec.control.iam.tokens import TokenStore
from dsec.shared.errors import Forbidden, NotFound, Unauthorized

HERE = os.path.dirname(os.path.abspath(__file__))
STATIC = os.path.join(HERE, "static")
VENDOR_DIR = os.environ.get("DSEC_CONSOLE_VENDOR", os.path.join(HERE, "node_modules"))
# the name the page asks for -> the file in the npm packages (package.json pins them)
VENDOR = {
    "preact.js": "htm/preact/standalone.mjs",
    "uplot.js": "uplot/dist/uPlot.esm.js",
    "uplot.css": "uplot/dist/uPlot.min.css",
    "xterm.js": "@xterm/xterm/lib/xterm.js",
    "xterm.css": "@xterm/xterm/css/xterm.css",
    "xterm-fit.js": "@xterm/addon-fit/lib/addon-fit.js",
}
TYPES = {".js": "text/javascript", ".mjs": "text/javascript", ".css": "text/css", ".html": "text/html",
         ".svg": "image/svg+xml", ".png": "image/png"}
# the page runs only its own scripts and talks only to its own origin
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data: blob:; style-src 'self' 'unsafe-inline'; "
                               "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


class Login(BaseModel):
    token: str = Field(min_length=1, max_length=4096)


class Whoami(BaseModel):
    token_id: str
    project: str
    role: str
    expires_at: float | None = None


def _file(path: str) -> Response:
    if not os.path.isfile(path):
        raise NotFound(f"no console file {os.path.basename(path)!r}", field="path")
    return FileResponse(path, media_type=TYPES.get(os.path.splitext(path)[1], "application/octet-stream"),
                        headers=HEADERS)


def vendor_missing() -> list[str]:
    return [name for name, rel in VENDOR.items() if not os.path.isfile(os.path.join(VENDOR_DIR, rel))]


def routes(tokens: TokenStore, sessions: session.Revocations) -> APIRouter:
    router = APIRouter(include_in_schema=False)

    @router.get("/ui")
    async def to_index() -> Response:
        return RedirectResponse("/ui/")

    @router.get("/ui/")
    async def index() -> Response:
        if missing := vendor_missing():
            return Response(f"the console's browser libraries are not installed ({', '.join(missing)}): run "
                            "scripts/setup.sh, or npm install in dsec/control/console\n", status_code=503,
                            media_type="text/plain")
        return _file(os.path.join(STATIC, "index.html"))

    @router.get("/ui/static/{name}")
    async def static(name: str) -> Response:
        if "/" in name or name.startswith("."):
            raise NotFound(f"no console file {name!r}", field="name")
        return _file(os.path.join(STATIC, name))

    @router.get("/ui/vendor/{name}")
    async def vendor(name: str) -> Response:
        if name not in VENDOR:
            raise NotFound(f"no console library {name!r}", field="name")
        return _file(os.path.join(VENDOR_DIR, VENDOR[name]))

    @router.post("/ui/session")
    async def login(body: Login, request: Request) -> Response:
        """Exchange a token for a session cookie (the token is not kept in the browser)."""
        if session.CSRF_HEADER.decode() not in request.headers:  # no login from another site's form
            raise Forbidden(f"send the {session.CSRF_HEADER.decode()} header to log in", field="x-dsec-console")
        principal = await tokens.verify(body.token.strip().encode())
        if principal is None:
            raise Unauthorized("invalid token", field="token")
        value, s = session.issue(tokens, principal)
        resp = JSONResponse(Whoami(token_id=principal.token_id, project=principal.project, role=principal.role,
                                   expires_at=s.expires_at).model_dump())
        secure = request.url.scheme == "https" or request.headers.get("x-forwarded-proto") == "https"
        resp.headers["set-cookie"] = session.cookie_header(value, max(0, int(s.expires_at - time.time())), secure)
        return resp

    @router.get("/ui/session")
    async def whoami(request: Request) -> Whoami:
        principal = await session.principal_of(tokens, sessions, request.headers.get("cookie", "").encode("latin-1"))
        if principal is None:
            raise Unauthorized("not logged in", field="session")
        return Whoami(token_id=principal.token_id, project=principal.project, role=principal.role,
                      expires_at=principal.expires_at)

    @router.delete("/ui/session", status_code=204)
    async def logout(request: Request) -> Response:
        """End this session for good (a copy of the cookie is refused from now on) and clear it."""
        s = session.session_of(tokens, request.headers.get("cookie", "").encode("latin-1"))
        if s is not None:
            await sessions.end(s)
        resp = Response(status_code=204)
        resp.headers["set-cookie"] = session.cookie_header("", 0, False)
        return resp

    return router
