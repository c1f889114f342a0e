"""Live branches of a running container through CRIU (docs/snapshots.md, "Live branch of a container: CRIU"),
at the backend boundary: ``branch_image`` of a container running a Python process that
holds a counter in memory and writes files, then children made from that image with
``prepare(restore=...)`` + ``launch`` + ``connect``, as the edge makes them. Real CRIU
(scripts/criu.sh), crun, btrfs and cgroups: the child runs the same process from the
same state, with the files of that instant, in its own network namespace, cgroup and
hostname, its shell sessions carried; the parent keeps running; what CRIU refuses is a
BranchUnsupported in CRIU's words (and a session running a command, in ours); nothing is
left behind."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import secrets
from collections.abc import AsyncIterator

import pytest

from dsec.node.backends.api import Sandbox
from dsec.node.backends.container import branching
from dsec.node.backends.container.sandboxes import ContainerSandboxes
from dsec.node.host.cgroup import WORKLOAD, Cgroup
from dsec.node.host.process import alive
from dsec.shared.errors import BranchUnsupported
from dsec.shared.wire.models import ContainerArgs, ExecRequest
from tests.test_backend_contract import Host, Node, leftovers, node, runtime  # noqa: F401 - node: the module fixture

# a counter in memory (never read back from the file) under a token drawn at its start:
# a child that restarted it would show a new token and a count from 1
COUNTER = r"""
import os, secrets, socket, threading, time
token, n = secrets.token_hex(4), 0
server = socket.create_server(("0.0.0.0", 7000))  # a TCP listener: a child's answers in its own netns

def serve():
    while True:
        c, _ = server.accept()
        c.sendall(f"{token} {n}".encode())
        c.close()

threading.Thread(target=serve, daemon=True).start()
while True:
    n += 1
    with open("/root/count.tmp", "w") as f:
        f.write(f"{token} {n} {os.getpid()}")
    os.replace("/root/count.tmp", "/root/count")
    time.sleep(0.02)
