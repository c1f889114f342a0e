"""The backend contract: the same tests against every :class:`~dsec.node.backends.api.SandboxRuntime`
(crun containers, QEMU microVMs, the hollow runtime), after containerd's snapshotter test
suite. Each test plays the edge's part itself (``Host`` below: records, agents, the release
of files), so what is tested is the boundary and nothing behind it: prepare, launch,
connect, pause, resume, kill, destroy, adopt after a restart, reap_strays, and the
questions the edge asks instead of reading backend state. Where a backend honestly
differs, ``EXPECT`` says so. Real crun, QEMU (under whatever accelerator the node's probe
chose: TCG here) and cgroups; nothing is mocked."""

from __future__ import annotations

import contextlib
import glob
import os
import secrets
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import pytest

from dsec.node.agent.aether import DEFAULT_PATH, Aether, AgentContext
from dsec.node.agent.native import ensure_init_binary
from dsec.node.backends.api import InitLink, Record, Sandbox, SandboxLost, SandboxRuntime
from dsec.node.backends.container.sandboxes import ContainerSandboxes
from dsec.node.backends.hollow.runtime import HollowSandboxes
from dsec.node.backends.vm.sandboxes import VMSandboxes
from dsec.node.host import linux
from dsec.node.host.cgroup import Cgroup
from dsec.node.host.prep import prepare_cgroups
from dsec.node.host.process import alive, wait_gone
from dsec.node.host.volume import SandboxVolume
from dsec.node.layers.store import LayerStore
from dsec.node.storage.node import NodeLayers
from dsec.shared.errors import InvalidRequest, NotFound
from dsec.shared.wire.models import (
    Backend,
    ContainerArgs,
    ExecRequest,
    MicroVMArgs,
    PauseInfo,
    SandboxInfo,
    SandboxState,
)
from tests.conftest import _seed_layers, qemu_pids

KINDS = ("container", "microvm", "hollow")


@dataclass(frozen=True)
class Expect:
    process: bool  # it runs a host process (its init, QEMU) in its cgroup
    output: bool  # a command's output comes back (a hollow init answers exit 0, nothing written)
    adopt: bool  # it outlives its edge and can be taken back
    host_pid: bool  # its root is a host process's /proc root
    writable_dir: bool  # its writes are a host directory
    quota: bool  # it has a quota group on the sandbox volume
    whole_snapshot: bool  # checkpointed whole (memory and disk), not as layers
    pause_ends_process: bool  # pause ends its process (a VM's QEMU) rather than freezing it
    files_outlive_resume: bool  # a hollow resume binds a fresh agent over new in-memory files
    lost: str  # the start of what its agent_lost says


EXPECT = {
    "container": Expect(process=True, output=True, adopt=True, host_pid=True, writable_dir=True, quota=True,
                        whole_snapshot=False, pause_ends_process=False, files_outlive_resume=True,
                        lost="sandbox init exited"),
    "microvm": Expect(process=True, output=True, adopt=True, host_pid=False, writable_dir=False, quota=False,
                      whole_snapshot=True, pause_ends_process=True, files_outlive_resume=True,
                      lost="VM agent channel lost"),
    "hollow": Expect(process=False, output=False, adopt=False, host_pid=False, writable_dir=False, quota=False,
                     whole_snapshot=False, pause_ends_process=False, files_outlive_resume=False,
                     lost="sandbox init exited"),
}


@dataclass
class Node:
    """What the runtimes of one node share: a data dir with the base layers and the VM
    guest, a per-boot run dir, a sandbox volume, the init binary."""

    data_dir: str
    run_dir: str
    cgroup_parent: str
    volume: SandboxVolume
    sandbox_root: str
    store: LayerStore
    init_binary: str


@pytest.fixture(scope="module")
async def node(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Node]:
    prepare_cgroups()
    data = str(tmp_path_factory.mktemp("contract"))
    _seed_layers(data)
    tag = secrets.token_hex(3)
    root = os.path.join(data, "edges", "ct")
    os.makedirs(root)
    volume = SandboxVolume(root, 2)
    volume.setup()
    assert volume.available, volume.status
    sandbox_root = os.path.join(volume.mnt, "sandboxes")
    os.makedirs(sandbox_root)
    n = Node(data, f"/run/dsec/ct{tag}", f"dsec-ct{tag}", volume, sandbox_root,
             LayerStore(os.path.join(data, "layers")), ensure_init_binary(os.path.join(data, "bin", "dsec-init")))
    yield n
    # whatever a failed test left: reaped as a restarted edge would (no record owns it)
    for kind in ("container", "microvm"):
        await runtime(kind, n).reap_strays(set())
    for mp in linux.mounted_under(n.sandbox_root) + linux.mounted_under(os.path.join(data, "layers", "mnt")):
        linux.umount(mp, detach=True)
    for top in glob.glob(f"/sys/fs/cgroup/*/{n.cgroup_parent}"):
        for d, _, _ in os.walk(top, topdown=False):
            if d != top:
                with contextlib.suppress(OSError):
                    os.rmdir(d)
    ContainerSandboxes(NodeLayers(n.store, data, n.run_dir, "eager"), volume, n.run_dir, n.cgroup_parent,
                       n.init_binary).close(sandboxes_left=False)
    volume.close()
    shutil.rmtree(n.run_dir, ignore_errors=True)
    assert glob.glob(f"/sys/fs/cgroup/*/{n.cgroup_parent}") == [], "cgroups left"


