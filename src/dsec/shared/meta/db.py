"""Opening the metadata database: an engine with bounded connects and statements, its
schema brought to the newest Alembic revision first (under an advisory lock on
PostgreSQL, so replicas starting together migrate once)."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import (
    ArgumentError,
    DBAPIError,
    DisconnectionError,
    InterfaceError,
    OperationalError,
    SQLAlchemyError,
)
from sqlalchemy.pool import ConnectionPoolEntry

from dsec.shared.errors import MetadataUnavailable

MIGRATIONS = os.path.join(os.path.dirname(__file__), "migrations")
CONNECT_TIMEOUT_S = 5
STATEMENT_TIMEOUT_MS = 10_000
MIGRATION_LOCK = 0x64736563  # "dsec"
POOL_SIZE = min(32, (os.cpu_count() or 1) + 4)  # asyncio's default executor's threads
PING_IDLE_S = 5.0
T = TypeVar("T")


def unavailable(e: BaseException) -> MetadataUnavailable | None:
    """``e`` as the typed 503 a caller gets while the database is away (a server restarting
    or unreachable, a connection cut, a statement past its timeout); None for any other
    error, which stays the bug it is. The next request tries again: a connection that was
    cut invalidates the pool (each pooled one is made anew), one idle for a while is checked
    before use (``_ping_idle``), and a connect is bounded by CONNECT_TIMEOUT_S."""
    if isinstance(e, OperationalError | InterfaceError | DisconnectionError) or \
            isinstance(e, DBAPIError) and e.connection_invalidated:
        first = str(getattr(e, "orig", None) or e).strip().splitlines()[:1] or [type(e).__name__]
        return MetadataUnavailable(f"the cluster's database did not answer ({first[0][:200]}); try again shortly")
    return None


RIDE_THROUGH_S = 10.0  # how long a request waits out a database restart before its 503


async def ride_through(call: Callable[[], Awaitable[T]], limit_s: float = RIDE_THROUGH_S) -> T:
    """``call()``, tried again while the database is away (restarting, unreachable: what
    :func:`unavailable` names), for up to ``limit_s``; then its 503. Only for steps that
    change nothing until they succeed (a read, an admission's one transaction): a create
    during a PostgreSQL restart failed at once (bench/chaos.py) where waiting 1 s would do."""
    deadline = time.monotonic() + limit_s
    delay = 0.1
    while True:
        try:
            return await call()
        except (SQLAlchemyError, MetadataUnavailable) as e:
            if (isinstance(e, SQLAlchemyError) and unavailable(e) is None) or time.monotonic() + delay > deadline:
                raise
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1.0)


class DatabaseUnreachable(ConnectionError):
    """The database refused or did not answer a daemon's first connection: the message says
    where it tried and what to fix."""


CONNECT_FAILED = ("connection failed", "connection to server", "could not translate host", "could not connect")


def _unreachable(url: str, e: OperationalError) -> DatabaseUnreachable | None:
    """``e``, met on a first connection, as what to fix; None if it is not a connect's."""
    if not any(s in str(e).lower() for s in CONNECT_FAILED):
        return None
    u = make_url(url)
    where = f"{u.host or 'localhost'}:{u.port or 5432}"
    first = (str(getattr(e, "orig", None) or e).strip().splitlines() or [type(e).__name__])
    why = " ".join(ln.strip() for ln in first[:2])[:300]
    low = why.lower()
    if "pg_hba.conf" in low and "no encryption" in low:
        hint = ("the server takes network clients over TLS only: add ?sslmode=require&channel_binding=require "
                "to the URL")
    elif "pg_hba.conf" in low:
        hint = ("the server does not admit this node's address (a cluster's private database admits the "
                "subnet of its node's address: name others with `dsec cluster up --db-allow CIDR`)")
    elif "password authentication failed" in low:
        hint = "the URL's user or password is wrong"
    elif any(s in low for s in ("timeout", "timed out", "refused", "no route", "unreachable")):
        hint = f"open TCP port {u.port or 5432} on {u.host} to this node, and have the server listen on that address"
    else:
        hint = "see the server's log"
    return DatabaseUnreachable(f"cannot reach the cluster's database at {where} from this node: {hint} ({why})")


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
        # as many pooled connections as the default executor has threads (the blocking calls
        # run there): with fewer, the overflow was a new connection (a PostgreSQL backend
        # forked, authenticated) and a close for every call past the 4th at once, ~1 ms of
        # each side's CPU per create (bench/scale.py)
        engine = create_engine(url, pool_size=POOL_SIZE, max_overflow=8, pool_timeout=CONNECT_TIMEOUT_S,
                               connect_args={"connect_timeout": CONNECT_TIMEOUT_S,
                                             "options": f"-c statement_timeout={STATEMENT_TIMEOUT_MS}"})
        _ping_idle(engine)
    if migrate:
        try:
            upgrade(engine)
        except OperationalError as e:
            if engine.dialect.name != "postgresql" or (why := _unreachable(url, e)) is None:
                raise
            engine.dispose()
            raise why from None
    return engine


def _ping_idle(engine: Engine) -> None:
    """Check a pooled connection before use only when it sat idle for PING_IDLE_S or more:
    those are the ones a database restart or a proxy's idle timeout cut while nobody looked.
    pool_pre_ping checked every checkout, a round trip per call (three per create). A busy
    connection that the server drops fails its call with a 503 and invalidates the pool."""
    @event.listens_for(engine, "connect")
    @event.listens_for(engine, "checkin")
    def _used(dbapi_conn: object, record: ConnectionPoolEntry) -> None:
        record.info["used_at"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checkout(dbapi_conn: Any, record: ConnectionPoolEntry, proxy: object) -> None:
        if time.monotonic() - record.info.get("used_at", 0.0) < PING_IDLE_S:
            return
        try:
            with dbapi_conn.cursor() as cur:
                cur.execute("SELECT 1")
        except Exception as e:  # the pool makes a new connection (and tries up to 3 times)
            raise DisconnectionError(f"a pooled connection idle for {PING_IDLE_S:g} s or more is gone: {e}") from e


def upgrade(engine: Engine) -> None:
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK})
        cfg = Config()
        cfg.set_main_option("script_location", MIGRATIONS)
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
