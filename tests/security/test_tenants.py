"""Tenant isolation, attacked through the API: what one project's tokens could do to
another project's sandboxes, builds and FnCall calls, or to the platform itself (the holes
an attack on the API found, one test each; every one of them failed on the code before the
fix). Two projects, ``ta`` and ``tb``, each with a runner and a builder, on the session's
real ``dsec serve``; everything runs at the platform's defaults.

Network attacks aim only at this machine: the host's own address, loopback, link-local
and the sandboxes' own addresses.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import logging
import os
import socket
import tarfile
import time
from collections.abc import AsyncIterator

import httpx
import pytest
import websockets
import websockets.exceptions
from conftest import TOKEN, Platform

import dsec
from dsec.client.cli.servers import _no_signatures
from dsec.node.edge.interactive import MAX_STREAMS_PER_SANDBOX, StreamSlots
from dsec.node.edge.network.nft import LibNft

pytestmark = pytest.mark.asyncio(loop_scope="session")

CONNECT = ("python3 -c \"import socket,sys; s=socket.create_connection((sys.argv[1], int(sys.argv[2])), 3); "
           "print(s.recv(64).decode().strip())\" {} {}")
BANNER = "SECRET-OF-TB"


@pytest.fixture(scope="module")
async def admin(platform: Platform) -> AsyncIterator[dsec.AsyncClient]:
    async with dsec.AsyncClient(url=platform.url, token=TOKEN) as c:
        yield c


@pytest.fixture(scope="module")
async def toks(admin: dsec.AsyncClient) -> dict[str, str]:
    out = {}
    for project in ("ta", "tb"):
        for role in ("runner", "builder"):
            out[f"{project}-{role}"] = (await admin.create_token(project, role)).token or ""
    return out


def _host_ip() -> str:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing address
        return str(s.getsockname()[0])
    finally:
        s.close()


async def _listening(sb: dsec.AsyncSandbox, port: int, banner: str) -> None:
    """A TCP server in ``sb`` that greets every client with ``banner``."""
    code = (f"import socket; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
            f"s.bind(('0.0.0.0', {port})); s.listen(8)\n"
            f"while True:\n c, _ = s.accept(); c.sendall(b'{banner}\\n'); c.close()")
    await sb.write_file("/tmp/srv.py", code.encode())
    await sb.run_shell("nohup python3 /tmp/srv.py >/dev/null 2>&1 &")
    for _ in range(50):
        if (await sb.run_shell(CONNECT.format("127.0.0.1", port))).stdout.strip() == banner:
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the listener did not come up")


# ---- 1. network rules ------------------------------------------------------------------------

async def test_a_runner_cannot_open_its_network_to_other_tenants_or_the_host(
        platform: Platform, toks: dict[str, str]) -> None:
    async with dsec.AsyncClient(url=platform.url, token=toks["ta-runner"]) as a, \
            dsec.AsyncClient(url=platform.url, token=toks["tb-runner"]) as b:
        victim = await b.run_container(dsec.ContainerArgs(network_rules={}))
        attacker = await a.run_container(dsec.ContainerArgs(network_rules={}))
        try:
            await _listening(victim, 8000, BANNER)
            assert victim.info.network is not None and attacker.info.network is not None
            b_ip, gw = victim.info.network.address, attacker.info.network.gateway
            for rule in (f"{b_ip}:8000/tcp", "0.0.0.0/0:2024/tcp", f"{_host_ip()}:{platform.port}/tcp",
                         f"{gw}:53/udp", f"{gw}:1-65535/tcp", "169.254.169.254:80/tcp", "127.0.0.1:22/tcp",
                         "224.0.0.251:5353/udp", "255.255.255.255:67/udp", "10.211.0.0/16:1-65535/tcp",
                         "0.0.0.0/1:80/tcp", "1.0.0.0/4:443/tcp"):
                with pytest.raises(dsec.InvalidRequest) as e:
                    await attacker.set_network_rules({rule: True})
                assert e.value.field == "network_rules", rule
                with pytest.raises(dsec.InvalidRequest):  # at create as well
                    await a.run_container(dsec.ContainerArgs(network_rules={rule: True}))
            with pytest.raises(dsec.Forbidden) as f:  # the host: form is the cluster admin's alone
                await attacker.set_network_rules({f"host:{platform.port}/tcp": True})
            assert f.value.field == "rules"
            with pytest.raises(dsec.Forbidden):
                await a.run_container(dsec.ContainerArgs(network_rules={f"host:{platform.port}/tcp": True}))
            assert attacker.info.network.rules == (await attacker.refresh()).network.rules == {}  # type: ignore[union-attr]
            r = await attacker.run_shell(CONNECT.format(b_ip, 8000))
            assert r.exit_code != 0 and BANNER not in r.stdout, r
        finally:
            await attacker.stop()
            await victim.stop()


async def test_the_kernel_drops_other_sandboxes_ahead_of_any_allow(platform: Platform, admin: dsec.AsyncClient,
                                                                  toks: dict[str, str]) -> None:
    """Were a rule to another sandbox in the allow set (written there behind the API's
    back, as root on the host), the kernel still drops the flow: the drops come first."""
    async with dsec.AsyncClient(url=platform.url, token=toks["tb-runner"]) as b:
        victim = await b.run_container(dsec.ContainerArgs(network_rules={}))
    attacker = await admin.run_container(dsec.ContainerArgs(network_rules={}))
    try:
        await _listening(victim, 8001, BANNER)
        a_ip, b_ip = attacker.info.network.address, victim.info.network.address  # type: ignore[union-attr]
        nft = LibNft()
        tables = [t["table"]["name"] for t in json.loads(nft.run("list tables", as_json=True))["nftables"]
                  if "table" in t and t["table"]["name"].startswith("dsec_")]
        mine = [t for t in tables if f"{a_ip} " in nft.run(f"list set inet {t} veths")]
        assert len(mine) == 1, tables
        nft.run(f"add element inet {mine[0]} raw_allow {{ {a_ip} . {b_ip} . tcp . 8001 }}")
        r = await attacker.run_shell(CONNECT.format(b_ip, 8001))
        assert r.exit_code != 0 and BANNER not in r.stdout, r
    finally:
        await attacker.stop()
        await victim.stop()


async def test_overlapping_rules_are_a_400_that_names_no_command(platform: Platform, toks: dict[str, str]) -> None:
    async with dsec.AsyncClient(url=platform.url, token=toks["ta-runner"]) as a:
        sb = await a.run_container(dsec.ContainerArgs(image="base/busybox", network_rules={}))
        try:
            with pytest.raises(dsec.InvalidRequest) as e:
                await sb.set_network_rules({"198.51.100.0/24:80/tcp": True, "198.51.100.7:80/tcp": True})
            assert e.value.field == "network_rules" and "overlap" in e.value.message
            assert "nft" not in e.value.message and "element" not in e.value.message
            await sb.set_network_rules({"198.51.100.0/24:80/tcp": True})
            with pytest.raises(dsec.InvalidRequest):  # an overlap with a rule it already has
                await sb.set_network_rules({"198.51.100.7:70-90/tcp": True})
            assert (await sb.set_network_rules({"198.51.100.7:443/tcp": True})).rules == {
                "198.51.100.0/24:80/tcp": True, "198.51.100.7:443/tcp": True}
        finally:
            await sb.stop()


# ---- 2. template builds ----------------------------------------------------------------------

def _tar(name: str, text: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        data = text.encode()
        info = tarfile.TarInfo(name)
        info.size, info.mode = len(data), 0o755
        t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _build(url: str, key: str, name: str, files_hash: str, content: str) -> str:
    """A template ``name`` with ``COPY setup.sh /opt/setup.sh`` under ``files_hash``,
    uploading ``content`` if the server asks for it; its build's final status."""
    h = {"X-API-Key": key}
    req = httpx.post(f"{url}/v3/templates", headers=h, json={"name": name}).json()
    tid, bid = req["templateID"], req["buildID"]
    up = httpx.get(f"{url}/templates/{tid}/files/{files_hash}", headers=h).json()
    if not up["present"]:
        assert httpx.put(up["url"], content=_tar("setup.sh", content)).status_code == 200
    r = httpx.post(f"{url}/v2/templates/{tid}/builds/{bid}", headers=h, json={
        "fromImage": "debian:12", "steps": [{"type": "COPY", "args": ["setup.sh", "/opt/setup.sh"],
                                             "filesHash": files_hash}]})
    assert r.status_code == 202, r.text
    deadline = time.monotonic() + 300
    while True:
        st = httpx.get(f"{url}/templates/{tid}/builds/{bid}/status", headers=h).json()
        if st["status"] in ("ready", "error"):
            return str(st["status"])
        assert time.monotonic() < deadline, st
        time.sleep(0.5)


