"""Daytona's API on dsec, driven by the unmodified ``daytona`` SDK (sync and async) against
the session's embedded server: create from a snapshot or an image name, exec (with a
timeout), code_run, files, sessions, labels, stop/start, delete, errors, and another
project's sandbox as a 404."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import httpx
import pytest
from conftest import TOKEN, Platform
from daytona import (
    AsyncDaytona,
    CreateSandboxFromImageParams,
    CreateSandboxFromSnapshotParams,
    Daytona,
    DaytonaConfig,
    DaytonaConflictError,
    DaytonaError,
    DaytonaNotFoundError,
    DaytonaTimeoutError,
    FileUpload,
    Image,
    ListSandboxesQuery,
    Resources,
    SessionExecuteRequest,
)
from daytona.common.errors import DaytonaAuthenticationError, DaytonaFileNotFoundError

import dsec


@pytest.fixture
def dtn_env(platform: Platform, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("DAYTONA_API_URL", f"{platform.url}/daytona")
    monkeypatch.setenv("DAYTONA_API_KEY", TOKEN)
    monkeypatch.setenv("DAYTONA_TARGET", "dsec")
    yield


def test_lifecycle_exec_files_sessions(dtn_env: None, platform: Platform) -> None:
    d = Daytona()
    sb = d.create(CreateSandboxFromSnapshotParams(snapshot="base/debian:12", labels={"task": "t1"},
                                                  env_vars={"GREETING": "hi"}, auto_stop_interval=30))
    try:
        assert sb.state == "started" and sb.id.count("-") >= 1
        # exec: output (both streams, as one), exit code, env, cwd, timeout
        r = sb.process.exec("echo out; echo err >&2; echo $GREETING; exit 3")
        assert r.exit_code == 3 and r.result.split() == ["out", "err", "hi"]
        assert sb.process.exec("pwd", cwd="/tmp").result.strip() == "/tmp"
        assert sb.process.exec("echo $X", env={"X": "y"}).result.strip() == "y"
        with pytest.raises(DaytonaTimeoutError):
            sb.process.exec("sleep 5", timeout=1)
        r = sb.process.code_run("import sys\nprint(sum(range(10)), sys.argv[1:])")
        assert r.exit_code == 0 and r.result.strip() == "45 []"

        # files
        sb.fs.upload_file(b"hello\nworld\n", "/root/a/b.txt")
        assert sb.fs.download_file("/root/a/b.txt") == b"hello\nworld\n"
        sb.fs.upload_files([FileUpload(source=b"x = 1\n", destination="rel.py")])  # relative: the workdir
        assert sb.process.exec("cat /root/rel.py").result == "x = 1\n"
        names = {f.name: f for f in sb.fs.list_files("/root/a")}
        assert names["b.txt"].size == 12 and not names["b.txt"].is_dir
        assert sb.fs.get_file_info("/root/a").is_dir
        matches = sb.fs.find_files("/root/a", "world")
        assert [(x.file, x.line, x.content) for x in matches] == [("/root/a/b.txt", 2, "world")]
        assert sb.fs.search_files("/root", "*.txt").files == ["/root/a/b.txt"]
        res = sb.fs.replace_in_files(["/root/a/b.txt"], "world", "there")
        assert res[0].success and sb.fs.download_file("/root/a/b.txt") == b"hello\nthere\n"
        sb.fs.set_file_permissions("/root/a/b.txt", mode="600")
        assert sb.fs.get_file_info("/root/a/b.txt").permissions == "0600"
        sb.fs.create_folder("/root/new", "755")
        sb.fs.move_files("/root/a/b.txt", "/root/new/c.txt")
        assert [f.name for f in sb.fs.list_files("/root/new")] == ["c.txt"]
        sb.fs.delete_file("/root/new", recursive=True)
        with pytest.raises(DaytonaFileNotFoundError):
            sb.fs.download_file("/root/new/c.txt")
        with pytest.raises(DaytonaNotFoundError):
            sb.fs.get_file_info("/nope")

        # sessions: state between commands, command ids, logs, async commands
        sb.process.create_session("s1")
        r1 = sb.process.execute_session_command("s1", SessionExecuteRequest(command="cd /tmp && export V=7"))
        assert r1.exit_code == 0 and r1.cmd_id
        r2 = sb.process.execute_session_command("s1", SessionExecuteRequest(command="echo $V $(pwd); echo e >&2"))
        assert (r2.exit_code, r2.stdout, r2.stderr) == (0, "7 /tmp\n", "e\n")
        r3 = sb.process.execute_session_command("s1", SessionExecuteRequest(command="sleep 1; echo done",
                                                                            run_async=True))
        assert r3.exit_code is None
        for _ in range(50):
            if sb.process.get_session_command("s1", r3.cmd_id).exit_code is not None:
                break
            asyncio.run(asyncio.sleep(0.2))
        assert sb.process.get_session_command("s1", r3.cmd_id).exit_code == 0
        assert sb.process.get_session_command_logs("s1", r3.cmd_id).stdout == "done\n"
        session = sb.process.get_session("s1")
        assert [c.id for c in session.commands] == [r1.cmd_id, r2.cmd_id, r3.cmd_id]
        assert [s.session_id for s in sb.process.list_sessions()] == ["s1"]
        sb.process.delete_session("s1")
        assert sb.process.list_sessions() == []

        # labels and list
        assert sb.labels["task"] == "t1"
        listed = list(d.list(query=ListSandboxesQuery(labels={"task": "t1"})))
        assert [x.id for x in listed] == [sb.id]
        assert d.get(sb.id).labels["task"] == "t1"

        # preview link: a server on a port, reached with the link's token
        sb.process.exec("nohup python3 -m http.server 8123 -d /root >/dev/null 2>&1 &")
        link = sb.get_preview_link(8123)
        for _ in range(50):
            resp = httpx.get(f"{link.url}/rel.py", headers={"x-daytona-preview-token": link.token})
            if resp.status_code == 200:
                break
            asyncio.run(asyncio.sleep(0.1))
        assert resp.text == "x = 1\n"
        assert httpx.get(f"{link.url}/rel.py", headers={"x-daytona-preview-token": "wrong"}).status_code == 401

        # stop keeps the files (dsec's pause), start brings it back
        sb.stop()
        assert sb.state == "stopped" and d.get(sb.id).state == "stopped"
        sb.start()
        assert sb.state == "started"
        assert sb.process.exec("cat /root/rel.py").result == "x = 1\n"
    finally:
        d.delete(sb)
    with pytest.raises(DaytonaNotFoundError):
        d.get(sb.id)
    with dsec.Client(url=platform.url, token=TOKEN) as c:
        assert c.connect(sb.id).info.state.value == "stopped"  # deleted: dsec stopped it


def test_rl_backend_calls_async(dtn_env: None, platform: Platform) -> None:
    """What verl's, rLLM's and verifiers' Daytona backends do: create from a snapshot with
    resources, upload files, exec with a timeout, download, delete (async SDK)."""

    async def main() -> None:
        async with AsyncDaytona() as d:
            sb = await d.create(CreateSandboxFromImageParams(image="debian:12", resources=Resources(cpu=1, memory=1),
                                                             auto_delete_interval=0, auto_stop_interval=5,
                                                             ttl_minutes=30))
            try:
                assert sb.cpu == 1 and sb.memory == 1
                async with dsec.AsyncClient(url=platform.url, token=TOKEN) as c:  # ttl_minutes: its lifetime
                    info = (await c.connect(sb.id)).info
                assert info.expires_at is not None and abs(info.expires_at - info.created_at - 1800) < 5
                await sb.fs.upload_file(b"print(6 * 7)\n", "/tmp/solution.py")
                r = await sb.process.exec("python3 /tmp/solution.py", timeout=30)
                assert (r.exit_code, r.result) == (0, "42\n")
                await sb.process.exec("echo 1 > /tmp/out.txt")
                assert await sb.fs.download_file("/tmp/out.txt") == b"1\n"
                await sb.stop()  # ephemeral (auto_delete_interval=0): stopping deletes it
                assert sb.state == "destroyed"
                with pytest.raises(DaytonaNotFoundError):
                    await d.get(sb.id)
            finally:
                if sb.state != "destroyed":
                    await d.delete(sb)
    asyncio.run(main())


def test_rllm_python_interpreter_calls(dtn_env: None, platform: Platform) -> None:
    """The calls rLLM's DaytonaPythonInterpreter makes (rllm/tools/code_tools/daytona_tool.py,
    read from its source): the key in DaytonaConfig and the URL from the environment, n sandboxes
    from ``CreateSandboxFromSnapshotParams(language="python")`` (no snapshot named), code_run
    with a timeout round-robin, a failing run read as exit_code != 0 with the traceback in
    ``result``, a restart (delete, then create again) and the cleanup."""
    d = Daytona(DaytonaConfig(api_key=TOKEN))
    sbs = [d.create(CreateSandboxFromSnapshotParams(language="python")) for _ in range(2)]
    try:
        r = sbs[0].process.code_run("print('Hello, world!')\nimport math\nprint(math.sqrt(4))", timeout=20)
        assert (r.exit_code, r.result.split()) == (0, ["Hello,", "world!", "2.0"])
        r = sbs[1].process.code_run("import math\nmath.sqrt(4)\nmath.lol", timeout=20)
        assert r.exit_code != 0 and "AttributeError" in r.result and "lol" in r.result
        d.delete(sbs[0])
        sbs[0] = d.create(CreateSandboxFromSnapshotParams(language="python"))
        assert sbs[0].process.code_run("print(6 * 7)", timeout=20).result.strip() == "42"
    finally:
        for sb in sbs:
            with contextlib.suppress(DaytonaNotFoundError):
                d.delete(sb)
    with pytest.raises(DaytonaNotFoundError):
        d.get(sbs[1].id)


def test_git(dtn_env: None) -> None:
    d = Daytona()
    sb = d.create(CreateSandboxFromSnapshotParams(snapshot="base/debian:12"))
    try:
        sb.process.exec("git init -q -b main /root/repo && echo one > /root/repo/a.txt")
        st = sb.git.status("/root/repo")
        assert st.current_branch == "main"
        assert [(f.name, f.worktree) for f in st.file_status] == [("a.txt", "Untracked")]
        sb.git.add("/root/repo", ["a.txt"])
        assert sb.git.status("/root/repo").file_status[0].staging == "Added"
        commit = sb.git.commit("/root/repo", "first", "A U Thor", "a@example.com")
        assert len(commit.sha) == 40
        assert sb.git.status("/root/repo").file_status == []
        sb.git.clone("/root/repo", "/root/clone")  # a local path: the sandbox reaches no network here
        assert sb.process.exec("cat /root/clone/a.txt; git -C /root/clone log --format=%an:%s").result == \
            "one\nA U Thor:first\n"
        with pytest.raises(DaytonaError):
            sb.git.status("/tmp")
    finally:
        d.delete(sb)


def test_image_with_steps_is_built_once(dtn_env: None, platform: Platform) -> None:
    """An image with build steps is built by dsec's template builder, once: the next create
    with the same image starts from the built template."""
    d = Daytona()
    image = Image.base("debian:12").run_commands("echo built > /opt/marker").env({"K": "v w"}).workdir("/opt")
    made = []
    try:
        for _ in range(2):
            made.append(d.create(CreateSandboxFromImageParams(image=image), timeout=300))
        for sb in made:
            assert sb.process.exec("cat marker; echo $K").result == "built\nv w\n"
        name = made[0].snapshot
        assert name is not None and name.startswith("daytona-") and made[1].snapshot == name
        # E2B's template API sees the same template: built once, spawned twice
        t = httpx.get(f"{platform.url}/templates/{name}", headers={"Authorization": f"Bearer {TOKEN}"}).json()
        assert (t["buildCount"], t["spawnCount"], t["buildStatus"]) == (1, 2, "ready")
    finally:
        for sb in made:
            d.delete(sb)


def test_errors_and_refusals(dtn_env: None, platform: Platform) -> None:
    d = Daytona()
    with pytest.raises(DaytonaNotFoundError):
        d.get("n1-0000000000000000")
    with pytest.raises(DaytonaNotFoundError, match="snapshot"):
        d.create(CreateSandboxFromSnapshotParams(snapshot="no/such:1"), timeout=30)
    with pytest.raises(DaytonaError, match="image"):

        d.create(CreateSandboxFromImageParams(image=Image.debian_slim("3.12").pip_install("numpy")), timeout=30)
    # a name: found by get, and a second sandbox of that name is a conflict
    named = d.create(CreateSandboxFromSnapshotParams(name="dtn-named"))
    try:
        assert named.name == "dtn-named" and d.get("dtn-named").id == named.id
        with pytest.raises(DaytonaConflictError):
            d.create(CreateSandboxFromSnapshotParams(name="dtn-named"))
        with pytest.raises(DaytonaError, match="labels"):  # labels are set at create only
            named.set_labels({"a": "b"})
    finally:
        d.delete(named)
    bad = Daytona(DaytonaConfig(api_key="not-a-token", api_url=f"{platform.url}/daytona", target="dsec"))
    with pytest.raises(DaytonaAuthenticationError):
        list(bad.list())
    # a route dsec does not serve: Daytona's envelope, with the path named
    r = httpx.get(f"{platform.url}/daytona/volumes", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 404 and r.json()["statusCode"] == 404 and "volumes" in r.json()["message"]


def test_other_project_is_404(dtn_env: None, platform: Platform) -> None:
    with dsec.Client(url=platform.url, token=TOKEN) as c:
        mine = c.create_token("default", "runner", "daytona-test")
        theirs = c.create_token("elsewhere", "runner", "daytona-test")
    try:
        url = f"{platform.url}/daytona"
        d = Daytona(DaytonaConfig(api_key=mine.token, api_url=url, target="dsec"))
        other = Daytona(DaytonaConfig(api_key=theirs.token, api_url=url, target="dsec"))
        sb = d.create()
        try:
            with pytest.raises(DaytonaNotFoundError):
                other.get(sb.id)
            assert sb.id not in [x.id for x in other.list()]
            r = httpx.post(f"{url}/toolbox/{sb.id}/process/execute", json={"command": "true"},
                           headers={"Authorization": f"Bearer {theirs.token}"})
            assert r.status_code == 404
        finally:
            d.delete(sb)
    finally:
        with dsec.Client(url=platform.url, token=TOKEN) as c:
            c.revoke_token(mine.id)
            c.revoke_token(theirs.id)



