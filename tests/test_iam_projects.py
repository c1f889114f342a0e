"""The project tree and its quotas on both databases they run on (SQLite embedded, a real
PostgreSQL as in a cluster), with an engine per "replica": delegation that never exceeds
the parent, lowering a parent below what it delegated refused with what to shrink,
admission charging every ancestor and refusing with the project and resource, creates
racing from two replicas for the last units never overshooting, holds released once,
paused sandboxes holding no CPU, and the sweep reconciling with what the edges hold."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine

from dsec.control.iam.projects import ProjectStore
from dsec.control.iam.quota import Need, ProjectQuotas
from dsec.shared.errors import NotFound, ProjectExists, ProjectNotEmpty, QuotaConflict, QuotaExceeded
from dsec.shared.meta import open_db, sqlite_url
from dsec.shared.wire.iam import ProjectPatch, ProjectQuota, ProjectSpec
from dsec.shared.wire.models import SandboxInfo, SandboxState
from tests.test_catalog_db import db_url, pg_url  # noqa: F401  (fixtures: a PostgreSQL server, a database)

ONE = Need.of(1.0, 512, 1024)


@pytest.fixture(params=["sqlite", "postgresql"])
def stores(request: pytest.FixtureRequest, tmp_path: os.PathLike[str]) -> Iterator[tuple[ProjectStore, ProjectStore]]:
    """Two replicas' stores on one database."""
    url = sqlite_url(str(tmp_path)) if request.param == "sqlite" else request.getfixturevalue("db_url")
    engines: list[Engine] = [open_db(url), open_db(url)]
    yield tuple(ProjectStore(e, ProjectQuotas(e)) for e in engines)  # type: ignore[misc]
    for e in engines:
        e.dispose()


def _q(**kw: float) -> ProjectQuota:
    return ProjectQuota(**kw)


def _info(sid: str, state: SandboxState = SandboxState.running, created: float | None = None,
          project: str = "team") -> SandboxInfo:
    return SandboxInfo(sandbox_id=sid, edge=sid.split("-")[0], backend="container", state=state,
                       image="base/busybox:latest", layers=[], created_at=created or time.time() - 3600,
                       last_active_at=time.time(), labels={"dsec.project": project}, memory_limit_mb=512,
                       cpu_cores_limit=1.0, disk_limit_mb=1024)


def test_delegation_never_exceeds_the_parent(stores: tuple[ProjectStore, ProjectStore]) -> None:
    s, _ = stores
    s.create(ProjectSpec(name="rl", quota=_q(sandboxes=100, cpu_cores=40)), "admin")
    s.create(ProjectSpec(name="rl/swe", quota=_q(sandboxes=60, cpu_cores=20.5)), "admin")
    with pytest.raises(QuotaConflict) as e:  # 60 + 50 > 100
        s.create(ProjectSpec(name="rl/math", quota=_q(sandboxes=50)), "admin")
    assert e.value.field == "quota.sandboxes" and "'rl'" in e.value.message and "40 is left for 'rl/math'" in \
        e.value.message, e.value.message
    assert not s.exists("rl/math")  # nothing half-made
    s.create(ProjectSpec(name="rl/math", quota=_q(sandboxes=40)), "admin")
    # a sub-project without a cap of its own delegates what is capped below it
    s.create(ProjectSpec(name="rl/free"), "admin")
    with pytest.raises(QuotaConflict):
        s.create(ProjectSpec(name="rl/free/deep", quota=_q(cpu_cores=20)), "admin")  # 20.5 + 20 > 40
    s.create(ProjectSpec(name="rl/free/deep", quota=_q(cpu_cores=19.5)), "admin")
    info = s.get("rl")
    assert info.delegated.sandboxes == 100 and info.delegated.cpu_cores == 40.0
    # raising a child past what its parent can spare: refused; the quota is unchanged
    with pytest.raises(QuotaConflict):
        s.update("rl/swe", ProjectPatch(quota=_q(sandboxes=61)), "admin")
    assert s.get("rl/swe").quota.sandboxes == 60
    # lowering a parent below what it delegated: refused, naming the sub-projects to shrink
    with pytest.raises(QuotaConflict) as e:
        s.update("rl", ProjectPatch(quota=_q(sandboxes=90)), "admin")
    assert "(rl/math: 40, rl/swe: 60)" in e.value.message, e.value.message
    s.update("rl/math", ProjectPatch(quota=_q(sandboxes=30)), "admin")
    s.update("rl", ProjectPatch(quota=_q(sandboxes=90)), "admin")
    # a patch names what it sets: cpu kept; null lifts the cap
    assert s.get("rl").quota.cpu_cores == 40.0
    s.update("rl/swe", ProjectPatch.model_validate({"quota": {"sandboxes": None}}), "admin")
    assert s.get("rl/swe").quota.sandboxes is None and s.get("rl/swe").quota.cpu_cores == 20.5
    with pytest.raises(ProjectExists):
        s.create(ProjectSpec(name="rl/swe"), "admin")
    with pytest.raises(NotFound):
        s.create(ProjectSpec(name="nope/child"), "admin")
    with pytest.raises(ValueError):
        ProjectSpec(name="rl/../rl")
    with pytest.raises(ValueError):
        ProjectSpec(name="rl//x")


