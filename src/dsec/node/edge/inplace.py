"""Where a sandbox's in-place snapshots live on the edge's volume
(``inplace/<sandbox id>/<name>``, a subvolume and a ``.json`` beside each, and the file
naming their qgroup), and dropping them all: at the sandbox's end (dsec.node.edge.teardown)
and at an edge's start for sandboxes that ended while it was down (dsec.node.edge.recovery).
Taking them and rolling back is dsec.node.edge.rollback's."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time

from dsec.node.host.linux import unmount_all
from dsec.node.host.volume import SandboxVolume

log = logging.getLogger("dsec.edge")
GROUP_FILE = ".group.json"  # beside the snapshots: the level-1 qgroup holding the sandbox and them


def inplace_dir(volume: SandboxVolume, sandbox_id: str) -> str:
    return os.path.join(volume.mnt, "inplace", sandbox_id)


def drop_all(volume: SandboxVolume, sandbox_id: str) -> int:
    """At the end of a sandbox: every snapshot of it goes (their subvolumes and the
    directory); how many there were."""
    d = inplace_dir(volume, sandbox_id)
    n, group = 0, group_of(d)
    for attempt in range(3):  # a spare copy being made as the sandbox ended lands meanwhile
        for entry in os.listdir(d):
            path = os.path.join(d, entry)
            try:  # by what it is, not by its name; one that will not go does not keep the rest
                if volume.is_subvolume(path):
                    volume.remove(path)
                    n += not entry.startswith(".")
                elif os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
            except OSError as e:
                log.warning("snapshots of %s: %s not removed: %s", sandbox_id, entry, e)
        try:
            os.rmdir(d)
            break
        except OSError:
            if attempt == 2:
                raise
            time.sleep(0.05)
    # a rollback's copy or old root not removed yet (their removal runs in the background)
    sandboxes = os.path.join(volume.mnt, "sandboxes")
    for entry in os.listdir(sandboxes):
        if entry.startswith(f".{sandbox_id}."):
            with contextlib.suppress(OSError):
                unmount_all(os.path.join(sandboxes, entry))
                volume.remove(os.path.join(sandboxes, entry))
    if group is not None:  # (its members are gone or going: btrfs drops a deleted subvolume's qgroup)
        with contextlib.suppress(OSError):
            volume.group_remove(group)
    return n


def group_of(d: str) -> int | None:
    """The sandbox's level-1 qgroup, from the file beside its snapshots (None: none)."""
    try:
        with open(os.path.join(d, GROUP_FILE)) as f:
            group = int(json.load(f)["group"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return group if group > 0 else None


def sweep(volume: SandboxVolume, live: set[str]) -> int:
    """At an edge's start, once its sandboxes are back: snapshots of any other (it ended
    while no edge was there to drop them) go."""
    root = os.path.join(volume.mnt, "inplace")
    gone = 0
    with contextlib.suppress(FileNotFoundError):
        for sid in os.listdir(root):
            if sid not in live:
                with contextlib.suppress(OSError):
                    gone += drop_all(volume, sid)
    return gone
