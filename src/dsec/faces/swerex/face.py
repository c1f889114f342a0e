"""SWE-ReX's remote runtime protocol for each sandbox, at ``/swerex/<sandbox_id>/<endpoint>``.

``RemoteRuntime(host="http://APISERVER/swerex/<sandbox_id>", auth_token=...)`` (port
left None: the client appends the endpoint to host, and a port after the path would
not be one) talks to this exactly as to SWE-ReX's own server. An ASGI middleware in
front of the apiserver rather than routes behind its auth middleware, because the
credential is SWE-ReX's ``X-API-Key`` and may be one sandbox's own token, and because a
runner token (which may use sandboxes, not administer the node) must be enough.

Answers follow SWE-ReX's server: a model's JSON on success; an error raised by the
runtime as HTTP 511 ``{"swerexception": {...}}``, which the client raises again as the
same class (CommandTimeoutError, NonZeroExitCodeError, SessionDoesNotExistError,
BashIncorrectSyntaxError, FileNotFoundError, ...); anything else the client refuses
by status, with FastAPI's ``detail`` (which its ``is_alive`` reports) and dsec's error
fields. No server traceback is ever sent.
"""

from __future__ import annotations

import asyncio
import codecs
import logging
import posixpath
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from dsec.control.apiserver.core import Apiserver
from dsec.control.iam import project_of_sandbox
from dsec.control.iam.bound import SWEREX as SWEREX_PURPOSE
from dsec.faces.swerex import models as m
from dsec.faces.swerex import shell
from dsec.faces.swerex.upload import upload
from dsec.node.edge.api import EdgeAPI
from dsec.shared.errors import (
    DeadlineExceeded,
    DsecError,
    Forbidden,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    SandboxError,
    SandboxNotRunning,
    Unauthorized,
)
from dsec.shared.wire.models import SESSION_RE, ExecRequest, ExecResult, SandboxInfo, SandboxState

log = logging.getLogger("dsec.swerex")
PREFIX = "/swerex/"
# SWE-ReX's "no timeout": just under the 300 s its client allows a whole request (aiohttp's
# default), so the caller gets SWE-ReX's own CommandTimeoutError, not its client's
DEFAULT_TIMEOUT_S = 290.0
MAX_OUTPUT_BYTES = 16 * 1024 * 1024  # per stream; an agent's observation, not a transfer
CLOSE_WAIT_S = 30.0
MAX_SESSIONS = 64  # dsec's shell sessions per sandbox
MAX_BODY = 8 * 1024 * 1024  # a command, a session request: JSON with room for escaping
OFF_LOOP_BYTES = 1 << 20  # bodies and files this big are parsed and decoded off the event loop
SWEREX = "swerex.exceptions."
TRUNCATED = "\n[dsec: output past {n} bytes was dropped]\n"


class _ActionKind(BaseModel):
    action_type: str = "bash"  # SWE-ReX's discriminator; its client always sends it


