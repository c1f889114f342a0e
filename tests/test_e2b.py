"""The official E2B Python SDK (PyPI ``e2b``, unmodified) against dsec: control plane
(create, list, info, timeout, pause, connect, kill) and envd (commands with streaming,
stdin, background processes, signals, PTY; files), sync and async, and its errors."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import TOKEN, Platform
from e2b import (
    AsyncSandbox,
    AuthenticationException,
    CommandExitException,
    NotFoundException,
    PtySize,
    Sandbox,
    SandboxException,
)

import dsec


def test_the_issue_example(e2b_env: None) -> None:
    sbx = Sandbox.create("base/debian:12", timeout=300)
    assert sbx.commands.run("echo hello").stdout == "hello\n"
    sbx.files.write("/root/x.txt", "hi")
    assert sbx.files.read("/root/x.txt") == "hi"
    sbx.pause()
    assert Sandbox.get_info(sbx.sandbox_id).state.value == "paused"
    sbx = Sandbox.connect(sbx.sandbox_id)
    assert sbx.files.read("/root/x.txt") == "hi"  # the same sandbox, resumed
    sbx.kill()
    with pytest.raises(NotFoundException):
        Sandbox.connect(sbx.sandbox_id)


def test_commands(e2b_env: None) -> None:
    sbx = Sandbox.create(timeout=120, envs={"FROM_CREATE": "c"}, metadata={"run": "e2b-test"})
    try:
        seen: list[str] = []
        r = sbx.commands.run("echo $FROM_CREATE $X; pwd; echo err >&2", envs={"X": "x"}, cwd="/tmp",
                             on_stdout=seen.append)
        assert r.stdout == "c x\n/tmp\n" and r.stderr == "err\n" and r.exit_code == 0
        assert "".join(seen) == r.stdout
        with pytest.raises(CommandExitException) as e:
            sbx.commands.run("echo out; exit 3")
        assert e.value.exit_code == 3 and e.value.stdout == "out\n"
        # E2B's base has both `python` and `python3`; scripts call either
        assert sbx.commands.run("python -c 'print(6*7)'").stdout == "42\n"
        bg = sbx.commands.run("sleep 60", background=True)
        assert bg.pid in [p.pid for p in sbx.commands.list()]
        assert sbx.commands.kill(bg.pid)
        with pytest.raises(CommandExitException):
            bg.wait()
        cat = sbx.commands.run("cat", background=True, stdin=True)
        sbx.commands.send_stdin(cat.pid, "piped\n")
        sbx.commands.close_stdin(cat.pid)
        assert cat.wait().stdout == "piped\n"
        slow = sbx.commands.run("for i in 1 2 3; do echo $i; sleep 0.2; done", background=True)
        again = sbx.commands.connect(slow.pid)  # a second client attaches to a running process
        assert again.wait().stdout.strip().endswith("3")
        info = [s for s in Sandbox.list(query=None).next_items() if s.sandbox_id == sbx.sandbox_id]
        assert info and info[0].metadata == {"run": "e2b-test"}
    finally:
        sbx.kill()


def test_pty(e2b_env: None) -> None:
    sbx = Sandbox.create(timeout=120)
    try:
        out: list[bytes] = []
        term = sbx.pty.create(PtySize(rows=24, cols=80))
        sbx.pty.resize(term.pid, PtySize(rows=30, cols=100))
        sbx.pty.send_stdin(term.pid, b"stty size; exit\n")
        term.wait(on_pty=out.append)
        assert b"30 100" in b"".join(out)
    finally:
        sbx.kill()


def test_files(e2b_env: None) -> None:
    sbx = Sandbox.create(timeout=120)
    try:
        sbx.files.write("/work/a/b.bin", b"\x00\x01binary")
        assert sbx.files.read("/work/a/b.bin", format="bytes") == b"\x00\x01binary"
        assert sbx.files.exists("/work/a") and not sbx.files.exists("/work/nope")
        assert sbx.files.make_dir("/work/d") and not sbx.files.make_dir("/work/d")
        from e2b import InvalidArgumentException

        with pytest.raises(InvalidArgumentException, match="not a directory"):
            sbx.files.make_dir("/work/a/b.bin/sub")  # a component is a file: a clear 400, not a 500
        assert {e.name for e in sbx.files.list("/work")} == {"a", "d"}
        moved = sbx.files.rename("/work/a/b.bin", "/work/d/c.bin")
        assert moved.path == "/work/d/c.bin" and moved.size == 8
        sbx.files.remove("/work/d")
        assert not sbx.files.exists("/work/d/c.bin")
        with pytest.raises(NotFoundException):
            sbx.files.read("/work/missing")
    finally:
        sbx.kill()


def test_watch_dir(e2b_env: None) -> None:
    sbx = Sandbox.create(timeout=120)
    try:
        sbx.files.make_dir("/work/w")
        handle = sbx.files.watch_dir("/work/w", recursive=True)
        # sub/g is written right after mkdir, before the watch on sub can exist: the edge
        # must still report it (it failed CI once, when it came from the gap)
        sbx.commands.run("mkdir /work/w/sub && echo a > /work/w/f && echo b > /work/w/sub/g && rm /work/w/f")
        want = {("f", "create"), ("f", "write"), ("f", "remove"), ("sub", "create"), ("sub/g", "create")}
        seen: set[tuple[str, str]] = set()
        deadline = time.time() + 10
        while not want <= seen and time.time() < deadline:
            time.sleep(0.1)
            seen |= {(e.name, e.type.value) for e in handle.get_new_events()}
        assert want <= seen, seen
        handle.stop()
        with pytest.raises(NotFoundException):
            sbx.files.watch_dir("/work/none")
    finally:
        sbx.kill()


async def test_watch_dir_async(e2b_env: None) -> None:
    sbx = await AsyncSandbox.create(timeout=120)
    try:
        await sbx.files.make_dir("/work/w")
        got: list[tuple[str, str]] = []
        handle = await sbx.files.watch_dir("/work/w", on_event=lambda e: got.append((e.name, e.type.value)))
        await sbx.files.write("/work/w/new.txt", "x")
        for _ in range(50):
            if ("new.txt", "create") in got:
                break
            await asyncio.sleep(0.1)
        await handle.stop()
        assert ("new.txt", "create") in got, got
    finally:
        await sbx.kill()


def test_timeout_ends_the_sandbox(e2b_env: None) -> None:
    sbx = Sandbox.create(timeout=120)
    sbx.set_timeout(2)
    end = Sandbox.get_info(sbx.sandbox_id).end_at.timestamp()
    assert end - time.time() < 5
    deadline = time.time() + 30
    while time.time() < deadline and sbx.is_running():
        time.sleep(0.5)
    assert not sbx.is_running()


def test_errors(e2b_env: None, platform: Platform) -> None:
    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key="wrong-key")
    with pytest.raises(SandboxException, match="404: template 'no/such-template:1' not found"):
        Sandbox.create("no/such-template:1")
    assert Sandbox.kill("edge0-doesnotexist") is False  # the SDK's answer to a 404
    # E2B's own template names that are no dsec layer ref are missing templates, not bad input
    with pytest.raises(SandboxException, match="404: template 'httpbin' not found"):
        Sandbox.create("httpbin")
    # a route no face serves answers the error shape E2B's SDK reads (it raised KeyError 'code'
    # on FastAPI's {"detail": ...})
    for method, path, status in (("GET", "/no/such/route", 404), ("DELETE", "/v1/nodes", 405)):
        r = httpx.request(method, f"{platform.url}{path}", headers={"X-API-Key": TOKEN})
        body = r.json()
        assert r.status_code == status and body["code"] == status and body["message"], (r.status_code, body)
        assert body["error"] in ("not_found", "method_not_allowed")


def test_admission_refusal_is_rate_limit(tmp_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """429 when admission refuses: the SDK's RateLimitException, with dsec's reason."""
    from conftest import _seed_layers, stop_all
    from e2b import RateLimitException

    _seed_layers(str(tmp_path))
    # any memory pressure, even none, is too much, and memory counts as short below 2 TiB
    p = Platform(str(tmp_path), ["--admit-max-psi", "-1", "--pause-below-mb", str(1 << 20)])
    p.start()
    try:
        for k, v in {"E2B_API_URL": p.url, "E2B_SANDBOX_URL": p.url, "E2B_API_KEY": TOKEN}.items():
            monkeypatch.setenv(k, v)
        with pytest.raises(RateLimitException, match="memory pressure"):
            Sandbox.create(timeout=30)
    finally:
        stop_all(p)


def test_js_sdk(platform: Platform) -> None:
    """The E2B JS SDK (npm e2b, installed by scripts/setup.sh into tests/e2b_js)."""
    here = os.path.join(os.path.dirname(__file__), "e2b_js")
    env = {**os.environ, "E2B_API_URL": platform.url, "E2B_SANDBOX_URL": platform.url, "E2B_API_KEY": TOKEN}
    r = subprocess.run(["node", "smoke.mjs"], cwd=here, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"stdout": "hello from js\n", "read": "hi", "list": [".bashrc", ".profile", "x.txt"],
                   "exitCode": 3, "whoami": "user\n/home/user\n", "stdin": "echo through stdin\n", "pty": True,
                   "watched": True, "metadata": {"tag": "js"}, "listed": True, "afterConnect": "hi",
                   "running": False}, out


async def test_async_sdk(e2b_env: None) -> None:
    sbx = await AsyncSandbox.create(timeout=120)
    try:
        r = await sbx.commands.run("echo async")
        assert r.stdout == "async\n"
        await sbx.files.write("/root/a.txt", "A")
        assert await sbx.files.read("/root/a.txt") == "A"
    finally:
        await sbx.kill()


def test_users(e2b_env: None) -> None:
    """The ``base`` template acts as E2B's unprivileged ``user`` by default (commands,
    file owners, relative paths); ``user="root"`` asks for root; a template without that
    account (a bare layer ref) acts as root."""
    sbx = Sandbox.create("base", timeout=120)
    try:
        assert sbx.commands.run("id -un; pwd; echo $HOME").stdout == "user\n/home/user\n/home/user\n"
        assert sbx.commands.run("id -u", user="root").stdout == "0\n"
        # init itself drops to the user (no sandbox binary in between): no capabilities left,
        # and replacing setpriv, say, changes nothing
        sbx.commands.run("rm -f /usr/bin/setpriv", user="root")
        status = sbx.commands.run("grep -E '^(Uid|Gid|Groups|CapEff|CapPrm):' /proc/self/status").stdout
        assert status.split() == ["Uid:", *["1000"] * 4, "Gid:", *["1000"] * 4, "Groups:", "1000",
                                  "CapPrm:", "0" * 16, "CapEff:", "0" * 16], status
        info = sbx.files.write("notes/a.txt", "x")
        assert info.path == "/home/user/notes/a.txt"
        got = sbx.files.get_info("notes/a.txt")
        assert (got.owner, got.group) == ("user", "user")
        assert sbx.commands.run("stat -c %U:%G notes notes/a.txt").stdout == "user:user\nuser:user\n"
        assert sbx.commands.run("cat a.txt", cwd="notes").stdout == "x"  # a relative cwd is under home
        sbx.commands.run("ln -s a.txt notes/link")
        link = sbx.files.get_info("notes/link")
        assert (link.type.value, link.symlink_target) == ("file", "/home/user/notes/a.txt")
        with pytest.raises(SandboxException, match="does not exist"):
            sbx.commands.run("true", user="nobody-here")  # type: ignore[arg-type]
    finally:
        sbx.kill()
    bare = Sandbox.create("base/debian:12", timeout=120)
    try:
        assert bare.commands.run("id -un; pwd").stdout == "root\n/root\n"
    finally:
        bare.kill()


def test_list_pages_order_and_filters(e2b_env: None) -> None:
    from e2b import SandboxQuery, SandboxState

    tag = {"suite": os.urandom(4).hex()}
    made = [Sandbox.create(timeout=120, metadata=tag) for _ in range(3)]
    try:
        pager = Sandbox.list(query=SandboxQuery(metadata=tag), limit=2)
        first = pager.next_items()
        assert [s.sandbox_id for s in first] == [made[2].sandbox_id, made[1].sandbox_id]  # newest first
        assert pager.has_next
        assert [s.sandbox_id for s in pager.next_items()] == [made[0].sandbox_id] and not pager.has_next
        asc = Sandbox.list(query=SandboxQuery(metadata=tag), order="asc").next_items()
        assert [s.sandbox_id for s in asc] == [s.sandbox_id for s in made]
        assert Sandbox.list(query=SandboxQuery(metadata=tag, template="no-such")).next_items() == []
        later = made[1].get_info().started_at
        after = Sandbox.list(query=SandboxQuery(metadata=tag, started_after=later)).next_items()
        assert {s.sandbox_id for s in after} == {made[1].sandbox_id, made[2].sandbox_id}
        made[0].pause()
        paused = Sandbox.list(query=SandboxQuery(metadata=tag, state=[SandboxState.PAUSED])).next_items()
        assert [s.sandbox_id for s in paused] == [made[0].sandbox_id]
    finally:
        for s in made:
            s.kill()


def test_sandbox_gone_mid_command(e2b_env: None) -> None:
    """A command stream cut by the sandbox's end is the SDK's 'killed' error (the proxy's
    502 "was not found" answers its health probe), not an exit code."""
    from e2b import SandboxNotRunningException, TimeoutException

    sbx = Sandbox.create(timeout=120)
    cmd = sbx.commands.run("sleep 60", background=True)
    sbx.kill()
    with pytest.raises(TimeoutException, match="killed or reached its end of life") as err:
        cmd.wait()
    assert isinstance(err.value, SandboxNotRunningException)
    with pytest.raises(SandboxNotRunningException):
        sbx.files.read("/etc/hostname")


def test_timeouts_and_auto_pause(e2b_env: None) -> None:
    from e2b import TimeoutException

    sbx = Sandbox.create(timeout=300, lifecycle={"on_timeout": "pause"})
    try:
        with pytest.raises(TimeoutException):
            sbx.commands.run("sleep 10", timeout=1)  # the stream's deadline, kept by the server
        before = sbx.get_info().end_at
        Sandbox.connect(sbx.sandbox_id, timeout=10)  # never shortens a running sandbox's timeout
        assert sbx.get_info().end_at == before
        sbx.files.write("/root/kept.txt", "kept")
        sbx.set_timeout(0)  # the timeout pauses it (autoPause) rather than ending it
        deadline = time.time() + 30
        while time.time() < deadline and sbx.is_running():
            time.sleep(0.3)
        assert Sandbox.get_info(sbx.sandbox_id).state.value == "paused"
        resumed = Sandbox.connect(sbx.sandbox_id)
        assert resumed.files.read("/root/kept.txt") == "kept"
        assert resumed.get_info().end_at.timestamp() > time.time() + 60  # a fresh timeout on resume
    finally:
        sbx.kill()


def test_snapshots_and_fork(e2b_env: None) -> None:
    """Snapshots are the sandbox's writes as a workspace layer over its stack; a sandbox
    created from the snapshot's id has those files; fork does the same for live copies."""
    sbx = Sandbox.create(timeout=120)
    made: list[Sandbox] = []
    try:
        sbx.files.write("state.txt", "before")
        snap = sbx.create_snapshot(name="my snap_1")
        assert snap.names == ["my snap_1"]
        sbx.files.write("state.txt", "after")
        restored = Sandbox.create(snap.snapshot_id, timeout=60)
        made.append(restored)
        assert restored.files.read("state.txt") == "before"
        assert restored.commands.run("id -un").stdout == "user\n"  # the template's stack came along
        listed = Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id).next_items()
        assert [s.snapshot_id for s in listed] == [snap.snapshot_id]
        assert Sandbox.list_snapshots(name="other").next_items() == []
        forks = sbx.fork(count=2, timeout=60)
        made += forks
        assert len({f.sandbox_id for f in forks} | {sbx.sandbox_id}) == 3
        forks[0].files.write("state.txt", "fork 0")
        assert [f.files.read("state.txt") for f in forks] == ["fork 0", "after"]
        assert sbx.files.read("state.txt") == "after" and sbx.is_running()
        with pytest.raises(SandboxException):  # a running sandbox still uses the snapshot
            Sandbox.delete_snapshot(snap.snapshot_id)
        restored.kill()
        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
        assert Sandbox.delete_snapshot(snap.snapshot_id) is False
    finally:
        for s in [sbx, *made]:
            s.kill()
    from e2b import SandboxNotFoundException

    with pytest.raises(SandboxNotFoundException):
        sbx.fork()


