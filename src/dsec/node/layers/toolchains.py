"""FnCall toolchains and library sets as toolkit layers on the FnCall base image.

Each entry of :data:`TOOLCHAINS` is one versioned toolkit layer (``tk/fncall-<name>:<version>``)
holding a language's toolchain (Debian packages), a library set (PyPI wheels) or modules
(npm), built on top of ``FNCALL_IMAGE`` and nothing else, so any of them stacks on the base
alone or beside the others. A pool of FnCall containers carries only the layers of its
key: a Python-only pool has none of these, a Ruby call's pool has the Ruby layer.

Debian packages are installed by apt-get in a chroot of the base image under an overlay
mount (the chroot's writes land in the overlay's upper dir, which is exactly the layer:
new files, changed ones, whiteouts), with maintainer scripts run as on a real system
(alternatives, Mono's assembly registration). The host's own apt configuration
(``/etc/apt``: sources, proxies, keys) is bind-mounted in, and the host's pip and npm
(with their configuration) install PyPI and npm packages, so no registry host is named
here. The package lists and downloads go to a temporary dir shared by one build run.

Which layers setup builds is ``default``: the MultiPL-E set and the runners; the big ones
(Racket 451 MB, Kotlin 367 MB) are built on demand by ``dsec fncall toolchains build NAME``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

from dsec.node.host import linux
from dsec.node.layers.store import Layer, LayerStore
from dsec.shared.wire.models import FNCALL_IMAGE

# where the npm toolchain's modules live inside the layer (FnCall's worker links them into
# a call's scratch dir for the languages that need a node_modules beside the code)
NODE_DIR = "/usr/local/lib/dsec-node"
PY_SITE = "/usr/local/lib/python3.11/dist-packages"  # on the default sys.path of Debian 12's python3


@dataclass(frozen=True)
class Toolchain:
    version: str  # a new package list takes a new version: published layers never change
    apt: tuple[str, ...] = ()
    pip: tuple[str, ...] = ()
    npm: tuple[str, ...] = ()
    languages: tuple[str, ...] = ()  # FnCall languages that need this layer (none: a library set)
    default: bool = True  # built by `dsec setup`; else on demand
    files: tuple[tuple[str, str], ...] = ()  # (path in the layer, text) written after the packages
    post: str = ""  # a shell script run in the chroot after the packages (warming a build cache, say)

    def ref(self, name: str) -> str:
        return f"tk/fncall-{name}:{self.version}"


GO_CACHE = "/usr/local/lib/dsec-go-cache"
_GO_WARM = """package main

