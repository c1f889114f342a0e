"""API tokens (admin only): create, list, revoke."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter

from dsec.apiserver.core import Apiserver
from dsec.errors import NotFound
from dsec.wire.iam import TokenInfo, TokenSpec


def routes(api: Apiserver) -> APIRouter:
    router = APIRouter()
    @router.post("/v1/tokens", status_code=201)
    async def create_token(spec: TokenSpec) -> TokenInfo:
        """A token for one project and role; its secret is in this answer only."""
        return await asyncio.to_thread(api.tokens.create, spec)

    @router.get("/v1/tokens")
    async def list_tokens() -> list[TokenInfo]:
        return await asyncio.to_thread(api.tokens.list)

    @router.delete("/v1/tokens/{token_id}")
    async def revoke_token(token_id: str) -> dict[str, str]:
        if not await asyncio.to_thread(api.tokens.revoke, token_id):
            raise NotFound(f"no token {token_id!r}", field="token_id")
        return {"revoked": token_id}
    return router