def test_metrics(e2b_env: None) -> None:
    import datetime

    sbx = Sandbox.create(timeout=60)
    try:
        sbx.commands.run("head -c 20000000 /dev/urandom > ~/blob")
        (m,) = sbx.get_metrics()
        assert m.mem_total == 512 << 20 and 0 < m.mem_used <= m.mem_total
        assert m.disk_used >= 20_000_000 and m.disk_total == 10240 << 20
        assert m.cpu_count == 1 and m.cpu_used_pct > 0
        assert abs(m.timestamp.timestamp() - time.time()) < 10
        long_ago = datetime.datetime.now(datetime.UTC) - datetime.timedelta(hours=1)
        assert sbx.get_metrics(start=long_ago, end=long_ago + datetime.timedelta(minutes=1)) == []
    finally:
        sbx.kill()


def test_signed_file_urls(e2b_env: None) -> None:
    """A signed URL is its own credential: no token header, no sandbox id; it is refused
    once expired or when any part of it is changed."""
    import urllib.error
    import urllib.request

    sbx = Sandbox.create(timeout=60)
    try:
        sbx.files.write("s.txt", "signed")
        for url in (sbx.download_url("s.txt", "user"), sbx.download_url("s.txt", "user", 120)):
            with urllib.request.urlopen(url) as resp:
                assert resp.read() == b"signed"
        for bad, message in ((sbx.download_url("s.txt", "user", use_signature_expiration=-120),
                              "signature is already expired"),
                             (sbx.download_url("s.txt", "user").replace("s.txt", "other.txt"), "invalid signature")):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(bad)
            assert err.value.code == 401
            assert json.loads(err.value.read()) == {"code": 401, "message": message}
    finally:
        sbx.kill()


