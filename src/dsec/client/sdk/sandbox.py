"""The SDK's sandbox handle: a sandbox's id plus the client's requests (exec, sessions,
files, ports, TTY, pause / resume, checkpoints, stop), and the exec request it sends.
Cheap to make, holding no connection of its own: any process with the id can
``client.connect`` to the sandbox and carry on."""

from __future__ import annotations

import builtins
import json
from collections.abc import AsyncIterator
from typing import Any, Literal

import aiohttp
from pydantic import ValidationError

from dsec.client.sdk.transport import Api, Response, _raise_for
from dsec.shared.errors import ERRORS_BY_CODE, DsecError, InvalidRequest
from dsec.shared.wire.fleet import CheckpointInfo
from dsec.shared.wire.layers import Layer
from dsec.shared.wire.models import (
    AuditRecord,
    ClickRequest,
    CommandRecord,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileStat,
    KeysRequest,
    NetworkInfo,
    PackDiffRequest,
    SandboxEvent,
    SandboxInfo,
    SandboxUsage,
)
from dsec.shared.wire.snapshots import RollbackResult, SandboxSnapshot


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

    def __init__(self, client: Api, info: SandboxInfo) -> None:
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

    async def snapshot(self, name: str | None = None, *, timeout: float = 60.0) -> SandboxSnapshot:
        """Snapshot its files now, in place (a container on a btrfs edge; frozen for
        milliseconds, whatever it has written): kept on its edge until dropped or it ends,
        and :meth:`rollback` returns to it (docs/snapshots.md)."""
        return SandboxSnapshot.model_validate(await self._client._json(
            "POST", f"{self._base}/snapshot", json={"name": name}, timeout=timeout))

    async def snapshots(self) -> builtins.list[SandboxSnapshot]:
        """Its in-place snapshots, oldest first."""
        return [SandboxSnapshot.model_validate(x) for x in await self._client._json("GET", f"{self._base}/snapshots")]

    async def drop_snapshot(self, snapshot: SandboxSnapshot | str) -> None:
        name = snapshot if isinstance(snapshot, str) else snapshot.name
        await self._client._request("DELETE", f"{self._base}/snapshots/{name}")

    async def rollback(self, snapshot: SandboxSnapshot | str, *, timeout: float = 60.0) -> RollbackResult:
        """Its files back to ``snapshot`` exactly, in milliseconds: every process but
        dsec-init is killed (a command running now ends killed), shell sessions restart at
        their working directories of then, and command log records after it are dropped
        (their keys run again). The snapshot stays: roll back to it again at will."""
        name = snapshot if isinstance(snapshot, str) else snapshot.name
        return RollbackResult.model_validate(await self._client._json(
            "POST", f"{self._base}/rollback", json={"snapshot": name}, timeout=timeout))

    async def branch(self, n: int = 1, *, timeout: float = 600.0) -> builtins.list[AsyncSandbox]:
        """Live branch: ``n`` new sandboxes that continue from this one's running state,
        its processes and memory included, each with its own id, hostname, clock and
        entropy, limits and labels as this one's, and a copy of its command log; this one
        runs on (paused for the moment of the capture). MicroVMs and VMs; a container
        raises :class:`~dsec.BranchUnsupported` (docs/snapshots.md, "Live branch")."""
        data = await self._client._json("POST", f"{self._base}/branch", json={"n": n}, timeout=timeout)
        return [AsyncSandbox(self._client, SandboxInfo.model_validate(x)) for x in data]

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
