"""The apiserver's FastAPI application: error mapping, authentication, E2B's faces, and
the routes of every resource (control/apiserver/routes/)."""

from __future__ import annotations

import os

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException

from dsec.control.apiserver.core import Apiserver, error_response
from dsec.control.apiserver.limits import RequestLimits, body_limits
from dsec.control.apiserver.routes import MODULES
from dsec.control.console import web as console_web
from dsec.control.iam import current_principal
from dsec.control.iam.bound import ENVD, TEMPLATE_FILES, TRAFFIC
from dsec.faces import daytona, sandboxfusion, swerex
from dsec.faces.e2b import api as e2b_api
from dsec.faces.e2b import envd, templates_api
from dsec.faces.e2b.ports import PortProxy
from dsec.faces.front.auth import BearerAuth
from dsec.faces.templates.builder import Builder
from dsec.faces.templates.catalog import TemplateCatalog
from dsec.faces.templates.context import MAX_CONTEXT_BYTES, Contexts
from dsec.faces.templates.images import Images
from dsec.shared.errors import (
    DsecError,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
)
from dsec.shared.meta.db import unavailable
from dsec.shared.wire.models import (
    BACKEND_TAGS,
)


def build_app(api: Apiserver) -> FastAPI:
    # FastAPI's own OpenTelemetry spans (a server span per request, in the caller's trace) are
    # the apiserver's part of a trace (dsec.shared.tracing); they record only when tracing is on
    app = FastAPI(title="dsec", version="0.1.0",
                  description="Elastic sandboxes for agentic RL: create, exec, files, HTTP, TTY.",
                  telemetry={"metrics": False, "logs": False, "operation_spans": False})

    @app.exception_handler(DsecError)
    async def _dsec_error(_: Request, e: DsecError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(SQLAlchemyError)
    async def _database(_: Request, e: SQLAlchemyError) -> JSONResponse:
        away = unavailable(e)
        if away is None:
            raise e
        return error_response(away)

    @app.exception_handler(HTTPException)
    async def _unrouted(request: Request, e: HTTPException) -> Response:
        # a path or method no face serves answers the shape every face's client reads (E2B's
        # SDK read {"detail": ...} for "code" and raised KeyError instead of its own error)
        if (e.status_code, e.detail) == (404, "Not Found"):
            return error_response(NotFound(f"no route {request.method} {request.url.path}", field="path"))
        if (e.status_code, e.detail) == (405, "Method Not Allowed"):
            resp = error_response(MethodNotAllowed(f"{request.method} is not served on {request.url.path}",
                                                   field="method"))
            resp.headers.update(e.headers or {})
            return resp
        return await http_exception_handler(request, e)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "args", *BACKEND_TAGS)]
        field = ".".join(loc) or ("backend" if first.get("type") == "invalid_backend" else None)
        msg = first.get("msg", "invalid request")
        return error_response(InvalidRequest(f"{field}: {msg}" if field else msg, field=field))

    app.add_middleware(BearerAuth, api=api)
    # outermost: a request for a sandbox's own port carries that sandbox's token, not a bearer
    app.add_middleware(PortProxy, edge_for=api.edge_for, keys=api.tokens.bound)
    swerex.mount(app, api)  # outermost too: SWE-ReX's X-API-Key may be one sandbox's own token
    sandboxfusion.mount(app, api)  # outermost too: its token rides in the URL, cut out before logging
    catalog = TemplateCatalog(api.tokens.db)
    images = Images.from_env(api.layers)
    contexts = Contexts(api.layers.root)
    builder = Builder(api, catalog, images, contexts, templates_api.runner_name())
    app.state.template_builder = builder  # the lifespan stops its builds
    source = templates_api.TemplateSource(catalog, images, os.environ.get("DSEC_E2B_IMAGE_METADATA_KEY", "image"))
    bound = api.tokens.bound
    e2b = e2b_api.E2BApi(api, lambda info: bound.mint_for(ENVD, info), lambda info: bound.mint_for(TRAFFIC, info),
                         source)
    # dsec's own routes first: a request is matched against the routes in order, a regex
    # each, and the hot ones (exec, FnCall, a sandbox's get) were ~120 routes deep
    for module in MODULES:
        app.include_router(module.routes(api))
    templates = templates_api.TemplatesApi(
        catalog, builder, contexts, lambda key: bound.mint(TEMPLATE_FILES, key, current_principal.get().token_id),
        e2b.delete_snapshot)
    templates_api.mount(app, templates)
    e2b_api.mount(app, e2b)
    envd.mount(app, envd.Envd(api.edge_for))
    daytona.mount(app, api, source, templates)  # outermost too: every answer under /daytona in Daytona's error envelope
    # outermost of all: a body is bounded, and a credential or a sandbox named once, before any
    # face or authentication reads the request
    app.add_middleware(RequestLimits, limits=body_limits(api.max_file_bytes, MAX_CONTEXT_BYTES))
    app.include_router(console_web.routes(api.tokens, api.sessions))
    return app
