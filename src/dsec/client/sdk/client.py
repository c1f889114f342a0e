"""The async SDK: one client over dsec's REST API (aiohttp underneath: its C HTTP
parser keeps the client's share of an exec round trip near 0.5 ms). The sync twin in
:mod:`dsec.client.sdk.sync` drives this same core, so the two can never drift apart.

A sandbox handle is just its id plus the client: any process holding the id can
``connect`` to it and carry on, because the sandbox belongs to the platform, not to
the process that made it.
"""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import Sequence
from typing import Any

import aiohttp

from dsec.client.sdk.batches import AsyncBatch
from dsec.client.sdk.console import AsyncConsole
from dsec.client.sdk.iam import AsyncProjects
from dsec.client.sdk.jobs import AsyncJob
from dsec.client.sdk.nodes import AsyncNodes
from dsec.client.sdk.rollouts import AsyncRollouts
from dsec.client.sdk.sandbox import AsyncSandbox
from dsec.client.sdk.transport import (
    _NEVER_SENT,
    REPLICA_CONNECT_TIMEOUT_S,
    Response,
    _filters,
    _idempotent,
    _is_dsec_error,
    _keyed_exec,
    _parse_urls,
    _raise_for,
    _reason,
    _Replicas,
    _route_of,
    _transport_error,
    _what,
    default_token,
    default_url,
)
from dsec.shared import tracing
from dsec.shared.errors import DsecError, EdgeUnavailable
from dsec.shared.wire.batches import BatchInfo
from dsec.shared.wire.iam import IamEvent, TokenInfo
from dsec.shared.wire.jobs import JobInfo, JobQuota, JobSpec
from dsec.shared.wire.layers import Layer
from dsec.shared.wire.models import (
    FNCALL_IMAGE,
    ContainerArgs,
    CreateRequest,
    FnCallArgs,
    FnCallResult,
    ForkRequest,
    MicroVMArgs,
    SandboxInfo,
    StorageStats,
    VMArgs,
)