def test_file_metadata_and_watch_entries(e2b_env: None) -> None:
    """File metadata are user.e2b.* extended attributes on the file (set by the upload,
    replaced by the next one, visible when set from inside); watch events can carry the
    entry."""
    from e2b import InvalidArgumentException

    sbx = Sandbox.create(timeout=60)
    try:
        info = sbx.files.write("m.txt", "x", metadata={"Author": "mish"})
        assert info.metadata == {"author": "mish"}
        assert sbx.files.get_info("m.txt").metadata == {"author": "mish"}
        assert sbx.commands.run("getfattr --version >/dev/null 2>&1 || python3 -c \"import os; "
                                "print(os.getxattr('m.txt', 'user.e2b.author').decode())\"").stdout == "mish\n"
        assert sbx.files.rename("m.txt", "n.txt").metadata == {"author": "mish"}
        assert sbx.files.write("n.txt", "y").metadata is None
        assert sbx.files.get_info("n.txt").metadata is None
        sbx.commands.run("python3 -c \"import os; os.setxattr('n.txt', 'user.e2b.k', b'v')\"")
        assert [e.metadata for e in sbx.files.list(".") if e.name == "n.txt"] == [{"k": "v"}]
        with pytest.raises(InvalidArgumentException):
            sbx.files.write("bad.txt", "x", metadata={"bad key": "v"})
        sbx.files.make_dir("w")
        handle = sbx.files.watch_dir("w", include_entry=True)
        sbx.files.write("w/f.txt", "hello")
        time.sleep(0.3)
        created = [e for e in handle.get_new_events() if e.type.value == "create"]
        assert created and created[0].entry is not None and created[0].entry.path == "/home/user/w/f.txt"
        handle.stop()
    finally:
        sbx.kill()