def test_admission_charges_every_ancestor_and_names_the_project(stores: tuple[ProjectStore, ProjectStore]) -> None:
    s, _ = stores
    q = s.quotas
    s.create(ProjectSpec(name="org", quota=_q(cpu_cores=2.5)), "admin")
    s.create(ProjectSpec(name="org/a", quota=_q(sandboxes=5, memory_mb=2048)), "admin")
    s.create(ProjectSpec(name="org/b"), "admin")
    h1 = q.admit("org/a", "job1", ONE)
    h2 = q.admit("org/b", None, ONE)
    with pytest.raises(QuotaExceeded) as e:  # org has 0.5 cores left
        q.admit("org/a", None, ONE)
    assert e.value.status == 429 and e.value.field == "quota.cpu_cores" and "'org'" in e.value.message
    with pytest.raises(QuotaExceeded) as e:
        q.admit("org/a", None, Need.of(0.25, 2048, 0))  # org/a's memory: 512 + 2048 > 2048
    assert e.value.field == "quota.memory_mb" and "'org/a'" in e.value.message
    assert s.get("org").usage.sandboxes == 2 and s.get("org").usage.starting == 2
    q.bind(h1, "e1-00000000aaaa")
    q.bind(h2, "e1-00000000bbbb")
    u = s.get("org").usage
    assert (u.sandboxes, u.cpu_cores, u.memory_mb, u.disk_mb, u.starting) == (2, 2.0, 1024, 2048, 0)
    tree = s.get("org", tree=True)
    assert [c.name for c in tree.children or []] == ["org/a", "org/b"]
    assert tree.children and tree.children[0].jobs == {"job1": tree.children[0].jobs["job1"]}  # type: ignore[index]
    assert tree.children[0].jobs["job1"].sandboxes == 1  # type: ignore[index]
    # pausing frees the CPU, not the memory; resuming takes it back
    assert q.set_paused("e1-00000000aaaa", True) and not q.set_paused("e1-00000000aaaa", True)
    assert s.get("org").usage.cpu_cores == 1.0 and s.get("org").usage.memory_mb == 1024
    h3 = q.admit("org/a", None, ONE)  # room now
    q.release(hold=h3)
    assert q.set_paused("e1-00000000aaaa", False) and s.get("org").usage.cpu_cores == 2.0
    # released once, however many replicas report the stop
    assert q.release(sandbox_id="e1-00000000aaaa") and not q.release(sandbox_id="e1-00000000aaaa")
    assert q.release(sandbox_id="e1-00000000bbbb")
    u = s.get("org").usage
    assert (u.sandboxes, u.cpu_cores, u.memory_mb, u.disk_mb, u.starting) == (0, 0.0, 0, 0, 0)
    with pytest.raises(NotFound):
        q.admit("org/ghost", None, ONE)
    # a top-level project nobody created exists from its first sandbox, without a cap
    q.release(hold=q.admit("legacy", None, ONE))
    assert s.exists("legacy") and s.get("legacy").quota == ProjectQuota()