class Transfer(Exception):
    """An exception for the SWE-ReX client to raise on its side."""

    def __init__(self, class_path: str, message: str, extra_info: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.body = m.ExceptionTransfer(message=message, class_path=class_path, extra_info=extra_info or {})


def _error(e: DsecError) -> Response:
    return JSONResponse({"detail": e.message, "error": e.code, "message": e.message, "field": e.field,
                         "code": e.status}, status_code=e.status)


def _invalid(e: ValidationError) -> InvalidRequest:
    errs = e.errors()
    if not errs:
        return InvalidRequest("invalid request")
    first = errs[0]
    field = str(first["loc"][0]) if first["loc"] else None
    msg = first["msg"]
    if first["type"] == "json_invalid":
        field, msg = "body", "not valid JSON"
    return InvalidRequest(f"{field}: {msg}" if field else msg, field=field)


async def _json(model: type[BaseModel], body: bytes) -> Any:
    try:
        if len(body) > OFF_LOOP_BYTES:
            return await asyncio.to_thread(model.model_validate_json, body)
        return model.model_validate_json(body or b"{}")
    except ValidationError as e:
        raise _invalid(e) from None


def _absolute(path: str) -> str:
    """A relative path is taken from the sandbox's /: SWE-ReX's own server reads it from its
    working directory, which a container's entrypoint leaves at / (a 400 here turned a
    missing file into an error no SWE-ReX caller handles)."""
    return path if path.startswith("/") else posixpath.join("/", path)


def _output(r: ExecResult, merged: bool = True) -> str:
    out = r.stdout
    if r.stdout_truncated or (merged and r.stderr_truncated):
        out += TRUNCATED.format(n=MAX_OUTPUT_BYTES)
    return out


class SwerexFace:
    """ASGI middleware: requests under ``/swerex/`` are served here, the rest pass on."""

    def __init__(self, app: Any, api: Apiserver) -> None:
        self.app, self.api = app, api
        self.routes: dict[str, tuple[str, Callable[[str, EdgeAPI, Request], Awaitable[BaseModel | Response]]]] = {
            "": ("GET", self.root), "is_alive": ("GET", self.is_alive), "token": ("GET", self.token),
            "create_session": ("POST", self.create_session), "run_in_session": ("POST", self.run_in_session),
            "close_session": ("POST", self.close_session), "execute": ("POST", self.execute),
            "read_file": ("POST", self.read_file), "write_file": ("POST", self.write_file),
            "upload": ("POST", self.upload), "close": ("POST", self.close)}

    def token_for(self, info: SandboxInfo) -> str:
        """The sandbox's own SWE-ReX token: good for this sandbox's face only, verifiable on
        any replica without being stored, and bound to the token that made the sandbox (it
        ends when that one is revoked or expires: dsec.control.iam.bound)."""
        return self.api.tokens.bound.mint_for(SWEREX_PURPOSE, info)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PREFIX):
            await self.app(scope, receive, send)
            return
        response = await self._serve(Request(scope, receive))
        await response(scope, receive, send)

    async def _serve(self, request: Request) -> Response:
        sid, _, endpoint = request.scope["path"][len(PREFIX):].partition("/")
        endpoint = endpoint.strip("/")
        route = self.routes.get(endpoint)
        if route is None:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        if request.method != route[0]:
            return JSONResponse({"detail": "Method Not Allowed"}, status_code=405)
        try:
            edge = await self._authorize(request, sid)
            out = await route[1](sid, edge, request)
        except Transfer as t:
            return JSONResponse({"swerexception": t.body.model_dump()}, status_code=511)
        except DsecError as e:
            return _error(e)
        except Exception:
            log.exception("swerex %s on %s", endpoint, sid)
            return _error(DsecError("internal error in dsec's SWE-ReX face; see the apiserver log"))
        return out if isinstance(out, Response) else Response(out.model_dump_json(), media_type="application/json")

    async def _authorize(self, request: Request, sid: str) -> EdgeAPI:
        """The sandbox's edge, once the key may act on the sandbox: the sandbox's own
        SWE-ReX token, or a dsec token whose role may use sandboxes and whose project
        holds this one. Refusals come before any lookup, so they say nothing of which
        sandboxes exist."""
        key = request.headers.get("x-api-key", "")
        scheme, _, cred = request.headers.get("authorization", "").partition(" ")
        if not key and scheme.lower() == "bearer":
            key = cred.strip()
        if not key:
            raise Unauthorized("missing X-API-Key: a dsec token, or this sandbox's SWE-ReX token", field="x-api-key")
        if self.api.tokens.bound.signed_by(SWEREX_PURPOSE, sid, key) is not None:  # the sandbox's own token
            if await self.api.tokens.bound.check(SWEREX_PURPOSE, sid, key) is None:
                raise Unauthorized("this sandbox's SWE-ReX token was revoked with the token that made the sandbox",
                                   field="x-api-key")
            return self.api.edge_for(sid)
        principal = await self.api.tokens.verify(key.encode())
        if principal is None:
            raise Unauthorized("invalid X-API-Key", field="x-api-key")
        if not principal.may("sandbox"):
            raise Forbidden(f"a {principal.role} token may not use sandboxes", field="x-api-key")
        edge = self.api.edge_for(sid)
        if not principal.all_projects:
            info = await edge.get(sid)
            if not principal.covers(project_of_sandbox(info)):
                raise NotFound(f"no sandbox {sid!r} in project {principal.project!r}", field="sandbox_id")
        return edge

    async def _body(self, request: Request, limit: int = MAX_BODY) -> bytes:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise PayloadTooLarge(f"body: {declared} bytes is over the {limit}-byte limit", field="body")
        buf = bytearray()
        async for chunk in request.stream():
            buf += chunk
            if len(buf) > limit:
                raise PayloadTooLarge(f"body: over the {limit}-byte limit", field="body")
        return bytes(buf)

    # ---- runtime ---------------------------------------------------------------------
    async def root(self, sid: str, edge: EdgeAPI, request: Request) -> Response:
        return JSONResponse({"message": f"dsec SWE-ReX face of {sid}"})

    async def token(self, sid: str, edge: EdgeAPI, request: Request) -> Response:
        info = await edge.get(sid)  # an unknown sandbox is a 404, not a token for nothing
        return JSONResponse({"auth_token": self.token_for(info), "sandbox_id": sid})

    async def is_alive(self, sid: str, edge: EdgeAPI, request: Request) -> BaseModel:
        info = await edge.get(sid)
        if info.state in (SandboxState.running, SandboxState.paused):  # a paused one resumes on its next request
            return m.IsAliveResponse(is_alive=True)
        return m.IsAliveResponse(is_alive=False, message=f"sandbox {sid} is {info.state.value}"
                                 + (f": {info.error}" if info.error else ""))

    async def close(self, sid: str, edge: EdgeAPI, request: Request) -> BaseModel:
        """Ends every SWE-ReX session of the sandbox (those with a pid on record); the
        sandbox itself belongs to whoever created it (and its TTLs)."""
        try:
            # the directory is the sandbox's to write: only names this face gives sessions
            names = [f.name[:-4] for f in await edge.list_dir(sid, shell.STATE_DIR)
                     if f.name.endswith(".pid") and SESSION_RE.match(f.name[:-4])
                     and f.name.startswith(("swerex-", "swerex_"))][:MAX_SESSIONS]
        except SandboxNotRunning:
            return m.Empty()  # nothing left to close: a teardown that runs twice is not an error
        except NotFound as e:
            if e.field == "sandbox_id":
                raise
            names = []  # no session was ever created
        for name in names:
            await self._end(sid, edge, name)
        return m.Empty()

    async def _end(self, sid: str, edge: EdgeAPI, dsec_name: str) -> bool:
        """End one session: what it runs first (from outside, so the close does not wait
        behind it), then its shell (from inside). False if it was not a session."""
        await self._stop_running(sid, edge, dsec_name, 0)
        script = shell.close(dsec_name)
        req = ExecRequest(cmd=script.text, session=dsec_name, timeout_s=10)
        try:  # bounded: a command line that keeps starting processes still holds the session
            r = await asyncio.wait_for(edge.exec(sid, req), CLOSE_WAIT_S)
        except TimeoutError:
            raise DeadlineExceeded(f"session {dsec_name!r} stayed busy for {CLOSE_WAIT_S} s; not closed",
                                   field="session") from None
        except SandboxError as e:
            if type(e) is not SandboxError:
                raise
            return False  # its shell had already ended
        return shell.status(r.stderr, script.nonce).has("closed")

    async def _stop_running(self, sid: str, edge: EdgeAPI, dsec_name: str, ticks: int) -> bool:
        """SIGINT to what the session runs, SIGKILL after ``ticks`` x 50 ms; False if the
        session has no shell on record."""
        argv = ["/bin/sh", "-c", shell.INTERRUPT, "sh", dsec_name, str(ticks)]
        r = await edge.exec(sid, ExecRequest(argv=argv, timeout_s=ticks * 0.05 + 30))
        return r.exit_code != 3

    # ---- sessions --------------------------------------------------------------------
    async def _in_session(self, sid: str, edge: EdgeAPI, name: str, script: shell.Script,
                          timeout: float) -> ExecResult:
        req = ExecRequest(cmd=script.text, session=shell.session_name(name), timeout_s=timeout,
                          max_output_bytes=MAX_OUTPUT_BYTES)
        return await edge.exec(sid, req)

    async def create_session(self, sid: str, edge: EdgeAPI, request: Request) -> BaseModel:
        req: m.CreateBashSessionRequest = await _json(m.CreateBashSessionRequest, await self._body(request))
        script = shell.create(req.session, req.startup_source)
        try:
            r = await self._in_session(sid, edge, req.session, script, req.startup_timeout)
        except SandboxError as e:
            if type(e) is not SandboxError:
                raise
            # the shell dsec held for this name had been killed (close, or a timeout that
            # had to end the shell): dsec has let go of it now and starts a fresh one
            r = await self._in_session(sid, edge, req.session, script, req.startup_timeout)
        st = shell.status(r.stderr, script.nonce)
        if st.has("exists"):
            raise Transfer(SWEREX + "SessionExistsError", f"session {req.session!r} already exists")
        if r.timed_out:
            raise Transfer(SWEREX + "CommandTimeoutError",
                           f"sourcing {req.startup_source} took over {req.startup_timeout} s (the session exists)",
                           {"output": _output(r)})
        if not st.has("created"):
            raise Transfer(SWEREX + "SwerexException", f"the shell of session {req.session!r} ended while starting "
                           f"(exit status {r.exit_code}): {_output(r)[-2000:]}")
        return m.CreateBashSessionResponse(output=_output(r))

    async def run_in_session(self, sid: str, edge: EdgeAPI, request: Request) -> BaseModel:
        body = await self._body(request)
        kind = (await _json(_ActionKind, body)).action_type
        if kind == "bash_interrupt":
            return await self._interrupt(sid, edge, await _json(m.BashInterruptAction, body))
        if kind != "bash":
            raise InvalidRequest("action_type: must be 'bash' or 'bash_interrupt'", field="action_type")
        action: m.BashAction = await _json(m.BashAction, body)
        if action.is_interactive_command or action.is_interactive_quit or action.expect:
            raise Transfer("builtins.NotImplementedError",
                           "interactive commands (is_interactive_command, is_interactive_quit, expect) are not "
                           "supported by dsec: a session's commands run to completion with stdin at /dev/null "
                           "and no terminal; drive an interactive program with its batch mode or a here-document")
        timeout = action.timeout or DEFAULT_TIMEOUT_S
        script = shell.run(action.command)
        try:
            r = await self._in_session(sid, edge, action.session, script, timeout)
        except SandboxError as e:
            if type(e) is not SandboxError:
                raise
            raise Transfer(SWEREX + "SessionDoesNotExistError",
                           f"session {action.session!r} does not exist (its shell has ended)") from None
        st = shell.status(r.stderr, script.nonce)
        if st.has("missing"):
            raise Transfer(SWEREX + "SessionDoesNotExistError", f"session {action.session!r} does not exist")
        if st.syntax_error is not None:
            raise Transfer(SWEREX + "BashIncorrectSyntaxError",
                           f"bash -n rejected the command {action.command!r}:\n{st.syntax_error}",
                           {"bash_stdout": "", "bash_stderr": st.syntax_error})
        if not st.has("run"):
            raise Transfer(SWEREX + "SessionDoesNotExistError",
                           f"session {action.session!r} does not exist (its shell ended before the command ran)")
        output = _output(r)
        if r.timed_out:
            gone = "" if st.has("done") else "; the command kept the shell itself busy, so the session was ended " \
                "(create it again)"
            raise Transfer(SWEREX + "CommandTimeoutError",
                           f"timeout after {timeout} seconds while running command {action.command!r}; its "
                           f"processes were killed{gone}", {"output": output, "session_alive": st.has("done")})
        exit_code, reason = st.exit_code, ""
        if not st.has("done"):  # the command ended the shell (exit, exec, kill)
            exit_code, reason = r.exit_code, "the session's shell exited; create the session again"
        if action.check == "raise" and exit_code != 0:
            msg = f"command {action.command!r} exited with {exit_code}; its output:\n{output}"
            raise Transfer(SWEREX + "NonZeroExitCodeError", f"{action.error_msg}: {msg}" if action.error_msg else msg,
                           {"exit_code": exit_code, "output": output})
        return m.BashObservation(output=output, exit_code=None if action.check == "ignore" else exit_code,
                                 failure_reason=reason)

    async def _interrupt(self, sid: str, edge: EdgeAPI, action: m.BashInterruptAction) -> BaseModel:
        """What runs in the session now gets SIGINT, then SIGKILL after ``timeout`` x
        ``n_retry``. A timed-out command was already killed by dsec, so after a
        CommandTimeoutError this finds nothing to do and answers at once."""
        ticks = max(1, int(action.timeout * max(1, action.n_retry) / 0.05))
        if not await self._stop_running(sid, edge, shell.session_name(action.session), ticks):
            raise Transfer(SWEREX + "SessionDoesNotExistError", f"session {action.session!r} does not exist")
        return m.BashObservation(output="", exit_code=0)

    async def close_session(self, sid: str, edge: EdgeAPI, request: Request) -> BaseModel:
        req: m.CloseBashSessionRequest = await _json(m.CloseBashSessionRequest, await self._body(request))
        if not await self._end(sid, edge, shell.session_name(req.session)):
            raise Transfer(SWEREX + "SessionDoesNotExistError", f"session {req.session!r} does not exist")
        return m.CloseBashSessionResponse()

    # ---- one-off commands and files --------------------------------------------------
    async def execute(self, sid: str, edge: EdgeAPI, request: Request) -> BaseModel:
        c: m.Command = await _json(m.Command, await self._body(request))
        timeout = c.timeout or DEFAULT_TIMEOUT_S
        cmd: str | None = None
        argv: list[str] | None = None
        # as subprocess.run has it: a list with shell=True is sh -c with the rest as $0...;
        # a string without shell names one program
        if isinstance(c.command, str):
            if c.shell and not c.command.strip():  # `sh -c ""`, as subprocess.run has it: nothing, 0
                return m.CommandResponse(stdout="", stderr="", exit_code=0)
            if c.shell:
                cmd = f"exec 2>&1\n{c.command}" if c.merge_output_streams else c.command
            else:
                argv = [c.command]
        else:
            argv = ["/bin/sh", "-c", *c.command] if c.shell else list(c.command)
        if argv is not None and c.merge_output_streams:
            argv = ["/bin/sh", "-c", 'exec "$@" 2>&1', "sh", *argv]
        try:
            req = ExecRequest(cmd=cmd, argv=argv, env=c.env or {}, cwd=c.cwd, timeout_s=timeout,
                              max_output_bytes=MAX_OUTPUT_BYTES)
        except ValidationError as e:
            raise _invalid(e) from None
        r = await edge.exec(sid, req)
        stdout, stderr = _output(r, c.merge_output_streams), r.stderr
        if r.stderr_truncated and not c.merge_output_streams:
            stderr += TRUNCATED.format(n=MAX_OUTPUT_BYTES)
        if r.timed_out:
            raise Transfer(SWEREX + "CommandTimeoutError", f"command ran past its {timeout} s timeout and was killed",
                           {"stdout": stdout, "stderr": stderr})
        if c.check and r.exit_code != 0:
            msg = f"command {c.command!r} exited with {r.exit_code}; stdout:\n{stdout}\nstderr:\n{stderr}"
            raise Transfer(SWEREX + "NonZeroExitCodeError", f"{c.error_msg}: {msg}" if c.error_msg else msg,
                           {"exit_code": r.exit_code, "stdout": stdout, "stderr": stderr})
        return m.CommandResponse(stdout=stdout, stderr=stderr, exit_code=r.exit_code)

    async def read_file(self, sid: str, edge: EdgeAPI, request: Request) -> BaseModel:
        req: m.ReadFileRequest = await _json(m.ReadFileRequest, await self._body(request))
        encoding, errors = req.encoding or "utf-8", req.errors or "strict"
        for value, field, lookup in ((encoding, "encoding", codecs.lookup), (errors, "errors", codecs.lookup_error)):
            try:
                lookup(value)
            except LookupError:
                raise InvalidRequest(f"{field}: unknown {field} {value!r}", field=field) from None
        data = await self._file_op(edge.read_file(sid, _absolute(req.path)), req.path)
        try:
            text = await asyncio.to_thread(data.decode, encoding, errors) if len(data) > OFF_LOOP_BYTES \
                else data.decode(encoding, errors)
        except UnicodeDecodeError as e:
            raise Transfer("builtins.ValueError", f"{req.path} is not {encoding}: {e}") from None
        # as Path.read_text does (text mode): universal newlines
        return m.ReadFileResponse(content=text.replace("\r\n", "\n").replace("\r", "\n"))

    async def write_file(self, sid: str, edge: EdgeAPI, request: Request) -> BaseModel:
        req: m.WriteFileRequest = await _json(m.WriteFileRequest, await self._body(request, self.api.max_file_bytes))
        try:
            data = await asyncio.to_thread(req.content.encode) if len(req.content) > OFF_LOOP_BYTES \
                else req.content.encode()
        except UnicodeEncodeError:
            raise InvalidRequest("content: not encodable as UTF-8 (a lone surrogate?)", field="content") from None
        await self._file_op(edge.write_file(sid, _absolute(req.path), data), req.path)
        return m.Empty()

    async def upload(self, sid: str, edge: EdgeAPI, request: Request) -> BaseModel:
        declared = request.headers.get("content-length", "")
        limit = self.api.max_file_bytes + (1 << 20)  # the file, and the form around it
        if declared.isdigit() and int(declared) > limit:
            raise PayloadTooLarge(f"body: {declared} bytes is over the {limit}-byte limit", field="body")
        await self._file_op(upload(edge, sid, _capped(request, limit), self.api.max_file_bytes), "target_path")
        return m.Empty()

    @staticmethod
    async def _file_op(aw: Awaitable[Any], path: str) -> Any:
        """A file operation, its "no such file" as the FileNotFoundError SWE-ReX's own
        server would raise (a missing sandbox stays a 404)."""
        try:
            return await aw
        except NotFound as e:
            if e.field == "sandbox_id":
                raise
            raise Transfer("builtins.FileNotFoundError", e.message) from None
        except InvalidRequest as e:
            if e.field != "path":
                raise
            raise Transfer("builtins.OSError", e.message) from None


def _capped(request: Request, limit: int) -> Request:
    """The request, its body refused past ``limit`` bytes as it streams in (a multipart
    body may declare no length)."""
    seen = 0

    async def receive() -> Any:
        nonlocal seen
        msg = await request.receive()
        if msg["type"] == "http.request":
            seen += len(msg.get("body", b""))
            if seen > limit:
                raise PayloadTooLarge(f"body: over the {limit}-byte limit", field="body")
        return msg

    return Request(request.scope, receive)


def mount(app: Any, api: Apiserver) -> None:
    """Serve SWE-ReX's protocol from the apiserver: outermost, ahead of its bearer auth."""
    app.add_middleware(SwerexFace, api=api)