def test_code_interpreter(e2b_env: None) -> None:
    """PyPI e2b-code-interpreter, unmodified, on the code-interpreter-v1 template: cells run
    in a Jupyter kernel inside the sandbox (as its user), state persists between cells,
    output streams to callbacks as it is printed, rich results and errors come back."""
    from e2b_code_interpreter import Sandbox as CodeSandbox

    sbx = CodeSandbox.create(timeout=120)
    try:
        assert sbx.run_code("x = 41; x + 1").text == "42"
        seen: list[tuple[float, str]] = []
        t0 = time.time()
        cell = "import os, time\nprint('a', flush=True); time.sleep(1.5); print(os.getuid(), os.environ['K'])"
        ex = sbx.run_code(cell, on_stdout=lambda m: seen.append((time.time() - t0, m.line)), envs={"K": "v"})
        assert ex.logs.stdout == ["a\n", "1000 v\n"] and ex.error is None
        assert seen[0][0] < seen[1][0] - 1.0  # the first line arrived before the cell ended
        assert sbx.run_code("import os; os.environ.get('K')").text is None  # envs are the cell's only
        err = sbx.run_code("1/0").error
        assert err is not None and err.name == "ZeroDivisionError"
        html = sbx.run_code("from IPython.display import HTML; HTML('<b>hi</b>')")
        assert html.results[0].html == "<b>hi</b>"
        ctx = sbx.create_code_context(cwd="/tmp")
        assert sbx.run_code("import os; os.getcwd()", context=ctx).text == "'/tmp'"
        assert sbx.run_code("x", context=ctx).error is not None  # a context is its own kernel
        assert {c.id for c in sbx.list_code_contexts()} >= {ctx.id}
        sbx.remove_code_context(ctx)
        assert ctx.id not in {c.id for c in sbx.list_code_contexts()}
    finally:
        sbx.kill()


