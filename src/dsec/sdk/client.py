"""The async SDK: one client over dsec's REST API (aiohttp underneath: its C HTTP
parser keeps the client's share of an exec round trip near 0.5 ms). The sync twin in
:mod:`dsec.sdk.sync` drives this same core, so the two can never drift apart.

A sandbox handle is just its id plus the client: any process holding the id can
``connect`` to it and carry on, because the sandbox belongs to the platform, not to
the process that made it.
"""

from __future__ import annotations

import asyncio
import builtins
import json
import os
import re
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
from pydantic import ValidationError

from dsec import tracing
from dsec.errors import ERRORS_BY_CODE, DeadlineExceeded, DsecError, EdgeUnavailable, InvalidRequest, RateLimited
from dsec.sdk.batches import AsyncBatch
from dsec.sdk.console import AsyncConsole
from dsec.sdk.iam import AsyncProjects
from dsec.sdk.jobs import AsyncJob
from dsec.sdk.nodes import AsyncNodes
from dsec.sdk.rollouts import AsyncRollouts
from dsec.wire.batches import BatchInfo
from dsec.wire.fleet import CheckpointInfo
from dsec.wire.iam import IamEvent, TokenInfo
from dsec.wire.jobs import JobInfo, JobQuota, JobSpec
from dsec.wire.layers import Layer
from dsec.wire.models import (
    FNCALL_IMAGE,
    AuditRecord,
    ClickRequest,
    CommandRecord,
    ContainerArgs,
    CreateRequest,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileStat,
    FnCallArgs,
    FnCallResult,
    ForkRequest,
    KeysRequest,
    MicroVMArgs,
    NetworkInfo,
    PackDiffRequest,
    SandboxEvent,
    SandboxInfo,
    SandboxUsage,
    StorageStats,
    VMArgs,
)

DEFAULT_URL = "http://127.0.0.1:7777"
_ID = re.compile(r"/(sandboxes|jobs|batches|rollouts|layers|nodes|projects|tokens)/[^/]+")


def _route_of(path: str) -> str:
    """A path with its ids taken out: a span's name is the same for every sandbox."""
    return _ID.sub(lambda m: f"/{m.group(1)}/{{id}}", path)
# a replica that failed goes to the back of the queue this long: requests in the meantime
# go to the others first instead of paying for its failure again, yet one blip never
# takes it out of service for long
REPLICA_BACKOFF_S = 5.0
# with other replicas to go to, a host that swallows SYNs should cost seconds, not the
# request's whole timeout (two SYNs: the first retransmit comes after 1 s)
REPLICA_CONNECT_TIMEOUT_S = 3.0
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# the connection never got to carry the request: connect refused, timed out, DNS, TLS
_NEVER_SENT = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)


def default_url() -> str:
    return os.environ.get("DSEC_URL", DEFAULT_URL)


def _parse_urls(url: str | Sequence[str]) -> tuple[str, ...]:
    """The apiserver URLs of ``"http://a:7777,http://b:7777"`` or a list of them, in order."""
    items = url.split(",") if isinstance(url, str) else url
    urls = tuple(dict.fromkeys(u.strip().rstrip("/") for u in items if u.strip()))
    if not urls:
        raise ValueError("no apiserver URL given")
    for u in urls:
        if not u.startswith(("http://", "https://")):
            raise ValueError(f"apiserver URL {u!r} is not http://HOST:PORT or https://...")
    return urls


def default_token() -> str | None:
    if tok := os.environ.get("DSEC_TOKEN"):
        return tok
    path = os.path.join(os.environ.get("DSEC_DATA_DIR", "/var/lib/dsec"), "token")
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


@dataclass
class Response:
    """A buffered HTTP response."""

    status_code: int
    content: bytes
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return json.loads(self.content)


def _call_of(method: str, path: str) -> tuple[str | None, str]:
    """(sandbox id, operation) of a request path: ``POST /v1/sandboxes/ID/stop`` is
    (ID, "stop"); ``POST /v1/sandboxes`` is (None, "create")."""
    parts = [p for p in path.split("?")[0].split("/") if p]
    if len(parts) >= 2 and parts[1] == "sandboxes":
        if len(parts) == 2:
            return None, "create" if method == "POST" else "list"
        op = "/".join(parts[3:]) or {"GET": "get", "DELETE": "stop"}.get(method, method.lower())
        return parts[2], op
    return None, f"{method} {'/'.join(parts[1:]) or '/'}"


