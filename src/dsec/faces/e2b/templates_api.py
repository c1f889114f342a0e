"""E2B's template API (what its SDKs' ``Template.build`` and the CLI drive) over dsec's
template builds (dsec.faces.templates): request a build by name and tags, learn whether each
COPY's files are already here and upload those that are not, start the build with its
steps, follow its status and logs, tag, list, get and delete templates. Errors are E2B's
``{"code", "message"}``.

An upload URL is signed for its project and files hash, bound to the token that asked for
it (dsec.control.iam.bound: it stops working when that token is revoked or expires; the SDK sends no
other credential with it); it points back at the apiserver the request came through."""

from __future__ import annotations

import asyncio
import datetime
import os
import socket
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, Field
from starlette.responses import JSONResponse, Response

from dsec.control.iam import current_principal
from dsec.faces.e2b.envd import ENVD_VERSION
from dsec.faces.e2b.routing import add_routes
from dsec.faces.e2b.template import Template
from dsec.faces.templates.builder import Builder
from dsec.faces.templates.catalog import LOG_PAGE, BuildRow, LogRow, TemplateCatalog, TemplateRow
from dsec.faces.templates.context import Contexts
from dsec.faces.templates.images import Images
from dsec.faces.templates.models import BuildRequest, TemplateSpec, check_tag
from dsec.shared.errors import Forbidden, InvalidRequest, NotFound

FILES_PATH = "/e2b/template-files/"
DEFAULT_CPU, DEFAULT_MEMORY_MB = 2, 1024
REAP_S = 10.0


def _iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).isoformat().replace("+00:00", "Z")


def _entry(e: LogRow) -> dict[str, Any]:
    return {"timestamp": _iso(e.ts), "level": e.level, "message": e.message, **({"step": e.step} if e.step else {})}


class TagsBody(BaseModel):
    target: str = Field(min_length=1)
    tags: list[str] = Field(min_length=1)


class UntagBody(BaseModel):
    name: str = Field(min_length=1)
    tags: list[str] = Field(min_length=1)


class PublicBody(BaseModel):
    public: bool = False


class TemplateSource:
    """Templates built through E2B's template API, and images named in a create's metadata
    (slime's way: no template, the image under a metadata key the operator chose)."""

    def __init__(self, catalog: TemplateCatalog, images: Images, image_key: str | None = None) -> None:
        self.catalog, self.images, self.image_key = catalog, images, image_key

    async def lookup(self, name: str) -> Template | None:
        """The built template ``name`` means; None when no template has that name (or none
        the caller may see: another project's private one)."""
        base = name.partition(":")[0]
        row = await asyncio.to_thread(self.catalog.template, base)
        if row is None or not (row.public or current_principal.get().covers(row.project)):
            return None
        t, b = await asyncio.to_thread(self.catalog.resolve, name)  # NotFound names a missing tag
        assert b.result is not None
        await asyncio.to_thread(self.catalog.spawned, t.id)
        return Template.built(t.id, b.result, b.cpu_count, b.memory_mb)

    async def from_metadata(self, template_id: str, metadata: dict[str, str]) -> Template | None:
        if not self.image_key or template_id != "base" or not metadata.get(self.image_key):
            return None
        base = await self.images.resolve(metadata[self.image_key])
        return Template(base.image, base.layers, workdir="/root")


