"""The template catalog over the metadata database (SQLite embedded, PostgreSQL in a
cluster): templates by name, builds and their status, build logs, tags, and the step
cache. Every replica reads and writes the same rows, so a build started through one
apiserver is followed through any other. Blocking calls: services run them in a thread."""

from __future__ import annotations

import json
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import Engine, delete, insert, select, update
from sqlalchemy.exc import IntegrityError

from dsec.faces.templates.models import BuildStatus, BuiltTemplate, TemplateSpec, check_name, check_tag
from dsec.shared.errors import DsecError, NotFound
from dsec.shared.meta.templates_schema import (
    template_build_logs,
    template_builds,
    template_cache,
    template_tags,
    templates,
)

MAX_LOG_ENTRIES = 20_000  # per build; further lines are counted, not kept
LOG_PAGE = 100  # entries per status call, as E2B's API pages them
RUNNER_LOST_S = 30.0  # a build whose runner has not said it is alive for this long has failed


class Conflict(DsecError):
    status = 409
    code = "conflict"


@dataclass(frozen=True)
class TemplateRow:
    id: str
    name: str
    project: str
    public: bool
    created_at: float
    updated_at: float
    build_count: int
    spawn_count: int
    last_spawned_at: float | None


@dataclass(frozen=True)
class BuildRow:
    id: str
    template_id: str
    status: BuildStatus
    cpu_count: int
    memory_mb: int
    tags: list[str]
    created_at: float
    updated_at: float
    finished_at: float | None
    spec: TemplateSpec | None
    result: BuiltTemplate | None
    reason: dict[str, str] | None
    runner: str | None
    heartbeat_at: float | None
    builder: str | None
    log_count: int


@dataclass(frozen=True)
class LogRow:
    ts: float
    level: str
    step: str | None
    message: str


def _template(r: object) -> TemplateRow:
    m = r._mapping  # type: ignore[attr-defined]
    return TemplateRow(m["id"], m["name"], m["project"], bool(m["public"]), m["created_at"], m["updated_at"],
                       m["build_count"], m["spawn_count"], m["last_spawned_at"])


def _build(r: object) -> BuildRow:
    m = r._mapping  # type: ignore[attr-defined]
    return BuildRow(m["id"], m["template_id"], m["status"], m["cpu_count"], m["memory_mb"], json.loads(m["tags"]),
                    m["created_at"], m["updated_at"], m["finished_at"],
                    TemplateSpec.model_validate_json(m["spec"]) if m["spec"] else None,
                    BuiltTemplate.model_validate_json(m["result"]) if m["result"] else None,
                    json.loads(m["reason"]) if m["reason"] else None, m["runner"], m["heartbeat_at"], m["builder"],
                    m["log_count"])


def new_template_id() -> str:
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    return "".join(secrets.choice(alphabet) for _ in range(20))


