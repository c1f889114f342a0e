"""Wire models shared by the SDK, the apiserver and the edge.

Everything that crosses a process or component boundary is one of these pydantic
models, so a field is validated once, at the edge of the system, with an error that
names it.
"""

from __future__ import annotations

import base64
import os
import re
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from dsec.shared.wire.fleet import CheckpointInfo, EdgeSignals, Health, HostLoad

DEFAULT_MAX_OUTPUT_BYTES = 16 * 1024 * 1024
LAYER_REF_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*/[a-z0-9][a-z0-9._/-]*:[A-Za-z0-9._-]+$")


def normalize_layer_ref(ref: str) -> str:
    """``base/busybox`` means ``base/busybox:latest``; raise ValueError if malformed."""
    if ":" not in ref.rsplit("/", 1)[-1]:
        ref += ":latest"
    if not LAYER_REF_RE.match(ref):
        raise ValueError(f"{ref!r} must look like kind/name:version, e.g. base/debian:12")
    return ref
EDGE_NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,30}$")
SANDBOX_ID_RE = re.compile(r"^([a-z][a-z0-9]{0,30})-([a-z0-9]{12})$")
SESSION_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# a command log key (docs/rl.md): "rollout-88/turn-3", "job:step@12+a=b"
COMMAND_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:/@+=-]{0,255}$")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Backend(StrEnum):
    container = "container"
    microvm = "microvm"
    vm = "vm"


class SandboxState(StrEnum):
    creating = "creating"
    running = "running"
    paused = "paused"
    stopping = "stopping"
    stopped = "stopped"
    failed = "failed"
    restoring = "restoring"  # its node was lost or drained: coming back on another edge from its checkpoint


def parse_sandbox_id(sandbox_id: str) -> str:
    """Return the edge that owns ``sandbox_id``; raise ValueError if it is malformed."""
    m = SANDBOX_ID_RE.match(sandbox_id)
    if not m:
        raise ValueError(f"sandbox_id {sandbox_id!r} is malformed (expected EDGE-xxxxxxxxxxxx)")
    return m.group(1)


def _check_env(v: dict[str, str]) -> dict[str, str]:
    for k, val in v.items():
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", k):
            raise ValueError(f"env name {k!r} is not a valid variable name")
        if "\0" in val:
            raise ValueError(f"env {k} must not contain NUL characters")
    return v


class SandboxBase(Strict):
    """What every kind of sandbox is created with: its layer stack, lifetime and labels."""

    image: str = Field(default="base/debian:12", description="base layer, kind/name:version")
    layers: list[str] = Field(default_factory=list, description="workspace/toolkit layers, bottom to top")
    ttl_running_stop: Annotated[int | None, Field(ge=1, description="idle seconds before it is stopped")] = 1800
    ttl_running_pause: Annotated[int | None, Field(ge=1, description="idle seconds before it is paused")] = None
    ttl_paused_stop: Annotated[int | None, Field(ge=1, description="seconds paused before it is stopped")] = None
    max_lifetime_s: Annotated[int | None, Field(ge=1)] = 24 * 3600
    on_expiry: Literal["stop", "pause"] = Field(
        default="stop", description="what reaching max_lifetime_s does: stop it, or pause it (it then stays "
        "paused until resumed with a new lifetime, as E2B's connect does, or until ttl_paused_stop)")
    env: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    job: str | None = Field(default=None, max_length=128)
    workdir: str = "/root"
    checkpoint_every_s: Annotated[int, Field(ge=5, le=7 * 24 * 3600)] | None = Field(
        default=None, description="checkpoint it to the shared store this often, so it comes back under its own id "
        "on another edge should its node fail or be drained (docs/fault-tolerance.md): a container's writable "
        "layer incrementally (its processes restart), a VM's memory and disk whole (it runs on); None: never")

    @field_validator("image")
    @classmethod
    def _image(cls, v: str) -> str:
        return normalize_layer_ref(v)

    @field_validator("layers")
    @classmethod
    def _layers(cls, v: list[str]) -> list[str]:
        if len(v) > 32:
            raise ValueError("at most 32 layers")
        refs = [normalize_layer_ref(ref) for ref in v]
        dup = {r for r in refs if refs.count(r) > 1}
        if dup:
            raise ValueError(f"layer {sorted(dup)[0]!r} appears more than once in the stack")
        return refs

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_env(v)

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError("workdir must be an absolute path")
        return v


