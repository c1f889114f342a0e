"""FnCall: short stateless tasks in pooled warm containers."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from dsec.control.apiserver.core import MAX_EXEC_BODY, Apiserver, parse_body, read_body
from dsec.control.iam import acting_project
from dsec.shared.wire.models import (
    FNCALL_IMAGE,
    FnCallArgs,
    FnCallResult,
)


def routes(api: Apiserver) -> APIRouter:
    router = APIRouter()
    fncall_body = {"content": {"application/json": {"schema": FnCallArgs.model_json_schema()}}, "required": True}

    @router.post("/v1/fncall", response_model=None, openapi_extra={"requestBody": fncall_body},
                 responses={200: {"model": FnCallResult, "description": "FnCallResult"}})
    async def fncall(request: Request) -> Response:
        """Run a short stateless task in a pooled warm container (compile once, run each test)."""
        await api.fncall_rates.take(acting_project(None))
        args = parse_body(FnCallArgs, await read_body(request, MAX_EXEC_BODY, "body"))
        res = await api.fncall(args)  # (its image and layers are checked there, for every face)
        return Response(res.model_dump_json(), media_type="application/json")

    @router.get("/v1/fncall/languages")
    async def fncall_languages(image: str = FNCALL_IMAGE) -> list[str]:
        await api.check_refs(image, [])  # another project's hidden layer is unknown here too
        return await api.fncall_edge(image).fncall_languages(image)
    return router
