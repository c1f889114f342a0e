"""The web console in a real browser: Debian's headless Chromium, driven by Playwright,
against the session's real platform. A user logs in with a token, sees a sandbox they
create appear, opens its terminal and runs a command, browses its files, watches a
job's progress move, stops the sandbox from the page and sees it leave; a project's
token sees only its project. Each page's screenshot is saved under
``tests/artifacts/console`` (``$DSEC_TEST_ARTIFACTS`` moves it)."""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import AsyncIterator

import aiohttp
import pytest
from conftest import TOKEN, Platform
from playwright.async_api import Browser, BrowserContext, Page, async_playwright, expect

import dsec
from dsec.shared.wire.iam import ProjectQuota
from dsec.shared.wire.jobs import JobQuota

CHROMIUM = "/usr/bin/chromium"
# Chromium on a closed network: no background connections, no first-run, no GPU
ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-dev-shm-usage"]
ARTIFACTS = os.environ.get("DSEC_TEST_ARTIFACTS",
                           os.path.join(os.path.dirname(os.path.abspath(__file__)), "artifacts", "console"))
WAIT_MS = 20_000  # a poll is 2-3 s: anything live shows within a few


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Browser]:
    os.makedirs(ARTIFACTS, exist_ok=True)
    async with async_playwright() as p:
        b = await p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        await b.close()


async def logged_in(browser: Browser, platform: Platform, token: str = TOKEN) -> tuple[BrowserContext, Page]:
    ctx = await browser.new_context(viewport={"width": 1440, "height": 900})
    page = await ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    await page.goto(f"{platform.url}/ui/")
    await page.fill("input[name=token]", token)
    await page.click("button[type=submit]")
    await expect(page.get_by_test_id("whoami")).to_be_visible(timeout=WAIT_MS)
    assert not errors, errors
    return ctx, page


async def shot(page: Page, name: str) -> None:
    await page.screenshot(path=os.path.join(ARTIFACTS, f"{name}.png"), full_page=True)


async def test_login_refuses_a_wrong_token_and_keeps_no_token(browser: Browser, platform: Platform) -> None:
    ctx = await browser.new_context()
    page = await ctx.new_page()
    await page.goto(f"{platform.url}/ui/")
    await page.fill("input[name=token]", "not-a-token")
    await page.click("button[type=submit]")
    await expect(page.get_by_role("alert")).to_contain_text("invalid token", timeout=WAIT_MS)
    await shot(page, "login")
    await page.fill("input[name=token]", TOKEN)
    await page.click("button[type=submit]")
    await expect(page.get_by_test_id("whoami")).to_contain_text("all projects")
    cookies = await ctx.cookies()
    session = [c for c in cookies if c["name"] == "dsec_session"]
    assert session and session[0]["httpOnly"] and session[0]["sameSite"] == "Strict"
    assert TOKEN not in session[0]["value"]  # the cookie names the token, never holds it
    assert TOKEN not in await page.evaluate("JSON.stringify(localStorage) + JSON.stringify(sessionStorage)")
    copied = {"Cookie": f"dsec_session={session[0]['value']}"}
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{platform.url}/v1/console/fleet", headers=copied) as r:
            assert r.status == 200
        # the session reaches what the console uses, never tokens or the cluster's administration
        async with s.get(f"{platform.url}/v1/tokens", headers=copied) as r:
            assert r.status == 401
    await page.get_by_role("button", name="Log out").click()
    await expect(page.locator("input[name=token]")).to_be_visible()
    r = await page.request.get(f"{platform.url}/v1/console/fleet")
    assert r.status == 401
    async with aiohttp.ClientSession() as s:  # a copy of the cookie kept from before the logout is dead too
        async with s.get(f"{platform.url}/v1/console/fleet", headers=copied) as r:
            assert r.status == 401
    await ctx.close()


