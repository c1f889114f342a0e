"""envd, E2B's in-sandbox daemon, as the E2B SDKs reach it: the process and filesystem
Connect services and the /files upload and download endpoints. Served by the apiserver
itself (E2B_SANDBOX_URL points at it); each request names its sandbox in the
``E2b-Sandbox-Id`` header and carries that sandbox's access token (checked by the
apiserver's auth middleware). Work is done by the sandbox's edge: processes through its
process table (dsec-init underneath), files through the edge's file operations.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import hashlib
import hmac
import posixpath
import re
import secrets
import signal
import stat as statmod
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from dsec.agent.procs import Proc, ProcessTable
from dsec.agent.watch import DirWatch, WatchEvent
from dsec.e2b.accounts import Account, Accounts, UnknownUser, basic_user
from dsec.e2b.accounts import load as load_accounts
from dsec.e2b.connect import (
    ConnectError,
    first_message,
    read_envelopes,
    stream_response,
    timeout_of,
    unary_body,
    unary_error,
)
from dsec.edge.api import EdgeAPI
from dsec.errors import DsecError, InvalidRequest, NotFound, SandboxNotRunning
from dsec.models import FileStat

ENVD_VERSION = "0.6.4"
METADATA_HEADER, METADATA_XATTR = "x-metadata-", "user.e2b."
METADATA_KEY_RE = re.compile(r"[!#$%&'*+\-.^_`|~0-9a-z]+\Z")
METADATA_VALUE_RE = re.compile(r"[\x20-\x7e]*\Z")
SANDBOX_HEADER = "e2b-sandbox-id"
KEEPALIVE_S = 50.0
SIGNALS = {"SIGNAL_SIGKILL": signal.SIGKILL, "SIGNAL_SIGTERM": signal.SIGTERM, 9: signal.SIGKILL,
           15: signal.SIGTERM}
FILE_TYPES = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY", "symlink": "FILE_TYPE_SYMLINK"}
ENVD_PREFIXES = ("/process.Process/", "/filesystem.Filesystem/")
ENVD_PATHS = frozenset({"/files", "/health"})


def _code_of(e: DsecError) -> str:
    if isinstance(e, NotFound):
        return "not_found"
    if isinstance(e, InvalidRequest):
        return "invalid_argument"
    if isinstance(e, SandboxNotRunning):
        return "failed_precondition"
    return {401: "unauthenticated", 403: "permission_denied", 409: "failed_precondition",
            429: "resource_exhausted"}.get(e.status, "internal")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@dataclass
class Ctx:
    """One envd request's sandbox, its edge and the user it acts as."""

    sid: str
    edge: EdgeAPI
    user: Account
    accounts: Accounts

    def path(self, p: object, field: str = "path") -> str:
        if not isinstance(p, str) or not p:
            raise ConnectError("invalid_argument", f"{field} is required")
        return p if p.startswith("/") else f"{self.user.home.rstrip('/')}/{p}"  # relative to home, as envd does

    async def entry(self, f: FileStat) -> dict[str, Any]:
        """An entry as envd gives it: a symlink has its target's type and, as its
        target, the absolute path it resolves to (inside the sandbox)."""
        if f.type == "symlink" and f.link_target is not None:
            target, link, kind = f.path, f, "other"
            for _ in range(8):  # a chain of links, as far as the kernel would follow one
                target = posixpath.normpath(posixpath.join(posixpath.dirname(target), link.link_target or ""))
                try:
                    link = await _call(self.edge.stat(self.sid, target))
                except ConnectError:
                    break  # dangling
                if link.type != "symlink":
                    kind = link.type
                    break
            f = f.model_copy(update={"type": kind, "link_target": target})
        return _entry(f, self.accounts)


