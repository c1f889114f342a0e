"""The apiserver: the only path between trusted callers and sandboxes.

Stateless: it authenticates, validates, asks placement where a new sandbox goes, and
routes every other request to the edge named in the sandbox id. It keeps no record of
any sandbox, so any number of replicas can serve any request.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hmac
import json
import logging
import re
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

from fastapi import FastAPI, Query, Request, WebSocket, WebSocketDisconnect
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, TypeAdapter, ValidationError

from dsec.e2b import api as e2b_api
from dsec.e2b import envd
from dsec.e2b.envd import ENVD_PATHS, ENVD_PREFIXES, signed_file_sandbox
from dsec.e2b.ports import PortProxy
from dsec.edge.api import EdgeAPI
from dsec.errors import (
    AdmissionRejected,
    DsecError,
    EdgeUnavailable,
    Forbidden,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    SandboxBusy,
    SandboxError,
    Unauthorized,
)
from dsec.iam import PROJECT_LABEL, TokenStore, current_principal, permission_for
from dsec.layers.store import Layer, LayerStore
from dsec.placement.engine import Placement
from dsec.watcher.watcher import Watcher
from dsec.wire.edge import TtyInput
from dsec.wire.iam import TokenInfo, TokenSpec
from dsec.wire.models import (
    BACKEND_TAGS,
    AuditRecord,
    ClickRequest,
    ContainerArgs,
    CreateRequest,
    ExecRequest,
    FileStat,
    FnCallArgs,
    FnCallResult,
    ForkRequest,
    KeysRequest,
    NetworkInfo,
    NetworkRulesRequest,
    NodeStats,
    PackDiffRequest,
    ProtectRequest,
    SandboxEvent,
    SandboxInfo,
    SandboxState,
    SandboxUsage,
    StorageStats,
    normalize_layer_ref,
    parse_sandbox_id,
)

log = logging.getLogger("dsec.apiserver")
M = TypeVar("M", bound=BaseModel)
MAX_CREATE_ATTEMPTS = 3
MAX_EXEC_BODY = 64 * 1024 * 1024  # a command with its stdin


async def _body(request: Request, limit: int, field: str) -> bytes:
    """The request body, refused with 413 past ``limit`` without reading it all."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"body of {declared} bytes exceeds the {limit}-byte limit", field=field)
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            raise PayloadTooLarge(f"body exceeds the {limit}-byte limit", field=field)
    return bytes(buf)


_SANDBOX_PATH = re.compile(r"^/v1/sandboxes/([^/]+-[^/]+)(?:/|$)")

