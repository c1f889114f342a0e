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
import signal
import stat as statmod
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from pydantic import ValidationError
from starlette.responses import JSONResponse, Response

from dsec.faces.e2b.accounts import Account, Accounts, UnknownUser, basic_user
from dsec.faces.e2b.accounts import load as load_accounts
from dsec.faces.e2b.connect import (
    ConnectError,
    first_message,
    read_envelopes,
    stream_response,
    timeout_of,
    unary_body,
    unary_error,
)
from dsec.node.edge.api import EdgeAPI
from dsec.shared.errors import CommandForgotten, DsecError, InvalidRequest, KeyConflict, NotFound, SandboxNotRunning
from dsec.shared.wire.edge import FsEvent, ProcOutput, ProcRef, ProcSpec
from dsec.shared.wire.models import ExecEvent, ExecRequest, ExecResult, FileStat

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
# E2B's SDKs have no field for it, but every one passes a command's envs through: the
# command log's key rides there (docs/rl.md) and is taken out before the process sees it
KEY_ENV = "DSEC_COMMAND_KEY"
MAX_EXEC_S = 24 * 3600.0  # ExecRequest's own bound: a stream with no deadline runs up to it


def _code_of(e: DsecError) -> str:
    if isinstance(e, KeyConflict):  # the key's record exists, for another command
        return "already_exists"
    if isinstance(e, CommandForgotten):
        return "failed_precondition"
    if isinstance(e, NotFound):
        return "not_found"
    if isinstance(e, InvalidRequest):
        return "invalid_argument"
    if isinstance(e, SandboxNotRunning):
        return "failed_precondition"
    return {401: "unauthenticated", 403: "permission_denied", 409: "failed_precondition",
            429: "resource_exhausted", 503: "unavailable", 504: "deadline_exceeded"}.get(e.status, "internal")


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
    """How a watch's events are reported: paths under ``root``, with entries if asked."""

    ctx: Ctx
    root: str
    include_entry: bool

    async def event(self, ev: FsEvent) -> dict[str, Any]:
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


EVENT_TYPES = {"create": "EVENT_TYPE_CREATE", "write": "EVENT_TYPE_WRITE", "remove": "EVENT_TYPE_REMOVE",
               "rename": "EVENT_TYPE_RENAME", "chmod": "EVENT_TYPE_CHMOD"}
MAX_ENTRIES = 100_000
ACCOUNTS_TTL_S = 2.0