@dataclass
class Watching:
    """A directory watch and what its events are reported with."""

    ctx: Ctx
    root: str
    watch: DirWatch
    include_entry: bool

    async def event(self, ev: WatchEvent) -> dict[str, Any]:
        out: dict[str, Any] = {"name": ev.name, "type": EVENT_TYPES[ev.kind]}
        if self.include_entry and ev.kind != "remove":
            with contextlib.suppress(ConnectError):  # gone again already: no entry to give
                out["entry"] = await self.ctx.entry(
                    await _call(self.ctx.edge.stat(self.ctx.sid, posixpath.join(self.root, ev.name))))
        return out


def _entry(f: FileStat, accounts: Accounts) -> dict[str, Any]:
    mode = f.mode | {"file": statmod.S_IFREG, "dir": statmod.S_IFDIR, "symlink": statmod.S_IFLNK}.get(f.type, 0)
    out: dict[str, Any] = {
        "name": f.name, "type": FILE_TYPES.get(f.type, "FILE_TYPE_UNSPECIFIED"), "path": f.path,
        "size": str(f.size), "mode": f.mode, "permissions": statmod.filemode(mode),
        "owner": accounts.owner_name(f.uid), "group": accounts.group_name(f.gid),
        "modifiedTime": datetime.datetime.fromtimestamp(f.mtime, datetime.UTC).isoformat().replace("+00:00", "Z")}
    if f.link_target is not None:
        # no isSymlink: with it the SDKs report the link's own type, the official tests its target's
        out["symlinkTarget"] = f.link_target
    metadata = {k[len(METADATA_XATTR):]: v for k, v in f.xattrs.items() if k.startswith(METADATA_XATTR)}
    if metadata:
        out["metadata"] = metadata
    return out


def _metadata(headers: Any) -> dict[str, str]:
    """File metadata of an upload (``X-Metadata-<key>: value`` headers), keys lowercased."""
    out = {}
    for name, value in headers.items():
        if name.lower().startswith(METADATA_HEADER):
            key = name[len(METADATA_HEADER):].lower()
            if not METADATA_KEY_RE.match(key) or not METADATA_VALUE_RE.match(value):
                raise ConnectError("invalid_argument", f"metadata {key!r}: keys are HTTP tokens, values printable "
                                   "ASCII")
            out[key] = value
    return out


def _selector(msg: dict[str, Any]) -> tuple[int | None, str | None]:
    sel = msg.get("process") or {}
    pid = sel.get("pid")
    return (int(pid) if pid is not None else None), sel.get("tag")


EVENT_TYPES = {"create": "EVENT_TYPE_CREATE", "write": "EVENT_TYPE_WRITE", "remove": "EVENT_TYPE_REMOVE",
               "rename": "EVENT_TYPE_RENAME", "chmod": "EVENT_TYPE_CHMOD"}
MAX_WATCHERS, MAX_WATCHERS_PER_SANDBOX = 8192, 256
PRUNE_EVERY_S = 10.0
MAX_ENTRIES = 100_000
ACCOUNTS_TTL_S = 2.0


