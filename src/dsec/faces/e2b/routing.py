"""How E2B's REST routes answer (the sandbox API and the template API alike): errors as
E2B's ``{"code", "message"}`` with its statuses, a body that fails validation as a 400
naming the field, and the routes added to the app outside FastAPI's schema."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from pydantic import ValidationError
from starlette.responses import JSONResponse, Response

from dsec.shared.errors import DsecError, InvalidRequest

Handler = Callable[..., Awaitable[Response]]


def error(e: DsecError) -> JSONResponse:
    status = e.status
    if isinstance(e, InvalidRequest) and e.field == "sandbox_id":
        status = 404  # a malformed id names no sandbox, as far as the SDK is concerned
    return JSONResponse({"code": status, "message": e.message}, status_code=status)


def guarded(fn: Handler) -> Callable[[Request], Awaitable[Response]]:
    async def route(request: Request) -> Response:
        try:
            return await fn(request, **request.path_params)
        except DsecError as e:
            return error(e)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(x) for x in err["loc"])
            return error(InvalidRequest(f"{where}: {err['msg']}" if where else err["msg"], field=where or None))
    route.__name__ = fn.__name__
    return route


def add_routes(app: FastAPI, routes: list[tuple[str, Handler, str]]) -> None:
    for path, fn, method in routes:
        app.router.add_route(path, guarded(fn), methods=[method], include_in_schema=False)
