"""What the container backend promises about isolation: an image with no Python works,
the agent is out of reach of root in the sandbox, kernel interfaces are masked, limits
are applied, and there is no network but loopback."""

from __future__ import annotations

import asyncio
import glob
import os

import pytest

import dsec
from dsec.node.host.cgroup import MEMORY_RESERVE_MB
from tests.conftest import Platform


async def test_busybox_image_has_no_python_and_still_works(busybox: dsec.AsyncSandbox) -> None:
    r = await busybox.exec("command -v python3 || echo none; ls /usr/lib | wc -l")
    assert r.stdout.splitlines()[0] == "none"
    await busybox.run_shell("cd /tmp; X=5")
    assert (await busybox.run_shell("echo $PWD $X")).stdout == "/tmp 5\n"


async def test_hostname_is_the_sandbox_id(busybox: dsec.AsyncSandbox) -> None:
    assert (await busybox.exec("hostname")).stdout.strip() == busybox.sandbox_id


async def test_agent_is_out_of_reach(debian: dsec.AsyncSandbox) -> None:
    # pid 1 is dsec-init: non-dumpable, so its exe, fds, memory and environment are closed
    for probe in ("head -c1 /proc/1/exe", "head -c1 /proc/1/mem", "head -c1 /proc/1/environ",
                  "head -c1 /proc/1/fd/4", "readlink /proc/1/fd/0", "ls /proc/1/root/", "ls /proc/1/cwd/"):
        r = await debian.exec(f"{probe} >/dev/null 2>&1 && echo OPEN || echo closed")
        assert r.stdout.strip() == "closed", probe
    r = await debian.exec("readlink /proc/1/exe; echo rc=$?")
    assert r.stdout.strip().endswith("rc=1")
    # it cannot be killed from inside, and the sandbox keeps working
    await debian.exec("kill -9 1; kill -TERM 1; true")
    assert (await debian.exec("echo alive")).stdout == "alive\n"
    # no socket of the agent anywhere in the sandbox's filesystem
    r = await debian.exec("find / -xdev -type s 2>/dev/null | wc -l")
    assert r.stdout.strip() == "0"
    # ptrace is refused outright
    r = await debian.exec(["python3", "-c", "import ctypes; print(ctypes.CDLL(None).ptrace(16, 1, 0, 0))"])
    assert r.stdout.strip() == "-1"


async def test_dangerous_kernel_interfaces_are_masked(debian: dsec.AsyncSandbox) -> None:
    for path in ("/proc/kpagecgroup", "/proc/kpageflags", "/proc/kcore", "/proc/sysrq-trigger",
                 "/proc/timer_list"):
        r = await debian.exec(f"head -c 16 {path} 2>/dev/null | wc -c")
        assert r.stdout.strip() == "0", path
    r = await debian.exec("echo 1 > /proc/sys/vm/drop_caches 2>&1; touch /sys/x 2>&1; true")
    assert "Read-only" in r.stdout
    r = await debian.exec("mount -t tmpfs none /mnt 2>&1; unshare -U true 2>&1; echo done")
    assert "permission denied" in r.stdout.lower() and r.stdout.endswith("done\n")
    r = await debian.exec("grep -c CapEff /proc/self/status; grep CapEff /proc/self/status")
    assert int(r.stdout.split()[-1], 16) & (1 << 21) == 0  # no CAP_SYS_ADMIN


async def test_only_loopback_network(debian: dsec.AsyncSandbox) -> None:
    r = await debian.exec("ip -o link | awk -F': ' '{print $2}'")
    assert r.stdout.split() == ["lo"]
    r = await debian.exec(["python3", "-c",
                           "import socket; s=socket.socket(); s.settimeout(2)\n"
                           "try: s.connect(('127.0.0.1', 7777)); print('reached')\n"
                           "except OSError as e: print('refused', e.errno)"])
    assert r.stdout.startswith("refused")


async def test_cgroup_limits_are_applied(platform: Platform, client: dsec.AsyncClient) -> None:
    sb = await client.run_container(dsec.ContainerArgs(image="base/busybox", memory_limit_mb=96,
                                                       cpu_cores_limit=0.5, pids_limit=64))
    try:
        # the workload's limits are on the sandbox's child cgroup w; dsec-init stays in the
        # parent, which holds a small reserve above them so the agent outlives its workload
        mem = glob.glob(f"/sys/fs/cgroup/memory/**/{sb.sandbox_id}/w/memory.limit_in_bytes", recursive=True) \
            or glob.glob(f"/sys/fs/cgroup/**/{sb.sandbox_id}/w/memory.max", recursive=True)
        assert mem and int(open(mem[0]).read()) == 96 * 1024 * 1024
        parent = os.path.dirname(os.path.dirname(mem[0])) + "/" + os.path.basename(mem[0])
        assert int(open(parent).read()) == (96 + MEMORY_RESERVE_MB) * 1024 * 1024
        pids = glob.glob(f"/sys/fs/cgroup/**/{sb.sandbox_id}/w/pids.max", recursive=True)
        assert pids and open(pids[0]).read().strip() == "64"
        cpu = glob.glob(f"/sys/fs/cgroup/cpu/**/{sb.sandbox_id}/w/cpu.cfs_quota_us", recursive=True)
        if cpu:
            assert int(open(cpu[0]).read()) == 50000
            # no quota on the parent: a kill must never wait for the next CPU period
            assert int(open(os.path.dirname(os.path.dirname(cpu[0])) + "/cpu.cfs_quota_us").read()) == -1
        # a fork bomb hits the pids limit, not the host, and the sandbox recovers
        r = await sb.exec("i=0; while [ $i -lt 200 ]; do (sleep 2 &) 2>/dev/null; i=$((i+1)); done; echo end",
                          timeout=30)
        assert r.stdout.endswith("end\n")
        running = int(open(pids[0].replace("pids.max", "pids.current")).read())
        assert running <= 64
        await asyncio.sleep(3)
        assert (await sb.exec("echo still-usable")).stdout == "still-usable\n"
    finally:
        await sb.stop()