class Envd:
    def __init__(self, edge_for: Callable[[str], EdgeAPI]) -> None:
        self.edge_for = edge_for
        self.watchers: dict[str, Watching] = {}  # watcher id -> what it watches
        self.accounts: dict[str, tuple[float, Accounts]] = {}  # sandbox -> (read at, its users)
        self.pruned_at = 0.0

    def _sandbox(self, request: Request) -> tuple[str, EdgeAPI]:
        sid = request.headers.get(SANDBOX_HEADER, "")
        try:
            return sid, self.edge_for(sid)
        except DsecError:
            raise SandboxGone() from None

    async def _accounts(self, sid: str, edge: EdgeAPI) -> Accounts:
        now = time.monotonic()
        hit = self.accounts.get(sid)
        if hit is not None and now - hit[0] < ACCOUNTS_TTL_S:
            return hit[1]
        accounts = await _call(load_accounts(edge, sid))
        if len(self.accounts) >= 4096:
            self.accounts.clear()
        self.accounts[sid] = (now, accounts)
        return accounts

    async def _ctx(self, request: Request, username: str | None = None) -> Ctx:
        sid, edge = self._sandbox(request)
        accounts = await self._accounts(sid, edge)
        try:
            user = accounts.user(username or basic_user(request.headers.get("authorization")))
        except UnknownUser as e:
            raise ConnectError("invalid_argument", str(e)) from None
        return Ctx(sid, edge, user, accounts)

    async def _table(self, request: Request) -> ProcessTable:
        sid, edge = self._sandbox(request)
        return await _call(edge.process_table(sid))

    async def _proc(self, request: Request, msg: dict[str, Any]) -> tuple[ProcessTable, Proc]:
        table = await self._table(request)
        pid, tag = _selector(msg)
        p = table.find(pid, tag)
        if p is None:
            raise ConnectError("not_found", f"process with {'pid ' + str(pid) if pid else 'tag ' + repr(tag)} "
                               "not found")
        return table, p

    # ---- process service -----------------------------------------------------------
    async def start(self, request: Request) -> AsyncIterator[dict[str, Any]]:
        msg = await first_message(request)
        ctx = await self._ctx(request)
        table = await _call(ctx.edge.process_table(ctx.sid))
        cfg = msg.get("process") or {}
        if not cfg.get("cmd"):
            raise ConnectError("invalid_argument", "process.cmd is required")
        size = ((msg.get("pty") or {}).get("size")) if "pty" in msg else None
        pty = (int(size.get("cols", 80)), int(size.get("rows", 24))) if size is not None else None
        try:
            p = await table.start(cfg["cmd"], list(cfg.get("args") or []),
                                  {**ctx.user.env(), **dict(cfg.get("envs") or {})},
                                  ctx.path(cfg["cwd"]) if cfg.get("cwd") else ctx.user.home,
                                  pty, bool(msg.get("stdin", False)), msg.get("tag"), ctx.user.owner)
        except ValueError as e:
            raise ConnectError("resource_exhausted", str(e)) from None
        except DsecError as e:
            raise ConnectError(_code_of(e), e.message) from None
        q = p.subscribe()
        return self._events(p, q)

    async def _events(self, p: Proc, q: asyncio.Queue[Any]) -> AsyncIterator[dict[str, Any]]:
        try:
            yield {"event": {"start": {"pid": p.pid}}}
            while True:
                try:
                    ev = await asyncio.wait_for(q.get(), KEEPALIVE_S)
                except TimeoutError:
                    yield {"event": {"keepalive": {}}}
                    continue
                p.consumed(q, ev)
                if ev.kind == "data":
                    yield {"event": {"data": {ev.stream: _b64(ev.data)}}}
                elif ev.kind == "end":
                    if ev.exit_code < 0:  # the sandbox went away under the process
                        raise ConnectError("unavailable", "the connection to the sandbox ended before the "
                                           "stream completed")
                    yield {"event": {"end": {"exitCode": ev.exit_code, "exited": True, "status": ev.status}}}
                    return
        finally:
            p.unsubscribe(q)

    async def connect(self, request: Request) -> AsyncIterator[dict[str, Any]]:
        msg = await first_message(request)
        _, p = await self._proc(request, msg)
        return self._events(p, p.subscribe())

    async def list(self, request: Request) -> dict[str, Any]:
        table = await self._table(request)
        out = []
        for p in table.procs.values():
            info: dict[str, Any] = {"config": {"cmd": p.cmd, "args": p.args, "envs": p.envs, "cwd": p.cwd},
                                    "pid": p.pid}
            if p.tag is not None:
                info["tag"] = p.tag
            out.append(info)
        return {"processes": out}

    async def send_input(self, request: Request) -> dict[str, Any]:
        msg = await unary_body(request)
        table, p = await self._proc(request, msg)
        await self._input(table, p, msg.get("input") or {})
        return {}

    async def _input(self, table: ProcessTable, p: Proc, inp: dict[str, Any]) -> None:
        data = base64.b64decode(inp.get("stdin") or inp.get("pty") or "")
        try:
            await table.write(p, data)
        except (ValueError, OSError) as e:
            raise ConnectError("failed_precondition", f"cannot write to process {p.pid}: {e}") from None

    async def stream_input(self, request: Request) -> dict[str, Any]:
        table: ProcessTable | None = None
        p: Proc | None = None
        async for msg in read_envelopes(request):
            if "start" in msg:
                table, p = await self._proc(request, msg["start"])
            elif "data" in msg:
                if table is None or p is None:
                    raise ConnectError("failed_precondition", "input before the start message")
                await self._input(table, p, (msg["data"] or {}).get("input") or {})
        return {}

    async def send_signal(self, request: Request) -> dict[str, Any]:
        msg = await unary_body(request)
        table, p = await self._proc(request, msg)
        sig = SIGNALS.get(msg.get("signal", ""))
        if sig is None:
            raise ConnectError("invalid_argument", f"unknown signal {msg.get('signal')!r}")
        await table.signal(p, sig)
        return {}

    async def close_stdin(self, request: Request) -> dict[str, Any]:
        msg = await unary_body(request)
        table, p = await self._proc(request, msg)
        table.close_stdin(p)
        return {}

    async def update(self, request: Request) -> dict[str, Any]:
        msg = await unary_body(request)
        table, p = await self._proc(request, msg)
        size = (msg.get("pty") or {}).get("size")
        if size:
            try:
                await table.resize(p, int(size.get("cols", 80)), int(size.get("rows", 24)))
            except ValueError as e:
                raise ConnectError("failed_precondition", str(e)) from None
        return {}

    # ---- filesystem service -----------------------------------------------------------
    async def stat(self, request: Request) -> dict[str, Any]:
        msg = await unary_body(request)
        ctx = await self._ctx(request)
        return {"entry": await ctx.entry(await _call(ctx.edge.stat(ctx.sid, ctx.path(msg.get("path")))))}

    async def list_dir(self, request: Request) -> dict[str, Any]:
        msg = await unary_body(request)
        ctx = await self._ctx(request)
        depth = max(1, int(msg.get("depth") or 1))
        root = ctx.path(msg.get("path"))
        if (await _call(ctx.edge.stat(ctx.sid, root))).type != "dir":
            raise ConnectError("invalid_argument", f"{root} is not a directory")
        out: list[dict[str, Any]] = []

        async def walk(d: str, level: int) -> None:  # depth first, by name, as envd lists
            for f in await _call(ctx.edge.list_dir(ctx.sid, d)):
                out.append(await ctx.entry(f))
                if f.type == "dir" and level < depth and len(out) < MAX_ENTRIES:
                    await walk(f.path, level + 1)
        await walk(root, 1)
        return {"entries": out[:MAX_ENTRIES]}

    async def make_dir(self, request: Request) -> dict[str, Any]:
        msg = await unary_body(request)
        ctx = await self._ctx(request)
        path = ctx.path(msg.get("path"))
        if not await _call(ctx.edge.make_dir(ctx.sid, path, ctx.user.owner)):
            raise ConnectError("already_exists", f"{path} already exists")
        return {"entry": await ctx.entry(await _call(ctx.edge.stat(ctx.sid, path)))}

    async def move(self, request: Request) -> dict[str, Any]:
        msg = await unary_body(request)
        ctx = await self._ctx(request)
        f = await _call(ctx.edge.move(ctx.sid, ctx.path(msg.get("source"), "source"),
                                      ctx.path(msg.get("destination"), "destination")))
        return {"entry": await ctx.entry(f)}

    async def remove(self, request: Request) -> dict[str, Any]:
        msg = await unary_body(request)
        ctx = await self._ctx(request)
        try:
            await _call(ctx.edge.remove(ctx.sid, ctx.path(msg.get("path")), True))
        except ConnectError as e:
            if e.code != "not_found":  # removing what is not there is done, as envd has it
                raise
        return {}

    async def _watch(self, request: Request, msg: dict[str, Any]) -> Watching:
        ctx = await self._ctx(request)
        path = ctx.path(msg.get("path"))
        w = await _call(ctx.edge.watch_dir(ctx.sid, path, bool(msg.get("recursive", False))))
        # allowNetworkMounts: nothing to allow, a sandbox's mounts are all local to its edge
        return Watching(ctx, path, w, bool(msg.get("includeEntry", msg.get("include_entry", False))))

    async def watch_dir(self, request: Request) -> AsyncIterator[dict[str, Any]]:
        watching = await self._watch(request, await first_message(request))
        w = watching.watch

        async def events() -> AsyncIterator[dict[str, Any]]:
            try:
                yield {"start": {}}
                while not w.closed:
                    try:
                        await asyncio.wait_for(w.changed.wait(), KEEPALIVE_S)
                    except TimeoutError:
                        yield {"keepalive": {}}
                        continue
                    for ev in w.drain():
                        yield {"filesystem": await watching.event(ev)}
            finally:
                w.close()
        return events()

    async def create_watcher(self, request: Request) -> dict[str, Any]:
        sid, _ = self._sandbox(request)
        if time.monotonic() - self.pruned_at > PRUNE_EVERY_S:
            await self._prune()
        if sum(1 for w in self.watchers.values() if w.ctx.sid == sid) >= MAX_WATCHERS_PER_SANDBOX:
            await self._prune()
            if sum(1 for w in self.watchers.values() if w.ctx.sid == sid) >= MAX_WATCHERS_PER_SANDBOX:
                raise ConnectError("resource_exhausted", f"at most {MAX_WATCHERS_PER_SANDBOX} watchers per sandbox")
        if len(self.watchers) >= MAX_WATCHERS:
            await self._prune()
            if len(self.watchers) >= MAX_WATCHERS:
                raise ConnectError("resource_exhausted", f"at most {MAX_WATCHERS} watchers on this server")
        watching = await self._watch(request, await unary_body(request))
        wid = secrets.token_hex(8)
        self.watchers[wid] = watching
        return {"watcherId": wid}

    async def _prune(self) -> None:
        """Close the watchers of sandboxes that have ended (their owners never removed
        them): a dead sandbox must not hold inotify fds or its share of the limit."""
        self.pruned_at = time.monotonic()
        live: dict[str, bool] = {}
        for wid, w in list(self.watchers.items()):
            if w.ctx.sid not in live:
                try:
                    live[w.ctx.sid] = (await w.ctx.edge.get(w.ctx.sid)).state in ("running", "paused")
                except DsecError:
                    live[w.ctx.sid] = False
            if w.watch.closed or not live[w.ctx.sid]:
                w.watch.close()
                self.watchers.pop(wid, None)

    def _watcher(self, request: Request, msg: dict[str, Any]) -> tuple[str, Watching]:
        sid, _ = self._sandbox(request)
        found = self.watchers.get(str(msg.get("watcherId", "")))
        if found is None or found.ctx.sid != sid:
            raise ConnectError("not_found", f"watcher {msg.get('watcherId')!r} not found")
        return str(msg["watcherId"]), found

    async def get_watcher_events(self, request: Request) -> dict[str, Any]:
        _, watching = self._watcher(request, await unary_body(request))
        return {"events": [await watching.event(e) for e in watching.watch.drain()]}

    async def remove_watcher(self, request: Request) -> dict[str, Any]:
        wid, watching = self._watcher(request, await unary_body(request))
        watching.watch.close()
        self.watchers.pop(wid, None)
        return {}

    # ---- /files ---------------------------------------------------------------------------
    async def download(self, request: Request) -> Response:
        ctx = await self._ctx(request, request.query_params.get("username"))
        path = ctx.path(request.query_params.get("path"))
        data = await _call(ctx.edge.read_file(ctx.sid, path))
        return Response(data, media_type="application/octet-stream")

    async def upload(self, request: Request) -> Response:
        ctx = await self._ctx(request, request.query_params.get("username"))
        metadata = _metadata(request.headers)  # checked before anything is written
        written: list[tuple[str, bytes]] = []
        ctype = request.headers.get("content-type", "")
        if ctype.startswith("multipart/form-data"):
            form = await request.form()
            for _, item in form.multi_items():
                if isinstance(item, str):
                    continue
                name = item.filename or ""
                path = request.query_params.get("path") if len(form) == 1 and request.query_params.get("path") \
                    else name
                written.append((ctx.path(path), await item.read()))
        else:
            data = await request.body()
            if request.headers.get("content-encoding") == "gzip":
                import gzip

                data = gzip.decompress(data)
            written.append((ctx.path(request.query_params.get("path")), data))
        out = []
        for path, data in written:
            await _call(ctx.edge.write_file(ctx.sid, path, data, owner=ctx.user.owner))
            # always: a file written again without metadata loses what it had
            await _call(ctx.edge.set_xattrs(ctx.sid, path, METADATA_XATTR, metadata))
            entry: dict[str, Any] = {"name": path.rsplit("/", 1)[-1], "type": "file", "path": path}
            if metadata:
                entry["metadata"] = metadata
            out.append(entry)
        return JSONResponse(out)


