"""The project tree: create sub-projects with quotas carved from their parent's, read a
project with its usage (``tree=true``: every sub-project and job), change a quota, delete.
A project's admin manages what is below it; only the cluster's admin makes top-level
projects or sets their quotas."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Query

from dsec.control.apiserver.core import Apiserver, all_edges_answered
from dsec.control.iam import PROJECT_LABEL, Principal, current_principal
from dsec.shared.errors import Forbidden, NotFound
from dsec.shared.wire.iam import ProjectInfo, ProjectPatch, ProjectSpec, check_project, parent_of


def _may_manage(p: Principal, name: str, what: str) -> None:
    """Creating, changing the quota of, or deleting ``name`` is its parent's admin's to do."""
    parent = parent_of(name)
    if parent is None and not p.all_projects:
        raise Forbidden(f"only the cluster's admin may {what} a top-level project ({name!r})", field="name")
    if parent is not None and not p.administers(parent):
        raise Forbidden(f"a {p.role} token of project {p.project!r} may not {what} project {name!r}: that is for an "
                        f"admin of {parent!r} or above" + (" (a project's admin cannot raise its own quota)"
                                                           if name == p.project else ""), field="name")


def _name(name: str) -> str:
    try:
        return check_project(name)
    except ValueError as e:
        raise NotFound(str(e), field="name") from None


def routes(api: Apiserver) -> APIRouter:
    router = APIRouter()
    store = api.projects

    @router.post("/v1/projects", status_code=201)
    async def create_project(spec: ProjectSpec) -> ProjectInfo:
        """A project under an existing one (or, for the cluster's admin, at the top), with a
        quota its parent can spare."""
        p = current_principal.get()
        _may_manage(p, spec.name, "create")
        return await asyncio.to_thread(store.create, spec, p.token_id)

    @router.get("/v1/projects")
    async def list_projects(under: str | None = None) -> list[ProjectInfo]:
        """The projects the caller sees (``under``: one and its subtree), parents first."""
        p = current_principal.get()
        if under is not None and not p.covers(_name(under)):
            raise NotFound(f"no project {under!r}", field="under")
        if under is None and not p.all_projects:
            under = p.project
        if not p.all_projects and p.role != "admin":  # only its own project, not its sub-projects
            return [i for i in await asyncio.to_thread(store.list, under) if i.name == p.project]
        return await asyncio.to_thread(store.list, under)

    @router.get("/v1/projects/{name:path}")
    async def get_project(name: str, tree: bool = Query(default=False, description="with sub-projects and jobs")
                          ) -> ProjectInfo:
        p = current_principal.get()
        if not p.covers(_name(name)):
            raise NotFound(f"no project {name!r}", field="name")
        if not p.all_projects and p.role != "admin":
            tree = False  # a sub-project is its admin's to show
        if not p.all_projects and "/" not in name and not await asyncio.to_thread(store.exists, name):
            return ProjectInfo(name=name, created_at=0.0)  # a token's top-level project that holds nothing yet
        return await asyncio.to_thread(store.get, name, tree)

    @router.patch("/v1/projects/{name:path}")
    async def update_project(name: str, patch: ProjectPatch) -> ProjectInfo:
        """Set the quota's named resources (null: no cap of its own); refused if it would
        delegate more than an ancestor holds, or cap the project below what it delegated."""
        p = current_principal.get()
        _may_manage(p, _name(name), "change the quota of")
        return await asyncio.to_thread(store.update, name, patch, p.token_id)

    @router.delete("/v1/projects/{name:path}")
    async def delete_project(name: str, stop: bool = Query(default=False, description="stop its sandboxes first")
                             ) -> dict[str, object]:
        """Remove a project with no sub-projects, revoking its tokens. One with sandboxes is
        refused (409) unless ``stop=true``, which stops them first."""
        p = current_principal.get()
        _may_manage(p, _name(name), "delete")
        if not await asyncio.to_thread(store.exists, name):
            raise NotFound(f"no project {name!r}", field="name")
        stopped: list[str] = []
        if stop:
            targets = [i for i in await api.list(None, {PROJECT_LABEL: name}) if i.state in ("running", "paused")]
            all_edges_answered("stopped")
            stopped = [info.sandbox_id for info in await api.stop_all(i.sandbox_id for i in targets)]
        revoked = await asyncio.to_thread(store.delete, name, p.token_id)
        api.tokens.forget(revoked)
        return {"deleted": name, "tokens_revoked": revoked, "sandboxes_stopped": stopped}
    return router