class TemplateCatalog:
    def __init__(self, db: Engine) -> None:
        self.db = db

    # ---- templates ------------------------------------------------------------------
    def template(self, id_or_name: str) -> TemplateRow | None:
        """By id first, then by name: a name that looks like another template's id never
        stands for that template."""
        with self.db.connect() as c:
            r = c.execute(select(templates).where(templates.c.id == id_or_name)).first() or \
                c.execute(select(templates).where(templates.c.name == id_or_name)).first()
        return _template(r) if r else None

    def templates(self, project: str | None = None) -> list[TemplateRow]:
        q = select(templates).order_by(templates.c.created_at)
        if project is not None:
            q = q.where(templates.c.project == project)
        with self.db.connect() as c:
            return [_template(r) for r in c.execute(q)]

    def delete_template(self, template_id: str) -> list[tuple[str, str | None]]:
        """Forget a template, its builds, tags and logs; returns the builds still running
        (and their builder sandboxes), for the caller to stop."""
        with self.db.begin() as c:
            running = [(r.id, r.builder) for r in c.execute(select(template_builds).where(
                (template_builds.c.template_id == template_id)
                & template_builds.c.status.in_(("waiting", "building"))))]
            ids = [r.id for r in c.execute(select(template_builds.c.id).where(
                template_builds.c.template_id == template_id))]
            c.execute(delete(template_build_logs).where(template_build_logs.c.build_id.in_(ids)))
            c.execute(delete(template_builds).where(template_builds.c.template_id == template_id))
            c.execute(delete(template_tags).where(template_tags.c.template_id == template_id))
            n = c.execute(delete(templates).where(templates.c.id == template_id)).rowcount
        if not n:
            raise NotFound(f"template {template_id!r} not found", field="templateID")
        return running

    def set_public(self, template_id: str, public: bool) -> None:
        with self.db.begin() as c:
            q = update(templates).where(templates.c.id == template_id).values(public=int(public))
            if not c.execute(q).rowcount:
                raise NotFound(f"template {template_id!r} not found", field="templateID")

    def spawned(self, template_id: str) -> None:
        with self.db.begin() as c:
            c.execute(update(templates).where(templates.c.id == template_id).values(
                spawn_count=templates.c.spawn_count + 1, last_spawned_at=time.time()))

    # ---- builds ---------------------------------------------------------------------
    def request_build(self, name: str, tags: list[str], cpu_count: int, memory_mb: int,
                      project: str) -> tuple[TemplateRow, BuildRow]:
        """A new build of template ``name`` (made on first use), waiting for its steps."""
        check_name(name)
        now = time.time()
        for _ in range(3):  # two requests may make the same new name at once: one insert wins
            with self.db.begin() as c:
                row = c.execute(select(templates).where(templates.c.name == name)).first()
                if row is None and c.execute(select(templates.c.id).where(templates.c.id == name)).first():
                    raise Conflict(f"template name {name!r} is another template's id", field="name")
                if row is None:
                    tid = new_template_id()
                    try:
                        c.execute(insert(templates).values(id=tid, name=name, project=project, public=0,
                                                           created_at=now, updated_at=now, build_count=0,
                                                           spawn_count=0))
                    except IntegrityError:
                        continue
                    row = c.execute(select(templates).where(templates.c.id == tid)).first()
                t = _template(row)
                if t.project != project and project != "*":
                    raise Conflict(f"template name {name!r} belongs to another project", field="name")
                bid = str(uuid.uuid4())
                c.execute(insert(template_builds).values(
                    id=bid, template_id=t.id, status="waiting", cpu_count=cpu_count, memory_mb=memory_mb,
                    tags=json.dumps(tags), created_at=now, updated_at=now, log_count=0))
                b = _build(c.execute(select(template_builds).where(template_builds.c.id == bid)).one())
                return t, b
        raise Conflict(f"template {name!r} is being created concurrently; try again", field="name")

    def build(self, build_id: str) -> BuildRow | None:
        with self.db.connect() as c:
            r = c.execute(select(template_builds).where(template_builds.c.id == build_id)).first()
        return _build(r) if r else None

    def builds(self, template_id: str) -> list[BuildRow]:
        with self.db.connect() as c:
            return [_build(r) for r in c.execute(select(template_builds).where(
                template_builds.c.template_id == template_id).order_by(template_builds.c.created_at))]

    def start(self, build_id: str, spec: TemplateSpec, runner: str) -> None:
        """waiting -> building, once: a second start of the same build is a conflict."""
        now = time.time()
        with self.db.begin() as c:
            n = c.execute(update(template_builds).where(
                (template_builds.c.id == build_id) & (template_builds.c.status == "waiting")).values(
                status="building", spec=spec.model_dump_json(), runner=runner, heartbeat_at=now,
                updated_at=now)).rowcount
        if not n:
            b = self.build(build_id)
            if b is None:
                raise NotFound(f"build {build_id!r} not found", field="buildID")
            raise Conflict(f"build {build_id} was already started (it is {b.status})", field="buildID")

    def heartbeat(self, build_id: str, builder: str | None = None) -> None:
        values: dict[str, object] = {"heartbeat_at": time.time()}
        if builder is not None:
            values["builder"] = builder
        with self.db.begin() as c:
            c.execute(update(template_builds).where(template_builds.c.id == build_id).values(**values))

    def add_logs(self, build_id: str, entries: list[LogRow]) -> None:
        if not entries:
            return
        with self.db.begin() as c:
            n = c.execute(select(template_builds.c.log_count).where(template_builds.c.id == build_id)).scalar()
            if n is None:
                return
            keep = entries[:max(0, MAX_LOG_ENTRIES - n)]
            if keep:
                c.execute(insert(template_build_logs), [
                    {"build_id": build_id, "seq": n + i, "ts": e.ts, "level": e.level, "step": e.step,
                     "message": e.message} for i, e in enumerate(keep)])
                c.execute(update(template_builds).where(template_builds.c.id == build_id).values(
                    log_count=n + len(keep)))

    def logs(self, build_id: str, offset: int, limit: int = LOG_PAGE) -> list[LogRow]:
        with self.db.connect() as c:
            return [LogRow(r.ts, r.level, r.step, r.message) for r in c.execute(
                select(template_build_logs).where((template_build_logs.c.build_id == build_id)
                                                  & (template_build_logs.c.seq >= offset))
                .order_by(template_build_logs.c.seq).limit(limit))]

    def finish(self, build_id: str, result: BuiltTemplate) -> BuildRow:
        """building -> ready: the build's tags now point at it."""
        now = time.time()
        with self.db.begin() as c:
            n = c.execute(update(template_builds).where(
                (template_builds.c.id == build_id) & (template_builds.c.status == "building")).values(
                status="ready", result=result.model_dump_json(), finished_at=now, updated_at=now,
                builder=None)).rowcount
            b = _build(c.execute(select(template_builds).where(template_builds.c.id == build_id)).one())
            if not n:
                raise Conflict(f"build {build_id} is {b.status}, not building", field="buildID")
            for tag in b.tags:
                self._tag(c, b.template_id, tag, build_id, now)
            c.execute(update(templates).where(templates.c.id == b.template_id).values(
                updated_at=now, build_count=templates.c.build_count + 1))
        return b

    def fail(self, build_id: str, message: str, step: str | None = None) -> None:
        now = time.time()
        reason = {"message": message, **({"step": step} if step is not None else {})}
        with self.db.begin() as c:
            c.execute(update(template_builds).where(
                (template_builds.c.id == build_id) & template_builds.c.status.in_(("waiting", "building"))).values(
                status="error", reason=json.dumps(reason), finished_at=now, updated_at=now))

    def reap(self, now: float | None = None, dead: Callable[[str], bool] | None = None) -> list[BuildRow]:
        """Builds whose runner went quiet (its apiserver died), or that ``dead`` says of
        their runner: failed, returned so the caller stops their builder sandboxes."""
        cutoff = (now or time.time()) - RUNNER_LOST_S
        with self.db.connect() as c:
            stale = [_build(r) for r in c.execute(select(template_builds).where(
                template_builds.c.status == "building"))]
        stale = [b for b in stale if (b.heartbeat_at or 0) < cutoff or (dead is not None and dead(b.runner or ""))]
        for b in stale:
            self.fail(b.id, f"the build's runner ({b.runner}) stopped answering; build it again")
        return stale

    # ---- tags -----------------------------------------------------------------------
    @staticmethod
    def _tag(c: object, template_id: str, tag: str, build_id: str, now: float) -> None:
        c.execute(delete(template_tags).where(  # type: ignore[attr-defined]
            (template_tags.c.template_id == template_id) & (template_tags.c.tag == tag)))
        c.execute(insert(template_tags).values(  # type: ignore[attr-defined]
            template_id=template_id, tag=tag, build_id=build_id, created_at=now))

    def tags(self, template_id: str) -> list[tuple[str, str, float]]:
        with self.db.connect() as c:
            return [(r.tag, r.build_id, r.created_at) for r in c.execute(select(template_tags).where(
                template_tags.c.template_id == template_id).order_by(template_tags.c.created_at))]

    def assign(self, target: str, tags: list[str]) -> tuple[str, list[str]]:
        """Point ``tags`` at the build ``target`` (``name:tag``, or a name: its default) is."""
        for t in tags:
            check_tag(t)
        t_row, b = self.resolve(target)
        now = time.time()
        with self.db.begin() as c:
            for tag in tags:
                self._tag(c, t_row.id, tag, b.id, now)
        return b.id, tags

    def untag(self, name: str, tags: list[str]) -> None:
        t = self.template(name)
        if t is None:
            raise NotFound(f"template {name!r} not found", field="name")
        with self.db.begin() as c:
            c.execute(delete(template_tags).where((template_tags.c.template_id == t.id)
                                                  & template_tags.c.tag.in_(tags)))

    def resolve(self, ref: str) -> tuple[TemplateRow, BuildRow]:
        """The ready build ``ref`` names: ``name`` or ``id`` (its ``default`` tag, else its
        latest ready build), ``name:tag``, or ``name:buildID``."""
        name, _, tag = ref.partition(":")
        t = self.template(name)
        if t is None:
            raise NotFound(f"template {name!r} not found", field="templateID")
        with self.db.connect() as c:
            bid = None
            if tag:
                bid = c.execute(select(template_tags.c.build_id).where(
                    (template_tags.c.template_id == t.id) & (template_tags.c.tag == tag))).scalar()
                if bid is None:
                    bid = c.execute(select(template_builds.c.id).where(
                        (template_builds.c.template_id == t.id) & (template_builds.c.id == tag)
                        & (template_builds.c.status == "ready"))).scalar()
                if bid is None:
                    raise NotFound(f"tag '{tag}' does not exist for template '{name}'", field="templateID")
            else:
                bid = c.execute(select(template_tags.c.build_id).where(
                    (template_tags.c.template_id == t.id) & (template_tags.c.tag == "default"))).scalar()
                if bid is None:
                    bid = c.execute(select(template_builds.c.id).where(
                        (template_builds.c.template_id == t.id) & (template_builds.c.status == "ready"))
                        .order_by(template_builds.c.finished_at.desc()).limit(1)).scalar()
                if bid is None:
                    raise NotFound(f"template {name!r} has no finished build", field="templateID")
            r = c.execute(select(template_builds).where(template_builds.c.id == bid)).one()
        return t, _build(r)

    # ---- cache ----------------------------------------------------------------------
    def cached(self, keys: list[str]) -> dict[str, BuiltTemplate]:
        if not keys:
            return {}
        with self.db.connect() as c:
            return {r.key: BuiltTemplate.model_validate_json(r.result) for r in c.execute(
                select(template_cache).where(template_cache.c.key.in_(keys)))}

    def results(self, template_id: str) -> list[BuiltTemplate]:
        """What each of the template's finished builds made."""
        with self.db.connect() as c:
            return [BuiltTemplate.model_validate_json(r) for r in c.execute(
                select(template_builds.c.result).where(template_builds.c.template_id == template_id,
                                                       template_builds.c.result.is_not(None))).scalars()]

    def cache_put(self, key: str, result: BuiltTemplate) -> None:
        with self.db.begin() as c:
            c.execute(delete(template_cache).where(template_cache.c.key == key))
            c.execute(insert(template_cache).values(key=key, result=result.model_dump_json(), created_at=time.time()))