class Apiserver:
    def __init__(self, edges: Mapping[str, EdgeAPI], watcher: Watcher, placement: Placement,
                 tokens: TokenStore, layers: LayerStore, max_file_bytes: int = 256 * 1024 * 1024) -> None:
        self.edges = edges
        self.tokens = tokens
        self.layers = layers
        self.watcher = watcher
        self.placement = placement
        self.max_file_bytes = max_file_bytes

    def edge_for(self, sandbox_id: str) -> EdgeAPI:
        try:
            name = parse_sandbox_id(sandbox_id)
        except ValueError as e:
            raise InvalidRequest(str(e), field="sandbox_id") from None
        edge = self.edges.get(name)
        if edge is None:
            raise NotFound(f"no sandbox {sandbox_id!r}: edge {name!r} is not part of this cluster",
                           field="sandbox_id")
        return edge

    async def create(self, req: CreateRequest) -> SandboxInfo:
        """Place, then let the chosen edge admit; an edge's refusal re-places elsewhere.
        When no edge is left, the caller gets the last edge's own reason."""
        principal = current_principal.get()
        if not principal.all_projects:  # a project's token makes sandboxes of that project only
            req = req.model_copy(update={"args": req.args.model_copy(
                update={"labels": {**req.args.labels, PROJECT_LABEL: principal.project}})})
        tried: set[str] = set()
        last: AdmissionRejected | None = None
        refreshed = False
        for _ in range(MAX_CREATE_ATTEMPTS):
            if not self.watcher.view:
                await self.watcher.refresh()
            try:
                name = self.placement.choose(req.args, exclude=tried)
            except AdmissionRejected:
                if last is not None:
                    raise last from None
                if not refreshed:  # the view may predate sandboxes that have ended since: look again once
                    refreshed = True
                    await self.watcher.refresh()
                    continue
                raise
            try:
                with self.placement.reserve(name, req.args):
                    return await self.edges[name].create(req.args)
            except AdmissionRejected as e:
                tried.add(name)
                last = e
        assert last is not None
        raise last

    def fncall_edge(self, image: str) -> EdgeAPI:
        """The edge for a FnCall: placed like a small sandbox; its pool does the rest."""
        try:
            known = self.layers.has(image)
        except ValueError:
            known = False
        if not known:
            raise NotFound(f"unknown FnCall image {image!r}", field="image")
        if not self.watcher.view:
            return next(iter(self.edges.values()))
        name = self.placement.choose(ContainerArgs(image=image, memory_limit_mb=64, cpu_cores_limit=0.1), exclude=set())
        return self.edges[name]

    async def fork(self, req: ForkRequest) -> list[SandboxInfo]:
        """n sandboxes stacked exactly as the snapshot was taken, created concurrently;
        all or nothing: if one cannot be made the others are stopped."""
        try:
            snap = self.layers.get(req.snapshot)
        except (NotFound, ValueError) as e:
            raise NotFound(f"unknown snapshot {req.snapshot!r}", field="snapshot") from e
        image, layers = snap.stack()
        base = req.args or ContainerArgs()
        args = base.model_copy(update={"image": image, "layers": layers})
        results = await asyncio.gather(*(self.create(CreateRequest(args=args)) for _ in range(req.n)),
                                       return_exceptions=True)
        made = [r for r in results if isinstance(r, SandboxInfo)]
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await asyncio.gather(*(self.edge_for(i.sandbox_id).stop(i.sandbox_id) for i in made),
                                 return_exceptions=True)
            err = failed[0]
            raise err if isinstance(err, DsecError) else SandboxError(f"fork failed: {err}")
        return made

    async def layers_in_use(self) -> set[str]:
        parts = await asyncio.gather(*(e.layers_in_use() for e in self.edges.values()))
        return set().union(*parts)

    async def list(self, job: str | None, labels: dict[str, str], usage: bool = False) -> list[SandboxInfo]:
        """What every reachable edge holds (the caller's project only). The edges that did
        not answer are in ``self.unreachable`` for the request (a list goes on without a
        node that is down; a job operation reports it)."""
        principal = current_principal.get()
        if not principal.all_projects:
            labels = {**labels, PROJECT_LABEL: principal.project}
        names = list(self.edges)
        parts = await asyncio.gather(*(self.edges[n].list_sandboxes(job=job, labels=labels, usage=usage)
                                       for n in names), return_exceptions=True)
        items: list[SandboxInfo] = []
        missing: list[str] = []
        for name, part in zip(names, parts, strict=True):
            if isinstance(part, EdgeUnavailable):
                missing.append(name)
            elif isinstance(part, BaseException):
                raise part
            else:
                items += part
        unreachable.set(tuple(missing))
        return sorted(items, key=lambda i: i.created_at)


UNREACHABLE_HEADER = "X-Dsec-Unreachable-Edges"
# the edges that did not answer this request's list (a context variable: one per request)
unreachable: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("unreachable", default=())


def _all_edges_answered(done: str) -> None:
    """A job operation reached every sandbox it lists, or says which edges it could not."""
    missing = unreachable.get()
    if missing:
        raise EdgeUnavailable(f"edge(s) {', '.join(missing)} did not answer: their sandboxes of this job were not "
                              f"{done} (the others were); try again when they are back")


def _error(e: DsecError) -> JSONResponse:
    # "code" (the HTTP status) is what E2B's SDKs read; dsec's own read "error"
    return JSONResponse({"error": e.code, "message": e.message, "field": e.field, "code": e.status},
                        status_code=e.status)


def _ref(ref: str) -> str:
    try:
        return normalize_layer_ref(ref)
    except ValueError as e:
        raise InvalidRequest(str(e), field="ref") from None


def _parse_labels(label: list[str]) -> dict[str, str]:
    out = {}
    for item in label:
        if "=" not in item:
            raise InvalidRequest(f"label filter {item!r} must be key=value", field="label")
        k, v = item.split("=", 1)
        out[k] = v
    return out


