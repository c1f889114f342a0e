"""API tokens (project admins, for their subtree; the cluster's admin, for all): create (with
an expiry), list, revoke; and the IAM events, who changed what when."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Query

from dsec.control.apiserver.core import Apiserver
from dsec.control.iam import current_principal
from dsec.shared.errors import NotFound
from dsec.shared.wire.iam import IamEvent, TokenInfo, TokenSpec


def routes(api: Apiserver) -> APIRouter:
    router = APIRouter()
    @router.post("/v1/tokens", status_code=201)
    async def create_token(spec: TokenSpec) -> TokenInfo:
        """A token for one project (one the caller administers) and role; its secret is in this answer only."""
        return await asyncio.to_thread(api.tokens.create, spec, current_principal.get())

    @router.get("/v1/tokens")
    async def list_tokens() -> list[TokenInfo]:
        return await asyncio.to_thread(api.tokens.list, current_principal.get())

    @router.delete("/v1/tokens/{token_id}")
    async def revoke_token(token_id: str) -> dict[str, str]:
        if not await asyncio.to_thread(api.tokens.revoke, token_id, current_principal.get()):
            raise NotFound(f"no token {token_id!r}", field="token_id")
        return {"revoked": token_id}

    @router.get("/v1/iam/events")
    async def iam_events(after: int = Query(default=0, ge=0), limit: int = Query(default=1000, ge=1, le=10_000)
                         ) -> list[IamEvent]:
        """IAM changes (tokens, projects, quotas) after event ``after``, oldest first."""
        return await asyncio.to_thread(api.tokens.events, after, limit, current_principal.get())
    return router
