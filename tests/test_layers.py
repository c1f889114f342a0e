"""Environment layers on the real platform: composition semantics against overlayfs
expectations, one shared mount per layer per node, pack_diff, fork, and bad input."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import stat
import subprocess
import time

import pytest

import dsec
from dsec.node.layers.store import LayerStore
from tests.conftest import TOKEN, Platform

# Walks a tree inside a sandbox and prints {path: [type, mode, uid, gid, size, digest-or-target, xattrs]}.
TREE = r"""
import hashlib, json, os, stat, sys
root, skip = sys.argv[1], set(sys.argv[2:])
out = {}
for d, dirs, files in os.walk(root):
    dirs[:] = sorted(x for x in dirs if os.path.join(d, x) not in skip)
    for name in sorted(dirs + files):
        p = os.path.join(d, name)
        st = os.lstat(p)
        if stat.S_ISREG(st.st_mode):
            h = hashlib.sha256(open(p, "rb").read()).hexdigest()
        elif stat.S_ISLNK(st.st_mode):
            h = os.readlink(p)
        elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
            h = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
        else:
            h = ""
        try:
            xa = sorted((k, os.getxattr(p, k, follow_symlinks=False).hex())
                        for k in os.listxattr(p, follow_symlinks=False) if k.startswith("user."))
        except OSError:
            xa = []
        out[p] = [stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid,
                  st.st_size if stat.S_ISREG(st.st_mode) else 0, h, xa]