def runtime(kind: str, node: Node) -> SandboxRuntime:
    """A backend as an edge builds it (a new one: what an edge restart makes)."""
    layers = NodeLayers(node.store, node.data_dir, node.run_dir, "eager")
    if kind == "container":
        return ContainerSandboxes(layers, node.volume, node.run_dir, node.cgroup_parent, node.init_binary)
    if kind == "microvm":
        return VMSandboxes(layers, node.data_dir, node.run_dir, node.cgroup_parent)
    return HollowSandboxes(f"/sys/fs/cgroup/{node.cgroup_parent}-hollow")


class Host:
    """The edge's part, as small as it can be: it drives a create (prepare, launch,
    record, connect, bind), binds agents, and releases what the edge releases."""

    def __init__(self, kind: str, node: Node) -> None:
        self.kind, self.node = kind, node
        self.rt = runtime(kind, node)
        self.made: dict[str, Sandbox] = {}
        self.agents: dict[str, Aether] = {}

    def args(self) -> ContainerArgs | MicroVMArgs:
        if self.kind == "microvm":
            return MicroVMArgs(image="base/debian:12", vcpus=1, memory_mb=512)
        return ContainerArgs(image="base/busybox:latest", memory_limit_mb=256)

    async def create(self) -> Sandbox:
        args = self.args()
        sid = f"ct-{secrets.token_hex(6)}"
        digests = self.node.store.get(args.image).all_blobs
        now = time.time()
        info = SandboxInfo(sandbox_id=sid, edge="ct", backend=Backend(args.backend), state=SandboxState.creating,
                           image=args.image, layers=[], created_at=now, last_active_at=now,
                           memory_limit_mb=args.memory_limit_mb, cpu_cores_limit=args.cpu_cores_limit)
        sb = Sandbox(Record(info, args, 0, digests), os.path.join(self.node.sandbox_root, sid))
        self.made[sid] = sb
        events = await self.rt.prepare(sb, digests)
        assert all(isinstance(k, str) and isinstance(m, str) for k, m in events)
        launched = await self.rt.launch(sb, digests)
        assert (launched.init_pid > 0) == EXPECT[self.kind].process
        assert (launched.vm is not None) == (self.kind == "microvm")
        sb.rec.init_pid = launched.init_pid
        self.bind(sb, await self.rt.connect(sb))
        info.state = SandboxState.running
        return sb

    def bind(self, sb: Sandbox, link: InitLink) -> None:
        env = {"PATH": DEFAULT_PATH, "HOME": "/root"}
        self.agents[sb.id] = Aether(AgentContext(sb.id, sb.rec.init_pid, env, "/"), link.init, link.files)

    async def run(self, sb: Sandbox, cmd: str) -> str:
        r = await self.agents[sb.id].exec(ExecRequest(cmd=cmd, timeout_s=60))
        assert r.exit_code == 0, r
        return r.stdout

    async def pause(self, sb: Sandbox) -> None:
        await self.rt.pause(sb)
        sb.rec.info.state = SandboxState.paused
        sb.rec.info.pause = PauseInfo(memory_before_bytes=0, memory_after_bytes=0, pause_s=0.0)

    async def resume(self, sb: Sandbox) -> None:
        msg, link = await self.rt.resume(sb)
        assert msg
        if link is not None:
            self.bind(sb, link)
        sb.rec.info.state = SandboxState.running

    async def release(self, sb: Sandbox) -> None:
        """A teardown as the edge orders it: kill, the agent, the runtime, then mounts and files."""
        await self.rt.kill(sb)
        if (agent := self.agents.pop(sb.id, None)) is not None:
            await agent.close()
        await self.rt.destroy(sb)
        linux.unmount_all(sb.dir)
        if os.path.lexists(sb.dir):
            self.node.volume.remove(sb.dir)
        self.made.pop(sb.id, None)

    async def close(self) -> None:
        for sb in list(self.made.values()):
            await self.release(sb)


@pytest.fixture(params=KINDS)
async def host(request: pytest.FixtureRequest, node: Node) -> AsyncIterator[Host]:
    h = Host(request.param, node)
    yield h
    await h.close()


