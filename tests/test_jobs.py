"""Jobs as an API object against the real platform: records, status counts as sandboxes
start and stop, quota refusals (429 naming the quota) that hold under concurrent creates,
pause / resume / stop of a whole job, project isolation, name validation, the sync SDK
and the CLI."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid

import httpx
import pytest

import dsec
from tests.conftest import TOKEN, Platform

SMALL = dict(image="base/busybox", memory_limit_mb=64, cpu_cores_limit=0.25)


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def test_create_get_list_and_status_follow_the_sandboxes(client: dsec.AsyncClient) -> None:
    name = _name("grpo-step")
    job = await client.create_job(name, quota=dsec.JobQuota(sandboxes=8, cpu_cores=4, memory_mb=4096),
                                  labels={"run": name})
    assert job.info.state == "active" and job.info.project == "default"
    assert (await client.job(name)).info.quota.sandboxes == 8
    assert [j.name for j in await client.jobs(labels={"run": name})] == [name]
    assert (await job.status()).usage.sandboxes == 0
    a = await job.run(dsec.ContainerArgs(**SMALL))
    b = await job.run(dsec.ContainerArgs(**SMALL))
    try:
        assert a.info.job == name
        st = await job.status(usage=True)
        assert st.by_state == {"running": 2}
        assert st.by_backend == {"container": 2}
        assert st.usage.sandboxes == 2 and st.usage.memory_mb == 128 and st.usage.cpu_cores == pytest.approx(0.5)
        assert st.usage.memory_bytes is not None and st.usage.memory_bytes > 0
        assert st.quota_free.sandboxes == 6 and st.quota_free.memory_mb == 4096 - 128
        assert st.created_last_minute == 2
        assert {i.sandbox_id for i in await job.sandboxes()} == {a.sandbox_id, b.sandbox_id}
        await a.stop()
        st = await job.status()
        assert st.by_state.get("running") == 1 and st.usage.sandboxes == 1
    finally:
        await job.stop()
    assert (await job.status()).usage.sandboxes == 0


async def test_a_second_job_of_the_same_name_is_refused(client: dsec.AsyncClient) -> None:
    name = _name("dup")
    await client.create_job(name)
    with pytest.raises(dsec.JobExists) as e:
        await client.create_job(name)
    assert e.value.field == "name"


async def test_sandbox_quota_is_refused_with_429_naming_it(client: dsec.AsyncClient) -> None:
    name = _name("quota-n")
    job = await client.create_job(name, quota=dsec.JobQuota(sandboxes=2))
    made = [await job.run(dsec.ContainerArgs(**SMALL)) for _ in range(2)]
    try:
        with pytest.raises(dsec.QuotaExceeded) as e:
            await job.run(dsec.ContainerArgs(**SMALL))
        assert isinstance(e.value, dsec.AdmissionRejected) and e.value.field == "quota.sandboxes"
        r = await client._request("POST", "/v1/sandboxes", json={"args": {**SMALL, "job": name}}, check=False)
        assert r.status_code == 429
        assert r.json()["error"] == "quota_exceeded" and r.json()["field"] == "quota.sandboxes"
        assert "2 sandboxes" in r.json()["message"]
        await made.pop().stop()  # its share comes back at once
        made.append(await job.run(dsec.ContainerArgs(**SMALL)))
    finally:
        await job.stop()


async def test_memory_quota_and_fork_like_batches(client: dsec.AsyncClient) -> None:
    job = await client.create_job(_name("quota-mem"), quota=dsec.JobQuota(memory_mb=100))
    try:
        await job.run(dsec.ContainerArgs(**SMALL))
        with pytest.raises(dsec.QuotaExceeded) as e:
            await job.run(dsec.ContainerArgs(**SMALL))
        assert e.value.field == "quota.memory_mb" and "100 MiB" in e.value.message
        # a smaller one still fits
        await job.run(dsec.ContainerArgs(**{**SMALL, "memory_limit_mb": 32}))
        assert (await job.status()).usage.memory_mb == 96
    finally:
        await job.stop()


async def test_concurrent_creates_never_overshoot(client: dsec.AsyncClient) -> None:
    job = await client.create_job(_name("race"), quota=dsec.JobQuota(sandboxes=3))
    try:
        results = await asyncio.gather(*(job.run(dsec.ContainerArgs(**SMALL)) for _ in range(6)),
                                       return_exceptions=True)
        made = [r for r in results if isinstance(r, dsec.AsyncSandbox)]
        refused = [r for r in results if isinstance(r, dsec.QuotaExceeded)]
        assert len(made) == 3 and len(refused) == 3, results
        assert len(await job.sandboxes()) == 3
    finally:
        await job.stop()


async def test_pause_resume_and_stop_the_whole_job(client: dsec.AsyncClient) -> None:
    job = await client.create_job(_name("preempt"))
    a = await job.run(dsec.ContainerArgs(**SMALL))
    b = await job.run(dsec.ContainerArgs(**SMALL))
    try:
        r = await job.pause()
        assert r.job.state == "paused" and r.job.paused_at is not None
        assert sorted(r.changed) == sorted([a.sandbox_id, b.sandbox_id])
        assert {i.state for i in await job.sandboxes()} == {dsec.SandboxState.paused}
        with pytest.raises(dsec.JobNotActive) as e:  # a straggler of the preempted trainer makes nothing
            await job.run(dsec.ContainerArgs(**SMALL))
        assert e.value.status == 409 and "paused" in e.value.message
        r = await job.resume()
        assert r.job.state == "active" and len(r.changed) == 2
        assert {i.state for i in await job.sandboxes()} == {dsec.SandboxState.running}
        assert (await a.exec("echo back")).stdout.strip() == "back"
        c = await job.run(dsec.ContainerArgs(**SMALL))
        r = await job.stop()
        assert r.job.state == "stopped" and len(r.changed) == 3
        assert (await c.refresh()).state == dsec.SandboxState.stopped
        assert (await job.status()).usage.sandboxes == 0
        with pytest.raises(dsec.JobNotActive):
            await job.run(dsec.ContainerArgs(**SMALL))
        with pytest.raises(dsec.JobNotActive):
            await job.resume()
    finally:
        await job.stop()


async def test_a_job_without_a_record_is_a_free_form_label(client: dsec.AsyncClient) -> None:
    sb = await client.run_container(dsec.ContainerArgs(**SMALL, job=_name("no-record")))
    try:
        assert sb.info.state == dsec.SandboxState.running
    finally:
        await sb.stop()


async def test_another_project_cannot_see_or_control_a_job(client: dsec.AsyncClient, platform: Platform) -> None:
    ta = await client.create_token("team-a", "runner")
    tb = await client.create_token("team-b", "runner")
    name = _name("shared")
    async with dsec.AsyncClient(url=platform.url, token=ta.token) as ca, \
            dsec.AsyncClient(url=platform.url, token=tb.token) as cb:
        job = await ca.create_job(name, quota=dsec.JobQuota(sandboxes=1))
        assert job.info.project == "team-a"
        sb = await job.run(dsec.ContainerArgs(**SMALL))
        try:
            with pytest.raises(dsec.NotFound):
                await cb.job(name)
            assert name not in [j.name for j in await cb.jobs()]
            r = await cb._request("POST", f"/v1/jobs/{name}/pause", check=False)
            assert r.status_code == 404
            r = await cb._request("GET", f"/v1/jobs/{name}", params={"project": "team-a"}, check=False)
            assert r.status_code == 403 and r.json()["field"] == "project"
            assert (await sb.refresh()).state == dsec.SandboxState.running
            # the name is per project: team-b's job of the same name has its own quota
            jb = await cb.create_job(name, quota=dsec.JobQuota(sandboxes=1))
            other = await jb.run(dsec.ContainerArgs(**SMALL))
            assert [i.sandbox_id for i in await jb.sandboxes()] == [other.sandbox_id]
            await jb.stop()
            # the admin sees both, and names the project to act on one
            assert {j.project for j in await client.jobs() if j.name == name} == {"team-a", "team-b"}
            assert (await client.job(name, project="team-a")).info.state == "active"
        finally:
            await job.stop()
        assert (await sb.refresh()).state == dsec.SandboxState.stopped


@pytest.mark.parametrize("bad", ["bad name", "-leading", "x" * 129, "a/b"])
def test_bad_job_names_are_400_naming_the_field(platform: Platform, bad: str) -> None:
    h = {"Authorization": f"Bearer {TOKEN}"}
    r = httpx.post(f"{platform.url}/v1/jobs", headers=h, json={"name": bad})
    assert r.status_code == 400 and r.json()["field"] == "name", r.text
    if "/" not in bad:
        r = httpx.get(f"{platform.url}/v1/jobs/{bad}", headers=h)
        assert r.status_code == 400 and r.json()["field"] == "name", r.text
    r = httpx.post(f"{platform.url}/v1/jobs", headers=h, json={"name": "ok-name", "quota": {"sandboxes": -1}})
    assert r.status_code == 400 and r.json()["field"] == "quota.sandboxes", r.text


def test_sync_client(platform: Platform) -> None:
    with dsec.Client(url=platform.url, token=TOKEN) as c:
        job = c.create_job(_name("sync"), quota=dsec.JobQuota(sandboxes=1))
        sb = job.run(dsec.ContainerArgs(**SMALL))
        assert isinstance(sb, dsec.Sandbox) and isinstance(job, dsec.Job)
        assert job.status().usage.sandboxes == 1
        with pytest.raises(dsec.QuotaExceeded):
            job.run(dsec.ContainerArgs(**SMALL))
        assert c.job(job.name).stop().changed == [sb.sandbox_id]


def test_cli(platform: Platform) -> None:
    env = {**os.environ, "DSEC_URL": platform.url, "DSEC_TOKEN": TOKEN}
    name = _name("cli")

    def dsec_cli(*args: str) -> str:
        r = subprocess.run([sys.executable, "-m", "dsec.client.cli.main", "job", *args], env=env, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout

    made = json.loads(dsec_cli("create", name, "--sandboxes", "2", "--memory-mb", "1024", "--label", "k=v"))
    assert made["quota"] == {"sandboxes": 2, "cpu_cores": None, "memory_mb": 1024, "creates_per_s": None}
    assert made["labels"] == {"k": "v"}
    assert json.loads(dsec_cli("get", name))["state"] == "active"
    assert name in [json.loads(line)["name"] for line in dsec_cli("list", "--label", "k=v").splitlines()]
    assert json.loads(dsec_cli("status", name))["quota_free"]["sandboxes"] == 2
    assert json.loads(dsec_cli("pause", name))["job"]["state"] == "paused"
    assert json.loads(dsec_cli("resume", name))["job"]["state"] == "active"
    assert json.loads(dsec_cli("stop", name))["job"]["state"] == "stopped"
    r = subprocess.run([sys.executable, "-m", "dsec.client.cli.main", "job", "get", "no-such-job"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "not_found" in r.stderr
