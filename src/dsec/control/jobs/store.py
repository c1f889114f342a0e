"""Job records in the metadata database (SQLite embedded, PostgreSQL in a cluster):
create, get, list, state changes. Blocking calls: the apiserver runs them in a thread."""

from __future__ import annotations

import json
import time
from typing import Any

from sqlalchemy import Engine, bindparam, case, insert, literal, or_, select, update
from sqlalchemy.exc import IntegrityError

from dsec.shared.errors import JobExists
from dsec.shared.meta.jobs_schema import jobs
from dsec.shared.wire.jobs import JobInfo, JobQuota, JobSpec, JobState

# a create reads its job's record: the statement built once (dsec.control.iam.visibility says why)
_ONE = select(jobs).where(jobs.c.project == bindparam("project"), jobs.c.name == bindparam("name"))


class JobStore:
    def __init__(self, db: Engine) -> None:
        self.db = db

    def create(self, project: str, spec: JobSpec) -> JobInfo:
        info = JobInfo(name=spec.name, project=project, labels=spec.labels, quota=spec.quota, state="active",
                       created_at=time.time(), checkpoint_every_s=spec.checkpoint_every_s)
        try:
            with self.db.begin() as c:
                c.execute(insert(jobs).values(project=project, name=spec.name, labels=json.dumps(spec.labels),
                                              quota=spec.quota.model_dump_json(), state="active",
                                              checkpoint_every_s=spec.checkpoint_every_s,
                                              created_at=info.created_at))
        except IntegrityError:  # the primary key: the name is taken in this project
            raise JobExists(f"project {project!r} already has a job {spec.name!r}", field="name") from None
        return info

    def get(self, project: str, name: str) -> JobInfo | None:
        with self.db.connect() as c:
            row = c.execute(_ONE, {"project": project, "name": name}).mappings().first()
        return _info(row) if row else None

    def list(self, project: str | None, labels: dict[str, str], state: str | None = None) -> list[JobInfo]:
        """The jobs of ``project`` (None: every project), those carrying all ``labels``."""
        q = select(jobs).order_by(jobs.c.created_at)
        if project is not None:
            q = q.where(jobs.c.project == project)
        if state is not None:
            q = q.where(jobs.c.state == state)
        with self.db.connect() as c:
            items = [_info(r) for r in c.execute(q).mappings()]
        return [i for i in items if all(i.labels.get(k) == v for k, v in labels.items())]

    def set_state(self, project: str, name: str, state: JobState) -> JobInfo | None:
        now = time.time()
        values: dict[str, Any] = {"state": state}
        if state == "paused":
            values["paused_at"] = now
        elif state == "active":
            values["paused_at"] = None
        else:
            values["stopped_at"] = now
        with self.db.begin() as c:
            c.execute(update(jobs).where(jobs.c.project == project, jobs.c.name == name).values(**values))
        return self.get(project, name)


    def take_creates(self, project: str, name: str, rate: float, n: int = 1) -> float:
        """Take ``n`` creates' tokens from the job's creation-rate bucket (``rate`` a second,
        holding a second's worth, at least one): 0.0 when taken, else the seconds until
        there will be enough (nothing taken). One bucket on the job's row, whichever replica
        asks, taken by one conditional UPDATE (two takes at once never both read the same
        tokens); exact up to the clock skew between the replicas' hosts."""
        size = max(rate, 1.0)
        now = time.time()
        t = jobs.c
        elapsed = case((t.rate_at > now, 0.0), else_=literal(now) - t.rate_at)
        refilled = t.rate_tokens + elapsed * rate
        tokens = case((or_(t.rate_tokens.is_(None), t.rate_at.is_(None)), size), (refilled > size, size),
                      else_=refilled)
        key = (t.project == project, t.name == name)
        with self.db.begin() as c:
            if c.execute(update(jobs).where(*key, tokens >= n).values(rate_tokens=tokens - n, rate_at=now)
                         ).rowcount == 1:
                return 0.0
            left = c.execute(select(tokens).where(*key)).scalar()
        return 0.0 if left is None else max((n - left) / rate, 0.001)


def _info(row: Any) -> JobInfo:
    r = dict(row)
    return JobInfo(name=r["name"], project=r["project"], labels=json.loads(r["labels"] or "{}"),
                   quota=JobQuota.model_validate_json(r["quota"] or "{}"), state=r["state"],
                   created_at=r["created_at"], paused_at=r["paused_at"], stopped_at=r["stopped_at"],
                   checkpoint_every_s=r.get("checkpoint_every_s"))
