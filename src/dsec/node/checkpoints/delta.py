"""What changed in a sandbox's writable layer since its last checkpoint.

A checkpoint works on a writable copy of the sandbox's directory (a btrfs snapshot, taken
while the sandbox is frozen for a few milliseconds): :func:`scan` records every path of the
overlay upper dir with what identifies its content (inode, ctime, mtime, size, mode,
opacity), and :func:`prune` turns the copy into the delta against the previous manifest:

- a path whose entry is unchanged is removed from the copy; a directory stays when it
  changed itself or holds something that stays (its metadata then is the current one);
- a path the previous manifest had and the copy has not gets a whiteout (a 0/0 character
  device, as overlayfs writes them), so stacking the delta over the earlier checkpoints
  deletes it again;
- an opaque directory (``trusted.overlay.opaque``) that was not opaque, or not there, at
  the last checkpoint keeps its whole subtree; one that already was opaque loses the flag
  in the delta, or it would hide what the earlier checkpoints hold of it.

ctime moves on every change of content, mode, owner, xattrs or name, and the snapshot
keeps inode numbers, so an unchanged (inode, ctime) pair is an unchanged file.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass

OPAQUE = "trusted.overlay.opaque"

# relative path -> (inode, ctime_ns, mtime_ns, size, mode, opaque)
Entry = tuple[int, int, int, int, int, bool]
Manifest = dict[str, Entry]


@dataclass
class Delta:
    files: int  # entries the delta holds: changed paths, their directories and whiteouts
    whiteouts: int


def _opaque(path: str) -> bool:
    try:
        return os.getxattr(path, OPAQUE, follow_symlinks=False) == b"y"
    except OSError:
        return False


def scan(root: str) -> Manifest:
    """Every path below ``root`` (the upper dir), relative, with its identity. Iterative: a
    sandbox may nest directories deeper than Python recurses."""
    out: Manifest = {}
    todo = [""]
    while todo:
        rel_dir = todo.pop()
        with os.scandir(os.path.join(root, rel_dir)) as it:
            for entry in it:
                rel = os.path.join(rel_dir, entry.name) if rel_dir else entry.name
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                    # a whiteout: overlayfs makes them all links of one inode, whose ctime moves
                    # with every new deletion; a whiteout is a whiteout whatever its inode says
                    out[rel] = (0, 0, 0, 0, st.st_mode, False)
                    continue
                is_dir = stat.S_ISDIR(st.st_mode)
                out[rel] = (st.st_ino, st.st_ctime_ns, st.st_mtime_ns, st.st_size, st.st_mode,
                            is_dir and _opaque(entry.path))
                if is_dir:
                    todo.append(rel)
    return out


def _parent(rel: str) -> str:
    return os.path.dirname(rel)


def prune(root: str, now: Manifest, before: Manifest) -> Delta:
    """Make ``root`` (a writable copy whose manifest is ``now``) hold only the changes since
    ``before``; returns what is left."""
    keep: set[str] = set()
    whole: list[str] = []  # opaque directories new since before: kept with everything below
    for rel, e in now.items():
        old = before.get(rel)
        if old != e:
            keep.add(rel)
        if e[5]:
            if old is None or old[0] != e[0] or not old[5]:
                whole.append(rel)
            else:  # opaque then and now: merge with what earlier checkpoints hold of it
                os.removexattr(os.path.join(root, rel), OPAQUE, follow_symlinks=False)
    for top in whole:
        prefix = top + "/"
        keep.update(r for r in now if r == top or r.startswith(prefix))
    # a removed path needs a whiteout, except below a newly opaque directory (which hides
    # all of what earlier layers hold of it: a whiteout there would show as a dead entry)
    hidden = tuple(top + "/" for top in whole)
    gone = [rel for rel in before if rel not in now and _is_dir_or_root(now, _parent(rel))
            and not rel.startswith(hidden)]
    # the directories holding what stays stay
    for rel in list(keep) + gone:
        p = _parent(rel)
        while p and p not in keep:
            keep.add(p)
            p = _parent(p)
    # deepest first, so a directory is empty when its turn comes
    for rel in sorted(now, key=lambda r: r.count("/"), reverse=True):
        if rel in keep:
            continue
        full = os.path.join(root, rel)
        if stat.S_ISDIR(now[rel][4]):
            try:
                os.rmdir(full)
            except OSError:  # something below it stays after all (a whiteout in it)
                pass
        else:
            os.unlink(full)
    for rel in gone:
        os.mknod(os.path.join(root, rel), stat.S_IFCHR | 0o000, os.makedev(0, 0))
    return Delta(files=len(keep) + len(gone), whiteouts=len(gone))


def _is_dir_or_root(now: Manifest, rel: str) -> bool:
    """A removed path needs a whiteout only where its parent is still a directory (a
    parent that went is covered by its own whiteout, or by the non-directory now there)."""
    return rel == "" or (rel in now and stat.S_ISDIR(now[rel][4]))


def save(manifest: Manifest, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, separators=(",", ":"))
    os.replace(tmp, path)


def load(path: str) -> Manifest | None:
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return None
    return {k: (int(v[0]), int(v[1]), int(v[2]), int(v[3]), int(v[4]), bool(v[5])) for k, v in raw.items()}
