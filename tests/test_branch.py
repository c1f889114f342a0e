"""Live branch of a running sandbox (docs/snapshots.md, "Live branch") on a real ``dsec
serve``: a microVM on real QEMU (under TCG on our machines: slow, so one VM test does the
whole story, one more covers a cold-booted parent) branched into children that see its
files and carry on its running process with its memory, while it runs on and each
diverges; the children's own identity and entropy, their command log, job, project,
quotas and events; a child's pause, resume and own branch; and nothing left behind
(files, QEMU processes) once all have stopped. Then a container (CRIU) through the same
story, its shell sessions carried; the refusals: what CRIU cannot carry (an established
TCP connection, 409 naming it), a paused parent (409), a bad ``n`` (400 naming it),
another project's token (404)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import glob
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

import dsec
from tests.conftest import TOKEN, Platform, leftovers, qemu_pids, wait_for

BUSYBOX = dict(image="base/busybox", memory_limit_mb=64, cpu_cores_limit=0.25)


def _branches_dir(platform: Platform) -> list[str]:
    """Branch images still on the platform's edges (each is dropped once its children are made)."""
    found: list[str] = []
    for d in glob.glob(os.path.join(platform.data_dir, "edges", "*", "branches")) + \
            glob.glob(os.path.join(platform.data_dir, "edges", "*", "volume", "branches")):
        found += os.listdir(d)
    return found


async def _state(sb: dsec.AsyncSandbox) -> tuple[str, int]:
    """The background loop's secret and counter, as it last wrote them (it renames each
    write into place: a read never sees a half-written file)."""
    secret, count, *_ = (await sb.read_file("/tmp/loop")).decode().split()
    return secret, int(count)


async def _check_branch(parent: dsec.AsyncSandbox, children: list[dsec.AsyncSandbox], *, project: str, job: str,
                        loop_pid: str, count_at_branch: int, logged: dsec.ExecResult,
                        session: tuple[str, list[str]]) -> None:
    """What a branch of 2 shows, whatever the backend: each child is the parent's (its
    arguments, files, running loop with the memory it held, shell session, command log)
    under its own identity; the parent runs on and names its children; each then diverges.
    ``session``: a command for the parent's session and the words it printed before."""
    assert len(children) == 2 and len({c.sandbox_id for c in children}) == 2
    assert parent.sandbox_id not in {c.sandbox_id for c in children}
    for c in children:
        info = c.info
        assert info.state == "running" and info.branched_from == parent.sandbox_id
        assert info.labels["team"] == "search" and info.labels["dsec.project"] == project
        assert info.job == job
        assert info.memory_limit_mb == parent.info.memory_limit_mb
        # its own identity: the hostname is its own id
        assert (await c.exec("hostname")).stdout.strip() == c.sandbox_id
        # the parent's files, and its running process with the memory it held
        assert await c.read_file("/root/base.txt") == b"from the parent"
        assert (await c.exec("test -e /root/seed")).exit_code != 0
        assert (await c.exec(f"kill -0 {loop_pid}")).exit_code == 0
        secret, count = await _state(c)
        assert secret == "s3cret" and count >= count_at_branch
        assert await _wait_count_above(c, count)  # ... still running in the child: its counter goes on
        # the shell session carried over: the same shell, its cwd and variables
        assert (await c.run_shell(session[0])).stdout.split() == session[1]
        # the command log starts from the parent's: the keyed command replays its result
        assert [r.key for r in await c.command_log()] == ["k-before"]
        again = await c.exec("cat /proc/sys/kernel/random/uuid", key="k-before")
        assert again.stdout == logged.stdout and len(logged.stdout) == 37
        assert any(e.kind == "branched" and parent.sandbox_id in e.message for e in await c.events())
    # the parent runs on, untouched, its session too, and its event names the children
    assert (await parent.exec(f"kill -0 {loop_pid}")).exit_code == 0
    assert await _wait_count_above(parent, count_at_branch)
    assert (await parent.run_shell(session[0])).stdout.split() == session[1]
    ev = [e for e in await parent.events() if e.kind == "branched"]
    assert ev and all(c.sandbox_id in ev[-1].message for c in children)
    # each diverges on its own
    await parent.write_file("/root/who", b"parent")
    for i, c in enumerate(children):
        await c.write_file("/root/who", f"child{i}".encode())
    assert await parent.read_file("/root/who") == b"parent"


