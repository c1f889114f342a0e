"""Wire models of the edge contract's interactive parts: long-lived processes, directory
watches, streamed HTTP to a sandbox port and the TTY duplex. Bytes travel as base64 in
JSON, so every model here crosses the edge daemon's wire unchanged."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from dsec.shared.wire.models import Owner

_BYTES = ConfigDict(ser_json_bytes="base64", val_json_bytes="base64")


class ProcSpec(BaseModel):
    """A long-lived process to start (E2B's process service): as ``owner`` when given,
    on a pty of ``pty`` (cols, rows) or on pipes, with stdin kept open if asked."""

    cmd: str = Field(min_length=1)
    args: list[str] = []
    envs: dict[str, str] = {}
    cwd: str | None = None
    pty: tuple[int, int] | None = None
    stdin: bool = False
    tag: str | None = None
    owner: Owner | None = None


class ProcRef(BaseModel):
    """Which process: by pid, else by tag."""

    pid: int | None = None
    tag: str | None = None

    def __str__(self) -> str:
        return f"pid {self.pid}" if self.pid else f"tag {self.tag!r}"


class ProcInfo(BaseModel):
    pid: int
    tag: str | None = None
    cmd: str
    args: list[str]
    envs: dict[str, str]
    cwd: str
    pty: bool


class ProcOutput(BaseModel):
    """One item of a process's stream: ``start`` (its pid) first, then ``data`` (a stream's
    bytes), ``lost`` (the reader fell behind and output was dropped), ``keepalive`` while
    nothing happens, and ``end`` last (exit_code -1: the sandbox ended under it)."""

    model_config = _BYTES

    kind: Literal["start", "data", "lost", "keepalive", "end"]
    pid: int = 0
    stream: str = ""
    data: bytes = b""
    exit_code: int = 0
    status: str = ""


class FsEvent(BaseModel):
    name: str  # relative to the watched directory
    kind: Literal["create", "write", "remove", "rename", "chmod"]


class HttpPart(BaseModel):
    """A streamed HTTP response: the head (status, headers) first, then body chunks."""

    model_config = _BYTES

    status: int | None = None
    headers: list[tuple[str, str]] = []
    data: bytes = b""


class TtyInput(BaseModel):
    """From the user's terminal: keystrokes, or a new window size (cols, rows)."""

    model_config = _BYTES

    data: bytes = b""
    resize: tuple[int, int] | None = None


class TtyOutput(BaseModel):
    """To the user's terminal: output, and last the shell's exit code."""

    model_config = _BYTES

    data: bytes = b""
    exit_code: int | None = None
