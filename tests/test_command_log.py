"""The command log (keyed commands recorded by the edge, replayed instead of run twice)
and failure attribution (workload or infra), against the real platform (docs/rl.md)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import pytest

import dsec
from tests.conftest import TOKEN, Cluster, Platform, own_cluster, own_platform

APPEND = "echo ran >> /root/runs; echo out; echo err >&2"


async def runs(sb: dsec.AsyncSandbox, path: str = "/root/runs") -> int:
    return len((await sb.exec(f"cat {path} 2>/dev/null || true")).stdout.splitlines())


async def test_a_key_again_returns_the_record_without_running(debian: dsec.AsyncSandbox) -> None:
    first = await debian.exec(APPEND + "; exit 3", key="rollout-1/turn-1")
    second = await debian.exec(APPEND + "; exit 3", key="rollout-1/turn-1")
    assert await runs(debian) == 1
    assert not first.replayed and second.replayed
    assert (second.exit_code, second.stdout, second.stderr) == (3, "out\n", "err\n") == \
        (first.exit_code, first.stdout, first.stderr)
    assert first.failure == second.failure == "workload"
    # a retry may pick another timeout: still the same command
    third = await debian.exec(APPEND + "; exit 3", key="rollout-1/turn-1", timeout=7)
    assert third.replayed and await runs(debian) == 1
    # without a key, or with another, it runs
    await debian.exec(APPEND)
    await debian.exec(APPEND + "; exit 3", key="rollout-1/turn-2")
    assert await runs(debian) == 3


async def test_concurrent_calls_with_one_key_run_it_once(debian: dsec.AsyncSandbox) -> None:
    cmd = "sleep 0.5; echo ran >> /root/runs; echo done-$RANDOM"
    results = await asyncio.gather(*(debian.exec(cmd, key="k/concurrent") for _ in range(5)))
    assert await runs(debian) == 1
    assert len({(r.stdout, r.exit_code) for r in results}) == 1 and results[0].stdout.startswith("done-")
    assert sorted(r.replayed for r in results) == [False, True, True, True, True]


async def test_a_key_with_a_different_command_is_a_conflict(debian: dsec.AsyncSandbox) -> None:
    await debian.exec("echo a", key="k/conflict", env={"A": "1"}, cwd="/tmp")
    for other in ({"cmd": "echo b"}, {"cmd": ["echo", "a"]}, {"cmd": "echo a", "env": {"A": "2"}},
                  {"cmd": "echo a", "env": {"A": "1"}, "cwd": "/"}, {"cmd": "echo a", "env": {"A": "1"},
                                                                    "session": "s"}):
        kw = {"env": {"A": "1"}, "cwd": "/tmp", **other}
        with pytest.raises(dsec.KeyConflict, match="k/conflict") as e:
            await debian.exec(kw.pop("cmd"), key="k/conflict", **kw)  # type: ignore[arg-type]
        assert e.value.status == 409 and e.value.field == "key" and not e.value.infra
    # while the first is still running, too
    slow = asyncio.create_task(debian.exec("sleep 1; echo slow", key="k/inflight"))
    await asyncio.sleep(0.3)
    with pytest.raises(dsec.KeyConflict, match="k/inflight"):
        await debian.exec("echo fast", key="k/inflight")
    assert (await slow).stdout == "slow\n"


async def test_bad_keys_are_refused_naming_the_field(client: dsec.AsyncClient, debian: dsec.AsyncSandbox) -> None:
    for bad in ("has space", "x" * 257, "-leading-dash", "", "semi;colon"):
        with pytest.raises(dsec.InvalidRequest) as e:
            await client._json("POST", f"/v1/sandboxes/{debian.sandbox_id}/exec", json={"cmd": "true", "key": bad})
        assert e.value.field == "key", bad
    assert (await debian.exec("true", key="ok-" + "x" * 253)).exit_code == 0


async def test_exec_as_a_user_keyed_or_not(client: dsec.AsyncClient, debian: dsec.AsyncSandbox) -> None:
    """``uid``/``gid`` run a command as that user (no capabilities left), with or without a
    key; the user is part of what makes a keyed command "the same"."""
    denied = await debian.exec("pwd", uid=65534)  # the sandbox's workdir, /root here, is root's own
    assert denied.exit_code == 126 and "/root" in denied.stderr
    r = await debian.exec("id -u; id -g; grep CapEff /proc/self/status; touch u-file; stat -c %u:%g u-file",
                          uid=65534, gid=65533, cwd="/tmp")
    assert r.stdout.split() == ["65534", "65533", "CapEff:", "0" * 16, "65534:65533"], r
    assert (await debian.exec("id -u; id -g", uid=1234, cwd="/")).stdout == "1234\n1234\n"  # gid: the uid
    assert (await debian.exec("touch /root/nope", uid=65534, cwd="/")).exit_code != 0  # not root
    first = await debian.exec("echo ran >> /tmp/u-runs; id -u", key="k/user", uid=65534, cwd="/")
    again = await debian.exec("echo ran >> /tmp/u-runs; id -u", key="k/user", uid=65534, cwd="/")
    assert first.stdout == again.stdout == "65534\n" and again.replayed
    with pytest.raises(dsec.KeyConflict):  # the same command as root is another command
        await debian.exec("echo ran >> /tmp/u-runs; id -u", key="k/user", cwd="/")
    with pytest.raises(dsec.InvalidRequest, match="session"):
        await debian.exec("id -u", uid=65534, session="s")
    for body in ({"cmd": "id", "uid": 1, "session": "s"}, {"cmd": "id", "gid": 1}, {"cmd": "id", "uid": -1}):
        with pytest.raises(dsec.InvalidRequest):
            await client._json("POST", f"/v1/sandboxes/{debian.sandbox_id}/exec", json=body)


async def test_run_shell_with_a_key(debian: dsec.AsyncSandbox) -> None:
    step = "export N=$((N+1)); echo $N"
    assert (await debian.run_shell(step, session="agent", key="shell/1")).stdout == "1\n"
    again = await debian.run_shell(step, session="agent", key="shell/1")
    assert again.stdout == "1\n" and again.replayed
    # the session's state moved once: the replay ran nothing in it
    assert (await debian.run_shell(step, session="agent")).stdout == "2\n"


async def test_streamed_exec_with_a_key(debian: dsec.AsyncSandbox) -> None:
    async def collect(it: AsyncIterator[dsec.ExecEvent]) -> tuple[str, dsec.ExecResult | None]:
        out, res = "", None
        async for ev in it:
            if ev.type == "stdout":
                out += ev.data or ""
            elif ev.type == "result":
                res = ev.result
        return out, res

    out1, r1 = await collect(debian.exec_stream(APPEND, key="stream/1"))
    out2, r2 = await collect(debian.exec_stream(APPEND, key="stream/1"))
    assert r1 is not None and r2 is not None and not r1.replayed and r2.replayed
    assert out1 == out2 == "out\n" and await runs(debian) == 1


async def test_command_log_lists_keys_in_order(client: dsec.AsyncClient, debian: dsec.AsyncSandbox,
                                               platform: Platform) -> None:
    t0 = time.time()
    keys = ["log/c", "log/a", "log/b"]
    for i, k in enumerate(keys):
        await debian.exec(f"sleep 0.1; exit {i}", key=k)
    await debian.exec("echo unkeyed")
    await debian.exec("sleep 0.1; exit 0", key="log/c")  # a replay adds nothing
    log = await debian.command_log()
    assert [r.key for r in log] == keys and [r.seq for r in log] == [1, 2, 3]
    for i, r in enumerate(log):
        assert r.state == "done" and r.result is not None and r.result.exit_code == i
        assert r.cmd == f"sleep 0.1; exit {i}" and r.finished_at is not None
        assert t0 <= r.started_at < r.finished_at and r.finished_at - r.started_at >= 0.09
        assert r.result.duration_ms >= 90
    assert [r.key for r in await debian.command_log(after=1, limit=1)] == ["log/a"]

    def sync_log() -> list[str]:
        with dsec.Client(url=platform.url, token=TOKEN) as c:
            return [r.key for r in c.connect(debian.sandbox_id).command_log()]
    assert await asyncio.to_thread(sync_log) == keys


async def test_the_record_caps_output(debian: dsec.AsyncSandbox) -> None:
    cmd = "head -c 100000 /dev/zero | tr '\\0' a"
    first = await debian.exec(cmd, key="big/1")
    assert len(first.stdout) == 100_000 and not first.stdout_truncated
    again = await debian.exec(cmd, key="big/1")
    assert again.replayed and again.stdout_truncated and len(again.stdout) == 32 << 10
    [rec] = [r for r in await debian.command_log() if r.key == "big/1"]
    assert rec.result is not None and len(rec.result.stdout) == 32 << 10 and rec.result.stdout_truncated


async def test_a_timed_out_keyed_command_is_recorded_timed_out(debian: dsec.AsyncSandbox) -> None:
    cmd = "echo ran >> /root/runs; sleep 30"
    first = await debian.exec(cmd, key="slow/1", timeout=1)
    assert first.timed_out and first.failure == "workload"
    again = await debian.exec(cmd, key="slow/1", timeout=60)
    assert again.replayed and again.timed_out and again.failure == "workload"
    assert await runs(debian) == 1


async def test_whose_failure(client: dsec.AsyncClient, debian: dsec.AsyncSandbox) -> None:
    assert (await debian.exec("true")).failure is None
    assert (await debian.exec("exit 1")).failure == "workload"
    assert (await debian.exec("sleep 5", timeout=0.5)).failure == "workload"
    oom = await client.run_container(dsec.ContainerArgs(image="base/debian:12", memory_limit_mb=64))
    try:  # the command's own OOM: its exit says so, the platform did its job
        r = await oom.exec("head -c 1G /dev/zero | tail > /dev/null", timeout=30)
        assert r.exit_code != 0 and r.failure == "workload"
    finally:
        await oom.stop()
    with pytest.raises(dsec.AdmissionRejected) as refused:
        await client.run_container(dsec.ContainerArgs(image="base/debian:12", cpu_cores_limit=1024))
    assert refused.value.infra
    with pytest.raises(dsec.InvalidRequest) as bad:
        await client._json("POST", f"/v1/sandboxes/{debian.sandbox_id}/exec", json={"cmd": "true", "timeout_s": -1})
    assert not bad.value.infra
    with pytest.raises(dsec.NotFound) as missing:
        await client.connect(f"{debian.info.edge}-zzzzzzzzzzzz")
    assert not missing.value.infra
    await debian.stop()
    with pytest.raises(dsec.SandboxNotRunning) as stopped:
        await debian.exec("true")
    assert stopped.value.infra
    with pytest.raises(dsec.SandboxNotRunning):  # a new key on an ended sandbox: nothing recorded
        await debian.exec("true", key="after/stop")
    assert "after/stop" not in [r.key for r in await debian.command_log()]
    for cls in (dsec.EdgeUnavailable, dsec.DeadlineExceeded, dsec.SandboxError, dsec.InsufficientStorage):
        assert cls("x").infra, cls
    for cls in (dsec.Unauthorized, dsec.Forbidden, dsec.PayloadTooLarge, dsec.KeyConflict, dsec.CommandForgotten):
        assert not cls("x").infra, cls


# ---- on a platform of their own: restarts, and a small bound ---------------------------

BOUND = 5


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    yield from own_platform(tmp_path_factory, "cmdlog", env={"DSEC_COMMAND_LOG_RECORDS": str(BOUND)})


@pytest.fixture
async def sb(small: Platform) -> AsyncIterator[dsec.AsyncSandbox]:
    async with dsec.AsyncClient(url=small.url, token=TOKEN) as c:
        s = await c.run_container(dsec.ContainerArgs(image="base/debian:12", memory_limit_mb=256))
        yield s
        await s.stop()


@pytest.mark.parametrize("crash", [False, True])
async def test_the_log_survives_an_edge_restart(small: Platform, sb: dsec.AsyncSandbox, crash: bool) -> None:
    first = await sb.exec(APPEND, key="restart/done")
    slow = asyncio.create_task(sb.exec("echo ran >> /root/slow; sleep 60", key="restart/running", timeout=120))
    await asyncio.sleep(1.0)
    await asyncio.to_thread(small.restart, crash)
    with pytest.raises(dsec.DsecError) as lost:  # its caller lost the edge under it
        await slow
    assert lost.value.infra
    again = await sb.exec(APPEND, key="restart/done")
    assert again.replayed and (again.stdout, again.exit_code) == (first.stdout, first.exit_code)
    assert await runs(sb) == 1
    # the command the edge was running: its outcome is unknown, it is not run again
    gone = await sb.exec("echo ran >> /root/slow; sleep 60", key="restart/running", timeout=120)
    assert gone.replayed and gone.failure == "infra" and gone.exit_code == -1 and "restarted" in gone.stderr
    assert await runs(sb, "/root/slow") == 1
    states = {r.key: r.state for r in await sb.command_log()}
    assert states == {"restart/done": "done", "restart/running": "interrupted"}


async def test_records_past_the_bound_are_dropped_oldest_first(sb: dsec.AsyncSandbox) -> None:
    for i in range(BOUND + 2):
        await sb.exec(f"echo {i} >> /root/runs", key=f"bound/{i}")
    assert [r.key for r in await sb.command_log()] == [f"bound/{i}" for i in range(2, BOUND + 2)]
    with pytest.raises(dsec.CommandForgotten, match="bound/0") as e:
        await sb.exec("echo 0 >> /root/runs", key="bound/0")
    assert e.value.status == 410 and e.value.field == "key" and not e.value.infra
    assert await runs(sb) == BOUND + 2  # never run twice
    assert (await sb.exec(f"echo {BOUND + 1} >> /root/runs", key=f"bound/{BOUND + 1}")).replayed
    with pytest.raises(dsec.KeyConflict):  # a forgotten key still knows its command
        await sb.exec("echo other", key="bound/1")


async def test_fast_forward_is_cheap(debian: dsec.AsyncSandbox) -> None:
    """A fast-forwarded command's round trip against running ``true`` (median of 200 each)."""
    await debian.exec("true", key="ff/1")

    async def median(**kw: str) -> float:
        ts = []
        for _ in range(200):
            t = time.perf_counter()
            await debian.exec("true", **kw)
            ts.append(time.perf_counter() - t)
        return sorted(ts)[len(ts) // 2]

    run, ff = await median(), await median(key="ff/1")
    print(f"\nrunning `true`: {run * 1000:.2f} ms; fast-forwarded: {ff * 1000:.2f} ms (medians of 200)")
    assert ff < run


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from own_cluster(tmp_path_factory, "cmdlog-cluster")


async def test_cluster_mode_the_edge_keeps_the_log(cluster: Cluster) -> None:
    """The apiserver holds nothing: the edge daemon records, and its restart keeps the log."""
    async with dsec.AsyncClient(url=cluster.url, token=TOKEN) as c:
        s = await c.run_container(dsec.ContainerArgs(image="base/debian:12", memory_limit_mb=256))
        try:
            first = await s.exec(APPEND, key="cluster/1")
            results = await asyncio.gather(*(s.exec(APPEND, key="cluster/2") for _ in range(3)))
            assert sorted(r.replayed for r in results) == [False, True, True]
            with pytest.raises(dsec.KeyConflict, match="cluster/1"):
                await s.exec("echo other", key="cluster/1")
            await asyncio.to_thread(cluster.edges["n1"].restart)
            again = await s.exec(APPEND, key="cluster/1")
            assert again.replayed and again.stdout == first.stdout
            assert await runs(s) == 2
            assert [r.key for r in await s.command_log()] == ["cluster/1", "cluster/2"]
        finally:
            await s.stop()