async def test_microvm_branch_carries_processes_memory_and_files(platform: Platform) -> None:
    project = f"br{uuid.uuid4().hex[:6]}"
    async with dsec.AsyncClient(url=platform.url, token=TOKEN) as admin:
        await admin.projects.create(project, dsec.ProjectQuota(sandboxes=4))
        token = (await admin.create_token(project, "admin")).token
    async with dsec.AsyncClient(url=platform.url, token=token) as client:
        await client.create_job("search-1", quota=dsec.JobQuota(sandboxes=3))
        vm = await client.run_microvm(dsec.MicroVMArgs(memory_mb=256, labels={"team": "search"}, job="search-1"))
        children: list[dsec.AsyncSandbox] = []
        try:
            await vm.write_file("/root/seed", b"s3cret")
            await vm.write_file("/root/base.txt", b"from the parent")
            # a process holding state only in its memory: the seed file is gone before the branch
            await vm.run_shell("(sh -c 'secret=$(cat /root/seed); i=0; while true; do i=$((i+1)); "
                               "echo \"$secret $i\" > /tmp/loop.new; mv /tmp/loop.new /tmp/loop; sleep 0.2; done' "
                               ">/dev/null 2>&1 &) ; "
                               "sleep 1; rm /root/seed; cd /srv && export KEEP=kept")
            found = (await vm.exec(["pgrep", "-f", "while true"])).stdout.split()  # (argv: no shell to match)
            assert len(found) == 1, found
            loop_pid = found[0]
            logged = await vm.exec("cat /proc/sys/kernel/random/uuid", key="k-before")  # differs per run
            _, count_at_branch = await _state(vm)

            t0 = time.monotonic()
            children = await vm.branch(n=2)
            took = time.monotonic() - t0
            for c in children:
                assert c.info.backend == "microvm" and c.info.vm is not None and c.info.vm.started_from == "branch"
            await _check_branch(vm, children, project=project, job="search-1", loop_pid=loop_pid,
                                count_at_branch=count_at_branch, logged=logged,
                                session=("echo $PWD $KEEP", ["/srv", "kept"]))
            assert [await c.read_file("/root/who") for c in children] == [b"child0", b"child1"]
            rand = [(await s.exec("head -c 16 /dev/urandom | od -An -tx1")).stdout for s in (vm, *children)]
            assert len(set(rand)) == 3
            # the children count in the parent's job: 3 of its 3 sandboxes are held now ...
            with pytest.raises(dsec.QuotaExceeded) as q:
                await vm.branch(n=1)
            assert "search-1" in q.value.message
            # ... and in its project (4 of them, 3 held): 2 more are refused before the edge is asked
            with pytest.raises(dsec.QuotaExceeded) as q:
                await vm.branch(n=2)
            assert "search-1" not in q.value.message, q.value.message
            assert _branches_dir(platform) == []  # the image went once the children were made
            assert _qemus_of_branch_images() == []  # and its template QEMU with it
            # a child pauses and resumes like any VM (its RAM file is its own link), and branches in turn
            await children[1].stop()
            await children[0].pause()
            assert (await children[0].resume()).state == "running"
            _, before = await _state(children[0])
            assert await _wait_count_above(children[0], before)
            grand = (await children[0].branch(1))[0]
            children.append(grand)
            assert grand.info.branched_from == children[0].sandbox_id
            assert await grand.read_file("/root/who") == b"child0"
            assert (await grand.exec(f"kill -0 {loop_pid}")).exit_code == 0
            assert await _wait_count_above(grand, (await _state(grand))[1])
            print(f"branch of 2 microVM children under TCG: {took:.2f} s")
        finally:
            for s in (*children, vm):
                await s.stop()  # (a stopped one answers with its info)
    for s in (vm, *children):
        assert leftovers(platform, s.sandbox_id) == []
        assert qemu_pids(s.sandbox_id) == []
    assert _branches_dir(platform) == []


