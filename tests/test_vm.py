"""VM sandboxes on real QEMU: microVMs (-M microvm) and full VMs (q35), booted from
Debian's cloud kernel and dsec's initramfs with the EROFS layers as read-only virtio
disks. The accelerator is whatever the node's probe chose: on our machines KVM runs
only PVM guests, so these run under TCG (emulation), which is slow but complete.
Nothing is mocked."""

from __future__ import annotations

import asyncio
import glob
import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import zlib

import pytest
import websockets

import dsec
from tests.conftest import TOKEN, Platform, leftovers, qemu_pids, sandbox_dir, wait_for


def _accel(platform: Platform) -> str:
    with open(os.path.join(platform.data_dir, "vm", "accel.json")) as f:
        return str(json.load(f)["accel"])


def _png_size(png: bytes) -> tuple[int, int]:
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    w, h = struct.unpack(">II", png[16:24])
    return w, h


def _png_pixels(png: bytes) -> bytes:
    """The raw scanlines of our own (single IDAT) PNGs."""
    n = struct.unpack(">I", png[33:37])[0]
    assert png[37:41] == b"IDAT"
    return zlib.decompress(png[41:41 + n])


async def test_microvm_exec_files_sessions(platform: Platform, client: dsec.AsyncClient) -> None:
    vm = await client.run_microvm(dsec.MicroVMArgs(image="base/debian:12", vcpus=1, memory_mb=512,
                                                   env={"FOO": "bar"}))
    try:
        info = vm.info
        assert info.backend == "microvm" and info.vm is not None
        assert info.vm.accelerator == _accel(platform)  # what the probe decided, reported per sandbox
        assert info.vm.started_from == "template"
        r = await vm.run_shell("uname -r; hostname; echo $FOO; cat /proc/cpuinfo | grep -c ^processor")
        lines = r.stdout.split()
        assert r.exit_code == 0 and lines[0].endswith("cloud-amd64")  # the guest's own kernel, not the host's
        assert lines[1:] == [vm.sandbox_id, "bar", "1"]
        # the memory cap is the guest's RAM
        r = await vm.exec(["sh", "-c", "awk '/MemTotal/ {print $2}' /proc/meminfo"])
        assert 400_000 < int(r.stdout) <= 512 * 1024
        # sessions keep cwd and variables; exec gets stdin, exit codes and timeouts
        await vm.run_shell("cd /tmp && export X=42")
        r = await vm.run_shell("echo $PWD $X")
        assert r.stdout.strip() == "/tmp 42"
        r = await vm.exec("cat; exit 3", stdin="piped")
        assert (r.exit_code, r.stdout) == (3, "piped")
        r = await vm.exec("sleep 30", timeout=1)
        assert r.timed_out and r.exit_code == 137
        r = await vm.run_shell("sleep 30", timeout=1)
        assert r.timed_out
        assert (await vm.run_shell("echo alive")).stdout == "alive\n"
        # files
        await vm.write_file("/root/data/x.bin", b"\0\1\2" * 100_000)
        assert await vm.read_file("/root/data/x.bin") == b"\0\1\2" * 100_000
        st = await vm.stat("/root/data/x.bin")
        assert (st.type, st.size) == ("file", 300_000)
        assert [e.name for e in await vm.list_dir("/root/data")] == ["x.bin"]
        await vm.remove("/root/data", recursive=True)
        with pytest.raises(dsec.NotFound):
            await vm.read_file("/root/data/x.bin")
        with pytest.raises(dsec.InvalidRequest):
            await vm.read_file("/root")
        # streaming output arrives in pieces, in order
        chunks = [ev.data async for ev in vm.exec_stream("for i in 1 2 3; do echo $i; sleep 0.2; done")
                  if ev.type == "stdout"]
        assert "".join(c or "" for c in chunks) == "1\n2\n3\n"
        # the QEMU process is in the sandbox's cgroup, under its memory limit
        pids = qemu_pids(vm.sandbox_id)
        assert len(pids) == 1
        with open(f"/proc/{pids[0]}/cgroup") as f:
            assert vm.sandbox_id in f.read()
    finally:
        await vm.stop()
    assert leftovers(platform, vm.sandbox_id) == []


