"""The apiserver's routes, a module per resource; each offers ``routes(api) -> APIRouter``."""

from dsec.apiserver.routes import batches, display, exec, files, fncall, jobs, layers, node, ports, sandboxes, tokens

MODULES = (tokens, node, sandboxes, jobs, batches, exec, display, layers, fncall, files, ports)
