"""In-place snapshots and rollback of running containers (docs/snapshots.md), on the real
btrfs sandbox volume of a real ``dsec serve``: files, processes, shell sessions and the
command log after a rollback, the bounds and their errors, another project's token, and
nothing left on the volume when the sandbox stops."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

import dsec
from dsec.node.edge.rollback import MAX_SNAPSHOTS
from tests.conftest import TOKEN, Platform, own_platform

BUSYBOX = dict(image="base/busybox", memory_limit_mb=128, cpu_cores_limit=1.0)


def _volume(platform: Platform) -> str:
    return os.path.join(platform.data_dir, "edges", "edge0", "volume")


def _leftovers(platform: Platform, sandbox_id: str) -> list[str]:
    """Anything of the sandbox still on the volume: its directory, a rollback's copies, snapshots."""
    vol = _volume(platform)
    found = [n for n in os.listdir(os.path.join(vol, "sandboxes")) if sandbox_id in n]
    if os.path.exists(os.path.join(vol, "inplace", sandbox_id)):
        found.append(f"inplace/{sandbox_id}")
    return found


def _settled_leftovers(platform: Platform, sandbox_id: str) -> list[str]:
    """The leftovers once an old root's removal, which may still be finishing in the
    background when a stop returns, has had 5 s."""
    for _ in range(50):
        if not _leftovers(platform, sandbox_id):
            break
        time.sleep(0.1)
    return _leftovers(platform, sandbox_id)


@pytest.fixture
def sb(platform: Platform) -> Iterator[dsec.Sandbox]:
    with dsec.Client(url=platform.url, token=TOKEN) as c:
        s = c.run_container(dsec.ContainerArgs(**BUSYBOX))  # type: ignore[arg-type]
        try:
            yield s
        finally:
            if s.refresh().state.value in ("running", "paused"):
                s.stop()


def test_rollback_brings_files_back_and_kills_later_processes(platform: Platform, sb: dsec.Sandbox) -> None:
    sb.exec("mkdir -p /work && echo one > /work/a && echo keep > /work/k && echo gone > /etc/motd")
    sb.exec("cd /work && export X=before", session="s1")
    snap = sb.snapshot()
    assert snap.name == "snap-1" and snap.sessions == {"s1": "/work"} and snap.freeze_ms < 1000
    # after it: a file written, one deleted, one changed, a directory made, a process started
    sb.exec("echo two > /work/b && rm /work/a /etc/motd && echo changed > /work/k && mkdir -p /new/deep")
    pid = sb.exec("sleep 600 >/dev/null 2>&1 & echo $!").stdout.strip()
    assert sb.exec(f"kill -0 {pid}").exit_code == 0
    sb.exec("cd /new", session="s1")

    res = sb.rollback(snap)
    assert res.snapshot == "snap-1" and res.killed >= 2 and res.sessions == ["s1"], res  # the sleep, s1's shell
    listing = sb.exec("ls /work; cat /work/a /work/k /etc/motd; ls -d /new").stdout.split()
    assert listing[:2] == ["a", "k"] and listing[2:5] == ["one", "keep", "gone"], listing
    assert "/new" not in listing
    assert sb.exec(f"kill -0 {pid}").exit_code != 0  # started after the snapshot: dead
    ps = sb.exec("ps -o pid,args").stdout
    assert "sleep 600" not in ps, ps
    # the session restarted in its directory of then (an exported variable does not survive)
    assert sb.exec("pwd; echo X=$X", session="s1").stdout.split() == ["/work", "X="]

    # again, to the same snapshot: the rollback copied it, the snapshot itself is untouched
    sb.exec("echo three > /work/c && rm /work/k")
    res2 = sb.rollback("snap-1")
    assert res2.snapshot == "snap-1"
    assert sb.exec("ls /work").stdout.split() == ["a", "k"]
    # the sandbox still works as before: files API, a new session, the root's mounts in place
    sb.write_file("/work/new.txt", "hello")
    assert sb.read_file("/work/new.txt") == b"hello"
    mounts = sb.exec("cat /proc/mounts").stdout
    for mp in (" / overlay", " /proc proc", " /dev tmpfs", " /sys sysfs", " /dev/pts devpts"):
        assert mp in mounts, (mp, mounts)
    # the new root is a private mount: what sits on it stays in the sandbox's mount namespace
    # and shows nowhere in the host's (a clone of a shared host mount would propagate)
    with open("/proc/self/mountinfo") as f:
        host = [line.split()[4] for line in f if sb.sandbox_id in line]
    assert not [m for m in host if m.endswith(("/rootfs/proc", "/rootfs/dev", "/rootfs/sys"))], host
    assert [s.name for s in sb.snapshots()] == ["snap-1"]