async def test_one_project_cannot_poison_anothers_template_build(platform: Platform, admin: dsec.AsyncClient,
                                                                 toks: dict[str, str]) -> None:
    # the hash a's SDK will compute for its COPY: b can predict it for a file it knows
    files_hash = hashlib.sha256(b"COPY setup.sh /opt/setup.sh|predictable").hexdigest()
    good, evil = "echo built-by-ta\n", "echo built-by-tb\n"
    assert await asyncio.to_thread(_build, platform.url, toks["tb-builder"], "tpl-tb-poison", files_hash,
                                   evil) == "ready"
    async with httpx.AsyncClient(headers={"X-API-Key": toks["ta-builder"]}) as h:
        req = (await h.post(f"{platform.url}/v3/templates", json={"name": "tpl-ta-probe"})).json()
        up = (await h.get(f"{platform.url}/templates/{req['templateID']}/files/{files_hash}")).json()
    assert up["present"] is False  # b's upload is not a's: a is asked for its own files
    assert "project=ta" in up["url"]
    assert await asyncio.to_thread(_build, platform.url, toks["ta-builder"], "tpl-ta-victim", files_hash,
                                   good) == "ready"
    async with dsec.AsyncClient(url=platform.url, token=toks["ta-runner"]) as a, \
            httpx.AsyncClient(headers={"X-API-Key": toks["ta-runner"]}) as h:
        ra = await h.post(f"{platform.url}/sandboxes", json={"templateID": "tpl-ta-victim", "timeout": 120})
        assert ra.status_code == 201, ra.text
        sb = await a.connect(ra.json()["sandboxID"])
        try:
            r = await sb.exec(["sh", "/opt/setup.sh"])
            assert r.stdout == "built-by-ta\n", r  # its own file, not b's, and not b's cached step
        finally:
            await sb.stop()


