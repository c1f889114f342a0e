"""IAM end to end on the real platform (docs/iam.md): a project tree with delegated quotas
enforced on real creates (429 naming the project and resource), subtree admins who can
grant only within what they hold, runners and readers, and the red team's attempts:
over-delegation, granting outside one's subtree, raising one's own quota, reading another
project's sandbox, job, batch or rollout by its id, a reader opening a terminal, deleting
a project with running sandboxes, the E2B face under a project's quota."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator

import httpx
import pytest
import websockets
import websockets.exceptions

import dsec
from dsec.shared.wire.iam import ProjectQuota
from tests.conftest import TOKEN, Platform, own_platform, wait_for

SMALL = dict(image="base/busybox", memory_limit_mb=64, cpu_cores_limit=0.5, disk_limit_mb=64)


class Org:
    """A top-level project made by the cluster's admin, and tokens in it."""

    def __init__(self, platform: Platform) -> None:
        self.url = platform.url
        self.root = f"org{uuid.uuid4().hex[:6]}"
        self.admin = dsec.Client(url=self.url, token=TOKEN)
        self.admin.projects.create(self.root, ProjectQuota(sandboxes=4, cpu_cores=1.5, memory_mb=4096))
        self.clients = [self.admin]
        self.lead = self.client(self.root, "admin")  # the team lead: admin of the subtree

    def token(self, project: str, role: str, by: dsec.Client | None = None) -> str:
        t = (by or self.admin).create_token(project, role).token
        assert t is not None
        return t

    def client(self, project: str, role: str, by: dsec.Client | None = None) -> dsec.Client:
        c = dsec.Client(url=self.url, token=self.token(project, role, by))
        self.clients.append(c)
        return c

    def close(self) -> None:
        for info in self.admin.list():
            if info.labels.get("dsec.project", "").startswith(self.root) and info.state.value in ("running", "paused"):
                self.admin.connect(info.sandbox_id).stop()
        for c in self.clients:
            c.close()


@pytest.fixture
def org(platform: Platform) -> Iterator[Org]:
    o = Org(platform)
    yield o
    o.close()


def test_quota_is_enforced_on_creates_and_freed_by_stops(org: Org) -> None:
    swe = f"{org.root}/swe"
    org.lead.projects.create(swe, ProjectQuota(sandboxes=2))
    runner = org.client(swe, "runner", by=org.lead)
    with pytest.raises(dsec.QuotaConflict) as qc:  # a job's quota is carved from its project's
        runner.create_job("too-big", quota=dsec.JobQuota(sandboxes=3))
    assert qc.value.field == "quota.sandboxes" and repr(swe) in qc.value.message
    runner.create_job("fits", quota=dsec.JobQuota(sandboxes=2, cpu_cores=1.5))
    a = runner.run_container(dsec.ContainerArgs(**SMALL))
    b = runner.run_container(dsec.ContainerArgs(**SMALL))
    assert a.refresh().labels["dsec.project"] == swe
    with pytest.raises(dsec.QuotaExceeded) as e:
        runner.run_container(dsec.ContainerArgs(**SMALL))
    assert e.value.status == 429 and e.value.field == "quota.sandboxes" and repr(swe) in e.value.message
    # the root's CPU (1.5 cores) is what stops a third sandbox in another sub-project
    ops = org.client(org.root, "runner")
    c = ops.run_container(dsec.ContainerArgs(**SMALL))
    with pytest.raises(dsec.QuotaExceeded) as e:
        ops.run_container(dsec.ContainerArgs(**SMALL))
    assert e.value.field == "quota.cpu_cores" and repr(org.root) in e.value.message
    usage = org.lead.projects.get(org.root, tree=True)
    assert (usage.usage.sandboxes, usage.usage.cpu_cores, usage.usage.starting) == (3, 1.5, 0)
    assert usage.children and usage.children[0].name == swe and usage.children[0].usage.sandboxes == 2
    # a paused sandbox holds its memory, not its CPU: room for one more
    b.pause()
    assert org.admin.projects.get(org.root).usage.cpu_cores == 1.0
    d = ops.run_container(dsec.ContainerArgs(**SMALL, ttl_running_stop=2))
    # resuming is never refused (the sandbox was admitted): the project is over its CPU
    # cap until something stops, and takes no new sandbox meanwhile
    b.resume()
    assert org.admin.projects.get(org.root).usage.cpu_cores == 2.0
    with pytest.raises(dsec.QuotaExceeded):
        ops.run_container(dsec.ContainerArgs(**SMALL))
    c.stop()
    a.stop()
    assert org.admin.projects.get(org.root).usage.sandboxes == 2
    # a sandbox that ends on its own (its idle TTL) is freed by the sweep within seconds
    assert wait_for(lambda: org.admin.projects.get(org.root).usage.sandboxes == 1, 30), \
        org.admin.projects.get(org.root).usage
    assert d.refresh().state.value == "stopped"
    runner.run_container(dsec.ContainerArgs(**SMALL)).stop()


