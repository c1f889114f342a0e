"""Failpoints: named places in the edge's long operations (create, stop, pause, resume,
pack_diff) where the fault-injection tests make the edge die or stall, to prove that a
crash at any step leaves no half-built state once the edge is back.

Off unless ``DSEC_FAILPOINTS`` is set in the edge's environment, which production never
does; then a failpoint costs one dict lookup. The value is a comma-separated list of
``name=action``:

- ``kill``: SIGKILL this process where it stands (a crash: no cleanup runs);
- ``sleep:SECONDS``: stall there (a slow disk, a stuck helper);
- ``error``: raise ``OSError(EIO)`` there (a failing device).

The names are listed in :data:`POINTS`; an unknown name or action is refused when the
edge starts, so a test cannot silently inject nothing.
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal

ENV = "DSEC_FAILPOINTS"

POINTS = frozenset({
    "create.recorded",   # on record as creating, nothing built
    "create.mounted",    # layers and overlay mounted, no container
    "create.started",    # crun started init, workload cgroup not split yet
    "create.attached",   # init answers, the record still says creating
    "stop.recorded",     # on record as stopping, nothing killed
    "stop.killed",       # every process killed, nothing released
    "stop.deleted",      # crun's container deleted, mounts and files still there
    "pause.frozen",      # frozen, memory not pushed out, record says running
    "pause.paged",       # memory pushed out, record says running
    "resume.thawed",     # thawed, record says paused
    "pack_diff.frozen",  # frozen, image not built
    "pack_diff.built",   # layer published, sandbox still frozen
})


class FailpointError(ValueError):
    """A malformed ``DSEC_FAILPOINTS``."""


def parse(spec: str) -> dict[str, str]:
    points: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, action = item.partition("=")
        if name not in POINTS:
            raise FailpointError(f"{ENV}: unknown failpoint {name!r} (known: {', '.join(sorted(POINTS))})")
        if action.startswith("sleep:"):
            try:
                float(action[6:])
            except ValueError:
                raise FailpointError(f"{ENV}: {item!r}: sleep takes seconds") from None
        elif action not in ("kill", "error"):
            raise FailpointError(f"{ENV}: {item!r}: the action is kill, sleep:SECONDS or error")
        points[name] = action
    return points


_points = parse(os.environ.get(ENV, ""))


async def failpoint(name: str) -> None:
    """Act as ``DSEC_FAILPOINTS`` says at ``name`` (nothing, unless it names it)."""
    action = _points.get(name)
    if action is None:
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        await asyncio.sleep(3600)  # SIGKILL is not instant; nothing after this point may run
    elif action == "error":
        raise OSError(errno.EIO, f"injected fault at {name}")
    else:
        await asyncio.sleep(float(action[6:]))