async def test_microvm_cold_boot_with_a_toolkit_layer(platform: Platform, client: dsec.AsyncClient,
                                                      tmp_path: str) -> None:
    src = os.path.join(str(tmp_path), "tk")
    os.makedirs(os.path.join(src, "opt", "tool"))
    with open(os.path.join(src, "opt", "tool", "run.sh"), "w") as f:
        f.write("echo tool-v1\n")
    await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "dsec.client.cli.main", "layer", "import-dir", src,
                                             "tk/vmtool:v1", "--data-dir", platform.data_dir],
                            check=True, capture_output=True)
    vm = await client.run_microvm(dsec.MicroVMArgs(image="base/debian:12", layers=["tk/vmtool:v1"],
                                                   template=False, disk_mb=256))
    try:
        assert vm.info.vm is not None and vm.info.vm.started_from == "boot"
        r = await vm.run_shell("sh /opt/tool/run.sh; echo changed > /opt/tool/run.sh; cat /opt/tool/run.sh; "
                               "df -m / | tail -1")
        assert r.stdout.startswith("tool-v1\nchanged\n")  # overlay: the toolkit below, writes on the upper disk
        # each layer is a read-only disk (metadata, and its data blob when it has one), the upper is writable
        r = await vm.run_shell("for b in /sys/block/vd*; do echo $(cat $b/serial)=$(cat $b/ro); done; "
                               "grep ' / ' /proc/mounts")
        disks = dict(line.split("=") for line in r.stdout.splitlines() if line.startswith("dsec-"))
        assert disks.pop("dsec-upper") == "0"
        assert {"dsec-l0m", "dsec-l1m"} <= set(disks) and set(disks.values()) == {"1"}
        assert "overlay / overlay" in r.stdout
    finally:
        await vm.stop()
    assert leftovers(platform, vm.sandbox_id) == []


async def test_pause_resume_keeps_processes_files_and_sessions(platform: Platform,
                                                               client: dsec.AsyncClient) -> None:
    vm = await client.run_microvm(dsec.MicroVMArgs(memory_mb=512))
    try:
        await vm.run_shell("cd /srv && export KEEP=kept && (sleep 1000 >/dev/null 2>&1 &) && echo $$ > /root/shell")
        await vm.write_file("/root/state", b"before pause")
        before = (await vm.exec("pgrep -x sleep")).stdout
        assert before.strip()
        info = await vm.pause()
        assert info.state == "paused" and info.vm is not None and info.vm.snapshot_bytes
        assert qemu_pids(vm.sandbox_id) == []  # QEMU ended: its memory is freed
        snap = os.path.join(sandbox_dir(platform, vm.sandbox_id), "snapshot.state")
        assert os.path.getsize(snap) == info.vm.snapshot_bytes
        # any request resumes transparently: same shell session, same processes and files
        r = await vm.run_shell("echo $PWD $KEEP $$")
        shell_pid = (await vm.read_file("/root/shell")).decode().strip()
        assert r.stdout.split() == ["/srv", "kept", shell_pid]
        assert (await vm.exec("pgrep -x sleep")).stdout == before
        assert await vm.read_file("/root/state") == b"before pause"
        info = await vm.refresh()
        assert info.state == "running" and info.vm is not None and info.vm.started_from == "snapshot"
        assert not os.path.exists(snap)
        # a restored VM pauses again, and resume() is explicit too
        await vm.pause()
        assert (await vm.resume()).state == "running"
        assert (await vm.run_shell("echo $KEEP")).stdout == "kept\n"
        events = [e.kind for e in await vm.events()]
        assert events.count("paused") == 2 and events.count("resumed") == 2
    finally:
        await vm.stop()
    assert leftovers(platform, vm.sandbox_id) == []