class BearerAuth:
    """ASGI middleware: every route but the open ones needs ``Bearer <token>``.

    A middleware rather than a per-route dependency keeps it off FastAPI's dependency
    solver on the hot exec path, and covers websockets the same way (a refused
    websocket is accepted, then closed with code 4401 so the client learns why)."""

    OPEN = frozenset({"/healthz", "/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect"})

    def __init__(self, app: Any, api: Apiserver) -> None:
        self.app = app
        self.api = api

    async def _refusal(self, scope: dict[str, Any]) -> DsecError | None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in self.OPEN:
            return None
        headers = dict(scope["headers"])
        if scope["path"] == "/files" and b"signature=" in scope.get("query_string", b""):
            return await self._signed_file(scope, headers)
        if scope["path"].startswith(ENVD_PREFIXES) or scope["path"] in ENVD_PATHS:  # E2B's envd: per-sandbox token
            sid = headers.get(b"e2b-sandbox-id", b"").decode(errors="replace")
            given = headers.get(b"x-access-token", b"").decode(errors="replace")
            if not sid or not hmac.compare_digest(given, self.api.tokens.derive("envd", sid)):
                return Unauthorized("missing or wrong X-Access-Token for this sandbox", field="x-access-token")
            return None
        header = headers.get(b"authorization", b"")
        if not header and b"x-api-key" in headers:  # E2B's SDKs send their key this way
            header = b"Bearer " + headers[b"x-api-key"]
        scheme, _, cred = header.partition(b" ")
        if scheme.lower() != b"bearer" or not cred.strip():
            return Unauthorized("missing or malformed Authorization header; expected 'Bearer <token>'",
                                field="authorization")
        principal = self.api.tokens.verify(cred.strip())
        if principal is None:
            return Unauthorized("invalid token", field="authorization")
        method = scope.get("method", "GET")
        need = permission_for(method, scope["path"])
        if not principal.may(need):
            return Forbidden(f"a {principal.role} token may not {method} {scope['path']} (needs {need!r})",
                             field="authorization")
        current_principal.set(principal)
        if not principal.all_projects and (m := _SANDBOX_PATH.match(scope["path"])):
            with contextlib.suppress(DsecError):  # a bad or unknown id is the route's to report
                info = await self.api.edge_for(m.group(1)).get(m.group(1))
                if info.labels.get(PROJECT_LABEL, "default") != principal.project:
                    return NotFound(f"no sandbox {m.group(1)!r} in project {principal.project!r}",
                                    field="sandbox_id")
        return None

    async def _signed_file(self, scope: dict[str, Any], headers: dict[bytes, bytes]) -> DsecError | None:
        """An E2B signed file URL: the signature is the credential, and names the sandbox."""
        query = dict(urllib.parse.parse_qsl(scope["query_string"].decode(errors="replace")))
        named = headers.get(b"e2b-sandbox-id", b"").decode(errors="replace")
        if named:
            candidates = [named]
        else:
            candidates = [i.sandbox_id for i in await self.api.list(None, {}) if i.state == SandboxState.running]
        try:
            sid = signed_file_sandbox(query, scope.get("method", "GET"), candidates,
                                      lambda s: self.api.tokens.derive("envd", s))
        except ValueError as e:
            return Unauthorized(str(e), field="signature")
        scope["headers"] = [h for h in scope["headers"] if h[0] != b"e2b-sandbox-id"] + \
            [(b"e2b-sandbox-id", sid.encode())]
        return None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        err = await self._refusal(scope)
        if err is None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http" and (scope["path"] in ENVD_PATHS or scope["path"].startswith(ENVD_PREFIXES)):
            await JSONResponse({"code": err.status, "message": err.message}, status_code=err.status)(
                scope, receive, send)  # envd's own error shape
        elif scope["type"] == "http":
            await _error(err)(scope, receive, send)
        else:
            await receive()  # websocket.connect
            await send({"type": "websocket.accept"})
            await send({"type": "websocket.close", "code": 4401, "reason": err.message[:120]})