async def test_an_operator_ends_every_session_of_a_token(browser: Browser, platform: Platform,
                                                         client: dsec.AsyncClient) -> None:
    tok = await client.create_token("default", "reader", "console sessions")
    assert tok.token is not None
    ctx, page = await logged_in(browser, platform, tok.token)
    try:
        r = await page.request.get(f"{platform.url}/v1/console/fleet")
        assert r.status == 200
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as s:
            async with s.delete(f"{platform.url}/v1/console/sessions", params={"token_id": tok.id}) as r2:
                assert r2.status == 200
        r = await page.request.get(f"{platform.url}/v1/console/fleet")
        assert r.status == 401  # the token still works; its console sessions do not
        async with dsec.AsyncClient(url=platform.url, token=tok.token) as theirs:
            assert isinstance(await theirs.list(), list)
        await logged_in(browser, platform, tok.token)  # a new login is a new session
    finally:
        await ctx.close()
        await client.revoke_token(tok.id)


async def test_a_sandbox_port_cannot_reach_the_console_session(browser: Browser, platform: Platform,
                                                               client: dsec.AsyncClient) -> None:
    """A page a sandbox serves on the API's own origin (its /ports/ route) is hostile: it sees
    no cookie, sets none, runs in CSP's sandbox, and its requests carry no session."""
    server = (
        "import http.server, json\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        body = ('<html><body><pre id=seen>' + json.dumps(dict(self.headers)) + '</pre><script>'\n"
        "                'fetch(\"/v1/console/fleet\", {credentials: \"include\"}).then(r => document.title = '\n"
        "                '\"status \" + r.status).catch(e => document.title = \"blocked\")</script></body></html>')\n"
        "        self.send_response(200)\n"
        "        self.send_header('Content-Type', 'text/html')\n"
        "        self.send_header('Set-Cookie', 'dsec_session=planted; Path=/v1/')\n"
        "        self.end_headers()\n"
        "        self.wfile.write(body.encode())\n"
        "http.server.HTTPServer(('0.0.0.0', 8000), H).serve_forever()\n")
    sb = await client.run_container(dsec.ContainerArgs(image="base/debian:12", memory_limit_mb=128))
    ctx, page = await logged_in(browser, platform)
    try:
        await sb.write_file("/root/srv.py", server)
        await sb.exec("nohup python3 /root/srv.py >/dev/null 2>&1 &")
        for _ in range(50):
            if (await sb.exec("python3 -c \"import socket; socket.create_connection(('127.0.0.1', 8000))\"")
                    ).exit_code == 0:
                break
            await asyncio.sleep(0.2)
        url = f"{platform.url}/v1/sandboxes/{sb.sandbox_id}/ports/8000/index.html"
        assert (await page.request.get(url)).status == 401  # a session does not open a sandbox's port
        # with the API's own credential (only for this one URL), the page loads: still walled off
        await page.route(url, lambda route: asyncio.ensure_future(route.continue_(
            headers={**route.request.headers, "authorization": f"Bearer {TOKEN}"})))
        resp = await page.goto(url)
        assert resp is not None and resp.status == 200
        assert "sandbox" in (resp.headers.get("content-security-policy") or "")
        assert "set-cookie" not in resp.headers
        seen = await page.locator("#seen").inner_text()
        assert "dsec_session" not in seen and "cookie" not in seen.lower()  # the session never reached it
        await page.wait_for_function("() => document.title !== ''", timeout=WAIT_MS)
        assert await page.title() in ("blocked", "status 401"), await page.title()  # its fetch had no session
        assert [c["value"] for c in await ctx.cookies() if c["name"] == "dsec_session"] != ["planted"]
        assert len([c for c in await ctx.cookies() if c["name"] == "dsec_session"]) == 1
        # and the console still works for this user
        r = await page.request.get(f"{platform.url}/v1/console/fleet")
        assert r.status == 200
    finally:
        await ctx.close()
        await sb.stop()