async def test_a_private_templates_layer_is_its_projects_and_a_public_ones_everyones(
        platform: Platform, admin: dsec.AsyncClient, toks: dict[str, str]) -> None:
    """Red team: a template build published its layer (tk/e2bt-...) with no owner, so every
    project listed it and mounted it (reading what the private build wrote). Now it is the
    template's project's and private; made public, the template's layers are everyone's
    (another project spawns it), and made private again, they are hidden again."""
    files_hash = hashlib.sha256(b"COPY setup.sh /opt/setup.sh|private-tpl").hexdigest()
    assert await asyncio.to_thread(_build, platform.url, toks["tb-builder"], "tpl-tb-private", files_hash,
                                   "echo tb-secret\n") == "ready"
    built = [x.ref for x in await admin.layers() if x.ref.startswith("tk/e2bt-") and
             x.source and "template build" in x.source]
    async with dsec.AsyncClient(url=platform.url, token=toks["ta-runner"]) as a, \
            dsec.AsyncClient(url=platform.url, token=toks["tb-runner"]) as b, \
            httpx.AsyncClient(headers={"X-API-Key": toks["ta-runner"]}) as ha:
        mine = {x.ref for x in await b.layers()}
        theirs = {x.ref for x in await a.layers()}
        tb_layers = [r for r in built if r in mine]
        assert tb_layers and not set(tb_layers) & theirs, (tb_layers, sorted(theirs))
        for ref in tb_layers:
            with pytest.raises(dsec.NotFound):
                await a.run_container(dsec.ContainerArgs(image="base/debian:12", layers=[ref]))
        r = await ha.post(f"{platform.url}/sandboxes", json={"templateID": "tpl-tb-private", "timeout": 60})
        assert r.status_code in (400, 404), r.text  # another's private template is no template here
        async with httpx.AsyncClient(headers={"X-API-Key": toks["tb-builder"]}) as hb:
            tid = (await hb.get(f"{platform.url}/templates")).json()
            tid = next(t["templateID"] for t in tid if "tpl-tb-private" in t.get("aliases", []) + [t.get("name")])
            assert (await hb.patch(f"{platform.url}/templates/{tid}", json={"public": True})).status_code == 200
            r = await ha.post(f"{platform.url}/sandboxes", json={"templateID": "tpl-tb-private", "timeout": 60})
            assert r.status_code == 201, r.text  # a public template: another project spawns it
            sb = await a.connect(r.json()["sandboxID"])
            assert (await sb.exec(["sh", "/opt/setup.sh"])).stdout == "tb-secret\n"
            await sb.stop()
            assert (await hb.patch(f"{platform.url}/templates/{tid}", json={"public": False})).status_code == 200
        assert not {x.ref for x in await a.layers()} & set(tb_layers)


async def test_an_upload_url_is_for_its_own_project(platform: Platform, toks: dict[str, str]) -> None:
    files_hash = "ab" * 32
    async with httpx.AsyncClient(headers={"X-API-Key": toks["tb-builder"]}) as h:
        req = (await h.post(f"{platform.url}/v3/templates", json={"name": "tpl-tb-url"})).json()
        up = (await h.get(f"{platform.url}/templates/{req['templateID']}/files/{files_hash}")).json()
        forged = up["url"].replace("project=tb", "project=ta")
        assert forged != up["url"]
        assert (await h.put(forged, content=b"x")).status_code == 401
        assert (await h.get(f"{platform.url}/templates/{req['templateID']}/files/{files_hash}")).json()[
            "present"] is False


