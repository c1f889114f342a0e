"""The project tree: projects by path, their quotas, and the rule that keeps delegation
honest. A project's quota is carved from its parent's: for every resource a project caps,
what its sub-projects are delegated (each one's own cap, or for one without a cap, what
is delegated under it) never exceeds that cap. Changes to the tree are serialized (an
advisory lock on PostgreSQL, one writer on SQLite); usage counters are admission's
(dsec.control.iam.quota). Blocking calls: the apiserver runs them in a thread."""

from __future__ import annotations

import builtins
import contextlib
import functools
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

from sqlalchemy import Connection, Engine, delete, insert, select, text, update
from sqlalchemy.exc import IntegrityError

from dsec.control.iam import blocks
from dsec.control.iam.quota import COLUMNS, ProjectQuotas, in_subtree, show
from dsec.control.iam.tokens import record_event
from dsec.shared.errors import NotFound, ProjectExists, ProjectNotEmpty, QuotaConflict
from dsec.shared.meta.schema import project_holds, projects, tokens
from dsec.shared.wire.iam import (
    RESOURCES,
    ProjectInfo,
    ProjectPatch,
    ProjectQuota,
    ProjectSpec,
    Usage,
    lineage,
    parent_of,
)

TREE_LOCK = 0x64736564  # advisory lock key of tree changes on PostgreSQL
_QUOTA_COLS = {r: q for r, (_, q) in COLUMNS.items()}
_USAGE_COLS = {r: u for r, (u, _) in COLUMNS.items()}


def _to_row(q: ProjectQuota) -> dict[str, Any]:
    out: dict[str, Any] = {col: getattr(q, r) for r, col in _QUOTA_COLS.items()}
    if q.cpu_cores is not None:
        out["q_cpu_milli"] = round(q.cpu_cores * 1000)
    out["q_fncall_per_s"] = q.fncall_per_s
    return out


def _quota(row: Any) -> ProjectQuota:
    cpu = row["q_cpu_milli"]
    return ProjectQuota(sandboxes=row["q_sandboxes"], cpu_cores=cpu / 1000 if cpu is not None else None,
                        memory_mb=row["q_memory_mb"], disk_mb=row["q_disk_mb"], starting=row["q_starting"],
                        fncall_per_s=row["q_fncall_per_s"])


def _usage(amounts: dict[str, int | float]) -> Usage:
    return Usage(sandboxes=int(amounts["sandboxes"]), cpu_cores=amounts["cpu_cores"] / 1000,
                 memory_mb=int(amounts["memory_mb"]), disk_mb=int(amounts["disk_mb"]),
                 starting=int(amounts["starting"]))


class _Tree:
    """Every project's quota row, to compute what is delegated under each."""

    def __init__(self, rows: list[Any]) -> None:
        self.rows = {r["name"]: dict(r) for r in rows}
        self.children: dict[str | None, list[str]] = {}
        for name, r in self.rows.items():
            self.children.setdefault(r["parent"], []).append(name)

    def delegated(self, name: str, resource: str) -> int:
        col = _QUOTA_COLS[resource]
        total = 0
        for child in self.children.get(name, []):
            cap = self.rows[child][col]
            total += cap if cap is not None else self.delegated(child, resource)
        return total

    def check(self, name: str) -> None:
        """The delegation rule along ``name``'s lineage, for every resource; a QuotaConflict
        (409) says what to shrink."""
        for resource, col in _QUOTA_COLS.items():
            for p in reversed(lineage(name)):
                cap = self.rows[p][col]
                if cap is None:
                    continue
                d = self.delegated(p, resource)
                if d <= cap:
                    continue
                amount = functools.partial(show, resource, unit=False)
                kids = {c: self.rows[c][col] if self.rows[c][col] is not None else self.delegated(c, resource)
                        for c in sorted(self.children.get(p, []))}
                shares = ", ".join(f"{c}: {amount(v)}" for c, v in kids.items() if v)
                if p == name:
                    raise QuotaConflict(
                        f"project {p!r} would cap {resource} at {amount(cap)} but has delegated "
                        f"{amount(d)} to its sub-projects ({shares}): shrink them first",
                        field=f"quota.{resource}")
                branch = lineage(name)[len(lineage(p))]  # p's child on the way to the changed project
                left = cap - (d - kids[branch])
                raise QuotaConflict(
                    f"project {p!r} caps {resource} at {amount(cap)}; its sub-projects would be delegated "
                    f"{amount(d)} ({shares}): {amount(max(left, 0))} is left for {branch!r}",
                    field=f"quota.{resource}")


