"""The rollout store on both databases it runs on (SQLite embedded, PostgreSQL in a cluster),
with an engine per "replica": idempotent submits, claims racing from several replicas
(each rollout to one worker), the journal's first write winning, leases expiring, a stale
worker fenced off, hand-back and reset, paused and stopped jobs. A real PostgreSQL server
(the cluster's own, dsec.control.cluster.postgres) is started for the module."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine

from dsec.control.jobs.store import JobStore
from dsec.control.rollouts.store import RolloutStore
from dsec.shared.errors import RolloutLost
from dsec.shared.meta import open_db, sqlite_url
from dsec.shared.wire.jobs import JobSpec
from dsec.shared.wire.rollouts import FinishRequest, RolloutSpec, Step
from tests.test_catalog_db import db_url, pg_url  # noqa: F401  (fixtures: a PostgreSQL server, a database)


@pytest.fixture(params=["sqlite", "postgresql"])
def engines(request: pytest.FixtureRequest, tmp_path: os.PathLike[str]) -> Iterator[tuple[Engine, Engine]]:
    """Two engines on one database, as two apiserver replicas have."""
    url = (sqlite_url(str(tmp_path)) if request.param == "sqlite"
           else request.getfixturevalue("db_url"))
    a, b = open_db(url), open_db(url)
    yield a, b
    a.dispose()
    b.dispose()


def _spec(key: str | None = None, job: str | None = None, **labels: str) -> RolloutSpec:
    return RolloutSpec(agent="m:f", key=key, job=job, labels=labels)


def _step(seq: int, response: object) -> Step:
    return Step(seq=seq, kind="note", request={"n": seq}, response=response, digest=f"d{seq}")


def test_submit_is_idempotent_by_key_and_lists_by_label(engines: tuple[Engine, Engine]) -> None:
    a, b = engines
    sa, sb = RolloutStore(a), RolloutStore(b)
    made, n = sa.submit("p", [_spec("k1", run="x"), _spec("k2", run="y"), _spec("k1", run="x"), _spec(None)])
    assert n == 3 and made[0].id == made[2].id and len({m.id for m in made}) == 3
    again, n2 = sb.submit("p", [_spec("k2"), _spec("k1")])
    assert n2 == 0 and [r.id for r in again] == [made[1].id, made[0].id]
    other, n3 = sb.submit("q", [_spec("k1")])  # keys are per project
    assert n3 == 1 and other[0].id != made[0].id
    assert [r.id for r in sa.list("p", labels={"run": "y"})] == [made[1].id]
    assert len(sa.list("p", labels={}, limit=2)) == 2 and len(sa.list(None)) == 4
    assert sa.counts("p", None).queued == 3


def test_claims_racing_from_two_replicas_give_each_rollout_once(engines: tuple[Engine, Engine]) -> None:
    a, b = engines
    stores = [RolloutStore(a), RolloutStore(b)]
    ids = {r.id for r in stores[0].submit("p", [_spec() for _ in range(40)])[0]}
    got: list[str] = []
    lock = threading.Lock()

    def worker(k: int) -> None:
        store = stores[k % 2]
        for _ in range(30):
            cl = store.claim("p", f"w{k}", 3, 30, time.time())
            with lock:
                got.extend(c.rollout.id for c in cl)
            if not cl:
                return
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert Counter(got) == Counter({i: 1 for i in ids})  # every rollout claimed, none twice


def test_journal_lease_expiry_and_fencing(engines: tuple[Engine, Engine]) -> None:
    a, b = engines
    sa, sb = RolloutStore(a), RolloutStore(b)
    (r,), _ = sa.submit("p", [RolloutSpec(agent="m:f", max_attempts=2)])
    (c1,) = sa.claim("p", "w1", 5, 0.5, time.time())
    assert c1.attempt == 1 and c1.steps == []
    assert sa.add_step(r.id, "w1", 1, _step(0, "first")).response == "first"
    assert sb.add_step(r.id, "w1", 1, _step(0, "second")).response == "first"  # the first write wins
    with pytest.raises(RolloutLost):
        sb.add_step(r.id, "w2", 1, _step(1, "x"))
    assert sb.expire("q", time.time() + 1) == []  # another project's sweep leaves it alone
    assert sb.expire("p", time.time() + 1) == []  # requeued (attempts left), not failed
    (c2,) = sb.claim(None, "w2", 5, 0.5, time.time())
    assert c2.attempt == 2 and [s.response for s in c2.steps] == ["first"]
    with pytest.raises(RolloutLost):  # the first holder, late: fenced off
        sa.finish(r.id, FinishRequest(worker="w1", attempt=1, state="done", reward=1.0))
    with pytest.raises(RolloutLost):
        sa.add_step(r.id, "w1", 1, _step(1, "late"))
    held = sa.heartbeat("p", "w1", [r.id], 30, time.time())
    assert [(h.owned, h.state) for h in held] == [(False, "running")]
    (failed,) = sa.expire(None, time.time() + 1)  # out of attempts: failed as infra
    assert failed.id == r.id and failed.failure == "infra" and "w2" in (failed.error or "")
    info = sa.get(r.id, steps=True)
    assert info is not None and info.state == "failed" and info.steps is not None and len(info.steps) == 1


def test_hand_back_reset_and_outcomes(engines: tuple[Engine, Engine]) -> None:
    a, _ = engines
    s = RolloutStore(a)
    (r,), _ = s.submit("p", [_spec()])
    (c,) = s.claim("p", "w", 1, 30, time.time())
    s.add_step(r.id, "w", 1, _step(0, 1))
    back = s.finish(r.id, FinishRequest(worker="w", attempt=1, state="failed", failure="infra", release=True))
    assert back.state == "queued" and back.attempts == 0 and back.n_steps == 1  # not counted, journal kept
    (c,) = s.claim("p", "w", 1, 30, time.time())
    assert c.attempt == 1 and len(c.steps) == 1
    reset = s.finish(r.id, FinishRequest(worker="w", attempt=1, state="failed", failure="infra", requeue=True,
                                         reset=True, error="sandbox lost\x00"))
    assert reset.state == "queued" and reset.n_steps == 0 and reset.attempts == 1
    (c,) = s.claim("p", "w", 1, 30, time.time())
    assert c.attempt == 2 and c.steps == []
    done = s.finish(r.id, FinishRequest(worker="w", attempt=2, state="failed", failure="workload",
                                        error="Traceback\x00binary"))  # PostgreSQL text takes no NUL
    assert done.state == "failed" and done.error is not None and "\x00" not in done.error
    assert s.ack("p", [r.id]) == 1 and s.counts("p", None).unconsumed == 0


def test_paused_jobs_are_not_claimed_and_stopped_ones_cancelled(engines: tuple[Engine, Engine]) -> None:
    a, _ = engines
    s, jobs = RolloutStore(a), JobStore(a)
    jobs.create("p", JobSpec(name="j1"))
    made, _ = s.submit("p", [_spec(job="j1"), _spec(job="free")])  # "free": a job label without a record
    jobs.set_state("p", "j1", "paused")
    assert [c.rollout.id for c in s.claim("p", "w", 5, 30, time.time())] == [made[1].id]
    jobs.set_state("p", "j1", "stopped")
    assert s.cancel_stopped_jobs("p", time.time()) == [made[0].id]
    assert s.get(made[0].id).state == "cancelled"  # type: ignore[union-attr]
