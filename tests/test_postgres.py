"""The private PostgreSQL (dsec.control.cluster.postgres) that `dsec cluster up` runs when given no
database: ready means it takes queries, so a server killed uncleanly (mid-write, as by a
power loss) is waited for through its crash recovery, never hurried into errors, and comes
back with what it had committed. A real server, Debian's postgresql-15."""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import socket
import stat
import tempfile
import threading
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, text

from dsec.control.cluster.postgres import Postgres, ready, state
from dsec.shared.meta.db import normalize_url
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


def _ssl_in_use(url: str) -> bool:
    engine = create_engine(normalize_url(url))
    try:
        with engine.connect() as c:
            return bool(c.execute(text("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")).scalar())
    finally:
        engine.dispose()


def _plain(url: str) -> str:
    return url.split("?")[0] + "?sslmode=disable"


def test_the_network_reaches_it_over_tls_only_and_an_old_data_dir_is_upgraded(pg_dir: str) -> None:
    from sqlalchemy.exc import OperationalError

    from dsec.control.cluster import postgres

    ip = postgres.advertised("0.0.0.0")
    assert not ipaddress.ip_address(ip).is_loopback
    pg = Postgres(pg_dir, host=ip, port=_free_port())
    try:
        url = pg.start()
        assert "sslmode=require" in url and "channel_binding=require" in url
        assert _ssl_in_use(url)  # the server's own view: this session is encrypted
        with pytest.raises(OperationalError, match="no encryption|pg_hba"):
            _ssl_in_use(_plain(url))  # a client that does not do TLS is refused
        assert stat.S_IMODE(os.stat(os.path.join(pg_dir, postgres.KEY)).st_mode) == 0o600
        pg.stop()
        # a data dir as an older dsec left it: no certificate, its networks on `host` lines
        for name in (postgres.KEY, postgres.CERT):
            os.unlink(os.path.join(pg_dir, name))
        hba = os.path.join(pg_dir, "pg_hba.conf")
        with open(hba) as f:
            old = f.read().replace("hostssl    dsec", "host    dsec")
        with open(hba, "w") as f:
            f.write(old)
        url = pg.start()
        assert _ssl_in_use(url)
        with pytest.raises(OperationalError, match="no encryption|pg_hba"):
            _ssl_in_use(_plain(url))
    finally:
        pg.stop()
