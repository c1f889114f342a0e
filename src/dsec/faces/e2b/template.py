"""E2B templates as dsec layer stacks. E2B's default template ``base`` is Debian with an
unprivileged ``user`` (uid 1000, home /home/user) that commands and file writes act as
by default; here it is ``base/debian:12`` with one small toolkit layer on top that adds
that account (passwd, group, shadow, gshadow and the home directory, from the base's own
files and /etc/skel). ``code-interpreter-v1`` (the e2b-code-interpreter SDK's default)
adds a layer with ipykernel, jupyter_client and dsec's own code interpreter server
(dsec.faces.e2b.interpreter_server), which the sandbox starts as ``user`` when it is created.
A snapshot id, or any layer taken from a sandbox, means the stack it was taken on plus
it; a template built through E2B's template API (dsec.faces.templates) is found by name, id,
``name:tag`` or ``name:buildID``; any other template name is a dsec layer ref, used alone.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

from dsec.faces.templates.models import BuiltTemplate
from dsec.node.host import linux
from dsec.node.layers.store import Layer, LayerStore
from dsec.shared.errors import DsecError, NotFound
from dsec.shared.wire.models import normalize_layer_ref

BASE_IMAGE = "base/debian:12"
USER_LAYER = "tk/e2b-user:2"  # 2: adds `python` (E2B's base has both names)
INTERPRETER_PACKAGES = ["ipykernel>=6.29,<8", "jupyter_client>=8.6,<9"]
INTERPRETER_SOURCE = os.path.join(os.path.dirname(__file__), "interpreter_server.py")


def _interpreter_version() -> str:
    """Layers are immutable: the layer's version names what goes into it, so a changed
    server or package list is a new layer, built by the next setup."""
    h = hashlib.sha256(" ".join(INTERPRETER_PACKAGES).encode())
    with open(INTERPRETER_SOURCE, "rb") as f:
        h.update(f.read())
    return h.hexdigest()[:12]


INTERPRETER_LAYER = f"tk/e2b-code-interpreter:{_interpreter_version()}"
INTERPRETER_PATH, INTERPRETER_PORT = "/opt/dsec/code_interpreter.py", 49999


@dataclass(frozen=True)
class Template:
    image: str
    layers: list[str] = field(default_factory=list)
    start: list[str] | None = None  # run as the template's user when a sandbox is created
    ready_port: int | None = None  # ... and the sandbox is handed out once this port answers /health
    # a built template: its ENV, WORKDIR and USER, its start and ready commands (shell), resources
    envs: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    start_cmd: str | None = None
    ready_cmd: str | None = None
    cpu_count: int | None = None
    memory_mb: int | None = None
    template_id: str | None = None

    @classmethod
    def built(cls, template_id: str, result: BuiltTemplate, cpu_count: int, memory_mb: int) -> Template:
        c = result.config
        return cls(result.image, list(result.layers), envs=dict(c.envs), workdir=c.workdir, user=c.user,
                   start_cmd=c.start_cmd, ready_cmd=c.ready_cmd, cpu_count=cpu_count, memory_mb=memory_mb,
                   template_id=template_id)


TEMPLATES = {
    "base": Template(BASE_IMAGE, [USER_LAYER]),
    "code-interpreter-v1": Template(BASE_IMAGE, [USER_LAYER, INTERPRETER_LAYER],
                                    ["python3", INTERPRETER_PATH, "--port", str(INTERPRETER_PORT)], INTERPRETER_PORT),
}
UID = GID = 1000
ACCOUNT_LINES = {
    "passwd": f"user:x:{UID}:{GID}:user:/home/user:/bin/bash\n",
    "group": f"user:x:{GID}:\n",
    "shadow": "user:*:19000:0:99999:7:::\n",
    "gshadow": "user:!::\n",
}


SNAPSHOT_ID_RE = re.compile(r"^e2b-snapshot-[0-9a-f]{12}$")


def snapshot_ref(snapshot_id: str) -> str:
    """The layer an E2B snapshot id names (ids carry no '/', as they travel in URL paths)."""
    return f"ws/{snapshot_id}:1"


def resolve(template: str, store: LayerStore) -> Template:
    """(image, layers) a template name means: a built-in template, a layer taken from a
    sandbox (an E2B snapshot or any pack_diff layer: the stack it was taken on, then it),
    or a layer ref used alone."""
    if template in TEMPLATES:
        return TEMPLATES[template]
    if not SNAPSHOT_ID_RE.match(template):
        try:
            normalize_layer_ref(template)
        except ValueError:  # E2B names ("httpbin") that are no layer ref: a missing template, not bad input
            raise NotFound(f"template {template!r} not found (built-in: {', '.join(TEMPLATES)}; or a built "
                           f"template's name, a snapshot id, a layer ref)", field="templateID") from None
    try:
        layer = store.get(snapshot_ref(template) if SNAPSHOT_ID_RE.match(template) else template)
    except (DsecError, ValueError):
        return Template(template)  # not a layer here: the create says so, naming the field
    return Template(*layer.stack()) if layer.parent_image else Template(template)


def ensure_interpreter_layer(store: LayerStore) -> Layer:
    """Build ``tk/e2b-code-interpreter:<version>`` once per store: the packages installed with
    this node's pip (the sandbox's Debian python3 is the same 3.11) under
    /usr/local/lib/python3.11/dist-packages, and the server."""
    if store.has(INTERPRETER_LAYER):
        return store.get(INTERPRETER_LAYER)
    with tempfile.TemporaryDirectory(prefix="dsec-e2b-ci-") as tmp:
        site = os.path.join(tmp, "usr", "local", "lib", "python3.11", "dist-packages")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile",
                        "--target", site, *INTERPRETER_PACKAGES], check=True)
        dest = os.path.join(tmp, INTERPRETER_PATH.lstrip("/"))
        os.makedirs(os.path.dirname(dest))
        shutil.copy(INTERPRETER_SOURCE, dest)
        for d, _, _ in os.walk(tmp):
            os.chmod(d, 0o755)  # the temporary root is 0700, and a layer's root dir is the sandbox's /
        return store.ensure_dir(tmp, INTERPRETER_LAYER)


def ensure_user_layer(store: LayerStore) -> Layer:
    """Build ``tk/e2b-user`` from the base layer, once per store: E2B's ``user`` and, where
    the base has only ``python3``, ``python`` (scripts written for E2B's base call both)."""
    if store.has(USER_LAYER):
        return store.get(USER_LAYER)
    base = store.get(BASE_IMAGE)
    with tempfile.TemporaryDirectory(prefix="dsec-e2b-") as tmp:
        mnt, root = os.path.join(tmp, "base"), os.path.join(tmp, "root")
        os.makedirs(mnt)
        os.makedirs(os.path.join(root, "etc"))
        source, opts = store.mount_args(base.digest)
        linux.mount(source, mnt, "erofs", linux.MS_RDONLY, opts)
        try:
            for name, line in ACCOUNT_LINES.items():
                src, dst = os.path.join(mnt, "etc", name), os.path.join(root, "etc", name)
                shutil.copy2(src, dst)
                st = os.stat(src)
                os.chown(dst, st.st_uid, st.st_gid)
                with open(dst, "a") as f:
                    f.write(line)
            home = os.path.join(root, "home", "user")
            shutil.copytree(os.path.join(mnt, "etc", "skel"), home, symlinks=True)
            os.chmod(home, 0o750)
            for d, _, files in os.walk(home):
                for p in [d, *(os.path.join(d, f) for f in files)]:
                    os.chown(p, UID, GID, follow_symlinks=False)
            bin_dir = os.path.join(mnt, "usr", "bin")
            if os.path.lexists(os.path.join(bin_dir, "python3")) and not os.path.lexists(
                    os.path.join(bin_dir, "python")):
                os.makedirs(os.path.join(root, "usr", "bin"))
                os.symlink("python3", os.path.join(root, "usr", "bin", "python"))
        finally:
            linux.umount(mnt)
        return store.ensure_dir(root, USER_LAYER)