def test_watchers_are_bounded_and_released(e2b_env: None, platform: Platform) -> None:
    """Watchers a client never removes are bounded per sandbox and released with it."""
    from dsec.node.edge.interactive import MAX_WATCHERS_PER_SANDBOX

    assert platform.proc is not None
    fd_dir = f"/proc/{platform.proc.pid}/fd"

    def inotify_fds() -> int:
        n = 0
        for f in os.listdir(fd_dir):
            try:
                n += os.readlink(f"{fd_dir}/{f}") == "anon_inode:inotify"
            except FileNotFoundError:
                pass
        return n

    before = inotify_fds()
    sbx = Sandbox.create(timeout=60)
    try:
        handles = [sbx.files.watch_dir("/tmp") for _ in range(MAX_WATCHERS_PER_SANDBOX)]
        assert inotify_fds() >= before + MAX_WATCHERS_PER_SANDBOX
        with pytest.raises(SandboxException, match="watchers per sandbox"):
            sbx.files.watch_dir("/tmp")
        handles[0].stop()
        sbx.files.watch_dir("/tmp")  # a removed watcher's place is free again
    finally:
        sbx.kill()
    other = Sandbox.create(timeout=60)
    try:
        other.files.watch_dir("/tmp").stop()
        assert inotify_fds() <= before  # the edge released the dead sandbox's watchers with it
    finally:
        other.kill()