async def test_corrupt_snapshot_is_refused(platform: Platform, client: dsec.AsyncClient) -> None:
    vm = await client.run_microvm(dsec.MicroVMArgs(memory_mb=256))
    await vm.pause()
    snap = os.path.join(sandbox_dir(platform, vm.sandbox_id), "snapshot.state")
    with open(snap, "r+b") as f:
        f.seek(os.path.getsize(snap) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(dsec.SandboxError, match="corrupt"):
        await vm.run_shell("true")
    assert wait_for(lambda: leftovers(platform, vm.sandbox_id) == [], 15)
    info = await vm.refresh()
    assert info.state == "failed" and "corrupt" in (info.error or "")


async def test_qemu_death_marks_the_sandbox_failed(platform: Platform, client: dsec.AsyncClient) -> None:
    vm = await client.run_microvm(dsec.MicroVMArgs(memory_mb=256))
    (pid,) = qemu_pids(vm.sandbox_id)
    os.kill(pid, signal.SIGKILL)
    for _ in range(100):
        if (await vm.refresh()).state == "failed":
            break
        await asyncio.sleep(0.1)
    assert vm.info.state == "failed" and "channel lost" in (vm.info.error or "")
    assert wait_for(lambda: leftovers(platform, vm.sandbox_id) == [], 10)
    with pytest.raises(dsec.SandboxNotRunning):
        await vm.run_shell("true")


async def test_guest_poweroff_marks_the_sandbox_failed(platform: Platform, client: dsec.AsyncClient) -> None:
    vm = await client.run_microvm(dsec.MicroVMArgs(memory_mb=256))
    # root in the guest kills the agent's mux: the guest powers off, the command's caller is told
    with pytest.raises(dsec.SandboxNotRunning):
        await vm.exec("pkill -KILL dsec-vmux; sleep 10")
    for _ in range(100):
        if (await vm.refresh()).state == "failed":
            break
        await asyncio.sleep(0.1)
    assert vm.info.state == "failed"
    assert wait_for(lambda: leftovers(platform, vm.sandbox_id) == [], 10)


async def test_vm_http_and_tty(platform: Platform, client: dsec.AsyncClient) -> None:
    vm = await client.run_microvm(dsec.MicroVMArgs(memory_mb=512))
    try:
        await vm.write_file("/srv/www/index.html", b"<h1>vm</h1>")
        await vm.run_shell("cd /srv/www && (python3 -m http.server 8080 >/dev/null 2>&1 &)")
        for _ in range(100):
            resp = await vm.http(8080, "/")
            if resp.status_code == 200:
                break
            await asyncio.sleep(0.2)
        assert resp.status_code == 200 and resp.text == "<h1>vm</h1>"
        async with websockets.connect(vm.tty_url(100, 30),
                                      additional_headers={"Authorization": f"Bearer {TOKEN}"}) as ws:
            await ws.send(b"stty size; tty; echo tty-$((6*7))\n")
            buf = b""
            while b"tty-42" not in buf:
                buf += await asyncio.wait_for(ws.recv(), 20)  # type: ignore[operator]
            assert b"30 100" in buf and b"/dev/pts/" in buf
            await ws.send(json.dumps({"resize": [120, 40]}))
            await ws.send(b"stty size\n")
            while b"40 120" not in buf:
                buf += await asyncio.wait_for(ws.recv(), 20)  # type: ignore[operator]
            await ws.send(b"exit 5\n")
            code = None
            async for msg in ws:
                if isinstance(msg, str):
                    code = json.loads(msg)["exit"]
            assert code == 5
    finally:
        await vm.stop()


async def test_edge_restart_readopts_running_and_paused_vms_with_sessions(platform: Platform,
                                                            client: dsec.AsyncClient) -> None:
    running = await client.run_microvm(dsec.MicroVMArgs(memory_mb=256))
    paused = await client.run_microvm(dsec.MicroVMArgs(memory_mb=256))
    await running.write_file("/root/f", b"running")
    await running.exec("sleep 1000 >/dev/null 2>&1 &")
    await running.run_shell("cd /srv && export S=kept")
    shell = (await running.run_shell("echo $$")).stdout
    await paused.write_file("/root/f", b"paused")
    await paused.pause()
    platform.restart(crash=True)
    async with dsec.AsyncClient(url=platform.url, token=TOKEN) as c2:
        r = await c2.connect(running.sandbox_id)
        assert r.info.state == "running"
        assert await r.read_file("/root/f") == b"running"
        assert (await r.exec("pgrep -x sleep")).exit_code == 0
        # the shell session too: the guest held its channels for the next edge
        assert (await r.run_shell("echo $$ $PWD $S")).stdout.split() == [shell.strip(), "/srv", "kept"]
        p = await c2.connect(paused.sandbox_id)
        assert p.info.state == "paused"
        assert (await p.run_shell("cat /root/f")).stdout == "paused"
        for sb in (r, p):
            await sb.stop()
    for sid in (running.sandbox_id, paused.sandbox_id):
        assert leftovers(platform, sid) == []


async def test_full_vm_display_keys_and_click(platform: Platform, client: dsec.AsyncClient) -> None:
    vm = await client.run_vm(dsec.VMArgs(memory_mb=512, display=True))
    try:
        assert vm.info.backend == "vm" and vm.info.vm is not None and vm.info.vm.machine == "q35"
        png = await vm.screenshot()
        w, h = _png_size(png)
        assert w >= 320 and h >= 200
        # text on the VGA console shows in the next screenshot
        await vm.exec("printf '\\033[2J\\033[HDSEC SCREEN TEST %s\\n' $(seq 1 40) > /dev/tty1")
        after = await vm.screenshot()
        assert _png_pixels(after) != _png_pixels(png)
        # keys typed on the VM's keyboard reach its console
        await vm.exec("(head -n1 < /dev/tty1 > /root/typed) >/dev/null 2>&1 &")
        await asyncio.sleep(0.5)
        await vm.send_keys("h i shift-x ret")
        for _ in range(50):
            typed = (await vm.exec("cat /root/typed")).stdout
            if typed:
                break
            await asyncio.sleep(0.1)
        assert typed == "hiX\n"
        # a click arrives at the VM's tablet as a left-button press (evdev BTN_LEFT = 0x110)
        watcher = ("import glob, select, struct, sys\n"
                   "fs = [open(p, 'rb', buffering=0) for p in glob.glob('/dev/input/event*')]\n"
                   "while True:\n"
                   "    r, _, _ = select.select(fs, [], [], 30)\n"
                   "    if not r: sys.exit(1)\n"
                   "    for f in r:\n"
                   "        data = f.read(24 * 64)\n"
                   "        for i in range(0, len(data) - 23, 24):\n"
                   "            t, c, v = struct.unpack('HHi', data[i + 16:i + 24])\n"
                   "            if t == 1 and c == 0x110 and v == 1: print('click'); sys.exit(0)\n")
        await vm.write_file("/root/watch.py", watcher.encode())
        await vm.exec("(python3 /root/watch.py > /root/clicked 2>&1 &)")
        await asyncio.sleep(1.0)
        await vm.click(w // 2, h // 2)
        for _ in range(50):
            clicked = (await vm.exec("cat /root/clicked")).stdout
            if clicked:
                break
            await asyncio.sleep(0.1)
        assert clicked == "click\n"
        with pytest.raises(dsec.InvalidRequest, match="keys"):
            await vm.send_keys("ctrl-$$")
        with pytest.raises(dsec.InvalidRequest, match="outside"):
            await vm.click(w + 10, 5)
    finally:
        await vm.stop()
    assert leftovers(platform, vm.sandbox_id) == []


async def test_vm_bad_input(platform: Platform, client: dsec.AsyncClient) -> None:
    with pytest.raises(dsec.InvalidRequest, match="memory_mb"):
        await client._json("POST", "/v1/sandboxes", json={"args": {"backend": "microvm", "memory_mb": 16}})
    with pytest.raises(dsec.InvalidRequest, match="vcpus"):
        await client._json("POST", "/v1/sandboxes", json={"args": {"backend": "vm", "vcpus": 0}})
    with pytest.raises(dsec.InvalidRequest, match="backend"):
        await client._json("POST", "/v1/sandboxes", json={"args": {"backend": "firecracker"}})
    with pytest.raises(dsec.NotFound, match="unknown layer") as e:
        await client.run_microvm(dsec.MicroVMArgs(image="base/nope:1"))
    assert e.value.field == "image"
    vm = await client.run_microvm(dsec.MicroVMArgs(memory_mb=256))
    try:
        with pytest.raises(dsec.InvalidRequest, match="display"):
            await vm.screenshot()
        with pytest.raises(dsec.InvalidRequest, match="pack_diff"):
            await vm.pack_diff("ws/vm-diff:v1")
    finally:
        await vm.stop()


def test_node_info_reports_the_accelerator(platform: Platform) -> None:
    out = subprocess.run([sys.executable, "-m", "dsec.client.cli.main", "node", "info", "--json", "--url", platform.url,
                          "--token", TOKEN], check=True, capture_output=True, text=True).stdout
    (node,) = json.loads(out)
    assert node["vm"]["accelerator"] == _accel(platform)
    assert node["vm"]["agent_channel"] == "virtio-serial"
    assert "microvm" in node["backends"] and "vm" in node["backends"]
    if node["vm"]["accelerator"] == "tcg":
        assert "slower" in node["vm"]["note"]  # never silently pretending TCG is fast


def test_restart_kills_qemu_no_sandbox_owns(platform: Platform) -> None:
    """A QEMU left by a crash mid-create (no record owns it) is killed when the edge starts."""
    run_dirs = glob.glob(f"/run/dsec/{hashlib.sha1(os.path.abspath(platform.data_dir).encode()).hexdigest()[:8]}-*")
    assert len(run_dirs) == 1
    sock = os.path.join(run_dirs[0], "v", "edge0-stray0000001.q")
    stray = subprocess.Popen(["qemu-system-x86_64", "-M", "microvm", "-nodefaults", "-display", "none", "-S",
                              "-qmp", f"unix:{sock},server=on,wait=off"], start_new_session=True)
    try:
        assert wait_for(lambda: os.path.exists(sock), 10)
        platform.restart(crash=True)
        assert wait_for(lambda: stray.poll() is not None, 10)
    finally:
        stray.kill()
        stray.wait()