print(json.dumps(out))
"""


def _tree(sb: dsec.Sandbox, root: str, *skip: str) -> dict[str, list[object]]:
    sb.write_file("/opt/tree.py", TREE)  # outside the compared trees
    r = sb.exec(["python3", "/opt/tree.py", root, *skip])
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def _uniq(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


@pytest.fixture(scope="module")
def store(platform: Platform) -> LayerStore:
    return LayerStore(os.path.join(platform.data_dir, "layers"))


@pytest.fixture(scope="module")
def composed(tmp_path_factory: pytest.TempPathFactory, store: LayerStore) -> tuple[str, str]:
    """A workspace and a toolkit above it that overrides, merges, whites out and
    makes a directory opaque."""
    ws = tmp_path_factory.mktemp("ws")
    (ws / "app").mkdir()
    (ws / "app/main.py").write_text("print('ws')\n")
    (ws / "app/keep.txt").write_text("keep\n")
    (ws / "app/gone.txt").write_text("to be whited out\n")
    (ws / "cfg").mkdir()
    (ws / "cfg/old.conf").write_text("old\n")
    (ws / "empty").mkdir()
    (ws / "tools").mkdir()
    (ws / "tools/tool").write_text("#!/bin/sh\necho tool\n")
    os.chmod(ws / "tools/tool", 0o751)
    os.chown(ws / "tools/tool", 1234, 5678)
    os.symlink("../app/main.py", ws / "tools/link")
    os.link(ws / "app/keep.txt", ws / "app/keep-hardlink.txt")
    os.setxattr(ws / "app/keep.txt", "user.origin", b"workspace")
    os.mknod(ws / "app/null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    os.mkfifo(ws / "app/fifo")
    tk = tmp_path_factory.mktemp("tk")
    (tk / "app").mkdir()
    (tk / "app/main.py").write_text("print('tk')\n")  # overrides
    (tk / "app/extra.py").write_text("x = 1\n")  # merges
    os.mknod(tk / "app/gone.txt", stat.S_IFCHR, os.makedev(0, 0))  # whiteout
    (tk / "cfg").mkdir()
    (tk / "cfg/new.conf").write_text("new\n")
    os.setxattr(tk / "cfg", "trusted.overlay.opaque", b"y")  # hides cfg/old.conf
    (tk / "harness").mkdir()
    (tk / "harness/run.py").write_text("import extra\n")
    wsref, tkref = f"ws/{_uniq('compose')}:v1", f"tk/{_uniq('harness')}:v3"
    store.import_dir(str(ws), wsref)
    store.import_dir(str(tk), tkref)
    return wsref, tkref


def test_composition_semantics(platform: Platform, composed: tuple[str, str], store: LayerStore) -> None:
    wsref, tkref = composed
    with dsec.Client(url=platform.url, token=TOKEN) as c:
        sb = c.run_container(dsec.ContainerArgs(image="base/debian:12", layers=[wsref, tkref]))
        try:
            t = _tree(sb, "/app") | _tree(sb, "/cfg") | _tree(sb, "/tools") | _tree(sb, "/empty")
            r = sb.exec("cat /app/main.py /app/extra.py")
            assert r.exit_code == 0, r.stderr
            out = r.stdout.split()
            assert out[:4] == ["print('tk')", "x", "=", "1"]
            listing = set(sb.exec("ls /app").stdout.split())
            assert listing == {"main.py", "extra.py", "keep.txt", "keep-hardlink.txt", "null", "fifo"}
            assert sb.exec("ls /cfg").stdout.split() == ["new.conf"]
            assert sb.exec("ls -A /empty | wc -l").stdout.strip() == "0"
            st = sb.exec("stat -c '%a %u %g' /tools/tool; readlink /tools/link; "
                         "stat -c %i /app/keep.txt /app/keep-hardlink.txt; stat -c '%F %t:%T' /app/null /app/fifo")
            lines = st.stdout.splitlines()
            assert lines[0] == "751 1234 5678" and lines[1] == "../app/main.py"
            assert lines[2] == lines[3]  # hardlink preserved
            assert lines[4] == "character special file 1:3" and lines[5].startswith("fifo")
            xa = sb.exec(["python3", "-c", "import os; print(os.getxattr('/app/keep.txt', 'user.origin'))"])
            assert xa.stdout.strip() == "b'workspace'"
            assert t  # the walker ran over every composed path
            # writes anywhere, __pycache__ inside the toolkit included, go to the sandbox's upper layer
            r = sb.exec("cd /harness && python3 -c 'import sys; sys.path.insert(0, \"/app\"); import run' "
                        "&& ls /harness /app/__pycache__ && echo changed >> /app/main.py && rm /app/keep.txt")
            assert r.exit_code == 0, r.stderr
            for ref in (wsref, tkref):
                mnt = os.path.join(platform.data_dir, "layers", "mnt", store.get(ref).digest)
                assert not os.path.exists(os.path.join(mnt, "app/__pycache__"))
                assert subprocess.run(["sha256sum", store.blob_path(store.get(ref).digest)], capture_output=True,
                                      text=True).stdout.split()[0] == store.get(ref).digest
            assert open(os.path.join(platform.data_dir, "layers", "mnt", store.get(tkref).digest,
                                     "app/main.py")).read() == "print('tk')\n"
        finally:
            sb.stop()


def test_one_mount_serves_many_sandboxes(platform: Platform, composed: tuple[str, str], store: LayerStore) -> None:
    wsref, _ = composed
    digest = store.get(wsref).digest
    with dsec.Client(url=platform.url, token=TOKEN) as c:
        sbs = [c.run_container(dsec.ContainerArgs(image="base/busybox", layers=[wsref], memory_limit_mb=32))
               for _ in range(3)]
        try:
            with open("/proc/self/mountinfo") as f:
                mounts = [line for line in f if line.split()[4].endswith(digest)]
            assert len(mounts) == 1 and " erofs " in mounts[0]
            assert "/dev/loop" not in mounts[0]  # file-backed, not a loop device
            # each sandbox's overlay stacks on it; its options name the layers by fd, not by host
            # path (what the sandbox reads in its own mountinfo: tests/security/test_tenants.py)
            with open("/proc/self/mountinfo") as f:
                overlays = [line for line in f if " overlay " in line
                            and any(sb.sandbox_id in line.split()[4] for sb in sbs)]
            assert len(overlays) == 3
            assert all("lowerdir=/proc/self/fd/" in line and digest not in line for line in overlays), overlays
        finally:
            for sb in sbs:
                sb.stop()


def test_pack_diff_and_fork_reproduce_the_tree(platform: Platform) -> None:
    with dsec.Client(url=platform.url, token=TOKEN) as c:
        src = c.run_container(dsec.ContainerArgs(image="base/debian:12"))
        kids: list[dsec.Sandbox] = []
        try:
            r = src.run_shell(
                "mkdir -p /work/pkg/sub /work/empty && echo hi > /work/pkg/a.txt && "
                "head -c 100000 /dev/urandom > /work/pkg/sub/blob && ln -s pkg/a.txt /work/link && "
                "ln /work/pkg/a.txt /work/pkg/hard && chmod 700 /work/pkg/sub && chown 42:43 /work/pkg/a.txt && "
                "echo changed >> /etc/issue && rm /etc/debian_version && rm -r /usr/share/bug && "
                "mkdir /usr/share/bug && echo new > /usr/share/bug/only && "  # deleted then remade: opaque
                "mv /etc/profile /etc/profile.moved && mkfifo /work/fifo && "
                "echo secret > /tmp/junk && echo 'cat answers' > /root/.bash_history && "
                "mkdir -p /work/answers && echo 42 > /work/answers/key && "
                "python3 -c \"import os; os.setxattr('/work/pkg/a.txt', 'user.k', b'v')\"")
            assert r.exit_code == 0, r.stderr
            before = {p: _tree(src, p) for p in ("/work", "/etc", "/usr/share")}
            snap = src.pack_diff(f"ws/{_uniq('snap')}:v1", scrub_paths=["/work/answers"])
            assert snap.kind == "workspace" and snap.parent_image == "base/debian:12"
            assert src.run_shell("echo still running").stdout == "still running\n"  # thawed again
            kids = c.fork(snap, n=2)
            assert len({k.sandbox_id for k in kids}) == 2
            for k in kids:
                for p, tree in before.items():
                    got = _tree(k, p)
                    want = {q: v for q, v in tree.items() if not q.startswith("/work/answers")}
                    assert got == want, p
                assert k.exec("ls /tmp/junk /root/.bash_history /work/answers 2>&1 | wc -l").stdout.strip() == "3"
                assert k.exec("cat /tmp/junk /root/.bash_history 2>/dev/null | wc -c").stdout.strip() == "0"
            kids[0].write_file("/work/only-in-0", "x")
            assert kids[1].exec("test -e /work/only-in-0; echo $?").stdout.strip() == "1"
            assert src.exec("test -e /work/only-in-0; echo $?").stdout.strip() == "1"
            # a fork of a fork: pack_diff over a stack that already holds a snapshot
            kids[0].run_shell("rm /work/pkg/a.txt && echo more > /work/more")
            snap2 = kids[0].pack_diff(f"ws/{_uniq('snap2')}:v1")
            assert snap2.parent_layers == [snap.ref]
            (g,) = c.fork(snap2.ref, n=1)
            kids.append(g)
            assert g.exec("cat /work/more; test -e /work/pkg/a.txt; echo $?").stdout == "more\n1\n"
        finally:
            src.stop()
            for k in kids:
                k.stop()


def test_layer_catalog_api_and_rm_rules(platform: Platform, composed: tuple[str, str]) -> None:
    wsref, tkref = composed
    with dsec.Client(url=platform.url, token=TOKEN) as c:
        refs = {layer.ref for layer in c.layers()}
        assert {"base/debian:12", "base/busybox:latest", wsref, tkref} <= refs
        assert c.layer(wsref).kind == "workspace"
        sb = c.run_container(dsec.ContainerArgs(image="base/busybox", layers=[tkref]))
        try:
            with pytest.raises(dsec.LayerInUse):
                c.remove_layer(tkref)
            snap = sb.pack_diff(f"ws/{_uniq('child')}:v1")
        finally:
            sb.stop()
        with pytest.raises(dsec.LayerInUse, match="parent"):
            c.remove_layer(tkref)
        assert c.remove_layer(snap.ref).ref == snap.ref
        removed = c.gc_layers()
        assert snap.digest in removed
        with pytest.raises(dsec.NotFound):
            c.layer(snap.ref)


def test_bad_layer_input(platform: Platform, composed: tuple[str, str], store: LayerStore,
                         tmp_path_factory: pytest.TempPathFactory) -> None:
    wsref, tkref = composed
    with dsec.Client(url=platform.url, token=TOKEN) as c:
        with pytest.raises(dsec.NotFound) as e:
            c.run_container(dsec.ContainerArgs(image="base/busybox", layers=["ws/nope:v1"]))
        assert e.value.field == "layers[0]"
        with pytest.raises(dsec.InvalidRequest) as e2:
            c.run_container(dsec.ContainerArgs(image="base/busybox", layers=["base/debian:12"]))
        assert e2.value.field == "layers[0]"
        with pytest.raises(dsec.InvalidRequest) as e3:
            c.run_container(dsec.ContainerArgs(image=tkref))
        assert e3.value.field == "image"
        with pytest.raises(ValueError, match="more than once"):  # refused by the SDK's own validation
            c.run_container(dsec.ContainerArgs(image="base/busybox", layers=[wsref, tkref, wsref]))
        with pytest.raises(dsec.NotFound) as e4:
            c.fork("ws/never-made:v1", n=2)
        assert e4.value.field == "snapshot"
        sb = c.run_container(dsec.ContainerArgs(image="base/busybox"))
        try:
            for ref, field in ((tkref, "ref"), ("base/x:v1", "ref"), ("nonsense", "ref")):
                with pytest.raises(dsec.InvalidRequest) as e5:
                    sb.pack_diff(ref)
                assert e5.value.field == field
            with pytest.raises(dsec.InvalidRequest):
                sb.pack_diff("ws/y:v1", scrub_paths=["relative"])
        finally:
            sb.stop()
    # immutability and a corrupt image: nothing half-published
    src = tmp_path_factory.mktemp("dup")
    (src / "f").write_text("other content")
    with pytest.raises(dsec.InvalidRequest, match="immutable"):
        store.import_dir(str(src), wsref)
    bogus = src / "bogus.erofs"
    bogus.write_bytes(os.urandom(8192))
    with pytest.raises(dsec.InvalidRequest, match="not an EROFS image"):
        store.import_image(str(bogus), "ws/bogus:v1")
    assert not store.has("ws/bogus:v1")
    with pytest.raises(dsec.InvalidRequest):
        store.import_dir(str(src / "missing"), "ws/missing:v1")
    assert not store.has("ws/missing:v1")
    blobs = set(os.listdir(store.blob_dir))
    assert not [b for b in blobs if b.endswith(".tmp")]
    # a published blob corrupted on disk: creation fails cleanly, the platform stays up
    (src / "g").write_text("soon corrupt")
    (src / "f").unlink()
    bad = store.import_dir(str(src), f"ws/{_uniq('corrupt')}:v1")
    path = store.blob_path(bad.digest)
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(1024)
        f.write(b"\0" * 64)
    with dsec.Client(url=platform.url, token=TOKEN) as c:
        with pytest.raises(dsec.DsecError, match="not an EROFS image|corrupt"):
            c.run_container(dsec.ContainerArgs(image="base/busybox", layers=[bad.ref]))
        assert c.run_container(dsec.ContainerArgs(image="base/busybox")).stop().state == dsec.SandboxState.stopped
    assert hashlib.sha256(open(path, "rb").read()).hexdigest() != bad.digest


def test_layer_build_cli(platform: Platform, tmp_path_factory: pytest.TempPathFactory) -> None:
    import sys

    d = tmp_path_factory.mktemp("build")
    (d / "run.py").write_text("print('harness ok')\n")
    ref = f"tk/{_uniq('built')}:v1"
    (d / "spec.toml").write_text(
        f'ref = "{ref}"\nimage = "base/debian:12"\n'
        'steps = ["mkdir -p /opt/harness && cd /opt/harness", "python3 -m compileall -q .", '
        '"echo 42 > answers.txt"]\nscrub_paths = ["/opt/harness/answers.txt"]\n'
        '[files]\n"run.py" = "/opt/harness/run.py"\n')
    cli = [sys.executable, "-m", "dsec.client.cli.main", "layer", "build", "--url", platform.url, "--token", TOKEN]
    out = subprocess.run([*cli, str(d / "spec.toml")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert ref in out.stdout
    with dsec.Client(url=platform.url, token=TOKEN) as c:
        sb = c.run_container(dsec.ContainerArgs(image="base/debian:12", layers=[ref]))
        try:
            r = sb.exec("python3 /opt/harness/run.py; ls /opt/harness /opt/harness/__pycache__ | wc -l; "
                        "test -e /opt/harness/answers.txt; echo $?")
            assert r.stdout.splitlines()[0] == "harness ok" and r.stdout.splitlines()[-1] == "1"
        finally:
            sb.stop()
        (d / "bad.toml").write_text(f'ref = "{ref}-bad"\nsteps = ["false"]\n'.replace(":v1-bad", "-bad:v1"))
        bad = subprocess.run([*cli, str(d / "bad.toml")], capture_output=True, text=True, timeout=300)
        assert bad.returncode != 0 and "step 1 failed" in bad.stderr
        assert not [layer for layer in c.layers() if layer.ref.endswith("-bad:v1")]
        assert not [i for i in c.list(labels={"dsec-role": "builder"}) if i.state == dsec.SandboxState.running]


async def test_stale_build_scratch_is_swept(tmp_path: str) -> None:
    """A layer build killed mid-way (an edge crash in pack_diff) leaves a scratch dir in the
    store's tmp/; an edge start removes those older than a day and leaves younger ones (a
    build in progress, maybe another node's on a shared store)."""
    from dsec.node.storage.node import NodeLayers

    store = LayerStore(os.path.join(tmp_path, "store"))
    old, young = (os.path.join(store.backend.tempdir(), n) for n in ("tmpold", "tmpyoung"))
    for d in (old, young):
        os.makedirs(os.path.join(d, "sub"))
        with open(os.path.join(d, "sub", "meta"), "wb") as f:
            f.write(b"x" * 4096)
    two_days_ago = time.time() - 2 * 86400
    os.utime(old, (two_days_ago, two_days_ago))
    node = NodeLayers(store, os.path.join(tmp_path, "node"), os.path.join(tmp_path, "run"))
    await node.sweep_scratch()
    assert not os.path.exists(old) and os.path.isdir(young)
    store.close()