def _parse(model: type[M], body: bytes) -> M:
    """The hot paths parse their bodies with pydantic-core directly (FastAPI's body
    machinery costs ~0.5 ms a call here), reporting errors the same way."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise RequestValidationError(
            [{**err, "loc": ("body", *err.get("loc", ()))} for err in e.errors()]) from None


def build_app(api: Apiserver) -> FastAPI:
    app = FastAPI(title="dsec", version="0.1.0",
                  description="Elastic sandboxes for agentic RL: create, exec, files, HTTP, TTY.")

    @app.exception_handler(DsecError)
    async def _dsec_error(_: Request, e: DsecError) -> JSONResponse:
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "args", *BACKEND_TAGS)]
        field = ".".join(loc) or ("backend" if first.get("type") == "invalid_backend" else None)
        msg = first.get("msg", "invalid request")
        return _error(InvalidRequest(f"{field}: {msg}" if field else msg, field=field))

    app.add_middleware(BearerAuth, api=api)
    # outermost: a request for a sandbox's own port carries that sandbox's token, not a bearer
    app.add_middleware(PortProxy, edge_for=api.edge_for, envd_token=lambda sid: api.tokens.derive("envd", sid),
                       traffic_token=lambda sid: api.tokens.derive("traffic", sid))
    e2b_api.mount(app, e2b_api.E2BApi(api, lambda sid: api.tokens.derive("envd", sid),
                                      lambda sid: api.tokens.derive("traffic", sid)))
    envd.mount(app, envd.Envd(api.edge_for))

    @app.post("/v1/tokens", status_code=201)
    async def create_token(spec: TokenSpec) -> TokenInfo:
        """A token for one project and role; its secret is in this answer only."""
        return await asyncio.to_thread(api.tokens.create, spec)

    @app.get("/v1/tokens")
    async def list_tokens() -> list[TokenInfo]:
        return await asyncio.to_thread(api.tokens.list)

    @app.delete("/v1/tokens/{token_id}")
    async def revoke_token(token_id: str) -> dict[str, str]:
        if not await asyncio.to_thread(api.tokens.revoke, token_id):
            raise NotFound(f"no token {token_id!r}", field="token_id")
        return {"revoked": token_id}

    @app.get("/healthz")
    async def healthz() -> dict[str, object]:
        return {"ok": True, "edges": sorted(api.edges)}

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text format: the edge's counters and per-sandbox cgroup usage (embedded mode has one
        edge; in cluster mode each edge is scraped on its own)."""
        # a scrape reads every sandbox's cgroup (and now and then walks its writable layer): not on the loop
        body = b"".join([await e.metrics_text() for e in api.edges.values()])
        return Response(body, media_type="text/plain; version=0.0.4")

    @app.get("/v1/nodes")
    async def nodes() -> list[NodeStats]:
        return list((await api.watcher.refresh()).values())

    @app.post("/v1/sandboxes", status_code=201)
    async def create(req: CreateRequest) -> SandboxInfo:
        return await api.create(req)

    @app.get("/v1/sandboxes", response_model=list[SandboxInfo])
    async def list_sandboxes(job: str | None = None, label: list[str] = Query(default=[]),
                             usage: bool = False) -> Response:
        """``usage=true`` adds each sandbox's CPU, memory (anon, file, swap), pids, disk and OOM kills.
        Edges that did not answer are named in the ``X-Dsec-Unreachable-Edges`` header (their
        sandboxes are missing from the list)."""
        items = await api.list(job, _parse_labels(label), usage)
        body = TypeAdapter(list[SandboxInfo]).dump_json(items)
        missing = unreachable.get()
        return Response(body, media_type="application/json",
                        headers={UNREACHABLE_HEADER: ",".join(missing)} if missing else None)

    @app.get("/v1/sandboxes/{sandbox_id}/usage")
    async def usage(sandbox_id: str) -> SandboxUsage:
        return await api.edge_for(sandbox_id).usage(sandbox_id)

    @app.delete("/v1/sandboxes")
    async def stop_many(job: str | None = None, label: list[str] = Query(default=[])) -> list[SandboxInfo]:
        """Stop every running or paused sandbox of a job (and/or with these labels), on every edge."""
        labels = _parse_labels(label)
        if job is None and not labels:
            raise InvalidRequest("give a job or at least one label; stopping everything is not offered",
                                 field="job")
        targets = [i for i in await api.list(job, labels) if i.state in ("running", "paused")]
        done = list(await asyncio.gather(*(api.edge_for(i.sandbox_id).stop(i.sandbox_id) for i in targets)))
        _all_edges_answered("stopped")
        return done

    @app.post("/v1/sandboxes/pause")
    async def pause_many(job: str | None = None, label: list[str] = Query(default=[])) -> list[SandboxInfo]:
        """Pause every running sandbox of a job (and/or with these labels), on every edge; the ones that
        have requests in flight are left running (they appear unchanged in the answer)."""
        return await _each(job, label, "running", "pause", lambda e, sid: e.pause(sid))

    @app.post("/v1/sandboxes/resume")
    async def resume_many(job: str | None = None, label: list[str] = Query(default=[])) -> list[SandboxInfo]:
        return await _each(job, label, "paused", "resume", lambda e, sid: e.resume(sid))

    async def _each(job: str | None, label: list[str], state: str, what: str,
                    op: Callable[[EdgeAPI, str], Awaitable[SandboxInfo]]) -> list[SandboxInfo]:
        labels = _parse_labels(label)
        if job is None and not labels:
            raise InvalidRequest(f"give a job or at least one label; {what} of everything is not offered",
                                 field="job")
        targets = [i for i in await api.list(job, labels) if i.state == state]

        async def one(i: SandboxInfo) -> SandboxInfo:
            try:
                return await op(api.edge_for(i.sandbox_id), i.sandbox_id)
            except SandboxBusy:
                return i
        done = list(await asyncio.gather(*(one(i) for i in targets)))
        _all_edges_answered(what + "d")
        return done

    @app.get("/v1/sandboxes/{sandbox_id}")
    async def get(sandbox_id: str) -> SandboxInfo:
        return await api.edge_for(sandbox_id).get(sandbox_id)

    @app.delete("/v1/sandboxes/{sandbox_id}")
    async def stop(sandbox_id: str) -> SandboxInfo:
        return await api.edge_for(sandbox_id).stop(sandbox_id)

    exec_body = {"content": {"application/json": {"schema": ExecRequest.model_json_schema()}}, "required": True}

    @app.post("/v1/sandboxes/{sandbox_id}/exec", response_model=None,
              openapi_extra={"requestBody": exec_body},
              responses={200: {"description": "ExecResult, or NDJSON ExecEvents with ?stream=true"}})
    async def exec_(sandbox_id: str, request: Request, stream: bool = False) -> Response:
        # the hot path: the body is parsed by pydantic-core directly (FastAPI's body
        # machinery costs ~0.5 ms a call here) and the result serialized once
        req = _parse(ExecRequest, await _body(request, MAX_EXEC_BODY, "body"))
        edge = api.edge_for(sandbox_id)
        if not stream:  # the hot path: serialize once, skip FastAPI's re-validation
            res = await edge.exec(sandbox_id, req)
            return Response(res.model_dump_json(), media_type="application/json")
        await edge.get(sandbox_id)  # a bad id fails before the 200 goes out
        events = edge.exec_stream(sandbox_id, req)

        async def body() -> AsyncIterator[bytes]:
            try:  # closing the stream (the client went away) stops the command
                async for item in events:
                    yield item.model_dump_json(exclude_none=True).encode() + b"\n"
            except DsecError as e:
                yield (json.dumps({"type": "error", "error": e.code, "message": e.message}) + "\n").encode()
            finally:
                await events.aclose()  # type: ignore[attr-defined]

        return StreamingResponse(body(), media_type="application/x-ndjson")

    @app.post("/v1/sandboxes/{sandbox_id}/pack_diff", status_code=201)
    async def pack_diff(sandbox_id: str, req: PackDiffRequest) -> Layer:
        return await api.edge_for(sandbox_id).pack_diff(sandbox_id, req.ref, req.scrub_paths, req.default_scrub)

    @app.post("/v1/sandboxes/{sandbox_id}/pause")
    async def pause(sandbox_id: str) -> SandboxInfo:
        """VM: RAM and devices to a snapshot file and QEMU ends; container: frozen. Any later request resumes."""
        return await api.edge_for(sandbox_id).pause(sandbox_id)

    @app.post("/v1/sandboxes/{sandbox_id}/network")
    async def set_network_rules(sandbox_id: str, req: NetworkRulesRequest) -> NetworkInfo:
        """Change a container's egress rules while it runs; keys not named keep their setting."""
        return await api.edge_for(sandbox_id).set_network_rules(sandbox_id, req.rules)

    @app.post("/v1/sandboxes/{sandbox_id}/resume")
    async def resume(sandbox_id: str) -> SandboxInfo:
        return await api.edge_for(sandbox_id).resume(sandbox_id)

    @app.get("/v1/sandboxes/{sandbox_id}/screenshot", response_class=Response,
             responses={200: {"content": {"image/png": {}}, "description": "the VM's screen as PNG"}})
    async def screenshot(sandbox_id: str) -> Response:
        return Response(await api.edge_for(sandbox_id).screenshot(sandbox_id), media_type="image/png")

    @app.post("/v1/sandboxes/{sandbox_id}/keys", status_code=204)
    async def send_keys(sandbox_id: str, req: KeysRequest) -> Response:
        await api.edge_for(sandbox_id).send_keys(sandbox_id, req.keys)
        return Response(status_code=204)

    @app.post("/v1/sandboxes/{sandbox_id}/click", status_code=204)
    async def click(sandbox_id: str, req: ClickRequest) -> Response:
        await api.edge_for(sandbox_id).click(sandbox_id, req.x, req.y, req.button)
        return Response(status_code=204)

    @app.get("/v1/sandboxes/{sandbox_id}/events")
    async def events(sandbox_id: str) -> list[SandboxEvent]:
        """What happened to a sandbox that its owner should know (creation, prefetch, storage errors, ...)."""
        return await api.edge_for(sandbox_id).events(sandbox_id)

    @app.get("/v1/sandboxes/{sandbox_id}/audit")
    async def audit(sandbox_id: str, kind: str | None = None, flagged: bool = False,
                    limit: int = Query(default=1000, ge=1, le=20000)) -> list[AuditRecord]:
        """Processes executed, platform requests, egress denials and detector flags, oldest first
        (the last ``limit``); kept after the sandbox ends."""
        return await api.edge_for(sandbox_id).audit_log(sandbox_id, kind, flagged, limit)

    @app.post("/v1/sandboxes/{sandbox_id}/protect")
    async def protect(sandbox_id: str, req: ProtectRequest) -> dict[str, int]:
        """Fingerprint the files under these paths now; any later change is flagged in the audit log."""
        return {"files": await api.edge_for(sandbox_id).protect(sandbox_id, req.paths)}

    @app.post("/v1/sandboxes/{sandbox_id}/access_list")
    async def save_access_list(sandbox_id: str) -> dict[str, int]:
        """Save what a record_access sandbox has read so far as its layers' access lists (data blob -> chunks)."""
        return await api.edge_for(sandbox_id).save_access_lists(sandbox_id)

    fncall_body = {"content": {"application/json": {"schema": FnCallArgs.model_json_schema()}}, "required": True}

    @app.post("/v1/fncall", response_model=None, openapi_extra={"requestBody": fncall_body},
              responses={200: {"model": FnCallResult, "description": "FnCallResult"}})
    async def fncall(request: Request) -> Response:
        """Run a short stateless task in a pooled warm container (compile once, run each test)."""
        args = _parse(FnCallArgs, await _body(request, MAX_EXEC_BODY, "body"))
        res = await api.fncall_edge(args.image).fncall(args)
        return Response(res.model_dump_json(), media_type="application/json")

    @app.get("/v1/fncall/languages")
    async def fncall_languages(image: str = "base/fncall:12") -> list[str]:
        return await api.fncall_edge(image).fncall_languages(image)

    @app.get("/v1/storage")
    async def storage() -> list[StorageStats]:
        """Per edge: the layer store it reads, its chunk cache, and what it fetched per data blob."""
        return [await e.storage_stats() for e in api.edges.values()]

    @app.post("/v1/fork", status_code=201)
    async def fork(req: ForkRequest) -> list[SandboxInfo]:
        return await api.fork(req)

    @app.get("/v1/layers")
    async def list_layers() -> list[Layer]:
        return api.layers.list()

    @app.post("/v1/layers/gc")
    async def gc_layers() -> dict[str, list[str]]:
        for e in api.edges.values():
            await e.release_layers()
        return {"removed_blobs": api.layers.gc(await api.layers_in_use())}

    @app.get("/v1/layers/{ref:path}")
    async def get_layer(ref: str) -> Layer:
        return api.layers.get(_ref(ref))

    @app.delete("/v1/layers/{ref:path}")
    async def remove_layer(ref: str) -> Layer:
        return api.layers.remove(_ref(ref), await api.layers_in_use())

    @app.get("/v1/sandboxes/{sandbox_id}/files")
    async def read_file(sandbox_id: str, path: str) -> Response:
        data = await api.edge_for(sandbox_id).read_file(sandbox_id, path)
        return Response(content=data, media_type="application/octet-stream")

    @app.put("/v1/sandboxes/{sandbox_id}/files", status_code=204)
    async def write_file(sandbox_id: str, path: str, request: Request, mode: int = 0o644) -> Response:
        edge = api.edge_for(sandbox_id)
        if not 0 <= mode <= 0o7777:
            raise InvalidRequest("mode must be between 0 and 0o7777", field="mode")
        await edge.write_file(sandbox_id, path, await _body(request, api.max_file_bytes, "body"), mode)
        return Response(status_code=204)

    @app.delete("/v1/sandboxes/{sandbox_id}/files", status_code=204)
    async def remove(sandbox_id: str, path: str, recursive: bool = False) -> Response:
        await api.edge_for(sandbox_id).remove(sandbox_id, path, recursive)
        return Response(status_code=204)

    @app.get("/v1/sandboxes/{sandbox_id}/files/list")
    async def list_dir(sandbox_id: str, path: str) -> list[FileStat]:
        return await api.edge_for(sandbox_id).list_dir(sandbox_id, path)

    @app.get("/v1/sandboxes/{sandbox_id}/files/stat")
    async def stat(sandbox_id: str, path: str) -> FileStat:
        return await api.edge_for(sandbox_id).stat(sandbox_id, path)

    @app.api_route("/v1/sandboxes/{sandbox_id}/ports/{port}/{path:path}",
                   methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"])
    async def proxy(sandbox_id: str, port: int, path: str, request: Request) -> Response:
        if not 1 <= port <= 65535:
            raise InvalidRequest("port must be 1-65535", field="port")
        body = await request.body()
        skip = {"host", "authorization", "content-length", "connection", "transfer-encoding"}
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in skip]
        target = "/" + path + (f"?{request.url.query}" if request.url.query else "")
        resp = await api.edge_for(sandbox_id).http(sandbox_id, port, request.method, target, headers, body)
        out_headers = {k: v for k, v in resp.headers
                       if k.lower() not in ("content-length", "transfer-encoding", "connection")}
        return Response(content=resp.body, status_code=resp.status, headers=out_headers)

    @app.websocket("/v1/sandboxes/{sandbox_id}/tty")
    async def tty(ws: WebSocket, sandbox_id: str, cols: int = 80, rows: int = 24) -> None:
        await ws.accept()
        try:
            session = api.edge_for(sandbox_id).tty(sandbox_id, cols, rows, _tty_input(ws))
            await anext(session)  # the shell is up (or why not)
        except DsecError as e:
            # the close code carries the HTTP status (4000 + status) and the reason
            await ws.close(code=4000 + e.status, reason=e.message[:120])
            return
        try:
            async for out in session:
                if out.data:
                    await ws.send_bytes(out.data)
                if out.exit_code is not None:
                    await ws.send_text(json.dumps({"exit": out.exit_code}))
            with contextlib.suppress(Exception):
                await ws.close()
        except (WebSocketDisconnect, RuntimeError):
            pass  # the client went away: closing the session kills the shell
        finally:
            await session.aclose()  # type: ignore[attr-defined]

    return app


async def _tty_input(ws: WebSocket) -> AsyncIterator[TtyInput]:
    """What the user's terminal sends: bytes are keystrokes; text is JSON control
    ({"resize": [cols, rows]} or {"data": "..."}). Ends when the client goes away."""
    while True:
        msg = await ws.receive()
        if msg["type"] == "websocket.disconnect":
            return
        if msg.get("bytes"):
            yield TtyInput(data=msg["bytes"])
        elif msg.get("text"):
            with contextlib.suppress(ValueError, KeyError, TypeError, ValidationError):
                ctl = json.loads(msg["text"])
                if "resize" in ctl:
                    yield TtyInput(resize=(int(ctl["resize"][0]), int(ctl["resize"][1])))
                if "data" in ctl:
                    yield TtyInput(data=str(ctl["data"]).encode())