async def test_branch_of_a_cold_booted_microvm(platform: Platform, client: dsec.AsyncClient) -> None:
    """A parent booted without a template has its RAM as QEMU's own (no file): its children
    restore its stream under the machine's own RAM name (qemu.DEFAULT_RAM_ID)."""
    vm = await client.run_microvm(dsec.MicroVMArgs(memory_mb=256, template=False, disk_mb=256))
    kids: list[dsec.AsyncSandbox] = []
    try:
        await vm.run_shell("echo cold > /root/x; (sleep 999 >/dev/null 2>&1 &)")
        sleeper = (await vm.exec("pgrep -x sleep")).stdout.strip()
        kids = await vm.branch(1)
        assert kids[0].info.vm is not None and kids[0].info.vm.started_from == "branch"
        r = await kids[0].exec("cat /root/x; pgrep -x sleep")
        assert r.stdout.split() == ["cold", sleeper]
        assert (await vm.exec("pgrep -x sleep")).stdout.strip() == sleeper
    finally:
        for s in (*kids, vm):
            await s.stop()
    for s in (*kids, vm):
        assert leftovers(platform, s.sandbox_id) == [] and qemu_pids(s.sandbox_id) == []


def _qemus_of_branch_images() -> list[int]:
    """QEMU processes started over a branch image (its template)."""
    out = []
    for cmd in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(cmd, "rb") as f:
                argv = f.read()
        except OSError:
            continue
        if argv.startswith(b"qemu-system") or b"/qemu-system" in argv.split(b"\0")[0]:
            if b"/branches/" in argv:
                out.append(int(cmd.split("/")[2]))
    return out