def file_signature(path: str, operation: str, user: str, token: str, expiration: int | None) -> str:
    """envd's v1 signature of a file URL: sha256 over path, operation ("read"/"write"),
    user ("" for the default one), the sandbox's access token and the expiry, if any;
    unpadded base64."""
    raw = f"{path}:{operation}:{user}:{token}" + (f":{expiration}" if expiration is not None else "")
    return "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).rstrip(b"=").decode()


def signed_file_sandbox(query: dict[str, str], method: str, candidates: list[str],
                        token_of: Callable[[str], str]) -> str:
    """The sandbox (of ``candidates``) whose access token signed this /files URL. A signed
    URL carries no sandbox id (it may be opened by anyone, anywhere), so it is matched
    against the tokens of the sandboxes it could be for. Raises ValueError with the
    refusal's message."""
    sig = query.get("signature", "")
    raw_exp = query.get("signature_expiration")
    expiration = None
    if raw_exp:
        if not raw_exp.lstrip("-").isdigit():
            raise ValueError("signature_expiration is not a unix time")
        expiration = int(raw_exp)
        if expiration < time.time():
            raise ValueError("signature is already expired")
    op = "read" if method == "GET" else "write"
    for sid in candidates:
        want = file_signature(query.get("path", ""), op, query.get("username", ""), token_of(sid), expiration)
        if hmac.compare_digest(want, sig):
            return sid
    raise ValueError("invalid signature")


