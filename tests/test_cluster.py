"""Several edges on one machine behind one apiserver, as a cluster runs them: three edge
daemons with their own data dirs, run dirs, cgroup parents, subnets, nftables tables and
volumes, sharing one layer store on a real MooseFS (master, chunkserver, FUSE client
started here). Edge n3 refuses every sandbox (its memory-pressure limit is below any
pressure), so placement meets a 429 it must route around.

What one edge never could: placement across edges, re-placement after a refusal, lists
and job operations that span edges, a fork whose children land on other edges than the
snapshot's source, and one edge down while the others serve.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from aiohttp import web

import dsec
from dsec.node.storage.moosefs import MooseFS
from dsec.shared.wire.models import FnCallArgs, SandboxInfo
from tests.conftest import TOKEN, Cluster, leftovers, own_cluster

REFUSING = ["--admit-max-psi", "-1", "--pause-below-mb", str(1 << 20)]  # any pressure is too much


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    fs = MooseFS(str(tmp_path_factory.mktemp("cluster-moosefs")))
    fs.start()
    try:
        store = os.path.join(fs.mount, "dsec")
        os.makedirs(store)
        yield from own_cluster(tmp_path_factory, "cluster", ("n1", "n2", "n3"), store, {"n3": REFUSING})
    finally:
        fs.stop()


def _edge_of(sandbox_id: str) -> str:
    return sandbox_id.rsplit("-", 1)[0]


def _rejected(cluster: Cluster, edge: str) -> float:
    text = httpx.get(f"{cluster.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    m = re.search(rf'^dsec_admission_rejected_total{{edge="{edge}"}} (\S+)', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_edges_on_one_machine_keep_apart(cluster: Cluster) -> None:
    with dsec.Client(url=cluster.url, token=TOKEN) as c:
        nodes = {n.edge: n for n in c.nodes()}
    assert set(nodes) == {"n1", "n2", "n3"} and all(n.healthy for n in nodes.values())
    subnets = {n.network.split(",")[0] for n in nodes.values()}
    assert len(subnets) == 3, subnets  # a /19 each
    tables = os.popen("nft list tables").read()
    assert len(re.findall(r"^table \w+ dsec", tables, re.M)) >= 3, tables


async def test_placement_spreads_and_routes_around_a_refusing_edge(cluster: Cluster) -> None:
    before = _rejected(cluster, "n3")
    async with dsec.AsyncClient(url=cluster.url, token=TOKEN) as c:
        sbs = await asyncio.gather(*(c.run_container(dsec.ContainerArgs(image="base/busybox", job="spread"))
                                     for _ in range(10)))
        try:
            edges = [_edge_of(s.sandbox_id) for s in sbs]
            assert set(edges) == {"n1", "n2"}, edges  # both serving edges, never the refusing one
            assert _rejected(cluster, "n3") > before  # n3 was tried and said 429; placement went on
            for s in sbs:
                assert (await s.exec("echo ok")).stdout == "ok\n"
            listed = await c.list(job="spread")  # one list across every edge
            assert sorted(i.sandbox_id for i in listed) == sorted(s.sandbox_id for s in sbs)
            # the console's query: each remote edge answers for its own, the apiserver merges the pages
            async with httpx.AsyncClient(base_url=cluster.url, headers={"Authorization": f"Bearer {TOKEN}"}) as h:
                pages = [(await h.get("/v1/console/sandboxes", params={
                    "job": "spread", "sort": "created", "limit": 4, "offset": o, "usage": "true"})).json()
                    for o in (0, 4, 8)]
                fleet = (await h.get("/v1/console/fleet")).json()
                fncall = (await h.get("/v1/console/fncall")).json()
            assert [p["total"] for p in pages] == [10, 10, 10] and pages[0]["states"] == {"running": 10}
            paged = [i for p in pages for i in p["items"]]
            assert [i["sandbox_id"] for i in paged] == [i.sandbox_id for i in sorted(listed, key=lambda i: (
                i.created_at, i.sandbox_id))]
            assert {i["edge"] for i in paged} == {"n1", "n2"} and all(i["usage"] is not None for i in paged)
            assert {n["edge"] for n in fleet["nodes"]} == {"n1", "n2", "n3"}
            assert all(n["host"]["memory_total_mb"] > 0 for n in fleet["nodes"])
            assert sorted(f["edge"] for f in fncall) == ["n1", "n2", "n3"]
            paused = await c.pause_many(job="spread")
            assert len(paused) == 10 and all(i.state == "paused" for i in paused)
            resumed = await c.resume_many(job="spread")
            assert len(resumed) == 10 and all(i.state == "running" for i in resumed)
        finally:
            stopped = await c.stop_many(job="spread")
        assert len(stopped) == 10 and all(i.state == "stopped" for i in stopped)
        assert all(i.state == "stopped" for i in await c.list(job="spread"))
    for s in sbs:
        assert leftovers(cluster, s.sandbox_id) == []


async def test_fork_lands_across_edges(cluster: Cluster) -> None:
    async with dsec.AsyncClient(url=cluster.url, token=TOKEN) as c:
        src = await c.run_container(dsec.ContainerArgs(image="base/busybox"))
        kids: list[dsec.AsyncSandbox] = []
        try:
            await src.exec("mkdir -p /work && echo from-$(hostname) > /work/origin")
            snap = await src.pack_diff(f"ws/cluster-fork-{src.sandbox_id}:v1")
            kids = await c.fork(snap, n=6)
            assert {_edge_of(k.sandbox_id) for k in kids} == {"n1", "n2"}  # the snapshot is on the shared store
            for k in kids:
                assert (await k.exec("cat /work/origin")).stdout == f"from-{src.sandbox_id}\n"
        finally:
            for sb in [src, *kids]:
                await sb.stop()


async def test_one_edge_down_the_others_serve(cluster: Cluster) -> None:
    async with dsec.AsyncClient(url=cluster.url, token=TOKEN) as c:
        sbs = await asyncio.gather(*(c.run_container(dsec.ContainerArgs(image="base/busybox", job="down"))
                                     for _ in range(4)))
        on2 = [s for s in sbs if _edge_of(s.sandbox_id) == "n2"]
        assert on2, "placement put nothing on n2"
        cluster.edges["n2"].stop()  # the daemon goes; its sandboxes run on
        try:
            with pytest.raises(dsec.EdgeUnavailable, match="n2"):
                await on2[0].exec("true")
            r = await c._request("GET", "/v1/sandboxes", params={"job": "down"})
            listed = [i["sandbox_id"] for i in r.json()]
            assert r.headers["x-dsec-unreachable-edges"] == "n2"
            assert sorted(listed) == sorted(s.sandbox_id for s in sbs if s not in on2)
            with pytest.raises(dsec.EdgeUnavailable, match="n2"):  # a job operation says what it missed
                await c.pause_many(job="down")
            for _ in range(50):  # the watcher marks n2 unhealthy: new sandboxes go elsewhere
                if not next(n for n in await c.nodes() if n.edge == "n2").healthy:
                    break
                await asyncio.sleep(0.1)
            fresh = [await c.run_container(dsec.ContainerArgs(image="base/busybox", job="down")) for _ in range(3)]
            assert {_edge_of(s.sandbox_id) for s in fresh} == {"n1"}
            sbs += fresh
        finally:
            cluster.edges["n2"].start()  # back: it re-adopts what ran on while it was away
        for s in on2:
            assert (await s.exec("echo back")).stdout == "back\n"
        await c.resume_many(job="down")
        stopped = await c.stop_many(job="down")
        assert sorted(i.sandbox_id for i in stopped) == sorted(s.sandbox_id for s in sbs)


async def test_a_call_that_never_reached_an_edge_says_so() -> None:
    """What lets a FnCall placed on an edge just lost go to another one without ever running
    twice (it failed outright: bench/chaos.py): a call to an edge no connection could be made
    to was surely not sent; one to an edge that took the connection and dropped it may
    have been."""
    from dsec.node.edge.remote.client import remote_edge

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # bound, never listening: refused
    edge = remote_edge("gone", f"http://127.0.0.1:{closed}", "secret")
    try:
        with pytest.raises(dsec.EdgeUnavailable) as refused:
            await edge.fncall(FnCallArgs(language="python", code="print(1)"))
        assert refused.value.sent is False, refused.value
    finally:
        await edge.close()

    # an edge that takes the call on its WebSocket, then goes away without an answer
    async def calls(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.receive()
        await ws.close()
        return ws
    app = web.Application()
    app.router.add_get("/v1/calls", calls)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    edge = remote_edge("flaky", f"http://127.0.0.1:{port}", "secret")
    try:
        with pytest.raises(dsec.EdgeUnavailable) as dropped:
            await edge.fncall(FnCallArgs(language="python", code="print(1)"))
        assert dropped.value.sent is True, dropped.value
    finally:
        await edge.close()
        await runner.cleanup()


async def test_a_job_operation_misses_only_the_down_edges_that_hold_its_sandboxes(tmp_path: Path) -> None:
    """By the cluster's sandbox index (a real database): a down edge that holds none of a
    job's sandboxes does not fail the job's stop (it failed whole while any edge was down:
    bench/chaos.py); one that holds some still does."""
    from types import SimpleNamespace

    from dsec.control.apiserver.core import Apiserver
    from dsec.shared.meta import open_db, sqlite_url
    from dsec.shared.meta.registry import Registry

    registry = Registry(open_db(sqlite_url(str(tmp_path))))
    now = time.time()
    for sid, edge, job, labels in [("n1-aaaaaaaaaaaa", "n1", "a", {"k": "v"}), ("n2-bbbbbbbbbbbb", "n2", "b", {}),
                                   ("n3-cccccccccccc", "n3", "a", {"k": "w"})]:
        registry.index_put(SandboxInfo(sandbox_id=sid, edge=edge, backend="container", state="running",
                                       image="base/busybox:latest", layers=[], created_at=now, last_active_at=now,
                                       job=job, labels=labels, memory_limit_mb=64, cpu_cores_limit=1), "p")
    api = SimpleNamespace(index=registry)
    holding = Apiserver._holding
    assert await holding(api, ["n1", "n2", "n3"], "a", {}) == ["n1", "n3"]  # type: ignore[arg-type]
    assert await holding(api, ["n2", "n3"], "a", {"k": "v"}) == []  # type: ignore[arg-type]
    assert await holding(api, ["n1", "n2"], None, {"k": "v"}) == ["n1"]  # type: ignore[arg-type]
    registry.index_drop(["n1-aaaaaaaaaaaa"])
    assert await holding(api, ["n1", "n2"], "a", {}) == []  # type: ignore[arg-type]
