"""A mini-swe-agent environment on a dsec sandbox.

``DsecEnvironment`` is what mini-swe-agent's Docker environment is, with a dsec
sandbox in place of the container: it creates the sandbox when constructed (or attaches
to one by id), runs each action as a fresh ``bash -lc`` process in it (mini-swe-agent's
actions share no shell state, only the filesystem), answers in the shape its agents
read (``output``, ``returncode``, ``exception_info``), raises its ``Submitted`` when an
action prints the submission marker, and stops the sandbox on ``cleanup``.

mini-swe-agent is imported only when the class is instantiated, so dsec never needs it.
Config keys (as with the other environments: keyword arguments, or the ``environment``
section of a mini-swe-agent YAML with ``environment_class:
dsec.client.integrations.mini_swe_agent.DsecEnvironment``) are :class:`DsecEnvironmentConfig`'s.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import weakref
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from dsec.client.sdk import Client, Sandbox
from dsec.shared.errors import DsecError
from dsec.shared.wire.models import ContainerArgs

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"  # what mini-swe-agent's prompts tell the model to print
# stderr is folded into stdout by a wrapper, as the other environments' subprocess does,
# whatever the interpreter: exec keeps the command's pid and exit status
_MERGE = ["/bin/sh", "-c", 'exec "$@" 2>&1', "sh"]
# mini-swe-agent never calls cleanup (its Docker environment stops its container from
# __del__); environments still alive at interpreter exit are cleaned up while the SDK's
# loop still runs, since a finalizer run later could wait on a loop that is gone
_LIVE: weakref.WeakSet[DsecEnvironment] = weakref.WeakSet()


class DsecEnvironmentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # the sandbox: created here unless ``sandbox_id`` names one to use
    image: str = "base/debian:12"
    """Base layer (kind/name:version)."""
    layers: list[str] = []
    """Workspace and toolkit layers, bottom to top."""
    memory_limit_mb: int | None = None
    cpu_cores_limit: float | None = None
    ttl_running_stop: int | None = 3600
    """Idle seconds before dsec stops the sandbox: a crashed run does not leak it."""
    max_lifetime_s: int | None = None
    labels: dict[str, str] = {}
    job: str | None = None
    sandbox_env: dict[str, str] = {}
    """Environment of every process in the sandbox (``env`` below is per action)."""
    container_args: dict[str, Any] = {}
    """Any other ``dsec.ContainerArgs`` field (pids_limit, qos, workdir, ...)."""
    sandbox_id: str | None = None
    """Use this running sandbox instead of creating one; it is then not stopped by
    ``cleanup`` unless ``stop_on_cleanup`` says so."""
    stop_on_cleanup: bool | None = None
    url: str | None = None
    """The apiserver; default ``$DSEC_URL``, then the local platform."""
    token: str | None = Field(default=None, exclude=True, repr=False)
    """dsec token; default ``$DSEC_TOKEN``, then the local token file. Never serialized."""
    startup_timeout: float = 120.0
    """Seconds to wait for the sandbox to be created and running."""

    # the actions
    cwd: str = ""
    """Working directory of the actions; empty: the sandbox's workdir."""
    env: dict[str, str] = {}
    """Environment variables set for every action."""
    forward_env: list[str] = []
    """Variables passed on from this process's environment when set here (``env`` wins)."""
    timeout: int = 30
    """Seconds an action may run; then its processes are killed."""
    interpreter: list[str] = ["bash", "-lc"]
    """What runs an action: the command is appended as its last argument."""
    max_output_bytes: int = 1 << 20
    """Output kept per action; the rest is dropped (and said so)."""