class TemplatesApi:
    def __init__(self, catalog: TemplateCatalog, builder: Builder, contexts: Contexts,
                 sign: Callable[[str], str], delete_snapshot: Callable[[str], Awaitable[None]]) -> None:
        self.catalog, self.builder, self.contexts, self.sign = catalog, builder, contexts, sign
        self.delete_snapshot = delete_snapshot
        self._reaped = 0.0

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    async def reap(self) -> None:
        """Now and then, fail builds whose runner is gone (any replica may notice)."""
        now = asyncio.get_running_loop().time()
        if now - self._reaped >= REAP_S:
            self._reaped = now
            await self.builder.reap()

    async def _template(self, template_id: str, owned: bool = False) -> TemplateRow:
        """The template, if the caller may see it (its project's, or public); ``owned``: if
        it may change it (its project's only: a public template is read-only to others)."""
        t = await self._call(self.catalog.template, template_id)
        if t is None:
            raise NotFound(f"template {template_id!r} not found", field="templateID")
        p = current_principal.get()
        if not p.covers(t.project) and not t.public:
            raise NotFound(f"template {template_id!r} not found", field="templateID")
        if owned and not p.covers(t.project):
            raise Forbidden(f"template {template_id!r} belongs to another project: it may be used, not changed",
                            field="templateID")
        return t

    async def _build(self, template_id: str, build_id: str, owned: bool = False) -> tuple[TemplateRow, BuildRow]:
        t = await self._template(template_id, owned)
        b = await self._call(self.catalog.build, build_id)
        if b is None or b.template_id != t.id:
            raise NotFound(f"build {build_id!r} of template {template_id!r} not found", field="buildID")
        return t, b

    async def request(self, body: BuildRequest) -> dict[str, Any]:
        try:
            name, tags = body.split()
        except ValueError as e:
            raise InvalidRequest(f"name: {e}", field="name") from None
        project = current_principal.get().project
        t, b = await self._call(self.catalog.request_build, name, tags, body.cpuCount or DEFAULT_CPU,
                                body.memoryMB or DEFAULT_MEMORY_MB, project)
        return {"templateID": t.id, "buildID": b.id, "public": t.public, "names": [t.name], "tags": b.tags,
                "aliases": [t.name]}

    async def start(self, template_id: str, build_id: str, spec: TemplateSpec) -> None:
        await self.reap()
        t, _ = await self._build(template_id, build_id, owned=True)
        if spec.fromTemplate:  # building on another template: one the caller may use
            await self._template(spec.fromTemplate.partition(":")[0])
        for s in spec.steps:
            if s.type == "COPY" and s.filesHash and not await self._call(self.contexts.has, t.project, s.filesHash):
                raise InvalidRequest(f"the files of COPY {s.args[0]} (hash {s.filesHash}) were not uploaded",
                                     field="steps")
        await self.builder.start(build_id, spec)

    async def status(self, template_id: str, build_id: str, offset: int, limit: int) -> dict[str, Any]:
        await self.reap()
        _, b = await self._build(template_id, build_id)
        entries = await self._call(self.catalog.logs, build_id, offset, limit)
        out: dict[str, Any] = {"templateID": b.template_id, "buildID": b.id, "status": b.status, "logs": [],
                               "logEntries": [_entry(e) for e in entries]}
        if b.reason:
            tail = await self._call(self.catalog.logs, build_id, max(0, b.log_count - 20), 20)
            out["reason"] = {**b.reason, "logEntries": [_entry(e) for e in tail]}
        return out

    async def logs(self, template_id: str, build_id: str, cursor: int, limit: int) -> dict[str, Any]:
        await self._build(template_id, build_id)
        return {"logs": [_entry(e) for e in await self._call(self.catalog.logs, build_id, cursor, limit)]}

    async def files(self, template_id: str, files_hash: str, base_url: str) -> dict[str, Any]:
        """Whether the template's project has these files; if not, where to upload them (a
        URL signed for that project and hash)."""
        t = await self._template(template_id, owned=True)
        if await self._call(self.contexts.has, t.project, files_hash):
            return {"present": True}
        q = urllib.parse.urlencode({"project": t.project, "signature": self.sign(upload_key(t.project, files_hash))})
        return {"present": False, "url": f"{base_url.rstrip('/')}{FILES_PATH}{files_hash}?{q}"}

    def _info(self, t: TemplateRow, builds: list[BuildRow]) -> dict[str, Any]:
        ready = [b for b in builds if b.status == "ready"]
        pick = ready or builds
        last = pick[-1] if pick else None
        return {"templateID": t.id, "buildID": last.id if last else "", "cpuCount": last.cpu_count if last else 0,
                "memoryMB": last.memory_mb if last else 0, "diskSizeMB": 0, "public": t.public,
                "aliases": [t.name], "names": [t.name], "createdAt": _iso(t.created_at),
                "updatedAt": _iso(t.updated_at), "createdBy": None,
                "lastSpawnedAt": _iso(t.last_spawned_at) if t.last_spawned_at else None,
                "spawnCount": t.spawn_count, "buildCount": t.build_count, "envdVersion": ENVD_VERSION,
                "buildStatus": last.status if last else "waiting"}

    async def list_all(self) -> list[dict[str, Any]]:
        p = current_principal.get()
        rows = await self._call(self.catalog.templates, None if p.all_projects else p.project)
        return [self._info(t, await self._call(self.catalog.builds, t.id)) for t in rows]

    async def get(self, template_id: str) -> dict[str, Any]:
        t = await self._template(template_id)
        builds = await self._call(self.catalog.builds, t.id)
        return {**self._info(t, builds), "builds": [
            {"buildID": b.id, "status": b.status, "createdAt": _iso(b.created_at), "updatedAt": _iso(b.updated_at),
             **({"finishedAt": _iso(b.finished_at)} if b.finished_at else {}), "cpuCount": b.cpu_count,
             "memoryMB": b.memory_mb, "envdVersion": ENVD_VERSION} for b in builds]}

    async def alias(self, alias: str) -> dict[str, Any]:
        t = await self._template(alias)
        return {"templateID": t.id, "public": t.public}

    async def delete(self, template_id: str) -> None:
        t = await self._call(self.catalog.template, template_id)
        if t is None:  # not a built template: E2B deletes snapshots through the same route
            await self.delete_snapshot(template_id)
            return
        t = await self._template(template_id, owned=True)
        for build_id, sandbox_id in await self._call(self.catalog.delete_template, t.id):
            await self.builder.cancel(build_id, sandbox_id)

    async def set_public(self, template_id: str, public: bool) -> None:
        t = await self._template(template_id, owned=True)
        await self._call(self.catalog.set_public, t.id, public)
        # its built layers follow it: another project spawns a public template's, and mounts
        # no private one's
        for result in await self._call(self.catalog.results, t.id):
            await self.builder.platform.template_layers(result.layers, t.project, public)

    async def tags(self, template_id: str) -> list[dict[str, Any]]:
        t = await self._template(template_id)
        return [{"tag": tag, "buildID": bid, "createdAt": _iso(at)}
                for tag, bid, at in await self._call(self.catalog.tags, t.id)]

    async def assign(self, body: TagsBody) -> dict[str, Any]:
        await self._template(body.target.partition(":")[0], owned=True)
        try:
            for tag in body.tags:
                check_tag(tag)
        except ValueError as e:
            raise InvalidRequest(f"tags: {e}", field="tags") from None
        build_id, tags = await self._call(self.catalog.assign, body.target, body.tags)
        return {"tags": tags, "buildID": build_id}

    async def untag(self, body: UntagBody) -> None:
        await self._template(body.name, owned=True)
        await self._call(self.catalog.untag, body.name, body.tags)


