"""How the Daytona face answers: Daytona's error envelope (``statusCode``, ``message``,
``error``, and a daemon's ``code`` and ``source``, which its SDK maps to its exception
classes), camelCase JSON bodies, and request bodies validated with the field named."""

from __future__ import annotations

import datetime
import json
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from dsec.faces.daytona import models as m
from dsec.shared.errors import DsecError, InvalidRequest

REASONS = {400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found", 408: "Request Timeout",
           409: "Conflict", 410: "Gone", 413: "Payload Too Large", 422: "Unprocessable Entity",
           429: "Too Many Requests", 500: "Internal Server Error", 501: "Not Implemented",
           503: "Service Unavailable"}

def error_response(e: DsecError, path: str = "", code: str | None = None, source: str | None = None) -> Response:
    status = e.status
    if isinstance(e, InvalidRequest) and e.field == "sandbox_id":
        status = 404  # a malformed id names no sandbox
    now = datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")
    body = m.ErrorBody(status_code=status, message=e.message, error=REASONS.get(status, "Error"), code=code,
                       source=source, field=e.field, path=path, timestamp=now)
    return json_response(body, status)


def json_response(body: BaseModel | list[Any] | dict[str, Any], status: int = 200) -> Response:
    if isinstance(body, BaseModel):
        raw = body.model_dump_json(by_alias=True, exclude_none=True)
    elif isinstance(body, list):
        raw = "[" + ",".join(x.model_dump_json(by_alias=True, exclude_none=True) if isinstance(x, BaseModel)
                             else _dumps(x) for x in body) + "]"
    else:
        raw = _dumps(body)
    return Response(raw, status_code=status, media_type="application/json")


def _dumps(x: Any) -> str:
    return json.dumps(x)


def parse(model: type[Any], raw: bytes) -> Any:
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "body"
        raise InvalidRequest(f"{where}: {err['msg']}", field=where) from None


