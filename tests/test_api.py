"""The SDK surface end to end against a real embedded platform: exec, sessions,
streaming, files, HTTP, TTY, reconnect from another process, and bad input."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys

import httpx
import pytest
import websockets
import websockets.exceptions

import dsec
from tests.conftest import TOKEN, Platform


async def test_issue_example(client: dsec.AsyncClient) -> None:
    sb = await client.run_container(dsec.ContainerArgs(
        image="base/debian:12", memory_limit_mb=512, cpu_cores_limit=1, ttl_running_stop=300), timeout=120)
    try:
        await sb.run_shell("cd /tmp && export X=1")
        r = await sb.run_shell("pwd; echo $X")
        assert r.exit_code == 0 and r.stdout == "/tmp\n1\n"
        await sb.write_file("/root/a.bin", b"\x00" * 1024)
        assert await sb.read_file("/root/a.bin") == b"\x00" * 1024
    finally:
        info = await sb.stop()
    assert info.state == dsec.SandboxState.stopped


def test_sync_client_and_connect_from_another_process(platform: Platform) -> None:
    with dsec.Client(url=platform.url, token=TOKEN) as c:
        sb = c.run_container(dsec.ContainerArgs(image="base/busybox", memory_limit_mb=64))
        try:
            sb.run_shell("echo from-parent > /root/mark")
            code = (
                "import dsec, sys\n"
                f"c = dsec.Client(url={platform.url!r}, token={TOKEN!r})\n"
                f"sb = c.connect({sb.sandbox_id!r})\n"
                "print(sb.run_shell('cat /root/mark').stdout, end='')\n"
                "c.close()\n")
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
            assert out.stdout == "from-parent\n", out.stderr
            # never closed: closed at exit, without aiohttp's "Unclosed client session" warnings
            out = subprocess.run([sys.executable, "-W", "default", "-c", code.replace("c.close()\n", "")],
                                 capture_output=True, text=True, timeout=60)
            assert out.stdout == "from-parent\n" and "nclosed" not in out.stderr, out.stderr
        finally:
            sb.stop()


async def test_exec_argv_stdin_env_cwd(debian: dsec.AsyncSandbox) -> None:
    r = await debian.exec(["python3", "-c", "import sys, os; print(sys.stdin.read().upper(), os.getcwd(), "
                           "os.environ['FOO'])"], stdin="hello", env={"FOO": "bar"}, cwd="/etc")
    assert (r.exit_code, r.stdout) == (0, "HELLO /etc bar\n")
    r = await debian.exec("echo out; echo err >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr) == (3, "out\n", "err\n")


async def test_missing_program_exits_127_with_a_message(debian: dsec.AsyncSandbox) -> None:
    r = await debian.exec(["/no/such/binary"])
    assert r.exit_code == 127 and "/no/such/binary" in r.stderr and "No such file" in r.stderr
    r = await debian.exec(["/etc/passwd"])
    assert r.exit_code == 126 and "Permission denied" in r.stderr
    r = await debian.exec(["true"], cwd="/nonexistent")
    assert r.exit_code == 127 and "working directory" in r.stderr


async def test_sessions_are_independent_and_keep_background_jobs(debian: dsec.AsyncSandbox) -> None:
    await debian.run_shell("cd /etc && export A=1", session="a")
    await debian.run_shell("cd /var && export A=2", session="b")
    ra, rb = await asyncio.gather(debian.run_shell("echo $PWD $A", session="a"),
                                  debian.run_shell("echo $PWD $A", session="b"))
    assert (ra.stdout, rb.stdout) == ("/etc 1\n", "/var 2\n")
    await debian.run_shell("sleep 300 & echo $! > /tmp/bg.pid", session="a")
    r = await debian.run_shell("kill -0 $(cat /tmp/bg.pid) && jobs | wc -l", session="a")
    assert r.exit_code == 0 and r.stdout.strip() == "1"


async def test_timeout_kills_the_command_tree_and_keeps_the_session(debian: dsec.AsyncSandbox) -> None:
    await debian.run_shell("cd /tmp && export KEEP=yes")
    r = await debian.run_shell("sh -c 'sleep 1000 & sleep 1000; echo never'", timeout=0.5)
    assert r.timed_out and "never" not in r.stdout
    r = await debian.run_shell("echo $PWD $KEEP; pgrep -c sleep || true")
    assert r.stdout.split() == ["/tmp", "yes", "0"]
    # a busy loop in the shell itself: the session is restarted, cwd kept
    r = await debian.run_shell("while :; do :; done", timeout=0.5)
    assert r.timed_out
    r = await debian.run_shell("pwd")
    assert r.stdout == "/tmp\n"
    r = await debian.exec("sleep 1000", timeout=0.3)
    assert r.timed_out and r.exit_code == 137


async def test_output_capture_is_bounded(debian: dsec.AsyncSandbox) -> None:
    r = await debian.exec("yes | head -c 5000000; echo done >&2", max_output_bytes=1000)
    assert r.stdout_truncated and len(r.stdout) == 1000 and r.stderr == "done\n"
    r = await debian.run_shell("head -c 3000 /dev/zero | tr '\\0' x", session="big")
    assert len(r.stdout) == 3000 and not r.stdout_truncated


async def test_streaming_output(debian: dsec.AsyncSandbox) -> None:
    events = [ev async for ev in debian.exec_stream("for i in 1 2 3; do echo $i; sleep 0.2; done")]
    chunks = [e.data for e in events if e.type == "stdout"]
    assert len(chunks) >= 2 and "".join(c or "" for c in chunks) == "1\n2\n3\n"
    assert events[-1].type == "result" and events[-1].result and events[-1].result.exit_code == 0


async def test_files(busybox: dsec.AsyncSandbox) -> None:
    await busybox.write_file("/root/d/e/f.txt", "hi", mode=0o600)
    st = await busybox.stat("/root/d/e/f.txt")
    assert (st.type, st.size, st.mode) == ("file", 2, 0o600)
    names = [e.name for e in await busybox.list_dir("/root/d/e")]
    assert names == ["f.txt"]
    assert (await busybox.exec("cat /root/d/e/f.txt")).stdout == "hi"
    await busybox.remove("/root/d", recursive=True)
    with pytest.raises(dsec.NotFound):
        await busybox.read_file("/root/d/e/f.txt")


async def test_big_file_round_trip(busybox: dsec.AsyncSandbox) -> None:
    data = os.urandom(64 << 20)
    await busybox.write_file("/root/big.bin", data)
    assert (await busybox.exec("md5sum /root/big.bin")).stdout.split()[0] == hashlib.md5(data).hexdigest()
    assert await busybox.read_file("/root/big.bin") == data


async def test_file_api_does_not_follow_symlinks_out_of_the_sandbox(busybox: dsec.AsyncSandbox) -> None:
    host_secret = "/etc/hostname"
    await busybox.exec(f"ln -s {host_secret} /root/evil && ln -s ../../../../../../etc/passwd /root/evil2 "
                       "&& ln -s / /root/rootlink")
    inside = (await busybox.exec("cat /etc/passwd")).stdout.encode()
    assert await busybox.read_file("/root/evil2") == inside
    with pytest.raises(dsec.NotFound):  # /etc/hostname does not exist in the busybox image
        await busybox.read_file("/root/evil")
    await busybox.write_file("/root/rootlink/tmp/planted", "x")
    assert not os.path.exists("/tmp/planted")
    assert (await busybox.exec("cat /tmp/planted")).stdout == "x"


async def test_http_to_a_port_inside(debian: dsec.AsyncSandbox) -> None:
    await debian.write_file("/srv/www/index.html", "<h1>dsec</h1>")
    await debian.run_shell("cd /srv/www && python3 -m http.server 8080 >/dev/null 2>&1 &", session="srv")
    for _ in range(50):
        resp = await debian.http(8080, "/index.html")
        if resp.status_code == 200:
            break
        await asyncio.sleep(0.1)
    assert resp.status_code == 200 and resp.text == "<h1>dsec</h1>"
    resp = await debian.http(8081, "/")
    assert resp.status_code == 500 and "port 8081" in resp.json()["message"]


async def test_tty(platform: Platform, busybox: dsec.AsyncSandbox) -> None:
    url = busybox.tty_url(100, 30)
    async with websockets.connect(url, additional_headers={"Authorization": f"Bearer {TOKEN}"}) as ws:
        await ws.send(b"stty size; tty; echo tty-$((6*7))\n")
        buf = b""
        while b"tty-42" not in buf:
            buf += await asyncio.wait_for(ws.recv(), 10)  # type: ignore[operator]
        assert b"30 100" in buf
        await ws.send(b"exit 5\n")
        code = None
        async for msg in ws:
            if isinstance(msg, str):
                code = json.loads(msg)["exit"]
        assert code == 5
    async with websockets.connect(url, additional_headers={"Authorization": "Bearer wrong"}) as ws:
        with pytest.raises(websockets.exceptions.ConnectionClosed) as e:
            await ws.recv()
        assert e.value.rcvd is not None and e.value.rcvd.code == 4401


async def test_list_filters_by_job_and_label(client: dsec.AsyncClient) -> None:
    a = await client.run_container(dsec.ContainerArgs(image="base/busybox", job="job-a", labels={"k": "1"}))
    b = await client.run_container(dsec.ContainerArgs(image="base/busybox", job="job-b", labels={"k": "2"}))
    try:
        assert [i.sandbox_id for i in await client.list(job="job-a")] == [a.sandbox_id]
        assert [i.sandbox_id for i in await client.list(labels={"k": "2"})] == [b.sandbox_id]
        assert a.sandbox_id.startswith("edge0-")
        stopped = await client.stop_many(job="job-a")
        assert [i.sandbox_id for i in stopped] == [a.sandbox_id] and stopped[0].state == dsec.SandboxState.stopped
        assert (await b.refresh()).state == dsec.SandboxState.running
        with pytest.raises(dsec.InvalidRequest):
            await client.stop_many()
    finally:
        await a.stop()
        await b.stop()


# ---- bad input -------------------------------------------------------------------

def _post(platform: Platform, path: str, body: object, token: str = TOKEN) -> httpx.Response:
    return httpx.post(platform.url + path, json=body, headers={"Authorization": f"Bearer {token}"}, timeout=30)


@pytest.mark.parametrize("args, field", [
    ({"image": "base/nope:1"}, "image"),
    ({"image": "not a ref"}, "image"),
    ({"memory_limit_mb": -5}, "memory_limit_mb"),
    ({"cpu_cores_limit": 0}, "cpu_cores_limit"),
    ({"layers": ["base/debian:12"]}, "layers[0]"),
    ({"bogus": 1}, "bogus"),
    ({"memory_limit_mb": 1024 * 1024}, None),
])
def test_create_rejects_bad_args_naming_the_field(platform: Platform, args: dict[str, object],
                                                  field: str | None) -> None:
    r = _post(platform, "/v1/sandboxes", {"args": args})
    assert 400 <= r.status_code < 500, r.text
    body = r.json()
    assert body["message"]
    if field is None:
        assert r.status_code == 429 and body["error"] == "admission_rejected"
    else:
        assert body["field"] == field, body


def test_auth(platform: Platform) -> None:
    assert httpx.get(platform.url + "/v1/sandboxes").status_code == 401
    r = httpx.get(platform.url + "/v1/sandboxes", headers={"Authorization": "Basic abc"})
    assert r.status_code == 401 and r.json()["field"] == "authorization"
    r = httpx.get(platform.url + "/v1/sandboxes", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401
    with pytest.raises(dsec.Unauthorized):
        with dsec.Client(url=platform.url, token="nope") as c:
            c.list()


def test_unknown_and_malformed_ids(platform: Platform) -> None:
    h = {"Authorization": f"Bearer {TOKEN}"}
    r = httpx.get(platform.url + "/v1/sandboxes/edge0-aaaaaaaaaaaa", headers=h)
    assert r.status_code == 404 and r.json()["field"] == "sandbox_id"
    r = httpx.get(platform.url + "/v1/sandboxes/zz9-aaaaaaaaaaaa", headers=h)
    assert r.status_code == 404
    r = httpx.get(platform.url + "/v1/sandboxes/..%2Fetc", headers=h)
    assert r.status_code in (400, 404)
    r = _post(platform, "/v1/sandboxes/bad id/exec", {"cmd": "true"})
    assert r.status_code == 400 and r.json()["field"] == "sandbox_id"


async def test_bad_exec_and_file_requests(platform: Platform, busybox: dsec.AsyncSandbox) -> None:
    base = f"/v1/sandboxes/{busybox.sandbox_id}"
    r = _post(platform, base + "/exec", {"cmd": "true", "argv": ["true"]})
    assert r.status_code == 400
    r = _post(platform, base + "/exec", {"cmd": "true", "timeout_s": -1})
    assert r.status_code == 400 and r.json()["field"] == "timeout_s"
    r = _post(platform, base + "/exec", {"cmd": "true", "session": "../x"})
    assert r.status_code == 400 and r.json()["field"] == "session"
    with pytest.raises(dsec.InvalidRequest):
        await busybox.read_file("relative/path")
    big = b"\0" * (257 * 1024 * 1024)
    with pytest.raises(dsec.PayloadTooLarge):
        await busybox.write_file("/root/big", big)
    del big
    assert (await busybox.exec("ls /root/big 2>&1; echo ok")).stdout.endswith("ok\n")


async def test_commands_on_a_stopped_sandbox_get_409(client: dsec.AsyncClient) -> None:
    sb = await client.run_container(dsec.ContainerArgs(image="base/busybox"))
    await sb.stop()
    with pytest.raises(dsec.SandboxNotRunning, match="stopped"):
        await sb.exec("true")
    with pytest.raises(dsec.SandboxNotRunning):
        await sb.write_file("/x", "y")
    assert (await sb.stop()).state == dsec.SandboxState.stopped  # idempotent


def test_openapi_document(platform: Platform) -> None:
    spec = httpx.get(platform.url + "/openapi.json").json()
    assert "/v1/sandboxes" in spec["paths"] and "/v1/sandboxes/{sandbox_id}/exec" in spec["paths"]


async def test_dropped_stream_stops_its_command(debian: dsec.AsyncSandbox) -> None:
    agen = debian.exec_stream("echo started; sleep 1000; echo never")
    async for ev in agen:
        assert ev.type == "stdout" and ev.data == "started\n"
        break
    await agen.aclose()  # the client goes away mid-command
    for _ in range(50):
        if (await debian.exec("pgrep -c sleep || true")).stdout.strip() == "0":
            break
        await asyncio.sleep(0.1)
    assert (await debian.exec("pgrep -c sleep || true")).stdout.strip() == "0"


async def test_stop_during_a_command_answers_409(client: dsec.AsyncClient) -> None:
    sb = await client.run_container(dsec.ContainerArgs(image="base/busybox"))
    running = asyncio.create_task(sb.exec("sleep 1000"))
    await asyncio.sleep(0.3)
    await sb.stop()
    with pytest.raises(dsec.SandboxNotRunning):
        await running


async def test_hostile_file_types_do_not_hang_the_edge(busybox: dsec.AsyncSandbox) -> None:
    await busybox.exec("mkfifo /root/pipe && mkdir /root/dir")
    for path in ("/root/pipe", "/root/dir", "/dev/zero"):
        with pytest.raises(dsec.InvalidRequest):
            await asyncio.wait_for(busybox.read_file(path), 10)
    with pytest.raises(dsec.InvalidRequest):
        await asyncio.wait_for(busybox.write_file("/root/pipe", "x"), 10)
    assert (await busybox.exec("echo fine")).stdout == "fine\n"


def test_nul_bytes_are_refused(platform: Platform, busybox: dsec.AsyncSandbox) -> None:
    base = f"/v1/sandboxes/{busybox.sandbox_id}/exec"
    for body, field in (({"argv": ["echo", "a\u0000b"]}, "argv"), ({"cmd": "echo a\u0000b"}, "cmd"),
                        ({"cmd": "true", "env": {"X": "a\u0000"}}, "env")):
        r = _post(platform, base, body)
        assert r.status_code == 400 and r.json()["field"] == field, r.text


async def test_prometheus_metrics(platform: Platform, debian: dsec.AsyncSandbox) -> None:
    # A resident process holds 30 MiB while we scrape: memory charged only transiently could be gone by then.
    await debian.run_shell("python3 -c 'x = bytearray(30 << 20); print(1, flush=True); import time; time.sleep(100)'"
                           " > /tmp/held & sleep 100 &")
    for _ in range(100):
        if (await debian.exec(["cat", "/tmp/held"])).stdout == "1\n":
            break
        await asyncio.sleep(0.1)
    h = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=platform.url) as hc:
        text = (await hc.get("/metrics", headers=h)).text
        assert (await hc.get("/metrics")).status_code == 401

    def value(name: str) -> float:
        for line in text.splitlines():
            if line.startswith(name + "{") and f'sandbox="{debian.sandbox_id}"' in line:
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} for {debian.sandbox_id} missing")

    assert value("dsec_sandbox_memory_bytes") > 30 * 1024 * 1024
    assert value("dsec_sandbox_cpu_seconds") > 0
    assert value("dsec_sandbox_pids") >= 3  # init, the session shell, sleep
    assert 'dsec_sandboxes{edge="edge0",state="running"}' in text
    assert "dsec_sandboxes_created_total" in text and 'dsec_exec_seconds_count{edge="edge0",kind="exec"}' in text
