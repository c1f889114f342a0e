"""A cluster's PostgreSQL that restarts while the cluster runs (an external ``--db``, as an
operator's managed database does for maintenance): the replica and the edge ride it out.
Meanwhile what needs the database is a typed 503 (``metadata_unavailable``), never a 500 or
a hang, and what does not (commands in running sandboxes) goes on; once the database is
back, the same processes serve every request again, with nothing restarted.

Real parts: Debian's PostgreSQL 15, one ``dsec edge serve`` whose layer catalog is in that
database, one ``dsec apiserver --db`` finding the edge in the cluster's registry."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from collections.abc import Iterator

import pytest
from conftest import SECRET, TOKEN, Service, _free_port, _seed_layers

import dsec
from dsec.control.cluster.postgres import Postgres
from dsec.shared.meta import open_db
from dsec.shared.meta.registry import Registry

pytestmark = pytest.mark.asyncio(loop_scope="module")


class Outage:
    def __init__(self, root: str) -> None:
        pg_root = tempfile.mkdtemp(prefix="dsec-pg-")  # the server runs as its own user
        os.chmod(pg_root, 0o711)
        self.pg_root = pg_root
        self.pg = Postgres(os.path.join(pg_root, "data"), port=_free_port())
        self.db = self.pg.start()
        secret_file = os.path.join(root, "cluster.key")
        with open(secret_file, "w") as f:
            f.write(SECRET + "\n")
        d = os.path.join(root, "n1")
        os.makedirs(d)
        _seed_layers(d)
        self.edge = Service([], os.path.join(d, "edge.log"), env={"DSEC_DB": self.db},
                            health_headers={"Authorization": f"Bearer {SECRET}"})
        self.edge.argv = ["edge", "serve", "--name", "n1", "--listen", f"127.0.0.1:{self.edge.port}",
                          "--secret-file", secret_file, "--data-dir", d]
        api_dir = os.path.join(root, "api")
        os.makedirs(api_dir)
        self.api = Service(["apiserver", "--db", self.db, "--secret-file", secret_file, "--data-dir", api_dir,
                            "--token", TOKEN], os.path.join(api_dir, "apiserver.log"))
        self.api.argv += ["--port", str(self.api.port)]

    def start(self) -> None:
        self.edge.start()
        engine = open_db(self.db)
        Registry(engine).register("n1", self.edge.url, "node-n1")
        engine.dispose()
        self.api.start()

    def stop(self) -> None:
        self.api.stop()
        self.edge.stop()
        self.pg.remove()
        shutil.rmtree(self.pg_root, ignore_errors=True)


@pytest.fixture(scope="module")
def outage(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outage]:
    o = Outage(str(tmp_path_factory.mktemp("db-outage")))
    try:
        o.start()
        yield o
    finally:
        o.stop()


async def test_the_database_restarts_under_a_running_cluster(outage: Outage) -> None:
    async with dsec.AsyncClient(url=outage.api.url, token=TOKEN) as admin:
        deadline = time.monotonic() + 60
        while True:  # the replica's watcher finds the registered edge
            try:
                sb = await admin.run_container(dsec.ContainerArgs(image="base/busybox", memory_limit_mb=64))
                break
            except (dsec.AdmissionRejected, dsec.EdgeUnavailable):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.5)
        runner = (await admin.create_token("outage", "runner")).token or ""
        try:
            outage.pg.stop()  # a fast shutdown: every connection of the replica and the edge is cut
            assert (await sb.exec(["echo", "still"])).stdout == "still\n"  # needs no database
            for attempt in (admin.run_container(dsec.ContainerArgs(image="base/busybox", memory_limit_mb=64)),
                            admin.create_token("outage", "builder")):
                t0 = time.monotonic()
                with pytest.raises(dsec.MetadataUnavailable) as e:
                    await attempt
                assert e.value.status == 503 and e.value.infra and time.monotonic() - t0 < 30
            async with dsec.AsyncClient(url=outage.api.url, token="dsec_" + "n" * 43) as unknown:
                with pytest.raises(dsec.MetadataUnavailable):  # a token never seen: cannot be looked up
                    await unknown.list()
            assert outage.api.proc is not None and outage.api.proc.poll() is None
            assert outage.edge.proc is not None and outage.edge.proc.poll() is None
            # a create made while the server is away, back within the create's ride-through
            # (dsec.shared.meta.db.ride_through: 10 s), is made (it failed at once: bench/chaos.py)
            late = asyncio.create_task(admin.run_container(dsec.ContainerArgs(image="base/busybox",
                                                                              memory_limit_mb=64)))
            await asyncio.sleep(2)
            assert not late.done()
            outage.pg.start()  # the same server back: the same processes serve again
            made = await late
            assert (await made.exec(["echo", "made"])).stdout == "made\n"
            await made.stop()
            deadline = time.monotonic() + 60
            while True:
                try:
                    again = await admin.run_container(dsec.ContainerArgs(image="base/busybox", memory_limit_mb=64))
                    break
                except dsec.MetadataUnavailable:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.5)
            await again.stop()
            async with dsec.AsyncClient(url=outage.api.url, token=runner) as r:
                mine = await r.run_container(dsec.ContainerArgs(image="base/busybox", memory_limit_mb=64))
                assert (await mine.exec(["echo", "back"])).stdout == "back\n"
                await mine.stop()
        finally:
            await sb.stop()