class Envd:
    def __init__(self, edge_for: Callable[[str], EdgeAPI]) -> None:
        self.edge_for = edge_for
        self.accounts: dict[str, tuple[float, Accounts]] = {}  # sandbox -> (read at, its users)

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

    @staticmethod
    def _ref(msg: dict[str, Any]) -> ProcRef:
        sel = msg.get("process") or {}
        if not isinstance(sel, dict):
            raise ConnectError("invalid_argument", "process must be an object with pid or tag")
        try:
            return ProcRef(pid=sel.get("pid"), tag=sel.get("tag"))
        except ValidationError:
            raise ConnectError("invalid_argument", "process.pid must be a number") from None

    # ---- process service -----------------------------------------------------------
    async def start(self, request: Request) -> AsyncIterator[dict[str, Any]]:
        msg = await first_message(request)
        ctx = await self._ctx(request)
        cfg = msg.get("process") or {}
        if not cfg.get("cmd"):
            raise ConnectError("invalid_argument", "process.cmd is required")
        size = ((msg.get("pty") or {}).get("size")) if "pty" in msg else None
        envs = dict(cfg.get("envs") or {})
        key = envs.pop(KEY_ENV, None)
        try:
            spec = ProcSpec(cmd=cfg["cmd"], args=list(cfg.get("args") or []), envs={**ctx.user.env(), **envs},
                            cwd=ctx.path(cfg["cwd"]) if cfg.get("cwd") else ctx.user.home,
                            pty=(int(size.get("cols", 80)), int(size.get("rows", 24))) if size is not None else None,
                            stdin=bool(msg.get("stdin", False)), tag=msg.get("tag"), owner=ctx.user.owner)
        except (ValidationError, TypeError, ValueError, AttributeError) as e:
            raise ConnectError("invalid_argument", f"bad process config: {e}") from None
        if key is not None:
            return self._keyed(ctx, _keyed_request(ctx, spec, key, timeout_of(request)))
        return await self._events(ctx.edge.proc_start(ctx.sid, spec))

    def _keyed(self, ctx: Ctx, req: ExecRequest) -> AsyncIterator[dict[str, Any]]:
        """A keyed command as envd's events, run (or replayed, or waited for) by the edge's
        keyed exec. The start event goes first, at once: the SDK's background handle
        returns on it, and a replay or a refusal comes right after it anyway."""
        stream = ctx.edge.exec_stream(ctx.sid, req)

        async def events() -> AsyncIterator[dict[str, Any]]:
            nxt: asyncio.Future[ExecEvent | None] | None = None
            try:
                # no pid: the command is not in the process table (the edge's exec runs it)
                yield {"event": {"start": {"pid": 0}}}
                while True:
                    nxt = asyncio.ensure_future(_call(_named_key(anext(stream, None))))
                    # the exec stream has no keepalives of its own, and a quiet command
                    # must not look like a dead connection to the SDK or a proxy
                    while not (await asyncio.wait({nxt}, timeout=KEEPALIVE_S))[0]:
                        yield {"event": {"keepalive": {}}}
                    ev, nxt = nxt.result(), None
                    if ev is None:
                        raise ConnectError("unavailable", "the connection to the sandbox ended before the stream "
                                           "completed")
                    if ev.type in ("stdout", "stderr") and ev.data:
                        yield {"event": {"data": {ev.type: _b64(ev.data.encode())}}}
                    elif ev.type == "result" and ev.result is not None:
                        yield _keyed_end(req, ev.result)
                        return
            finally:
                if nxt is not None:  # the client went away mid-wait: the edge's run goes on, keyed
                    nxt.cancel()
                    await asyncio.wait({nxt})
                await stream.aclose()  # type: ignore[attr-defined]
        return events()

    async def _events(self, stream: AsyncIterator[ProcOutput]) -> AsyncIterator[dict[str, Any]]:
        """The process's stream as envd's events; its first item is awaited here, so a
        process that cannot start (or is not there) fails the call, not the stream."""
        try:
            first = await _call(anext(stream))
        except BaseException:
            await stream.aclose()  # type: ignore[attr-defined]
            raise

        async def events() -> AsyncIterator[dict[str, Any]]:
            try:
                ev: ProcOutput | None = first
                while ev is not None:
                    if ev.kind == "start":
                        yield {"event": {"start": {"pid": ev.pid}}}
                    elif ev.kind == "data":
                        yield {"event": {"data": {ev.stream: _b64(ev.data)}}}
                    elif ev.kind == "keepalive":
                        yield {"event": {"keepalive": {}}}
                    elif ev.kind == "end":
                        if ev.exit_code < 0:  # the sandbox went away under the process
                            raise ConnectError("unavailable", "the connection to the sandbox ended before the "
                                               "stream completed")
                        yield {"event": {"end": {"exitCode": ev.exit_code, "exited": True, "status": ev.status}}}
                        return
                    ev = await _call(anext(stream, None))  # an edge that fails mid-stream: a Connect error
                raise ConnectError("unavailable", "the connection to the sandbox ended before the stream completed")
            finally:
                await stream.aclose()  # type: ignore[attr-defined]
        return events()

    async def connect(self, request: Request) -> AsyncIterator[dict[str, Any]]:
        msg = await first_message(request)
        sid, edge = self._sandbox(request)
        return await self._events(edge.proc_connect(sid, self._ref(msg)))

    async def list(self, request: Request) -> dict[str, Any]:
        sid, edge = self._sandbox(request)
        out = []
        for p in await _call(edge.proc_list(sid)):
            info: dict[str, Any] = {"config": {"cmd": p.cmd, "args": p.args, "envs": p.envs, "cwd": p.cwd},
                                    "pid": p.pid}
            if p.tag is not None:
                info["tag"] = p.tag
            out.append(info)
        return {"processes": out}

    async def _exists(self, request: Request, ref: ProcRef) -> None:
        sid, edge = self._sandbox(request)
        if not any(p.pid == ref.pid or (ref.tag and p.tag == ref.tag) for p in await _call(edge.proc_list(sid))):
            raise ConnectError("not_found", f"process with {ref} not found")

    async def send_input(self, request: Request) -> dict[str, Any]:
        msg = await unary_body(request)
        await self._input(request, self._ref(msg), msg.get("input") or {})
        return {}

    async def _input(self, request: Request, ref: ProcRef, inp: dict[str, Any]) -> None:
        sid, edge = self._sandbox(request)
        if not isinstance(inp, dict):
            raise ConnectError("invalid_argument", "input must be an object")
        try:
            data = base64.b64decode(inp.get("stdin") or inp.get("pty") or "", validate=True)
        except (ValueError, TypeError):
            raise ConnectError("invalid_argument", "input must be base64") from None
        await _call(edge.proc_input(sid, ref, data))

    async def stream_input(self, request: Request) -> dict[str, Any]:
        ref: ProcRef | None = None
        async for msg in read_envelopes(request):
            if "start" in msg:
                ref = self._ref(msg["start"])
                await self._exists(request, ref)
            elif "data" in msg:
                if ref is None:
                    raise ConnectError("failed_precondition", "input before the start message")
                await self._input(request, ref, (msg["data"] or {}).get("input") or {})
        return {}

    async def send_signal(self, request: Request) -> dict[str, Any]:
        msg = await unary_body(request)
        sig = SIGNALS.get(msg.get("signal", ""))
        if sig is None:
            raise ConnectError("invalid_argument", f"unknown signal {msg.get('signal')!r}")
        sid, edge = self._sandbox(request)
        await _call(edge.proc_signal(sid, self._ref(msg), int(sig)))
        return {}

    async def close_stdin(self, request: Request) -> dict[str, Any]:
        msg = await unary_body(request)
        sid, edge = self._sandbox(request)
        await _call(edge.proc_close_stdin(sid, self._ref(msg)))
        return {}

    async def update(self, request: Request) -> dict[str, Any]:
        msg = await unary_body(request)
        ref = self._ref(msg)
        pty = msg.get("pty") or {}
        size = pty.get("size") if isinstance(pty, dict) else None
        if size:
            try:
                cols, rows = int(size.get("cols", 80)), int(size.get("rows", 24))
            except (TypeError, ValueError, AttributeError):
                raise ConnectError("invalid_argument", "pty.size must have numeric cols and rows") from None
            sid, edge = self._sandbox(request)
            await _call(edge.proc_resize(sid, ref, cols, rows))
        else:
            await self._exists(request, ref)
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

    async def _watching(self, request: Request, msg: dict[str, Any]) -> tuple[Watching, bool]:
        ctx = await self._ctx(request)
        # allowNetworkMounts: nothing to allow, a sandbox's mounts are all local to its edge
        return (Watching(ctx, ctx.path(msg.get("path")), bool(msg.get("includeEntry", msg.get("include_entry"))),),
                bool(msg.get("recursive", False)))

    async def watch_dir(self, request: Request) -> AsyncIterator[dict[str, Any]]:
        watching, recursive = await self._watching(request, await first_message(request))
        ctx = watching.ctx
        stream = ctx.edge.watch(ctx.sid, watching.root, recursive)
        try:
            await _call(anext(stream))  # the watch exists (or why not)
        except BaseException:
            await stream.aclose()  # type: ignore[attr-defined]
            raise

        async def events() -> AsyncIterator[dict[str, Any]]:
            try:
                yield {"start": {}}
                while (batch := await _call(anext(stream, None))) is not None:
                    if not batch:
                        yield {"keepalive": {}}
                    for ev in batch:
                        yield {"filesystem": await watching.event(ev)}
            finally:
                await stream.aclose()  # type: ignore[attr-defined]
        return events()

    async def create_watcher(self, request: Request) -> dict[str, Any]:
        watching, recursive = await self._watching(request, await unary_body(request))
        ctx = watching.ctx
        wid = await _call(ctx.edge.watcher_create(ctx.sid, watching.root, recursive))
        # the edge holds the watch; what its events are reported with travels in the id
        tail = base64.urlsafe_b64encode(watching.root.encode()).decode().rstrip("=")
        return {"watcherId": f"{wid}.{int(watching.include_entry)}.{tail}"}

    async def _watcher(self, request: Request, msg: dict[str, Any]) -> tuple[str, Watching]:
        raw = str(msg.get("watcherId", ""))
        wid, _, rest = raw.partition(".")
        flag, _, tail = rest.partition(".")
        try:
            root = base64.urlsafe_b64decode(tail + "=" * (-len(tail) % 4)).decode()
        except (ValueError, UnicodeDecodeError):
            raise ConnectError("not_found", f"watcher {raw!r} not found") from None
        if flag not in ("0", "1") or not root.startswith("/"):
            raise ConnectError("not_found", f"watcher {raw!r} not found")
        return wid, Watching(await self._ctx(request), root, flag == "1")

    async def get_watcher_events(self, request: Request) -> dict[str, Any]:
        wid, watching = await self._watcher(request, await unary_body(request))
        ctx = watching.ctx
        return {"events": [await watching.event(e) for e in await _call(ctx.edge.watcher_events(ctx.sid, wid))]}

    async def remove_watcher(self, request: Request) -> dict[str, Any]:
        wid, watching = await self._watcher(request, await unary_body(request))
        await _call(watching.ctx.edge.watcher_remove(watching.ctx.sid, wid))
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


