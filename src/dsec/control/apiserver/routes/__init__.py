"""The apiserver's routes, a module per resource; each offers ``routes(api) -> APIRouter``."""

from dsec.control.apiserver.routes import (
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
    snapshots,
    tokens,
)

# in the order a request's path is matched: the hot path's routes first
MODULES = (exec, rollouts, fncall, sandboxes, files, ports, batches, jobs, checkpoints, snapshots, display, layers,
           tokens, projects, node, nodes, console)
