"""E2B's control-plane REST API (the part of E2B's OpenAPI document the SDKs use for
sandboxes) over dsec's own: create from a template, list, get, kill, timeout, pause,
resume/connect. Templates map to dsec layer stacks (dsec.faces.e2b.template): a layer ref
(``base/debian:12``) is used as is; E2B's default template ``base`` is Debian with E2B's
unprivileged ``user``. E2B
metadata are labels, envVars the sandbox's environment, the timeout its remaining
lifetime. Errors are E2B's ``{"code", "message"}`` with the same HTTP statuses.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import builtins
import contextlib
import datetime
import json
import secrets
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from fastapi import FastAPI, Request
from pydantic import BaseModel, Field, ValidationError
from starlette.responses import JSONResponse, Response

from dsec.faces.e2b import network as e2b_network
from dsec.faces.e2b import startup
from dsec.faces.e2b.envd import ENVD_VERSION
from dsec.faces.e2b.network import NetworkOpts, NetworkUpdate
from dsec.faces.e2b.routing import add_routes
from dsec.faces.e2b.template import SNAPSHOT_ID_RE, Template, resolve, snapshot_ref
from dsec.faces.e2b.templates_api import TemplateSource
from dsec.node.edge.api import EdgeAPI
from dsec.node.layers.store import Layer, LayerStore
from dsec.shared.errors import DsecError, Forbidden, InvalidRequest, NotFound
from dsec.shared.wire.models import ContainerArgs, CreateRequest, SandboxInfo, SandboxState

DEFAULT_TIMEOUT_S = 300
MAX_TIMEOUT_S = 24 * 3600
METRICS_BUCKET_S = 5
TEMPLATE_LABEL = "e2b.template"


class Platform(Protocol):
    """What the E2B front end needs of the apiserver."""

    layers: LayerStore

    async def create(self, req: CreateRequest) -> SandboxInfo: ...
    async def list(self, job: str | None, labels: dict[str, str], usage: bool = False) -> list[SandboxInfo]: ...
    def edge_for(self, sandbox_id: str) -> EdgeAPI: ...
    async def layers_in_use(self) -> set[str]: ...
    async def stop(self, sandbox_id: str) -> SandboxInfo: ...
    async def pause(self, sandbox_id: str) -> SandboxInfo: ...
    async def resume(self, sandbox_id: str) -> SandboxInfo: ...
    async def publish(self, sandbox_id: str, ref: str, *, scrub_paths: builtins.list[str] | None = None,
                      default_scrub: bool = True, source: str | None = None, visibility: str | None = None
                      ) -> tuple[Layer, Any]: ...
    async def visible_layers(self, refs: builtins.list[str]) -> set[str]: ...
    async def may_change_layer(self, ref: str) -> bool: ...
    async def layer_removed(self, ref: str) -> None: ...


class NewSandbox(BaseModel):
    templateID: str
    timeout: int = Field(default=DEFAULT_TIMEOUT_S, ge=0, le=MAX_TIMEOUT_S)
    metadata: dict[str, str] = Field(default_factory=dict)
    envVars: dict[str, str] = Field(default_factory=dict)
    autoPause: bool = False
    allow_internet_access: bool | None = None  # E2B's API spells this one in snake case
    network: NetworkOpts | None = None
    model_config = {"extra": "ignore"}


Key = tuple[float, str]  # (creation time, id): what pages are ordered and resumed by


class ListQuery(BaseModel):
    states: set[str] = Field(default_factory=set)
    metadata: dict[str, str] = Field(default_factory=dict)
    template: str | None = None
    started_after: float | None = None
    started_before: float | None = None
    order: str = "desc"
    limit: int = Field(default=100, ge=1, le=1000)
    after: Key | None = None  # the key the previous page ended at


T = TypeVar("T")


def _page(items: list[T], key: Callable[[T], Key], desc: bool, after: Key | None,
          limit: int) -> tuple[list[T], str | None]:
    """One page of ``items`` in key order, starting past ``after``, and the token of the
    next page (the last key returned, so pages stay consistent while items come and go)."""
    items = sorted((i for i in items if after is None or (key(i) < after if desc else key(i) > after)),
                   key=key, reverse=desc)
    page = items[:limit]
    if len(items) <= limit:
        return page, None
    return page, base64.urlsafe_b64encode(json.dumps(list(key(page[-1]))).encode()).decode()


SNAPSHOT_PREFIX, SNAPSHOT_SOURCE = "ws/e2b-snapshot-", "e2b snapshot "
FORK_PREFIX, FORK_SOURCE = "ws/e2b-fork-", "e2b fork "
FORK_GRACE_S = 300.0  # an unused fork layer younger than this is kept (its creates may be under way)


def _snapshot_meta(layer: Layer) -> dict[str, Any] | None:
    if not (layer.ref.startswith(SNAPSHOT_PREFIX) and layer.source.startswith(SNAPSHOT_SOURCE)):
        return None
    try:
        meta = json.loads(layer.source[len(SNAPSHOT_SOURCE):])
    except ValueError:
        return None
    return meta if isinstance(meta, dict) else None


def _snapshot_info(layer: Layer) -> dict[str, Any]:
    name = (_snapshot_meta(layer) or {}).get("name")
    snapshot_id = layer.ref.removeprefix("ws/").removesuffix(":1")
    return {"snapshotID": snapshot_id, "names": [name] if name else [snapshot_id]}


def _parse_token(token: str) -> Key:
    try:
        created, sid = json.loads(base64.urlsafe_b64decode(token.encode()))
        return float(created), str(sid)
    except (ValueError, TypeError, binascii.Error):
        raise InvalidRequest("nextToken: not a token this server gave", field="nextToken") from None


def _parse_time(value: str, name: str) -> float:
    try:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise InvalidRequest(f"{name}: not an RFC 3339 time: {value!r}", field=name) from None


class SnapshotBody(BaseModel):
    name: str | None = Field(default=None, max_length=256)
    memory: bool | None = None  # files only here: a container's memory is not saved (see docs/e2b-compat.md)
    model_config = {"extra": "ignore"}


class ForkBody(BaseModel):
    timeout: int = Field(default=DEFAULT_TIMEOUT_S, ge=1, le=MAX_TIMEOUT_S)
    count: int = Field(default=1, ge=1, le=64)
    model_config = {"extra": "ignore"}


class TimeoutBody(BaseModel):
    timeout: int = Field(ge=0, le=MAX_TIMEOUT_S)
    model_config = {"extra": "ignore"}


class ConnectBody(BaseModel):
    timeout: int | None = Field(default=None, ge=0, le=MAX_TIMEOUT_S)
    model_config = {"extra": "ignore"}


def _reported(ts: float) -> float:
    """``ts`` at the microsecond it is reported as (datetime rounds to the nearest one)."""
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).timestamp()


def _iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).isoformat().replace("+00:00", "Z")


class E2BApi:
    def __init__(self, platform: Platform, access_token: Callable[[SandboxInfo], str],
                 traffic_token: Callable[[SandboxInfo], str], templates: TemplateSource | None = None) -> None:
        self.platform, self.access_token, self.traffic_token = platform, access_token, traffic_token
        self.templates = templates
        self.edge_for = platform.edge_for

    async def list_all(self) -> list[SandboxInfo]:
        return await self.platform.list(None, {})

    def _sandbox(self, info: SandboxInfo) -> dict[str, Any]:
        return {"templateID": info.labels.get(TEMPLATE_LABEL, info.image), "sandboxID": info.sandbox_id,
                "clientID": info.edge, "envdVersion": ENVD_VERSION,
                "envdAccessToken": self.access_token(info),  # bound to the token that made it (dsec.control.iam.bound)
                "trafficAccessToken": self.traffic_token(info)}

    def _listed(self, info: SandboxInfo) -> dict[str, Any]:
        end = info.expires_at or info.created_at + MAX_TIMEOUT_S
        return {**self._sandbox(info), "startedAt": _iso(info.created_at), "endAt": _iso(end),
                "cpuCount": max(1, round(info.cpu_cores_limit)), "memoryMB": info.memory_limit_mb,
                "diskSizeMB": 0,
                "metadata": {k: v for k, v in info.labels.items() if not k.startswith(("e2b.", "dsec."))},
                "state": "paused" if info.state == SandboxState.paused else "running"}

    async def _template(self, body: NewSandbox) -> Template:
        if self.templates is not None:
            found = await self.templates.from_metadata(body.templateID, body.metadata) or \
                await self.templates.lookup(body.templateID)
            if found is not None:
                return found
        return await asyncio.to_thread(resolve, body.templateID, self.platform.layers)

    async def create(self, body: NewSandbox) -> dict[str, Any]:
        template = await self._template(body)
        sizes: dict[str, Any] = {}
        if template.cpu_count:
            sizes["cpu_cores_limit"] = template.cpu_count
        if template.memory_mb:
            sizes["memory_limit_mb"] = template.memory_mb
        try:
            args = ContainerArgs(network_rules=e2b_network.rules(body.allow_internet_access, body.network),
                                 image=template.image, layers=template.layers, env={**template.envs, **body.envVars},
                                 labels={**body.metadata, TEMPLATE_LABEL: body.templateID},
                                 max_lifetime_s=max(1, body.timeout or DEFAULT_TIMEOUT_S), ttl_running_stop=None,
                                 on_expiry="pause" if body.autoPause else "stop",
                                 ttl_running_pause=None, workdir=template.workdir or "/root", **sizes)
        except ValidationError as e:
            raise InvalidRequest(f"templateID/metadata/envVars: {e.errors()[0]['msg']}", field="templateID") from None
        try:
            info = await self.platform.create(CreateRequest(args=args))
        except (NotFound, InvalidRequest) as e:
            if isinstance(e, InvalidRequest) and e.field not in ("image", "layers", "args.image"):
                raise
            raise NotFound(f"template {body.templateID!r} not found: {e.message}", field="templateID") from None
        if template.start or template.start_cmd:
            try:
                await startup.start(self.edge_for(info.sandbox_id), info.sandbox_id, template)
            except BaseException:
                await self.platform.stop(info.sandbox_id)
                raise
        return self._sandbox(info)

    async def _live(self, sandbox_id: str) -> tuple[EdgeAPI, SandboxInfo]:
        edge = self.edge_for(sandbox_id)
        info = await edge.get(sandbox_id)
        if info.state not in (SandboxState.running, SandboxState.paused):
            raise NotFound(f"sandbox {sandbox_id} not found (it {info.state.value})", field="sandbox_id")
        return edge, info

    async def update_network(self, sandbox_id: str, body: NetworkUpdate) -> None:
        """E2B's update replaces the sandbox's egress with what the body says."""
        edge, info = await self._live(sandbox_id)
        wanted = e2b_network.rules(body.allow_internet_access, body) or {}
        if info.network is None:
            if wanted:
                raise DsecConflict(f"sandbox {sandbox_id} was created without a network link (no network options "
                                   "and no internet on this node): create it with allow_internet_access or "
                                   "network.allowOut to change its egress later", field="sandbox_id")
            return
        delta = e2b_network.changes(info.network.rules, wanted)
        if delta:
            await edge.set_network_rules(sandbox_id, delta)

    async def snapshot(self, sandbox_id: str, name: str | None) -> dict[str, Any]:
        """A persistent snapshot of the sandbox's files: its writes as a workspace layer
        over the stack it runs on, which creating a sandbox from the snapshot's id restores."""
        edge, _ = await self._live(sandbox_id)
        source = SNAPSHOT_SOURCE + json.dumps({"sandbox": sandbox_id, "name": name})
        layer, _ = await self.platform.publish(sandbox_id, snapshot_ref(f"e2b-snapshot-{secrets.token_hex(6)}"),
                                               source=source, visibility="project")  # the team's, as in E2B
        return _snapshot_info(layer)

    async def snapshots(self, sandbox_id: str | None, name: str | None, limit: int,
                        after: Key | None) -> tuple[list[dict[str, Any]], str | None]:
        """The caller's project's (and public) snapshots, newest first, in pages keyed by
        (creation time, id)."""
        picked = []
        for layer in self.platform.layers.list():
            meta = _snapshot_meta(layer)
            if meta is None or (sandbox_id and meta.get("sandbox") != sandbox_id) or \
                    (name is not None and meta.get("name") != name):
                continue
            picked.append(layer)
        seen = await self.platform.visible_layers([x.ref for x in picked])
        picked = [x for x in picked if x.ref in seen]
        page, token = _page(picked, lambda layer: (layer.created_at, layer.ref), True, after, limit)
        return [_snapshot_info(x) for x in page], token

    async def delete_snapshot(self, snapshot_id: str) -> None:
        try:
            layer = self.platform.layers.get(snapshot_ref(snapshot_id)) if SNAPSHOT_ID_RE.match(snapshot_id) else None
        except (DsecError, ValueError):
            layer = None
        if layer is None or _snapshot_meta(layer) is None or not await self.platform.visible_layers([layer.ref]):
            raise NotFound(f"snapshot {snapshot_id!r} not found", field="templateID")
        if not await self.platform.may_change_layer(layer.ref):
            raise Forbidden(f"snapshot {snapshot_id!r} belongs to another project", field="templateID")
        self.platform.layers.remove(layer.ref, await self.platform.layers_in_use())
        await self.platform.layer_removed(layer.ref)

    async def fork(self, sandbox_id: str, count: int, timeout: int) -> list[dict[str, Any]]:
        """``count`` new sandboxes with the sandbox's files as they are now (its writes
        taken as a layer, as a snapshot is) and its template, metadata and limits; the
        original keeps running. Forks made are returned even if others fail."""
        edge, info = await self._live(sandbox_id)
        await self._drop_unused_forks()
        layer, _ = await self.platform.publish(sandbox_id, f"{FORK_PREFIX}{secrets.token_hex(6)}:1",
                                               source=FORK_SOURCE + json.dumps({"sandbox": sandbox_id}),
                                               visibility="private")
        image, layers = layer.stack()
        args = ContainerArgs(image=image, layers=layers, labels=info.labels, memory_limit_mb=info.memory_limit_mb,
                             cpu_cores_limit=info.cpu_cores_limit, max_lifetime_s=max(1, timeout),
                             ttl_running_stop=None, ttl_running_pause=None, workdir="/root")
        made = await asyncio.gather(*(self.platform.create(CreateRequest(args=args)) for _ in range(count)),
                                    return_exceptions=True)
        out: list[dict[str, Any]] = []
        for r in made:
            if isinstance(r, SandboxInfo):
                out.append({"sandbox": self._sandbox(r)})
            else:
                err = r if isinstance(r, DsecError) else DsecError(str(r))
                out.append({"error": {"code": err.status, "message": err.message}})
        return out

    async def _drop_unused_forks(self) -> None:
        """A fork's layer lives while its forks do: earlier ones no sandbox uses are dropped,
        the caller's own only, and not in their first minutes (a fork's creates may still be
        on their way to using it)."""
        in_use = await self.platform.layers_in_use()
        for layer in self.platform.layers.list():
            unused = layer.ref.startswith(FORK_PREFIX) and not set(layer.all_blobs) & in_use
            if unused and layer.created_at < time.time() - FORK_GRACE_S \
                    and await self.platform.may_change_layer(layer.ref):
                with contextlib.suppress(DsecError):
                    self.platform.layers.remove(layer.ref, in_use)
                    await self.platform.layer_removed(layer.ref)

    async def metrics(self, sandbox_id: str, start: float | None, end: float | None) -> list[dict[str, Any]]:
        """The sandbox's use now, from its cgroup and writable layer, stamped with the
        5-second bucket it falls in (no history is kept: a range that does not hold the
        current bucket is empty). CPU is its average since it started."""
        edge, info = await self._live(sandbox_id)
        now = time.time()
        bucket = now - now % METRICS_BUCKET_S
        if (start is not None and bucket < start - METRICS_BUCKET_S) or (end is not None and bucket > end):
            return []
        use = await edge.usage(sandbox_id)
        cores = max(info.cpu_cores_limit, 0.01)
        return [{"timestamp": _iso(bucket), "timestampUnix": int(bucket), "cpuCount": max(1, round(cores)),
                 "cpuUsedPct": round(100 * use.cpu_s / max(now - info.created_at, 1e-3) / cores, 2),
                 "memUsed": use.memory_bytes, "memTotal": info.memory_limit_mb << 20, "memCache": use.file_bytes,
                 "diskUsed": use.disk_bytes, "diskTotal": (info.disk_limit_mb or 0) << 20}]

    async def get(self, sandbox_id: str) -> dict[str, Any]:
        return self._listed((await self._live(sandbox_id))[1])

    async def list(self, q: ListQuery) -> tuple[list[dict[str, Any]], str | None]:
        """One page of the sandboxes ``q`` selects, ordered by start time (then id)."""
        picked = []
        for info in await self.list_all():
            state = "paused" if info.state == SandboxState.paused else \
                "running" if info.state == SandboxState.running else None
            if state is None or (q.states and state not in q.states) or TEMPLATE_LABEL not in info.labels:
                continue
            if any(info.labels.get(k) != v for k, v in q.metadata.items()):
                continue
            if q.template is not None and info.labels[TEMPLATE_LABEL] != q.template:
                continue
            started = _reported(info.created_at)  # as startedAt gave it, so a time read from there matches
            if (q.started_after is not None and started < q.started_after) or \
                    (q.started_before is not None and started > q.started_before):
                continue
            picked.append(info)
        page, token = _page(picked, lambda i: (i.created_at, i.sandbox_id), q.order == "desc", q.after, q.limit)
        return [self._listed(i) for i in page], token

    async def kill(self, sandbox_id: str) -> None:
        await self._live(sandbox_id)
        await self.platform.stop(sandbox_id)

    async def set_timeout(self, sandbox_id: str, timeout: int) -> None:
        await self.edge_for(sandbox_id).set_deadline(sandbox_id, timeout)

    async def pause(self, sandbox_id: str) -> None:
        edge = self.edge_for(sandbox_id)
        if (await edge.get(sandbox_id)).state == SandboxState.paused:
            raise DsecConflict(f"sandbox {sandbox_id} is already paused")
        await self.platform.pause(sandbox_id)

    async def connect(self, sandbox_id: str, timeout: int | None) -> tuple[int, dict[str, Any]]:
        edge, info = await self._live(sandbox_id)
        status = 200
        if info.state == SandboxState.paused:
            info = await self.platform.resume(sandbox_id)
            status = 201
            await edge.set_deadline(sandbox_id, timeout or DEFAULT_TIMEOUT_S)
        elif timeout and (info.expires_at is None or time.time() + timeout > info.expires_at):
            await edge.set_deadline(sandbox_id, timeout)  # connecting extends a running one, never shortens it
        return status, self._sandbox(info)