def test_malformed_envd_requests_are_400(e2b_env: None, platform: Platform) -> None:
    """Hostile or broken clients speaking envd's wire format directly get Connect's
    invalid_argument (HTTP 400) naming what is wrong, never a 500."""
    import httpx

    sbx = Sandbox.create(timeout=60)
    try:
        headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token or "",
                   "Content-Type": "application/json"}
        bad = [("/filesystem.Filesystem/ListDir", {"path": "/", "depth": "deep"}),
               ("/process.Process/SendInput", {"process": {"pid": "x"}, "input": {"stdin": "!!"}}),
               ("/process.Process/Update", {"process": 5}),
               ("/filesystem.Filesystem/Stat", ["not", "an", "object"])]
        for route, body in bad:
            r = httpx.post(platform.url + route, json=body, headers=headers)
            assert r.status_code == 400 and r.json()["code"] == "invalid_argument", (route, r.text)
        r = httpx.post(platform.url + "/files?path=x", headers={**headers, "X-Metadata-ok": b"\xe9"},
                       content=b"x")
        assert r.status_code == 400 and "metadata" in r.json()["message"], r.text
    finally:
        sbx.kill()


def test_command_log_keys(e2b_env: None, platform: Platform) -> None:
    """``DSEC_COMMAND_KEY`` in a command's envs is a command log key (docs/rl.md): the
    same key again answers from the record and runs nothing; another command under it is
    refused naming the key; the process never sees the variable."""
    import httpx
    from e2b import InvalidArgumentException, TimeoutException

    sbx = Sandbox.create("base/debian:12", timeout=120)  # root: keyed commands run as root only
    try:
        key = f"e2b/{os.urandom(4).hex()}"
        cmd = 'echo ran >> /root/runs; echo "key=[$DSEC_COMMAND_KEY] x=$X"; echo err >&2'
        seen: list[str] = []
        first = sbx.commands.run(cmd, envs={"DSEC_COMMAND_KEY": key, "X": "x"})
        again = sbx.commands.run(cmd, envs={"DSEC_COMMAND_KEY": key, "X": "x"}, on_stdout=seen.append)
        assert (first.stdout, first.stderr, first.exit_code) == ("key=[] x=x\n", "err\n", 0)
        assert (again.stdout, again.stderr, again.exit_code) == (first.stdout, first.stderr, 0)
        assert "".join(seen) == first.stdout  # a replay streams its recorded output too
        assert sbx.commands.run("wc -l < /root/runs").stdout == "1\n"

        failing = f"{key}-exit"
        for _ in range(2):
            with pytest.raises(CommandExitException) as e:
                sbx.commands.run("echo ran >> /root/exits; echo no; exit 3", envs={"DSEC_COMMAND_KEY": failing})
            assert (e.value.exit_code, e.value.stdout) == (3, "no\n")
        assert sbx.commands.run("wc -l < /root/exits").stdout == "1\n"

        with pytest.raises(SandboxException, match=f"ALREADY_EXISTS: DSEC_COMMAND_KEY: key '{key}'") as conflict:
            sbx.commands.run("echo other", envs={"DSEC_COMMAND_KEY": key, "X": "x"})
        assert "different command" in str(conflict.value)
        with pytest.raises(SandboxException, match=key):  # the envs are part of the command
            sbx.commands.run(cmd, envs={"DSEC_COMMAND_KEY": key, "X": "y"})
        with pytest.raises(InvalidArgumentException, match="DSEC_COMMAND_KEY"):
            sbx.commands.run("true", envs={"DSEC_COMMAND_KEY": "no spaces allowed"})
        with pytest.raises(InvalidArgumentException, match="PTY"):
            sbx.pty.create(PtySize(rows=24, cols=80), envs={"DSEC_COMMAND_KEY": f"{key}-pty"})
        with pytest.raises(InvalidArgumentException, match="stdin"):
            sbx.commands.run("cat", stdin=True, envs={"DSEC_COMMAND_KEY": f"{key}-stdin"})
        assert sbx.commands.run("wc -l < /root/runs").stdout == "1\n"

        # the records are the edge's command log, the same one dsec's own exec keys use
        log = httpx.get(f"{platform.url}/v1/sandboxes/{sbx.sandbox_id}/commands",
                        headers={"Authorization": f"Bearer {TOKEN}"}).json()
        assert {r["key"]: r["result"]["exit_code"] for r in log} == {key: 0, failing: 3}

        # a run cut by its stream's deadline is recorded timed out, and a retry gets that
        slow = f"{key}-slow"
        for _ in range(2):
            with pytest.raises(TimeoutException):
                sbx.commands.run("sleep 5", timeout=1, envs={"DSEC_COMMAND_KEY": slow})
    finally:
        sbx.kill()


