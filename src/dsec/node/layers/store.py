"""The layer store: immutable, content-addressed EROFS images and the catalog that
names them.

A layer reference is ``kind/name:version`` (``base/debian:12``, ``ws/attrs-bug-17:v1``,
``tk/harness:v3``); its digest is the sha256 of its EROFS metadata image. Every image
is published as metadata (``<digest>.erofs``: inodes, directories, chunk maps; small)
plus a data blob (``<data>.data``, referenced by the metadata as its blob device) and the
data blob's chunk index (``<data>.chunks``), so that a node can copy the metadata and
read data on demand (docs/ondemand.md). Blobs live in a :mod:`dsec.node.storage.backend`,
the catalog (:mod:`dsec.node.layers.catalog`) in a small SQLite file at the store's root, or
in the cluster's database when the store is a cluster's. A published name never changes
what it points to. A layer made by pack_diff records the stack it was
taken on top of (``parent_image`` + ``parent_layers``), which is what fork restores.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

from sqlalchemy import Engine
from sqlalchemy.engine import RowMapping

from dsec.node.layers.catalog import FILE_NAME, Catalog, JournalMode
from dsec.node.storage.backend import BackendKind, BlobBackend, open_backend
from dsec.node.storage.chunks import DEFAULT_CHUNK_SIZE, ChunkIndex, check_chunk_size
from dsec.shared.errors import InvalidRequest, LayerInUse, NotFound
from dsec.shared.meta import open_db
from dsec.shared.wire.layers import Layer
from dsec.shared.wire.models import normalize_layer_ref

EROFS_CHUNK = 1 << 20  # mkfs.erofs --chunksize: granularity of the metadata's chunk maps (and dedup)

KINDS = {"base": "base", "ws": "workspace", "tk": "toolkit"}
EROFS_MAGIC = 0xE0F5E1E2


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
    """The store at ``root``; its catalog in ``db`` (a cluster's database, which the caller
    owns) when given, else in ``root``'s own catalog file. A store that had a file before
    it had a database starts the database's catalog from it."""

    def __init__(self, root: str, backend: BackendKind | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 db: Engine | None = None) -> None:
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)
        self.backend: BlobBackend = open_backend(self.root, backend)
        self.chunk_size = check_chunk_size(chunk_size)
        self.blob_dir = os.path.join(self.root, "blobs", "sha256")
        # WAL needs shared memory between all users of the file, which a network
        # filesystem cannot give; a rollback journal only needs POSIX locks.
        journal: JournalMode = "WAL" if self.backend.kind == "local" else "DELETE"
        file = os.path.join(self.root, FILE_NAME)
        if db is None:
            self.catalog = Catalog.open_file(file, journal)
        else:
            self.catalog = Catalog(db)
            self.catalog.import_file(file, journal)

    def close(self) -> None:
        """Close the catalog (a process must not hold files on a shared store it is done with)."""
        self.catalog.close()

    def blob_path(self, digest: str) -> str:
        """The metadata image (or whole image, for one published as a single file)."""
        return self.backend.path(f"{digest}.erofs")

    def data_path(self, data: str) -> str:
        return self.backend.path(f"{data}.data")

    def data_of(self, digest: str) -> str | None:
        """The data blob an image's metadata refers to; None for a single-file image."""
        return self.catalog.data_of(digest)

    def mount_args(self, digest: str) -> tuple[str, str | None]:
        """(source, options) to mount image ``digest`` straight from this store with
        mount(2): the metadata file, and its data blob as the EROFS extra device."""
        check_erofs(self.blob_path(digest))
        data = self.data_of(digest)
        return self.blob_path(digest), f"device={self.data_path(data)}" if data else None

    def chunk_index(self, data: str) -> ChunkIndex:
        with open(self.backend.path(f"{data}.chunks"), "rb") as f:
            return ChunkIndex.from_bytes(f.read())

    def _layers(self, rows: builtins.list[RowMapping]) -> builtins.list[Layer]:
        """Layers of catalog rows, with their data blobs and prefetch hint sizes (looked up
        for all rows together: a remote database answers two queries, not two per blob)."""
        found = [Layer(ref=r["ref"], kind=r["kind"], digest=r["digest"], size=r["size"], created_at=r["created_at"],
                       **json.loads(r["meta"] or "{}")) for r in rows]
        data = self.catalog.data_of_many(b for layer in found for b in layer.all_blobs)
        counts = self.catalog.prefetch_counts(data.values())
        for layer in found:
            for b in layer.all_blobs:
                if d := data.get(b):
                    layer.data[b] = d
                    layer.prefetch_chunks += counts.get(d, 0)
        return found

    # ---- access lists (prefetch hints) ------------------------------------------
    def access_list(self, data: str) -> builtins.list[int]:
        return self.catalog.access_list(data)

    def set_access_list(self, data: str, chunks: builtins.list[int], source: str) -> None:
        """Record the chunks of ``data`` a run touched, in first-touch order. Advisory
        metadata beside the immutable layer: a later recording replaces it."""
        self.catalog.set_access_list(data, chunks, source)

    def get(self, ref: str) -> Layer:
        ref = normalize_layer_ref(ref)
        row = self.catalog.layer(ref)
        if row is None:
            raise NotFound(f"unknown layer {ref!r}", field="ref")
        return self._layers([row])[0]

    def has(self, ref: str) -> bool:
        return self.catalog.has(normalize_layer_ref(ref))

    def list(self) -> list[Layer]:
        return self._layers(self.catalog.layers())

    def link_from(self, other_root: str, refs: set[str] | None = None) -> int:
        """Publish every layer (or those of ``refs``) of the store at ``other_root`` here,
        hard-linking blobs (copying across filesystems). Returns how many layers were added."""
        other = LayerStore(other_root)
        try:
            layers = other.list()
        finally:
            other.close()
        added = 0
        for layer in layers:
            if self.has(layer.ref) or (refs is not None and layer.ref not in refs):
                continue
            for blob in layer.all_blobs:
                names = [f"{blob}.erofs"]
                if data := layer.data.get(blob):
                    names += [f"{data}.data", f"{data}.chunks"]
                for name in names:
                    dest = self.backend.path(name)
                    if not os.path.exists(dest):
                        try:
                            os.link(other.backend.path(name), dest)
                        except OSError:
                            shutil.copy2(other.backend.path(name), dest)
                if data:
                    self.catalog.set_data(blob, data)
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
        return self._publish(Layer(ref=ref, kind=ref_kind, digest=digest, size=self._blob_size(digest),
                                   created_at=time.time(), parent_image=parent_image,
                                   parent_layers=parent_layers or [], source=source))

    def ensure_dir(self, src: str, ref: str) -> Layer:
        """``import_dir``, for a layer every node of a cluster may build at once (the base
        layers, at each edge's start): a node that finds ``ref`` published by another since
        it looked adopts that layer instead of failing (two builds of one tree differ in
        their timestamps, so the loser's digest is not the winner's)."""
        try:
            return self.import_dir(src, ref)
        except InvalidRequest:
            if self.has(ref):
                return self.get(ref)
            raise

    def build_blob(self, src: str, opts: ImportOptions) -> str:
        """mkfs.erofs ``src`` into the store as metadata image + data blob + chunk index
        (not yet published under a name); returns the metadata image's digest."""
        if opts.content_key and (done := self.built_blob(opts.content_key)):
            return done
        work = tempfile.mkdtemp(dir=self.backend.tempdir())
        try:
            meta, data = os.path.join(work, "meta"), os.path.join(work, "data")
            # Chunked files are stored uncompressed in the blob device (erofs-utils 1.5),
            # which is what lets a node fetch any byte range of a file on its own.
            cmd = ["mkfs.erofs", "--quiet", "--preserve-mtime", f"--chunksize={EROFS_CHUNK}", f"--blobdev={data}"]
            cmd += [f"--exclude-regex={rx}" for rx in opts.exclude_regex]
            proc = subprocess.run([*cmd, meta, src], capture_output=True)
            if proc.returncode != 0:
                raise InvalidRequest(f"mkfs.erofs failed for {src}: {proc.stderr.decode(errors='replace')[-500:]}")
            data_digest, digest = sha256_file(data), sha256_file(meta)
            index = os.path.join(work, "chunks")
            with open(index, "wb") as f:
                f.write(ChunkIndex.build(data, self.chunk_size).to_bytes())
            # data first, metadata last: a metadata image in the store always has its data
            for path, name in ((data, f"{data_digest}.data"), (index, f"{data_digest}.chunks"),
                               (meta, f"{digest}.erofs")):
                self.backend.put(path, name)
            self.catalog.set_data(digest, data_digest)
            if opts.content_key:
                self.catalog.set_built(opts.content_key, digest)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return digest

    def _blob_size(self, digest: str) -> int:
        size = os.path.getsize(self.blob_path(digest))
        if data := self.data_of(digest):
            size += os.path.getsize(self.data_path(data))
        return size

    def built_blob(self, content_key: str) -> str | None:
        """The blob an earlier build of the same input produced, if it is still stored."""
        digest = self.catalog.built(content_key)
        return digest if digest and os.path.exists(self.blob_path(digest)) else None

    def publish_blobs(self, ref: str, digests: builtins.list[str], source: str = "") -> Layer:
        """Publish already-built blobs (bottom to top) as one layer ``ref``."""
        ref = normalize_layer_ref(ref)
        kind = layer_kind(ref)
        identity = digests[0] if len(digests) == 1 else hashlib.sha256(",".join(digests).encode()).hexdigest()
        size = sum(self._blob_size(d) for d in digests)
        return self._publish(Layer(ref=ref, kind=kind, digest=identity, size=size, created_at=time.time(),
                                   source=source, blobs=digests if len(digests) > 1 else []))

    def import_image(self, path: str, ref: str, source: str = "") -> Layer:
        """Publish an existing EROFS image file (checked, then copied in)."""
        ref = normalize_layer_ref(ref)
        kind = layer_kind(ref)
        if self.has(ref):
            raise InvalidRequest(f"layer {ref!r} already exists", field="ref")
        check_erofs(path)
        digest = sha256_file(path)
        self.backend.put(path, f"{digest}.erofs")
        return self._publish(Layer(ref=ref, kind=kind, digest=digest, size=os.path.getsize(self.blob_path(digest)),
                                   created_at=time.time(), source=source))

    def _publish(self, layer: Layer) -> Layer:
        meta = {"parent_image": layer.parent_image, "parent_layers": layer.parent_layers, "source": layer.source,
                "blobs": layer.blobs}
        if not self.catalog.add_layer(ref=layer.ref, kind=layer.kind, digest=layer.digest, size=layer.size,
                                      created_at=layer.created_at, meta=json.dumps(meta)):
            existing = self.get(layer.ref)
            if existing.digest != layer.digest:
                raise InvalidRequest(f"layer {layer.ref!r} is already published with another content; "
                                     "layers are immutable, publish a new version", field="ref")
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
        self.catalog.remove_layer(layer.ref)
        return layer

    def gc(self, in_use: set[str]) -> builtins.list[str]:
        """Delete blobs no published layer and no running sandbox references."""
        live = {b for layer in self.list() for b in layer.all_blobs} | in_use
        live |= {d for b in live if (d := self.data_of(b))}
        removed = []
        for name in self.backend.names():
            digest, _, ext = name.partition(".")
            if ext in ("erofs", "data", "chunks") and digest not in live:
                self.backend.remove(name)
                if ext != "chunks":
                    removed.append(digest)
        self.catalog.keep_data_of(live)
        return removed


def sha256_file(path: str) -> str:
    """A file's sha256, hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def open_store(data_dir: str, store: str | None = None, db: str | Engine | None = None) -> LayerStore:
    """The layer store: ``store`` (or $DSEC_STORE) is a shared filesystem path mounted on
    every node; without one, the local data dir. $DSEC_CHUNK_SIZE sets the chunk size
    new layers are indexed with (bytes, default 1 MiB). Its catalog is in ``db`` (a
    cluster's database: its URL, or its engine when the caller has one open) when given,
    else in the store's own file. Only when given: $DSEC_DB is read by the commands that
    serve a cluster (their --db), never here, so a variable left in a shell cannot move
    the catalog of an embedded or hand-run store into some cluster's database."""
    store = store or os.environ.get("DSEC_STORE") or None
    chunk = int(os.environ.get("DSEC_CHUNK_SIZE", DEFAULT_CHUNK_SIZE))
    engine = open_db(db) if isinstance(db, str) else db
    if store:
        return LayerStore(store, "sharedfs", chunk_size=chunk, db=engine)
    return LayerStore(os.path.join(os.path.abspath(data_dir), "layers"), "local", chunk_size=chunk, db=engine)