def test_subtree_admin_grants_only_what_it_holds(org: Org) -> None:
    lead = org.lead
    lead.projects.create(f"{org.root}/a", ProjectQuota(sandboxes=2, cpu_cores=1))
    with pytest.raises(dsec.QuotaConflict) as e:  # over-delegation: 2 + 3 > 4
        lead.projects.create(f"{org.root}/b", ProjectQuota(sandboxes=3))
    assert e.value.field == "quota.sandboxes" and f"2 is left for '{org.root}/b'" in e.value.message, e.value.message
    lead.projects.create(f"{org.root}/b", ProjectQuota(sandboxes=2))
    lead.projects.create(f"{org.root}/a/deep")
    with pytest.raises(dsec.Forbidden):  # a project's admin cannot raise its own quota
        lead.projects.set_quota(org.root, sandboxes=1000)
    with pytest.raises(dsec.Forbidden):  # nor make a top-level project
        lead.projects.create(f"x{org.root}")
    other = f"oth{uuid.uuid4().hex[:6]}"
    org.admin.projects.create(other)
    with pytest.raises(dsec.Forbidden):  # nor act outside its subtree
        lead.projects.create(f"{other}/mine")
    with pytest.raises(dsec.Forbidden):
        lead.create_token(other, "admin")
    with pytest.raises(dsec.NotFound):  # a token for a sub-project that does not exist
        lead.create_token(f"{org.root}/ghost", "runner")
    # lowering a parent below what it delegated says what must shrink
    with pytest.raises(dsec.QuotaConflict) as e:
        org.admin.projects.set_quota(org.root, sandboxes=3)
    assert f"{org.root}/a: 2, {org.root}/b: 2" in e.value.message, e.value.message
    # an admin of a sub-project manages below it only
    sub = org.client(f"{org.root}/a", "admin", by=lead)
    sub.projects.set_quota(f"{org.root}/a/deep", sandboxes=2)
    with pytest.raises(dsec.QuotaConflict):
        sub.projects.set_quota(f"{org.root}/a/deep", sandboxes=3)
    with pytest.raises(dsec.Forbidden):
        sub.projects.set_quota(f"{org.root}/b", sandboxes=0)
    with pytest.raises(dsec.NotFound):
        sub.projects.get(f"{org.root}/b")
    assert [p.name for p in sub.projects.list()] == [f"{org.root}/a", f"{org.root}/a/deep"]
    assert {t.project for t in lead.tokens()} <= {org.root, f"{org.root}/a", f"{org.root}/b"}
    assert {t.project for t in sub.tokens()} == {f"{org.root}/a"}
    # the IAM events: who did what, and a subtree admin sees its subtree's only
    events = lead.iam_events(limit=10_000)
    assert {e.project for e in events} <= {org.root, f"{org.root}/a", f"{org.root}/b", f"{org.root}/a/deep"}
    assert ("project.quota", f"{org.root}/a/deep") in {(e.action, e.target) for e in events}
    assert any(e.action == "project.create" and e.target == f"{org.root}/a" for e in events)


def test_readers_read_and_nothing_else(org: Org, platform: Platform) -> None:
    runner = org.client(org.root, "runner")
    reader = org.client(org.root, "reader")
    sb = runner.run_container(dsec.ContainerArgs(**SMALL))
    assert [i.sandbox_id for i in reader.list()] == [sb.sandbox_id]
    assert reader.connect(sb.sandbox_id).refresh().state.value == "running"
    assert reader.projects.get(org.root).usage.sandboxes == 1
    with pytest.raises(dsec.Forbidden):
        reader.connect(sb.sandbox_id).exec(["true"])
    with pytest.raises(dsec.Forbidden):
        reader.run_container(dsec.ContainerArgs(**SMALL))
    with pytest.raises(dsec.Forbidden):
        reader.connect(sb.sandbox_id).stop()
    with pytest.raises(dsec.Forbidden):
        reader.create_token(org.root, "runner")
    with pytest.raises(dsec.Forbidden):  # a runner runs environments, it does not publish them
        sb.pack_diff(f"ws/{org.root}-stolen:v1")
    with pytest.raises(dsec.Forbidden):
        runner.create_token(org.root, "builder")  # nor grants itself more

    async def tty() -> int | None:
        url = sb._inner.tty_url(80, 24)
        async with websockets.connect(url, additional_headers={"Authorization": f"Bearer {reader.token}"}) as ws:
            with pytest.raises(websockets.exceptions.ConnectionClosed) as e:
                await ws.recv()
            return e.value.rcvd.code if e.value.rcvd else None
    assert asyncio.run(tty()) == 4401  # a terminal is a write, whatever its HTTP method