# what a request whose fields have the wrong shape raises while it is read (a depth that
# is not a number, a message that is not an object, bad base64): a 400, not a 500
MALFORMED = (ValueError, TypeError, KeyError, AttributeError)


def _malformed(e: Exception) -> ConnectError:
    return ConnectError("invalid_argument", f"malformed request: {type(e).__name__}: {e}")


class SandboxGone(ConnectError):
    """The sandbox does not exist or has ended: answered as E2B's proxy does (HTTP 502,
    "... was not found"), which the SDKs turn into their sandbox-not-running errors."""

    def __init__(self) -> None:
        super().__init__("unavailable", "The sandbox was not found")

    def response(self, sid: str) -> Response:
        return JSONResponse({"code": 502, "message": self.message, "sandboxId": sid}, status_code=502)


async def _call(aw: Awaitable[Any]) -> Any:
    """An edge call, its errors as Connect errors."""
    try:
        return await aw
    except ConnectError:
        raise
    except (NotFound, SandboxNotRunning) as e:
        if e.field == "sandbox_id" or isinstance(e, SandboxNotRunning):
            raise SandboxGone() from None
        raise ConnectError(_code_of(e), e.message) from None
    except DsecError as e:
        raise ConnectError(_code_of(e), e.message) from None


def mount(app: FastAPI, envd: Envd) -> None:
    """Add envd's routes to the apiserver."""
    streams = {"/process.Process/Start": envd.start, "/process.Process/Connect": envd.connect,
               "/filesystem.Filesystem/WatchDir": envd.watch_dir}
    unary = {"/process.Process/List": envd.list, "/process.Process/SendInput": envd.send_input,
             "/process.Process/SendSignal": envd.send_signal, "/process.Process/CloseStdin": envd.close_stdin,
             "/process.Process/Update": envd.update, "/process.Process/StreamInput": envd.stream_input,
             "/filesystem.Filesystem/Stat": envd.stat, "/filesystem.Filesystem/ListDir": envd.list_dir,
             "/filesystem.Filesystem/MakeDir": envd.make_dir, "/filesystem.Filesystem/Move": envd.move,
             "/filesystem.Filesystem/Remove": envd.remove,
             "/filesystem.Filesystem/CreateWatcher": envd.create_watcher,
             "/filesystem.Filesystem/GetWatcherEvents": envd.get_watcher_events,
             "/filesystem.Filesystem/RemoveWatcher": envd.remove_watcher}

    def stream_route(fn: Callable[[Request], Awaitable[AsyncIterator[dict[str, Any]]]]) -> Any:
        async def route(request: Request) -> Response:
            try:
                events = await fn(request)
            except SandboxGone as e:
                return e.response(request.headers.get(SANDBOX_HEADER, ""))
            except ConnectError as e:
                return stream_response(_failed(e))
            except MALFORMED as e:
                return stream_response(_failed(_malformed(e)))
            return stream_response(events, timeout_of(request))
        return route

    def unary_route(fn: Callable[[Request], Awaitable[dict[str, Any]]]) -> Any:
        async def route(request: Request) -> Response:
            try:
                if fn is envd.stream_input:
                    return stream_response(_single(await fn(request)))
                return JSONResponse(await fn(request))
            except SandboxGone as e:
                return e.response(request.headers.get(SANDBOX_HEADER, ""))
            except ConnectError as e:
                return unary_error(e)
            except MALFORMED as e:
                return unary_error(_malformed(e))
        return route

    for path, sfn in streams.items():
        app.router.add_route(path, stream_route(sfn), methods=["POST"], include_in_schema=False)
    for path, ufn in unary.items():
        app.router.add_route(path, unary_route(ufn), methods=["POST"], include_in_schema=False)

    def files_route(fn: Callable[[Request], Awaitable[Response]]) -> Any:
        """/files answers plain HTTP errors, {"code": <status>, "message"}."""
        async def route(request: Request) -> Response:
            try:
                return await fn(request)
            except SandboxGone as e:
                return e.response(request.headers.get(SANDBOX_HEADER, ""))
            except (ConnectError, *MALFORMED) as e:
                err = e if isinstance(e, ConnectError) else _malformed(e)
                status = 404 if err.code == "not_found" else 400
                return JSONResponse({"code": status, "message": err.message}, status_code=status)
        return route

    async def health(request: Request) -> Response:
        """204 while the sandbox runs; once it has ended, the proxy's 502 "was not found"
        (what the SDK's is_running and its health probe after a dropped stream read)."""
        sid = request.headers.get(SANDBOX_HEADER, "")
        try:
            _, edge = envd._sandbox(request)
            info = await edge.get(sid)
        except (ConnectError, DsecError):
            return SandboxGone().response(sid)
        return Response(status_code=204) if info.state == "running" else SandboxGone().response(sid)

    app.router.add_route("/files", files_route(envd.download), methods=["GET"], include_in_schema=False)
    app.router.add_route("/files", files_route(envd.upload), methods=["POST"], include_in_schema=False)
    app.router.add_route("/health", health, methods=["GET"], include_in_schema=False)


async def _single(msg: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    yield msg


async def _failed(err: ConnectError) -> AsyncIterator[dict[str, Any]]:
    raise err
    yield {}  # unreachable: makes this an async generator


__all__ = ["ENVD_PATHS", "ENVD_PREFIXES", "ENVD_VERSION", "Envd", "mount"]