def _transport_error(e: BaseException, url: str, method: str, path: str, timeout: float | None) -> DsecError:
    """What the SDK raises when no answer came: says which call, on which sandbox, and why."""
    sid, op, what = _what(method, path)
    if isinstance(e, TimeoutError):
        return DeadlineExceeded(f"{what} got no answer from dsec at {url} within "
                                f"{timeout if timeout is not None else 'the session'}s timeout "
                                "(the request was sent; the platform may still finish it)",
                                sandbox_id=sid, operation=op)
    return EdgeUnavailable(f"{what}: cannot reach dsec at {url}: {e or type(e).__name__}",
                           sandbox_id=sid, operation=op)


def _idempotent(method: str, path: str) -> bool:
    """Whether a request that may have reached one replica may be sent again to another:
    reads, and stopping one sandbox (a stopped sandbox's record answers a second stop for an
    hour, and a late duplicate stop can undo no later request). Everything else (create,
    exec without a key, files, fork, pause, a job-wide stop whose selection could take in
    sandboxes made since, ...) is never repeated: its outcome is unknown."""
    if method in _SAFE_METHODS:
        return True
    return method == "DELETE" and _call_of(method, path)[1] == "stop"


def _keyed_exec(method: str, path: str, body: Any) -> bool:
    """An exec with a command-log key may be sent again: the edge runs it once and answers
    a repeat with its record (or waits for the run under way), whichever replica relays it."""
    return method == "POST" and path.endswith("/exec") and isinstance(body, dict) and bool(body.get("key"))


def _what(method: str, path: str) -> tuple[str | None, str, str]:
    """(sandbox id, operation, how an error message names the call)."""
    sid, op = _call_of(method, path)
    return sid, op, op + (f" of sandbox {sid}" if sid else "")


def _reason(e: BaseException) -> str:
    """Why a replica failed, short: "connection refused" rather than aiohttp's paragraph."""
    if isinstance(e, aiohttp.ConnectionTimeoutError):
        return "connect timed out"
    if isinstance(e, aiohttp.ClientConnectorError) and e.os_error.errno:
        return os.strerror(e.os_error.errno).lower()
    return str(e) or type(e).__name__


def _is_dsec_error(content: bytes) -> bool:
    """Whether a body is dsec's own error: a 503 carrying one (an edge is down) is an answer
    every replica would give, a bare one is a proxy's word that this replica is gone."""
    try:
        body = json.loads(content)
    except ValueError:
        return False
    return isinstance(body, dict) and "error" in body


def _raise_for(resp: Response, method: str = "", path: str = "") -> None:
    if resp.status_code < 400:
        return
    sid, op = _call_of(method, path) if path else (None, None)
    try:
        body = resp.json()
        cls = ERRORS_BY_CODE.get(body.get("error", ""), DsecError)
    except (ValueError, AttributeError):
        err = DsecError(f"HTTP {resp.status_code}: {resp.text[:500]}", sandbox_id=sid, operation=op)
        err.status = resp.status_code
        raise err from None
    err = cls(body.get("message", resp.text), field=body.get("field"), sandbox_id=sid, operation=op)
    if isinstance(err, RateLimited) and isinstance(body.get("retry_after"), (int, float)):
        err.retry_after = float(body["retry_after"])
    if cls is DsecError:  # a code this SDK does not know: the status still says whose failure it is
        err.status = resp.status_code
    raise err


def _filters(job: str | None, labels: dict[str, str] | None) -> list[tuple[str, str]]:
    """Query parameters selecting sandboxes by job and labels."""
    params = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
    if job:
        params.append(("job", job))
    return params


def _event(line: bytes) -> ExecEvent:
    item = json.loads(line)
    if item.get("type") == "error":
        cls = ERRORS_BY_CODE.get(item.get("error", ""), DsecError)
        raise cls(item.get("message", "exec failed"))
    return ExecEvent.model_validate(item)


