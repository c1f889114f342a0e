"""Daytona's toolbox API (the per-sandbox daemon its SDK reaches at ``toolboxProxyUrl/<id>``)
over dsec's exec and file operations: process exec and code_run, sessions, files, git.

Sessions keep nothing in the apiserver (it is stateless, and another replica may serve the
next call): a Daytona session is a dsec shell session (``dtn-<id>``), and each command's
text, output and exit code are files in the sandbox under ``SESSIONS_DIR/<id>/<cmd id>``,
written by the session's shell itself, which is how a command run with ``runAsync`` goes
on in the background and is read back later (get_session_command, logs). Git runs the
sandbox's own ``git`` (an image without it answers 400 saying so).
"""

from __future__ import annotations

import datetime
import posixpath
import re
import secrets
import shlex
import stat as statmod
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from dsec.control.apiserver.core import Apiserver, read_body
from dsec.faces.daytona import models as m
from dsec.faces.daytona.http import error_response, json_response, parse
from dsec.faces.e2b import accounts
from dsec.node.edge.api import EdgeAPI
from dsec.shared.errors import DsecError, InvalidRequest, NotFound
from dsec.shared.wire.models import ExecRequest, ExecResult, FileStat, SandboxInfo, SandboxState

SESSIONS_DIR = "/tmp/.dsec-daytona/sessions"
WORKDIR_LABEL = "daytona.workdir"
SESSION_RE = re.compile(r"^[A-Za-z0-9_.-]{1,60}$")
DEFAULT_TIMEOUT_S = 24 * 3600  # Daytona's exec has no limit unless given one; dsec's longest
MAX_BODY = 64 << 20
Lookup = Callable[[str], Awaitable[SandboxInfo]]
DAEMON = "DAYTONA_DAEMON"  # the error source Daytona's SDK maps daemon error codes under


