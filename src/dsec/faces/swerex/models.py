"""SWE-ReX's request and response bodies as dsec's own pydantic models: the same field
names, types and defaults as swe-rex 1.4.0 puts on the wire, so its ``RemoteRuntime``
reads our answers unchanged. Unknown fields are ignored (as SWE-ReX's server does),
which lets a newer client talk to this face; known fields are checked strictly, and
bounds that SWE-ReX leaves open (timeouts, sizes) are dsec's, named in the error."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field

MAX_TIMEOUT_S = 24 * 3600.0  # what dsec's exec accepts
Timeout = Annotated[float, Field(gt=0, le=MAX_TIMEOUT_S)]
MAX_COMMAND_CHARS = 1 << 20  # a command is a line an agent typed, not a payload
MAX_PATH_CHARS = 4096


def _no_nul(v: str) -> str:
    if "\0" in v:
        raise ValueError("must not contain NUL characters")
    return v


Text = Annotated[str, AfterValidator(_no_nul)]
SessionName = Annotated[Text, Field(min_length=1, max_length=256)]
PathText = Annotated[Text, Field(min_length=1, max_length=MAX_PATH_CHARS)]
CommandText = Annotated[Text, Field(max_length=MAX_COMMAND_CHARS)]


class IsAliveResponse(BaseModel):
    is_alive: bool
    message: str = ""


class CreateBashSessionRequest(BaseModel):
    startup_source: list[PathText] = []
    session: SessionName = "default"
    session_type: Literal["bash"] = "bash"
    startup_timeout: Timeout = 1.0


class CreateBashSessionResponse(BaseModel):
    output: str = ""
    session_type: Literal["bash"] = "bash"


class BashAction(BaseModel):
    command: CommandText
    session: SessionName = "default"
    timeout: Timeout | None = None
    is_interactive_command: bool = False
    is_interactive_quit: bool = False
    check: Literal["silent", "raise", "ignore"] = "raise"
    error_msg: str = ""
    expect: list[str] = []
    action_type: Literal["bash"] = "bash"


class BashInterruptAction(BaseModel):
    session: SessionName = "default"
    timeout: Timeout = 0.2
    n_retry: Annotated[int, Field(ge=0, le=100)] = 3
    expect: list[str] = []
    action_type: Literal["bash_interrupt"] = "bash_interrupt"


class BashObservation(BaseModel):
    output: str = ""
    exit_code: int | None = None
    failure_reason: str = ""
    expect_string: str = ""
    session_type: Literal["bash"] = "bash"


class CloseBashSessionRequest(BaseModel):
    session: SessionName = "default"
    session_type: Literal["bash"] = "bash"


class CloseBashSessionResponse(BaseModel):
    session_type: Literal["bash"] = "bash"


class Command(BaseModel):
    """A one-off process, as ``subprocess.run`` would take it (argv list, or a string
    with ``shell``)."""

    command: CommandText | Annotated[list[CommandText], Field(min_length=1,
                                                                                              max_length=65536)]
    timeout: Timeout | None = None
    shell: bool = False
    check: bool = False
    error_msg: str = ""
    env: dict[str, str] | None = None
    cwd: PathText | None = None
    merge_output_streams: bool = False


class CommandResponse(BaseModel):
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None


class ReadFileRequest(BaseModel):
    path: PathText
    encoding: str | None = None
    errors: str | None = None


class ReadFileResponse(BaseModel):
    content: str = ""


class WriteFileRequest(BaseModel):
    content: str
    path: PathText


class Empty(BaseModel):
    """WriteFileResponse, UploadResponse and CloseResponse: no fields."""


class ExceptionTransfer(BaseModel):
    """An exception for the client to raise again: ``class_path`` is the module and class
    it imports (``swerex.exceptions.CommandTimeoutError``, ``builtins.FileNotFoundError``)
    and constructs with ``message``; ``extra_info`` becomes the exception's attribute."""

    message: str = ""
    class_path: str = ""
    traceback: str = ""
    extra_info: dict[str, Any] = {}