class DsecConflict(DsecError):
    status = 409
    code = "conflict"


def mount(app: FastAPI, api: E2BApi) -> None:
    async def create(request: Request) -> Response:
        body = NewSandbox.model_validate_json(await request.body())
        return JSONResponse(await api.create(body), status_code=201)

    async def list_sandboxes(request: Request) -> Response:
        q = request.query_params
        query = ListQuery(
            states={s for s in q.get("state", "").split(",") if s} if "/v2/" in request.url.path else {"running"},
            metadata=dict(urllib.parse.parse_qsl(q.get("metadata", ""))), template=q.get("template"),
            started_after=_parse_time(q["startedAfter"], "startedAfter") if q.get("startedAfter") else None,
            started_before=_parse_time(q["startedBefore"], "startedBefore") if q.get("startedBefore") else None,
            after=_parse_token(q["nextToken"]) if q.get("nextToken") else None)
        if q.get("order"):
            if q["order"] not in ("asc", "desc"):
                raise InvalidRequest(f"order: must be asc or desc, not {q['order']!r}", field="order")
            query.order = q["order"]
        if q.get("limit"):
            if not q["limit"].isdigit() or not 1 <= int(q["limit"]) <= 1000:
                raise InvalidRequest("limit: must be an integer from 1 to 1000", field="limit")
            query.limit = int(q["limit"])
        page, token = await api.list(query)
        return JSONResponse(page, headers={"x-next-token": token} if token else None)

    async def get(request: Request, sandbox_id: str) -> Response:
        return JSONResponse(await api.get(sandbox_id))

    async def kill(request: Request, sandbox_id: str) -> Response:
        await api.kill(sandbox_id)
        return Response(status_code=204)

    async def timeout(request: Request, sandbox_id: str) -> Response:
        await api.set_timeout(sandbox_id, TimeoutBody.model_validate_json(await request.body()).timeout)
        return Response(status_code=204)

    async def pause(request: Request, sandbox_id: str) -> Response:
        await api.pause(sandbox_id)
        return Response(status_code=204)

    async def connect(request: Request, sandbox_id: str) -> Response:
        raw = await request.body()
        body = ConnectBody.model_validate_json(raw) if raw.strip() else None
        status, out = await api.connect(sandbox_id, body.timeout if body else None)
        return JSONResponse(out, status_code=status)

    async def update_network(request: Request, sandbox_id: str) -> Response:
        await api.update_network(sandbox_id, NetworkUpdate.model_validate_json(await request.body()))
        return Response(status_code=204)

    async def snapshot(request: Request, sandbox_id: str) -> Response:
        raw = await request.body()
        body = SnapshotBody.model_validate_json(raw) if raw.strip() else SnapshotBody()
        return JSONResponse(await api.snapshot(sandbox_id, body.name), status_code=201)

    async def snapshots(request: Request) -> Response:
        q = request.query_params
        limit = q.get("limit", "100")
        if not limit.isdigit() or not 1 <= int(limit) <= 1000:
            raise InvalidRequest("limit: must be an integer from 1 to 1000", field="limit")
        page, token = await api.snapshots(q.get("sandboxID"), q.get("name"), int(limit),
                                    _parse_token(q["nextToken"]) if q.get("nextToken") else None)
        return JSONResponse(page, headers={"x-next-token": token} if token else None)

    async def fork(request: Request, sandbox_id: str) -> Response:
        raw = await request.body()
        body = ForkBody.model_validate_json(raw) if raw.strip() else ForkBody()
        return JSONResponse(await api.fork(sandbox_id, body.count, body.timeout), status_code=201)

    async def metrics(request: Request, sandbox_id: str) -> Response:
        q = request.query_params

        def when(name: str) -> float | None:
            raw = q.get(name)
            if not raw:
                return None
            if not raw.isdigit():
                raise InvalidRequest(f"{name}: unix seconds, not {raw!r}", field=name)
            return float(raw)
        return JSONResponse(await api.metrics(sandbox_id, when("start"), when("end")))

    routes: list[tuple[str, Callable[..., Awaitable[Response]], str]] = [
        ("/sandboxes", create, "POST"), ("/v2/sandboxes", create, "POST"),
        ("/sandboxes", list_sandboxes, "GET"), ("/v2/sandboxes", list_sandboxes, "GET"),
        ("/sandboxes/{sandbox_id}", get, "GET"), ("/sandboxes/{sandbox_id}", kill, "DELETE"),
        ("/sandboxes/{sandbox_id}/timeout", timeout, "POST"), ("/sandboxes/{sandbox_id}/pause", pause, "POST"),
        ("/sandboxes/{sandbox_id}/resume", connect, "POST"), ("/sandboxes/{sandbox_id}/connect", connect, "POST"),
        ("/v2/sandboxes/{sandbox_id}/connect", connect, "POST"),
        ("/sandboxes/{sandbox_id}/snapshots", snapshot, "POST"), ("/snapshots", snapshots, "GET"),
("/sandboxes/{sandbox_id}/fork", fork, "POST"),
        ("/sandboxes/{sandbox_id}/metrics", metrics, "GET"), ("/sandboxes/{sandbox_id}/network", update_network, "PUT")]
    add_routes(app, routes)