def mounts_of(sid: str) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if sid in line]


def leftovers(node: Node, sid: str) -> list[str]:
    """Everything of ``sid`` still on this host: mounts, cgroups, live processes in them,
    QEMUs, crun state, sockets, files."""
    found = [f"mount {mp}" for mp in mounts_of(sid)]
    found += [f"cgroup {p}" for p in glob.glob(f"/sys/fs/cgroup/**/{sid}", recursive=True)]
    for cg in glob.glob("/proc/[0-9]*/cgroup"):
        try:
            with open(cg) as f:
                if sid in f.read() and alive(int(cg.split("/")[2])):
                    found.append(f"process {cg.split('/')[2]}")
        except OSError:
            pass
    found += [f"qemu {pid}" for pid in qemu_pids(sid)]
    found += [f"run {p}" for p in glob.glob(f"{node.run_dir}/**/{sid}*", recursive=True)]
    found += [f"file {p}" for p in glob.glob(f"{node.sandbox_root}/{sid}")]
    return found


# ---- the contract ---------------------------------------------------------------------
async def test_launch_answers_and_its_cgroup_holds_it(host: Host) -> None:
    want = EXPECT[host.kind]
    sb = await host.create()
    out = await host.run(sb, "echo contract; echo $HOME")
    assert out == ("contract\n/root\n" if want.output else "")
    cg = Cgroup(host.rt.cgroup_path(sb.id))
    assert sb.id in host.rt.cgroup_path(sb.id)
    if want.process:
        assert cg.hierarchies(), "no cgroup made"
        assert sb.rec.init_pid in cg.procs()  # its init (or QEMU) is charged to it
    else:
        assert cg.hierarchies() == [] and not os.path.exists(sb.dir)  # hollow: nothing made
    await host.release(sb)
    assert leftovers(host.node, sb.id) == []


async def test_pause_and_resume_keep_its_files(host: Host) -> None:
    want = EXPECT[host.kind]
    sb = await host.create()
    agent = host.agents[sb.id]
    await agent.files.write_file("/root/kept.txt", b"before the pause")
    await host.pause(sb)
    if want.pause_ends_process:
        assert not alive(sb.rec.init_pid) and qemu_pids(sb.id) == []
    elif want.process:
        assert Cgroup(host.rt.cgroup_path(sb.id)).frozen()
    await host.resume(sb)
    if want.process:
        assert alive(sb.rec.init_pid) or qemu_pids(sb.id)
        assert not Cgroup(host.rt.cgroup_path(sb.id)).frozen()
    if want.files_outlive_resume:
        assert await host.agents[sb.id].files.read_file("/root/kept.txt", 1 << 20) == b"before the pause"
    else:
        with pytest.raises(NotFound):
            await host.agents[sb.id].files.read_file("/root/kept.txt", 1 << 20)
    assert await host.run(sb, "echo again") == ("again\n" if want.output else "")


async def test_a_double_kill_then_destroy_leaves_nothing(host: Host) -> None:
    sb = await host.create()
    cg = Cgroup(host.rt.cgroup_path(sb.id))
    if EXPECT[host.kind].process:
        await host.run(sb, "sleep 300 >/dev/null 2>&1 &")  # a workload that would outlive a polite stop
        assert [p for p in cg.procs() if alive(p)]
    assert bool(mounts_of(sb.id)) == EXPECT[host.kind].writable_dir  # a container's root is mounted on the host
    await host.rt.kill(sb)
    await host.rt.kill(sb)  # a teardown retried after a timeout kills again: no error
    assert [p for p in cg.procs() if alive(p)] == [] and not alive(sb.rec.init_pid)
    await host.release(sb)
    assert leftovers(host.node, sb.id) == []


async def test_adopt_a_running_and_a_paused_sandbox_after_a_restart(host: Host) -> None:
    want = EXPECT[host.kind]
    running, paused = await host.create(), await host.create()
    await host.agents[paused.id].files.write_file("/root/p.txt", b"paused")
    await host.pause(paused)
    # the edge goes away: its agents let go (sessions stay in the sandboxes), its
    # runtime objects are dropped; a new edge has only the records and the node
    for sid in (running.id, paused.id):
        host.agents.pop(sid).detach()
        host.rt.detach(host.made[sid])
    host.rt = runtime(host.kind, host.node)
    known = await host.rt.known()
    again = {sid: Sandbox(replace(sb.rec), sb.dir) for sid, sb in host.made.items()}
    host.made.update(again)
    if not want.adopt:
        assert known == set()
        for sb in again.values():
            with pytest.raises(SandboxLost):
                await host.rt.adopt(sb, sb.id in known)
        host.made.clear()  # a hollow sandbox did not outlive its edge: nothing to release
        return
    if host.kind == "container":
        assert {running.id, paused.id} <= known
    a = await host.rt.adopt(again[running.id], running.id in known)
    assert a.running and a.link is not None
    host.bind(again[running.id], a.link)
    assert await host.run(again[running.id], "echo adopted") == "adopted\n"
    p = await host.rt.adopt(again[paused.id], paused.id in known)
    assert not p.running  # it stays paused until asked
    if want.pause_ends_process:
        assert qemu_pids(paused.id) == []
    else:
        assert Cgroup(host.rt.cgroup_path(paused.id)).frozen()
    await host.resume(again[paused.id])
    assert paused.id in host.agents  # its agent is bound on resume
    assert await host.agents[paused.id].files.read_file("/root/p.txt", 100) == b"paused"
    assert await host.run(again[paused.id], "echo resumed") == "resumed\n"