async def test_console_end_to_end(browser: Browser, platform: Platform, client: dsec.AsyncClient) -> None:
    job_name = f"console-{secrets.token_hex(3)}"
    job = await client.create_job(job_name, quota=JobQuota(sandboxes=8))
    ctx, page = await logged_in(browser, platform)
    try:
        await expect(page.locator("[data-testid=edges] tr[data-edge]")).to_have_count(1, timeout=WAIT_MS)
        await shot(page, "fleet")

        # a sandbox created elsewhere appears in the open list without a reload
        await page.goto(f"{platform.url}/ui/#/sandboxes?job={job_name}")
        await expect(page.get_by_test_id("sandbox-count")).to_have_text("0", timeout=WAIT_MS)
        sb = await job.run(dsec.ContainerArgs(image="base/debian:12", memory_limit_mb=256, labels={"who": "console"}))
        row = page.locator(f"tr[data-sandbox='{sb.sandbox_id}']")
        await expect(row).to_be_visible(timeout=WAIT_MS)
        await expect(row).to_contain_text("running")
        await shot(page, "sandboxes")

        # its page, its terminal: a command typed in the browser runs in the sandbox
        await row.locator("a").first.click()
        await expect(page.get_by_test_id("sandbox-id")).to_have_text(sb.sandbox_id)
        await sb.exec("echo from-the-log", key="k-1")  # a keyed command: in the command log
        await page.click("button[data-tab=terminal]")
        await expect(page.get_by_test_id("tty-status")).to_have_text("connected", timeout=WAIT_MS)
        await page.locator("[data-testid=terminal] textarea").focus()
        await page.keyboard.type("echo console-$((6*7)) > /root/typed.txt; cat /root/typed.txt\n")
        await page.wait_for_function(
            "() => { const b = window.dsecTerminal.buffer.active; let s = '';"
            " for (let i = 0; i < b.length; i++) s += b.getLine(i).translateToString(true) + '\\n';"
            " return s.includes('\\nconsole-42'); }", timeout=WAIT_MS)
        assert (await sb.read_file("/root/typed.txt")) == b"console-42\n"
        await shot(page, "terminal")

        # its files: browse to a directory, open a file
        await sb.write_file("/root/work/notes.txt", "hello from the files tab\n")
        await page.goto(f"{platform.url}/ui/#/sandbox/{sb.sandbox_id}?tab=files&path=/root/work")
        await page.locator("tr[data-file='notes.txt'] a").click()
        await expect(page.get_by_test_id("file-view")).to_have_text("hello from the files tab\n", timeout=WAIT_MS)
        await shot(page, "files")
        await page.click("button[data-tab=commands]")
        await expect(page.get_by_text("echo from-the-log")).to_be_visible(timeout=WAIT_MS)
        await page.click("button[data-tab=overview]")
        await expect(page.get_by_test_id("chart-cpu")).to_be_visible()
        await page.wait_for_timeout(4500)  # two usage samples make a line
        await shot(page, "sandbox")

        # the job's page: its progress moves as a batch of its sandboxes is made
        await page.goto(f"{platform.url}/ui/#/job/{job_name}")
        live = page.get_by_test_id("job-live").locator(".v")
        await expect(live).to_have_text("1", timeout=WAIT_MS)
        batch = await job.create_many(dsec.ContainerArgs(image="base/busybox", memory_limit_mb=64), 3)
        await expect(live).to_have_text("4", timeout=WAIT_MS)
        await batch.wait(timeout=120)
        await expect(page.locator(f"tr[data-batch='{batch.id}']")).to_contain_text("done", timeout=WAIT_MS)
        await shot(page, "job")
        await page.goto(f"{platform.url}/ui/#/jobs")
        await expect(page.locator(f"tr[data-job='{job_name}']")).to_contain_text("4 live", timeout=WAIT_MS)
        await shot(page, "jobs")

        # stopped from its page (the console's own request, with its CSRF header), it leaves the list
        await page.goto(f"{platform.url}/ui/#/sandbox/{sb.sandbox_id}")
        page.once("dialog", lambda d: asyncio.ensure_future(d.accept()))
        await page.get_by_test_id("stop").click()
        await expect(page.get_by_test_id("sandbox-state")).to_have_text("stopped", timeout=WAIT_MS)
        assert (await sb.refresh()).state == "stopped"
        await page.goto(f"{platform.url}/ui/#/sandboxes?job={job_name}&state=running")
        await expect(page.get_by_test_id("sandbox-count")).to_have_text("3", timeout=WAIT_MS)
        await expect(page.locator(f"tr[data-sandbox='{sb.sandbox_id}']")).to_have_count(0)

        for name, testid in (("layers", "layers"), ("fncall", "fncall-pools"), ("projects", "projects")):
            await page.goto(f"{platform.url}/ui/#/{name}")
            await expect(page.get_by_test_id(testid)).to_be_visible(timeout=WAIT_MS)
            await shot(page, name)
    finally:
        await ctx.close()
        await job.stop()