# ---- 3. FnCall's warm workers -----------------------------------------------------------------

PLANT = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
tried = {}
for d in ("/run/lock", "/var/lock", "/var/crash", "/var/mail", "/run", "/var/local", "/opt", "/srv", "/home"):
    try:
        with open(os.path.join(d, "planted-by-tb"), "w") as f:
            f.write("tb")
        os.chmod(os.path.join(d, "planted-by-tb"), 0o666)
        tried[d] = "written"
    except OSError as e:
        tried[d] = e.errno
shm = libc.shmget(0x7e57, 4096, 0o1000 | 0o666)  # IPC_CREAT, world-readable
sem = libc.semget(0x7e58, 1, 0o1000 | 0o666)
msg = libc.msgget(0x7e59, 0o1000 | 0o666)
print(tried, shm, sem, msg)
"""

LOOK = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
found = [d for d in ("/run/lock", "/var/lock", "/var/crash", "/var/mail", "/run", "/var/local", "/opt", "/srv",
                     "/home") if os.path.exists(os.path.join(d, "planted-by-tb"))]
ipc = [libc.shmget(0x7e57, 0, 0), libc.semget(0x7e58, 0, 0), libc.msgget(0x7e59, 0)]
print(found, ipc)
"""


async def test_fncall_workers_carry_nothing_across_tenants(platform: Platform, toks: dict[str, str]) -> None:
    async with dsec.AsyncClient(url=platform.url, token=toks["tb-runner"]) as b, \
            dsec.AsyncClient(url=platform.url, token=toks["ta-runner"]) as a:
        planted = await b.fncall(dsec.FnCallArgs(language="python", code=PLANT))
        assert planted.status == "ok", planted
        assert "'written'" not in planted.stdout, planted.stdout  # no world-writable directory of the image
        for _ in range(6):  # a's calls, on whichever pool container they land
            seen = await a.fncall(dsec.FnCallArgs(language="python", code=LOOK))
            assert seen.status == "ok", seen
            assert seen.stdout.strip() == "[] [-1, -1, -1]", seen.stdout


# ---- 4. request bodies and slow clients --------------------------------------------------------

