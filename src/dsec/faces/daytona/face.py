"""Daytona's control-plane REST API over dsec: an ASGI middleware owning ``/daytona``.

A middleware in front of the apiserver, as the SWE-ReX and SandboxFusion faces are, so
every answer under ``/daytona`` (a refused token, a route dsec does not serve) is in
Daytona's error envelope, which its SDK turns into the matching ``Daytona*Error``; dsec's
own ``{"error", ...}`` body would reach it as an unparsed string. The token is a dsec
token sent as Daytona's ``Authorization: Bearer`` API key, checked against the same
token store, role and project rules as dsec's own routes: another project's sandbox is a
404, as an unknown one is.

What a Daytona sandbox is here: a dsec container sandbox, its id dsec's. A snapshot name
means what an E2B template name means (dsec.faces.e2b.template: a built template, ``base``, a
snapshot or any layer ref); an image is accepted when its Dockerfile is ``FROM <ref>``
alone. Daytona's "stopped" is dsec's paused (its files and memory kept), "start" is
resume, "delete" is dsec's stop. Auto-stop (idle minutes) is the idle pause TTL,
auto-delete (minutes stopped) the paused-stop TTL; auto-delete 0 (ephemeral) stops it
at the idle deadline instead. The toolbox (process, sessions, files, git) is served under
``/daytona/toolbox/<id>`` (dsec.faces.daytona.toolbox), the URL the SDK is given in each
sandbox's ``toolboxProxyUrl``; preview links under ``/daytona/preview/<id>/<port>``.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import re
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import ValidationError
from sqlalchemy.exc import SQLAlchemyError
from starlette.requests import Request
from starlette.responses import Response

from dsec.control.apiserver.core import Apiserver, read_body
from dsec.control.iam import PROJECT_LABEL, current_principal, project_of_sandbox
from dsec.control.iam.bound import TRAFFIC
from dsec.control.iam.tokens import Principal
from dsec.faces.daytona import build
from dsec.faces.daytona import models as m
from dsec.faces.daytona.build import NotServed
from dsec.faces.daytona.http import error_response, json_response, parse
from dsec.faces.daytona.toolbox import WORKDIR_LABEL, Toolbox
from dsec.faces.e2b.template import Template, resolve
from dsec.faces.e2b.templates_api import TemplatesApi, TemplateSource
from dsec.shared.errors import DsecError, Forbidden, InvalidRequest, NotFound, Unauthorized
from dsec.shared.meta.db import unavailable
from dsec.shared.wire.models import ContainerArgs, CreateRequest, SandboxInfo, SandboxState

log = logging.getLogger("dsec.daytona")
PREFIX = "/daytona"
NAME_LABEL, SNAPSHOT_LABEL = "daytona.name", "daytona.snapshot"
STOP_LABEL, DELETE_LABEL = "daytona.auto-stop", "daytona.auto-delete"
DEFAULT_SNAPSHOT = "base/debian:12"
DEFAULT_AUTO_STOP_MIN = 15  # Daytona's default: stopped after 15 idle minutes
DEFAULT_AUTO_ARCHIVE_MIN = 7 * 24 * 60  # Daytona's default: archived after 7 days stopped
MAX_BODY = 1 << 20
BUILD_TIMEOUT_S = 1800.0  # a create waits this long for its image's build (the SDK's own timeout may end sooner)
TARGET = "dsec"
Handler = Callable[..., Awaitable[Response]]


def _iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).isoformat().replace("+00:00", "Z")


def _minutes(seconds: int | None) -> int:
    return (seconds or 0) // 60


class DaytonaFace:
    """ASGI middleware: requests under ``/daytona/`` are served here, the rest pass on."""

    def __init__(self, app: Any, api: Apiserver, templates: TemplateSource | None = None,
                 templates_api: TemplatesApi | None = None) -> None:
        self.app, self.api, self.templates, self.templates_api = app, api, templates, templates_api
        self.toolbox = Toolbox(api)
        self.routes: list[tuple[str, re.Pattern[str], Handler]] = [
            (method, re.compile("^" + pattern + "$"), fn) for method, pattern, fn in (
                ("POST", r"/sandbox", self.create), ("GET", r"/sandbox", self.list),
                ("GET", r"/sandbox/(?P<sid>[^/]+)", self.get), ("DELETE", r"/sandbox/(?P<sid>[^/]+)", self.delete),
                ("POST", r"/sandbox/(?P<sid>[^/]+)/start", self.start),
                ("POST", r"/sandbox/(?P<sid>[^/]+)/stop", self.stop),
                ("PUT", r"/sandbox/(?P<sid>[^/]+)/labels", self.set_labels),
                ("POST", r"/sandbox/(?P<sid>[^/]+)/autostop/(?P<minutes>-?\d+)", self.autostop),
                ("POST", r"/sandbox/(?P<sid>[^/]+)/autodelete/(?P<minutes>-?\d+)", self.autodelete),
                ("GET", r"/sandbox/(?P<sid>[^/]+)/toolbox-proxy-url", self.toolbox_url),
                ("GET", r"/sandbox/(?P<sid>[^/]+)/ports/(?P<port>\d+)/preview-url", self.preview_url),
                ("GET", r"/config", self.config),
            )]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not (path == PREFIX or path.startswith(PREFIX + "/")):
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        rest = path[len(PREFIX):] or "/"
        try:
            if rest.startswith("/preview/"):
                response = await self.preview(request, rest)
            else:
                principal = await self._authorize(request)
                if rest.startswith("/toolbox/"):
                    response = await self.toolbox.serve(request, rest[len("/toolbox/"):], self._sandbox)
                else:
                    response = await self._route(request, rest, principal)
        except DsecError as e:
            response = error_response(e, path)
        except SQLAlchemyError as e:  # the token store's database is away: a 503, as on dsec's own routes
            away = unavailable(e)
            if away is None:
                raise
            response = error_response(away, path)
        except Exception:
            log.exception("daytona %s %s", scope.get("method"), path)
            response = error_response(DsecError("internal error in dsec's Daytona face; see the apiserver log"), path)
        await response(scope, receive, send)

    async def _authorize(self, request: Request) -> Principal:
        scheme, _, cred = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not cred.strip():
            raise Unauthorized("no dsec token: send it as the Daytona API key (Authorization: Bearer <token>)",
                               field="authorization")
        principal = await self.api.tokens.verify(cred.strip().encode())
        if principal is None:
            raise Unauthorized("invalid dsec token", field="authorization")
        if not principal.may("sandbox"):
            raise Forbidden(f"a {principal.role} token may not use sandboxes", field="authorization")
        current_principal.set(principal)
        return principal

    async def _route(self, request: Request, rest: str, principal: Principal) -> Response:
        allowed = []
        for method, pattern, fn in self.routes:
            hit = pattern.match(rest)
            if hit is None:
                continue
            if method == request.method:
                return await fn(request, **{k: urllib.parse.unquote(v) for k, v in hit.groupdict().items()})
            allowed.append(method)
        if allowed:
            raise _MethodNotAllowed(f"{rest} takes {', '.join(allowed)}", field="method")
        raise NotFound(f"dsec's Daytona face does not serve {request.method} {rest} (see docs/harnesses.md)",
                       field="path")

    # ---- sandboxes ----

    async def _sandbox(self, sid: str) -> SandboxInfo:
        """The caller's live sandbox named by id or Daytona name; anything else a 404."""
        info: SandboxInfo | None = None
        try:
            info = await self.api.edge_for(sid).get(sid)
        except (NotFound, InvalidRequest) as e:
            if e.field != "sandbox_id":
                raise
            named = [i for i in await self.api.list(None, {NAME_LABEL: sid}) if i.state in
                     (SandboxState.running, SandboxState.paused)]
            info = named[0] if named else None
        principal = current_principal.get()
        if info is None or info.state not in (SandboxState.running, SandboxState.paused) or \
                (principal is not None and not principal.covers(project_of_sandbox(info))):
            raise NotFound(f"sandbox {sid!r} not found", field="sandbox_id")
        return info

    def _base(self, request: Request) -> str:
        return str(request.base_url).rstrip("/") + PREFIX

    def _dto(self, request: Request, info: SandboxInfo) -> m.Sandbox:
        labels = {k: v for k, v in info.labels.items() if not k.startswith(("daytona.", "dsec.", "e2b."))}
        state = "started" if info.state == SandboxState.running else \
            "stopped" if info.state == SandboxState.paused else "destroyed"
        stop_min, delete_min = info.labels.get(STOP_LABEL), info.labels.get(DELETE_LABEL)
        return m.Sandbox(
            id=info.sandbox_id, organization_id=info.labels.get(PROJECT_LABEL, "default"),
            name=info.labels.get(NAME_LABEL, info.sandbox_id), snapshot=info.labels.get(SNAPSHOT_LABEL, info.image),
            user="root", env={}, labels=labels, target=TARGET, cpu=max(1, round(info.cpu_cores_limit)),
            memory=max(1, round(info.memory_limit_mb / 1024)), disk=max(1, round((info.disk_limit_mb or 0) / 1024)),
            state=state, desired_state=state, auto_stop_interval=int(stop_min) if stop_min else 0,
            auto_archive_interval=0, auto_delete_interval=int(delete_min) if delete_min else -1,
            created_at=_iso(info.created_at), updated_at=_iso(info.created_at),
            toolbox_proxy_url=self._base(request) + "/toolbox")

    async def _template(self, body: m.CreateSandbox) -> tuple[str, Template]:
        """What a create runs: a snapshot (a template name, as E2B's), an image by name,
        or an image with build steps, built (once) by the template builder."""
        if body.build_info is not None:
            if body.build_info.context_hashes:
                raise NotServed("image: files copied into an image (a build context) are not served by dsec's "
                                "Daytona face; build it through E2B's template API and give its name as the "
                                "snapshot", field="image")
            dockerfile = body.build_info.dockerfile_content or ""
            spec = build.parse_dockerfile(dockerfile)
            name = spec.fromImage or ""
            if self.templates is None:
                return name, await asyncio.to_thread(resolve, name, self.api.layers)
            try:  # before any build: an image that is nowhere is a 404 at once, not a failed build
                base = await self.templates.images.resolve(name)
            except (InvalidRequest, ValueError) as e:
                raise NotFound(f"image {name!r} not found: {getattr(e, 'message', e)}", field="image") from None
            if spec.steps:
                if self.templates_api is None:
                    raise NotServed("image: this server builds no images", field="image")
                name = await build.build(self.templates_api, dockerfile, body.cpu,
                                         body.memory * 1024 if body.memory else None, BUILD_TIMEOUT_S)
                found = await self.templates.lookup(name)
                assert found is not None, "a template just built is found"
                return name, found
            return name, Template(base.image, base.layers)
        name = body.snapshot or DEFAULT_SNAPSHOT
        if self.templates is not None:
            found = await self.templates.lookup(name)
            if found is not None:
                return name, found
        return name, await asyncio.to_thread(resolve, name, self.api.layers)

    async def create(self, request: Request) -> Response:
        body: m.CreateSandbox = parse(m.CreateSandbox, await read_body(request, MAX_BODY, "body"))
        if body.volumes:
            raise NotServed("volumes: Daytona volumes are not served by dsec (use a snapshot for files a "
                            "sandbox starts with)", field="volumes")
        if body.gpu:
            raise NotServed("gpu: dsec's Daytona face creates containers without GPUs", field="gpu")
        if body.name and await self.api.list(None, {NAME_LABEL: body.name}):
            raise _Conflict(f"name: a sandbox named {body.name!r} exists", field="name")
        name, template = await self._template(body)
        stop_min = DEFAULT_AUTO_STOP_MIN if body.auto_stop_interval is None else body.auto_stop_interval
        delete_min = -1 if body.auto_delete_interval is None else body.auto_delete_interval
        # dsec has no archive tier: a sandbox stopped this long is deleted, unless auto-delete
        # comes first, so one nobody deletes does not hold its node for ever
        archive_min = DEFAULT_AUTO_ARCHIVE_MIN if not body.auto_archive_interval else body.auto_archive_interval
        gone_min = min(delete_min, archive_min) if delete_min > 0 else archive_min
        labels = {**body.labels, SNAPSHOT_LABEL: name, STOP_LABEL: str(stop_min), DELETE_LABEL: str(delete_min),
                  WORKDIR_LABEL: template.workdir or "/root"}
        if body.name:
            labels[NAME_LABEL] = body.name
        sizes: dict[str, Any] = {}
        if body.cpu or template.cpu_count:
            sizes["cpu_cores_limit"] = body.cpu or template.cpu_count
        if body.memory or template.memory_mb:
            sizes["memory_limit_mb"] = body.memory * 1024 if body.memory else template.memory_mb
        if body.disk:
            sizes["disk_limit_mb"] = body.disk * 1024
        idle = stop_min * 60 if stop_min else None
        try:
            args = ContainerArgs(
                image=template.image, layers=template.layers, env={**template.envs, **body.env}, labels=labels,
                workdir=template.workdir or "/root", ttl_running_stop=idle if delete_min == 0 else None,
                ttl_running_pause=idle if delete_min != 0 else None,
                ttl_paused_stop=gone_min * 60,
                max_lifetime_s=body.ttl_minutes * 60 if body.ttl_minutes else 24 * 3600, **sizes)
        except ValidationError as e:
            err = e.errors()[0]
            where = {"cpu_cores_limit": "cpu", "memory_limit_mb": "memory", "disk_limit_mb": "disk",
                     "image": "snapshot", "layers": "snapshot"}.get(str(err["loc"][0]) if err["loc"] else "", "body")
            raise InvalidRequest(f"{where}: {err['msg']}", field=where) from None
        try:
            info = await self.api.create(CreateRequest(args=args))
        except (NotFound, InvalidRequest) as e:
            if isinstance(e, InvalidRequest) and e.field not in ("image", "layers", "args.image"):
                raise
            field = "image" if body.build_info is not None else "snapshot"
            raise NotFound(f"{field} {name!r} not found: {e.message}", field=field) from None
        return json_response(self._dto(request, info))

    async def list(self, request: Request) -> Response:
        q = request.query_params
        labels: dict[str, str] = {}
        if q.get("labels"):
            try:
                labels = {str(k): str(v) for k, v in dict(json.loads(q["labels"])).items()}
            except (ValueError, TypeError):
                raise InvalidRequest("labels: a JSON object of label names to values", field="labels") from None
        limit = q.get("limit", "100")
        if not limit.isdigit() or not 1 <= int(limit) <= 1000:
            raise InvalidRequest("limit: an integer from 1 to 1000", field="limit")
        after = q.get("cursor")
        states = set(q.getlist("states")) | {s for x in q.getlist("states") for s in x.split(",") if s}
        found = [i for i in await self.api.list(None, labels)
                 if i.state in (SandboxState.running, SandboxState.paused)]
        items = [self._dto(request, i) for i in sorted(found, key=lambda i: (i.created_at, i.sandbox_id))]
        if states:
            items = [x for x in items if x.state in states]
        if q.get("name"):
            items = [x for x in items if x.name == q["name"]]
        if after:
            items = [x for x in items if (x.created_at, x.id) > tuple(after.split("|", 1))]
        page = items[:int(limit)]
        cursor = f"{page[-1].created_at}|{page[-1].id}" if len(items) > len(page) else None
        return json_response(m.SandboxPage(items=page, next_cursor=cursor))

    async def get(self, request: Request, sid: str) -> Response:
        return json_response(self._dto(request, await self._sandbox(sid)))

    async def delete(self, request: Request, sid: str) -> Response:
        info = await self._sandbox(sid)
        await self.api.stop(info.sandbox_id)
        dto = self._dto(request, info)
        dto.state = dto.desired_state = "destroyed"
        return json_response(dto)

    async def start(self, request: Request, sid: str) -> Response:
        info = await self._sandbox(sid)
        if info.state == SandboxState.paused:
            info = await self.api.resume(info.sandbox_id)
        return json_response(self._dto(request, info))

    async def stop(self, request: Request, sid: str) -> Response:
        info = await self._sandbox(sid)
        if info.labels.get(DELETE_LABEL) == "0":  # ephemeral: Daytona deletes it when it stops
            return await self.delete(request, sid)
        if info.state == SandboxState.running:
            info = await self.api.pause(info.sandbox_id)
        return json_response(self._dto(request, info))

    async def set_labels(self, request: Request, sid: str) -> Response:
        await self._sandbox(sid)
        parse(m.Labels, await read_body(request, MAX_BODY, "body"))
        raise NotServed("labels: dsec sets a sandbox's labels when it is created (CreateSandbox labels)",
                        field="labels")

    async def autostop(self, request: Request, sid: str, minutes: str) -> Response:
        await self._sandbox(sid)
        raise NotServed("autostop: dsec sets a sandbox's idle stop when it is created (auto_stop_interval)",
                        field="interval")

    async def autodelete(self, request: Request, sid: str, minutes: str) -> Response:
        await self._sandbox(sid)
        raise NotServed("autodelete: dsec sets it when the sandbox is created (auto_delete_interval)",
                        field="interval")

    async def toolbox_url(self, request: Request, sid: str) -> Response:
        await self._sandbox(sid)
        return json_response(m.Url(url=self._base(request) + "/toolbox"))

    async def preview_url(self, request: Request, sid: str, port: str) -> Response:
        info = await self._sandbox(sid)
        if not 1 <= int(port) <= 65535:
            raise InvalidRequest("port: 1-65535", field="port")
        return json_response(m.PreviewUrl(sandbox_id=info.sandbox_id,
                                          url=f"{self._base(request)}/preview/{info.sandbox_id}/{port}",
                                          token=self.api.tokens.bound.mint_for(TRAFFIC, info)))

    async def config(self, request: Request) -> Response:
        return json_response({"analyticsApiUrl": None})

    async def preview(self, request: Request, rest: str) -> Response:
        """A sandbox's port, for whoever holds its preview token (``x-daytona-preview-token``,
        good for that sandbox's ports only) or a dsec token of its project."""
        parts = rest[len("/preview/"):].split("/", 2)
        if len(parts) < 2 or not parts[1].isdigit() or not 1 <= int(parts[1]) <= 65535:
            raise NotFound("a preview URL is /daytona/preview/<sandbox>/<port>/<path>", field="path")
        sid, port = parts[0], int(parts[1])
        given = request.headers.get("x-daytona-preview-token", "")
        # the sandbox's traffic credential, which ends with the token that made the sandbox
        if not (given and await self.api.tokens.bound.check(TRAFFIC, sid, given)):
            await self._authorize(request)
            await self._sandbox(sid)
        body = await read_body(request, 64 << 20, "body")
        skip = {"host", "authorization", "cookie", "content-length", "connection", "transfer-encoding",
                "x-daytona-preview-token"}
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in skip]
        target = "/" + (parts[2] if len(parts) > 2 else "") + (f"?{request.url.query}" if request.url.query else "")
        resp = await self.api.edge_for(sid).http(sid, port, request.method, target, headers, body)
        out = {k: v for k, v in resp.headers if k.lower() not in ("content-length", "transfer-encoding", "connection",
                                                                   "set-cookie")}
        return Response(resp.body, status_code=resp.status, headers=out)


class _Conflict(DsecError):
    status = 409
    code = "conflict"


class _MethodNotAllowed(DsecError):
    status = 405
    code = "method_not_allowed"


def mount(app: Any, api: Apiserver, templates: TemplateSource | None = None,
          templates_api: TemplatesApi | None = None) -> None:
    """Serve Daytona's API from the apiserver under /daytona: outermost, ahead of its bearer auth."""
    app.add_middleware(DaytonaFace, api=api, templates=templates, templates_api=templates_api)