def test_another_project_finds_nothing_by_guessing_ids(org: Org, platform: Platform) -> None:
    mine = org.client(org.root, "builder")
    sb = mine.run_container(dsec.ContainerArgs(**SMALL, job="secret-job"))
    mine.create_job("planned")
    org.admin.projects.create(f"x{org.root}")
    thief = org.client(f"x{org.root}", "admin")
    h = {"Authorization": f"Bearer {thief.token}"}
    for path in (f"/v1/sandboxes/{sb.sandbox_id}", f"/v1/sandboxes/{sb.sandbox_id}/files?path=/etc/hostname",
                 f"/v1/sandboxes/{sb.sandbox_id}/commands", f"/v1/projects/{org.root}"):
        r = httpx.get(platform.url + path, headers=h)
        assert r.status_code == 404, (path, r.status_code, r.text)
    r = httpx.post(f"{platform.url}/v1/sandboxes/{sb.sandbox_id}/exec", headers=h, json={"cmd": "id"})
    assert r.status_code == 404
    r = httpx.get(f"{platform.url}/v1/jobs/planned", headers=h, params={"project": org.root})
    assert r.status_code == 403 and r.json()["field"] == "project"
    assert httpx.get(f"{platform.url}/v1/jobs/planned", headers=h).status_code == 404
    assert sb.sandbox_id not in {i.sandbox_id for i in thief.list()}
    assert not thief.list(job="secret-job")
    r = httpx.delete(f"{platform.url}/v1/sandboxes", headers=h, params={"job": "secret-job"})
    assert r.status_code == 200 and r.json() == []
    assert sb.refresh().state.value == "running"


def test_deleting_a_project_with_sandboxes(org: Org) -> None:
    name = f"{org.root}/tmp"
    org.lead.projects.create(name)
    runner = org.client(name, "runner", by=org.lead)
    sb = runner.run_container(dsec.ContainerArgs(**SMALL))
    with pytest.raises(dsec.ProjectNotEmpty) as e:
        org.lead.projects.delete(name)
    assert "1 sandbox" in e.value.message
    with pytest.raises(dsec.ProjectNotEmpty):
        org.admin.projects.delete(org.root)  # it has sub-projects
    out = org.lead.projects.delete(name, stop=True)
    assert out["sandboxes_stopped"] == [sb.sandbox_id] and len(out["tokens_revoked"]) == 1
    assert org.admin.connect(sb.sandbox_id).info.state.value == "stopped"
    with pytest.raises(dsec.Unauthorized):  # its tokens went with it, at once
        runner.list()
    assert org.admin.projects.get(org.root).usage.sandboxes == 0


def test_e2b_keys_are_project_tokens_under_its_quota(org: Org, platform: Platform) -> None:
    team = org.admin.projects.create(f"e2b{org.root}", ProjectQuota(sandboxes=2)).name
    key = org.token(team, "runner")
    h = {"X-API-Key": key}
    made = []
    try:
        for _ in range(2):
            r = httpx.post(f"{platform.url}/sandboxes", headers=h, json={"templateID": "base", "timeout": 60},
                           timeout=60)
            assert r.status_code == 201, r.text
            made.append(r.json()["sandboxID"])
        r = httpx.post(f"{platform.url}/sandboxes", headers=h, json={"templateID": "base", "timeout": 60},
                       timeout=60)
        assert r.status_code == 429 and repr(team) in r.json()["message"], r.text
        assert {s["sandboxID"] for s in httpx.get(f"{platform.url}/v2/sandboxes", headers=h).json()} == set(made)
        other = org.token(org.root, "runner")
        assert httpx.get(f"{platform.url}/v2/sandboxes", headers={"X-API-Key": other}).json() == []
    finally:
        for sid in made:
            httpx.delete(f"{platform.url}/sandboxes/{sid}", headers=h)