def exec_request(cmd: str | list[str], timeout: float, env: dict[str, str] | None, cwd: str | None,
                 stdin: str | None, session: str | None, max_output_bytes: int | None,
                 key: str | None = None, uid: int | None = None, gid: int | None = None) -> ExecRequest:
    """The ExecRequest of a command (a string through the shell, a list directly), refused here
    as the server would refuse it."""
    kw: dict[str, Any] = {"timeout_s": timeout, "env": env or {}, "cwd": cwd, "stdin": stdin, "session": session,
                          "key": key, "uid": uid, "gid": gid}
    if max_output_bytes is not None:
        kw["max_output_bytes"] = max_output_bytes
    if isinstance(cmd, str):
        kw["cmd"] = cmd
    else:
        kw["argv"] = list(cmd)
    try:
        return ExecRequest(**kw)
    except ValidationError as e:  # the request is refused here as the server would: a typed 400
        err = e.errors()[0]
        field = ".".join(str(p) for p in err.get("loc", ())) or None
        raise InvalidRequest(f"{field}: {err['msg']}" if field else str(err["msg"]), field=field) from None


class AsyncSandbox:
    """Handle to one sandbox. Cheap to make; holds no connection of its own."""

    def __init__(self, client: AsyncClient, info: SandboxInfo) -> None:
        self._client = client
        self.info = info
        self.sandbox_id = info.sandbox_id

    def __repr__(self) -> str:
        return f"<AsyncSandbox {self.sandbox_id} {self.info.state.value}>"

    @property
    def _base(self) -> str:
        return f"/v1/sandboxes/{self.sandbox_id}"

    async def refresh(self) -> SandboxInfo:
        self.info = SandboxInfo.model_validate(await self._client._json("GET", self._base))
        return self.info

    async def exec(self, cmd: str | list[str], *, timeout: float = 300.0, env: dict[str, str] | None = None,
                   cwd: str | None = None, stdin: str | None = None, session: str | None = None,
                   max_output_bytes: int | None = None, key: str | None = None, uid: int | None = None,
                   gid: int | None = None) -> ExecResult:
        """Run one command. A string runs through the sandbox's shell, a list directly.
        With ``session`` it runs in that persistent shell session. With ``key`` it is recorded
        in the sandbox's command log: the same key again returns the recorded result
        (``replayed``) and runs nothing (docs/rl.md). ``uid``/``gid``: run as that user
        (default root; not with a session)."""
        req = exec_request(cmd, timeout, env, cwd, stdin, session, max_output_bytes, key, uid, gid)
        data = await self._client._json("POST", f"{self._base}/exec", json=req.model_dump(exclude_none=True),
                                        timeout=timeout + 30)
        return ExecResult.model_validate(data)

    async def run_shell(self, cmd: str, *, session: str = "default", timeout: float = 300.0,
                        env: dict[str, str] | None = None, cwd: str | None = None,
                        key: str | None = None) -> ExecResult:
        """Run ``cmd`` in a persistent shell session: cwd, env and background jobs carry over.
        ``key``: record it in the command log, as for :meth:`exec`."""
        return await self.exec(cmd, session=session, timeout=timeout, env=env, cwd=cwd, key=key)

    async def exec_stream(self, cmd: str | list[str], *, timeout: float = 300.0,
                          env: dict[str, str] | None = None, cwd: str | None = None,
                          session: str | None = None, key: str | None = None, uid: int | None = None,
                          gid: int | None = None) -> AsyncIterator[ExecEvent]:
        """Yield stdout/stderr as produced, then a final ``result`` event. With ``key``, a
        recorded result comes back as its output's events and the result, and closing the
        stream does not end the command (a retry with the key waits for it)."""
        req = exec_request(cmd, timeout, env, cwd, None, session, None, key, uid, gid)
        resp = await self._client._open("POST", f"{self._base}/exec", {
            "params": {"stream": "true"}, "json": req.model_dump(exclude_none=True),
            "timeout": aiohttp.ClientTimeout(total=timeout + 30)}, timeout + 30)
        async with resp:
            if resp.status >= 400:
                _raise_for(Response(resp.status, await resp.read()), "POST", f"{self._base}/exec")
            buf = b""
            async for chunk in resp.content.iter_any():  # events can be longer than a "line" limit
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield _event(line)
            if buf.strip():
                yield _event(buf)

    async def command_log(self, *, after: int = 0, limit: int = 1000) -> builtins.list[CommandRecord]:
        """The keyed commands run here, in the order they started (``seq`` past ``after``),
        each with its recorded result (output capped; docs/rl.md)."""
        data = await self._client._json("GET", f"{self._base}/commands", params={"after": after, "limit": limit})
        return [CommandRecord.model_validate(x) for x in data]

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        body = data.encode() if isinstance(data, str) else data
        await self._client._request("PUT", f"{self._base}/files", params={"path": path, "mode": str(mode)},
                                    content=body)

    async def read_file(self, path: str) -> bytes:
        resp = await self._client._request("GET", f"{self._base}/files", params={"path": path})
        return resp.content

    async def list_dir(self, path: str) -> list[FileStat]:
        data = await self._client._json("GET", f"{self._base}/files/list", params={"path": path})
        return [FileStat.model_validate(x) for x in data]

    async def stat(self, path: str) -> FileStat:
        return FileStat.model_validate(await self._client._json("GET", f"{self._base}/files/stat",
                                                                params={"path": path}))

    async def remove(self, path: str, recursive: bool = False) -> None:
        await self._client._request("DELETE", f"{self._base}/files",
                                    params={"path": path, "recursive": str(recursive).lower()})

    async def http(self, port: int, path: str = "/", method: str = "GET", *, headers: dict[str, str] | None = None,
                   content: bytes | str | None = None, timeout: float = 60.0) -> Response:
        """An HTTP request to ``port`` inside the sandbox, through the apiserver; the
        in-sandbox server's status and body come back as they are."""
        return await self._client._request(method, f"{self._base}/ports/{port}/{path.lstrip('/')}",
                                           headers=headers, content=content, timeout=timeout, check=False)

    def tty_url(self, cols: int = 80, rows: int = 24) -> str:
        """The TTY websocket on the replica in use, the one that answered last: live a
        moment ago (a websocket client that is refused may ``refresh`` and ask again)."""
        base = self._client.url.rstrip("/").replace("http", "ws", 1)
        return f"{base}{self._base}/tty?cols={cols}&rows={rows}"

    async def pack_diff(self, ref: str, *, scrub_paths: builtins.list[str] | None = None,
                        default_scrub: bool = True, visibility: str | None = None, timeout: float = 600.0
                        ) -> Layer:
        """Snapshot this sandbox's writes as workspace layer ``ref`` (incremental over its
        stack, deletions kept as whiteouts, build residue scrubbed). It belongs to the
        sandbox's project; ``visibility``: "public" (every project), "project" (the project's
        subtree, the default) or "private" (the project alone). A sandbox of no project (the
        cluster admin's own) publishes a public layer unless one is named (docs/iam.md)."""
        fields: dict[str, object] = {"ref": ref, "scrub_paths": scrub_paths or [], "default_scrub": default_scrub}
        if visibility is not None:
            fields["visibility"] = visibility
        body = PackDiffRequest.model_validate(fields)
        return Layer.model_validate(await self._client._json("POST", f"{self._base}/pack_diff",
                                                             json=body.model_dump(exclude_unset=True),
                                                             timeout=timeout))

    async def checkpoint(self, *, full: bool = False, timeout: float = 600.0) -> CheckpointInfo:
        """Take a checkpoint now (sandboxes created with ``checkpoint_every_s`` are also
        checkpointed on schedule): what changed in its writable layer since the last one,
        after a freeze of milliseconds, with its command log (docs/fault-tolerance.md)."""
        return CheckpointInfo.model_validate(await self._client._json(
            "POST", f"{self._base}/checkpoint", json={"full": full}, timeout=timeout))

    async def checkpoints(self) -> builtins.list[CheckpointInfo]:
        """Its checkpoints in the store, oldest first (retention keeps the newest chains)."""
        return [CheckpointInfo.model_validate(c) for c in await self._client._json("GET", f"{self._base}/checkpoints")]

    async def move(self, *, timeout: float = 330.0) -> SandboxInfo:
        """Move it to another edge (cluster admins): paused, checkpointed, restored there
        under the same id, its processes restarted; its files and command log come along."""
        self.info = SandboxInfo.model_validate(await self._client._json("POST", f"{self._base}/move",
                                                                        timeout=timeout))
        return self.info

    async def restore(self, *, timeout: float = 600.0) -> SandboxInfo:
        """Bring it back from its newest checkpoint on another edge after its node was lost
        (the cluster does this by itself; this retries one whose restore failed)."""
        self.info = SandboxInfo.model_validate(await self._client._json("POST", f"{self._base}/restore",
                                                                        timeout=timeout))
        return self.info

    async def events(self) -> builtins.list[SandboxEvent]:
        """What happened to this sandbox: creation, prefetch, storage errors, access lists saved, ..."""
        return [SandboxEvent.model_validate(x) for x in await self._client._json("GET", f"{self._base}/events")]

    async def save_access_list(self) -> dict[str, int]:
        """For a ``record_access`` sandbox: save the chunks read so far as its layers'
        access lists now (it also happens when the sandbox stops). Data blob -> chunks."""
        return dict(await self._client._json("POST", f"{self._base}/access_list"))

    async def audit(self, kind: str | None = None, flagged: bool = False, limit: int = 1000) -> list[AuditRecord]:
        """What happened in this sandbox: every process it executed, the platform's requests
        into it, egress denials and detector flags (``flagged=True``: only those)."""
        params: dict[str, Any] = {"flagged": str(flagged).lower(), "limit": limit}
        if kind:
            params["kind"] = kind
        data = await self._client._json("GET", f"{self._base}/audit", params=params)
        return [AuditRecord.model_validate(x) for x in data]

    async def protect(self, paths: list[str]) -> int:
        """Fingerprint the files under ``paths`` (say, the tests that will grade this
        rollout); any later change, addition or removal is flagged. Returns the file count."""
        return int((await self._client._json("POST", f"{self._base}/protect", json={"paths": paths}))["files"])

    async def set_network_rules(self, rules: dict[str, bool]) -> NetworkInfo:
        """Change egress while the sandbox runs: ``{"pypi": False}`` takes pypi away, a key
        set to True allows that service or ``ip[/len]:port[-port]/tcp|udp``; keys not named
        keep their setting. A container created without ``network_rules`` is wired now."""
        return NetworkInfo.model_validate(await self._client._json("POST", f"{self._base}/network",
                                                                   json={"rules": rules}))

    async def pause(self, *, timeout: float = 120.0) -> SandboxInfo:
        """VM: memory and devices to a snapshot file, its QEMU ends; container: frozen.
        Any later request (exec, files, HTTP) resumes it first."""
        self.info = SandboxInfo.model_validate(await self._client._json("POST", f"{self._base}/pause",
                                                                        timeout=timeout))
        return self.info

    async def resume(self, *, timeout: float = 120.0) -> SandboxInfo:
        self.info = SandboxInfo.model_validate(await self._client._json("POST", f"{self._base}/resume",
                                                                        timeout=timeout))
        return self.info

    async def screenshot(self) -> bytes:
        """A full VM's screen as PNG."""
        return (await self._client._request("GET", f"{self._base}/screenshot")).content

    async def send_keys(self, keys: str) -> None:
        """Key combinations to a full VM: ``"ctrl-alt-t"``, ``"h i ret"`` (QEMU key codes)."""
        await self._client._request("POST", f"{self._base}/keys", json=KeysRequest(keys=keys).model_dump())

    async def click(self, x: int, y: int, button: Literal["left", "right", "middle"] = "left") -> None:
        """Click at pixel (x, y) of a full VM's screen."""
        await self._client._request("POST", f"{self._base}/click",
                                    json=ClickRequest(x=x, y=y, button=button).model_dump())

    async def usage(self) -> SandboxUsage:
        """CPU, memory (anon, file, swap), pids, writable-layer disk and OOM kills, now."""
        return SandboxUsage.model_validate(await self._client._json("GET", f"{self._base}/usage"))

    async def stop(self) -> SandboxInfo:
        self.info = SandboxInfo.model_validate(await self._client._json("DELETE", self._base))
        return self.info


class _Replicas:
    """The apiserver replicas of a client given several URLs: which one is in use (the
    first, then whichever answered last) and which are backing off after a failure."""

    def __init__(self, urls: tuple[str, ...]) -> None:
        self.urls = urls
        self.current = 0
        self.down_until = [0.0] * len(urls)

    def order(self) -> list[int]:
        """Each replica once, for one request: the current one and those after it, the
        ones backing off last (still tried: with every replica failing lately, the
        request is better sent than refused unsent)."""
        now, n = time.monotonic(), len(self.urls)
        return sorted(((self.current + k) % n for k in range(n)), key=lambda i: self.down_until[i] > now)

    def failed(self, i: int) -> None:
        self.down_until[i] = time.monotonic() + REPLICA_BACKOFF_S

    def answered(self, i: int) -> None:
        self.current = i
        self.down_until[i] = 0.0


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