def _raw(port: int, head: bytes, wait: float = 10.0) -> bytes:
    """Send ``head`` (a request line and headers, maybe a body's start) and read what comes
    back until the server answers or closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as s:
        s.sendall(head)
        out = b""
        try:
            while b"\r\n\r\n" not in out:
                chunk = s.recv(65536)
                if not chunk:
                    break
                out += chunk
        except TimeoutError:
            pass
        return out


@pytest.mark.parametrize("path", ["/ui/session", "/v1/sandboxes", "/sandboxes", "/v1/tokens",
                                  "/v1/sandboxes/edge0-x/ports/80/", "/v1/sandboxes/edge0-x/exec"])
async def test_a_huge_declared_body_is_refused_unread(platform: Platform, path: str) -> None:
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {300 << 20}\r\n\r\n").encode()
    out = await asyncio.to_thread(_raw, platform.port, head)
    assert out.startswith(b"HTTP/1.1 413"), out[:200]


async def test_an_endless_chunked_body_is_cut_off(platform: Platform) -> None:
    """No length declared, no token: the server stops reading at the route's cap (1 MiB for a
    control route) and answers 413, its memory not growing with what the client sends."""
    def send() -> bytes:
        with socket.create_connection(("127.0.0.1", platform.port), timeout=20) as s:
            s.sendall(b"POST /ui/session HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
            chunk = b"%x\r\n%s\r\n" % (1 << 16, b"a" * (1 << 16))
            try:
                for _ in range(64 << 4):  # up to 64 MiB, far past the cap
                    s.sendall(chunk)
            except OSError:
                pass  # the server closed on us: what it answered is still to be read
            out = b""
            try:
                while chunk := s.recv(65536):
                    out += chunk
            except OSError:
                pass
            return out
    rss0 = _rss(platform)
    out = await asyncio.to_thread(send)
    assert out.startswith(b"HTTP/1.1 413"), out[:200]
    assert _rss(platform) - rss0 < 32 << 20


def _rss(platform: Platform) -> int:
    assert platform.proc is not None
    with open(f"/proc/{platform.proc.pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def test_slow_loris_headers_are_dropped(platform: Platform) -> None:
    """A client that opens a connection and never finishes its headers is cut off (at the
    default deadline, 30 s), while other clients are served all along."""
    def trickle() -> float:
        """Seconds until the server closed the connection (60: it never did)."""
        t0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", platform.port), timeout=5) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            s.setblocking(False)
            while time.monotonic() - t0 < 60:
                try:
                    if s.recv(1) == b"":
                        return time.monotonic() - t0
                except BlockingIOError:
                    pass
                except OSError:
                    return time.monotonic() - t0
                try:
                    s.send(b"X-a: b\r\n")
                except BlockingIOError:
                    pass
                except OSError:
                    return time.monotonic() - t0
                time.sleep(1)
        return 60.0
    held = asyncio.create_task(asyncio.to_thread(trickle))
    async with httpx.AsyncClient() as h:
        assert (await h.get(f"{platform.url}/healthz")).status_code == 200
    assert 25 < await held < 45


# ---- 5. revocation ends what is open ---------------------------------------------------------

async def test_an_open_terminal_dies_with_its_token(platform: Platform, admin: dsec.AsyncClient) -> None:
    info = await admin.create_token("ta", "runner")
    async with dsec.AsyncClient(url=platform.url, token=info.token or "") as a:
        sb = await a.run_container(dsec.ContainerArgs(image="base/busybox"))
        try:
            async with websockets.connect(sb.tty_url(), additional_headers={
                    "Authorization": f"Bearer {info.token}"}) as ws:
                await ws.send(b"echo tty-$((6*7))\n")
                buf = b""
                while b"tty-42" not in buf:
                    buf += await asyncio.wait_for(ws.recv(), 10)  # type: ignore[operator]
                await admin.revoke_token(info.id)
                t0 = time.monotonic()
                with pytest.raises(websockets.exceptions.ConnectionClosed) as e:
                    while True:  # revocation reaches every replica within 5 s, an open TTY 2 s later
                        await asyncio.wait_for(ws.recv(), 12)
                assert e.value.rcvd is not None and e.value.rcvd.code == 4401
                assert time.monotonic() - t0 < 8
                with pytest.raises(websockets.exceptions.ConnectionClosed):
                    await ws.send(b"touch /tmp/after-revocation\n")
        finally:
            await asyncio.sleep(1)
    owned = await admin.connect(sb.sandbox_id)
    try:
        with pytest.raises(dsec.NotFound):  # typed after the revocation: never ran
            await owned.read_file("/tmp/after-revocation")
    finally:
        await owned.stop()


async def test_a_streamed_exec_ends_with_its_token(platform: Platform, admin: dsec.AsyncClient) -> None:
    info = await admin.create_token("ta", "runner")
    async with dsec.AsyncClient(url=platform.url, token=info.token or "") as a:
        sb = await a.run_container(dsec.ContainerArgs(image="base/busybox"))
        got = 0
        t_revoked = 0.0
        try:
            async for ev in sb.exec_stream("for i in $(seq 300); do echo $i; sleep 0.1; done"):
                got += 1
                if got == 5:
                    await admin.revoke_token(info.id)
                    t_revoked = time.monotonic()
                if ev.type == "result":
                    break
        except dsec.DsecError:
            pass
        assert t_revoked and time.monotonic() - t_revoked < 12, got
    await (await admin.connect(sb.sandbox_id)).stop()


# ---- found by the red-team pass after the fixes ------------------------------------------------

async def test_a_sandbox_named_twice_reaches_neither(platform: Platform, toks: dict[str, str]) -> None:
    """E2B's envd names its sandbox in a header: given twice (another project's first, the
    caller's own last), the check read one copy and the route acted on the other, and a
    runner read, wrote and ran commands as root in another project's sandbox. A credential
    or routing header given twice is a 400 now, before anything reads it."""
    async with httpx.AsyncClient() as h:
        made = {}
        for who in ("ta", "tb"):
            r = await h.post(f"{platform.url}/sandboxes", headers={"X-API-Key": toks[f"{who}-runner"]},
                             json={"templateID": "base", "timeout": 120})
            assert r.status_code == 201, r.text
            made[who] = r.json()
        a_id, a_tok, b_id = made["ta"]["sandboxID"], made["ta"]["envdAccessToken"], made["tb"]["sandboxID"]
        async with dsec.AsyncClient(url=platform.url, token=toks["tb-runner"]) as b:
            victim = await b.connect(b_id)
            await victim.write_file("/root/secret.txt", b"SECRET-OF-TB")
            for first, last in ((b_id, a_id), (a_id, b_id)):
                r = await h.get(f"{platform.url}/files", params={"path": "/root/secret.txt", "username": "root"},
                                headers=[("E2B-Sandbox-Id", first), ("E2B-Sandbox-Id", last),
                                         ("X-Access-Token", a_tok)])
                assert r.status_code == 400 and b"SECRET-OF-TB" not in r.content, r.text
                assert r.json()["field"] == "e2b-sandbox-id"
            r = await h.get(f"{platform.url}/files", params={"path": "/root/secret.txt", "username": "root"},
                            headers=[("E2B-Sandbox-Id", b_id), ("X-Access-Token", a_tok)])
            assert r.status_code == 401  # its own id with another's token: refused as before
            r = await h.get(f"{platform.url}/v1/sandboxes", headers=[("Authorization", f"Bearer {toks['ta-runner']}"),
                                                                      ("Authorization", f"Bearer {TOKEN}")])
            assert r.status_code == 400 and r.json()["field"] == "authorization"
            for sid, who in ((a_id, "ta"), (b_id, "tb")):
                await h.delete(f"{platform.url}/sandboxes/{sid}", headers={"X-API-Key": toks[f"{who}-runner"]})


HOLD_DNS = r"""
import socket, sys, time
held = []
for _ in range(int(sys.argv[1])):
    try:
        s = socket.create_connection(("1.1.1.1", 53), 2)  # any address: the kernel hands it to the edge's resolver
        held.append(s)
    except OSError:
        pass