class ToolboxError(DsecError):
    """An error with one of Daytona's daemon codes (its SDK raises the matching subclass)."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message, field=field)
        self.status, self.daemon_code = status, code


class Toolbox:
    def __init__(self, api: Apiserver) -> None:
        self.api = api
        self.routes: dict[tuple[str, str], Callable[..., Awaitable[Response]]] = {
            ("POST", "process/execute"): self.execute, ("POST", "process/code-run"): self.code_run,
            ("POST", "process/session"): self.create_session, ("GET", "process/session"): self.list_sessions,
            ("GET", "files"): self.list_files, ("DELETE", "files"): self.delete_file,
            ("GET", "files/info"): self.file_info, ("POST", "files/folder"): self.create_folder,
            ("POST", "files/move"): self.move, ("POST", "files/permissions"): self.permissions,
            ("GET", "files/find"): self.find, ("GET", "files/search"): self.search,
            ("POST", "files/replace"): self.replace, ("POST", "files/bulk-upload"): self.upload,
            ("POST", "files/bulk-download"): self.download,
            ("POST", "git/clone"): self.git_clone, ("GET", "git/status"): self.git_status,
            ("POST", "git/add"): self.git_add, ("POST", "git/commit"): self.git_commit,
            ("GET", "user-home-dir"): self.home_dir, ("GET", "work-dir"): self.work_dir,
            ("GET", "version"): self.version,
        }

    async def serve(self, request: Request, rest: str, lookup: Lookup) -> Response:
        sid, _, route = rest.partition("/")
        info = await lookup(sid)
        if info.state != SandboxState.running:
            raise _NotRunning(f"sandbox {sid} is stopped: start it first", field="sandbox_id")
        edge = self.api.edge_for(info.sandbox_id)
        try:
            fn = self.routes.get((request.method, route))
            if fn is not None:
                return await fn(request, edge, info)
            s = re.match(r"^process/session/([^/]+)(?:/(exec|command/([^/]+)(/logs)?))?$", route)
            if s is not None:
                return await self._session_route(request, edge, info, s)
            raise NotFound(f"dsec's Daytona toolbox does not serve {request.method} /{route} (see docs/harnesses.md)",
                           field="path")
        except ToolboxError as e:
            return error_response(e, request.url.path, e.daemon_code, DAEMON)

    # ---- process ----

    async def _exec(self, edge: EdgeAPI, info: SandboxInfo, cmd: str, *, cwd: str | None = None,
                    env: dict[str, str] | None = None, timeout: int | None = None, session: str | None = None,
                    stdin: str | None = None) -> ExecResult:
        try:
            req = ExecRequest(cmd=cmd, cwd=self._abs(info, cwd) if cwd else None, env=env or {}, session=session,
                              stdin=stdin, timeout_s=timeout or DEFAULT_TIMEOUT_S)
        except ValueError as e:
            raise InvalidRequest(f"command: {e}", field="command") from None
        return await edge.exec(info.sandbox_id, req)

    @staticmethod
    def _abs(info: SandboxInfo, path: str) -> str:
        return path if path.startswith("/") else posixpath.join(workdir(info), path)

    async def execute(self, request: Request, edge: EdgeAPI, info: SandboxInfo) -> Response:
        body: m.ExecuteRequest = parse(m.ExecuteRequest, await read_body(request, MAX_BODY, "body"))
        # Daytona's result is the command's output, both streams as they came: one pipe
        res = await self._exec(edge, info, f"{{ {body.command}\n}} 2>&1", cwd=body.cwd, env=body.envs,
                               timeout=body.timeout)
        if res.timed_out:
            raise ToolboxError(408, "PROCESS_EXECUTION_TIMEOUT", f"command timed out after {body.timeout} s",
                               field="timeout")
        return json_response(m.ExecuteResponse(exit_code=res.exit_code, result=res.stdout + res.stderr))

    async def code_run(self, request: Request, edge: EdgeAPI, info: SandboxInfo) -> Response:
        body: m.CodeRunRequest = parse(m.CodeRunRequest, await read_body(request, MAX_BODY, "body"))
        runner = {"python": "python3 -", "javascript": "node -", "typescript": "npx --yes tsx -"}.get(body.language)
        if runner is None:
            raise InvalidRequest(f"language: {body.language!r}; dsec runs python, javascript, typescript",
                                 field="language")
        argv = " ".join(shlex.quote(a) for a in body.argv or [])
        res = await self._exec(edge, info, f"{runner} {argv} 2>&1", env=body.envs, timeout=body.timeout,
                               stdin=body.code)
        if res.timed_out:
            raise ToolboxError(408, "PROCESS_EXECUTION_TIMEOUT", f"code timed out after {body.timeout} s",
                               field="timeout")
        return json_response(m.ExecuteResponse(exit_code=res.exit_code, result=res.stdout + res.stderr))

    # ---- sessions ----

    @staticmethod
    def _session_id(sid: str) -> str:
        if not SESSION_RE.match(sid):
            raise InvalidRequest("sessionId: 1-60 of [A-Za-z0-9_.-]", field="sessionId")
        return sid

    async def create_session(self, request: Request, edge: EdgeAPI, info: SandboxInfo) -> Response:
        body: m.CreateSession = parse(m.CreateSession, await read_body(request, MAX_BODY, "body"))
        sid = self._session_id(body.session_id)
        res = await self._exec(edge, info, f"test -e {SESSIONS_DIR}/{sid} && echo exists || "
                                           f"mkdir -p {SESSIONS_DIR}/{sid}")
        if res.stdout.strip() == "exists":
            raise ToolboxError(409, "SESSION_EXISTS", f"session {sid!r} exists", field="sessionId")
        if res.exit_code != 0:
            raise DsecError(f"could not create session {sid!r}: {res.stdout}{res.stderr}")
        return Response(status_code=201)

    async def _session_dir(self, edge: EdgeAPI, info: SandboxInfo, sid: str) -> str:
        d = f"{SESSIONS_DIR}/{self._session_id(sid)}"
        try:
            await edge.stat(info.sandbox_id, d)
        except NotFound:
            raise ToolboxError(404, "PROCESS_NOT_FOUND", f"session {sid!r} not found", field="sessionId") from None
        return d

    async def _command(self, edge: EdgeAPI, info: SandboxInfo, d: str, cmd_id: str) -> m.Command:
        if not SESSION_RE.match(cmd_id):
            raise ToolboxError(404, "PROCESS_NOT_FOUND", f"command {cmd_id!r} not found", field="commandId")
        try:
            text = await edge.read_file(info.sandbox_id, f"{d}/{cmd_id}/cmd")
        except NotFound:
            raise ToolboxError(404, "PROCESS_NOT_FOUND", f"command {cmd_id!r} not found", field="commandId") from None
        code: int | None = None
        try:
            code = int((await edge.read_file(info.sandbox_id, f"{d}/{cmd_id}/exit")).strip() or b"-1")
        except NotFound:
            pass  # still running
        except ValueError:
            code = None  # being written
        return m.Command(id=cmd_id, command=text.decode(errors="replace"), exit_code=code)

    async def _session_route(self, request: Request, edge: EdgeAPI, info: SandboxInfo, s: re.Match[str]) -> Response:
        sid, action, cmd_id, logs = s.group(1), s.group(2), s.group(3), s.group(4)
        d = await self._session_dir(edge, info, sid)
        if action is None and request.method == "DELETE":
            # its shell ends with its directory; a background command it started goes on until done
            await self._exec(edge, info, f"kill -9 $(cat {d}/pid 2>/dev/null) 2>/dev/null; rm -rf {d}")
            return Response(status_code=204)
        if action is None and request.method == "GET":
            ids = sorted((f for f in await edge.list_dir(info.sandbox_id, d) if f.type == "dir"),
                         key=lambda f: f.mtime)
            cmds = [await self._command(edge, info, d, f.name) for f in ids]
            return json_response(m.Session(session_id=sid, commands=cmds))
        if action == "exec" and request.method == "POST":
            body: m.SessionExecute = parse(m.SessionExecute, await read_body(request, MAX_BODY, "body"))
            return await self._session_exec(edge, info, sid, d, body)
        if cmd_id is not None and request.method == "GET":
            cmd = await self._command(edge, info, d, cmd_id)
            if not logs:
                return json_response(cmd)
            stdout, stderr = await self._read(edge, info, f"{d}/{cmd_id}/out"), \
                await self._read(edge, info, f"{d}/{cmd_id}/err")
            if request.query_params.get("follow") == "true":
                raise InvalidRequest("follow: streamed logs are not served by dsec; poll the logs instead",
                                     field="follow")
            return json_response(m.CommandLogs(output=stdout + stderr, stdout=stdout, stderr=stderr))
        raise NotFound(f"dsec's Daytona toolbox does not serve {request.method} {request.url.path}", field="path")

    async def _read(self, edge: EdgeAPI, info: SandboxInfo, path: str) -> str:
        try:
            return (await edge.read_file(info.sandbox_id, path)).decode(errors="replace")
        except NotFound:
            return ""

    async def _session_exec(self, edge: EdgeAPI, info: SandboxInfo, sid: str, d: str,
                            body: m.SessionExecute) -> Response:
        cmd_id = uuid.uuid4().hex
        c = f"{d}/{cmd_id}"
        # the session's shell writes the command's record itself, so that a background one
        # (runAsync) is recorded when it ends, with no one waiting on it
        run = f"{{ {body.command}\n}} >{c}/out 2>{c}/err </dev/null; echo $? >{c}/exit.tmp; mv {c}/exit.tmp {c}/exit"
        script = (f"echo $$ >{d}/pid; mkdir -p {c} && printf %s {shlex.quote(body.command)} >{c}/cmd\n"
                  + (f"( {run} ) >/dev/null 2>&1 &\n" if body.run_async or body.async_ else f"{run}\n"))
        res = await self._exec(edge, info, script, session=f"dtn-{sid}")
        if res.exit_code != 0 and not (body.run_async or body.async_):
            pass  # the command's own exit code is in its record, read below
        if body.run_async or body.async_:
            return json_response(m.SessionExecuteResponse(cmd_id=cmd_id), status=202)
        stdout, stderr = await self._read(edge, info, f"{c}/out"), await self._read(edge, info, f"{c}/err")
        cmd = await self._command(edge, info, d, cmd_id)
        return json_response(m.SessionExecuteResponse(cmd_id=cmd_id, output=stdout + stderr, stdout=stdout,
                                                      stderr=stderr, exit_code=cmd.exit_code))

    async def list_sessions(self, request: Request, edge: EdgeAPI, info: SandboxInfo) -> Response:
        try:
            dirs = [f.name for f in await edge.list_dir(info.sandbox_id, SESSIONS_DIR) if f.type == "dir"]
        except NotFound:
            dirs = []
        out = []
        for sid in sorted(dirs):
            cmds = sorted((f for f in await edge.list_dir(info.sandbox_id, f"{SESSIONS_DIR}/{sid}") if f.type == "dir"),
                          key=lambda f: f.mtime)
            out.append(m.Session(session_id=sid, commands=[await self._command(edge, info, f"{SESSIONS_DIR}/{sid}",
                                                                                f.name) for f in cmds]))
        return json_response(out)

    # ---- files ----

    @staticmethod
    def _query(request: Request, name: str, default: str | None = None) -> str:
        v = request.query_params.get(name, default)
        if v is None or v == "":
            raise InvalidRequest(f"{name}: required", field=name)
        return v

    def _path(self, request: Request, info: SandboxInfo, name: str = "path") -> str:
        return self._abs(info, self._query(request, name))

    async def _file_info(self, edge: EdgeAPI, info: SandboxInfo, f: FileStat, names: accounts.Accounts) -> m.FileInfo:
        mode = f.mode & 0o7777
        kind = {"dir": statmod.S_IFDIR, "symlink": statmod.S_IFLNK}.get(f.type, statmod.S_IFREG)
        return m.FileInfo(name=f.name, path=f.path, is_dir=f.type == "dir", size=f.size,
                          mode=statmod.filemode(kind | mode), permissions=f"{mode:04o}",
                          owner=names.owner_name(f.uid), group=names.group_name(f.gid),
                          mod_time=datetime.datetime.fromtimestamp(f.mtime, datetime.UTC).isoformat())

    async def list_files(self, request: Request, edge: EdgeAPI, info: SandboxInfo) -> Response:
        path = self._abs(info, request.query_params.get("path") or workdir(info))
        files = await _file_op(edge.list_dir(info.sandbox_id, path), path)
        names = await accounts.load(edge, info.sandbox_id)
        return json_response([await self._file_info(edge, info, f, names) for f in files])

    async def file_info(self, request: Request, edge: EdgeAPI, info: SandboxInfo) -> Response:
        path = self._path(request, info)
        f = await _file_op(edge.stat(info.sandbox_id, path), path)
        return json_response(await self._file_info(edge, info, f, await accounts.load(edge, info.sandbox_id)))

    async def delete_file(self, request: Request, edge: EdgeAPI, info: SandboxInfo) -> Response:
        path = self._path(request, info)
        await _file_op(edge.remove(info.sandbox_id, path, request.query_params.get("recursive") == "true"), path)
        return Response(status_code=204)

    async def create_folder(self, request: Request, edge: EdgeAPI, info: SandboxInfo) -> Response:
        path = self._path(request, info)
        mode = request.query_params.get("mode") or "755"
        if not re.fullmatch(r"[0-7]{3,4}", mode):
            raise InvalidRequest(f"mode: octal permissions such as 755, not {mode!r}", field="mode")
        res = await self._exec(edge, info, f"mkdir -p -m {mode} -- {shlex.quote(path)}")
        if res.exit_code != 0:
            raise ToolboxError(400, "INVALID_FILE_PATH", (res.stdout + res.stderr).strip(), field="path")
        return Response(status_code=201)

    async def move(self, request: Request, edge: EdgeAPI, info: SandboxInfo) -> Response:
        src, dst = self._path(request, info, "source"), self._path(request, info, "destination")
        await _file_op(edge.move(info.sandbox_id, src, dst), src)
        return Response(status_code=200)

    async def permissions(self, request: Request, edge: EdgeAPI, info: SandboxInfo) -> Response:
        path = self._path(request, info)
        q = request.query_params
        steps = []
        if q.get("mode"):
            if not re.fullmatch(r"[0-7]{3,4}", q["mode"]):
                raise InvalidRequest(f"mode: octal permissions such as 644, not {q['mode']!r}", field="mode")
            steps.append(f"chmod {q['mode']} -- {shlex.quote(path)}")
        if q.get("owner") or q.get("group"):
            who = shlex.quote(q.get("owner", "") + (":" + q["group"] if q.get("group") else ""))
            steps.append(f"chown {who} -- {shlex.quote(path)}")
        if steps:
            res = await self._exec(edge, info, " && ".join(steps))
            if res.exit_code != 0:
                raise ToolboxError(400, "INVALID_FILE_PATH", (res.stdout + res.stderr).strip(), field="path")
        return Response(status_code=200)

    async def find(self, request: Request, edge: EdgeAPI, info: SandboxInfo) -> Response:
        path, pattern = self._path(request, info), self._query(request, "pattern")
        res = await self._exec(edge, info, f"grep -rnI -e {shlex.quote(pattern)} -- {shlex.quote(path)}")
        if res.exit_code > 1:
            raise ToolboxError(400, "INVALID_FILE_PATH", res.stderr.strip(), field="path")
        out = []
        for line in res.stdout.splitlines():
            file, _, tail = line.partition(":")
            num, _, content = tail.partition(":")
            if num.isdigit():
                out.append(m.Match(file=file, line=int(num), content=content))
        return json_response(out)

    async def search(self, request: Request, edge: EdgeAPI, info: SandboxInfo) -> Response:
        path, pattern = self._path(request, info), self._query(request, "pattern")
        res = await self._exec(edge, info, f"find {shlex.quote(path)} -name {shlex.quote(pattern)}")
        if res.exit_code != 0 and not res.stdout:
            raise ToolboxError(400, "INVALID_FILE_PATH", res.stderr.strip(), field="path")
        return json_response(m.SearchResult(files=res.stdout.splitlines()))

    async def replace(self, request: Request, edge: EdgeAPI, info: SandboxInfo) -> Response:
        body: m.ReplaceRequest = parse(m.ReplaceRequest, await read_body(request, MAX_BODY, "body"))
        out = []
        for f in body.files:
            path = self._abs(info, f)
            try:
                st = await edge.stat(info.sandbox_id, path)
                text = (await edge.read_file(info.sandbox_id, path)).decode()
                await edge.write_file(info.sandbox_id, path, text.replace(body.pattern, body.new_value).encode(),
                                      mode=st.mode & 0o7777, owner=(st.uid, st.gid))
                out.append(m.ReplaceResult(file=f, success=True))
            except (DsecError, UnicodeDecodeError) as e:
                out.append(m.ReplaceResult(file=f, success=False, error=getattr(e, "message", str(e))))
        return json_response(out)

    async def upload(self, request: Request, edge: EdgeAPI, info: SandboxInfo) -> Response:
        form = await request.form(max_files=1000, max_fields=1000, max_part_size=self.api.max_file_bytes)
        try:
            paths: dict[str, str] = {}
            files: dict[str, bytes] = {}
            for key, value in form.multi_items():
                hit = re.fullmatch(r"files\[(\d+)\]\.(path|file)", key)
                if hit is None:
                    continue
                if hit.group(2) == "path" and isinstance(value, str):
                    paths[hit.group(1)] = value
                elif not isinstance(value, str):
                    files[hit.group(1)] = await value.read()
            for i, path in paths.items():
                if i not in files:
                    raise InvalidRequest(f"files[{i}].file: missing", field=f"files[{i}].file")
                dest = self._abs(info, path)
                await _file_op(edge.make_dir(info.sandbox_id, posixpath.dirname(dest)), dest)
                await _file_op(edge.write_file(info.sandbox_id, dest, files[i]), dest)
        finally:
            await form.close()
        return Response(status_code=200)

    async def download(self, request: Request, edge: EdgeAPI, info: SandboxInfo) -> Response:
        body: m.DownloadRequest = parse(m.DownloadRequest, await read_body(request, MAX_BODY, "body"))
        boundary = secrets.token_hex(16)
        parts: list[bytes] = []
        for path in body.paths:
            disposition = f'form-data; name="{{}}"; filename="{_header_quote(path)}"'
            try:
                data = await _file_op(edge.read_file(info.sandbox_id, self._abs(info, path)), path)
                head = f"Content-Disposition: {disposition.format('file')}\r\nContent-Type: application/octet-stream"
            except ToolboxError as e:
                err = m.ErrorBody(status_code=e.status, message=e.message, error="Not Found", code=e.daemon_code,
                                  source=DAEMON)
                data = err.model_dump_json(by_alias=True, exclude_none=True).encode()
                head = f"Content-Disposition: {disposition.format('error')}\r\nContent-Type: application/json"
            parts.append(f"--{boundary}\r\n{head}\r\n\r\n".encode() + data + b"\r\n")
        parts.append(f"--{boundary}--\r\n".encode())
        return Response(b"".join(parts), media_type=f"multipart/form-data; boundary={boundary}")

    # ---- git ----

    async def _git(self, edge: EdgeAPI, info: SandboxInfo, cmd: str, cwd: str | None = None) -> str:
        res = await self._exec(edge, info, f"command -v git >/dev/null || {{ echo 'git is not installed in this "
                                           f"sandbox' >&2; exit 127; }}; {cmd}", cwd=cwd, timeout=3600)
        if res.exit_code != 0:
            text = (res.stderr or res.stdout).strip()
            if res.exit_code == 127:
                raise InvalidRequest(text, field="path")
            code = "GIT_REPO_NOT_FOUND" if "not found" in text or "does not exist" in text else "GIT_TRANSPORT_FAILED"
            raise ToolboxError(400 if "not a git repository" in text else 404 if code == "GIT_REPO_NOT_FOUND"
                               else 502, code, text, field="path")
        return res.stdout

    async def git_clone(self, request: Request, edge: EdgeAPI, info: SandboxInfo) -> Response:
        body: m.GitClone = parse(m.GitClone, await read_body(request, MAX_BODY, "body"))
        url = body.url
        if body.username and body.password and "://" in url:
            scheme, _, rest = url.partition("://")
            user, password = urllib.parse.quote(body.username, safe=""), urllib.parse.quote(body.password, safe="")
            url = f"{scheme}://{user}:{password}@{rest}"
        opts = (f" --branch {shlex.quote(body.branch)}" if body.branch else "") + \
            (f" --depth {body.depth}" if body.depth else "")
        dest = shlex.quote(self._abs(info, body.path))
        cmd = f"git clone{opts} -- {shlex.quote(url)} {dest}"
        if body.commit_id:
            cmd += f" && git -C {dest} checkout {shlex.quote(body.commit_id)}"
        await self._git(edge, info, cmd)
        return Response(status_code=200)

    async def git_status(self, request: Request, edge: EdgeAPI, info: SandboxInfo) -> Response:
        path = self._path(request, info)
        out = await self._git(edge, info, "git status --porcelain=v1 --branch", cwd=path)
        branch, files = "", []
        names = {"M": "Modified", "A": "Added", "D": "Deleted", "R": "Renamed", "C": "Copied", "?": "Untracked",
                 "U": "Updated but unmerged", " ": "Unmodified"}
        ahead = behind = 0
        published = False
        for line in out.splitlines():
            if line.startswith("## "):
                head = line[3:].removeprefix("No commits yet on ").removeprefix("Initial commit on ")
                branch = head.split("...")[0].split(" ")[0]
                published = "..." in head
                a, b = re.search(r"ahead (\d+)", head), re.search(r"behind (\d+)", head)
                ahead, behind = int(a.group(1)) if a else 0, int(b.group(1)) if b else 0
            elif len(line) > 3:
                files.append(m.GitFileStatus(name=line[3:], staging=names.get(line[0], "Modified"),
                                             worktree=names.get(line[1], "Modified")))
        return json_response(m.GitStatus(current_branch=branch, file_status=files,
                                 ahead=ahead, behind=behind, branch_published=published))

    async def git_add(self, request: Request, edge: EdgeAPI, info: SandboxInfo) -> Response:
        body: m.GitAdd = parse(m.GitAdd, await read_body(request, MAX_BODY, "body"))
        await self._git(edge, info, "git add -- " + " ".join(shlex.quote(f) for f in body.files),
                        cwd=self._abs(info, body.path))
        return Response(status_code=200)

    async def git_commit(self, request: Request, edge: EdgeAPI, info: SandboxInfo) -> Response:
        body: m.GitCommit = parse(m.GitCommit, await read_body(request, MAX_BODY, "body"))
        author = shlex.quote(f"{body.author} <{body.email}>")
        empty = " --allow-empty" if body.allow_empty else ""
        out = await self._git(edge, info, f"git -c user.name={shlex.quote(body.author)} -c user.email="
                                          f"{shlex.quote(body.email)} commit -q{empty}"
                                          f" --author={author} -m {shlex.quote(body.message)} && git rev-parse HEAD",
                              cwd=self._abs(info, body.path))
        return json_response({"hash": out.strip().splitlines()[-1] if out.strip() else ""})

    # ---- info ----

    async def home_dir(self, request: Request, edge: EdgeAPI, info: SandboxInfo) -> Response:
        res = await self._exec(edge, info, 'printf %s "$HOME"')
        return json_response(m.Dir(dir=res.stdout or "/root"))

    async def work_dir(self, request: Request, edge: EdgeAPI, info: SandboxInfo) -> Response:
        return json_response(m.Dir(dir=workdir(info)))

    async def version(self, request: Request, edge: EdgeAPI, info: SandboxInfo) -> Response:
        return json_response({"version": "dsec"})


def workdir(info: SandboxInfo) -> str:
    return info.labels.get(WORKDIR_LABEL, "/root")


class _NotRunning(DsecError):
    status = 409
    code = "sandbox_not_running"


async def _file_op(op: Awaitable[Any], path: str) -> Any:
    """A file operation, its NotFound as Daytona's FILE_NOT_FOUND (its SDK's DaytonaFileNotFoundError)."""
    try:
        return await op
    except NotFound as e:
        raise ToolboxError(404, "FILE_NOT_FOUND", f"{path}: {e.message}", field="path") from None
    except InvalidRequest as e:
        raise ToolboxError(400, "INVALID_FILE_PATH", f"{path}: {e.message}", field="path") from None


def _header_quote(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\r", "").replace("\n", "")
