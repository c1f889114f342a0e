"""The layer store: immutable, content-addressed EROFS images and the catalog that
names them.

A layer reference is ``kind/name:version`` (``base/debian:12``, ``ws/attrs-bug-17:v1``,
``tk/harness:v3``); its digest is the sha256 of the EROFS image. Blobs live under
``blobs/sha256/``, the catalog in a small SQLite file beside them. A published name
never changes what it points to. A layer made by pack_diff records the stack it was
taken on top of (``parent_image`` + ``parent_layers``), which is what fork restores.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

from pydantic import BaseModel, Field

from dsec.errors import InvalidRequest, LayerInUse, NotFound
from dsec.models import normalize_layer_ref

KINDS = {"base": "base", "ws": "workspace", "tk": "toolkit"}
EROFS_MAGIC = 0xE0F5E1E2


class Layer(BaseModel):
    ref: str
    kind: str
    digest: str
    size: int
    created_at: float
    parent_image: str | None = None
    parent_layers: list[str] = []
    source: str = ""
    blobs: list[str] = Field(default_factory=list, description="EROFS images bottom to top, when more than one")

    @property
    def all_blobs(self) -> list[str]:
        return self.blobs or [self.digest]

    def stack(self) -> tuple[str, list[str]]:
        """(image, layers) of a sandbox that sees exactly this layer's tree."""
        if self.kind == "base":
            return self.ref, []
        if self.parent_image is None:
            raise InvalidRequest(f"layer {self.ref!r} was not taken from a sandbox; give an image to stack it on",
                                 field="snapshot")
        return self.parent_image, [*self.parent_layers, self.ref]


@dataclass
class ImportOptions:
    compress: str | None = "lz4"
    exclude_regex: list[str] = field(default_factory=list)
    # Names the input (an OCI layer group by its layer digests): a second build of the
    # same input reuses the first blob, so images sharing layers share EROFS images.
    # (mkfs.erofs output is not byte-reproducible without clobbering file mtimes.)
    content_key: str | None = None


def layer_kind(ref: str) -> str:
    prefix = ref.split("/", 1)[0]
    if prefix not in KINDS:
        raise InvalidRequest(f"layer {ref!r}: kind prefix must be one of {sorted(KINDS)} "
                             "(base/..., ws/... for workspaces, tk/... for toolkits)", field="ref")
    return KINDS[prefix]


