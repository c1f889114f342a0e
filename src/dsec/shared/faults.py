"""Failpoints: named places in the edge's long operations (create, stop, pause, resume,
pack_diff) and in its reads from the shared layer store, where the fault-injection tests
make the edge die, stall or fail, to prove that a crash at any step leaves no half-built
state once the edge is back, and that the fleet's detector sees a sick edge.

Off unless ``DSEC_FAILPOINTS`` is set in the edge's environment, which production never
does; then a failpoint costs one dict lookup. The value is a comma-separated list of
``name=action``:

- ``kill``: SIGKILL this process where it stands (a crash: no cleanup runs);
- ``sleep:SECONDS``: stall there (a slow disk, a stuck helper);
- ``error``: raise ``OSError(EIO)`` there (a failing device).

The names are listed in :data:`POINTS`; an unknown name or action is refused when the
edge starts, so a test cannot silently inject nothing.

``DSEC_FAILPOINTS=@FILE`` reads that list from FILE instead, again whenever FILE changes
(no file: none): a fault turned on and off while the edge runs, as a disk or a store goes
bad and comes back (the fleet health tests), with no restart in between.
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import time

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
    "checkpoint.frozen",  # frozen for a checkpoint's snapshot, none taken
    "checkpoint.built",  # its blob in the store, not recorded; the snapshot not yet dropped
    "store.read",        # a read from the shared layer store: catalog, metadata, chunk index, chunks
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


_spec = os.environ.get(ENV, "")
_file = _spec[1:] if _spec.startswith("@") else None
_points = parse(_spec) if _file is None else {}
_version: int | None = None  # FILE's mtime when last read


def _current() -> dict[str, str]:
    global _points, _version
    if _file is None:
        return _points
    try:
        version: int | None = os.stat(_file).st_mtime_ns
    except FileNotFoundError:
        version = None
    if version != _version:
        _version = version
        try:
            with open(_file) as f:
                _points = parse(f.read().strip())
        except FileNotFoundError:
            _points = {}
    return _points


async def failpoint(name: str) -> None:
    """Act as ``DSEC_FAILPOINTS`` says at ``name`` (nothing, unless it names it)."""
    if (pause := _act(name)) is not None:
        await asyncio.sleep(pause)


def failpoint_sync(name: str) -> None:
    """:func:`failpoint` for code on a thread (the lazy reader's store reads)."""
    if (pause := _act(name)) is not None:
        time.sleep(pause)


def _act(name: str) -> float | None:
    """Kill or raise as configured at ``name``; the seconds to stall there, if any."""
    action = _current().get(name)
    if action is None:
        return None
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        return 3600.0  # SIGKILL is not instant; nothing after this point may run
    if action == "error":
        raise OSError(errno.EIO, f"injected fault at {name}")
    return float(action[6:])
