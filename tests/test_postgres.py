"""The private PostgreSQL (dsec.cluster.postgres) that `dsec cluster up` runs when given no
database: ready means it takes queries, so a server killed uncleanly (mid-write, as by a
power loss) is waited for through its crash recovery, never hurried into errors, and comes
back with what it had committed. A real server, Debian's postgresql-15."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import tempfile
import threading
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, text

from dsec.cluster.postgres import Postgres, ready, state
from dsec.meta.db import normalize_url
from tests.conftest import _free_port


@pytest.fixture
def pg_dir() -> Iterator[str]:
    root = tempfile.mkdtemp(prefix="dsec-pg-")  # the server runs as its own user: not under pytest's 0700 dirs
    os.chmod(root, 0o711)
    yield os.path.join(root, "data")
    shutil.rmtree(root, ignore_errors=True)


def test_a_port_that_answers_is_not_a_server_that_takes_queries(pg_dir: str) -> None:
    port = _free_port()
    with socket.socket() as other:  # something accepts TCP there, and no PostgreSQL runs
        other.bind(("127.0.0.1", port))
        other.listen(1)
        assert not ready(pg_dir, port)


def test_an_unclean_stop_mid_write_comes_back_with_what_it_committed(pg_dir: str) -> None:
    pg = Postgres(pg_dir, port=_free_port())
    url = pg.start()
    engine = create_engine(normalize_url(url))
    try:
        with engine.begin() as c:
            c.execute(text("CREATE TABLE t (n int)"))
        committed = 0
        stop = threading.Event()

        def write() -> None:
            nonlocal committed
            try:
                with engine.connect() as c:
                    while not stop.is_set():
                        c.execute(text("INSERT INTO t SELECT generate_series(1, 200)"))
                        c.commit()
                        committed += 200
            except Exception:  # noqa: BLE001  (the server is killed under it)
                pass
        writer = threading.Thread(target=write)
        writer.start()
        while committed < 2000:
            threading.Event().wait(0.01)
        assert pg.proc is not None
        os.killpg(pg.proc.pid, signal.SIGKILL)  # the postmaster and every backend, no shutdown
        pg.proc.wait()
        stop.set()
        writer.join(30)
        engine.dispose()
        assert not ready(pg_dir, pg.port)
        again = Postgres(pg_dir, port=pg.port)
        assert again.start() == url  # back only once it takes queries: the first one works
        with engine.connect() as c:
            n = c.execute(text("SELECT count(*) FROM t")).scalar()
        assert n is not None and n >= committed - 200  # every committed batch, perhaps the one in flight
        log = open(pg_dir + ".log", errors="replace").read()
        assert "not properly shut down" in log or "interrupted" in log, log[-2000:]
        assert state(pg_dir + ".log")
        again.stop()
    finally:
        engine.dispose()
        pg.stop()
