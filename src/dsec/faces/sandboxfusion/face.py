"""SandboxFusion's ``/run_code`` on dsec's FnCall: an ASGI middleware owning ``/sandboxfusion``.

A middleware in front of the apiserver (like the SWE-ReX face) rather than routes behind
its bearer auth, because SandboxFusion's clients send no credentials: the dsec token
rides in the URL, ``/sandboxfusion/<token>/run_code``, and is checked here against the
same token store (a role that may use sandboxes, as ``/v1/fncall`` needs). The token is
cut out of the request's path before anything else sees it, so the access log shows
``/sandboxfusion/***/run_code``. ``/sandboxfusion/run_code`` with ``Authorization:
Bearer <token>`` works too, and ``/sandboxfusion/v1/ping`` answers ``"pong"`` to anyone
(a token in its path is checked, so a client can test its URL).

A request becomes one :class:`FnCallArgs` call: limits on wall-clock time (SandboxFusion's
rule), ``files`` written to the scratch dir, ``fetch_files`` read back. Refused requests
get a 4xx whose body is SandboxFusion's response shape with dsec's error fields added;
failures of the platform itself are ``status: SandboxError`` with HTTP 200, which is how
SandboxFusion reports its own (its client retries those, verl scores them as errors).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from dsec.control.apiserver.core import Apiserver, read_body
from dsec.control.iam import acting_project, current_principal
from dsec.faces.sandboxfusion.models import (
    LANGUAGES,
    NOT_SERVED,
    CommandRunResult,
    CommandRunStatus,
    ErrorBody,
    RunCodeRequest,
    RunCodeResponse,
    RunStatus,
)
from dsec.node.layers.toolchains import TOOLCHAINS
from dsec.shared.errors import DsecError, Forbidden, InvalidRequest, NotFound, Unauthorized
from dsec.shared.wire.models import FnCallArgs, FnCallResult, FnCallRun

log = logging.getLogger("dsec.sandboxfusion")
PREFIX = "/sandboxfusion"
ENDPOINTS = {"run_code": "POST", "v1/ping": "GET", "run_jupyter": "POST"}
MAX_BODY = 64 * 1024 * 1024  # code, stdin and files (base64) with room for JSON escaping
MAX_MEMORY_MB = 2048  # the most a FnCall slot holds (FnCallArgs.memory_limit_mb); also "no limit"
OUTPUT_LIMIT_KB = 8 * 1024  # per stream: SandboxFusion keeps all output; a reward check needs far less
PIDS_LIMIT = 128  # processes and threads of one call (JVM, Go and Node start several of their own)
# FnCallArgs' fields, named as the SandboxFusion request names them, for error messages
SF_FIELD = {"time_limit_s": "run_timeout", "compile_time_limit_s": "compile_timeout",
            "memory_limit_mb": "memory_limit_MB", "binary_files": "files"}


# what SandboxFusion's own runtimes have beside the language: its Python a data-science set
# (requests, numpy, pandas, ...), its Node.js npm modules (lodash, ...)
SF_LAYERS = {"python": [TOOLCHAINS["scipy"].ref("scipy")], "pytest": [TOOLCHAINS["scipy"].ref("scipy")],
             "nodejs": [TOOLCHAINS["node"].ref("node")]}


class NotServed(DsecError):
    status = 501
    code = "not_implemented"


class SandboxFusionFace:
    """ASGI middleware: requests under ``/sandboxfusion/`` are served here, the rest pass on."""

    def __init__(self, app: Any, api: Apiserver) -> None:
        self.app, self.api = app, api
        self._layers_seen: set[str] = set()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith(PREFIX + "/"):
            await self.app(scope, receive, send)
            return
        token, endpoint = split_path(path)
        if token is not None:
            # the same scope object is what the server's access log prints: no token there
            scope["path"] = f"{PREFIX}/{endpoint}"
            scope["raw_path"] = f"{PREFIX}/***/{endpoint}".encode()
        response = await self._serve(Request(scope, receive), token, endpoint)
        await response(scope, receive, send)

    async def _serve(self, request: Request, token: str | None, endpoint: str) -> Response:
        method = ENDPOINTS.get(endpoint)
        if method is None:
            return _refusal(NotFound(f"no SandboxFusion endpoint {endpoint!r}; dsec serves "
                                     f"{', '.join(ENDPOINTS)}", field="path"))
        if request.method != method:
            return _refusal(InvalidRequest(f"{endpoint} takes {method}", field="method"), status=405)
        try:
            if endpoint == "v1/ping" and token is None:
                return JSONResponse("pong")
            await self._authorize(request, token)
            if endpoint == "v1/ping":
                return JSONResponse("pong")
            if endpoint == "run_jupyter":
                raise NotServed("run_jupyter is not served by dsec (FnCall runs whole programs, not notebook "
                                "cells): use run_code", field="path")
            return await self.run_code(request)
        except DsecError as e:
            return _refusal(e)
        except Exception:
            log.exception("sandboxfusion %s", endpoint)
            return _refusal(DsecError("internal error in dsec's SandboxFusion face; see the apiserver log"))

    async def _authorize(self, request: Request, token: str | None) -> None:
        field = "token"
        if token is None:
            field = "authorization"
            scheme, _, cred = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not cred.strip():
                raise Unauthorized("no dsec token: put it in the URL (/sandboxfusion/<token>/run_code) or send "
                                   "'Authorization: Bearer <token>'", field=field)
            token = cred.strip()
        principal = await self.api.tokens.verify(token.encode())
        if principal is None:
            raise Unauthorized("invalid dsec token", field=field)
        if not principal.may("sandbox"):
            raise Forbidden(f"a {principal.role} token may not run code", field=field)
        current_principal.set(principal)

    def _has_layer(self, ref: str) -> bool:
        """Whether the platform has ``ref`` (remembered once seen: published layers do not change)."""
        if ref in self._layers_seen:
            return True
        if self.api.layers.has(ref):
            self._layers_seen.add(ref)
            return True
        return False

    async def run_code(self, request: Request) -> Response:
        body = await read_body(request, MAX_BODY, "body")
        try:
            req = RunCodeRequest.model_validate_json(body)
        except ValidationError as e:
            raise _invalid(e, {}) from None
        args = to_fncall(req, self._has_layer)
        try:
            await self.api.fncall_rates.take(acting_project(None))  # the project's FnCall rate (docs/iam.md)
            res = await self.api.fncall(args)
        except DsecError as e:
            if isinstance(e, NotFound) and e.field == "image":  # setup has not built the FnCall image
                e = DsecError(f"{e.message}: run `dsec setup` (scripts/setup.sh) on this platform")
            elif 400 <= e.status < 500 and e.status != 429:
                raise
            log.warning("sandboxfusion run_code: %s", e.message)
            return _json(RunCodeResponse(status=RunStatus.SandboxError, message=e.message))
        return _json(from_fncall(req, args, res))


def split_path(path: str) -> tuple[str | None, str]:
    """``/sandboxfusion/<token>/<endpoint>`` or ``/sandboxfusion/<endpoint>`` -> (token, endpoint)."""
    rest = path[len(PREFIX) + 1:].strip("/")
    if rest in ENDPOINTS:
        return None, rest
    token, _, endpoint = rest.partition("/")
    return token, endpoint


def to_fncall(req: RunCodeRequest, has_layer: Callable[[str], bool] | None = None) -> FnCallArgs:
    """The FnCall for a SandboxFusion request; the language's usual libraries (SF_LAYERS) are
    stacked where ``has_layer`` says the platform has them (a platform set up without its
    toolchain layers still runs Python, with the standard library)."""
    language = LANGUAGES.get(req.language)
    if req.language in NOT_SERVED:
        raise NotServed(f"language: {req.language!r} is not served by dsec: {NOT_SERVED[req.language]}",
                        field="language")
    if language is None:
        raise InvalidRequest(f"language: {req.language!r} is not served by dsec; supported: "
                             f"{', '.join(LANGUAGES)}", field="language")
    memory = req.memory_limit_MB
    if memory <= 0 or memory > MAX_MEMORY_MB:  # SandboxFusion's -1 is "no limit": the most a slot holds
        memory = MAX_MEMORY_MB
    try:
        return FnCallArgs(
            language=language,
            code=req.code or "\n",  # SandboxFusion runs an empty program; FnCall wants some code
            stdin=req.stdin or "",
            binary_files={path: b64 for path, b64 in req.files.items() if b64 is not None},
            fetch_files=req.fetch_files,
            time_limit_s=req.run_timeout, compile_time_limit_s=req.compile_timeout, time_limit_kind="wall",
            memory_limit_mb=memory, pids_limit=PIDS_LIMIT, output_limit_kb=OUTPUT_LIMIT_KB,
            layers=list(dict.fromkeys([*(ref for ref in SF_LAYERS.get(language, [])
                                         if has_layer is None or has_layer(ref)), *req.layers])))
    except ValidationError as e:
        raise _invalid(e, SF_FIELD) from None


def from_fncall(req: RunCodeRequest, args: FnCallArgs, res: FnCallResult) -> RunCodeResponse:
    notes = []
    compile_result = run_result = None
    if res.compile is not None:
        compile_result = _step(res.compile)
        notes += _limit_note("compile", res.compile, args)
    if res.compile is None or res.compile.status == "ok":
        run = FnCallRun.model_validate(res.model_dump(include=set(FnCallRun.model_fields)))
        run_result = _step(run)
        notes += _limit_note("run", run, args)
    steps = [s for s in (compile_result, run_result) if s is not None]
    ok = all(s.status == CommandRunStatus.Finished and s.return_code == 0 for s in steps)
    if res.files_left_out:
        notes.append(f"fetch_files past the 16 MiB bound, left out: {', '.join(res.files_left_out)}")
    return RunCodeResponse(status=RunStatus.Success if ok else RunStatus.Failed, message="; ".join(notes),
                           compile_result=compile_result, run_result=run_result,
                           executor_pod_name=res.container or None, files=res.files)


def _step(run: FnCallRun) -> CommandRunResult:
    if run.status == "time_limit":
        return CommandRunResult(status=CommandRunStatus.TimeLimitExceeded, execution_time=run.wall_ms / 1000,
                                cpu_time=run.time_ms / 1000, stdout=run.stdout, stderr=run.stderr)
    if run.exit_code is not None:
        code = run.exit_code
    elif run.signal is not None:
        code = -run.signal  # as Python's subprocess, which SandboxFusion reports, has it
    else:
        code = 0 if run.cached else 1
    return CommandRunResult(status=CommandRunStatus.Finished, execution_time=run.wall_ms / 1000,
                            cpu_time=run.time_ms / 1000, return_code=code, stdout=run.stdout, stderr=run.stderr)


def _limit_note(step: str, run: FnCallRun, args: FnCallArgs) -> list[str]:
    """What SandboxFusion has no status for, said in the message."""
    if run.status == "output_limit":
        return [f"{step}: output past {args.output_limit_kb // 1024} MiB, cut there and the program stopped"]
    if run.status == "memory_limit" and run.exit_code != 0:  # near the limit but done is no failure
        return [f"{step}: out of memory (limit {args.memory_limit_mb} MB)"]
    return []


def _invalid(e: ValidationError, names: dict[str, str]) -> InvalidRequest:
    errs = e.errors()
    first = errs[0] if errs else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [str(p) for p in first["loc"]]
    if first["type"] == "json_invalid" or (not loc and first["type"] == "model_type"):
        return InvalidRequest(f"body: must be a JSON object as SandboxFusion's RunCodeRequest ({first['msg']})",
                              field="body")
    if loc:
        loc[0] = names.get(loc[0], loc[0])
    field = ".".join(loc) or None
    return InvalidRequest(f"{field}: {first['msg']}" if field else str(first["msg"]), field=field)


def _json(model: RunCodeResponse) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


def _refusal(e: DsecError, status: int | None = None) -> Response:
    body = ErrorBody(status=RunStatus.SandboxError, message=e.message, error=e.code, field=e.field,
                     code=status or e.status)
    return Response(body.model_dump_json(), status_code=status or e.status, media_type="application/json")


def mount(app: Any, api: Apiserver) -> None:
    """Serve SandboxFusion's API from the apiserver: outermost, ahead of its bearer auth."""
    app.add_middleware(SandboxFusionFace, api=api)
