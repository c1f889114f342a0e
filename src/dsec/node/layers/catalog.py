"""The layer catalog's rows over SQLAlchemy Core, one code for both places it lives: a
SQLite file at the layer store's root (embedded mode, a store used on its own) or the
cluster's database (PostgreSQL, shared by every node and replica: a SQLite file written
by every node over the shared store's FUSE filesystem is what cluster mode must not do).

A cluster's catalog starts from the store's own file, when it has one: the first node to
open the store with the database takes the file's rows in, once. Blocking calls, like the
rest of the store."""

from __future__ import annotations

import json
import os
import sqlite3
import time
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Literal

from sqlalchemy import Connection, Engine, Table, create_engine, delete, event, func, inspect, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import RowMapping
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.schema import CreateColumn, CreateTable

from dsec.shared.meta.catalog_schema import access_lists, blob_data, built, layers, metadata
from dsec.shared.meta.schema import settings

JournalMode = Literal["WAL", "DELETE"]
FILE_NAME = "catalog.db"
BUSY_TIMEOUT_S = 30  # a writer on another node holds the file's lock this long at worst
IMPORTED = "layers:imported"  # settings key: the store file a cluster's catalog was started from
IMPORT_LOCK = 0x64736563636174  # "dseccat": one node imports, the others wait and find it done
IN_BATCH = 500  # values per IN (...): under SQLite's bound on parameters however many blobs a list spans