def test_snapshots_are_listed_dropped_and_named(sb: dsec.Sandbox) -> None:
    a = sb.snapshot("base")
    sb.exec("echo x > /x")
    b = sb.snapshot()
    assert (a.name, b.name) == ("base", "snap-1")
    snaps = sb.snapshots()
    assert [s.name for s in snaps] == ["base", "snap-1"] and all(s.bytes is not None for s in snaps)
    with pytest.raises(dsec.InvalidRequest) as e:
        sb.snapshot("base")  # names are unique per sandbox
    assert e.value.field == "name"
    for bad in ("../x", ".hidden", "a" * 65, "a/b", "a.json", "x\n"):  # a.json: the file beside each one
        with pytest.raises(dsec.InvalidRequest) as e:
            sb.snapshot(bad)
        assert e.value.field == "name", bad
    sb.drop_snapshot(a)
    assert [s.name for s in sb.snapshots()] == ["snap-1"]
    with pytest.raises(dsec.NotFound) as nf:
        sb.rollback("base")
    assert nf.value.field == "snapshot"
    with pytest.raises(dsec.NotFound):
        sb.drop_snapshot("base")
    sb.rollback(b)
    assert sb.exec("cat /x").stdout == "x\n"


def test_the_default_bound_is_a_409_until_one_is_dropped(sb: dsec.Sandbox) -> None:
    for i in range(MAX_SNAPSHOTS):
        sb.snapshot(f"s{i}")
    with pytest.raises(dsec.SnapshotLimit) as e:
        sb.snapshot()
    assert e.value.status == 409 and str(MAX_SNAPSHOTS) in e.value.message
    sb.drop_snapshot("s0")
    assert sb.snapshot().name == "snap-1"
    assert len(sb.snapshots()) == MAX_SNAPSHOTS


def test_snapshots_count_against_the_disk_quota(platform: Platform) -> None:
    with dsec.Client(url=platform.url, token=TOKEN) as c:
        sb = c.run_container(dsec.ContainerArgs(**BUSYBOX, disk_limit_mb=64))  # type: ignore[arg-type]
        try:
            sb.exec("dd if=/dev/urandom of=/data bs=1M count=40 2>/dev/null; sync")
            sb.snapshot("with-data")
            # the live sandbox lets go of the 40 MiB: the snapshot still holds them, so the kernel
            # refuses writes past the 24 MiB left of the limit (the sandbox and its snapshots share it)
            out = sb.exec("rm /data; dd if=/dev/urandom of=/more bs=1M count=30; sync")
            assert "quota" in out.stderr.lower(), out
            with pytest.raises(dsec.SnapshotLimit) as e:  # and no snapshot more while they fill it
                sb.snapshot()
            assert "quota" in e.value.message and e.value.field == "name"
            sb.drop_snapshot("with-data")
            for _ in range(100):  # btrfs frees the dropped snapshot's blocks in the background
                sb.exec("sync")
                try:
                    sb.snapshot("again")
                    break
                except dsec.SnapshotLimit:
                    time.sleep(0.1)
            assert [s.name for s in sb.snapshots()] == ["again"]
            # and a rollback keeps the sandbox under its limit: the copy it swaps in joins the group
            sb.rollback("again")
            out = sb.exec("rm -f /more; dd if=/dev/urandom of=/x bs=1M count=80; sync")
            assert "quota" in out.stderr.lower(), out
        finally:
            sb.stop()


