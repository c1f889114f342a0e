"""Builds the built-in base layers offline from Debian packages, once per machine.

``base/debian:12`` comes from mmdebstrap using this machine's own apt sources (so no
mirror host is written anywhere in dsec); ``base/busybox`` is the host's static busybox
and nothing else: no Python, no libc.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable

from dsec.node.layers.store import Layer, LayerStore
from dsec.shared.wire.models import FNCALL_IMAGE

DEBIAN_PACKAGES = [
    "bash", "coreutils", "python3", "python3-pip", "python3-venv", "python3-pytest", "git", "curl",
    "procps", "ca-certificates", "less", "iproute2",
]


def host_apt_sources() -> str:
    """The host's apt sources file (deb822 or one-line), which mmdebstrap accepts as mirror."""
    for cand in ["/etc/apt/sources.list.d/debian.sources", *sorted(glob.glob("/etc/apt/sources.list.d/*.sources")),
                 "/etc/apt/sources.list"]:
        if os.path.isfile(cand) and os.path.getsize(cand) > 0:
            return cand
    raise RuntimeError("no apt sources configured on this machine")


def _write_etc(root: str) -> None:
    etc = os.path.join(root, "etc")
    os.makedirs(etc, exist_ok=True)
    files = {
        "passwd": "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
        "group": "root:x:0:\nnogroup:x:65534:\n",
        "hosts": "127.0.0.1 localhost\n::1 localhost\n",
    }
    for name, text in files.items():
        with open(os.path.join(etc, name), "w") as f:
            f.write(text)


def _ensure(store: LayerStore, ref: str, make: Callable[[str], None]) -> Layer:
    """The layer ``ref``: the one published already, else the tree ``make(root)`` builds,
    published; safe on many nodes at once (LayerStore.ensure_dir)."""
    if store.has(ref):
        return store.get(ref)
    with tempfile.TemporaryDirectory(prefix="dsec-base-") as tmp:
        root = os.path.join(tmp, "rootfs")
        make(root)
        return store.ensure_dir(root, ref)


def build_busybox(store: LayerStore, ref: str = "base/busybox:latest") -> Layer:
    def make(root: str) -> None:
        busybox = shutil.which("busybox")
        if busybox is None:
            raise RuntimeError("busybox is not installed (apt-get install busybox-static)")
        for d in ("bin", "sbin", "usr/bin", "usr/sbin", "root", "tmp", "proc", "sys", "dev", "etc"):
            os.makedirs(os.path.join(root, d), exist_ok=True)
        os.chmod(os.path.join(root, "tmp"), 0o1777)
        shutil.copy2(busybox, os.path.join(root, "bin", "busybox"))
        applets = subprocess.run([busybox, "--list-full"], check=True, capture_output=True,
                                 text=True).stdout.split()
        for applet in applets:
            dest = os.path.join(root, applet)
            if not os.path.lexists(dest):
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                os.symlink("/bin/busybox", dest)
        _write_etc(root)
    return _ensure(store, ref, make)


def build_debian(store: LayerStore, ref: str = "base/debian:12", suite: str = "bookworm",
                 packages: list[str] | None = None) -> Layer:
    """A Debian ``suite`` root with ``packages`` (default: the built-in set) and their dependencies."""
    def make(root: str) -> None:
        subprocess.run(
            ["mmdebstrap", "--quiet", "--variant=minbase", f"--include={','.join(packages or DEBIAN_PACKAGES)}",
             "--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-exclude=/usr/share/man/*",
             "--dpkgopt=path-exclude=/usr/share/locale/*",
             # the man dirs the excludes leave out: the JDK's postinst links its man pages there
             # through update-alternatives, which fails if the directory is missing
             '--setup-hook=mkdir -p "$1/usr/share/man/man1"',
             suite, root, host_apt_sources()],
            check=True)
        for residue in ("var/cache/apt/archives", "var/lib/apt/lists"):
            p = os.path.join(root, residue)
            if os.path.isdir(p):
                for entry in os.listdir(p):
                    ep = os.path.join(p, entry)
                    if os.path.isfile(ep):
                        os.unlink(ep)
    return _ensure(store, ref, make)


# the FnCall image: the Debian base plus the toolchains of the worker's languages
# (changing this list takes a new FNCALL_IMAGE revision: layers are immutable)
FNCALL_PACKAGES = [*DEBIAN_PACKAGES, "gcc", "g++", "libc6-dev", "make",
                   "default-jdk-headless", "golang-go", "nodejs", "rustc"]


def ensure_base_layers(store: LayerStore) -> list[Layer]:
    return [build_busybox(store), build_debian(store),
            build_debian(store, FNCALL_IMAGE, packages=FNCALL_PACKAGES)]