class AsyncClient:
    """``url``: the apiserver, or several replicas of it (a list, or comma-separated; the
    default is $DSEC_URL, else the local one). With several, requests go to the first
    until it fails, then to the next (see docs/api.md, "Several apiservers")."""

    def __init__(self, url: str | Sequence[str] | None = None, token: str | None = None,
                 timeout: float = 60.0) -> None:
        tracing.setup("dsec-sdk")  # off unless OTEL_EXPORTER_OTLP_ENDPOINT (docs/tracing.md)
        self.urls = _parse_urls(url or default_url())
        self._url = self.urls[0]
        # None with one URL: the request path then is exactly the single-server one
        self._replicas = _Replicas(self.urls) if len(self.urls) > 1 else None
        self.token = token if token is not None else default_token()
        self.timeout = timeout
        self._headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self._http: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        """The apiserver in use: the URL given, or of several the replica that answered
        last (the first before any did). ``urls`` has them all."""
        return self._url if self._replicas is None else self.urls[self._replicas.current]

    async def _session(self) -> aiohttp.ClientSession:
        # made on first use: an aiohttp session belongs to the loop that runs it
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(
                # several replicas share one pool; each request names its replica in full
                self._url if self._replicas is None else None,
                headers=self._headers, timeout=aiohttp.ClientTimeout(total=self.timeout),
                # idle connections are dropped well before the server's keep-alive (65 s) ends
                # them: reusing one the server is closing fails a request that is not retried
                connector=aiohttp.TCPConnector(limit=256, force_close=False, keepalive_timeout=30))
        return self._http

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()

    async def _request(self, method: str, path: str, *, params: Any = None, json: Any = None,
                       content: bytes | str | None = None, headers: dict[str, str] | None = None,
                       timeout: float | None = None, check: bool = True) -> Response:
        if not tracing.on():
            return await self._send(method, path, params, json, content, headers, timeout, check)
        with tracing.span(f"dsec {method} {_route_of(path)}", kind="client", **{
                "http.request.method": method, "url.path": path}) as s:
            headers = dict(headers or {})
            tracing.inject(headers)
            try:
                resp = await self._send(method, path, params, json, content, headers, timeout, check)
            except DsecError as e:
                s.set_attribute("http.response.status_code", e.status)
                tracing.failed(s, f"{e.code}: {e.message}")
                raise
            s.set_attribute("http.response.status_code", resp.status_code)
            return resp

    async def _send(self, method: str, path: str, params: Any, json: Any, content: bytes | str | None,
                    headers: dict[str, str] | None, timeout: float | None, check: bool) -> Response:
        http = await self._session()
        kw: dict[str, Any] = {"params": params, "headers": headers}
        if json is not None:
            kw["json"] = json
        if content is not None:
            kw["data"] = content
        if timeout is not None:
            kw["timeout"] = aiohttp.ClientTimeout(total=timeout)
        if self._replicas is not None:
            async with await self._replicated(http, method, path, kw, timeout, buffer=True, ours=check) as r:
                resp = Response(r.status, await r.read(), dict(r.headers))
        else:
            try:
                async with http.request(method, path, **kw) as r:
                    resp = Response(r.status, await r.read(), dict(r.headers))
            except (aiohttp.ClientError, TimeoutError) as e:
                raise _transport_error(e, self._url, method, path, timeout) from e
        if check:
            _raise_for(resp, method, path)
        return resp

    async def _open(self, method: str, path: str, kw: dict[str, Any], timeout: float) -> aiohttp.ClientResponse:
        """A response whose headers are in and whose body is the caller's to read (a stream)."""
        if not tracing.on():
            return await self._open_stream(method, path, kw, timeout)
        # the client span ends with the response's headers; the apiserver's span covers the stream
        with tracing.span(f"dsec {method} {_route_of(path)}", kind="client", stream=True, **{
                "http.request.method": method, "url.path": path}) as s:
            kw["headers"] = dict(kw.get("headers") or {})
            tracing.inject(kw["headers"])
            resp = await self._open_stream(method, path, kw, timeout)
            s.set_attribute("http.response.status_code", resp.status)
            if resp.status >= 400:
                tracing.failed(s, f"HTTP {resp.status}")
            return resp

    async def _open_stream(self, method: str, path: str, kw: dict[str, Any], timeout: float) -> aiohttp.ClientResponse:
        http = await self._session()
        if self._replicas is not None:
            return await self._replicated(http, method, path, kw, timeout, buffer=False, ours=True)
        try:
            return await http.request(method, path, **kw)
        except (aiohttp.ClientError, TimeoutError) as e:
            raise _transport_error(e, self._url, method, path, timeout) from e

    async def _replicated(self, http: aiohttp.ClientSession, method: str, path: str, kw: dict[str, Any],
                          timeout: float | None, *, buffer: bool, ours: bool) -> aiohttp.ClientResponse:
        """A response from the first replica that gives one. A request goes on to the next
        replica when it provably never left (the connection was never made), or when it is
        idempotent and the replica failed under it (connection dropped, or a bare 502/503
        from a proxy in front of it). Otherwise whether it was carried out is unknown, and
        it is not sent again. ``buffer``: the body is read here (and a drop while reading
        it is a failure like any other); else only the headers. ``ours``: the status is
        dsec's; else it is a server's in a sandbox (``http``), which may say 502 as it likes
        and is never taken for a failed replica."""
        replicas = self._replicas
        assert replicas is not None
        total = self.timeout if timeout is None else timeout
        kw["timeout"] = aiohttp.ClientTimeout(total=total, sock_connect=min(REPLICA_CONNECT_TIMEOUT_S, total))
        idempotent = _idempotent(method, path) or _keyed_exec(method, path, kw.get("json"))
        failures: list[str] = []
        for i in replicas.order():
            url = replicas.urls[i]
            try:
                r = await http.request(method, url + path, **kw)
                bare = ours and r.status in (502, 503)
                if buffer or bare:
                    await r.read()  # closes the response should it fail
            except _NEVER_SENT as e:
                replicas.failed(i)
                failures.append(f"{url} ({_reason(e)})")
                continue
            except TimeoutError as e:  # the request's own deadline: every replica would need it again
                raise _transport_error(e, url, method, path, timeout) from e
            except aiohttp.ClientError as e:
                replicas.failed(i)
                if not idempotent:
                    raise self._unknown_outcome(method, path, url, f"the connection broke: {_reason(e)}") from e
                failures.append(f"{url} ({_reason(e)})")
                continue
            if bare and not _is_dsec_error(await r.read()):
                r.release()
                replicas.failed(i)
                if not idempotent:
                    raise self._unknown_outcome(method, path, url, f"a bare HTTP {r.status} came back")
                failures.append(f"{url} (HTTP {r.status})")
                continue
            replicas.answered(i)
            return r
        sid, op, what = _what(method, path)
        raise EdgeUnavailable(f"{what}: no dsec apiserver answered; tried {', '.join(failures)}",
                              sandbox_id=sid, operation=op)

    @staticmethod
    def _unknown_outcome(method: str, path: str, url: str, why: str) -> EdgeUnavailable:
        sid, op, what = _what(method, path)
        return EdgeUnavailable(f"{what}: dsec at {url} failed after the request was sent ({why}): it may or may "
                               "not have been carried out, so it was not repeated on another replica; look "
                               "before trying again", sandbox_id=sid, operation=op)

    async def _json(self, method: str, path: str, **kw: Any) -> Any:
        return (await self._request(method, path, **kw)).json()

    async def run_container(self, args: ContainerArgs | None = None, *, timeout: float = 120.0) -> AsyncSandbox:
        """Create a container sandbox and return its handle once it accepts commands."""
        return await self._create(args or ContainerArgs(), timeout)

    create = run_container

    async def run_microvm(self, args: MicroVMArgs | None = None, *, timeout: float = 300.0) -> AsyncSandbox:
        """Create a microVM sandbox (QEMU -M microvm); the same handle as a container's."""
        return await self._create(args or MicroVMArgs(), timeout)

    async def run_vm(self, args: VMArgs | None = None, *, timeout: float = 300.0) -> AsyncSandbox:
        """Create a full VM sandbox (QEMU q35, with a display for screenshots and input)."""
        return await self._create(args or VMArgs(), timeout)

    async def _create(self, args: ContainerArgs | MicroVMArgs | VMArgs, timeout: float) -> AsyncSandbox:
        body = CreateRequest(args=args).model_dump(mode="json")
        info = SandboxInfo.model_validate(await self._json("POST", "/v1/sandboxes", json=body, timeout=timeout))
        return AsyncSandbox(self, info)

    async def create_many(self, args: ContainerArgs | MicroVMArgs | VMArgs, n: int, job: str | None = None,
                          *, all_or_nothing: bool = False) -> AsyncBatch:
        """``n`` sandboxes (up to 32,768) of ``args``, made by the platform in the background a
        bounded number at a time per edge: returns at once with the batch's handle
        (``progress()``, ``result()`` -> (sandboxes, failures), ``cancel()``).

        ``all_or_nothing`` (a gang, for a rollout step that needs all n): the project's quota
        and edge room for all n are held before the call returns, or it raises at once naming
        the shortfall (QuotaExceeded, AdmissionRejected, JobNotActive) and nothing is made;
        should an item still fail, the batch ends ``failed`` and what it made is stopped."""
        # checked by the platform (an n out of range is its InvalidRequest naming ``n``)
        body = {"args": CreateRequest(args=args).model_dump(mode="json")["args"], "n": n,
                **({"job": job} if job is not None else {}), **({"all_or_nothing": True} if all_or_nothing else {})}
        return AsyncBatch(self, BatchInfo.model_validate(await self._json("POST", "/v1/batches", json=body)))

    @property
    def projects(self) -> AsyncProjects:
        """The project tree (docs/iam.md): create sub-projects with quotas, usage, delete."""
        return AsyncProjects(self)

    @property
    def rollouts(self) -> AsyncRollouts:
        """The rollout service (docs/rl.md, "Rollouts that outlive the trainer"): submit agent
        loops for the platform's workers, stream the finished ones, acknowledge them."""
        return AsyncRollouts(self)

    async def batch(self, batch_id: str) -> AsyncBatch:
        """A handle to an existing batch, from any process."""
        return AsyncBatch(self, BatchInfo.model_validate(await self._json(
            "GET", f"/v1/batches/{batch_id}", params={"limit": 0})))

    async def connect(self, sandbox_id: str) -> AsyncSandbox:
        """A handle to an existing sandbox, from any process."""
        info = SandboxInfo.model_validate(await self._json("GET", f"/v1/sandboxes/{sandbox_id}"))
        return AsyncSandbox(self, info)

    async def list(self, job: str | None = None, labels: dict[str, str] | None = None,
                   usage: bool = False) -> list[SandboxInfo]:
        """Sandboxes on every edge; ``usage=True`` fills each one's ``usage`` (CPU, memory, swap, disk, ...)."""
        params = _filters(job, labels) + ([("usage", "true")] if usage else [])
        data = await self._json("GET", "/v1/sandboxes", params=params)
        return [SandboxInfo.model_validate(x) for x in data]

    async def fork(self, snapshot: Layer | str, n: int = 1, args: ContainerArgs | None = None,
                   *, timeout: float = 300.0) -> builtins.list[AsyncSandbox]:
        """``n`` new sandboxes from a pack_diff snapshot, each stacked as the snapshot was
        taken; ``args`` sets limits, TTLs and labels."""
        ref = snapshot.ref if isinstance(snapshot, Layer) else snapshot
        body = ForkRequest(snapshot=ref, n=n, args=args).model_dump(mode="json", exclude_none=True)
        data = await self._json("POST", "/v1/fork", json=body, timeout=timeout)
        return [AsyncSandbox(self, SandboxInfo.model_validate(x)) for x in data]

    async def layers(self) -> builtins.list[Layer]:
        return [Layer.model_validate(x) for x in await self._json("GET", "/v1/layers")]

    async def layer(self, ref: str) -> Layer:
        return Layer.model_validate(await self._json("GET", f"/v1/layers/{ref}"))

    async def remove_layer(self, ref: str) -> Layer:
        return Layer.model_validate(await self._json("DELETE", f"/v1/layers/{ref}"))

    async def set_layer_visibility(self, ref: str, visibility: str) -> Layer:
        """Who may see and use layer ``ref``: "public", "project" (its owner project's subtree)
        or "private" (the owner project alone); admins of the owner or above see it in all three."""
        return Layer.model_validate(await self._json("PATCH", f"/v1/layers/{ref}", json={"visibility": visibility}))

    async def gc_layers(self) -> builtins.list[str]:
        return list((await self._json("POST", "/v1/layers/gc"))["removed_blobs"])

    async def pause_many(self, job: str | None = None, labels: dict[str, str] | None = None,
                         *, timeout: float = 600.0) -> builtins.list[SandboxInfo]:
        """Pause every running sandbox of a job (and/or with these labels) across edges."""
        data = await self._json("POST", "/v1/sandboxes/pause", params=_filters(job, labels), timeout=timeout)
        return [SandboxInfo.model_validate(x) for x in data]

    async def resume_many(self, job: str | None = None, labels: dict[str, str] | None = None,
                          *, timeout: float = 600.0) -> builtins.list[SandboxInfo]:
        data = await self._json("POST", "/v1/sandboxes/resume", params=_filters(job, labels), timeout=timeout)
        return [SandboxInfo.model_validate(x) for x in data]

    async def stop_many(self, job: str | None = None, labels: dict[str, str] | None = None
                        ) -> builtins.list[SandboxInfo]:
        """Stop every running sandbox of ``job`` (and/or carrying ``labels``)."""
        data = await self._json("DELETE", "/v1/sandboxes", params=_filters(job, labels))
        return [SandboxInfo.model_validate(x) for x in data]

    async def fncall(self, args: FnCallArgs, timeout: float = 600.0) -> FnCallResult:
        """Run code in a pooled warm container: one run of ``args.stdin``, or compile once
        and run every test case with an online-judge verdict each."""
        return FnCallResult.model_validate(await self._json("POST", "/v1/fncall", json=args.model_dump(),
                                                            timeout=timeout))

    async def fncall_many(self, calls: builtins.list[FnCallArgs], concurrency: int = 8,
                          timeout: float = 600.0) -> builtins.list[FnCallResult]:
        """Results in the order of ``calls``, at most ``concurrency`` in flight."""
        gate = asyncio.Semaphore(max(1, concurrency))

        async def one(a: FnCallArgs) -> FnCallResult:
            async with gate:
                return await self.fncall(a, timeout)

        return list(await asyncio.gather(*(one(a) for a in calls)))

    async def fncall_languages(self, image: str = FNCALL_IMAGE) -> builtins.list[str]:
        return list(await self._json("GET", "/v1/fncall/languages", params={"image": image}))

    async def storage_stats(self) -> builtins.list[StorageStats]:
        """Per edge: layer store kind, fetch mode, chunk cache, and bytes fetched per data blob."""
        return [StorageStats.model_validate(x) for x in await self._json("GET", "/v1/storage")]

    async def create_token(self, project: str, role: str, name: str = "", *, ttl_s: float | None = None
                           ) -> TokenInfo:
        """(a cluster admin, or an admin of ``project`` or above) A token for ``project`` with
        role ``admin`` (of its subtree), ``builder``, ``runner`` or ``reader``, expiring
        ``ttl_s`` seconds from now if given; the secret is in ``.token`` of this answer only."""
        body: dict[str, Any] = {"project": project, "role": role, "name": name}
        if ttl_s is not None:
            body["ttl_s"] = ttl_s
        return TokenInfo.model_validate(await self._json("POST", "/v1/tokens", json=body))

    async def iam_events(self, after: int = 0, limit: int = 1000) -> builtins.list[IamEvent]:
        """(admin) IAM changes after event ``after``, oldest first: who, what, when."""
        return [IamEvent.model_validate(x) for x in await self._json(
            "GET", "/v1/iam/events", params={"after": after, "limit": limit})]

    async def tokens(self) -> builtins.list[TokenInfo]:
        return [TokenInfo.model_validate(x) for x in await self._json("GET", "/v1/tokens")]

    async def revoke_token(self, token_id: str) -> None:
        await self._json("DELETE", f"/v1/tokens/{token_id}")

    @property
    def console(self) -> AsyncConsole:
        """What the web console and ``dsec top`` read (docs/console.md): ``.fleet()``,
        ``.sandboxes(sort="-cpu", ...)``, ``.batches()``, ``.fncall()``, ``.layers()``."""
        return AsyncConsole(self)

    @property
    def nodes(self) -> AsyncNodes:
        """The fleet (docs/fault-tolerance.md): ``await client.nodes()`` lists every edge with
        its load and health; ``.get``, ``.cordon``, ``.uncordon``, ``.events``."""
        return AsyncNodes(self)

    async def create_job(self, name: str, *, quota: JobQuota | None = None, labels: dict[str, str] | None = None,
                         project: str | None = None, checkpoint_every_s: int | None = None) -> AsyncJob:
        """A job: a named group of sandboxes (those created with ``job=name``) with a quota on
        their count, CPU cores and memory, paused, resumed and stopped as one. ``project``:
        admin tokens only (others act in their token's project). ``checkpoint_every_s``: its
        container sandboxes are checkpointed this often unless they say otherwise."""
        body = JobSpec(name=name, labels=labels or {}, quota=quota or JobQuota(),
                       checkpoint_every_s=checkpoint_every_s).model_dump(mode="json")
        params = {"project": project} if project else None
        return AsyncJob(self, JobInfo.model_validate(await self._json("POST", "/v1/jobs", json=body, params=params)))

    async def job(self, name: str, *, project: str | None = None) -> AsyncJob:
        """The handle of an existing job, from any process."""
        params = {"project": project} if project else None
        return AsyncJob(self, JobInfo.model_validate(await self._json("GET", f"/v1/jobs/{name}", params=params)))

    async def jobs(self, labels: dict[str, str] | None = None, state: str | None = None,
                   project: str | None = None) -> builtins.list[JobInfo]:
        """The jobs of this token's project (an admin token: every project's), those with ``labels``."""
        params = _filters(None, labels) + ([("state", state)] if state else []) + \
            ([("project", project)] if project else [])
        return [JobInfo.model_validate(x) for x in await self._json("GET", "/v1/jobs", params=params)]
