"""Opening the metadata database: an engine with bounded connects and statements, its
schema brought to the newest Alembic revision first (under an advisory lock on
PostgreSQL, so replicas starting together migrate once)."""

from __future__ import annotations

import os
import sqlite3

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, DisconnectionError, InterfaceError, OperationalError

from dsec.errors import MetadataUnavailable

MIGRATIONS = os.path.join(os.path.dirname(__file__), "migrations")
CONNECT_TIMEOUT_S = 5
STATEMENT_TIMEOUT_MS = 10_000
MIGRATION_LOCK = 0x64736563  # "dsec"


def unavailable(e: BaseException) -> MetadataUnavailable | None:
    """``e`` as the typed 503 a caller gets while the database is away (a server restarting
    or unreachable, a connection cut, a statement past its timeout); None for any other
    error, which stays the bug it is. The next request tries again: the engine checks a
    pooled connection before use (pool_pre_ping) and connects anew within CONNECT_TIMEOUT_S."""
    if isinstance(e, OperationalError | InterfaceError | DisconnectionError) or \
            isinstance(e, DBAPIError) and e.connection_invalidated:
        first = str(getattr(e, "orig", None) or e).strip().splitlines()[:1] or [type(e).__name__]
        return MetadataUnavailable(f"the cluster's database did not answer ({first[0][:200]}); try again shortly")
    return None


def sqlite_url(data_dir: str) -> str:
    return f"sqlite:///{os.path.join(os.path.abspath(data_dir), 'meta.db')}"


def normalize_url(url: str) -> str:
    """``postgresql://`` means psycopg 3 (the driver dsec installs); SQLite as given."""
    try:
        u = make_url(url)
    except ArgumentError:
        raise ValueError(f"--db {url!r} is not a database URL (postgresql://USER@HOST/DB or sqlite:///PATH)") from None
    if u.drivername in ("postgresql", "postgres"):
        u = u.set(drivername="postgresql+psycopg")
    elif u.drivername not in ("postgresql+psycopg", "sqlite"):
        raise ValueError(f"--db {url!r}: dsec speaks postgresql:// and sqlite:///, not {u.drivername}")
    return u.render_as_string(hide_password=False)


def open_db(url: str, migrate: bool = True) -> Engine:
    url = normalize_url(url)
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 10})

        @event.listens_for(engine, "connect")
        def _wal(conn: sqlite3.Connection, _: object) -> None:
            # WAL with synchronous=NORMAL: a commit is in the OS's hands when it returns, so it
            # survives any crash of dsec's processes (SIGKILL included); only the host losing
            # power can take the last commits before a checkpoint, and with them went the
            # sandboxes they describe (docs/performance.md, "What is durable"). FULL fsynced
            # the WAL on every commit: 2 of a create's 4 ms outside the edge.
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
    else:
        engine = create_engine(url, pool_pre_ping=True, pool_size=4, max_overflow=8, pool_timeout=CONNECT_TIMEOUT_S,
                               connect_args={"connect_timeout": CONNECT_TIMEOUT_S,
                                             "options": f"-c statement_timeout={STATEMENT_TIMEOUT_MS}"})
    if migrate:
        upgrade(engine)
    return engine


def upgrade(engine: Engine) -> None:
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK})
        cfg = Config()
        cfg.set_main_option("script_location", MIGRATIONS)
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
