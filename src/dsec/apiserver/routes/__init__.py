"""The apiserver's routes, a module per resource; each offers ``routes(api) -> APIRouter``."""

from dsec.apiserver.routes import (
    batches,
    checkpoints,
    console,
    display,
    exec,
    files,
    fncall,
    jobs,
    layers,
    node,
    nodes,
    ports,
    projects,
    rollouts,
    sandboxes,
    tokens,
)

MODULES = (tokens, projects, node, nodes, checkpoints, sandboxes, jobs, batches, rollouts, exec, display, layers,
           fncall, files, ports, console)