class ProjectStore:
    def __init__(self, db: Engine, quotas: ProjectQuotas) -> None:
        self.db = db
        self.quotas = quotas
        self._serial = threading.Lock()

    @contextlib.contextmanager
    def _tree_txn(self) -> Iterator[Connection]:
        # on SQLite also admission's lock: a delete must not read the holds while an admission
        # is between its charge and its commit
        with self._serial, self.quotas.serial(), self.db.begin() as c:
            if self.db.dialect.name == "postgresql":
                c.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": TREE_LOCK})
            yield c

    @staticmethod
    def _tree(c: Connection) -> _Tree:
        return _Tree(list(c.execute(select(projects)).mappings()))

    def create(self, spec: ProjectSpec, actor: str) -> ProjectInfo:
        parent = parent_of(spec.name)
        now = time.time()
        try:
            with self._tree_txn() as c:
                if parent is not None and c.execute(select(projects.c.name).where(projects.c.name == parent)).first() \
                        is None:
                    raise NotFound(f"no project {parent!r} to create {spec.name!r} under", field="name")
                c.execute(insert(projects).values(name=spec.name, parent=parent, description=spec.description,
                                                  created_at=now, created_by=actor, **_to_row(spec.quota)))
                self._tree(c).check(spec.name)
                record_event(c, actor, "project.create", spec.name, spec.name,
                             {"quota": spec.quota.model_dump(exclude_none=True)})
        except IntegrityError:
            raise ProjectExists(f"project {spec.name!r} exists", field="name") from None
        return self.get(spec.name)

    def get(self, name: str, tree: bool = False) -> ProjectInfo:
        with self.db.connect() as c:
            rows = list(c.execute(select(projects).where(in_subtree(projects.c.name, name))).mappings())
            unused = blocks.unused(c)
        if not any(r["name"] == name for r in rows):
            raise NotFound(f"no project {name!r}", field="name")
        t = _Tree(rows)
        infos = {n: self._info(t, n, unused) for n in t.rows}
        if not tree:
            return infos[name]
        jobs = self.quotas.job_usage(name)
        for (project, job), u in jobs.items():
            if project in infos:
                infos[project].jobs = {**(infos[project].jobs or {}),
                                       job: _usage({**u, "cpu_cores": u["cpu_milli"]})}
        for n in sorted(infos, key=lambda x: -x.count("/")):
            info = infos[n]
            info.children = [infos[c] for c in sorted(t.children.get(n, []))]
            if info.jobs is None:
                info.jobs = {}
        return infos[name]

    @staticmethod
    def _info(t: _Tree, name: str, unused: dict[str, Counter[str]]) -> ProjectInfo:
        """``unused``: the replicas' quota blocks by project (dsec.control.iam.blocks): in the counters,
        not in the usage shown, which is what sandboxes hold."""
        r = t.rows[name]
        ahead: Counter[str] = Counter()
        for p, amounts in unused.items():
            if p == name or p.startswith(name + "/"):
                ahead.update(amounts)
        return ProjectInfo(
            name=name, parent=r["parent"], description=r["description"] or "", quota=_quota(r),
            usage=_usage({k: r[col] - ahead[k] for k, col in _USAGE_COLS.items()}),
            delegated=_usage({k: t.delegated(name, k) for k in RESOURCES}),
            created_at=r["created_at"], created_by=r["created_by"])

    def list(self, under: str | None) -> list[ProjectInfo]:
        """Every project (``under``: that one and its subtree), parents before children."""
        q = select(projects)
        with self.db.connect() as c:
            rows = list(c.execute(q if under is None else q.where(in_subtree(projects.c.name, under))).mappings())
            unused = blocks.unused(c)
        t = _Tree(rows)
        return [self._info(t, n, unused) for n in sorted(t.rows)]

    def update(self, name: str, patch: ProjectPatch, actor: str) -> ProjectInfo:
        """Set the resources ``patch.quota`` names (the others kept), if the tree allows it."""
        given = patch.quota.model_fields_set
        with self._tree_txn() as c:
            row = c.execute(select(projects).where(projects.c.name == name)).mappings().first()
            if row is None:
                raise NotFound(f"no project {name!r}", field="name")
            old = _quota(row)
            new = old.model_copy(update={k: getattr(patch.quota, k) for k in given})
            values = _to_row(new)
            if patch.description is not None:
                values["description"] = patch.description
            c.execute(update(projects).where(projects.c.name == name).values(**values))
            self._tree(c).check(name)
            record_event(c, actor, "project.quota", name, name,
                         {"old": old.model_dump(exclude_none=True), "new": new.model_dump(exclude_none=True)})
        return self.get(name)

    def delete(self, name: str, actor: str) -> builtins.list[str]:
        """Remove a project with no sub-projects and no sandboxes; its tokens are revoked (their ids)."""
        with self._tree_txn() as c:
            blocks.free_project(c, name)  # replicas' blocks of it: a failed delete rolls this back
            # locked (PostgreSQL): an admission charging it commits first, and its hold is seen below
            if c.execute(select(projects.c.name).where(projects.c.name == name).with_for_update()).first() is None:
                raise NotFound(f"no project {name!r}", field="name")
            kids = c.execute(select(projects.c.name).where(projects.c.parent == name)).scalars().all()
            if kids:
                raise ProjectNotEmpty(f"project {name!r} has sub-projects ({', '.join(sorted(kids)[:10])}): "
                                      "delete them first", field="name")
            held = c.execute(select(project_holds.c.sandbox_id).where(project_holds.c.project == name)).all()
            if held:
                raise ProjectNotEmpty(f"project {name!r} has {len(held)} sandbox(es) starting, running or paused: "
                                      "stop them first, or delete with stop=true", field="name")
            revoked = c.execute(select(tokens.c.id).where(tokens.c.project == name)).scalars().all()
            c.execute(delete(tokens).where(tokens.c.project == name))
            c.execute(delete(projects).where(projects.c.name == name))
            record_event(c, actor, "project.delete", name, name, {"tokens_revoked": list(revoked)})
        return list(revoked)

    def exists(self, name: str) -> bool:
        with self.db.connect() as c:
            return c.execute(select(projects.c.name).where(projects.c.name == name)).first() is not None

    def check_job_quota(self, name: str, sandboxes: int | None, cpu_cores: float | None,
                        memory_mb: int | None) -> None:
        """A job's quota lives inside its project's: one asking more than the project (or an
        ancestor) caps is a QuotaConflict naming which."""
        with self.db.connect() as c:
            rows = c.execute(select(projects).where(projects.c.name.in_(lineage(name)))).mappings().all()
        for r in rows:
            cap = _quota(r)
            for field, want in (("sandboxes", sandboxes), ("cpu_cores", cpu_cores), ("memory_mb", memory_mb)):
                have = getattr(cap, field)
                if want is not None and have is not None and want > have:
                    raise QuotaConflict(f"the job's quota of {want:g} {field} exceeds project {r['name']!r}'s "
                                        f"{have:g}: a job's quota is carved from its project's", field=f"quota.{field}")

    def rates(self, name: str) -> builtins.list[tuple[str, float]]:
        """(project, calls/s) of the FnCall caps along ``name``'s lineage."""
        with self.db.connect() as c:
            rows = c.execute(select(projects.c.name, projects.c.q_fncall_per_s)
                             .where(projects.c.name.in_(lineage(name)))).all()
        return [(n, float(r)) for n, r in rows if r is not None]