def _keyed_request(ctx: Ctx, spec: ProcSpec, key: str, timeout: float | None) -> ExecRequest:
    """The exec a keyed Start is, or why it cannot be one. The command log records a
    command whose whole input is in its request and whose only handle is its stream (what
    a retry gets back): a PTY (interactive, no stdout/stderr to record), stdin kept open
    (input sent later is not part of the record) or a tag (a process to reach later) do
    not fit, and are refused rather than run unrecorded."""
    for unfit, why in ((spec.pty is not None, "a PTY"), (spec.stdin, "stdin kept open (stdin=True)"),
                       (spec.tag is not None, "a tag")):
        if unfit:
            raise ConnectError("invalid_argument", f"{KEY_ENV}: a command with {why} cannot be keyed: the command "
                               "log records a command run to its end on its request alone; start it without the key")
    owner = spec.owner  # as the process table would run it: E2B's user, else root
    try:
        return ExecRequest(argv=[spec.cmd, *spec.args], env=spec.envs, cwd=spec.cwd, key=key,
                           timeout_s=min(timeout or MAX_EXEC_S, MAX_EXEC_S),
                           uid=owner[0] if owner else None, gid=owner[1] if owner else None)
    except ValidationError as e:
        bad = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'request'}: {err['msg']}" for err in e.errors())
        raise ConnectError("invalid_argument", f"{KEY_ENV}: {bad}") from None


async def _named_key(aw: Awaitable[Any]) -> Any:
    """The edge's refusals of a key, naming where the E2B caller put it."""
    try:
        return await aw
    except DsecError as e:
        if e.field != "key":
            raise
        raise ConnectError(_code_of(e), f"{KEY_ENV}: {e.message}") from None


def _keyed_end(req: ExecRequest, res: ExecResult) -> dict[str, Any]:
    """A keyed command's result as envd's end event, or the error its first run ended with."""
    if res.failure == "infra":  # recorded interrupted: its outcome is unknown, it is never run again
        raise ConnectError("aborted", f"{KEY_ENV} {req.key!r}: {res.stderr.strip()}")
    if res.timed_out:
        # as the first run's stream ended (its deadline is the command's timeout); a retry
        # gets the same, since the record is not run again with a longer one
        raise ConnectError("deadline_exceeded", f"the command under {KEY_ENV} {req.key!r} ran out of its timeout"
                           + ("; that is its record: use a new key to run it again" if res.replayed else ""))
    return {"event": {"end": {"exitCode": res.exit_code, "exited": True, "status": f"exit status {res.exit_code}"}}}


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