_RULE_KEY = re.compile(r"^([a-z][a-z0-9_-]{0,31}"
                       r"|(host|\d{1,3}(\.\d{1,3}){3}(/\d{1,2})?):\d{1,5}(-\d{1,5})?/(tcp|udp))$")


def check_network_rules(v: dict[str, bool]) -> dict[str, bool]:
    if len(v) > 64:
        raise ValueError("at most 64 network rules")
    bad = [k for k in v if not _RULE_KEY.match(k)]
    if bad:
        raise ValueError(f"{bad[0]!r} is neither a service name nor ip[/len]:port[-port]/tcp|udp "
                         "(nor host:port[-port]/tcp|udp)")
    return v


class NetworkRulesRequest(Strict):
    rules: dict[str, bool] = Field(description="changes: a key set to true allows it, false removes it")

    @field_validator("rules")
    @classmethod
    def _rules(cls, v: dict[str, bool]) -> dict[str, bool]:
        return check_network_rules(v)


class AuditRecord(BaseModel):
    """One thing that happened in a sandbox, as the edge recorded it."""

    ts: float
    kind: str = Field(description="process, exec, file_write, file_remove, http, tty, egress_denied, flag, ...")
    detail: str
    flag: str | None = Field(default=None, description="the detector this record reports, if any")


class ProtectRequest(Strict):
    paths: list[str] = Field(min_length=1, max_length=64, description="absolute paths (files or trees) whose "
                             "later changes are flagged")

    @field_validator("paths")
    @classmethod
    def _abs(cls, v: list[str]) -> list[str]:
        for p in v:
            if not p.startswith("/") or "\0" in p or len(p) > 4096:
                raise ValueError(f"{p!r} is not an absolute path")
        return [os.path.normpath(p) for p in v]


class NetworkInfo(BaseModel):
    """A sandbox's network link and the egress it is allowed."""

    address: str
    gateway: str
    rules: dict[str, bool] = Field(description="what is allowed now (services and raw ip:port/proto)")
    hosts: list[str] = Field(default_factory=list, description="host names the allowed services stand for")


# what admission reserves for a best-effort container by default (of its limits): measured
# fleets of RL sandboxes mostly sit idle (DSec: ~90% use <= 5% of what they ask for), so
# reserving the limit would leave a node nearly empty; the limit still caps each one
BEST_EFFORT_CPU_SHARE = 0.05
BEST_EFFORT_MEMORY_DIVISOR = 8