def _batches(items: Iterable[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == IN_BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


class Catalog:
    """The catalog on ``engine``; ``owned``: the engine is the catalog's own (a file's), to
    dispose of at close, not a database others use too."""

    def __init__(self, engine: Engine, owned: bool = False) -> None:
        self.engine = engine
        # An owned file's connections close with the catalog even when nobody calls close()
        # (``LayerStore(root).link_from(...)``): the engine sits in reference cycles, and a
        # file on a shared store left open until a garbage collection can outlive the
        # filesystem's mount.
        self._dispose = weakref.finalize(self, engine.dispose) if owned else None
        chunks: Any = access_lists.c.chunks
        if engine.dialect.name == "postgresql":  # its json_array_length takes json, not text
            chunks = chunks.cast(postgresql.JSON)
        self._chunk_count = func.json_array_length(chunks)

    @classmethod
    def open_file(cls, path: str, journal_mode: JournalMode) -> Catalog:
        """The catalog in the SQLite file ``path``, made or brought up to the current tables
        (a file of any earlier version keeps its rows)."""
        engine = create_engine(f"sqlite:///{path}",
                               connect_args={"check_same_thread": False, "timeout": BUSY_TIMEOUT_S})

        @event.listens_for(engine, "connect")
        def _journal(conn: sqlite3.Connection, _: object) -> None:
            conn.execute(f"PRAGMA journal_mode={journal_mode}")

        try:
            _bring_up(engine)
        except BaseException:
            engine.dispose()
            raise
        return cls(engine, owned=True)

    def close(self) -> None:
        if self._dispose is not None:
            self._dispose()

    def _insert(self, table: Table) -> sqlite.Insert | postgresql.Insert:
        """An INSERT that can say what a conflict on the primary key does."""
        if self.engine.dialect.name == "postgresql":
            return postgresql.insert(table)
        return sqlite.insert(table)

    def _put(self, table: Table, **values: Any) -> None:
        """Insert or replace the row with ``values``' primary key."""
        ins = self._insert(table).values(**values)
        keys = [c.name for c in table.primary_key]
        with self.engine.begin() as c:
            c.execute(ins.on_conflict_do_update(index_elements=keys,
                                                set_={k: ins.excluded[k] for k in values if k not in keys}))

    def _one(self, table: Table, column: str, key: str) -> Any:
        """``column`` of the row whose primary key is ``key``; None without one."""
        (pk,) = table.primary_key
        with self.engine.connect() as c:
            return c.execute(select(table.c[column]).where(pk == key)).scalar()

    # ---- layers ----------------------------------------------------------------------
    def layer(self, ref: str) -> RowMapping | None:
        with self.engine.connect() as c:
            return c.execute(select(layers).where(layers.c.ref == ref)).mappings().first()

    def layers(self) -> list[RowMapping]:
        with self.engine.connect() as c:
            return list(c.execute(select(layers).order_by(layers.c.ref)).mappings())

    def has(self, ref: str) -> bool:
        return self._one(layers, "ref", ref) is not None

    def add_layer(self, **row: Any) -> bool:
        """Publish a row; False when ``ref`` is published already (names never move)."""
        try:
            with self.engine.begin() as c:
                c.execute(layers.insert().values(**row))
        except IntegrityError:
            return False
        return True

    def remove_layer(self, ref: str) -> None:
        with self.engine.begin() as c:
            c.execute(delete(layers).where(layers.c.ref == ref))

    # ---- blobs -----------------------------------------------------------------------
    def data_of(self, meta: str) -> str | None:
        data = self._one(blob_data, "data", meta)
        return str(data) if data is not None else None

    def data_of_many(self, metas: Iterable[str]) -> dict[str, str]:
        """meta -> data blob, for those of ``metas`` that have one."""
        found: dict[str, str] = {}
        with self.engine.connect() as c:
            for batch in _batches(set(metas)):
                q = select(blob_data.c.meta, blob_data.c.data).where(blob_data.c.meta.in_(batch))
                found.update((m, d) for m, d in c.execute(q))
        return found

    def set_data(self, meta: str, data: str) -> None:
        self._put(blob_data, meta=meta, data=data)

    def keep_data_of(self, live: set[str]) -> None:
        """Forget the data blob of every metadata image not in ``live``."""
        with self.engine.begin() as c:
            dead = [m for m in c.execute(select(blob_data.c.meta)).scalars() if m not in live]
            for batch in _batches(dead):
                c.execute(delete(blob_data).where(blob_data.c.meta.in_(batch)))

    def built(self, key: str) -> str | None:
        digest = self._one(built, "digest", key)
        return str(digest) if digest is not None else None

    def set_built(self, key: str, digest: str) -> None:
        self._put(built, key=key, digest=digest)

    # ---- access lists ----------------------------------------------------------------
    def access_list(self, data: str) -> list[int]:
        chunks = self._one(access_lists, "chunks", data)
        return [int(n) for n in json.loads(chunks)] if chunks is not None else []

    def set_access_list(self, data: str, chunks: list[int], source: str) -> None:
        self._put(access_lists, data=data, chunks=json.dumps(chunks), source=source, recorded_at=time.time())

    def prefetch_counts(self, datas: Iterable[str]) -> dict[str, int]:
        """data blob -> how many chunks its access list has, for those that have one."""
        found: dict[str, int] = {}
        with self.engine.connect() as c:
            for batch in _batches(set(datas)):
                q = select(access_lists.c.data, self._chunk_count).where(access_lists.c.data.in_(batch))
                found.update((d, int(n)) for d, n in c.execute(q))
        return found

    # ---- a cluster's start -----------------------------------------------------------
    def _started(self, c: Connection) -> bool:
        return (c.execute(select(settings.c.key).where(settings.c.key == IMPORTED)).first() is not None
                or c.execute(select(layers.c.ref).limit(1)).first() is not None)

    def import_file(self, path: str, journal_mode: JournalMode) -> int:
        """Take in the rows of the store's own catalog file ``path`` (a store used before it
        had a database), when this catalog has neither layers nor an earlier import; returns
        how many layers came. Once: the import is recorded, so layers removed later never
        come back from the file. Nodes opening the store together serialize on a lock, and
        a row present already is kept (a retry after a failure midway adds the rest)."""
        if not os.path.exists(path):
            return 0
        with self.engine.connect() as c:
            if self._started(c):
                return 0
        old = Catalog.open_file(path, journal_mode)
        try:
            with old.engine.connect() as c:
                rows = {t: [dict(r) for r in c.execute(select(t)).mappings()] for t in metadata.sorted_tables}
        finally:
            old.close()
        with self.engine.begin() as c:
            if self.engine.dialect.name == "postgresql":
                c.execute(select(func.pg_advisory_xact_lock(IMPORT_LOCK)))
            if self._started(c):
                return 0
            for table, batch in rows.items():
                if batch:
                    c.execute(self._insert(table).on_conflict_do_nothing(), batch)
            c.execute(self._insert(settings).values(key=IMPORTED, value=json.dumps(
                {"path": path, "at": time.time(), "layers": len(rows[layers])})).on_conflict_do_nothing())
        return len(rows[layers])


def _bring_up(engine: Engine) -> None:
    """Create what the file lacks: tables (IF NOT EXISTS, so that nodes opening one store
    file together cannot trip over each other), and columns later versions added (a file
    written before lineage was recorded has no ``meta``)."""
    with engine.begin() as c:
        for table in metadata.sorted_tables:
            c.execute(CreateTable(table, if_not_exists=True))
        for table in metadata.sorted_tables:
            have = {col["name"] for col in inspect(c).get_columns(table.name)}
            for col in table.columns:
                if col.name in have:
                    continue
                ddl = CreateColumn(col).compile(dialect=engine.dialect)
                try:
                    c.exec_driver_sql(f"ALTER TABLE {table.name} ADD COLUMN {ddl}")
                except OperationalError:  # another node added it first
                    if col.name not in {x["name"] for x in inspect(c).get_columns(table.name)}:
                        raise