print(len(held), flush=True)
time.sleep(float(sys.argv[2]))
"""


async def test_a_sandbox_cannot_run_the_edge_out_of_file_descriptors(platform: Platform,
                                                                     toks: dict[str, str]) -> None:
    """TCP to port 53 goes to the edge's resolver: a sandbox that opened thousands held as
    many of the edge's fds (20,000 took it to its limit, and other tenants' calls failed).
    Now a sandbox holds at most 16 there (and 256 through the egress gate)."""
    assert platform.proc is not None
    fds = lambda: len(os.listdir(f"/proc/{platform.proc.pid}/fd"))  # noqa: E731
    async with dsec.AsyncClient(url=platform.url, token=toks["ta-runner"]) as a, \
            dsec.AsyncClient(url=platform.url, token=toks["tb-runner"]) as b:
        attacker = await a.run_container(dsec.ContainerArgs(network_rules={}))
        other = await b.run_container(dsec.ContainerArgs(image="base/busybox"))
        try:
            before = fds()
            await attacker.write_file("/tmp/hold.py", HOLD_DNS.encode())
            flood = asyncio.create_task(attacker.exec(["python3", "/tmp/hold.py", "2000", "20"], timeout=120))
            await asyncio.sleep(8)
            during = fds()
            assert during - before < 200, (before, during)
            for _ in range(5):  # another tenant is served meanwhile
                assert (await other.exec(["echo", "ok"], timeout=10)).stdout == "ok\n"
            await flood
            denied = [e for e in await attacker.events() if e.kind == "egress_denied"]
            assert len(denied) <= 200, len(denied)  # a flood of denials is counted, not kept one by one
        finally:
            await attacker.stop()
            await other.stop()


SPY = r"""
import os, socket, time
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 8099)); srv.listen(8); srv.settimeout(0.2)
seen = set()
end = time.time() + 3
while time.time() < end:
    try:
        c, _ = srv.accept(); seen.add("conn:" + c.recv(32).decode(errors="replace")); c.close()
    except OSError:
        pass
    for name in os.listdir("/dev/shm") + os.listdir("/tmp"):
        if "beta" in name:
            seen.add("file:" + name)
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if b"BETA-ARGV" in open(f"/proc/{pid}/cmdline", "rb").read():
                    seen.add("argv")
            except OSError:
                pass
print(sorted(seen))
"""

BUSY_BETA = r"""
import os, socket, subprocess, time
open(f"/dev/shm/beta_{os.getpid()}", "w").write("x")
p = subprocess.Popen(["sh", "-c", "sleep 1.5; : BETA-ARGV"])
for _ in range(10):
    try:
        s = socket.create_connection(("127.0.0.1", 8099), 0.2); s.sendall(b"BETA"); s.close()
    except OSError:
        pass
    time.sleep(0.1)
p.wait()
print("done")
"""


async def test_concurrent_fncalls_of_two_projects_never_share_a_container(platform: Platform,
                                                                          toks: dict[str, str]) -> None:
    """A pool container runs two calls at once: of two projects, they shared its loopback,
    /dev/shm, /tmp and process list (a call read another's argv and files, and took its
    connections). A container now runs one project's calls at a time."""
    async with dsec.AsyncClient(url=platform.url, token=toks["ta-runner"]) as a, \
            dsec.AsyncClient(url=platform.url, token=toks["tb-runner"]) as b:
        for _ in range(2):
            spy = asyncio.create_task(a.fncall(dsec.FnCallArgs(language="python", code=SPY, time_limit_s=10)))
            await asyncio.sleep(0.3)
            betas = await asyncio.gather(*(b.fncall(dsec.FnCallArgs(language="python", code=BUSY_BETA,
                                                                    time_limit_s=10)) for _ in range(4)))
            got = await spy
            assert got.status == "ok" and got.stdout.strip() == "[]", got
            assert all(r.status == "ok" and r.stdout == "done\n" for r in betas), [r.stderr for r in betas]
            assert got.container not in {r.container for r in betas}