def test_command_log_after_a_rollback(sb: dsec.Sandbox) -> None:
    first = sb.exec("echo 1 >> /log; cat /log", key="step-1")
    snap = sb.snapshot()
    assert snap.commands_seq == 1
    second = sb.exec("echo 2 >> /log; cat /log", key="step-2")
    assert second.stdout == "1\n2\n"
    res = sb.rollback(snap)
    assert res.commands_dropped == 1
    assert [r.key for r in sb.command_log()] == ["step-1"]
    # the key from before replays; the key from after runs again, on the rolled-back files
    again1 = sb.exec("echo 1 >> /log; cat /log", key="step-1")
    assert again1.replayed and again1.stdout == first.stdout
    again2 = sb.exec("echo 2 >> /log; cat /log", key="step-2")
    assert not again2.replayed and again2.stdout == "1\n2\n"


async def test_rollback_while_a_command_runs(platform: Platform) -> None:
    async with dsec.AsyncClient(url=platform.url, token=TOKEN) as c:
        sb = await c.run_container(dsec.ContainerArgs(**BUSYBOX))  # type: ignore[arg-type]
        try:
            snap = await sb.snapshot()
            running = asyncio.create_task(sb.exec("echo started > /f; sleep 60; echo never > /g", timeout=120,
                                                  key="long"))
            for _ in range(200):  # until it has started
                if (await sb.exec("cat /f 2>/dev/null")).stdout:
                    break
                await asyncio.sleep(0.02)
            res = await sb.rollback(snap)
            assert res.killed >= 2  # the shell and its sleep
            out = await asyncio.wait_for(running, 10)  # it ends at once, killed
            assert out.exit_code != 0
            assert (await sb.exec("ls /f /g 2>&1; true")).stdout.count("No such file") == 2
            # its record is gone with the rest of what came after: the key runs again
            assert [r.key for r in await sb.command_log()] == []
            assert (await sb.exec("echo ok", key="long")).stdout == "ok\n"
        finally:
            await sb.stop()


def test_stop_leaves_nothing_on_the_volume(platform: Platform) -> None:
    with dsec.Client(url=platform.url, token=TOKEN) as c:
        sb = c.run_container(dsec.ContainerArgs(**BUSYBOX))  # type: ignore[arg-type]
        for i in range(3):
            sb.exec(f"echo {i} > /f{i}")
            sb.snapshot()
        sb.rollback("snap-2")
        sb.rollback("snap-1")
        assert _leftovers(platform, sb.sandbox_id) != []
        sb.stop()
        assert _settled_leftovers(platform, sb.sandbox_id) == []


def test_another_projects_token_gets_404(platform: Platform, sb: dsec.Sandbox) -> None:
    with dsec.Client(url=platform.url, token=TOKEN) as admin:
        project = f"snap{uuid.uuid4().hex[:6]}"
        admin.projects.create(project, dsec.ProjectQuota(sandboxes=1))
        other = admin.create_token(project, "admin").token
    sb.snapshot("mine")
    h = {"Authorization": f"Bearer {other}"}
    base = f"{platform.url}/v1/sandboxes/{sb.sandbox_id}"
    for method, path, body in (("POST", "/snapshot", {}), ("GET", "/snapshots", None),
                               ("DELETE", "/snapshots/mine", None), ("POST", "/rollback", {"snapshot": "mine"})):
        r = httpx.request(method, base + path, json=body, headers=h)
        assert r.status_code == 404 and r.json()["field"] == "sandbox_id", (path, r.text)
    assert [s.name for s in sb.snapshots()] == ["mine"]  # untouched


def test_bad_requests_name_the_field(platform: Platform, sb: dsec.Sandbox) -> None:
    h = {"Authorization": f"Bearer {TOKEN}"}
    base = f"{platform.url}/v1/sandboxes/{sb.sandbox_id}"
    r = httpx.post(base + "/rollback", json={}, headers=h)
    assert r.status_code == 400 and "snapshot" in r.text, r.text
    r = httpx.post(base + "/snapshot", json={"name": "no/slash"}, headers=h)
    assert r.status_code == 400 and "name" in r.text, r.text
    r = httpx.post(f"{platform.url}/v1/sandboxes/edge0-aaaaaaaaaaaa/snapshot", json={}, headers=h)
    assert r.status_code == 404 and r.json()["field"] == "sandbox_id", r.text


