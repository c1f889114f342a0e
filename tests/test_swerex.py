"""SWE-ReX's ``RemoteRuntime`` (PyPI swe-rex, unmodified) against dsec's SWE-ReX face,
and mini-swe-agent's own agent loop (PyPI mini-swe-agent, its scripted model, no LLM)
on ``dsec.client.integrations.mini_swe_agent.DsecEnvironment``: sessions, commands, files,
uploads, the errors SWE-ReX's client raises again, auth, and a full episode."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import aiohttp
import httpx
import pytest
from conftest import TOKEN, Platform
from swerex.exceptions import (
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
)
from swerex.runtime.abstract import (
    BashAction,
    BashInterruptAction,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)
from swerex.runtime.remote import RemoteRuntime

import dsec


def runtime(platform: Platform, sid: str, token: str = TOKEN) -> RemoteRuntime:
    # as SWE-agent's RemoteDeployment builds it: the sandbox's URL as host, no port
    return RemoteRuntime(host=f"{platform.url}/swerex/{sid}", auth_token=token, timeout=10)


async def test_sessions(platform: Platform, debian: dsec.AsyncSandbox) -> None:
    rt = runtime(platform, debian.sandbox_id)
    assert (await rt.is_alive()).is_alive
    await debian.write_file("/root/.swerexrc", "export FROM_RC=rc\necho sourced\n")
    created = await rt.create_session(CreateBashSessionRequest(startup_source=["/root/.swerexrc", "/nonexistent"]))
    assert created.output == "sourced\n/nonexistent: No such file or directory\n"
    with pytest.raises(SessionExistsError):
        await rt.create_session(CreateBashSessionRequest())

    # state persists between commands: cwd, exports, functions; stderr is in the output
    assert (await rt.run_in_session(BashAction(command="cd /tmp && export FOO=bar && f() { echo fn-$1; }"))
            ).exit_code == 0
    obs = await rt.run_in_session(BashAction(command="pwd; echo $FOO $FROM_RC; f x; echo err >&2"))
    assert (obs.output, obs.exit_code) == ("/tmp\nbar rc\nfn-x\nerr\n", 0)
    obs = await rt.run_in_session(BashAction(command="cat <<'EOF'\n$FOO\nEOF\necho $FOO"))
    assert obs.output == "$FOO\nbar\n"

    # check: raise (the default) / silent / ignore
    with pytest.raises(NonZeroExitCodeError) as err:
        await rt.run_in_session(BashAction(command="echo partial; (exit 3)", error_msg="step failed"))
    assert str(err.value).startswith("step failed") and "3" in str(err.value) and "partial" in str(err.value)
    assert (await rt.run_in_session(BashAction(command="(exit 4)", check="silent"))).exit_code == 4
    assert (await rt.run_in_session(BashAction(command="false", check="ignore"))).exit_code is None
    with pytest.raises(BashIncorrectSyntaxError) as syn:
        await rt.run_in_session(BashAction(command="export FOO=changed; echo (", check="silent"))
    assert "syntax error" in str(syn.value)
    assert (await rt.run_in_session(BashAction(command="echo $FOO"))).output == "bar\n"  # nothing of it ran
    with pytest.raises(NotImplementedError):
        await rt.run_in_session(BashAction(command="python3", is_interactive_command=True, expect=[">>>"]))
    with pytest.raises(SessionDoesNotExistError):
        await rt.run_in_session(BashAction(command="true", session="never-created"))

    # a timeout kills the command, not the session: what it had done stays
    t0 = time.monotonic()
    with pytest.raises(CommandTimeoutError) as late:
        await rt.run_in_session(BashAction(command="export X=1; echo started; sleep 30", timeout=1))
    assert time.monotonic() - t0 < 10
    assert late.value.extra_info["output"].startswith("started\n")  # type: ignore[attr-defined]
    assert (await rt.run_in_session(BashInterruptAction())).exit_code == 0  # SWE-agent's next step: nothing left
    obs = await rt.run_in_session(BashAction(command="echo $X $FOO; pwd"))
    assert obs.output == "1 bar\n/tmp\n"

    # an interrupt reaches a command still running in the session (another request)
    # (and to what the command line starts next, within the interrupt's window)
    running = asyncio.create_task(rt.run_in_session(BashAction(
        command="echo started; sleep 60; sleep 61 && echo not-reached", timeout=120, check="silent")))
    await asyncio.sleep(1.0)
    t0 = time.monotonic()
    await rt.run_in_session(BashInterruptAction(timeout=1))
    obs = await asyncio.wait_for(running, 10)
    assert time.monotonic() - t0 < 10
    assert obs.output.startswith("started\n") and "not-reached" not in obs.output and obs.exit_code == 130
    assert (await rt.run_in_session(BashAction(command="echo $FOO"))).output == "bar\n"

    # sessions are separate shells (any name: dsec's own names are narrower)
    await rt.create_session(CreateBashSessionRequest(session="two"))
    obs = await rt.run_in_session(BashAction(command="pwd; echo ${FOO:-unset}", session="two"))
    assert obs.output == "/root\nunset\n"
    await rt.create_session(CreateBashSessionRequest(session="a session/ü"))
    await rt.run_in_session(BashAction(command="export ODD=1", session="a session/ü"))
    assert (await rt.run_in_session(BashAction(command="echo $ODD", session="a session/ü"))).output == "1\n"
    await rt.close_session(CloseBashSessionRequest(session="a session/ü"))

    # closed means gone; created again means fresh, where the first session started
    await rt.close_session(CloseBashSessionRequest())
    with pytest.raises(SessionDoesNotExistError):
        await rt.run_in_session(BashAction(command="echo $FOO"))
    with pytest.raises(SessionDoesNotExistError):
        await rt.close_session(CloseBashSessionRequest())
    await rt.create_session(CreateBashSessionRequest())
    assert (await rt.run_in_session(BashAction(command="pwd; echo ${FOO:-unset}"))).output == "/root\nunset\n"

    # close() ends every session, the sandbox stays
    await rt.close()
    for name in ("default", "two"):
        with pytest.raises(SessionDoesNotExistError):
            await rt.run_in_session(BashAction(command="true", session=name))
    assert (await rt.is_alive()).is_alive
    await rt.create_session(CreateBashSessionRequest(session="two"))
    assert (await rt.run_in_session(BashAction(command="echo again", session="two"))).output == "again\n"

    # a timeout spent in the shell itself ends the session, and says so
    with pytest.raises(CommandTimeoutError) as busy:
        await rt.run_in_session(BashAction(command="while :; do :; done", timeout=1, session="two"))
    assert busy.value.extra_info["session_alive"] is False  # type: ignore[attr-defined]
    with pytest.raises(SessionDoesNotExistError):
        await rt.run_in_session(BashAction(command="true", session="two"))
    await rt.create_session(CreateBashSessionRequest(session="two"))
    assert (await rt.run_in_session(BashAction(command="echo back", session="two"))).output == "back\n"


async def test_execute_files_upload(platform: Platform, debian: dsec.AsyncSandbox, tmp_path: Path) -> None:
    rt = runtime(platform, debian.sandbox_id)
    await rt.close()  # before any session: nothing to end
    r = await rt.execute(Command(command="echo out; echo err >&2; exit 3", shell=True))
    assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 3)
    assert (await rt.execute(Command(command=["printf", "%s|", "a b", "c"]))).stdout == "a b|c|"
    r = await rt.execute(Command(command="echo $V; pwd; echo e >&2", shell=True, env={"V": "v"}, cwd="/tmp",
                                 merge_output_streams=True))
    assert (r.stdout, r.stderr, r.exit_code) == ("v\n/tmp\ne\n", "", 0)
    with pytest.raises(NonZeroExitCodeError):
        await rt.execute(Command(command="false", shell=True, check=True))
    t0 = time.monotonic()
    with pytest.raises(CommandTimeoutError):
        await rt.execute(Command(command=["sleep", "30"], timeout=1))
    assert time.monotonic() - t0 < 10

    await rt.write_file(WriteFileRequest(path="/root/deep/dir/x.txt", content="héllo\r\nwörld\n"))
    assert await debian.read_file("/root/deep/dir/x.txt") == "héllo\r\nwörld\n".encode()
    assert (await rt.read_file(ReadFileRequest(path="/root/deep/dir/x.txt"))).content == "héllo\nwörld\n"
    assert (await rt.read_file(ReadFileRequest(path="/root/deep/dir/x.txt", encoding="latin-1"))).content \
        == "hÃ©llo\nwÃ¶rld\n"
    with pytest.raises(FileNotFoundError):
        await rt.read_file(ReadFileRequest(path="/root/no/such/file"))
    # as SWE-ReX's own server has them: a relative path from its working directory, /; an
    # empty shell command exits 0
    assert (await rt.read_file(ReadFileRequest(path="root/deep/dir/x.txt"))).content == "héllo\nwörld\n"
    with pytest.raises(FileNotFoundError):
        await rt.read_file(ReadFileRequest(path="no/such/file"))
    assert (await rt.execute(Command(command="", shell=True))).exit_code == 0

    src = tmp_path / "tools"
    (src / "sub").mkdir(parents=True)
    (src / "empty").mkdir()
    (src / "a.txt").write_text("A\n")
    (src / "sub" / "b.txt").write_text("B\n")
    (src / "run.sh").write_text("#!/bin/sh\necho ran $0\n")
    os.chmod(src / "run.sh", 0o755)
    await rt.upload(UploadRequest(source_path=str(src), target_path="/opt/tools"))
    r = await rt.execute(Command(command="cat /opt/tools/a.txt /opt/tools/sub/b.txt; /opt/tools/run.sh; "
                                 "test -d /opt/tools/empty && echo empty-dir", shell=True))
    assert (r.stdout, r.exit_code) == ("A\nB\nran /opt/tools/run.sh\nempty-dir\n", 0)
    blob = tmp_path / "blob.bin"
    blob.write_bytes(bytes(range(256)) * 64)
    await rt.upload(UploadRequest(source_path=str(blob), target_path="/opt/blob.bin"))
    assert await debian.read_file("/opt/blob.bin") == blob.read_bytes()
    await rt.upload(UploadRequest(source_path=str(blob), target_path="/opt/tools"))  # onto a dir: into it
    assert await debian.read_file("/opt/tools/blob.bin") == blob.read_bytes()


async def test_errors_and_auth(platform: Platform, debian: dsec.AsyncSandbox, client: dsec.AsyncClient) -> None:
    sid = debian.sandbox_id
    bad = runtime(platform, sid, token="not-a-token")
    alive = await bad.is_alive()
    assert not alive.is_alive and "401" in alive.message
    with pytest.raises(aiohttp.ClientResponseError) as refused:
        await bad.run_in_session(BashAction(command="true"))
    assert refused.value.status == 401
    with pytest.raises(aiohttp.ClientResponseError) as unknown:
        await runtime(platform, "edge0-zzzzzzzzzzzz").execute(Command(command=["true"]))
    assert unknown.value.status == 404
    assert "404" in (await runtime(platform, "edge0-zzzzzzzzzzzz").is_alive()).message
    with pytest.raises(aiohttp.ClientResponseError) as malformed:
        await runtime(platform, "no-such-id").execute(Command(command=["true"]))
    assert malformed.value.status == 400

    async with httpx.AsyncClient(base_url=f"{platform.url}/swerex/{sid}", headers={"X-API-Key": TOKEN}) as h:
        for endpoint, body, field in [("run_in_session", {"session": "default"}, "command"),
                                      ("run_in_session", {"command": "true", "timeout": -1}, "timeout"),
                                      ("run_in_session", {"command": "true", "action_type": "gdb"}, "action_type"),
                                      ("execute", {"command": "true", "shell": True, "env": {"1x": "y"}}, "env"),
                                      ("read_file", {}, "path"),
                                      ("read_file", {"path": "/etc/hostname", "encoding": "klingon"}, "encoding"),
                                      ("write_file", {"path": "/root/x"}, "content")]:
            r = await h.post(f"/{endpoint}", json=body)
            assert 400 <= r.status_code < 500 and r.json()["field"] == field, (endpoint, body, r.text)
            assert field in r.json()["detail"]
        r = await h.post("/run_in_session", content=b"{not json")
        assert r.status_code == 400 and r.json()["field"] == "body"
        r = await h.post("/upload", files={"file": ("a", b"x")})  # no target_path
        assert r.status_code == 400 and r.json()["field"] == "target_path"
        r = await h.post("/upload", files={"file": ("a.zip", b"not a zip")},
                         data={"target_path": "/x", "unzip": "true"})
        assert r.status_code == 400 and "zip" in r.json()["detail"]
        assert (await h.get("/no_such_endpoint")).status_code == 404

        # the sandbox's own token: good for this sandbox only
        r = await h.get("/token")
        own = r.json()["auth_token"]
        assert (await runtime(platform, sid, own).execute(Command(command=["echo", "own"]))).stdout == "own\n"
        assert not (await runtime(platform, "edge0-aaaaaaaaaaaa", own).is_alive()).is_alive
        elsewhere = await h.get(f"{platform.url}/swerex/edge0-aaaaaaaaaaaa/is_alive", headers={"X-API-Key": own})
        assert elsewhere.status_code == 401

    # a runner token may use its project's sandboxes (not only an admin), and no other's
    mine = await client.create_token("default", "runner", "swerex-test")
    theirs = await client.create_token("elsewhere", "runner", "swerex-test")
    try:
        assert (await runtime(platform, sid, mine.token or "").execute(Command(command=["true"]))).exit_code == 0
        with pytest.raises(aiohttp.ClientResponseError) as hidden:
            await runtime(platform, sid, theirs.token or "").execute(Command(command=["true"]))
        assert hidden.value.status == 404
    finally:
        await client.revoke_token(mine.id)
        await client.revoke_token(theirs.id)


async def test_stopped_sandbox(platform: Platform, client: dsec.AsyncClient) -> None:
    sb = await client.run_container(dsec.ContainerArgs(image="base/debian:12", memory_limit_mb=128,
                                                       cpu_cores_limit=0.25))
    rt = runtime(platform, sb.sandbox_id)
    assert (await rt.is_alive()).is_alive
    await sb.stop()
    alive = await rt.is_alive()
    assert not alive.is_alive and "stopped" in alive.message
    await rt.close()  # SWE-agent's teardown after the sandbox is gone: not an error
    with pytest.raises(aiohttp.ClientResponseError) as gone:
        await rt.run_in_session(BashAction(command="true"))
    assert gone.value.status == 409


def test_mini_swe_agent_episode(platform: Platform, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MSWEA_SILENT_STARTUP", "1")
    monkeypatch.setenv("MSWEA_GLOBAL_CONFIG_DIR", str(tmp_path / "mini-config"))
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.models.test_models import DeterministicModel, make_output

    from dsec.client.integrations.mini_swe_agent import DsecEnvironment

    model = DeterministicModel(outputs=[
        make_output("make the file", [{"command": "mkdir -p /work && printf 'hello\\n' > /work/a.txt && echo made"}]),
        make_output("look at it", [{"command": "cd /work && cat a.txt && wc -c < a.txt && echo oops >&2 && false"}]),
        make_output("state does not persist", [{"command": "pwd; echo ${GREETING}"}]),
        make_output("too slow", [{"command": "echo before; sleep 30"}]),
        make_output("submit", [{"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat /work/a.txt"}]),
    ])
    env = DsecEnvironment(url=platform.url, token=TOKEN, memory_limit_mb=256, cpu_cores_limit=0.5, cwd="/tmp",
                          env={"GREETING": "hi"}, timeout=2)
    sid = env.sandbox_id
    assert sid is not None
    try:
        agent = DefaultAgent(model, env, system_template="You work in {{system}} on {{machine}}, in {{sandbox_id}}.",
                             instance_template="{{task}}", step_limit=10, cost_limit=0)
        result = agent.run("write hello to /work/a.txt and submit it")
    finally:
        env.cleanup()
    assert result == {"exit_status": "Submitted", "submission": "hello\n"}
    assert agent.messages[0]["content"].startswith("You work in Linux on ") and sid in agent.messages[0]["content"]
    observations = [m["content"] for m in agent.messages if m["role"] == "user"][1:]
    assert len(observations) == 4
    assert "<returncode>0</returncode>" in observations[0] and "made" in observations[0]
    assert "<returncode>1</returncode>" in observations[1] and "hello\n6\noops\n" in observations[1]
    assert "/tmp\nhi\n" in observations[2]
    assert "timed out after 2 seconds" in observations[3] and "before" in observations[3]
    assert agent.messages[-1]["role"] == "exit"
    data = agent.serialize()
    assert data["info"]["config"]["environment"]["sandbox_id"] == sid
    assert TOKEN not in str(data)  # the credential never lands in a trajectory
    with dsec.Client(url=platform.url, token=TOKEN) as c:
        assert c.connect(sid).refresh().state == dsec.SandboxState.stopped