class ContainerArgs(SandboxBase):
    """What a caller asks for when creating a container sandbox."""

    backend: Literal["container"] = "container"
    memory_limit_mb: Annotated[int, Field(ge=16, le=1024 * 1024)] = 512
    cpu_cores_limit: Annotated[float, Field(gt=0, le=1024)] = 1.0
    cpu_request: Annotated[float, Field(gt=0, le=1024)] | None = Field(
        default=None, description="CPU cores admission reserves for it (what it may use is cpu_cores_limit); "
        f"default: {BEST_EFFORT_CPU_SHARE:g} of the limit for best_effort, the limit for latency_sensitive")
    memory_request_mb: Annotated[int, Field(ge=1, le=1024 * 1024)] | None = Field(
        default=None, description="memory admission reserves for it (at least what it holds at the moment); "
        f"default: 1/{BEST_EFFORT_MEMORY_DIVISOR} of the limit (>= 16 MiB) for best_effort, the limit for "
        "latency_sensitive")
    pids_limit: Annotated[int, Field(ge=8, le=1 << 22)] = 1024
    qos: Literal["best_effort", "latency_sensitive"] = Field(
        default="best_effort", description="best_effort runs under SCHED_IDLE with minimal CPU shares: it only "
        "gets CPU time latency-sensitive work leaves idle")
    tmpfs: dict[str, Annotated[int, Field(ge=1, le=64 * 1024)]] = Field(
        default_factory=dict, description="extra tmpfs mounts, absolute path -> size in MiB (charged to memory)")
    readonly_rootfs: bool = Field(
        default=False, description="the root filesystem is read-only inside the sandbox (to root there too, and "
        "to the file API); writable: the tmpfs mounts, /dev/shm, /dev/mqueue")
    record_access: bool = Field(
        default=False, description="record which chunks of its layers this sandbox reads and save them, when "
        "it stops, as the layers' access lists (prefetched by later sandboxes); needs a shared layer store")
    disk_limit_mb: Annotated[int, Field(ge=16, le=64 * 1024 * 1024)] = Field(
        default=10240, description="quota on the writable layer (data and metadata, so it also bounds the number "
        "of files); writes past it fail with EDQUOT inside the sandbox")
    protected_paths: list[str] = Field(
        default_factory=list, max_length=64, description="paths (say, the tests that grade the rollout) whose "
        "files are fingerprinted at start; any later change, addition or removal is flagged in the audit log")
    network_rules: dict[str, bool] | None = Field(
        default=None, description="egress allowlist: service name (pypi, npm, debian, or one the operator "
        "added) or 'ip[/len]:port[-port]/tcp|udp' -> allowed (never this host, other sandboxes, loopback, "
        "link-local, multicast or wider than a /8); 'host:port[-port]/tcp|udp' reaches this host, for the "
        "cluster admin only. None: no network interface at all (loopback only); {} wires one that denies "
        "everything until rules are set")

    @model_validator(mode="after")
    def _requests_within_limits(self) -> ContainerArgs:
        if self.cpu_request is not None and self.cpu_request > self.cpu_cores_limit:
            raise ValueError(f"cpu_request ({self.cpu_request}) is above cpu_cores_limit ({self.cpu_cores_limit})")
        if self.memory_request_mb is not None and self.memory_request_mb > self.memory_limit_mb:
            raise ValueError(f"memory_request_mb ({self.memory_request_mb}) is above memory_limit_mb "
                             f"({self.memory_limit_mb})")
        return self

    @property
    def cpu_admitted(self) -> float:
        """What admission reserves: the request, else a share of the limit by QoS class."""
        if self.cpu_request is not None:
            return self.cpu_request
        return self.cpu_cores_limit * (BEST_EFFORT_CPU_SHARE if self.qos == "best_effort" else 1.0)

    @property
    def memory_admitted_mb(self) -> int:
        if self.memory_request_mb is not None:
            return self.memory_request_mb
        if self.qos == "best_effort":
            return min(self.memory_limit_mb, max(16, self.memory_limit_mb // BEST_EFFORT_MEMORY_DIVISOR))
        return self.memory_limit_mb

    @field_validator("protected_paths")
    @classmethod
    def _protected(cls, v: list[str]) -> list[str]:
        return ProtectRequest(paths=v).paths if v else v

    @field_validator("network_rules")
    @classmethod
    def _network_rules(cls, v: dict[str, bool] | None) -> dict[str, bool] | None:
        return None if v is None else check_network_rules(v)

    @field_validator("tmpfs")
    @classmethod
    def _tmpfs(cls, v: dict[str, int]) -> dict[str, int]:
        if len(v) > 8:
            raise ValueError("at most 8 tmpfs mounts")
        for path in v:
            norm = os.path.normpath(path)
            if not path.startswith("/") or norm == "/" or norm.split("/")[1] in ("proc", "sys", "dev") \
                    or "\0" in path or norm != path:
                raise ValueError(f"tmpfs path {path!r} must be absolute, normalized, and not /, /proc, /sys or /dev")
        return v


# QEMU's own memory beside guest RAM (TCG code cache of 64 MiB, devices): reserved at
# admission and added to the VM cgroup's limit
VM_OVERHEAD_MB = 160


class _VMBase(SandboxBase):
    vcpus: Annotated[int, Field(ge=1, le=64)] = 1
    memory_mb: Annotated[int, Field(ge=128, le=256 * 1024)] = 512
    disk_mb: Annotated[int, Field(ge=64, le=1024 * 1024, description="size of the writable disk (sparse)")] = 2048
    template: bool = Field(default=True, description="start by cloning a snapshotted template VM of the same "
                           "shape (made on first use) instead of booting")

    @property
    def memory_limit_mb(self) -> int:
        return self.memory_mb + VM_OVERHEAD_MB

    @property
    def cpu_cores_limit(self) -> float:
        return float(self.vcpus)

    # a VM's guest RAM is really allocated (and its vCPUs are threads that spin up), so
    # admission reserves all of it
    @property
    def memory_admitted_mb(self) -> int:
        return self.memory_limit_mb

    @property
    def cpu_admitted(self) -> float:
        return self.cpu_cores_limit


class MicroVMArgs(_VMBase):
    """A microVM: QEMU -M microvm, the layers as read-only virtio disks, overlay root in the guest."""

    backend: Literal["microvm"] = "microvm"


class VMArgs(_VMBase):
    """A full VM: QEMU q35 (PCI, VGA display, USB tablet) from a layer stack."""

    backend: Literal["vm"] = "vm"
    display: bool = Field(default=True, description="a VGA display for screenshots and input events")


def _backend_of(v: Any) -> str:
    """The args' backend; a body without one means a container (the first backend)."""
    if isinstance(v, dict):
        return str(v.get("backend", "container"))
    return str(getattr(v, "backend", "container"))


AnySandboxArgs = Annotated[
    Annotated[ContainerArgs, Tag("container")] | Annotated[MicroVMArgs, Tag("microvm")]
    | Annotated[VMArgs, Tag("vm")],
    Discriminator(_backend_of, custom_error_type="invalid_backend",
                  custom_error_message="backend must be container, microvm or vm")]
# what a validation error's location holds for the union's branch: not a field name
BACKEND_TAGS = ("container", "microvm", "vm")


SandboxArgs = ContainerArgs


class CreateRequest(Strict):
    args: AnySandboxArgs


class KeysRequest(Strict):
    keys: str = Field(max_length=4096, description="key combinations, e.g. 'ctrl-alt-t' or 'h i ret' "
                      "(QEMU key codes joined by '-', combinations separated by spaces)")


class ClickRequest(Strict):
    x: Annotated[int, Field(ge=0, le=65535)]
    y: Annotated[int, Field(ge=0, le=65535)]
    button: Literal["left", "right", "middle"] = "left"


class PackDiffRequest(Strict):
    ref: str = Field(description="the new workspace layer, ws/name:version")
    scrub_paths: list[str] = Field(default_factory=list, description="absolute paths left out of the layer")
    default_scrub: bool = Field(default=True, description="also leave out shell history, /tmp, caches, logs")
    visibility: Literal["public", "project", "private"] = Field(
        default="project", description="who may see and use the layer: every project, the sandbox's project and "
        "its subtree, or the sandbox's project alone (and admins above it, in both)")


class ForkRequest(Strict):
    snapshot: str = Field(description="a layer made by pack_diff")
    n: Annotated[int, Field(ge=1, le=256)] = 1
    args: ContainerArgs | None = Field(default=None, description="limits, TTLs, labels; image and layers "
                                       "come from the snapshot")


class SandboxInfo(BaseModel):
    sandbox_id: str
    edge: str
    backend: Backend
    state: SandboxState
    image: str
    layers: list[str]
    created_at: float
    last_active_at: float
    labels: dict[str, str] = Field(default_factory=dict)
    job: str | None = None
    memory_limit_mb: int
    cpu_cores_limit: float
    disk_limit_mb: int | None = Field(default=None, description="containers: the quota on its writable layer")
    error: str | None = None
    vm: VMInfo | None = Field(default=None, description="VM sandboxes: accelerator and how it started")
    paused_at: float | None = None
    expires_at: float | None = Field(default=None, description="when its maximum lifetime ends")
    usage: SandboxUsage | None = Field(default=None, description="filled on request (?usage=true, GET .../usage)")
    pause: PauseInfo | None = Field(default=None, description="the last pause: memory before and after, timings")
    network: NetworkInfo | None = Field(default=None, description="containers with network_rules: link and egress")
    checkpoint_every_s: int | None = Field(default=None, description="its checkpoint interval")
    checkpoint: CheckpointInfo | None = Field(default=None, description="its newest checkpoint")
    restored_from: str | None = Field(default=None, description="the edge it ran on before its last restore, "
                                      "and why it moved")
    branched_from: str | None = Field(default=None, description="the sandbox it is a live branch of (it started "
                                      "from that sandbox's running state: docs/snapshots.md)")


class SandboxUsage(BaseModel):
    """What a sandbox uses now, from its cgroup and its writable layer."""

    cpu_s: float = 0.0
    memory_bytes: int = Field(0, description="charged to its cgroup (anon + file)")
    anon_bytes: int = 0
    file_bytes: int = 0
    swap_bytes: int = 0
    pids: int = 0
    disk_bytes: int = Field(0, description="allocated by its writable layer (upper dir, or a VM's disk image)")
    oom_kills: int = Field(0, description="processes the kernel killed at its memory limit")


class PauseInfo(BaseModel):
    memory_before_bytes: int = Field(description="memory charged to the sandbox's cgroup when the pause began")
    memory_after_bytes: int = Field(description="... once paused (containers: after reclaim to swap; VMs: QEMU ended)")
    swap_bytes: int = 0
    pause_s: float
    resume_s: float | None = None


class VMInfo(BaseModel):
    machine: str
    accelerator: str = Field(description="kvm, or tcg (emulated: several times slower)")
    vcpus: int
    memory_mb: int
    disk_mb: int
    started_from: str = Field(description="boot, template, snapshot (a resumed pause), checkpoint (restored "
                              "from one, on this edge or another), or branch (a live branch of a running VM)")
    boot_s: float | None = None
    clone_s: float | None = None
    pause_s: float | None = None
    restore_s: float | None = None
    snapshot_bytes: int | None = Field(default=None, description="size of the pause snapshot while paused")


class ExecRequest(Strict):
    """Run one command. ``cmd`` runs through the sandbox's shell; ``argv`` runs directly."""

    cmd: str | None = None
    argv: list[str] | None = None
    session: str | None = Field(default=None, description="named shell session; state persists")
    timeout_s: Annotated[float, Field(gt=0, le=24 * 3600)] = 300.0
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    stdin: str | None = None
    max_output_bytes: Annotated[int, Field(ge=0, le=1 << 30)] = DEFAULT_MAX_OUTPUT_BYTES
    key: str | None = Field(default=None, description="record the command under this key in the sandbox's "
                            "command log; the same key again returns the recorded result (docs/rl.md)")
    uid: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = Field(
        default=None, description="run as this user id (default root); not with a session, whose shell runs as root")
    gid: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = Field(default=None, description="its group (default: uid)")

    @model_validator(mode="after")
    def _user(self) -> ExecRequest:
        if self.gid is not None and self.uid is None:
            raise ValueError("gid needs a uid")
        if self.uid is not None and self.session is not None:
            raise ValueError("uid: a session's shell runs as root; run the command without a session")
        return self

    @field_validator("session")
    @classmethod
    def _session(cls, v: str | None) -> str | None:
        if v is not None and not SESSION_RE.match(v):
            raise ValueError("session must be 1-64 of [A-Za-z0-9_.-]")
        return v

    @field_validator("key")
    @classmethod
    def _key(cls, v: str | None) -> str | None:
        if v is not None and not COMMAND_KEY_RE.match(v):
            raise ValueError("key must be 1-256 of [A-Za-z0-9_.:/@+=-], starting with a letter or digit")
        return v

    @field_validator("cmd", "cwd", "stdin")
    @classmethod
    def _no_nul(cls, v: str | None) -> str | None:
        if v is not None and "\0" in v:
            raise ValueError("must not contain NUL characters")
        return v

    @field_validator("argv")
    @classmethod
    def _argv_no_nul(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and any("\0" in a for a in v):
            raise ValueError("arguments must not contain NUL characters")
        return v

    @field_validator("env")
    @classmethod
    def _exec_env(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_env(v)

    def model_post_init(self, _ctx: object) -> None:
        if (self.cmd is None) == (self.argv is None):
            raise ValueError("exactly one of cmd and argv must be given")
        if self.argv is not None and not self.argv:
            raise ValueError("argv must not be empty")
        if self.session is not None and self.argv is not None:
            raise ValueError("argv cannot run in a session; use cmd")
        if self.session is not None and self.stdin is not None:
            raise ValueError("stdin is not supported for session commands")


class ExecResult(BaseModel):
    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    duration_ms: float = 0.0
    # whose failure (docs/rl.md): "workload" for a non-zero exit or the command's own timeout,
    # "infra" when the platform lost the command under it (a keyed command interrupted by an
    # edge restart); None when it succeeded
    failure: Literal["workload", "infra"] | None = None
    replayed: bool = Field(default=False, description="the command log's recorded result: this call ran nothing")

    def model_post_init(self, _ctx: object) -> None:
        if self.failure is None and (self.exit_code != 0 or self.timed_out):
            self.failure = "workload"


class CommandRecord(BaseModel):
    """One keyed command in a sandbox's command log (docs/rl.md)."""

    key: str
    seq: int = Field(description="its place in the log, from 1")
    cmd: str | None = None
    argv: list[str] | None = None
    session: str | None = None
    cwd: str | None = None
    state: Literal["running", "done", "interrupted"]
    started_at: float
    finished_at: float | None = None
    result: ExecResult | None = Field(default=None, description="with output capped to the log's bound")


class ExecEvent(BaseModel):
    """One item of a streamed exec: output as it is produced, then the result."""

    type: Literal["stdout", "stderr", "result"]
    data: str | None = None
    result: ExecResult | None = None


Owner = tuple[int, int]  # (uid, gid) inside the sandbox


class FileStat(BaseModel):
    path: str
    name: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int
    mtime: float
    link_target: str | None = None
    uid: int = 0
    gid: int = 0
    xattrs: dict[str, str] = Field(default_factory=dict, description="its user.* extended attributes")


class HttpResponse(BaseModel):
    model_config = ConfigDict(ser_json_bytes="base64", val_json_bytes="base64")

    status: int
    headers: list[tuple[str, str]]
    body: bytes


class NodeStats(BaseModel):
    """What the watcher learns from an edge: health and load."""

    edge: str
    healthy: bool
    backends: list[Backend]
    cpus: int
    memory_mb: int
    cpu_overcommit: float
    memory_overcommit: float
    sandboxes: int
    cpu_reserved: float
    memory_reserved_mb: int
    max_sandboxes: int
    per_job: dict[str, int] = Field(default_factory=dict)
    vm: dict[str, Any] | None = Field(default=None, description="VM support: accelerator (from a probe boot), "
                                      "agent channel, QEMU and guest kernel")
    network: str | None = Field(default=None, description="sandbox networking: subnet and egress services, "
                                "or why it is off")
    density: dict[str, Any] | None = Field(default=None, description="swap for paused sandboxes, CPU QoS "
                                           "mechanisms (SCHED_IDLE, core scheduling)")
    signals: EdgeSignals | None = Field(default=None,
                                        description="what the health detector reads (dsec.control.health)")
    cordoned: bool = Field(default=False, description="this edge refuses new sandboxes (an operator or the "
                           "detector cordoned it)")
    health: Health = Field(default="ok", description="the detector's verdict, as the registry has it")
    host: HostLoad | None = Field(default=None, description="the node's own CPU, memory and swap (/proc)")
    hollow: bool = Field(default=False, description="a hollow edge: a load instrument for the control plane "
                         "whose sandboxes run nothing (docs/scale.md)")


# ---- FnCall ------------------------------------------------------------------
FnCallStatus = Literal["ok", "compile_error", "time_limit", "memory_limit", "runtime_error", "output_limit"]
Verdict = Literal["accepted", "wrong_answer", "time_limit", "memory_limit", "runtime_error", "output_limit"]
MAX_FNCALL_INPUT = 16 * 1024 * 1024
# The default FnCall image. Layers are immutable, so a change to its package list
# (dsec.node.layers.base.FNCALL_PACKAGES) takes a new revision here: `dsec setup` then builds it
# on machines that already hold an older one. r2: Java, Go, Node.js and Rust added.
FNCALL_IMAGE = "base/fncall:12-r2"


class TestCase(Strict):
    __test__ = False  # not a pytest class

    stdin: str = Field(default="", max_length=MAX_FNCALL_INPUT)
    expected_stdout: str | None = Field(default=None, max_length=MAX_FNCALL_INPUT)


class FnCallArgs(Strict):
    """A short stateless task: code in a language, run in a pooled warm container."""

    language: str = Field(min_length=1, max_length=32)
    code: str = Field(min_length=1, max_length=1024 * 1024)
    stdin: str = Field(default="", max_length=MAX_FNCALL_INPUT)
    files: dict[str, str] = Field(default_factory=dict, description="relative path -> text, put in the scratch dir")
    binary_files: dict[str, str] = Field(default_factory=dict,
                                         description="relative path -> base64 content, put in the scratch dir")
    fetch_files: list[Annotated[str, Field(min_length=1, max_length=255)]] = Field(
        default_factory=list, max_length=1000,
        description="relative paths read back after the (last) run: base64 in the result's files, "
                    "16 MiB in all; missing ones are left out")
    tests: list[TestCase] = Field(default_factory=list, max_length=256,
                                  description="run against each (compiled once); stdin is then ignored")
    time_limit_s: Annotated[float, Field(gt=0, le=60)] = 5.0
    memory_limit_mb: Annotated[int, Field(ge=16, le=2048, description="per call; a pool slot holds 2 GiB")] = 256
    pids_limit: Annotated[int, Field(ge=1, le=1024)] = 32
    output_limit_kb: Annotated[int, Field(ge=1, le=64 * 1024)] = 1024
    compile_time_limit_s: Annotated[float, Field(gt=0, le=120)] = 30.0
    time_limit_kind: Literal["cpu", "wall"] = Field(
        default="cpu", description="cpu: the verdict compares CPU time and the wall clock allows 2 x the limit "
        "+ 1 s (a judge's rule); wall: the limits are on wall-clock time (SandboxFusion's rule)")
    comparator: Literal["exact", "whitespace", "float"] = "whitespace"
    float_tolerance: Annotated[float, Field(ge=0, le=1)] = 1e-6
    image: str = Field(default=FNCALL_IMAGE, description="FnCall image: a base layer with the toolchains")
    tenant: str = Field(default="", max_length=256, description="set by the apiserver to the calling project "
                        "(whatever the caller sends): a pool container runs one project's calls at a time")
    layers: list[str] = Field(default_factory=list, max_length=8,
                              description="toolkit/workspace layers on the image (e.g. pre-installed libraries)")
    preimport: list[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_.]{0,99}$")]] = Field(
        default_factory=list, max_length=32, description="Python modules the warm workers import before forking")

    @field_validator("files", "binary_files")
    @classmethod
    def _files(cls, v: dict[str, str]) -> dict[str, str]:
        total = 0
        for path, text in v.items():
            _scratch_path(path)
            total += len(text)
        if total > MAX_FNCALL_INPUT or len(v) > 1000:
            raise ValueError("at most 1000 files and 16 MiB in all")
        return v

    @field_validator("binary_files")
    @classmethod
    def _base64(cls, v: dict[str, str]) -> dict[str, str]:
        for path, b64 in v.items():
            try:
                base64.b64decode(b64, validate=True)
            except ValueError:
                raise ValueError(f"{path!r}: content is not valid base64") from None
        return v

    @field_validator("fetch_files")
    @classmethod
    def _fetch(cls, v: list[str]) -> list[str]:
        for path in v:
            _scratch_path(path)
        return v


def _scratch_path(path: str) -> None:
    norm = os.path.normpath(path)
    if not path or path.startswith("/") or norm.startswith("..") or "\0" in path or len(path) > 255:
        raise ValueError(f"file path {path!r} must be relative and stay inside the scratch dir")


class FnCallRun(BaseModel):
    status: FnCallStatus
    cached: bool = Field(default=False, description="compile step: artifact reused from an identical compile")
    exit_code: int | None = None
    signal: int | None = None
    stdout: str = ""
    stderr: str = ""
    time_ms: float = Field(description="CPU time, user + system")
    wall_ms: float
    memory_kb: int = Field(description="peak resident set size")


class TestResult(FnCallRun):
    __test__ = False

    verdict: Verdict


class FnCallResult(BaseModel):
    """``status`` and the run fields describe the run of ``stdin`` (no tests), or the
    first failing test (else the last one); ``compile`` is set for compiled languages."""

    status: FnCallStatus
    exit_code: int | None = None
    signal: int | None = None
    stdout: str = ""
    stderr: str = ""
    time_ms: float = 0.0
    wall_ms: float = 0.0
    memory_kb: int = 0
    compile: FnCallRun | None = None
    tests: list[TestResult] = Field(default_factory=list)
    container: str = Field(default="", description="the pooled sandbox that ran it")
    files: dict[str, str] = Field(default_factory=dict, description="fetch_files found: path -> base64")
    files_left_out: list[str] = Field(default_factory=list,
                                      description="fetch_files found but past the 16 MiB bound")


class SandboxEvent(BaseModel):
    t: float
    kind: str
    message: str


class LayerFetchStats(BaseModel):
    """What one node read of one data blob: from the shared store, or from its caches."""

    data: str
    layers: list[str] = []
    remote_bytes: int = 0
    remote_chunks: int = 0
    hits: int = Field(default=0, description="reads served by the node's memory or disk chunk cache")
    misses: int = Field(default=0, description="chunks fetched from the shared store for a read")
    prefetched: int = Field(default=0, description="chunks fetched ahead of any read, from an access list")
    errors: int = 0
    chunk_latency_s: float = Field(default=0.0, description="mean shared-store chunk fetch latency")


class StorageStats(BaseModel):
    edge: str
    backend: str
    mode: str
    cache_bytes: int = 0
    cache_max_bytes: int = 0
    cache_entries: int = 0
    cache_evictions: int = 0
    cache_corrupt: int = Field(default=0, description="cached chunks that failed their checksum and were refetched")
    cache_written_bytes: int = 0
    copied_bytes: int = Field(default=0, description="bytes copied whole from the store (metadata, eager data blobs)")
    blobs: list[LayerFetchStats] = []


class ErrorBody(BaseModel):
    error: str
    message: str
    field: str | None = None
