"""The checkpoint delta (dsec.node.checkpoints.delta) against the kernel's own overlayfs: a
writable layer on a real btrfs subvolume (what an edge's sandboxes have) is changed through
an overlay mount in the ways a workload does, checkpointed by btrfs snapshots and pruned
to deltas, and the deltas stacked over the base as overlay lower layers must show exactly
the tree the sandbox saw. Nothing is mocked: loop device, btrfs, overlayfs, whiteouts and
opaque directories are the kernel's."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.node.checkpoints import delta
from dsec.node.host import linux
from dsec.node.host.volume import SandboxVolume


@pytest.fixture
def vol(tmp_path: Path) -> Iterator[SandboxVolume]:
    v = SandboxVolume(str(tmp_path), 2)
    v.setup()
    assert v.available, v.status
    yield v
    for name in os.listdir(v.mnt):
        v.remove(os.path.join(v.mnt, name))
    v.close()


def _tree(root: str) -> dict[str, tuple[str, int, str]]:
    """path -> (type, mode, content or link target) of everything below ``root``."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            rel = os.path.relpath(full, root)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", 0, os.readlink(full))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st.st_mode), "")
            else:
                out[rel] = ("file", stat.S_IMODE(st.st_mode), Path(full).read_text())
    return out


class Layered:
    """A sandbox's writable layer over ``base``, and its checkpoints."""

    def __init__(self, vol: SandboxVolume, base: str) -> None:
        self.vol, self.base = vol, base
        self.dir = os.path.join(vol.mnt, "sb")
        vol.create(self.dir, 512)
        for sub in ("upper", "work", "merged"):
            os.makedirs(os.path.join(self.dir, sub))
        self.merged = os.path.join(self.dir, "merged")
        linux.mount("overlay", self.merged, "overlay", 0,
                    f"lowerdir={base},upperdir={self.dir}/upper,workdir={self.dir}/work")
        self.manifest: delta.Manifest = {}
        self.deltas: list[str] = []
        self.taken = 0

    def sh(self, script: str) -> None:
        subprocess.run(["sh", "-ec", script], cwd=self.merged, check=True)

    def checkpoint(self, full: bool = False) -> delta.Delta:
        self.taken += 1
        work = os.path.join(self.vol.mnt, f"ck{self.taken}")
        subprocess.run(["sync", "-f", self.merged], check=True)
        self.vol.snapshot(self.dir, work)
        upper = os.path.join(work, "upper")
        now = delta.scan(upper)
        d = delta.prune(upper, now, {} if full else self.manifest)
        self.manifest = now
        self.deltas.append(upper)
        return d

    def restored(self, mnt: str) -> dict[str, tuple[str, int, str]]:
        """The tree the checkpoints give back, stacked over the base (top first)."""
        os.makedirs(mnt)
        linux.mount("overlay", mnt, "overlay", 0, f"lowerdir={':'.join(reversed(self.deltas))}:{self.base}")
        try:
            return _tree(mnt)
        finally:
            linux.umount(mnt)

    def close(self) -> None:
        linux.umount(self.merged)


def test_deltas_stacked_give_back_the_tree_the_sandbox_saw(vol: SandboxVolume, tmp_path: Path) -> None:
    base = tmp_path / "base"
    for p, text in {"etc/a": "a", "etc/b": "b", "data/x/y": "y", "data/x/z": "z", "keep": "keep",
                    "opt/old/f": "old"}.items():
        (base / p).parent.mkdir(parents=True, exist_ok=True)
        (base / p).write_text(text)
    sb = Layered(vol, str(base))
    try:
        sb.sh("echo new1 > new1; echo a2 > etc/a; rm etc/b; mkdir -p d1/sub; echo f > d1/sub/f; "
              "echo g > d1/g; ln -s etc/a link1; echo h > hard1; ln hard1 hard2; echo q > data/x/q")
        first = sb.checkpoint()
        assert first.files > 0 and first.whiteouts == 0
        assert _tree(sb.merged) == sb.restored(str(tmp_path / "r1"))

        # the cases a delta must get right
        sb.sh("echo new1b > new1; "                  # a file changed in place
              "rm -rf d1; mkdir d1; echo g2 > d1/g; "  # a dir of the layer removed and made again
              "rm -rf data/x; mkdir data/x; echo w > data/x/w; "  # an image dir replaced (opaque)
              "rm keep; mkdir keep; echo in > keep/in; "  # a file replaced by a directory
              "rm -rf opt/old; echo now-a-file > opt/old; "  # a directory replaced by a file
              "chmod 600 etc/a; mv hard2 moved; "  # mode and a rename (of a hard link)
              "rm link1; ln -s new1 link1; rm new1 && echo recreated > new1")
        second = sb.checkpoint()
        assert second.whiteouts >= 1  # d1/sub went
        want = _tree(sb.merged)
        assert sb.restored(str(tmp_path / "r2")) == want
        assert "d1/sub" not in want and "data/x/y" not in want and want["keep"][0] == "dir"

        # nothing changed: an empty delta (and the tree unchanged)
        assert sb.checkpoint().files == 0
        # one more deletion of an image file: one whiteout, not every whiteout again (overlayfs
        # links them all to one inode, whose ctime every new one moves)
        sb.sh("rm data/x/w; rm etc/a")
        d = sb.checkpoint()
        assert (d.whiteouts, d.files) == (1, 5), d  # data/x/w's; etc/a's, and their directories
        assert not os.path.lexists(os.path.join(sb.deltas[-1], "etc/b"))  # the old whiteout stays out
        # an opaque dir that was opaque before merges with what the earlier checkpoints hold
        sb.sh("echo w2 > data/x/w2; touch etc/new; rm -rf keep")
        sb.checkpoint()
        assert sb.restored(str(tmp_path / "r3")) == _tree(sb.merged)
        # a full checkpoint alone gives it back too
        sb.deltas = []
        sb.checkpoint(full=True)
        assert sb.restored(str(tmp_path / "r4")) == _tree(sb.merged)
        # deeper than Python recurses
        sb.sh("i=0; while [ $i -lt 1200 ]; do mkdir n; cd n; i=$((i+1)); done; echo deep > f")
        assert sb.checkpoint().files == 1201
    finally:
        sb.close()


def test_manifest_round_trip_and_a_missing_one(tmp_path: Path) -> None:
    (tmp_path / "u" / "d").mkdir(parents=True)
    (tmp_path / "u" / "d" / "f").write_text("x")
    m = delta.scan(str(tmp_path / "u"))
    delta.save(m, str(tmp_path / "m.json"))
    assert delta.load(str(tmp_path / "m.json")) == m
    assert delta.load(str(tmp_path / "nope.json")) is None
    (tmp_path / "bad.json").write_text("{not json")
    assert delta.load(str(tmp_path / "bad.json")) is None
    shutil.rmtree(tmp_path / "u")