async def test_a_retired_pool_container_lets_its_other_call_finish(platform: Platform,
                                                                   toks: dict[str, str]) -> None:
    """A call that leaves a file retires its container; the other call running there (the
    same project's) finishes with its answer instead of an error."""
    async with dsec.AsyncClient(url=platform.url, token=toks["ta-runner"]) as a:
        slow = asyncio.create_task(a.fncall(dsec.FnCallArgs(
            language="python", code="import time; time.sleep(2); print('slow done')", time_limit_s=10)))
        await asyncio.sleep(0.3)
        messy = await a.fncall(dsec.FnCallArgs(language="python", code="open('/tmp/left', 'w').write('x')"))
        assert messy.status == "ok"
        done = await slow
        assert done.status == "ok" and done.stdout == "slow done\n", done


async def test_the_access_log_shows_no_signature() -> None:
    """A signed file URL is a credential: uvicorn's access log line for it (as the servers
    install the filter) shows it with its signature cut out."""
    rec = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                            ("127.0.0.1:5000", "GET", "/files?path=/a&signature=v1_leakme0123&username=root", "1.1",
                             200), None)
    assert _no_signatures(rec)
    line = rec.getMessage()
    assert "leakme0123" not in line and "/files?path=/a&signature=***&username=root" in line, line


async def test_a_template_build_learns_nothing_of_another_projects_private_layer(
        platform: Platform, toks: dict[str, str]) -> None:
    async with dsec.AsyncClient(url=platform.url, token=toks["tb-builder"]) as b:
        env = await b.run_container(dsec.ContainerArgs(image="base/busybox"))
        await env.exec(["sh", "-c", "echo private > /root/tb.txt"])
        await env.pack_diff("ws/tb-private:1", visibility="private")
        await env.stop()
    async with httpx.AsyncClient(headers={"X-API-Key": toks["ta-builder"]}) as h:
        req = (await h.post(f"{platform.url}/v3/templates", json={"name": "tpl-ta-peek"})).json()
        tid, bid = req["templateID"], req["buildID"]
        r = await h.post(f"{platform.url}/v2/templates/{tid}/builds/{bid}",
                         json={"fromImage": "ws/tb-private:1", "steps": [{"type": "RUN", "args": ["true"]}]})
        assert r.status_code == 202, r.text
        deadline = time.monotonic() + 60
        while (st := (await h.get(f"{platform.url}/templates/{tid}/builds/{bid}/status")).json())["status"] \
                not in ("ready", "error"):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.3)
        text = json.dumps(st)
        assert st["status"] == "error" and "unknown" in text, st
        assert "base/busybox" not in text and "FROM ws/tb-private:1 (" not in text, text  # nor its stack


async def test_a_project_cannot_publish_under_another_projects_layer_name(platform: Platform,
                                                                          toks: dict[str, str]) -> None:
    """Layer names are global: a project published the next version of another's private
    layer, made it public, and the other project's next create ran its files; publishing to
    an existing private ref also answered "already exists" where every other route says 404."""
    async with dsec.AsyncClient(url=platform.url, token=toks["tb-builder"]) as b, \
            dsec.AsyncClient(url=platform.url, token=toks["ta-builder"]) as a:
        owner = await b.run_container(dsec.ContainerArgs(image="base/busybox"))
        await owner.pack_diff("ws/tb-name:1", visibility="private")
        await owner.stop()
        squatter = await a.run_container(dsec.ContainerArgs(image="base/busybox"))
        try:
            messages = set()
            for ref in ("ws/tb-name:2", "ws/tb-name:1", "base/busybox:2"):
                with pytest.raises(dsec.Forbidden) as e:
                    await squatter.pack_diff(ref)
                assert e.value.field == "ref"
                messages.add(e.value.message.replace(ref.rsplit(":", 1)[0], "NAME"))
            assert len(messages) == 1  # an existing version and a new one answer alike
            assert (await squatter.pack_diff("ws/ta-name:1")).ref == "ws/ta-name:1"
            assert (await squatter.pack_diff("ws/ta-name:2")).ref == "ws/ta-name:2"  # its own name: any version
        finally:
            await squatter.stop()