def check_erofs(path: str) -> None:
    """Refuse a file that is not an EROFS image before the kernel ever sees it."""
    try:
        with open(path, "rb") as f:
            f.seek(1024)
            magic = f.read(4)
    except OSError as e:
        raise InvalidRequest(f"cannot read layer image {path}: {e.strerror}") from None
    if len(magic) < 4 or int.from_bytes(magic, "little") != EROFS_MAGIC:
        raise InvalidRequest(f"{path} is not an EROFS image (bad superblock magic)")


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
        self._db.execute("CREATE TABLE IF NOT EXISTS built (key TEXT PRIMARY KEY, digest TEXT NOT NULL)")
        cols = {r[1] for r in self._db.execute("PRAGMA table_info(layers)")}
        for col in ("meta",):  # catalogs written before lineage was recorded
            if col not in cols:
                self._db.execute(f"ALTER TABLE layers ADD COLUMN {col} TEXT NOT NULL DEFAULT '{{}}'")

    def blob_path(self, digest: str) -> str:
        return os.path.join(self.blob_dir, f"{digest}.erofs")

    @staticmethod
    def _row(row: tuple[str, str, str, int, float, str]) -> Layer:
        meta = json.loads(row[5] or "{}")
        return Layer(ref=row[0], kind=row[1], digest=row[2], size=row[3], created_at=row[4], **meta)

    _COLS = "ref, kind, digest, size, created_at, meta"

    def get(self, ref: str) -> Layer:
        ref = normalize_layer_ref(ref)
        row = self._db.execute(f"SELECT {self._COLS} FROM layers WHERE ref=?", (ref,)).fetchone()
        if row is None:
            raise NotFound(f"unknown layer {ref!r}", field="ref")
        return self._row(row)

    def has(self, ref: str) -> bool:
        return self._db.execute("SELECT 1 FROM layers WHERE ref=?", (normalize_layer_ref(ref),)).fetchone() is not None

    def list(self) -> list[Layer]:
        return [self._row(r) for r in self._db.execute(f"SELECT {self._COLS} FROM layers ORDER BY ref")]

    def link_from(self, other_root: str) -> int:
        """Publish every layer of the store at ``other_root`` here, hard-linking blobs
        (copying across filesystems). Returns how many layers were added."""
        other = LayerStore(other_root)
        added = 0
        for layer in other.list():
            if self.has(layer.ref):
                continue
            for blob in layer.all_blobs:
                dest = self.blob_path(blob)
                if not os.path.exists(dest):
                    try:
                        os.link(other.blob_path(blob), dest)
                    except OSError:
                        shutil.copy2(other.blob_path(blob), dest)
            self._publish(layer)
            added += 1
        return added

    def import_dir(self, src: str, ref: str, kind: str | None = None, opts: ImportOptions | None = None,
                   parent_image: str | None = None, parent_layers: builtins.list[str] | None = None,
                   source: str = "") -> Layer:
        """Build an EROFS image of the tree at ``src`` and publish it as ``ref``.

        Overlay whiteouts (0/0 character devices) and opaque-directory xattrs in ``src``
        are kept as they are, so the layer deletes what they delete when stacked."""
        try:
            ref = normalize_layer_ref(ref)
        except ValueError as e:
            raise InvalidRequest(str(e), field="ref") from None
        ref_kind = layer_kind(ref)
        if kind is not None and kind != ref_kind:
            raise InvalidRequest(f"layer {ref!r} is a {ref_kind} by its name, not a {kind}", field="kind")
        if self.has(ref):
            raise InvalidRequest(f"layer {ref!r} already exists; layers are immutable, publish a new version",
                                 field="ref")
        if not os.path.isdir(src):
            raise InvalidRequest(f"{src} is not a directory", field="dir")
        digest = self.build_blob(src, opts or ImportOptions())
        return self._publish(Layer(ref=ref, kind=ref_kind, digest=digest, size=os.path.getsize(self.blob_path(digest)),
                                   created_at=time.time(), parent_image=parent_image,
                                   parent_layers=parent_layers or [], source=source))

    def build_blob(self, src: str, opts: ImportOptions) -> str:
        """mkfs.erofs ``src`` into the blob store (not yet published); returns its digest."""
        if opts.content_key and (done := self.built_blob(opts.content_key)):
            return done
        fd, tmp = tempfile.mkstemp(dir=self.blob_dir, suffix=".tmp")
        os.close(fd)
        try:
            cmd = ["mkfs.erofs", "--quiet", "--preserve-mtime"]
            if opts.compress:
                cmd.append(f"-z{opts.compress}")
            cmd += [f"--exclude-regex={rx}" for rx in opts.exclude_regex]
            proc = subprocess.run([*cmd, tmp, src], capture_output=True)
            if proc.returncode != 0:
                raise InvalidRequest(f"mkfs.erofs failed for {src}: {proc.stderr.decode(errors='replace')[-500:]}")
            digest = _sha256(tmp)
            os.chmod(tmp, 0o444)
            os.replace(tmp, self.blob_path(digest))
            if opts.content_key:
                self._db.execute("INSERT OR REPLACE INTO built VALUES (?,?)", (opts.content_key, digest))
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return digest

    def built_blob(self, content_key: str) -> str | None:
        """The blob an earlier build of the same input produced, if it is still stored."""
        row = self._db.execute("SELECT digest FROM built WHERE key=?", (content_key,)).fetchone()
        return str(row[0]) if row and os.path.exists(self.blob_path(row[0])) else None

    def publish_blobs(self, ref: str, digests: builtins.list[str], source: str = "") -> Layer:
        """Publish already-built blobs (bottom to top) as one layer ``ref``."""
        ref = normalize_layer_ref(ref)
        kind = layer_kind(ref)
        identity = digests[0] if len(digests) == 1 else hashlib.sha256(",".join(digests).encode()).hexdigest()
        size = sum(os.path.getsize(self.blob_path(d)) for d in digests)
        return self._publish(Layer(ref=ref, kind=kind, digest=identity, size=size, created_at=time.time(),
                                   source=source, blobs=digests if len(digests) > 1 else []))

    def import_image(self, path: str, ref: str, source: str = "") -> Layer:
        """Publish an existing EROFS image file (checked, then copied in)."""
        ref = normalize_layer_ref(ref)
        kind = layer_kind(ref)
        if self.has(ref):
            raise InvalidRequest(f"layer {ref!r} already exists", field="ref")
        check_erofs(path)
        digest = _sha256(path)
        dest = self.blob_path(digest)
        if not os.path.exists(dest):
            fd, tmp = tempfile.mkstemp(dir=self.blob_dir, suffix=".tmp")
            os.close(fd)
            shutil.copyfile(path, tmp)
            os.chmod(tmp, 0o444)
            os.replace(tmp, dest)
        return self._publish(Layer(ref=ref, kind=kind, digest=digest, size=os.path.getsize(dest),
                                   created_at=time.time(), source=source))

    def _publish(self, layer: Layer) -> Layer:
        meta = {"parent_image": layer.parent_image, "parent_layers": layer.parent_layers, "source": layer.source,
                "blobs": layer.blobs}
        try:
            self._db.execute("INSERT INTO layers (ref, kind, digest, size, created_at, meta) VALUES (?,?,?,?,?,?)",
                             (layer.ref, layer.kind, layer.digest, layer.size, layer.created_at, json.dumps(meta)))
        except sqlite3.IntegrityError:
            existing = self.get(layer.ref)
            if existing.digest != layer.digest:
                raise InvalidRequest(f"layer {layer.ref!r} is already published with another content; "
                                     "layers are immutable, publish a new version", field="ref") from None
            return existing
        return layer

    def remove(self, ref: str, in_use: set[str]) -> Layer:
        """Unpublish ``ref``; refused while a sandbox uses its blob or a layer's lineage names it."""
        layer = self.get(ref)
        if set(layer.all_blobs) & in_use:
            raise LayerInUse(f"layer {layer.ref!r} is in use by a running sandbox", field="ref")
        for other in self.list():
            if layer.ref == other.parent_image or layer.ref in other.parent_layers:
                raise LayerInUse(f"layer {layer.ref!r} is the parent of {other.ref!r}; remove that first",
                                 field="ref")
        self._db.execute("DELETE FROM layers WHERE ref=?", (layer.ref,))
        return layer

    def gc(self, in_use: set[str]) -> builtins.list[str]:
        """Delete blobs no published layer and no running sandbox references."""
        live = {b for layer in self.list() for b in layer.all_blobs} | in_use
        removed = []
        for name in os.listdir(self.blob_dir):
            digest = name.split(".", 1)[0]
            if name.endswith(".erofs") and digest not in live:
                os.unlink(os.path.join(self.blob_dir, name))
                removed.append(digest)
        return removed


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