"""


class DebianHost(Host):
    def args(self) -> ContainerArgs:  # type: ignore[override]
        return ContainerArgs(image="base/debian:12", memory_limit_mb=256, disk_limit_mb=512)

    async def sh(self, sb: Sandbox, cmd: str) -> str:
        return await self.run(sb, cmd)

    async def make_child(self, restore: dict[str, str], like: Sandbox) -> Sandbox:
        """A child from a branch image, driven as the edge drives a create."""
        from dataclasses import replace

        sid = f"ct-{secrets.token_hex(6)}"
        info = like.rec.info.model_copy(update={"sandbox_id": sid})
        sb = Sandbox(replace(like.rec, info=info, init_pid=0), os.path.join(self.node.sandbox_root, sid))
        self.made[sid] = sb
        await self.rt.prepare(sb, sb.rec.digests, restore=restore)
        sb.rec.init_pid = (await self.rt.launch(sb, sb.rec.digests)).init_pid
        self.bind(sb, await self.rt.connect(sb))
        return sb


@pytest.fixture
async def host(node: Node) -> AsyncIterator[DebianHost]:  # noqa: F811 - node: the contract's module fixture
    if not os.access(os.path.join(branching.CRIU_PREFIX, "sbin", "criu"), os.X_OK):
        pytest.fail("CRIU is not built: run scripts/setup.sh (scripts/criu.sh)")
    h = DebianHost("container", node)
    yield h
    await h.close()


@pytest.fixture
def work(host: DebianHost) -> str:
    return os.path.join(_rt(host).branch_dir(), f"branch-{secrets.token_hex(4)}")


def _rt(h: Host) -> ContainerSandboxes:
    assert isinstance(h.rt, ContainerSandboxes)
    return h.rt


async def _count(h: DebianHost, sb: Sandbox) -> tuple[str, int, int]:
    token, n, pid = (await h.sh(sb, "cat /root/count")).split()
    return token, int(n), int(pid)


async def _started_counter(h: DebianHost) -> Sandbox:
    sb = await h.create()
    await h.agents[sb.id].files.write_file("/root/counter.py", COUNTER.encode())
    await h.sh(sb, "echo before > /root/data.txt; (python3 /root/counter.py </dev/null >/dev/null 2>&1 &)")
    for _ in range(100):
        if "yes" in await h.sh(sb, "test -f /root/count && echo yes || true"):
            break
        await asyncio.sleep(0.05)
    return sb


def _ns(pid: int, kind: str) -> str:
    return os.readlink(f"/proc/{pid}/ns/{kind}")


async def test_child_continues_the_parents_process_with_its_files_in_its_own_namespaces(
        host: DebianHost, work: str) -> None:
    rt = _rt(host)
    parent = await _started_counter(host)
    # a shell session with a cwd, a variable and a background job of its own
    p_agent = host.agents[parent.id]
    await p_agent.exec(ExecRequest(cmd="cd /root && export K=v && (sleep 600 &)", session="s1"))
    restore = await rt.branch_image(parent, work)
    assert restore == {"kind": branching.KIND, "image": work}
    captured = branching.Image.load(os.path.join(work, "criu", "dsec.json"))
    assert captured.dump_ms > 0 and captured.listener.startswith("socket:[")
    # after the capture: a file the children must not see, and the parent's counter runs on
    await host.sh(parent, "echo after > /root/after.txt")
    token, n_parent, pid = await _count(host, parent)

    children = [await host.make_child(restore, parent) for _ in range(2)]
    for child in children:
        # the same process (its pid in its namespace, its token: its memory), counting on from
        # where it was captured, not from 1
        await asyncio.sleep(0.3)
        c_token, c_n, c_pid = await _count(host, child)
        assert (c_token, c_pid) == (token, pid)
        assert c_n > 1
        await asyncio.sleep(0.2)
        assert (await _count(host, child))[1] > c_n, "the restored counter does not run"
        # its TCP listener came along and answers in the child's own network namespace
        got = await host.sh(child, "python3 -c 'import socket; "
                                   "print(socket.create_connection((\"127.0.0.1\", 7000)).recv(64).decode())'")
        assert got.split()[0] == token
        # the session came along (its shell and its channels), taken back as after an edge restart
        agent = host.agents[child.id]
        assert await agent.recover_sessions() == ["s1"]
        r = await agent.exec(ExecRequest(cmd="echo $PWD $K; pgrep -x sleep | wc -l", session="s1"))
        assert r.stdout.split() == ["/root", "v", "1"], r
        # the files of the captured instant
        assert (await host.sh(child, "cat /root/data.txt; ls /root")).split()[0] == "before"
        assert "after.txt" not in await host.sh(child, "ls /root")
        # its own identity, network namespace and cgroup
        assert (await host.sh(child, "hostname")).strip() == child.id
        init = child.rec.init_pid
        assert _ns(init, "net") != _ns(parent.rec.init_pid, "net")
        assert _ns(init, "pid") != _ns(parent.rec.init_pid, "pid")
        assert _ns(init, "mnt") != _ns(parent.rec.init_pid, "mnt")
        assert init in Cgroup(rt.cgroup_path(child.id)).procs()
        workload = Cgroup(os.path.join(rt.cgroup_path(child.id), WORKLOAD)).procs()
        assert workload and init not in workload  # the counter runs under the child's workload limits
        with open(os.path.join(Cgroup(rt.cgroup_path(child.id)).dir("memory", WORKLOAD),
                               "memory.limit_in_bytes")) as f:
            assert int(f.read()) == 256 << 20
        # a new command runs in it, in its workload cgroup (its cgroup namespace is rooted at the child's)
        assert f"memory:/{WORKLOAD}\n" in await host.sh(child, "cat /proc/self/cgroup")
        # its files are its own: a write in one child is not in the parent or the other child
        await host.sh(child, f"echo {child.id} > /root/mine.txt")
    assert "mine.txt" not in await host.sh(parent, "ls /root")
    assert (await host.sh(children[1], "cat /root/mine.txt")).strip() == children[1].id

    # a restarted edge knows the restored children (crun does not) and takes one back
    again = runtime("container", host.node)
    assert {c.id for c in children} <= await again.known()
    await host.agents[children[1].id].close()
    adopted = await again.adopt(children[1], True)
    assert adopted.running and adopted.link is not None
    host.bind(children[1], adopted.link)
    assert (await host.sh(children[1], "cat /root/mine.txt")).strip() == children[1].id

    # a child is branched in turn (its channel to the edge is in its own namespace too)
    work2 = f"{work}-2"
    grandchild = await host.make_child(await rt.branch_image(children[0], work2), children[0])
    await asyncio.sleep(0.2)
    g_token, g_n, _ = await _count(host, grandchild)
    assert g_token == token and g_n > 1
    assert (await host.sh(grandchild, "cat /root/mine.txt")).strip() == children[0].id
    children.append(grandchild)

    # the parent ran on throughout, and still answers, its session too
    assert (await _count(host, parent))[1] > n_parent
    assert (await p_agent.exec(ExecRequest(cmd="echo $PWD $K", session="s1"))).stdout.split() == ["/root", "v"]
    assert (await host.sh(parent, "cat /root/after.txt")).strip() == "after"

    ids = [parent.id, *(c.id for c in children)]
    nets = {_ns(c.rec.init_pid, "net") for c in children}
    for sb in [*children, parent]:
        await host.release(sb)
    rt.drop_branch_image(work)
    rt.drop_branch_image(work2)
    assert not os.path.exists(work) and not os.path.exists(work2)
    for sid in ids:
        assert leftovers(host.node, sid) == [], sid
    # no process is left in the children's network namespaces (they went with their inits)
    left = []
    for p in glob.glob("/proc/[0-9]*/ns/net"):
        with contextlib.suppress(OSError):
            if os.readlink(p) in nets:
                left.append(p)
    assert left == []


async def test_what_criu_refuses_is_branch_unsupported_and_the_parent_runs_on(host: DebianHost, work: str) -> None:
    rt = _rt(host)
    parent = await _started_counter(host)
    # an established TCP connection over its loopback: not carried (its peer may be anywhere)
    await host.sh(parent, "(python3 -c 'import socket,time; s=socket.create_server((\"127.0.0.1\", 7001)); "
                          "c=socket.create_connection((\"127.0.0.1\", 7001)); a=s.accept(); time.sleep(600)' "
                          "</dev/null >/dev/null 2>&1 &); sleep 0.5")
    with pytest.raises(BranchUnsupported) as e:
        await rt.branch_image(parent, work)
    assert "established TCP connection" in e.value.message, e.value.message
    assert "CRIU: " in e.value.message and "TCP" in e.value.message.split("CRIU: ")[1], e.value.message
    assert e.value.status == 409
    assert not os.path.exists(work)  # nothing of the failed capture is left
    assert not Cgroup(rt.cgroup_path(parent.id)).frozen()
    before = (await _count(host, parent))[1]
    await asyncio.sleep(0.1)
    assert (await _count(host, parent))[1] > before
    await host.sh(parent, "pkill -f create_serve[r]; true")

    # a command still running holds its output channel to the host: refused, naming it
    agent = host.agents[parent.id]
    running = asyncio.create_task(agent.exec(ExecRequest(cmd="sleep 30", timeout_s=60)))
    await asyncio.sleep(0.5)
    try:
        with pytest.raises(BranchUnsupported) as e:
            await rt.branch_image(parent, work)
        assert "unix socket of the host" in e.value.message and "not found" in e.value.message, e.value.message
    finally:
        running.cancel()
        with contextlib.suppress(BaseException):
            await running
    assert not os.path.exists(work)

    # a shell session running a command: refused, naming it (its caller waits on this shell;
    # CRIU would carry it, so the backend asks the sandbox's agent, as the edge holds it)
    parent.agent = agent
    assert (await agent.exec(ExecRequest(cmd="cd /root && pwd", session="s1"))).stdout.strip() == "/root"
    busy = asyncio.create_task(agent.exec(ExecRequest(cmd="sleep 30", session="s1", timeout_s=60)))
    await asyncio.sleep(0.3)
    try:
        with pytest.raises(BranchUnsupported) as e:
            await rt.branch_image(parent, work)
        assert "shell session 's1' is running a command" in e.value.message, e.value.message
    finally:
        busy.cancel()
        with contextlib.suppress(BaseException):
            await busy
    assert not os.path.exists(work)
    assert not Cgroup(rt.cgroup_path(parent.id)).frozen()
    assert alive(parent.rec.init_pid)
    await host.release(parent)
    assert leftovers(host.node, parent.id) == []


async def test_without_criu_it_says_so(host: DebianHost, work: str, monkeypatch: pytest.MonkeyPatch) -> None:
    rt = _rt(host)
    parent = await host.create()
    monkeypatch.setenv("DSEC_CRIU", "/nonexistent/criu")
    with pytest.raises(BranchUnsupported, match="CRIU is not installed at /nonexistent/criu"):
        await rt.branch_image(parent, work)
    assert not os.path.exists(work)
    assert (await host.sh(parent, "echo alive")).strip() == "alive"