class DsecEnvironment:
    def __init__(self, *, config_class: type[DsecEnvironmentConfig] = DsecEnvironmentConfig,
                 logger: logging.Logger | None = None, **kwargs: Any) -> None:
        self.logger = logger or logging.getLogger("minisweagent.environment")
        self.config = config_class(**kwargs)
        self._submitted = _submitted_class()
        self.client: Client | None = None
        self.sandbox: Sandbox | None = None
        self.sandbox_id: str | None = None  # kept after cleanup, for the trajectory
        self._uname: dict[str, str] = {}
        cfg = self.config
        self.client = Client(url=cfg.url, token=cfg.token)
        try:
            if cfg.sandbox_id:
                self.sandbox = self.client.connect(cfg.sandbox_id)
                self._owned = bool(cfg.stop_on_cleanup)
            else:
                self.sandbox = self.client.run_container(self._container_args(), timeout=cfg.startup_timeout)
                self._owned = cfg.stop_on_cleanup is not False
            self.sandbox_id = self.sandbox.sandbox_id
            _LIVE.add(self)
            self.logger.info("dsec sandbox %s ready", self.sandbox_id)
            self._uname = self._read_uname()
        except BaseException:
            self.cleanup()
            raise

    def _container_args(self) -> ContainerArgs:
        cfg = self.config
        fields: dict[str, Any] = {"image": cfg.image, "layers": cfg.layers, "labels": cfg.labels,
                                  "env": cfg.sandbox_env}
        for name in ("memory_limit_mb", "cpu_cores_limit", "ttl_running_stop", "max_lifetime_s", "job"):
            if getattr(cfg, name) is not None:
                fields[name] = getattr(cfg, name)
        return ContainerArgs(**{**fields, **cfg.container_args})

    def _read_uname(self) -> dict[str, str]:
        """The sandbox's own uname, for the prompts' system information (the Docker
        environment gives the host's; here the host is not where commands run)."""
        assert self.sandbox is not None
        keys = ("system", "node", "release", "version", "machine")
        try:
            r = self.sandbox.exec(["uname", "-s", "-n", "-r", "-v", "-m"], timeout=30)
        except DsecError:
            return {}
        parts = r.stdout.split()
        if r.exit_code != 0 or len(parts) < 5:
            return {}
        # the version is the only field with spaces: everything between release and machine
        return dict(zip(keys, [parts[0], parts[1], parts[2], " ".join(parts[3:-1]), parts[-1]], strict=True))

    def execute(self, action: dict[str, Any], cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        """Run ``action["command"]``; the answer is what mini-swe-agent's agents read."""
        command = action.get("command", "")
        limit = timeout or self.config.timeout
        env = {k: v for k in self.config.forward_env if (v := os.environ.get(k)) is not None}
        env.update(self.config.env)
        if self.sandbox is None:
            return _failed(command, RuntimeError("the sandbox has been cleaned up"))
        try:
            r = self.sandbox.exec([*_MERGE, *self.config.interpreter, command], timeout=limit, env=env,
                                  cwd=cwd or self.config.cwd or None, max_output_bytes=self.config.max_output_bytes)
        except DsecError as e:
            output = _failed(command, e)
        else:
            text = r.stdout
            if r.stdout_truncated:
                text += f"\n[dsec: output past {self.config.max_output_bytes} bytes was dropped]\n"
            if r.timed_out:
                output = {"output": text, "returncode": -1,
                          "exception_info": f"An error occurred while executing the command: Command '{command}' "
                                            f"timed out after {limit} seconds",
                          "extra": {"exception_type": "TimeoutExpired",
                                    "exception": f"timed out after {limit} seconds"}}
            else:
                output = {"output": text, "returncode": r.exit_code, "exception_info": ""}
        self._check_finished(output)
        return output

    def _check_finished(self, output: dict[str, Any]) -> None:
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_MARKER and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise self._submitted({"role": "exit", "content": submission,
                                   "extra": {"exit_status": "Submitted", "submission": submission}})

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return _merge(self.config.model_dump(), self._uname, {"sandbox_id": self.sandbox_id}, kwargs)

    def serialize(self) -> dict[str, Any]:
        return {"info": {"config": {
            "environment": {**self.config.model_dump(mode="json"), "sandbox_id": self.sandbox_id},
            "environment_type": f"{self.__class__.__module__}.{self.__class__.__name__}"}}}

    def cleanup(self) -> None:
        """Stop the sandbox (if this environment created it) and close the client; safe
        to call more than once."""
        sandbox, client = getattr(self, "sandbox", None), getattr(self, "client", None)
        self.sandbox, self.client = None, None
        try:
            if sandbox is not None and getattr(self, "_owned", False):
                try:
                    sandbox.stop()
                except DsecError as e:  # already gone: what cleanup wanted
                    self.logger.warning("dsec sandbox %s: stop: %s", sandbox.sandbox_id, e)
        finally:
            if client is not None:
                client.close()

    def __enter__(self) -> DsecEnvironment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def __del__(self) -> None:
        if sys.is_finalizing():
            return  # too late to reach the SDK's loop; the sandbox's TTL reclaims it
        try:
            self.cleanup()
        except Exception as e:
            self.logger.warning("dsec sandbox %s: cleanup: %s", self.sandbox_id, e)


@atexit.register
def _cleanup_live() -> None:
    for env in list(_LIVE):
        try:
            env.cleanup()
        except Exception as e:
            env.logger.warning("dsec sandbox %s: cleanup at exit: %s", env.sandbox_id, e)


def _failed(command: str, e: BaseException) -> dict[str, Any]:
    return {"output": "", "returncode": -1, "exception_info": f"An error occurred while executing the command: {e}",
            "extra": {"exception_type": type(e).__name__, "exception": str(e)}}


def _merge(*dicts: dict[str, Any]) -> dict[str, Any]:
    """Later wins; nested dicts merge (as mini-swe-agent's recursive_merge)."""
    out: dict[str, Any] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _submitted_class() -> type[Exception]:
    try:
        from minisweagent.exceptions import Submitted
    except ImportError as e:
        raise ImportError("dsec.client.integrations.mini_swe_agent.DsecEnvironment needs mini-swe-agent: "
                          "pip install mini-swe-agent") from e
    return Submitted


__all__ = ["DsecEnvironment", "DsecEnvironmentConfig"]
