"""Wire models of the nodes API (``/v1/nodes``): each edge's load as the watcher last saw
it, with its health (the detector's verdict or an operator's cordon) and the evidence."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dsec.shared.wire.fleet import Evidence
from dsec.shared.wire.models import NodeStats, Strict

NodeState = Literal["up", "unreachable", "lost"]


class NodeInfo(NodeStats):
    """An edge: everything :class:`NodeStats` says (so older clients read it as before),
    plus whether it answers and its health record."""

    state: NodeState = Field(description="up; unreachable (its last poll got no answer); lost (its node is gone)")
    health_reason: str = ""
    health_at: float | None = None
    evidence: list[Evidence] = Field(default_factory=list, description="the signals behind the verdict")
    cordoned_by: str = Field("", description='"" (not cordoned), "detector", or the token id of the operator')


class CordonRequest(Strict):
    reason: str = Field(min_length=1, max_length=1000, description="why: kept with the cordon and its event")


class UncordonRequest(Strict):
    reason: str = Field("", max_length=1000)