def test_a_vm_says_snapshots_are_for_containers(platform: Platform) -> None:
    with dsec.Client(url=platform.url, token=TOKEN) as c:
        vm = c.run_microvm(dsec.MicroVMArgs(image="base/busybox", vcpus=1, memory_mb=256))
        try:
            for call in (lambda: vm.snapshot(), lambda: vm.snapshots(), lambda: vm.rollback("x")):
                with pytest.raises(dsec.NotSupported) as e:
                    call()
                assert e.value.status == 501 and "container" in e.value.message and not e.value.infra
        finally:
            vm.stop()


@pytest.fixture(scope="module")
def no_btrfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    yield from own_platform(tmp_path_factory, "no-btrfs", ["--sandbox-volume-gb", "0"])


def test_without_the_btrfs_volume_a_typed_501(no_btrfs: Platform) -> None:
    with dsec.Client(url=no_btrfs.url, token=TOKEN) as c:
        sb = c.run_container(dsec.ContainerArgs(**BUSYBOX))  # type: ignore[arg-type]
        try:
            with pytest.raises(dsec.NotSupported) as e:
                sb.snapshot()
            assert "btrfs" in e.value.message and e.value.field == "sandbox_id"
        finally:
            sb.stop()


def test_a_read_only_root_and_tmpfs_mounts_survive_a_rollback(platform: Platform) -> None:
    with dsec.Client(url=platform.url, token=TOKEN) as c:
        sb = c.run_container(dsec.ContainerArgs(**BUSYBOX, readonly_rootfs=True,  # type: ignore[arg-type]
                                                tmpfs={"/scratch": 16}))
        try:
            sb.exec("echo kept > /scratch/f")
            snap = sb.snapshot()
            sb.rollback(snap)
            out = sb.exec("touch /x; cat /scratch/f; grep -c ' /scratch tmpfs' /proc/mounts")
            assert "Read-only file system" in out.stderr, out  # the root stays read-only
            assert out.stdout.split() == ["kept", "1"], out  # the same tmpfs, moved over with its contents
        finally:
            sb.stop()


@pytest.fixture(scope="module")
def restartable(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    yield from own_platform(tmp_path_factory, "snap-restart")


def test_snapshots_outlive_an_edge_restart(restartable: Platform) -> None:
    p = restartable
    with dsec.Client(url=p.url, token=TOKEN) as c:
        sb = c.run_container(dsec.ContainerArgs(**BUSYBOX, disk_limit_mb=256))  # type: ignore[arg-type]
        sb.exec("echo 1 > /f")
        first = sb.snapshot()
        sb.exec("echo 2 > /f")
        sb.rollback(first)  # the sandbox now runs on a rollback's copy
        sb.exec("echo 3 > /f")
        sb.snapshot("second")
    p.restart(crash=True)  # the edge dies; the sandbox and its snapshots stay
    with dsec.Client(url=p.url, token=TOKEN) as c:
        sb = c.connect(sb.sandbox_id)
        assert [s.name for s in sb.snapshots()] == ["snap-1", "second"]
        assert sb.exec("cat /f").stdout == "3\n"
        sb.rollback("snap-1")
        assert sb.exec("cat /f").stdout == "1\n"
        sb.rollback("second")
        assert sb.exec("cat /f").stdout == "3\n"
        sb.stop()
        assert _settled_leftovers(p, sb.sandbox_id) == []


def test_pack_diff_and_checkpoint_see_the_rolled_back_files(platform: Platform, sb: dsec.Sandbox) -> None:
    sb.exec("mkdir -p /work && echo kept > /work/kept")
    snap = sb.snapshot()
    sb.exec("echo later > /work/later && rm /work/kept")
    sb.rollback(snap)
    # the writable layer the edge reads from is the rolled-back one
    layer = sb.pack_diff(f"ws/rolled-{uuid.uuid4().hex[:6]}:v1")
    with dsec.Client(url=platform.url, token=TOKEN) as c:
        (kid,) = c.fork(layer, n=1)
        try:
            assert kid.exec("ls /work").stdout.split() == ["kept"]
        finally:
            kid.stop()
    cp = sb.checkpoint()
    assert cp.files > 0
