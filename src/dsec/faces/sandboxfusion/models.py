"""SandboxFusion's wire format for ``/run_code``, as its server and clients (the
``sandbox-fusion`` package, verl) define it: field names, defaults, status strings.

Written from SandboxFusion's published API; unknown request fields are ignored, as
SandboxFusion's own server ignores them, so a newer client keeps working.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

# SandboxFusion's names of the languages and test-runner modes dsec serves, in the names
# FnCall uses for them. "c" is not one of SandboxFusion's (it has no plain-C runner); dsec
# accepts it as well. The languages past the FnCall base run on their toolchain layers.
LANGUAGES: dict[str, str] = {
    "python": "python", "cpp": "cpp", "c": "c", "java": "java", "go": "go", "nodejs": "nodejs", "js": "nodejs",
    "rust": "rust", "bash": "bash", "pytest": "pytest", "junit": "junit", "go_test": "go_test", "jest": "jest",
    "typescript": "typescript", "ts": "typescript", "php": "php", "ruby": "ruby", "perl": "perl", "lua": "lua",
    "R": "r", "D_ut": "d", "csharp": "csharp", "scala": "scala", "verilog": "verilog", "racket": "racket",
    "kotlin_script": "kotlin"}
# SandboxFusion's languages dsec cannot serve on these machines, and why (501, not 400: the
# request is well formed)
NOT_SERVED: dict[str, str] = {
    "julia": "Julia is not packaged in Debian 12 (removed after bullseye), nor on PyPI or npm",
    "swift": "Swift has no Debian 12, PyPI or npm package (swift.org's toolchains are not reachable here)",
    "lean": "Lean 4 has no Debian 12 package; elan downloads toolchains from GitHub, which is not reachable here",
    "cuda": "no GPU on FnCall nodes",
    "python_gpu": "no GPU on FnCall nodes",
}


class RunStatus(StrEnum):
    Success = "Success"  # every step finished with return code 0
    Failed = "Failed"  # a step returned non-zero or ran out of time
    SandboxError = "SandboxError"  # the platform failed: the code's behaviour says nothing


class CommandRunStatus(StrEnum):
    Finished = "Finished"
    Error = "Error"
    TimeLimitExceeded = "TimeLimitExceeded"


class CommandRunResult(BaseModel):
    """One step (compile or run). ``execution_time`` is wall-clock seconds, ``cpu_time`` CPU seconds;
    ``return_code`` is negative for a signal (-9: killed), None on a time limit."""

    status: CommandRunStatus
    execution_time: float | None = None
    cpu_time: float | None = None  # in the sandbox-fusion client's model; user + system seconds
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class RunCodeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    compile_timeout: float = Field(default=10, description="seconds for the compile step of compiled languages")
    run_timeout: float = Field(default=10, description="seconds of wall-clock time for the run")
    memory_limit_MB: int = Field(default=-1, description="address space of the program in MB; -1: the largest "
                                 "dsec allows (2048)")
    code: str = Field(description="the program")
    stdin: str | None = Field(default=None, description="fed to the program's standard input")
    language: str = Field(description=f"one of {', '.join(LANGUAGES)}")
    files: dict[str, str | None] = Field(default_factory=dict,
                                         description="relative path -> base64 content, written before the run")
    fetch_files: list[str] = Field(default_factory=list,
                                   description="relative paths read back after the run, base64 in files")
    # dsec's own field (SandboxFusion has none like it; its clients never send it)
    layers: list[str] = Field(default_factory=list, max_length=8,
                              description="dsec: toolkit layers on the FnCall image for this call, e.g. "
                                          "tk/fncall-scipy:12-r2 (numpy, pandas, scipy, ...)")


class RunCodeResponse(BaseModel):
    status: RunStatus
    message: str = ""
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = Field(default=None, description="the pooled dsec sandbox that ran the code")
    files: dict[str, str] = Field(default_factory=dict)


class ErrorBody(RunCodeResponse):
    """A refused request: SandboxFusion's response shape (status SandboxError, the reason in
    message), so a client that parses every body as a RunCodeResponse reads the reason,
    plus dsec's error fields (``error``, ``field``, ``code``) for those that know them."""

    error: str
    field: str | None = None
    code: int