def test_the_starting_cap_counts_creates_in_flight(stores: tuple[ProjectStore, ProjectStore]) -> None:
    s, _ = stores
    s.create(ProjectSpec(name="burst", quota=_q(starting=2)), "admin")
    a, b = s.quotas.admit("burst", None, ONE), s.quotas.admit("burst", None, ONE)
    with pytest.raises(QuotaExceeded) as e:
        s.quotas.admit("burst", None, ONE)
    assert e.value.field == "quota.starting" and "starting at once" in e.value.message
    s.quotas.bind(a, "e1-00000000cccc")
    s.quotas.bind(b, "e1-00000000dddd")
    s.quotas.admit("burst", None, ONE)  # both made: room to start again


def test_creates_racing_from_two_replicas_never_overshoot(stores: tuple[ProjectStore, ProjectStore]) -> None:
    a, b = stores
    a.create(ProjectSpec(name="race", quota=_q(sandboxes=200)), "admin")
    a.create(ProjectSpec(name="race/x", quota=_q(sandboxes=30, cpu_cores=25)), "admin")
    a.create(ProjectSpec(name="race/y"), "admin")
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()

    def go(store: ProjectStore, project: str) -> None:
        for _ in range(10):
            try:
                store.quotas.admit(project, None, ONE)
                r = "ok"
            except QuotaExceeded as e:
                r = e.field or ""
            with lock:
                outcomes[f"{project}:{r}"] += 1

    threads = [threading.Thread(target=go, args=(st, p)) for st in (a, b) for p in ("race/x", "race/x", "race/y")
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # race/x: 80 tries for 25 cores; race/y: 40 tries, uncapped but for race's 200
    assert outcomes["race/x:ok"] == 25 and outcomes["race/x:quota.cpu_cores"] == 55, outcomes
    assert outcomes["race/y:ok"] == 40, outcomes
    assert a.get("race").usage.sandboxes == 65 == b.get("race").usage.sandboxes
    assert b.get("race/x").usage.cpu_cores == 25.0


def test_the_sweep_takes_what_the_edges_hold(stores: tuple[ProjectStore, ProjectStore]) -> None:
    s, other = stores
    s.create(ProjectSpec(name="team", quota=_q(sandboxes=10)), "admin")
    q = s.quotas
    for sid in ("e1-000000000001", "e1-000000000002", "e2-000000000003"):
        q.bind(q.admit("team", None, ONE), sid)
    stale = q.admit("team", None, ONE)  # a create whose replica died
    started = time.time()
    listed = [_info("e1-000000000001", SandboxState.paused),  # paused on its own: no CPU
              _info("e1-000000000009"),  # made without a hold, an hour ago: adopted
              _info("e1-000000000010", created=time.time())]  # too young to adopt: maybe a create on its way back
    # e1-0002 ended on its own (TTL); e2 did not answer: its sandbox is kept
    project_of = {i.sandbox_id: "team" for i in listed}
    done = other.quotas.reconcile(other.quotas.holds(), listed, {"e1"}, {"e1", "e2"}, started, project_of)
    assert done == {"released": 1, "adopted": 1, "paused": 1, "resumed": 0}, done
    u = s.get("team").usage
    assert (u.sandboxes, u.cpu_cores, u.starting) == (4, 3.0, 1), u  # 0001 (paused: no CPU), 0003, 0009, the stale hold
    # a second sweep (another replica's) changes nothing
    assert q.reconcile(q.holds(), listed, {"e1"}, {"e1", "e2"}, started, project_of) == \
        {"released": 0, "adopted": 0, "paused": 0, "resumed": 0}
    # an edge that left the cluster: its sandboxes' holds go; a starting hold past its time too
    done = q.reconcile(q.holds(), listed, {"e1"}, {"e1"}, started + 3600, project_of)
    assert done["released"] == 2 and done["adopted"] == 1 and not q.release(hold=stale)  # 0010 is old enough now
    assert s.get("team").usage.sandboxes == 3


def test_delete_refuses_a_project_that_holds_something(stores: tuple[ProjectStore, ProjectStore]) -> None:
    s, _ = stores
    s.create(ProjectSpec(name="gone"), "admin")
    s.create(ProjectSpec(name="gone/kid"), "admin")
    with pytest.raises(ProjectNotEmpty):
        s.delete("gone", "admin")
    h = s.quotas.admit("gone/kid", None, ONE)
    with pytest.raises(ProjectNotEmpty) as e:
        s.delete("gone/kid", "admin")
    assert "1 sandbox" in e.value.message
    s.quotas.release(hold=h)
    assert s.delete("gone/kid", "admin") == [] and not s.exists("gone/kid")
    s.delete("gone", "admin")
    with pytest.raises(NotFound):
        s.get("gone")


def test_a_publish_claim_is_retried_by_its_project_and_refused_to_others(
        stores: tuple[ProjectStore, ProjectStore]) -> None:
    """A pack_diff that died mid-way (its apiserver or edge killed) left its layer's claim:
    the same project's retry takes it over; another project is refused while it is fresh."""
    from dsec.control.iam.visibility import LayerAcl
    from dsec.shared.errors import InvalidRequest

    a, b = (LayerAcl(s.db) for s in stores)
    first = a.claim("ws/claimed:v1", "team", "project", "t1")
    again = b.claim("ws/claimed:v1", "team", "private", "t2")
    assert again.created_at >= first.created_at and a.get("ws/claimed:v1").visibility == "private"  # type: ignore[union-attr]
    with pytest.raises(InvalidRequest) as e:
        a.claim("ws/claimed:v1", "other", "public", "t3")
    assert e.value.field == "ref"


def test_a_gang_holds_all_its_shares_or_none_and_two_replicas_racing_never_overshoot(
        stores: tuple[ProjectStore, ProjectStore]) -> None:
    """Gang admission (a batch made all or nothing): n shares held in one transaction as
    reserved holds, the first shortfall refused naming the project, the resource and what
    the gang needs; ten gangs of 4 racing from two replicas for a quota of 18 sandboxes:
    exactly 4 win, and the counters hold 16, every ancestor too."""
    a, b = stores
    a.create(ProjectSpec(name="rl", quota=_q(sandboxes=18)), "admin")
    a.create(ProjectSpec(name="rl/grpo", quota=_q(cpu_cores=100)), "admin")
    won: list[str] = []
    refused: list[QuotaExceeded] = []
    lock = threading.Lock()

    def go(store: ProjectStore, k: int) -> None:
        try:
            store.quotas.reserve("rl/grpo", "step", ONE, 4, f"b-{k}")
            with lock:
                won.append(f"b-{k}")
        except QuotaExceeded as e:
            with lock:
                refused.append(e)

    threads = [threading.Thread(target=go, args=(a if k % 2 else b, k)) for k in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 4 and len(refused) == 6, (won, refused)
    assert all(e.field in ("quota.sandboxes", "quota") for e in refused)
    assert any("these 4 sandboxes need 4 sandboxes" in e.message and "'rl'" in e.message for e in refused), \
        [e.message for e in refused]
    for s in (a, b):
        assert s.get("rl").usage.sandboxes == 16 and s.get("rl/grpo").usage.sandboxes == 16
        assert s.get("rl").usage.starting == 0  # reserved: none of them starting yet

    # an item starts (one starting slot), is made (bound), and the gang's end frees the rest
    first = won[0]
    assert a.quotas.start(f"{first}/0") and not a.quotas.start(f"{first}/0")  # once
    assert b.get("rl").usage.starting == 1
    a.quotas.bind(f"{first}/0", "e1-00000000aaaa")
    assert b.get("rl").usage.starting == 0 and b.get("rl").usage.sandboxes == 16
    assert b.quotas.release_reserved(first) == 3 and b.quotas.release_reserved(first) == 0
    assert a.get("rl").usage.sandboxes == 13 and a.get("rl/grpo").usage.cpu_cores == 13.0
    assert not a.quotas.start(f"{first}/1")  # released: its item cannot start on it

    # the sweep releases what a batch that no longer runs reserved, and keeps a running one's
    holds = a.quotas.holds()
    done = a.quotas.reconcile(holds, [_info("e1-00000000aaaa", project="rl/grpo")], {"e1"}, {"e1"}, time.time(),
                              {"e1-00000000aaaa": "rl/grpo"}, running_batches={won[1]})
    assert done["released"] == 8, done  # the two gangs not running; won[1] keeps its 4
    assert b.get("rl").usage.sandboxes == 5  # won[1]'s 4 and the bound one


def test_a_gang_is_refused_by_a_cap_of_creates_starting_at_once_of_zero(
        stores: tuple[ProjectStore, ProjectStore]) -> None:
    s, _ = stores
    s.create(ProjectSpec(name="frozen", quota=_q(starting=0)), "admin")
    with pytest.raises(QuotaExceeded) as e:
        s.quotas.reserve("frozen", None, ONE, 3, "b-z")
    assert e.value.field == "quota.starting"
    assert s.get("frozen").usage.sandboxes == 0


def test_binds_committed_together_count_as_each_alone(stores: tuple[ProjectStore, ProjectStore]) -> None:
    """Group commit of binds (PostgreSQL's path under a burst): several binds of several
    projects in one transaction leave the counters as one bind each would."""
    s, other = stores
    s.create(ProjectSpec(name="g", quota=_q(starting=10)), "admin")
    s.create(ProjectSpec(name="g/a"), "admin")
    s.create(ProjectSpec(name="h"), "admin")
    holds = [(s.quotas.admit(p, None, ONE), f"e1-0000000000{i:02d}") for i, p in enumerate(["g/a", "g/a", "h", "g"])]
    assert s.get("g").usage.starting == 3 and s.get("h").usage.starting == 1
    other.quotas.bind_many([(h, sid, None, None) for h, sid in holds])
    assert s.get("g").usage.starting == 0 and s.get("g/a").usage.starting == 0 and s.get("h").usage.starting == 0
    assert s.get("g").usage.sandboxes == 3 and s.get("h").usage.sandboxes == 1
    other.quotas.bind_many([(h, sid, None, None) for h, sid in holds])  # again: nothing counted twice
    assert s.get("g").usage.starting == 0 and s.get("g").usage.sandboxes == 3
    assert s.quotas.release(sandbox_id=holds[0][1]) and s.get("g/a").usage.sandboxes == 1


def test_one_replica_holds_the_quota_sweep_at_a_time(stores: tuple[ProjectStore, ProjectStore]) -> None:
    """The quota sweep's lease: one holder among the replicas, renewed by it, taken over once
    it runs out, handed on at once by a clean stop."""
    from dsec.shared.meta.lease import release_lease, take_lease
    a, b = (s.quotas.db for s in stores)
    assert take_lease(a, "sweep", "A", 30) and take_lease(a, "sweep", "A", 30)  # held, renewed
    assert not take_lease(b, "sweep", "B", 30)
    assert take_lease(a, "sweep", "A", 0.01)
    time.sleep(0.05)
    assert take_lease(b, "sweep", "B", 30) and not take_lease(a, "sweep", "A", 30)  # ran out: B's
    release_lease(a, "sweep", "A")  # not A's to give: nothing changes
    assert not take_lease(a, "sweep", "A", 30)
    release_lease(b, "sweep", "B")
    assert take_lease(a, "sweep", "A", 30)