import (
	"fmt"
	"math"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestWarm(t *testing.T) {
	assert.Equal(t, "1", strconv.Itoa(1))
	require.True(t, math.Abs(-1) == 1 && sort.IntsAreSorted([]int{1}) && strings.HasPrefix(fmt.Sprint(1), "1"))
}
"""
CS_ENTRY = "/usr/local/lib/dsec-cs/DsecEntry.cs"
# The entry point of every C# call (mcs -main:DsecEntry): it runs the program's own static
# Main, and a failed Debug.Assert ends the program with exit code 1 as on .NET (Mono's
# default listener would print the failure and go on)
_CS_ENTRY_SRC = """using System;
using System.Diagnostics;
using System.Linq;
using System.Reflection;
using System.Runtime.ExceptionServices;

class DsecAssertListener : TraceListener {
    public override void Write(string message) { Console.Error.Write(message); }
    public override void WriteLine(string message) { Console.Error.WriteLine(message); }
    public override void Fail(string message, string detail) {
        Console.Out.Flush();
        Console.Error.WriteLine("Assertion failed: " + message + (String.IsNullOrEmpty(detail) ? "" : " " + detail));
        Console.Error.WriteLine(new StackTrace(2, true));
        Environment.Exit(1);
    }
}

static class DsecEntry {
    static int Main(string[] args) {
        Debug.Listeners.Clear();
        Debug.Listeners.Add(new DsecAssertListener());
        MethodInfo main = typeof(DsecEntry).Assembly.GetTypes()
            .Where(t => t != typeof(DsecEntry))
            .SelectMany(t => t.GetMethods(BindingFlags.Static | BindingFlags.Public | BindingFlags.NonPublic))
            .FirstOrDefault(m => m.Name == "Main");
        if (main == null) { Console.Error.WriteLine("error: the program has no static Main method"); return 1; }
        try {
            object r = main.Invoke(null, main.GetParameters().Length == 0 ? null : new object[] { args });
            return r is int ? (int)r : 0;
        } catch (TargetInvocationException e) {
            ExceptionDispatchInfo.Capture(e.InnerException).Throw();
            return 1;
        }
    }
}
"""
_JEST_PACKAGE = """{
  "name": "dsec-fncall-jest",
  "version": "1.0.0",
  "private": true,
  "jest": {"maxWorkers": 1, "cache": false}
}
"""
_BABEL = """module.exports = {
  presets: [['@babel/preset-env', {targets: {node: 'current'}}], '@babel/preset-typescript'],
};
"""

TOOLCHAINS: dict[str, Toolchain] = {
    "ruby": Toolchain("12-r1", apt=("ruby",), languages=("ruby",)),
    "php": Toolchain("12-r1", apt=("php-cli",), languages=("php",)),
    # Test::Deep and Data::Compare: what MultiPL-E's Perl tests use
    "perl": Toolchain("12-r1", apt=("perl", "libtest-deep-perl", "libdata-compare-perl"), languages=("perl",)),
    "lua": Toolchain("12-r1", apt=("lua5.4", "lua-unit"), languages=("lua",)),
    "r": Toolchain("12-r1", apt=("r-base-core",), languages=("r",)),
    # LDC (Debian has no DMD): the D unittest mode compiles with -unittest, as SandboxFusion's dmd does
    "d": Toolchain("12-r1", apt=("ldc",), languages=("d",)),
    "csharp": Toolchain("12-r2", apt=("mono-mcs", "mono-runtime"), languages=("csharp",),
                        files=((CS_ENTRY, _CS_ENTRY_SRC),)),
    "scala": Toolchain("12-r1", apt=("scala",), languages=("scala",)),
    "verilog": Toolchain("12-r1", apt=("iverilog",), languages=("verilog",)),
    "junit": Toolchain("12-r1", apt=("junit5",), languages=("junit",)),
    # with a Go build cache of testify and the standard packages tests use, which FnCall's
    # worker copies into each go_test call's scratch dir (Go needs its cache writable): a
    # go test then compiles only the call's own file (1.6 s instead of 14 s here)
    "go-testify": Toolchain("12-r2", apt=("golang-github-stretchr-testify-dev",), languages=("go_test",),
                            files=(("/tmp/warm/main_test.go", _GO_WARM),),
                            post=f"cd /tmp/warm && GOPATH=/usr/share/gocode GO111MODULE=off HOME=/tmp/warm "
                                 f"GOCACHE={GO_CACHE} go test main_test.go && chmod -R a+rX {GO_CACHE}"),
    # TypeScript (tsx, as SandboxFusion runs it) and Jest with Babel's TypeScript preset
    "node": Toolchain("12-r1", npm=("typescript@5.6", "tsx@4.19", "jest@29.7", "@jest/globals@29.7",
                                    "babel-jest@29.7", "@babel/core@7.26", "@babel/preset-env@7.26",
                                    "@babel/preset-typescript@7.26", "lodash@4.17"),
                      languages=("typescript", "jest"),
                      files=((f"{NODE_DIR}/package.json", _JEST_PACKAGE), (f"{NODE_DIR}/babel.config.js", _BABEL))),
    # scientific Python: a library set, selected per call with FnCallArgs.layers
    # (and /etc/hosts, which the FnCall base lacks: code that talks to a server of its own on
    # "localhost", as SandboxFusion's tests do, needs the name)
    "scipy": Toolchain("12-r2", pip=("numpy<2.3", "pandas<2.3", "scipy<1.16", "sympy<1.14", "networkx<3.5",
                                     "requests<3", "python-dateutil", "regex"),
                       files=(("/etc/hosts", "127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n"),)),
    "racket": Toolchain("12-r1", apt=("racket",), languages=("racket",), default=False),
    "kotlin": Toolchain("12-r1", apt=("kotlin",), languages=("kotlin",), default=False),
}
# language -> the toolchain layer it needs (languages of the base image need none)
LANGUAGE_TOOLCHAIN = {lang: name for name, tc in TOOLCHAINS.items() for lang in tc.languages}


def toolchain_layer(language: str) -> str | None:
    """The layer reference ``language`` needs on top of the FnCall base, if any."""
    name = LANGUAGE_TOOLCHAIN.get(language)
    return TOOLCHAINS[name].ref(name) if name else None


def _run(argv: list[str], **kw: object) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, **kw)  # type: ignore[call-overload]
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:6])} failed ({proc.returncode}): {(proc.stderr or proc.stdout)[-1500:]}")


class _AptCache:
    """Package lists and downloaded .debs shared by the builds of one run (one apt-get
    update for all of them), outside every layer."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="dsec-tc-apt-")
        self.lists = os.path.join(self.dir, "lists")
        self.archives = os.path.join(self.dir, "archives")
        os.makedirs(os.path.join(self.lists, "partial"))
        os.makedirs(os.path.join(self.archives, "partial"))
        self.updated = False

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def _chroot_of_base(store: LayerStore, tmp: str, apt: _AptCache, upper: str | None = None
                    ) -> Iterator[tuple[str, str]]:
    """The FnCall base under an overlay (merged root, upper dir: ``upper`` if given), with
    /proc, /dev, /sys, the host's /etc/apt and resolv.conf and the shared apt cache mounted in."""
    base = store.get(FNCALL_IMAGE)
    upper = upper or os.path.join(tmp, "upper")
    lower, work, merged = (os.path.join(tmp, n) for n in ("lower", "work", "merged"))
    shutil.rmtree(work, ignore_errors=True)
    for d in (lower, upper, work, merged):
        os.makedirs(d, exist_ok=True)
    os.chmod(upper, 0o755)  # the layer's root is a sandbox's /
    mounts: list[str] = []
    created: list[str] = []  # mount points made in the upper dir, removed before packing
    try:
        source, opts = store.mount_args(base.digest)
        linux.mount(source, lower, "erofs", linux.MS_RDONLY, opts)
        mounts.append(lower)
        linux.mount("overlay", merged, "overlay", 0,
                    f"lowerdir={lower},upperdir={upper},workdir={work},redirect_dir=off,index=off,metacopy=off")
        mounts.append(merged)

        def bind(src: str, rel: str, is_file: bool = False, ro: bool = False) -> None:
            dst = os.path.join(merged, rel)
            if not os.path.lexists(dst):
                created.append(rel)
                if is_file:
                    os.makedirs(os.path.dirname(dst), exist_ok=True)
                    open(dst, "w").close()  # noqa: SIM115
                else:
                    os.makedirs(dst)
            _run(["mount", "--bind", *(["-o", "ro"] if ro else []), src, dst])
            mounts.append(dst)

        _run(["mount", "-t", "proc", "proc", os.path.join(merged, "proc")])
        mounts.append(os.path.join(merged, "proc"))
        bind("/dev", "dev")
        bind("/sys", "sys", ro=True)
        bind("/etc/apt", "etc/apt", ro=True)
        if os.path.exists("/etc/resolv.conf"):
            bind(os.path.realpath("/etc/resolv.conf"), "etc/resolv.conf", is_file=True, ro=True)
        bind(apt.lists, "var/lib/apt/lists")
        bind(apt.archives, "var/cache/apt/archives")
        yield merged, upper
    finally:
        for m in reversed(mounts):
            with contextlib.suppress(OSError, RuntimeError):
                linux.umount(m, detach=True)
    for rel in created:
        p = os.path.join(upper, rel)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
        elif os.path.lexists(p):
            os.unlink(p)


# what apt, dpkg and the maintainer scripts leave that is no part of a toolchain
_RESIDUE = ("var/cache/apt", "var/cache/debconf/config.dat-old", "var/cache/debconf/templates.dat-old",
            "var/lib/apt/lists", "var/log", "tmp", "root/.cache", "var/cache/ldconfig/aux-cache",
            "var/lib/dpkg/status-old", "var/lib/dpkg/available-old", "etc/ld.so.cache~")


def _apt_install(merged: str, packages: tuple[str, ...], apt: _AptCache) -> None:
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "DEBIAN_FRONTEND": "noninteractive", "LANG": "C.UTF-8",
           "HOME": "/root"}
    if not apt.updated:
        _run(["chroot", merged, "apt-get", "update", "-qq"], env=env)
        apt.updated = True
    _run(["chroot", merged, "apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages], env=env)


def build_toolchain(store: LayerStore, name: str, apt: _AptCache | None = None) -> Layer:
    """Publish toolchain ``name``'s layer unless it is published already."""
    tc = TOOLCHAINS[name]
    ref = tc.ref(name)
    if store.has(ref):
        return store.get(ref)
    own_cache = apt is None
    cache = apt or _AptCache()
    try:
        with tempfile.TemporaryDirectory(prefix=f"dsec-tc-{name}-") as tmp:
            if tc.apt:
                with _chroot_of_base(store, tmp, cache) as (merged, upper):
                    _apt_install(merged, tc.apt, cache)
                root = upper
            else:
                root = os.path.join(tmp, "upper")
                os.makedirs(root, mode=0o755)
            if tc.pip:
                site = os.path.join(root, PY_SITE.lstrip("/"))
                # the node's pip (Python 3.11, as the image's python3) with its own configuration
                _run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile",
                      "--only-binary", ":all:", "--target", site, *tc.pip])
            if tc.npm:
                prefix = os.path.join(root, NODE_DIR.lstrip("/"))
                os.makedirs(prefix, exist_ok=True)
                _run(["npm", "install", "--prefix", prefix, "--no-audit", "--no-fund", "--silent",
                      "--no-package-lock", *tc.npm])
            for path, text in tc.files:
                dest = os.path.join(root, path.lstrip("/"))
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                with open(dest, "w") as f:
                    f.write(text)
            if tc.post:
                with _chroot_of_base(store, tmp, cache, upper=root) as (merged, _):
                    _run(["chroot", merged, "/bin/sh", "-ec", tc.post],
                         env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "HOME": "/root"})
            for rel in _RESIDUE:
                p = os.path.join(root, rel)
                if os.path.isdir(p) and not os.path.islink(p):
                    shutil.rmtree(p, ignore_errors=True)
                elif os.path.lexists(p):
                    os.unlink(p)
            for top in (PY_SITE, NODE_DIR) if tc.pip or tc.npm else ():
                for d, _, _ in os.walk(os.path.join(root, top.lstrip("/"))):
                    os.chmod(d, os.stat(d).st_mode | 0o555)  # what pip and npm made: readable by every call's uid
            return store.ensure_dir(root, ref)
    finally:
        if own_cache:
            cache.close()


def build_toolchains(store: LayerStore, names: list[str] | None = None) -> list[Layer]:
    """Build ``names`` (default: the default set), sharing one apt cache."""
    cache = _AptCache()
    try:
        return [build_toolchain(store, n, cache)
                for n in (names if names is not None else [n for n, t in TOOLCHAINS.items() if t.default])]
    finally:
        cache.close()