async def test_command_log_keys_concurrent_and_users(e2b_env: None) -> None:
    """Concurrent runs under one key run the command once and all get its result; a keyed
    command runs as the user it would run as without the key (E2B's ``user`` by default)."""
    sbx = await AsyncSandbox.create("base", timeout=120)
    try:
        key = f"e2b-par-{os.urandom(4).hex()}"
        cmd = "sleep 1; echo ran >> /root/par; id -un"
        results = await asyncio.gather(*[sbx.commands.run(cmd, user="root", envs={"DSEC_COMMAND_KEY": key})
                                         for _ in range(5)])
        assert {(r.stdout, r.exit_code) for r in results} == {("root\n", 0)}
        assert (await sbx.commands.run("wc -l < /root/par", user="root")).stdout == "1\n"
        mine = "echo ran >> runs; id -un; pwd; stat -c %U runs"
        first = await sbx.commands.run(mine, envs={"DSEC_COMMAND_KEY": f"{key}-user"})
        again = await sbx.commands.run(mine, envs={"DSEC_COMMAND_KEY": f"{key}-user"})
        assert first.stdout == again.stdout == "user\n/home/user\nuser\n"
        assert (await sbx.commands.run("wc -l < runs")).stdout == "1\n"
        with pytest.raises(SandboxException, match="DSEC_COMMAND_KEY"):  # the same key as another user
            await sbx.commands.run(mine, user="root", envs={"DSEC_COMMAND_KEY": f"{key}-user"})
    finally:
        await sbx.kill()


