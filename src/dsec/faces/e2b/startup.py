"""A template's start at each create: its start command run in the background as the
template's user, then the wait (bounded) until it is ready — a port answering ``/health``
(dsec's own code interpreter) or the template's ready command exiting 0 (built templates,
as E2B's ``readyCmd``) — before the sandbox is handed out."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator

from dsec.faces.e2b.accounts import UnknownUser
from dsec.faces.e2b.accounts import load as load_accounts
from dsec.faces.e2b.template import Template
from dsec.node.edge.api import EdgeAPI
from dsec.shared.errors import InvalidRequest, SandboxError
from dsec.shared.wire.edge import ProcOutput, ProcRef, ProcSpec

TEMPLATE_READY_S = 90.0
READY_PROBE_S = 30
# what E2B's SDKs set as the ready command of a Dockerfile's CMD (``wait_for_timeout``): a
# pause E2B takes once, at build time, before it snapshots the running sandbox; dsec starts
# the command at each create and does not make every create sleep
TIMER_ONLY = re.compile(r"^\s*sleep\s+\d+(\.\d+)?\s*$")
# E2B runs a template's commands in a login shell; an image without bash has sh
SHELL = 'if [ -x /bin/bash ]; then exec /bin/bash -l -c "$1"; fi; exec /bin/sh -l -c "$1"'


async def start(edge: EdgeAPI, sandbox_id: str, template: Template) -> None:
    accounts = await load_accounts(edge, sandbox_id)
    try:
        user = accounts.user(template.user.split(":", 1)[0] if template.user else None)
    except UnknownUser as e:
        raise InvalidRequest(f"template {template.template_id}: {e}", field="templateID") from None
    if template.start_cmd is not None:
        cmd, args = "/bin/sh", ["-c", SHELL, "sh", template.start_cmd]
    else:
        assert template.start is not None
        cmd, args = template.start[0], template.start[1:]
    spec = ProcSpec(cmd=cmd, args=args, envs={**user.env(), **template.envs}, cwd=template.workdir or user.home,
                    tag="template-start", owner=user.owner)
    stream = edge.proc_start(sandbox_id, spec)
    try:
        await anext(stream)  # started
        if template.ready_port is None and (not template.ready_cmd or TIMER_ONLY.match(template.ready_cmd)):
            return
        ended = asyncio.ensure_future(_end_of(stream))
        deadline = time.monotonic() + TEMPLATE_READY_S
        try:
            while time.monotonic() < deadline:
                if ended.done():
                    raise SandboxError(f"the template's start command ended ({ended.result()}) before it was ready")
                if await _ready(edge, sandbox_id, template, spec, deadline):
                    return
                await asyncio.sleep(0.1)
        finally:
            ended.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await ended
        what = f"port {template.ready_port} did not answer" if template.ready_port else \
            f"its ready command ({template.ready_cmd}) did not succeed"
        raise SandboxError(f"the template's start command ran, but {what} within {TEMPLATE_READY_S:g} s")
    finally:
        await stream.aclose()  # type: ignore[attr-defined]  # the process runs on; we stop listening


async def _ready(edge: EdgeAPI, sandbox_id: str, template: Template, spec: ProcSpec, deadline: float) -> bool:
    with contextlib.suppress(SandboxError):
        if template.ready_port is not None:
            return (await edge.http(sandbox_id, template.ready_port, "GET", "/health", [], b"", 5)).status == 200
        assert template.ready_cmd is not None
        probe = spec.model_copy(update={"args": ["-c", SHELL, "sh", template.ready_cmd], "cmd": "/bin/sh",
                                        "tag": "template-ready"})
        stream = edge.proc_start(sandbox_id, probe)
        try:
            bound = max(1.0, min(READY_PROBE_S, deadline - time.monotonic()))
            return await asyncio.wait_for(_end_code(stream), bound) == 0
        except TimeoutError:
            with contextlib.suppress(Exception):
                await edge.proc_signal(sandbox_id, ProcRef(tag="template-ready"), 9)
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
    return False


async def _end_code(stream: AsyncIterator[ProcOutput]) -> int:
    async for ev in stream:
        if ev.kind == "end":
            return ev.exit_code
    return -1


async def _end_of(stream: AsyncIterator[ProcOutput]) -> str:
    """How a process's stream ends (its status), reading past its output."""
    async for ev in stream:
        if ev.kind == "end":
            return ev.status
    return "the sandbox ended"
