"""The SDK's projects face (``client.projects``, docs/iam.md): the project tree, its quotas
and usage. Project names are paths ("rl-team/agentic-swe")."""

from __future__ import annotations

import builtins
import urllib.parse
from typing import Any

from dsec.client.sdk.transport import Api
from dsec.shared.wire.iam import ProjectInfo, ProjectQuota


def _path(name: str) -> str:
    return "/v1/projects/" + urllib.parse.quote(name, safe="/")


class AsyncProjects:
    def __init__(self, client: Api) -> None:
        self._client = client

    async def create(self, name: str, quota: ProjectQuota | None = None, *, description: str = "") -> ProjectInfo:
        """A project under an existing one (or, for the cluster's admin, at the top); its
        quota must fit in what its parent has not delegated (QuotaConflict says what does not)."""
        body = {"name": name, "quota": (quota or ProjectQuota()).model_dump(exclude_none=True),
                "description": description}
        return ProjectInfo.model_validate(await self._client._json("POST", "/v1/projects", json=body))

    async def get(self, name: str, *, tree: bool = False) -> ProjectInfo:
        """Its quota, what it delegated and what its subtree holds; ``tree=True`` adds every
        sub-project (``children``) and each project's jobs' usage (``jobs``)."""
        return ProjectInfo.model_validate(await self._client._json(
            "GET", _path(name), params={"tree": str(tree).lower()}))

    async def list(self, under: str | None = None) -> builtins.list[ProjectInfo]:
        params = {"under": under} if under else {}
        return [ProjectInfo.model_validate(x) for x in await self._client._json("GET", "/v1/projects", params=params)]

    async def set_quota(self, name: str, **quota: Any) -> ProjectInfo:
        """Set the named resources (``sandboxes=8000, cpu_cores=1500``; None lifts a cap), keeping the others."""
        ProjectQuota(**quota)  # a typo or a bad value is the caller's InvalidRequest-like ValidationError here
        return ProjectInfo.model_validate(await self._client._json("PATCH", _path(name), json={"quota": quota}))

    async def delete(self, name: str, *, stop: bool = False) -> dict[str, Any]:
        """Remove a project with no sub-projects (its tokens are revoked); one with sandboxes
        is refused (ProjectNotEmpty) unless ``stop=True``."""
        return dict(await self._client._json("DELETE", _path(name), params={"stop": str(stop).lower()}))
