"""One client, several apiservers: two real apiserver processes (A and B) in front of one
real edge daemon, and, where a replica must fail in one exact way, a tiny TCP server that
reads a request in full and then hangs up without answering (a replica that died after
the request reached it) or answers a bare 503 (a proxy in front of a replica that is gone).

What is checked: reads and stops move to a live replica whatever happened; creates and
execs move only when they provably never left (connection refused), and are otherwise
reported as of unknown outcome, never repeated; every URL down is a quick typed error;
the CLI takes the same URL list.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

import dsec
from tests.conftest import TOKEN, Cluster, Service, _free_port, own_cluster

JOB = "failover"
ARGS = dsec.ContainerArgs(image="base/busybox", job=JOB, memory_limit_mb=64, cpu_cores_limit=0.25)


def _replica(cluster: Cluster, data_dir: str) -> Service:
    """Another apiserver in front of the cluster's edges, as the cluster's own is started
    (same admin token and cluster secret), with a data dir of its own: its tokens and
    metadata are SQLite there, not meant for two processes."""
    b = Service([], os.path.join(data_dir, "apiserver.log"))
    argv = list(cluster.api.argv)
    argv[argv.index("--data-dir") + 1] = data_dir
    argv[argv.index("--port") + 1] = str(b.port)
    b.argv = argv
    return b


def _503(content_type: str, body: bytes) -> bytes:
    return (f"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


BARE_503 = _503("text/html", b"<h1>no way</h1>")  # a proxy's: its replica is gone
DSEC_503 = _503("application/json", b'{"error": "edge_unavailable", "message": "edge n9 is out"}')


class FakeReplica:
    """Reads each request in full (head and body), records its request line, then sends
    ``answer`` (none: it just hangs up) and closes the connection."""

    def __init__(self, answer: bytes = b"") -> None:
        self.requests: list[str] = []
        seen = self.requests

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                sock: socket.socket = self.request
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = sock.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                head, _, body = data.partition(b"\r\n\r\n")
                m = re.search(rb"(?im)^content-length:\s*(\d+)", head)
                while m and len(body) < int(m.group(1)):
                    chunk = sock.recv(65536)
                    if not chunk:
                        return
                    body += chunk
                seen.append(head.split(b"\r\n", 1)[0].decode())
                sock.sendall(answer)

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from own_cluster(tmp_path_factory, "failover")


@pytest.fixture(scope="module")
def replicas(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, Service]]:
    """(A, B): the cluster's apiserver and a second one. A may be killed by a test; the
    sandboxes left are stopped through whichever answers."""
    b = _replica(cluster, str(tmp_path_factory.mktemp("failover-b")))
    b.start()
    try:
        yield cluster.api, b
    finally:
        try:
            with dsec.Client(url=[cluster.api.url, b.url], token=TOKEN) as c:
                for info in c.list():
                    if info.state.value != "stopped":
                        c.connect(info.sandbox_id).stop()
        finally:
            b.stop()


@pytest.fixture(scope="module")
def hangup() -> Iterator[FakeReplica]:
    h = FakeReplica()
    yield h
    h.close()


async def _ids(c: dsec.AsyncClient) -> set[str]:
    return {i.sandbox_id for i in await c.list(job=JOB) if i.state.value != "stopped"}


async def test_a_replica_killed_mid_burst(replicas: tuple[Service, Service]) -> None:
    a, b = replicas
    async with dsec.AsyncClient(url=f"{a.url},{b.url}", token=TOKEN) as c:
        assert c.urls == (a.url, b.url) and c.url == a.url
        made = [await c.run_container(ARGS) for _ in range(2)]
        try:
            assert c.url == a.url  # the first URL, while it answers
            killed, done = asyncio.Event(), asyncio.Event()
            # (started after the kill, what, error or None)
            calls: list[tuple[bool, str, BaseException | None]] = []

            async def worker(k: int) -> None:
                while not done.is_set():
                    after, what = killed.is_set(), ("exec" if k % 2 else "list")
                    try:
                        if what == "exec":
                            sb = made[k % len(made)]
                            assert (await sb.exec(f"echo {k}")).stdout == f"{k}\n"
                        else:
                            assert {s.sandbox_id for s in made} <= await _ids(c)
                        calls.append((after, what, None))
                    except dsec.DsecError as e:
                        calls.append((after, what, e))

            workers = [asyncio.create_task(worker(k)) for k in range(8)]
            await asyncio.sleep(0.5)
            await asyncio.to_thread(a.stop, True)  # SIGKILL while calls are in flight
            # the loop reads the hang-ups of A's idle pooled connections: a request sent on
            # one before that could have reached A as far as anyone can tell
            await asyncio.sleep(0.05)
            killed.set()
            await asyncio.sleep(1.0)
            done.set()
            await asyncio.wait_for(asyncio.gather(*workers), 30)

            before = [(w, e) for after, w, e in calls if not after]
            later = [(w, e) for after, w, e in calls if after]
            assert len(before) > 20 and len(later) > 20, (len(before), len(later))
            assert [e for _, e in later if e] == []  # refused by A = never sent: all went to B
            assert [e for w, e in before if e and w == "list"] == []  # reads in flight were retried
            for _, e in before:  # an exec A had when it died: unknown outcome, said so, not repeated
                assert e is None or (isinstance(e, dsec.EdgeUnavailable) and "not repeated" in e.message), e
            assert c.url == b.url

            made += [await c.run_container(ARGS) for _ in range(2)]  # creates go to B
            assert await _ids(c) == {s.sandbox_id for s in made}  # nothing lost
        finally:
            stopped = [(await sb.stop()).state for sb in made]
        assert stopped == ["stopped"] * len(made)
        assert (await made[0].stop()).state == "stopped"  # a second stop answers the same: safe to retry


async def test_hang_up_after_sending(replicas: tuple[Service, Service], hangup: FakeReplica) -> None:
    """A replica that hung up after the request reached it: a create or an exec is not
    sent again, and the other replica shows it never ran there."""
    _, b = replicas
    async with dsec.AsyncClient(url=b.url, token=TOKEN) as direct:
        sb = await direct.run_container(ARGS)
        try:
            before = await _ids(direct)
            async with dsec.AsyncClient(url=[hangup.url, b.url], token=TOKEN) as c:
                with pytest.raises(dsec.EdgeUnavailable, match="may or may not have been carried out") as e:
                    await c.run_container(ARGS)
                assert e.value.operation == "create" and hangup.url in e.value.message
                assert "POST /v1/sandboxes HTTP/1.1" in hangup.requests  # it was sent
            assert await _ids(direct) == before  # ... and not again to B

            async with dsec.AsyncClient(url=[hangup.url, b.url], token=TOKEN) as c:
                with pytest.raises(dsec.EdgeUnavailable, match="not repeated") as e:
                    await dsec.AsyncSandbox(c, sb.info).exec("touch /tmp/ran")
                assert e.value.sandbox_id == sb.sandbox_id and e.value.operation == "exec"
            assert f"POST /v1/sandboxes/{sb.sandbox_id}/exec HTTP/1.1" in hangup.requests
            assert (await sb.exec("test -e /tmp/ran")).exit_code == 1
        finally:
            await sb.stop()


async def test_keyed_exec_retried_past_a_hang_up(replicas: tuple[Service, Service], hangup: FakeReplica) -> None:
    """An exec with a command-log key is sent again to the next replica after a hang-up: the
    edge runs it once whoever relays it (here the hung-up replica never passed it on)."""
    _, b = replicas
    async with dsec.AsyncClient(url=b.url, token=TOKEN) as direct:
        sb = await direct.run_container(ARGS)
        try:
            async with dsec.AsyncClient(url=[hangup.url, b.url], token=TOKEN) as c:
                r = await dsec.AsyncSandbox(c, sb.info).exec("echo x >> /tmp/ran; cat /tmp/ran", key="failover/1")
            assert f"POST /v1/sandboxes/{sb.sandbox_id}/exec HTTP/1.1" in hangup.requests
            assert r.exit_code == 0 and r.stdout == "x\n" and not r.replayed
            again = await sb.exec("echo x >> /tmp/ran; cat /tmp/ran", key="failover/1")
            assert again.replayed and again.stdout == "x\n"
            assert (await sb.exec("cat /tmp/ran")).stdout == "x\n"  # ran once
        finally:
            await sb.stop()


async def test_reads_and_stops_retried_past_a_hang_up(replicas: tuple[Service, Service], hangup: FakeReplica) -> None:
    _, b = replicas
    async with dsec.AsyncClient(url=b.url, token=TOKEN) as direct:
        sb = await direct.run_container(ARGS)
        try:
            async with dsec.AsyncClient(url=[hangup.url, b.url], token=TOKEN) as c:
                assert await _ids(c) == await _ids(direct)
                assert c.url == b.url
            assert "GET /v1/sandboxes?job=failover HTTP/1.1" in hangup.requests

            async with dsec.AsyncClient(url=[hangup.url, b.url], token=TOKEN) as c:
                assert (await dsec.AsyncSandbox(c, sb.info).stop()).state == "stopped"
            assert f"DELETE /v1/sandboxes/{sb.sandbox_id} HTTP/1.1" in hangup.requests
        finally:
            await sb.stop()


async def test_every_replica_down_is_a_quick_typed_error() -> None:
    dead = [f"http://127.0.0.1:{_free_port()}", f"http://127.0.0.1:{_free_port()}"]
    async with dsec.AsyncClient(url=dead, token=TOKEN) as c:
        for call, op in ((c.list, "list"), (lambda: c.run_container(ARGS), "create")):
            t0 = time.monotonic()
            with pytest.raises(dsec.EdgeUnavailable, match="no dsec apiserver answered") as e:
                await call()
            assert time.monotonic() - t0 < 2
            assert e.value.operation == op and all(f"{u} (connection refused)" in e.value.message for u in dead)
    with dsec.Client(url=",".join(dead), token=TOKEN) as sync, pytest.raises(dsec.EdgeUnavailable):
        sync.list()


def test_cli_with_the_first_replica_down(replicas: tuple[Service, Service]) -> None:
    a, b = replicas
    if a.proc is not None:  # run on its own, this test kills A itself
        a.stop(crash=True)
    urls = f"{a.url},{b.url}"
    cli = [sys.executable, "-m", "dsec.client.cli.main"]
    with dsec.Client(url=b.url, token=TOKEN) as c:
        sb = c.run_container(ARGS)
        try:
            out = subprocess.run([*cli, "ps", "--json", "--job", JOB, "--url", urls, "--token", TOKEN],
                                 capture_output=True, text=True, timeout=30)
            assert out.returncode == 0, out.stderr
            assert sb.sandbox_id in {row["sandbox_id"] for row in json.loads(out.stdout)}
            # $DSEC_URL takes the list too; a streamed exec is placed like any request
            out = subprocess.run([*cli, "exec", "--token", TOKEN, sb.sandbox_id, "echo", "via-b"],
                                 capture_output=True, text=True, timeout=30, env={**os.environ, "DSEC_URL": urls})
            assert (out.returncode, out.stdout) == (0, "via-b\n"), out.stderr
        finally:
            sb.stop()


async def test_bare_503_is_a_gone_replica_dsec_503_an_answer(replicas: tuple[Service, Service]) -> None:
    _, b = replicas
    bare, dsec503 = FakeReplica(BARE_503), FakeReplica(DSEC_503)
    try:
        async with dsec.AsyncClient(url=b.url, token=TOKEN) as direct:
            sb = await direct.run_container(ARGS)
            try:
                before = await _ids(direct)
                async with dsec.AsyncClient(url=[bare.url, b.url], token=TOKEN) as c:
                    # through its port route a 503 is the in-sandbox server's to give
                    assert (await dsec.AsyncSandbox(c, sb.info).http(8080, "/")).status_code == 503
                    with pytest.raises(dsec.EdgeUnavailable, match="bare HTTP 503"):
                        await c.run_container(ARGS)
                    assert await _ids(direct) == before  # not repeated on B
                async with dsec.AsyncClient(url=[bare.url, b.url], token=TOKEN) as c:
                    assert await _ids(c) == before  # a read moves on to B
                    assert c.url == b.url
                assert [r.split()[0] for r in bare.requests] == ["GET", "POST", "GET"]
                async with dsec.AsyncClient(url=[dsec503.url, b.url], token=TOKEN) as c:
                    with pytest.raises(dsec.EdgeUnavailable, match="edge n9 is out"):  # every replica would say so
                        await c.list()
                    assert c.url == dsec503.url
            finally:
                await sb.stop()
    finally:
        bare.close()
        dsec503.close()
