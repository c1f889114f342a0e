"""``dsec layer build``: a layer made by running steps in a sandbox, then pack_diff.

A spec (TOML) names the layer to publish, the stack to build on, files to copy in and
shell steps to run (in one session, so cwd and exports carry from step to step)::

    ref = "tk/harness:v3"
    image = "base/debian:12"
    layers = []
    steps = ["mkdir -p /opt/harness", "python3 -m compileall -q /opt/harness"]
    scrub_paths = ["/opt/harness/answers"]
    [files]
    "harness/run.py" = "/opt/harness/run.py"     # local path (relative to the spec) = sandbox path

The builder sandbox is a separate identity from the rollouts that later use the layer;
it is stopped whatever happens.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, Field

from dsec.node.layers.store import Layer
from dsec.shared.errors import InvalidRequest, SandboxError
from dsec.shared.wire.models import ContainerArgs


class BuildSpec(BaseModel):
    ref: str
    image: str = "base/debian:12"
    layers: list[str] = Field(default_factory=list)
    steps: list[str] = Field(default_factory=list)
    files: dict[str, str] = Field(default_factory=dict)
    scrub_paths: list[str] = Field(default_factory=list)
    memory_limit_mb: int = 1024
    cpu_cores_limit: float = 1.0
    step_timeout_s: float = 1800.0
    base_dir: str = "."

    @classmethod
    def load(cls, path: str) -> BuildSpec:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise InvalidRequest(f"cannot read build spec {path}: {e}", field="spec") from None
        data.setdefault("base_dir", os.path.dirname(os.path.abspath(path)))
        return cls.model_validate(data)


def build_layer(client: Any, spec: BuildSpec, log: Callable[[str], None] = print) -> Layer:
    """Run ``spec`` through ``client`` (a :class:`dsec.Client`) and publish the result."""
    sb = client.run_container(ContainerArgs(image=spec.image, layers=spec.layers,
                                            memory_limit_mb=spec.memory_limit_mb,
                                            cpu_cores_limit=spec.cpu_cores_limit, labels={"dsec-role": "builder"}))
    try:
        for local, dest in spec.files.items():
            path = os.path.join(spec.base_dir, local)
            with open(path, "rb") as f:
                sb.write_file(dest, f.read(), mode=os.stat(path).st_mode & 0o7777)
            log(f"copied {local} -> {dest}")
        for i, step in enumerate(spec.steps, 1):
            log(f"step {i}/{len(spec.steps)}: {step}")
            r = sb.run_shell(step, session="build", timeout=spec.step_timeout_s)
            for stream in (r.stdout, r.stderr):
                if stream.strip():
                    log(stream.rstrip())
            if r.exit_code != 0:
                raise SandboxError(f"build step {i} failed with exit code {r.exit_code}: {step}")
        layer: Layer = sb.pack_diff(spec.ref, scrub_paths=spec.scrub_paths)
        return layer
    finally:
        sb.stop()
