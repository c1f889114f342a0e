"""Builds the agent's static binaries from their C source: dsec-init (PID 1 of every
sandbox) and dsec-vmux (the guest end of a VM sandbox's agent channel)."""

from __future__ import annotations

import os
import shutil
import subprocess

HERE = os.path.dirname(__file__)
SOURCE = os.path.join(HERE, "dsec-init.c")


def ensure_binary(name: str, dest: str) -> str:
    """Compile ``name``.c to ``dest`` unless an up-to-date build is already there."""
    source = os.path.join(HERE, f"{name}.c")
    if os.path.exists(dest) and os.path.getmtime(dest) >= os.path.getmtime(source):
        return dest
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError(f"a C compiler is needed to build {name} (apt-get install gcc libc6-dev)")
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tmp = f"{dest}.tmp.{os.getpid()}"
    subprocess.run([cc, "-O2", "-static", "-Wall", "-o", tmp, source], check=True, capture_output=True)
    os.chmod(tmp, 0o500)
    os.replace(tmp, dest)
    return dest


def ensure_init_binary(dest: str) -> str:
    return ensure_binary("dsec-init", dest)
