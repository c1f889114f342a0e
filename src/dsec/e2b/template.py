"""E2B templates as dsec layer stacks. E2B's default template ``base`` is Debian with an
unprivileged ``user`` (uid 1000, home /home/user) that commands and file writes act as
by default; here it is ``base/debian:12`` with one small toolkit layer on top that adds
that account (passwd, group, shadow, gshadow and the home directory, from the base's own
files and /etc/skel). Any other template name is taken as a dsec layer ref, used alone.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

from dsec.edge import linux
from dsec.errors import DsecError
from dsec.layers.store import Layer, LayerStore

BASE_IMAGE = "base/debian:12"
USER_LAYER = "tk/e2b-user:1"
TEMPLATES: dict[str, tuple[str, list[str]]] = {"base": (BASE_IMAGE, [USER_LAYER])}
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


def stack(template: str, store: LayerStore) -> tuple[str, list[str]]:
    """(image, layers) a template name means: a built-in template, a layer taken from a
    sandbox (an E2B snapshot or any pack_diff layer: the stack it was taken on, then it),
    or a layer ref used alone."""
    if template in TEMPLATES:
        return TEMPLATES[template]
    try:
        layer = store.get(snapshot_ref(template) if SNAPSHOT_ID_RE.match(template) else template)
    except (DsecError, ValueError):
        return template, []  # not a layer here: the create says so, naming the field
    return layer.stack() if layer.parent_image else (template, [])


def ensure_user_layer(store: LayerStore) -> Layer:
    """Build ``tk/e2b-user:1`` from the base layer, once per store."""
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
        finally:
            linux.umount(mnt)
        return store.import_dir(root, USER_LAYER)
