"""The layer catalog in a database: two stores on one shared root and one PostgreSQL (two
nodes of a cluster) see each other's layers, access lists and removals at once; a name
published twice behaves as with the catalog file; a store used before its cluster had a
database starts the cluster's catalog from its file, once, however many nodes open it
together; and a catalog file written by the code before SQLAlchemy keeps its rows.

Real components: a private PostgreSQL (as ``dsec cluster up`` starts one), mkfs.erofs,
a tmpfs as the shared store's filesystem (the ``sharedfs`` backend refuses a directory on
this node's root filesystem)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sqlite3
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from typing import Literal

import pytest
from sqlalchemy import Engine, create_engine, inspect, text
from sqlalchemy.engine import make_url

from dsec.control.cluster.postgres import Postgres
from dsec.node.layers.base import build_busybox
from dsec.node.layers.catalog import FILE_NAME, Catalog
from dsec.node.layers.store import ImportOptions, LayerStore, open_store
from dsec.shared.errors import InvalidRequest, LayerInUse, NotFound
from dsec.shared.meta import open_db, sqlite_url
from dsec.shared.meta.db import normalize_url
from tests.conftest import _free_port

CATALOG_TABLES = {"layers", "built", "blob_data", "access_lists"}
TEMPLATE_TABLES = {"templates", "template_builds", "template_build_logs", "template_tags", "template_cache"}
JOB_TABLES = {"jobs", "batches", "batch_items", "rollouts", "rollout_steps"}
HEAD = "0012"  # the newest revision under dsec/shared/meta/migrations/versions

# the catalog file as the code before SQLAlchemy made it (git show f82f9c5:src/dsec/node/layers/store.py)
OLD_DDL = [
    "CREATE TABLE IF NOT EXISTS layers (ref TEXT PRIMARY KEY, kind TEXT NOT NULL,"
    " digest TEXT NOT NULL, size INTEGER NOT NULL, created_at REAL NOT NULL)",
    "CREATE TABLE IF NOT EXISTS built (key TEXT PRIMARY KEY, digest TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS blob_data (meta TEXT PRIMARY KEY, data TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS access_lists (data TEXT PRIMARY KEY, chunks TEXT NOT NULL,"
    " source TEXT NOT NULL, recorded_at REAL NOT NULL)",
]
OLD_LINEAGE_COLUMN = "ALTER TABLE layers ADD COLUMN meta TEXT NOT NULL DEFAULT '{}'"


def _old_catalog(root: str, lineage: bool, journal: Literal["WAL", "DELETE"]) -> sqlite3.Connection:
    """A catalog file as the old code left it (``lineage``: after it recorded lineage)."""
    os.makedirs(root, exist_ok=True)
    db = sqlite3.connect(os.path.join(root, FILE_NAME), isolation_level=None)
    db.execute(f"PRAGMA journal_mode={journal}")
    for stmt in OLD_DDL + ([OLD_LINEAGE_COLUMN] if lineage else []):
        db.execute(stmt)
    return db


class Opened:
    """Stores and engines a test opened, closed at its end (before a store's filesystem goes)."""

    def __init__(self) -> None:
        self.items: list[LayerStore | Engine] = []

    def store(self, root: str, backend: Literal["local", "sharedfs"], url: str | None = None) -> LayerStore:
        s = LayerStore(root, backend, db=self.engine(url) if url else None)
        self.items.append(s)
        return s

    def engine(self, url: str) -> Engine:
        e = open_db(url)
        self.items.append(e)
        return e

    def close(self) -> None:
        for item in reversed(self.items):
            item.close() if isinstance(item, LayerStore) else item.dispose()
        self.items.clear()


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    root = tempfile.mkdtemp(prefix="dsec-pg-")  # PostgreSQL runs as its own user: not under pytest's 0700 dirs
    os.chmod(root, 0o711)
    pg = Postgres(os.path.join(root, "data"), port=_free_port())
    try:
        yield pg.start()
    finally:
        pg.remove()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def db_url(pg_url: str) -> str:
    """A fresh database of the server per test: a cluster's, empty."""
    name = f"t_{secrets.token_hex(6)}"
    admin = create_engine(normalize_url(pg_url), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as c:
            c.execute(text(f"CREATE DATABASE {name}"))
    finally:
        admin.dispose()
    return make_url(pg_url).set(database=name).render_as_string(hide_password=False)


@pytest.fixture
def opened() -> Iterator[Opened]:
    o = Opened()
    yield o
    o.close()


@pytest.fixture
def shared_root(opened: Opened) -> Iterator[str]:
    """A store root on a filesystem of its own, as a shared store's mount is."""
    mnt = tempfile.mkdtemp(prefix="dsec-shared-")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", mnt], check=True)
    try:
        yield os.path.join(mnt, "store")
    finally:
        opened.close()  # nothing may hold a file there when it is unmounted
        subprocess.run(["umount", mnt], check=True)
        os.rmdir(mnt)


def _tree(path: str, content: str) -> str:
    os.makedirs(os.path.join(path, "etc"))
    with open(os.path.join(path, "etc", "hello"), "w") as f:
        f.write(content)
    return path


@pytest.fixture
def src(tmp_path: str) -> str:
    return _tree(os.path.join(tmp_path, "src"), "hello\n")


@pytest.fixture(params=["file", "db"])
def two_nodes(request: pytest.FixtureRequest, shared_root: str, opened: Opened) -> tuple[LayerStore, LayerStore]:
    """Two nodes' stores on one shared root: the catalog in the root's file, or in a
    cluster's database (an engine each, as two nodes have)."""
    url = request.getfixturevalue("db_url") if request.param == "db" else None
    nodes = opened.store(shared_root, "sharedfs", url), opened.store(shared_root, "sharedfs", url)
    # the file only where the catalog lives in it
    assert os.path.exists(os.path.join(shared_root, FILE_NAME)) == (url is None)
    return nodes


def test_what_one_node_does_the_other_sees_at_once(two_nodes: tuple[LayerStore, LayerStore], src: str) -> None:
    a, b = two_nodes
    layer = a.import_dir(src, "ws/x:v1", source="test")
    assert b.has("ws/x:v1") and [x.ref for x in b.list()] == ["ws/x:v1"]
    seen = b.get("ws/x:v1")
    assert (seen.digest, seen.size, seen.created_at, seen.source) == (layer.digest, layer.size, layer.created_at,
                                                                      "test")
    data = seen.data[layer.digest]
    assert a.data_of(layer.digest) == data
    assert b.mount_args(layer.digest) == (b.blob_path(layer.digest), f"device={b.data_path(data)}")

    a.set_access_list(data, [5, 0, 3], "run-1")
    assert b.access_list(data) == [5, 0, 3] and b.get("ws/x:v1").prefetch_chunks == 3
    b.set_access_list(data, [1], "run-2")  # a later recording replaces the earlier
    assert a.access_list(data) == [1] and a.list()[0].prefetch_chunks == 1

    digest = a.build_blob(src, ImportOptions(content_key="group-1"))
    assert b.built_blob("group-1") == digest and b.built_blob("group-2") is None

    b.remove("ws/x:v1", in_use=set())
    assert not a.has("ws/x:v1") and a.list() == []
    with pytest.raises(NotFound):
        a.get("ws/x:v1")
    assert layer.digest in a.gc(in_use=set())
    assert b.data_of(layer.digest) is None


def test_a_name_published_twice(two_nodes: tuple[LayerStore, LayerStore], src: str, tmp_path: str) -> None:
    a, b = two_nodes
    layer = a.import_dir(src, "ws/x:v1")
    with pytest.raises(InvalidRequest, match="already exists"):
        b.import_dir(src, "ws/x:v1")
    # two nodes past the existence check at once: the same content is the layer already there
    again = b.publish_blobs("ws/x:v1", [layer.digest])
    assert (again.digest, again.created_at) == (layer.digest, layer.created_at)
    other = b.import_dir(_tree(os.path.join(tmp_path, "other"), "other\n"), "ws/y:v1")
    with pytest.raises(InvalidRequest, match="another content"):
        a.publish_blobs("ws/x:v1", [other.digest])
    assert b.get("ws/x:v1").digest == layer.digest


def test_the_store_file_starts_a_clusters_catalog_once(shared_root: str, db_url: str, opened: Opened,
                                                      src: str) -> None:
    # the store as nodes used it before their cluster had a database: an old file, real blobs
    _old_catalog(shared_root, lineage=True, journal="DELETE").close()
    before = opened.store(shared_root, "sharedfs")
    base = before.import_dir(src, "base/mini:1")
    ws = before.import_dir(src, "ws/old:v1", parent_image="base/mini:1", source="pack")
    data = before.data_of(ws.digest)
    assert data is not None
    before.set_access_list(data, [2, 0], "run")
    built = before.build_blob(src, ImportOptions(content_key="group-1"))
    expected = before.list()
    before.close()

    # nodes opening the store with the database together: one takes the file in
    path = os.path.join(shared_root, FILE_NAME)
    catalogs = [Catalog(opened.engine(db_url)) for _ in range(4)]
    start, counts = threading.Barrier(len(catalogs)), []

    def open_one(c: Catalog) -> None:
        start.wait()
        counts.append(c.import_file(path, "DELETE"))
    threads = [threading.Thread(target=open_one, args=(c,)) for c in catalogs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(counts) == [0, 0, 0, 2]

    node = opened.store(shared_root, "sharedfs", db_url)
    assert node.list() == expected
    assert node.get("ws/old:v1").prefetch_chunks == 2 and node.access_list(data) == [2, 0]
    assert node.built_blob("group-1") == built
    with pytest.raises(LayerInUse):
        node.remove(base.ref, in_use=set())

    # removed from the cluster's catalog, never back from the file
    node.remove("ws/old:v1", in_use=set())
    node.remove("base/mini:1", in_use=set())
    assert opened.store(shared_root, "sharedfs", db_url).list() == []
    assert [x.ref for x in opened.store(shared_root, "sharedfs").list()] == ["base/mini:1", "ws/old:v1"]
    with opened.engine(db_url).connect() as c:
        mark = json.loads(c.execute(text("SELECT value FROM settings WHERE key='layers:imported'")).scalar_one())
    assert mark["path"] == path and mark["layers"] == 2


def test_a_catalog_file_of_the_code_before_keeps_its_rows(tmp_path: str, src: str,
                                                          monkeypatch: pytest.MonkeyPatch, db_url: str) -> None:
    monkeypatch.delenv("DSEC_STORE", raising=False)
    monkeypatch.setenv("DSEC_DB", db_url)  # a cluster's, in the shell: not the embedded store's
    root = os.path.join(tmp_path, "layers")
    db = _old_catalog(root, lineage=False, journal="WAL")  # from before lineage was recorded
    db.execute("INSERT INTO layers VALUES ('ws/pre:v1', 'workspace', 'd1', 10, 1.5)")
    db.execute("INSERT INTO blob_data VALUES ('d1', 'x1')")
    db.execute("INSERT INTO access_lists VALUES ('x1', '[4, 1, 2]', 'old', 2.0)")
    db.execute("INSERT INTO built VALUES ('group-1', 'd1')")
    db.close()

    store = open_store(tmp_path)  # dsec serve's store: the data dir's file
    try:
        pre = store.get("ws/pre:v1")
        assert (pre.size, pre.created_at, pre.parent_image, pre.parent_layers, pre.data, pre.prefetch_chunks) == (
            10, 1.5, None, [], {"d1": "x1"}, 3)
        assert store.access_list("x1") == [4, 1, 2]
        assert store.built_blob("group-1") is None  # its blob is not in the store
        store.import_dir(src, "ws/next:v1", parent_image="base/busybox", parent_layers=["ws/pre:v1"])
        assert [x.ref for x in store.list()] == ["ws/next:v1", "ws/pre:v1"]
        with pytest.raises(LayerInUse):
            store.remove("ws/pre:v1", in_use=set())
    finally:
        store.close()

    db = sqlite3.connect(os.path.join(root, FILE_NAME))
    try:
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert db.execute("SELECT ref, meta FROM layers ORDER BY ref").fetchall()[1] == ("ws/pre:v1", "{}")
    finally:
        db.close()
    bare = create_engine(normalize_url(db_url))  # not open_db: that would make the tables
    try:
        with bare.connect() as c:
            assert not c.execute(text("SELECT count(*) FROM pg_tables WHERE tablename='layers'")).scalar()
    finally:
        bare.dispose()


def test_open_store_with_a_database(tmp_path: str, db_url: str, opened: Opened, src: str,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DSEC_STORE", raising=False)
    store = open_store(tmp_path, db=db_url)
    try:
        store.import_dir(src, "ws/x:v1")
    finally:
        store.close()
    assert not os.path.exists(os.path.join(tmp_path, "layers", FILE_NAME))
    assert opened.store(os.path.join(tmp_path, "layers"), "local", db_url).has("ws/x:v1")
    with opened.engine(db_url).connect() as c:
        assert c.execute(text("SELECT version_num FROM alembic_version")).scalar_one() == HEAD
        assert CATALOG_TABLES | TEMPLATE_TABLES | JOB_TABLES <= set(inspect(c).get_table_names())


def test_embedded_metadata_gets_the_catalog_revision(tmp_path: str, opened: Opened) -> None:
    engine = opened.engine(sqlite_url(tmp_path))
    with engine.connect() as c:
        assert c.execute(text("SELECT version_num FROM alembic_version")).scalar_one() == HEAD
        assert CATALOG_TABLES | TEMPLATE_TABLES | JOB_TABLES <= set(inspect(c).get_table_names())


def _edges_start_together(nodes: list[LayerStore]) -> list[object]:
    """build_busybox on every node at once, each in a thread; a barrier makes all of them
    check the catalog and build before any publishes. What each got (a layer or an error)."""
    barrier = threading.Barrier(len(nodes), timeout=60)
    for node in nodes:
        real = node.import_dir

        def racing(*a: object, _real: object = real, **kw: object) -> object:
            barrier.wait()  # every node has looked and built; now all publish at once
            return _real(*a, **kw)  # type: ignore[operator]
        node.import_dir = racing  # type: ignore[method-assign]
    got: list[object] = [None] * len(nodes)

    def start(i: int) -> None:
        try:
            got[i] = build_busybox(nodes[i])
        except Exception as e:  # noqa: BLE001  (reported by the test, per node)
            got[i] = e
    threads = [threading.Thread(target=start, args=(i,)) for i in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return got


@pytest.mark.parametrize("catalog", ["file", "db"])
def test_edges_starting_together_build_the_base_layer_once(shared_root: str, pg_url: str, opened: Opened,
                                                           catalog: str) -> None:
    """Four edges start at once against a fresh store and catalog, five times over: each
    finds base/busybox missing, builds it (the builds differ: timestamps), and publishes;
    the barrier makes all four check before any publishes, the interleaving that lost an
    edge for good. Every edge comes up with the one layer that won."""
    for r in range(5):
        url = None
        if catalog == "db":
            name = f"t_{secrets.token_hex(6)}"
            admin = create_engine(normalize_url(pg_url), isolation_level="AUTOCOMMIT")
            with admin.connect() as c:
                c.execute(text(f"CREATE DATABASE {name}"))
            admin.dispose()
            url = make_url(pg_url).set(database=name).render_as_string(hide_password=False)
        nodes = [opened.store(f"{shared_root}-{r}", "sharedfs", url) for _ in range(4)]
        got = _edges_start_together(nodes)
        assert all(not isinstance(g, Exception) for g in got), (r, got)
        digests = {g.digest for g in got}  # type: ignore[attr-defined]
        assert len(digests) == 1, (r, digests)
        assert [x.ref for x in nodes[0].list()] == ["base/busybox:latest"]
        assert nodes[0].get("base/busybox:latest").digest in digests