async def test_reap_strays_spares_what_records_own(host: Host) -> None:
    owned, stray = await host.create(), await host.create()
    host.rt = runtime(host.kind, host.node)  # a restarted edge, whose records name only ``owned``
    reaped = await host.rt.reap_strays({owned.id})
    if EXPECT[host.kind].process:
        assert reaped == [stray.id]
        await wait_gone(stray.rec.init_pid)
        assert not alive(stray.rec.init_pid)
        assert qemu_pids(stray.id) == [] and Cgroup(host.rt.cgroup_path(stray.id)).hierarchies() == []
        assert alive(owned.rec.init_pid)
    else:
        assert reaped == []
    assert await host.run(owned, "echo spared") == ("spared\n" if EXPECT[host.kind].output else "")


async def test_the_questions_answer_consistently(host: Host) -> None:
    want, rt = EXPECT[host.kind], host.rt
    sb = await host.create()
    pid = rt.host_pid(sb)
    assert (pid is not None) == want.host_pid
    upper = rt.writable_dir(sb)
    assert (upper is not None) == want.writable_dir
    await host.agents[sb.id].files.write_file("/root/w.bin", b"x" * 65536)
    if pid is not None:
        assert pid == sb.rec.init_pid
        with open(f"/proc/{pid}/root/root/w.bin", "rb") as f:  # its root is that process's
            assert f.read() == b"x" * 65536
    if upper is not None:
        with open(os.path.join(upper, "root", "w.bin"), "rb") as f:
            assert f.read() == b"x" * 65536  # its writes are there
    disk = rt.disk_path(sb)
    assert os.path.exists(disk) == want.process
    qgroup = rt.disk_quota(sb)
    assert (qgroup is not None) == want.quota
    if qgroup is not None:
        assert qgroup == host.node.volume.subvolume_id(sb.dir)
    files = rt.snapshot_files(sb)
    assert (files is not None) == want.whole_snapshot
    if files is not None:
        assert set(files) == {"state", "meta", "disk"} and files["disk"] == disk
        await host.pause(sb)
        assert all(os.path.getsize(p) > 0 for p in files.values())  # a pause leaves them there
        await host.resume(sb)
    assert rt.display(sb) is None  # none of these has a screen (a full VM with display=True has)
    assert rt.agent_lost(sb).startswith(want.lost)
    # the same answers after a restart, from what the node holds
    if want.adopt:
        host.agents.pop(sb.id).detach()
        rt.detach(sb)
        host.rt = rt2 = runtime(host.kind, host.node)
        sb2 = host.made[sb.id] = Sandbox(replace(sb.rec), sb.dir)
        adopted = await rt2.adopt(sb2, sb.id in await rt2.known())
        assert adopted.link is not None
        host.bind(sb2, adopted.link)
        answers: list[Any] = [rt2.host_pid(sb2), rt2.writable_dir(sb2), rt2.disk_path(sb2), rt2.disk_quota(sb2),
                              rt2.snapshot_files(sb2)]
        assert answers == [pid, upper, disk, qgroup, files]


async def test_prepare_refuses_what_it_cannot_do(node: Node) -> None:
    """Bad input is refused naming the field, before anything is made."""
    h = Host("container", node)
    args = ContainerArgs(image="base/busybox:latest", record_access=True)  # needs a store read on demand
    sb = Sandbox(Record(SandboxInfo(sandbox_id="ct-badbadbadbad", edge="ct", backend=Backend.container,
                                    state=SandboxState.creating, image=args.image, layers=[], created_at=0,
                                    last_active_at=0, memory_limit_mb=1, cpu_cores_limit=1), args, 0, []),
                 os.path.join(node.sandbox_root, "ct-badbadbadbad"))
    with pytest.raises(InvalidRequest) as e:
        await h.rt.prepare(sb, [])
    assert e.value.field == "record_access"
    assert not os.path.exists(sb.dir)