def runner_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def upload_key(project: str, files_hash: str) -> str:
    """What an upload URL is signed for: the project's namespace and the hash in it."""
    return f"{project}\n{files_hash}"


def upload_claim(path: str, query: bytes) -> tuple[str, str] | None:
    """What an upload URL claims: (the key it is signed for, its signature), to check as a
    credential bound to the token that asked for the URL (dsec.control.iam.bound); None when the
    URL lacks a part."""
    files_hash = path[len(FILES_PATH):]
    q = urllib.parse.parse_qs(query.decode(errors="replace"))
    given, project = q.get("signature", [""])[0], q.get("project", [""])[0]
    if not (files_hash and project and given):
        return None
    return upload_key(project, files_hash), given


def mount(app: FastAPI, api: TemplatesApi) -> None:
    def offset(request: Request, name: str, default: int, most: int) -> int:
        raw = request.query_params.get(name)
        if raw is None or raw == "":
            return default
        if not raw.isdigit() or int(raw) > most:
            raise InvalidRequest(f"{name}: an integer from 0 to {most}, not {raw!r}", field=name)
        return int(raw)

    async def request_build(request: Request) -> Response:
        return JSONResponse(await api.request(BuildRequest.model_validate_json(await request.body())),
                            status_code=202)

    async def start_build(request: Request, template_id: str, build_id: str) -> Response:
        await api.start(template_id, build_id, TemplateSpec.model_validate_json(await request.body()))
        return Response(status_code=202)

    async def build_status(request: Request, template_id: str, build_id: str) -> Response:
        return JSONResponse(await api.status(template_id, build_id, offset(request, "logsOffset", 0, 1 << 31),
                                             offset(request, "limit", LOG_PAGE, LOG_PAGE)))

    async def build_logs(request: Request, template_id: str, build_id: str) -> Response:
        return JSONResponse(await api.logs(template_id, build_id, offset(request, "cursor", 0, 1 << 31),
                                           offset(request, "limit", LOG_PAGE, 1000)))

    async def files(request: Request, template_id: str, files_hash: str) -> Response:
        return JSONResponse(await api.files(template_id, files_hash, str(request.base_url)), status_code=201)

    async def upload(request: Request, files_hash: str) -> Response:
        await api.contexts.save(request.query_params.get("project", ""), files_hash, request.stream())
        return Response(status_code=200)

    async def alias(request: Request, alias: str) -> Response:
        return JSONResponse(await api.alias(alias))

    async def list_templates(request: Request) -> Response:
        return JSONResponse(await api.list_all())

    async def get(request: Request, template_id: str) -> Response:
        return JSONResponse(await api.get(template_id))

    async def delete(request: Request, template_id: str) -> Response:
        await api.delete(template_id)
        return Response(status_code=204)

    async def patch(request: Request, template_id: str) -> Response:
        await api.set_public(template_id, PublicBody.model_validate_json(await request.body() or b"{}").public)
        return JSONResponse({"names": [template_id]})

    async def tags(request: Request, template_id: str) -> Response:
        return JSONResponse(await api.tags(template_id))

    async def assign(request: Request) -> Response:
        return JSONResponse(await api.assign(TagsBody.model_validate_json(await request.body())), status_code=201)

    async def untag(request: Request) -> Response:
        await api.untag(UntagBody.model_validate_json(await request.body()))
        return Response(status_code=204)

    routes: list[tuple[str, Callable[..., Awaitable[Response]], str]] = [
        ("/v3/templates", request_build, "POST"), ("/v2/templates", request_build, "POST"),
        ("/v2/templates/{template_id}/builds/{build_id}", start_build, "POST"),
        ("/templates/{template_id}/builds/{build_id}/status", build_status, "GET"),
        ("/templates/{template_id}/builds/{build_id}/logs", build_logs, "GET"),
        ("/templates/{template_id}/files/{files_hash}", files, "GET"),
        (FILES_PATH + "{files_hash}", upload, "PUT"),
        ("/templates/aliases/{alias}", alias, "GET"),
        ("/templates/tags", assign, "POST"), ("/templates/tags", untag, "DELETE"),
        ("/templates", list_templates, "GET"), ("/templates/{template_id}", get, "GET"),
        ("/templates/{template_id}", delete, "DELETE"), ("/templates/{template_id}", patch, "PATCH"),
        ("/v2/templates/{template_id}", patch, "PATCH"),
        ("/templates/{template_id}/tags", tags, "GET"),
    ]
    add_routes(app, routes)