async def test_a_projects_token_sees_only_its_project(browser: Browser, platform: Platform,
                                                      client: dsec.AsyncClient) -> None:
    project = f"console-p{secrets.token_hex(2)}"
    await client.projects.create(project, ProjectQuota(sandboxes=5))
    mine = await client.run_container(dsec.ContainerArgs(image="base/busybox", memory_limit_mb=64))
    tok = await client.create_token(project, "runner", "console test")
    assert tok.token is not None
    async with dsec.AsyncClient(url=platform.url, token=tok.token) as theirs:
        their_sb = await theirs.run_container(dsec.ContainerArgs(image="base/busybox", memory_limit_mb=64))
    ctx, page = await logged_in(browser, platform, tok.token)
    try:
        await expect(page.get_by_test_id("whoami")).to_contain_text(f"project {project}")
        await page.goto(f"{platform.url}/ui/#/sandboxes")
        await expect(page.get_by_test_id("sandbox-count")).to_have_text("1", timeout=WAIT_MS)
        await expect(page.locator(f"tr[data-sandbox='{their_sb.sandbox_id}']")).to_be_visible()
        await expect(page.locator(f"tr[data-sandbox='{mine.sandbox_id}']")).to_have_count(0)
        await shot(page, "project-sandboxes")
        # its quota use: one of five sandboxes
        await page.goto(f"{platform.url}/ui/#/projects")
        await expect(page.locator(f"tr[data-project='{project}']")).to_contain_text("1 / 5", timeout=WAIT_MS)
        await expect(page.locator("tr[data-project]")).to_have_count(1)
        await shot(page, "projects")
        # another project's sandbox does not exist for this session, page or API
        r = await page.request.get(f"{platform.url}/v1/sandboxes/{mine.sandbox_id}")
        assert r.status == 404
        # a change made with the cookie alone (as another site's page would) is refused
        r = await page.request.delete(f"{platform.url}/v1/sandboxes/{their_sb.sandbox_id}")
        assert r.status == 403 and "x-dsec-console" in (await r.json())["message"]
        assert (await client.connect(their_sb.sandbox_id)).sandbox_id == their_sb.sandbox_id
        assert (await (await client.connect(their_sb.sandbox_id)).refresh()).state == "running"
        # the fleet without other projects' work: no job names, no operators, no fleet history,
        # no FnCall counters (the pools serve every project)
        fleet = await (await page.request.get(f"{platform.url}/v1/console/fleet")).json()
        assert all(n["per_job"] == {} and n["evidence"] == [] for n in fleet["nodes"])
        assert fleet["history"] == {"interval_s": 5.0, "samples": [], "shown": False}
        fncall = await (await page.request.get(f"{platform.url}/v1/console/fncall")).json()
        assert all(f["shown"] is False and f["calls"] == 0 and f["verdicts"] == {} for f in fncall)
        # the terminal's websocket from another origin is refused, from the console's own accepted
        cookie = "; ".join(f"{c['name']}={c['value']}" for c in await ctx.cookies())
        ws_url = f"{platform.url.replace('http', 'ws')}/v1/sandboxes/{their_sb.sandbox_id}/tty"
        async with aiohttp.ClientSession() as s:
            async with s.ws_connect(ws_url, headers={"Cookie": cookie, "Origin": "http://evil.example"}) as ws:
                msg = await ws.receive(timeout=10)
                assert msg.type == aiohttp.WSMsgType.CLOSE and ws.close_code == 4401
            async with s.ws_connect(ws_url, headers={"Cookie": cookie, "Origin": platform.url}) as ws:
                await ws.send_bytes(b"echo ws-$((40+2))\n")
                seen = b""
                while b"ws-42" not in seen:
                    msg = await ws.receive(timeout=10)
                    assert msg.type == aiohttp.WSMsgType.BINARY, msg
                    seen += msg.data
    finally:
        await ctx.close()
        await mine.stop()
        await client.connect(their_sb.sandbox_id)
        await (await client.connect(their_sb.sandbox_id)).stop()


