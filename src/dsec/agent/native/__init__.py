"""Builds dsec-init, the static PID 1 of container sandboxes, from its C source."""

from __future__ import annotations

import os
import shutil
import subprocess

SOURCE = os.path.join(os.path.dirname(__file__), "dsec-init.c")


def ensure_init_binary(dest: str) -> str:
    """Compile dsec-init to ``dest`` unless an up-to-date build is already there."""
    if os.path.exists(dest) and os.path.getmtime(dest) >= os.path.getmtime(SOURCE):
        return dest
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("a C compiler is needed to build dsec-init (apt-get install gcc libc6-dev)")
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tmp = f"{dest}.tmp.{os.getpid()}"
    subprocess.run([cc, "-O2", "-static", "-Wall", "-o", tmp, SOURCE], check=True, capture_output=True)
    os.chmod(tmp, 0o500)
    os.replace(tmp, dest)
    return dest