async def test_session_channels_cannot_be_opened_or_stolen(debian: dsec.AsyncSandbox) -> None:
    """A command in a session must not reach the session's own plumbing: reading the
    shell's stdin would steal the next result marker (and its nonce), and writing its
    saved control fd would forge a result."""
    r = await debian.run_shell(
        'for f in /proc/$$/fd/*; do t=$(readlink "$f"); '
        'case "$t" in /dev/null|/dev/pts/*) continue;; esac; '
        '(exec 9<>"$f") 2>/dev/null && echo "OPEN $f $t"; done; echo checked')
    assert r.stdout.strip().splitlines()[-1] == "checked"
    assert "OPEN" not in r.stdout, r.stdout
    r = await debian.exec(["python3", "-c",
                           "import os, ctypes; pid = os.getppid(); fd = os.pidfd_open(pid)\n"
                           "libc = ctypes.CDLL(None, use_errno=True)\n"
                           "print(libc.syscall(438, fd, 0, 0))"])  # pidfd_getfd
    assert r.stdout.strip() == "-1"
    assert (await debian.run_shell("echo intact")).stdout == "intact\n"


async def test_exec_output_cannot_be_forged_by_another_process(debian: dsec.AsyncSandbox) -> None:
    # a process left behind waits for the next command and tries to append to its stdout
    await debian.exec(["sh", "-c", "nohup sh -c 'for i in $(seq 100); do for p in $(pgrep -x sleep); do "
                       "echo FORGED > /proc/$p/fd/1 && echo hit > /tmp/hit; done; sleep 0.05; done' "
                       ">/dev/null 2>&1 &"])
    r = await debian.exec(["sleep", "1"])
    assert r.stdout == "" and "FORGED" not in r.stdout
    assert (await debian.exec("cat /tmp/hit 2>/dev/null || echo none")).stdout == "none\n"


async def test_leftover_process_cannot_touch_a_later_command(debian: dsec.AsyncSandbox) -> None:
    """Each spawned command gets its own Landlock domain: a process left behind by one
    command cannot read (or patch) the memory or environment of a later one."""
    spy = ("import os, time\n"
           "for _ in range(100):\n"
           "    for p in os.listdir('/proc'):\n"
           "        if p.isdigit() and open(f'/proc/{p}/cmdline', 'rb').read().startswith(b'sleep'):\n"
           "            for f in ('mem', 'environ'):\n"
           "                try:\n"
           "                    open(f'/proc/{p}/{f}', 'rb').read(1)\n"
           "                    open('/tmp/spy', 'a').write(f + ' read\\n')\n"
           "                except OSError as e:\n"
           "                    open('/tmp/spy', 'a').write(f'{f} {e.errno}\\n')\n"
           "    time.sleep(0.05)\n")
    await debian.write_file("/opt/spy.py", spy)
    await debian.run_shell("python3 /opt/spy.py >/dev/null 2>&1 &")
    r = await debian.exec(["sleep", "1"], env={"SECRET": "hunter2"})
    assert r.exit_code == 0
    log = (await debian.exec("sort -u /tmp/spy")).stdout
    assert log and "read" not in log, log  # it saw the command, and every attempt was refused


async def test_tmpfs_mounts_are_size_bounded(client: dsec.AsyncClient) -> None:
    sb = await client.run_container(dsec.ContainerArgs(image="base/busybox", memory_limit_mb=64,
                                                       tmpfs={"/scratch": 4}))
    try:
        r = await sb.exec(["sh", "-c", "dd if=/dev/zero of=/scratch/x bs=1M count=8; ls -l /scratch/x"])
        assert "No space left" in r.stderr and r.stdout.split()[4] == str(4 << 20), r
    finally:
        await sb.stop()
    for bad in ({"/": 4}, {"/proc/x": 4}, {"rel": 4}, {"/a/../b": 4}):
        with pytest.raises(dsec.InvalidRequest) as e:
            await client.run_container(dsec.ContainerArgs.model_construct(image="base/busybox", tmpfs=bad))
        assert e.value.field and "tmpfs" in e.value.field