async def test_busiest_first_and_bad_input_is_a_clear_4xx(platform: Platform, client: dsec.AsyncClient) -> None:
    h = {"Authorization": f"Bearer {TOKEN}"}
    busy = await client.run_container(dsec.ContainerArgs(image="base/busybox", memory_limit_mb=64, job="console-top"))
    idle = await client.run_container(dsec.ContainerArgs(image="base/busybox", memory_limit_mb=64, job="console-top"))
    try:
        await busy.exec("timeout 2 sh -c 'while :; do :; done'; true")
        async with aiohttp.ClientSession(headers=h) as s:
            async with s.get(f"{platform.url}/v1/console/sandboxes?job=console-top&sort=-cpu&limit=5") as r:
                page = await r.json()
        assert [i["sandbox_id"] for i in page["items"]] == [busy.sandbox_id, idle.sandbox_id]
        assert page["items"][0]["usage"]["cpu_s"] > 0.5 > page["items"][1]["usage"]["cpu_s"]
        assert page["items"][0]["usage"]["pids"] >= 1  # the page's items carry their full usage
    finally:
        await busy.stop()
        await idle.stop()
    async with aiohttp.ClientSession(headers=h) as s:
        for query, field in (("sort=sideways", "sort"), ("limit=100000", "limit"), ("offset=-1", "offset"),
                             ("label=nolabel", "label"), ("offset=10001", "offset"), ("state=x&" * 11, "state")):
            async with s.get(f"{platform.url}/v1/console/sandboxes?{query}") as r:
                body = await r.json()
                assert r.status == 400, (query, body)
                assert body["field"] == field, body
        async with s.post(f"{platform.url}/ui/session", json={"token": ""}) as r:
            assert r.status == 400 and (await r.json())["field"] == "token"
        async with s.get(f"{platform.url}/ui/vendor/../../token") as r:
            assert r.status == 404
        async with s.get(f"{platform.url}/ui/static/..%2F..%2Fweb.py") as r:
            assert r.status == 404
    # a forged or tampered session is no session
    async with aiohttp.ClientSession() as s:
        for value in ("v1.admin.9999999999.deadbeef", "v1.admin.1.x", "garbage", "v2.admin.1.9999999999.\u00e9"):
            async with s.get(f"{platform.url}/v1/console/fleet", headers={"Cookie": f"dsec_session={value}"}) as r:
                assert r.status == 401, value


async def test_a_vms_screen_and_keys(browser: Browser, platform: Platform, client: dsec.AsyncClient) -> None:
    vm = await client.run_vm(dsec.VMArgs(memory_mb=512, display=True))
    ctx, page = await logged_in(browser, platform)
    try:
        await vm.exec("printf '\\033[2J\\033[HSCREEN IN THE CONSOLE\\n' > /dev/tty1")
        await page.goto(f"{platform.url}/ui/#/sandbox/{vm.sandbox_id}?tab=screen")
        await page.wait_for_function("() => { const i = document.querySelector('[data-testid=screen]');"
                                     " return i && i.complete && i.naturalWidth >= 320; }", timeout=WAIT_MS)
        # keys typed in the page reach the VM's console
        await vm.exec("(head -n1 < /dev/tty1 > /root/typed) >/dev/null 2>&1 &")
        await asyncio.sleep(0.5)
        await page.fill("input[name=keys]", "o k ret")
        await page.get_by_role("button", name="Send keys").click()
        for _ in range(50):
            if (await vm.exec("cat /root/typed")).stdout.strip() == "ok":
                break
            await asyncio.sleep(0.2)
        assert (await vm.exec("cat /root/typed")).stdout.strip() == "ok"
        await page.wait_for_timeout(2500)  # the next screenshot shows the typed line
        await shot(page, "vm-screen")
    finally:
        await ctx.close()
        await vm.stop()
