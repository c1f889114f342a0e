"""The layer store: immutable, content-addressed EROFS images and the catalog that
names them.

A layer reference is ``kind/name:version`` (``base/debian:12``, ``ws/attrs-bug-17:v1``,
``tk/harness:v3``); its digest is the sha256 of the EROFS image. Blobs live under
``blobs/sha256/``, the catalog in a small SQLite file beside them. A published name
never changes what it points to.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import subprocess
import tempfile
import time
from dataclasses import dataclass

from dsec.errors import InvalidRequest, NotFound
from dsec.models import LAYER_REF_RE

KINDS = {"base": "base", "ws": "workspace", "tk": "toolkit"}


@dataclass(frozen=True)
class Layer:
    ref: str
    kind: str
    digest: str
    size: int
    created_at: float


def layer_kind(ref: str) -> str:
    prefix = ref.split("/", 1)[0]
    if prefix not in KINDS:
        raise InvalidRequest(f"layer {ref!r}: kind prefix must be one of {sorted(KINDS)}", field="image")
    return KINDS[prefix]


class LayerStore:
    def __init__(self, root: str) -> None:
        self.root = root
        self.blob_dir = os.path.join(root, "blobs", "sha256")
        os.makedirs(self.blob_dir, exist_ok=True)
        self._db = sqlite3.connect(os.path.join(root, "catalog.db"), check_same_thread=False,
                                   isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS layers (ref TEXT PRIMARY KEY, kind TEXT NOT NULL,"
            " digest TEXT NOT NULL, size INTEGER NOT NULL, created_at REAL NOT NULL)")

    def blob_path(self, digest: str) -> str:
        return os.path.join(self.blob_dir, f"{digest}.erofs")

    def get(self, ref: str) -> Layer:
        row = self._db.execute("SELECT ref, kind, digest, size, created_at FROM layers WHERE ref=?",
                               (ref,)).fetchone()
        if row is None:
            raise NotFound(f"unknown layer {ref!r}")
        return Layer(*row)

    def has(self, ref: str) -> bool:
        return self._db.execute("SELECT 1 FROM layers WHERE ref=?", (ref,)).fetchone() is not None

    def list(self) -> list[Layer]:
        return [Layer(*r) for r in self._db.execute(
            "SELECT ref, kind, digest, size, created_at FROM layers ORDER BY ref")]

    def link_from(self, other_root: str) -> int:
        """Publish every layer of the store at ``other_root`` here, hard-linking blobs
        (copying across filesystems). Returns how many layers were added."""
        import shutil

        other = LayerStore(other_root)
        added = 0
        for layer in other.list():
            if self.has(layer.ref):
                continue
            dest = self.blob_path(layer.digest)
            if not os.path.exists(dest):
                try:
                    os.link(other.blob_path(layer.digest), dest)
                except OSError:
                    shutil.copy2(other.blob_path(layer.digest), dest)
            self._publish(layer.ref, layer.kind, layer.digest, layer.size)
            added += 1
        return added

    def import_dir(self, src: str, ref: str, compress: str | None = "lz4") -> Layer:
        """Build an EROFS image of ``src`` and publish it as ``ref``."""
        if not LAYER_REF_RE.match(ref):
            raise InvalidRequest(f"layer name {ref!r} must look like kind/name:version", field="ref")
        kind = layer_kind(ref)
        fd, tmp = tempfile.mkstemp(dir=self.blob_dir, suffix=".tmp")
        os.close(fd)
        try:
            cmd = ["mkfs.erofs", "--quiet", "--preserve-mtime"]
            if compress:
                cmd.append(f"-z{compress}")
            subprocess.run([*cmd, tmp, src], check=True, capture_output=True)
            digest = _sha256(tmp)
            dest = self.blob_path(digest)
            os.chmod(tmp, 0o444)
            os.replace(tmp, dest)
        except subprocess.CalledProcessError as e:
            raise InvalidRequest(f"mkfs.erofs failed for {src}: {e.stderr.decode(errors='replace')}") from e
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return self._publish(ref, kind, digest, os.path.getsize(dest))

    def _publish(self, ref: str, kind: str, digest: str, size: int) -> Layer:
        try:
            existing = self.get(ref)
        except NotFound:
            layer = Layer(ref, kind, digest, size, time.time())
            self._db.execute("INSERT INTO layers VALUES (?,?,?,?,?)",
                             (layer.ref, layer.kind, layer.digest, layer.size, layer.created_at))
            return layer
        if existing.digest != digest:
            raise InvalidRequest(f"layer {ref!r} is already published with another content; "
                                 "layers are immutable, publish a new version", field="ref")
        return existing


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