@pytest.fixture(scope="module")
def internet_platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    """A node whose operator says E2B's "internet" is PyPI (DSEC_E2B_INTERNET): the
    registries are the only outside services these machines reach."""
    from conftest import own_platform
    yield from own_platform(tmp_path_factory, "e2b-internet", env={"DSEC_E2B_INTERNET": "pypi"})


PIP = "cd /tmp && pip download --no-deps --no-cache-dir -q six && echo fetched"


def test_network_options_map_to_egress_rules(internet_platform: Platform, monkeypatch: pytest.MonkeyPatch) -> None:
    """E2B's allow_internet_access, network.allowOut/denyOut and update_network, with the
    unmodified SDK, as dsec egress rules: "internet" is what the operator named."""
    for k, v in {"E2B_API_URL": internet_platform.url, "E2B_SANDBOX_URL": internet_platform.url,
                 "E2B_API_KEY": TOKEN}.items():
        monkeypatch.setenv(k, v)
    sbx = Sandbox.create(timeout=120)  # E2B's default: internet on
    closed = Sandbox.create(timeout=120, allow_internet_access=False)
    only = Sandbox.create(timeout=120, network={"deny_out": ["0.0.0.0/0"], "allow_out": ["192.0.2.7"]})
    try:
        assert sbx.commands.run(PIP, timeout=120).stdout.endswith("fetched\n")
        with pytest.raises(CommandExitException):
            closed.commands.run(PIP, timeout=60)
        with pytest.raises(CommandExitException):
            only.commands.run(PIP, timeout=60)
        with dsec.Client(url=internet_platform.url, token=TOKEN) as c:
            rules = c.connect(only.sandbox_id).info.network
        assert rules is not None and rules.rules == {"192.0.2.7:1-65535/tcp": True, "192.0.2.7:1-65535/udp": True}
        # an update replaces the whole egress: denied, then allowed again
        sbx.update_network({"deny_out": ["0.0.0.0/0"]})
        with pytest.raises(CommandExitException):
            sbx.commands.run(PIP, timeout=60)
        sbx.update_network({"allow_internet_access": True})
        assert sbx.commands.run(PIP, timeout=120).stdout.endswith("fetched\n")
        # what dsec cannot say is refused, naming the field
        for bad in ({"allow_out": ["pypi.example"]}, {"deny_out": ["198.51.100.0/24"]}):
            with pytest.raises(SandboxException, match="400: network"):
                Sandbox.create(timeout=60, network=bad)  # type: ignore[arg-type]
        # a sandbox created with no link (no internet asked, none to give) says why it cannot change
        with pytest.raises(SandboxException, match="409: .*without a network link"):
            closed.update_network({"allow_out": ["192.0.2.7"]})
    finally:
        for s in (sbx, closed, only):
            s.kill()