async def test_fncall_languages_tell_nothing_of_another_projects_private_layer(platform: Platform,
                                                                               toks: dict[str, str]) -> None:
    """Red team: GET /v1/fncall/languages skipped the visibility check, so another project's
    private layer answered a 500 naming its kind where an unknown one answered 404; an image
    with no FnCall runner (base/busybox) was a 500 too. Now: 404 alike, and a 400 naming image."""
    async with dsec.AsyncClient(url=platform.url, token=toks["tb-builder"]) as b:
        env = await b.run_container(dsec.ContainerArgs(image="base/busybox"))
        await env.pack_diff("ws/tb-fnlang:1", visibility="private")
        await env.stop()
    h = {"Authorization": f"Bearer {toks['ta-runner']}"}
    async with httpx.AsyncClient(timeout=60) as c:
        hidden = await c.get(f"{platform.url}/v1/fncall/languages", params={"image": "ws/tb-fnlang:1"}, headers=h)
        missing = await c.get(f"{platform.url}/v1/fncall/languages", params={"image": "ws/nope-x:1"}, headers=h)
        assert hidden.status_code == missing.status_code == 404, (hidden.text, missing.text)
        assert hidden.json()["message"].replace("tb-fnlang", "X") == missing.json()["message"].replace("nope-x", "X")
        plain = await c.get(f"{platform.url}/v1/fncall/languages", params={"image": "base/busybox"}, headers=h)
        assert plain.status_code == 400 and plain.json()["field"] == "image", plain.text


# ---- the hardening gaps ----------------------------------------------------------------------

async def test_a_nul_byte_in_a_path_is_refused(platform: Platform, toks: dict[str, str]) -> None:
    async with dsec.AsyncClient(url=platform.url, token=toks["ta-runner"]) as a:
        sb = await a.run_container(dsec.ContainerArgs(image="base/busybox"))
        try:
            with pytest.raises(dsec.InvalidRequest) as e:
                await sb.write_file("/tmp/real\x00.decoy", b"x")
            assert e.value.field == "path"
            async with httpx.AsyncClient() as h:
                r = await h.put(f"{platform.url}/v1/sandboxes/{sb.sandbox_id}/files?path=/tmp/real%00.decoy",
                                headers={"Authorization": f"Bearer {toks['ta-runner']}"}, content=b"x")
            assert r.status_code == 400 and r.json()["field"] == "path"
            for op in (sb.read_file("/etc/passwd\x00x"), sb.list_dir("/tmp\x00"), sb.remove("/tmp\x00/x")):
                with pytest.raises(dsec.InvalidRequest):
                    await op
            assert (await sb.exec(["ls", "/tmp"])).stdout == ""  # nothing was written under another name
        finally:
            await sb.stop()


async def test_a_label_filter_for_another_project_matches_nothing(platform: Platform, toks: dict[str, str]) -> None:
    async with dsec.AsyncClient(url=platform.url, token=toks["ta-runner"]) as a:
        mine = await a.run_container(dsec.ContainerArgs(image="base/busybox"))
        try:
            assert await a.list(labels={"dsec.project": "tb"}) == []
            assert await a.stop_many(labels={"dsec.project": "tb"}) == []
            assert (await mine.refresh()).state == dsec.SandboxState.running  # not its own instead
            assert mine.sandbox_id in [i.sandbox_id for i in await a.list(labels={"dsec.project": "ta"})]
        finally:
            await mine.stop()


async def test_open_streams_per_sandbox_are_bounded() -> None:
    """The edge's per-sandbox bound on open streams, at its default (driving 256 real
    streams through one sandbox is the cost this bound exists to refuse)."""
    slots = StreamSlots()
    assert slots.per_sandbox == MAX_STREAMS_PER_SANDBOX == 256
    held = [slots.hold("edge0-s", "terminal") for _ in range(MAX_STREAMS_PER_SANDBOX)]
    for h in held:
        h.__enter__()
    with pytest.raises(dsec.AdmissionRejected), slots.hold("edge0-s", "terminal"):
        pass
    with slots.hold("edge0-other", "terminal"):  # another sandbox is not held back
        pass
    held[0].__exit__(None, None, None)
    with slots.hold("edge0-s", "terminal"):
        pass
    for h in held[1:]:
        h.__exit__(None, None, None)
    assert slots.open == {}


async def test_mountinfo_shows_no_host_paths(platform: Platform, toks: dict[str, str]) -> None:
    async with dsec.AsyncClient(url=platform.url, token=toks["ta-runner"]) as a:
        sb = await a.run_container(dsec.ContainerArgs(image="base/busybox"))
        try:
            info = (await sb.exec(["cat", "/proc/1/mountinfo", "/proc/self/mountinfo", "/proc/mounts"])).stdout
            assert "overlay" in info
            assert platform.data_dir not in info and "/layers/" not in info and "/sandboxes/" not in info, info
        finally:
            await sb.stop()


async def test_metrics_are_the_cluster_admins(platform: Platform, toks: dict[str, str]) -> None:
    async with httpx.AsyncClient() as h:
        r = await h.get(f"{platform.url}/metrics", headers={"Authorization": f"Bearer {toks['ta-runner']}"})
        assert r.status_code == 403 and r.json()["field"] == "authorization"
        r = await h.get(f"{platform.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200 and "dsec_" in r.text