async def _wait_count_above(sb: dsec.AsyncSandbox, count: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (await _state(sb))[1] > count:
            return True
        await asyncio.sleep(0.3)
    return False


@pytest.fixture
def box(platform: Platform) -> Iterator[dsec.Sandbox]:
    with dsec.Client(url=platform.url, token=TOKEN) as c:
        s = c.run_container(dsec.ContainerArgs(**BUSYBOX))  # type: ignore[arg-type]
        try:
            yield s
        finally:
            if s.refresh().state.value in ("running", "paused"):
                s.stop()


async def test_container_branch_carries_processes_sessions_and_files(platform: Platform) -> None:
    """The container's story (CRIU), as the microVM's above: through the SDK, REST once."""
    project = f"bc{uuid.uuid4().hex[:6]}"
    async with dsec.AsyncClient(url=platform.url, token=TOKEN) as admin:
        await admin.projects.create(project, dsec.ProjectQuota(sandboxes=4))
        token = (await admin.create_token(project, "admin")).token
    async with dsec.AsyncClient(url=platform.url, token=token) as client:
        await client.create_job("search-c", quota=dsec.JobQuota(sandboxes=3))
        box = await client.run_container(dsec.ContainerArgs(**BUSYBOX, labels={"team": "search"},  # type: ignore[arg-type]
                                                            job="search-c"))
        children: list[dsec.AsyncSandbox] = []
        try:
            await box.write_file("/root/seed", b"s3cret")
            await box.write_file("/root/base.txt", b"from the parent")
            # a process holding state only in its memory (the seed file is gone before the
            # branch), its pid in what it writes; then a session with a cwd and a variable
            await box.run_shell("(sh -c 'secret=$(cat /root/seed); i=0; while true; do i=$((i+1)); "
                                "echo \"$secret $i $$\" > /tmp/loop.new; mv /tmp/loop.new /tmp/loop; sleep 0.2; "
                                "done' >/dev/null 2>&1 &); sleep 1; rm /root/seed")
            await box.run_shell("cd /tmp && export K=v")
            loop_pid = (await box.read_file("/tmp/loop")).decode().split()[2]
            logged = await box.exec("cat /proc/sys/kernel/random/uuid", key="k-before")  # differs per run
            _, count_at_branch = await _state(box)

            t0 = time.monotonic()
            children = await box.branch(n=2)
            took = time.monotonic() - t0
            assert all(c.info.backend == "container" for c in children)
            await _check_branch(box, children, project=project, job="search-c", loop_pid=loop_pid,
                                count_at_branch=count_at_branch, logged=logged,
                                session=("echo $PWD $K", ["/tmp", "v"]))
            for c in children:
                await c.run_shell("export K=child")
            assert [await c.read_file("/root/who") for c in children] == [b"child0", b"child1"]
            assert (await box.run_shell("echo $K")).stdout.strip() == "v"
            # the children count in the parent's job (3 of its 3 held) and its project
            with pytest.raises(dsec.QuotaExceeded) as q:
                await box.branch(n=1)
            assert "search-c" in q.value.message
            assert _branches_dir(platform) == []  # the image went once the children were made
            # a child branches in turn, over REST: 201 and the list of the new sandboxes
            await children[1].stop()
            async with httpx.AsyncClient(timeout=120) as http:
                r = await http.post(f"{platform.url}/v1/sandboxes/{children[0].sandbox_id}/branch", json={"n": 1},
                                    headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 201, r.text
            (grand_info,) = r.json()
            grand = await client.connect(grand_info["sandbox_id"])
            children.append(grand)
            assert grand_info["branched_from"] == children[0].sandbox_id and grand_info["state"] == "running"
            assert await grand.read_file("/root/who") == b"child0"
            assert (await grand.run_shell("echo $PWD $K")).stdout.split() == ["/tmp", "child"]
            assert await _wait_count_above(grand, (await _state(grand))[1])
            print(f"branch of 2 container children: {took:.2f} s")
        finally:
            for s in (*children, box):
                await s.stop()
    for s in (box, *children):
        assert leftovers(platform, s.sandbox_id) == []
    assert _branches_dir(platform) == []


def test_container_branch_refusals_and_a_paused_parent_are_409(platform: Platform, box: dsec.Sandbox) -> None:
    """What cannot be carried is refused, naming it, and nothing is left (the parent runs on)."""
    with dsec.Client(url=platform.url, token=TOKEN) as c:
        before = {i.sandbox_id for i in c.list()}
        # an established TCP connection (over its loopback): its peer may be anywhere
        r = box.run_shell("(sleep 600 | nc -l -p 7001 >/dev/null 2>&1 &); "
                          "for i in $(seq 100); do netstat -tln | grep -q :7001 && break; sleep 0.05; done; "
                          "(sleep 600 | nc 127.0.0.1 7001 >/dev/null 2>&1 &); "
                          "for i in $(seq 100); do [ $(netstat -tn | grep -c ESTABLISHED) -ge 2 ] && break; "
                          "sleep 0.05; done; netstat -tn | grep -c ESTABLISHED")
        assert r.stdout.strip() == "2", r  # both ends of one connection
        with pytest.raises(dsec.BranchUnsupported) as e:
            box.branch(2)
        assert e.value.status == 409 and "established TCP connection" in e.value.message, e.value.message
        assert not e.value.infra
        # the CLI says the same
        cli = subprocess.run([sys.executable, "-m", "dsec.client.cli.main", "branch", box.sandbox_id, "-n", "2",
                              "--url", platform.url, "--token", TOKEN], capture_output=True, text=True, timeout=60)
        assert cli.returncode != 0 and "established TCP connection" in cli.stdout + cli.stderr, cli
        assert box.run_shell("echo alive").stdout.strip() == "alive"  # thawed: it runs on
        # a shell session running a command (its caller waits on that shell): refused, naming it
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(box.run_shell, "sleep 2.5; echo done", session="busy")
            assert wait_for(lambda: "sleep 2.5" in box.exec("ps -o args").stdout, 10, 0.05)
            with pytest.raises(dsec.BranchUnsupported) as e:
                box.branch(1)
            assert e.value.status == 409 and "shell session 'busy' is running a command" in e.value.message
            assert running.result(timeout=30).stdout.strip() == "done"  # untouched
        box.pause()
        with pytest.raises(dsec.SandboxNotRunning) as e2:
            box.branch(1)
        assert "paused" in e2.value.message
        assert box.refresh().state.value == "paused"  # left as it was
        assert {i.sandbox_id for i in c.list()} == before  # no child was made, nothing held
    assert _branches_dir(platform) == []


def test_branch_bad_n_and_another_project(platform: Platform, box: dsec.Sandbox) -> None:
    h = {"Authorization": f"Bearer {TOKEN}"}
    url = f"{platform.url}/v1/sandboxes/{box.sandbox_id}/branch"
    for bad in (0, 17, -1, "x"):
        r = httpx.post(url, json={"n": bad}, headers=h)
        assert r.status_code == 400 and r.json()["field"] == "n", r.text
    with dsec.Client(url=platform.url, token=TOKEN) as admin:
        project = f"br{uuid.uuid4().hex[:6]}"
        admin.projects.create(project, dsec.ProjectQuota(sandboxes=1))
        other = admin.create_token(project, "admin").token
    r = httpx.post(url, json={"n": 1}, headers={"Authorization": f"Bearer {other}"})
    assert r.status_code == 404 and r.json()["field"] == "sandbox_id", r.text