def test_cli(org: Org, platform: Platform) -> None:
    base = [sys.executable, "-m", "dsec.client.cli.main", "project"]
    auth = ["--url", platform.url, "--token", TOKEN]
    name = f"{org.root}/cli"
    r = subprocess.run([*base, "create", name, "--quota", "sandboxes=1,cpu=0.5,memory_gb=1", *auth],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["quota"] == {"sandboxes": 1, "cpu_cores": 0.5, "memory_mb": 1024}
    r = subprocess.run([*base, "usage", org.root, "--tree", *auth], capture_output=True, text=True)
    assert r.returncode == 0 and "cli" in r.stdout and "/ 4" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([*base, "set-quota", name, "--quota", "sandboxes=9", *auth], capture_output=True, text=True)
    assert r.returncode == 2 and "quota_conflict" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = subprocess.run([*base, "create", name + "/x", "--quota", "cpus=1", *auth], capture_output=True, text=True)
    assert r.returncode == 2 and "--quota" in r.stderr


def test_fncall_rate_per_project(org: Org, platform: Platform) -> None:
    """A project's FnCall calls per second: a second's worth at once, then 429s naming the
    project, on /v1/fncall and on the SandboxFusion face alike; its sibling is not slowed."""
    org.lead.projects.create(f"{org.root}/fn", ProjectQuota(fncall_per_s=0.5))  # a call every 2 s
    fn = org.client(f"{org.root}/fn", "runner", by=org.lead)
    free = org.client(org.root, "runner")
    call = dsec.FnCallArgs(language="python", code="print(1)")
    outcomes = []
    for _ in range(6):
        try:
            outcomes.append(fn.fncall(call).status)
        except dsec.QuotaExceeded as e:
            assert e.field == "quota.fncall_per_s" and f"{org.root}/fn" in e.message
            outcomes.append("429")
    assert outcomes[0] != "429" and outcomes.count("429") >= 2, outcomes
    assert all(free.fncall(call).status != "429" for _ in range(4))  # the parent has no cap of its own
    answers = [httpx.post(f"{platform.url}/sandboxfusion/{fn.token}/run_code", timeout=60,
                          json={"code": "print(1)", "language": "python"}).text for _ in range(3)]
    assert any("FnCall rate" in a for a in answers), answers


@pytest.fixture(scope="module")
def restartable(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    yield from own_platform(tmp_path_factory, "dsec-iam-restart")


@pytest.mark.parametrize("crash", [False, True], ids=["sigterm", "sigkill"])
def test_usage_survives_a_restart(restartable: Platform, crash: bool) -> None:
    """What a project holds is in the metadata database and on the edge: a restarted platform
    (SIGKILLed or not) still counts the sandboxes that outlived it, and still refuses past the quota."""
    org = Org(restartable)
    try:
        runner = org.client(org.root, "runner")
        held = [runner.run_container(dsec.ContainerArgs(**SMALL)) for _ in range(2)]
        restartable.restart(crash=crash)
        with dsec.Client(url=restartable.url, token=runner.token) as again:
            assert again.projects.get(org.root).usage.sandboxes == 2
            again.run_container(dsec.ContainerArgs(**SMALL))
            with pytest.raises(dsec.QuotaExceeded):  # 1.5 cores, 0.5 each
                again.run_container(dsec.ContainerArgs(**SMALL))
            again.connect(held[0].sandbox_id).stop()
            again.run_container(dsec.ContainerArgs(**SMALL))
            assert again.projects.get(org.root).usage.sandboxes == 3
    finally:
        org.admin = dsec.Client(url=restartable.url, token=TOKEN)  # the old client's connections died
        org.clients.append(org.admin)
        org.close()


def test_a_batch_is_refused_per_item_past_the_quota(org: Org) -> None:
    team = org.client(org.root, "runner")
    batch = team.create_many(dsec.ContainerArgs(**SMALL), n=6)
    made, failures = batch.result(timeout=120)
    try:
        assert len(made) == 3 and len(failures) == 3, failures  # the root's CPU: 1.5 cores of 0.5 each
        assert all(f.error == "quota_exceeded" and repr(org.root) in (f.reason or "") for f in failures), failures
    finally:
        for sb in made:
            sb.stop()


def test_a_batch_waits_for_the_starting_cap_instead_of_failing(org: Org) -> None:
    org.lead.projects.create(f"{org.root}/slow", ProjectQuota(starting=1))
    team = org.client(f"{org.root}/slow", "runner", by=org.lead)
    made, failures = team.create_many(dsec.ContainerArgs(**SMALL), n=3).result(timeout=120)
    try:
        assert failures == [] and len(made) == 3
        with pytest.raises(dsec.QuotaExceeded):  # the root's CPU is full now: that one is a refusal
            team.run_container(dsec.ContainerArgs(**SMALL))
    finally:
        for sb in made:
            sb.stop()


def test_red_team_e2b_and_platform_paths(org: Org, platform: Platform) -> None:
    """What a review found reachable, closed: a reader reading E2B sandboxes (the answer
    carries each sandbox's envd token, enough to exec), a runner publishing through E2B's
    snapshots, another project using, listing or deleting a team's snapshot, a project
    token reaching the FnCall pool's containers (they run every project's code), a token
    outliving the admin token that made it."""
    builder = org.token(org.root, "builder")
    runner, reader = org.token(org.root, "runner"), org.token(org.root, "reader")
    with dsec.Client(url=platform.url, token=builder) as b:
        sb = b.run_container(dsec.ContainerArgs(**SMALL))
    for path in ("/sandboxes", "/v2/sandboxes", f"/sandboxes/{sb.sandbox_id}"):
        r = httpx.get(platform.url + path, headers={"X-API-Key": reader})
        assert r.status_code == 403, (path, r.text)
    r = httpx.post(f"{platform.url}/sandboxes/{sb.sandbox_id}/snapshots", headers={"X-API-Key": runner}, json={})
    assert r.status_code == 403, r.text
    r = httpx.post(f"{platform.url}/sandboxes/{sb.sandbox_id}/snapshots", headers={"X-API-Key": builder}, json={},
                   timeout=60)
    assert r.status_code == 201, r.text
    snap = r.json()["snapshotID"]
    outsider = org.token(org.admin.projects.create(f"out{org.root}").name, "builder")
    h = {"X-API-Key": outsider}
    assert snap in {s["snapshotID"] for s in httpx.get(f"{platform.url}/snapshots",
                                                          headers={"X-API-Key": builder}).json()}
    assert snap not in {s["snapshotID"] for s in httpx.get(f"{platform.url}/snapshots", headers=h).json()}
    r = httpx.post(f"{platform.url}/sandboxes", headers=h, json={"templateID": snap, "timeout": 30}, timeout=60)
    assert r.status_code == 404, r.text
    assert httpx.delete(f"{platform.url}/templates/{snap}", headers=h).status_code == 404
    # the FnCall pool's containers belong to no project, not even "default"
    org.admin.fncall(dsec.FnCallArgs(language="python", code="print(1)"))
    pool = [i for i in org.admin.list() if i.labels.get("dsec-role") == "fncall" and i.state.value == "running"]
    assert pool
    as_default = {"Authorization": f"Bearer {org.token('default', 'runner')}"}
    for i in pool:
        r = httpx.get(f"{platform.url}/v1/sandboxes/{i.sandbox_id}", headers=as_default)
        assert r.status_code == 404, r.text
    # a token made by a token that expires expires with it
    with dsec.Client(url=platform.url, token=TOKEN) as admin:
        lead = admin.create_token(org.root, "admin", ttl_s=600)
    with dsec.Client(url=platform.url, token=lead.token) as c:
        made = c.create_token(org.root, "runner")
    assert made.expires_at is not None and abs(made.expires_at - (lead.expires_at or 0)) < 1e-6


def test_hidden_layers_stay_hidden_through_rollouts_and_admin_patches(org: Org) -> None:
    builder = org.client(org.root, "builder")
    sb = builder.run_container(dsec.ContainerArgs(**SMALL))
    layer = sb.pack_diff(f"ws/{org.root}-hidden:v1")
    assert layer.owner == org.root and layer.visibility == "project"
    other = org.client(org.admin.projects.create(f"r{org.root}").name, "runner")
    with pytest.raises(dsec.NotFound) as e:  # a worker with an admin token would otherwise make it
        other.rollouts.submit(dsec.RolloutSpec(agent="m:f", snapshot=layer.ref))
    assert e.value.field == "snapshot"
    with pytest.raises(dsec.NotFound):
        other.rollouts.submit(dsec.RolloutSpec(agent="m:f", args=dsec.ContainerArgs(image="base/busybox",
                                                                                      layers=[layer.ref])))
    # the cluster admin making an unowned base layer public changes nothing; hiding it needs an owner
    base = org.admin.set_layer_visibility("base/busybox:latest", "public")
    assert base.owner is None and base.visibility == "public"
    with pytest.raises(dsec.InvalidRequest) as e2:
        org.admin.set_layer_visibility("base/busybox:latest", "private")
    assert e2.value.field == "project"
    # the cluster admin's own sandbox (no project) publishes an unowned, public layer
    mine = org.admin.run_container(dsec.ContainerArgs(**SMALL))
    try:
        pub = mine.pack_diff(f"ws/{org.root}-admins:v1")
        assert pub.owner is None and pub.visibility == "public"
    finally:
        mine.stop()
