"""The SDK's nodes face (``client.nodes``, docs/fault-tolerance.md): every edge with its
load and health, an operator's cordon, uncordon and drain, and the fleet's event log. Calling it
(``await client.nodes()``) lists the nodes, as it always did."""

from __future__ import annotations

import builtins
import urllib.parse
from typing import Any

from dsec.client.sdk.transport import Api
from dsec.shared.wire.fleet import DrainReport, FleetEvent
from dsec.shared.wire.nodes import NodeInfo


def _path(name: str) -> str:
    return "/v1/nodes/" + urllib.parse.quote(name, safe="")


class AsyncNodes:
    def __init__(self, client: Api) -> None:
        self._client = client

    async def __call__(self) -> builtins.list[NodeInfo]:
        """Every edge: load, whether it answers, health (ok / suspect / cordoned) and why."""
        return await self.list()

    async def list(self) -> builtins.list[NodeInfo]:
        return [NodeInfo.model_validate(x) for x in await self._client._json("GET", "/v1/nodes")]

    async def get(self, name: str) -> NodeInfo:
        return NodeInfo.model_validate(await self._client._json("GET", _path(name)))

    async def cordon(self, name: str, reason: str) -> NodeInfo:
        """(the cluster's admin) No new sandboxes on ``name`` until it is uncordoned; the
        detector never lifts it."""
        return NodeInfo.model_validate(await self._client._json("POST", _path(name) + "/cordon",
                                                                json={"reason": reason}))

    async def uncordon(self, name: str, reason: str = "") -> NodeInfo:
        """(the cluster's admin) Lift a cordon, the operator's or the detector's."""
        return NodeInfo.model_validate(await self._client._json("POST", _path(name) + "/uncordon",
                                                                json={"reason": reason}))

    async def drain(self, name: str, *, timeout: float = 960.0) -> DrainReport:
        """(the cluster's admin) Move every checkpointed sandbox off ``name`` to other edges
        (cordon it first, or new ones land there); the report says what moved where, what
        failed and why, and what was left running there (docs/fault-tolerance.md)."""
        return DrainReport.model_validate(await self._client._json("POST", _path(name) + "/drain", timeout=timeout))

    async def events(self, edge: str | None = None, *, sandbox_id: str | None = None, kind: str | None = None,
                     after: int = 0, limit: int = 200) -> builtins.list[FleetEvent]:
        """(the cluster's admin) The fleet's events after event ``after``, oldest first:
        health changes with their evidence, cordons and uncordons with who and why."""
        params: dict[str, Any] = {"after": after, "limit": limit}
        params.update({k: v for k, v in (("edge", edge), ("sandbox_id", sandbox_id), ("kind", kind)) if v})
        return [FleetEvent.model_validate(x) for x in await self._client._json("GET", "/v1/fleet/events",
                                                                              params=params)]
