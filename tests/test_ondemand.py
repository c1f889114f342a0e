"""Images on demand from a shared store: a real MooseFS cluster (master, chunkserver,
FUSE client) started by the tests, dsec nodes pointed at a directory on it, layers read
chunk by chunk through the node's lazy reader. Nothing is mocked; a "stalled store" is
the real chunkserver stopped with SIGSTOP."""

from __future__ import annotations

import asyncio
import glob
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

import dsec
from dsec.node.layers.store import LayerStore
from dsec.node.storage.lazyfs import LazyClient
from dsec.node.storage.moosefs import MooseFS
from dsec.shared.wire.models import LayerFetchStats
from tests.conftest import TOKEN, Platform

MiB = 1 << 20


@pytest.fixture(scope="module")
def mfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooseFS]:
    fs = MooseFS(str(tmp_path_factory.mktemp("moosefs")))
    fs.start()
    yield fs
    fs.stop()


def _tree(root: str, sub: str, files: int, seed: int) -> dict[str, str]:
    """``files`` files of 4 MiB (plus change, so they do not align with chunks); path -> sha256."""
    os.makedirs(os.path.join(root, sub))
    sums = {}
    rng = random.Random(seed)
    for i in range(files):
        data = rng.randbytes(4 * MiB + 4096 * i + 100)
        with open(os.path.join(root, sub, f"f{i}"), "wb") as f:
            f.write(data)
        sums[f"/{sub}/f{i}"] = hashlib.sha256(data).hexdigest()
    return sums


@pytest.fixture(scope="module")
def shared(mfs: MooseFS, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, str]]:
    store_root = os.path.join(mfs.mount, "dsec")
    os.makedirs(store_root)
    store = LayerStore(store_root, "sharedfs")
    sums: dict[str, str] = {}
    for ref, sub, seed in (("ws/od-big:v1", "od", 1), ("ws/od-rec:v1", "rec", 2), ("ws/od-fault:v1", "fault", 3),
                          ("ws/od-unreach:v1", "unreach", 4)):
        src = str(tmp_path_factory.mktemp(sub))
        sums.update(_tree(src, sub, 6, seed))
        store.import_dir(src, ref)
    # the test process must hold no file on MooseFS once it is stopped: a later fork would
    # hang closing it
    store.close()
    return store_root, sums


@pytest.fixture(scope="module")
def node(shared: tuple[str, dict[str, str]], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    data_dir = str(tmp_path_factory.mktemp("node1"))
    p = Platform(data_dir, ["--store", shared[0], "--fetch-timeout", "2", "--chunk-cache-mb", "512"])
    p.start()
    yield p
    with dsec.Client(url=p.url, token=TOKEN) as c:
        for info in c.list():
            c.connect(info.sandbox_id).stop()
    p.stop()
    # a clean stop with no sandboxes left releases the reader and every layer mount
    with open("/proc/self/mountinfo") as f:
        assert not [line for line in f if data_dir in line]
    assert not _reader_pids(data_dir)


def _reader_pids(data_dir: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"dsec.node.storage.lazyfs .*{data_dir}"], capture_output=True,
                         text=True).stdout
    return [int(x) for x in out.split()]


@pytest.fixture
async def client(node: Platform) -> AsyncIterator[dsec.AsyncClient]:
    async with dsec.AsyncClient(url=node.url, token=TOKEN) as c:
        yield c


def _lazy(node: Platform) -> LazyClient:
    tag = hashlib.sha1(os.path.abspath(node.data_dir).encode()).hexdigest()[:8]
    return LazyClient(f"/run/dsec/{tag}-edge0/lazyfs.sock")


async def _blob(client: dsec.AsyncClient, ref: str) -> LayerFetchStats:
    layer = await client.layer(ref)
    (data,) = layer.data.values()
    for b in (await client.storage_stats())[0].blobs:
        if b.data == data:
            return b
    return LayerFetchStats(data=data)


async def _settled(client: dsec.AsyncClient, ref: str) -> LayerFetchStats:
    await asyncio.sleep(1.2)  # the edge refreshes the reader's counters every second
    return await _blob(client, ref)


async def _busybox(client: dsec.AsyncClient, layer: str, record_access: bool = False) -> dsec.AsyncSandbox:
    return await client.run_container(dsec.ContainerArgs(image="base/busybox", layers=[layer], memory_limit_mb=64,
                                                         record_access=record_access))


async def _sum(sb: dsec.AsyncSandbox, path: str) -> str:
    r = await sb.exec(["sha256sum", path], timeout=60)
    assert r.exit_code == 0, r.stderr
    return r.stdout.split()[0]


async def test_layers_are_metadata_plus_data_and_read_on_demand(
        node: Platform, client: dsec.AsyncClient, shared: tuple[str, dict[str, str]]) -> None:
    store_root, sums = shared
    layer = await client.layer("ws/od-big:v1")
    (meta, data), = layer.data.items()
    blobs = os.path.join(store_root, "blobs", "sha256")
    meta_size, data_size = (os.path.getsize(os.path.join(blobs, n)) for n in (f"{meta}.erofs", f"{data}.data"))
    assert data_size > 24 * MiB and meta_size < data_size / 100

    sb = await _busybox(client, "ws/od-big:v1")
    try:
        # the node holds a local copy of the metadata only; data comes through the lazy reader
        assert os.path.exists(os.path.join(node.data_dir, "node", "meta", f"{meta}.erofs"))
        assert not os.path.exists(os.path.join(node.data_dir, "node", "full", f"{data}.data"))
        with open("/proc/self/mountinfo") as f:
            lazy = [line for line in f if os.path.join(node.data_dir, "node", "lazy") in line]
        assert lazy and "fuse" in lazy[0]

        assert await _sum(sb, "/od/f1") == sums["/od/f1"]
        st = await _settled(client, "ws/od-big:v1")
        # one 4 MiB file: its chunks and no more, not the 24 MiB blob
        assert 4 * MiB <= st.remote_bytes <= 6 * MiB, st
        assert st.misses == st.remote_chunks and st.errors == 0

        other = await _busybox(client, "ws/od-big:v1")
        assert await _sum(other, "/od/f1") == sums["/od/f1"]
        assert await _sum(other, "/od/f3") == sums["/od/f3"]
        st2 = await _settled(client, "ws/od-big:v1")
        assert st.remote_bytes < st2.remote_bytes <= st.remote_bytes + 6 * MiB  # f1 was not fetched again
        await other.stop()
    finally:
        await sb.stop()


async def test_corrupt_cached_chunk_is_refetched_not_served(
        node: Platform, client: dsec.AsyncClient, shared: tuple[str, dict[str, str]]) -> None:
    sums = shared[1]
    sb = await _busybox(client, "ws/od-big:v1")
    try:
        assert await _sum(sb, "/od/f2") == sums["/od/f2"]
        before = (await client.storage_stats())[0]
        cached = glob.glob(os.path.join(node.data_dir, "node", "cache", "*", "*"))
        assert cached
        for path in cached:  # flip bytes in every chunk on disk, then make the reader go to disk again
            with open(path, "r+b") as f:
                f.seek(1000)
                f.write(b"\xde\xad\xbe\xef")
        await _lazy(node).call("drop_cache", memory_only=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        assert await _sum(sb, "/od/f2") == sums["/od/f2"]
        await asyncio.sleep(1.2)
        after = (await client.storage_stats())[0]
        assert after.cache_corrupt > before.cache_corrupt
        assert sum(b.remote_bytes for b in after.blobs) > sum(b.remote_bytes for b in before.blobs)
    finally:
        await sb.stop()


async def test_a_project_token_gets_the_node_figures_but_no_layer_names(
        node: Platform, client: dsec.AsyncClient, shared: tuple[str, dict[str, str]]) -> None:
    """/v1/storage names the blobs (and layers) every project runs: a project's token gets
    the node's cache figures only."""
    sb = await _busybox(client, "ws/od-big:v1")
    try:
        assert await _sum(sb, "/od/f1") == shared[1]["/od/f1"]
        made = await client.create_token("od-reader", "runner")
        assert made.token is not None
        async with dsec.AsyncClient(url=node.url, token=made.token) as project:
            (mine,) = await project.storage_stats()
        (full,) = await client.storage_stats()
        assert any("ws/od-big:v1" in b.layers for b in full.blobs)
        assert mine.blobs == [] and mine.cache_max_bytes == full.cache_max_bytes and mine.mode == full.mode
    finally:
        await sb.stop()


async def test_recorded_access_list_is_prefetched(
        node: Platform, client: dsec.AsyncClient, shared: tuple[str, dict[str, str]]) -> None:
    sums = shared[1]
    rec = await _busybox(client, "ws/od-rec:v1", record_access=True)
    assert await _sum(rec, "/rec/f2") == sums["/rec/f2"]
    assert await _sum(rec, "/rec/f4") == sums["/rec/f4"]
    await rec.stop()  # saves the access list
    layer = await client.layer("ws/od-rec:v1")
    assert 8 <= layer.prefetch_chunks <= 12, layer  # two 4 MiB files, 1 MiB chunks

    # cold node: layer unmounted, chunk cache and page cache emptied
    await client.gc_layers()
    await _lazy(node).call("drop_cache")
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")
    sb = await _busybox(client, "ws/od-rec:v1")
    try:
        assert any(e.kind == "prefetch" for e in await sb.events())
        deadline = time.time() + 20
        while (st := await _blob(client, "ws/od-rec:v1")).prefetched < layer.prefetch_chunks:
            assert time.time() < deadline, st
            await asyncio.sleep(0.3)
        misses = st.misses
        assert await _sum(sb, "/rec/f2") == sums["/rec/f2"]
        assert await _sum(sb, "/rec/f4") == sums["/rec/f4"]
        after = await _settled(client, "ws/od-rec:v1")
        assert after.misses == misses  # everything the task read was already on the node
        assert after.hits > st.hits
        with pytest.raises(dsec.InvalidRequest):
            await sb.save_access_list()  # not a recording sandbox
    finally:
        await sb.stop()


async def test_stalled_store_gives_eio_in_bounded_time_then_recovers(
        node: Platform, client: dsec.AsyncClient, shared: tuple[str, dict[str, str]], mfs: MooseFS) -> None:
    sums = shared[1]
    sb = await _busybox(client, "ws/od-fault:v1")
    try:
        mfs.stall_chunkserver()
        try:
            t0 = time.monotonic()
            reading = asyncio.create_task(sb.exec(["cat", "/fault/f3"], timeout=120))
            await asyncio.sleep(0.5)
            alive = await sb.exec(["echo", "alive"], timeout=10)  # the sandbox and the edge still answer
            assert alive.stdout == "alive\n"
            assert (await client.nodes())[0].edge == "edge0"
            r = await reading
            elapsed = time.monotonic() - t0
            assert r.exit_code != 0 and "Input/output error" in r.stderr, r
            assert elapsed < 10, elapsed  # 2 s fetch timeout, then short graces for the kernel's retries
            deadline = time.time() + 5
            while not [e for e in await sb.events() if e.kind == "storage_error"]:
                assert time.time() < deadline, await sb.events()
                await asyncio.sleep(0.2)
        finally:
            mfs.resume_chunkserver()
        deadline = time.time() + 60
        while True:  # the store is back: the same read works, nothing restarted
            r = await sb.exec(["sha256sum", "/fault/f3"], timeout=60)
            if r.exit_code == 0 or time.time() > deadline:
                break
            await asyncio.sleep(1)
        assert r.stdout.split()[0] == sums["/fault/f3"], r
        assert (await _blob(client, "ws/od-fault:v1")).errors >= 1
    finally:
        await sb.stop()


async def test_store_unreachable_during_create_fails_cleanly(node: Platform, client: dsec.AsyncClient,
                                                             mfs: MooseFS) -> None:
    """A create whose layer is not on the node yet, while the store does not answer: it
    fails within the fetch bounds with a clear error and leaves nothing; the sandboxes
    already running keep answering; once the store is back the same create works."""
    bystander = await client.run_container(dsec.ContainerArgs(image="base/busybox", memory_limit_mb=64))
    try:
        before = {i.sandbox_id for i in await client.list()}
        # nothing of the store in the page cache (as after a busy day): the catalog too has to
        # come from the stalled store, which the event loop must never wait for
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        mfs.stall_chunkserver()
        try:
            creating = asyncio.ensure_future(_busybox(client, "ws/od-unreach:v1"))
            await asyncio.sleep(0.5)
            assert (await bystander.exec(["echo", "alive"], timeout=10)).stdout == "alive\n"
            with pytest.raises(dsec.DsecError) as e:
                await asyncio.wait_for(creating, 60)
            assert "shared layer store did not deliver" in str(e.value), e.value
            assert {i.sandbox_id for i in await client.list()} == before  # nothing half built
        finally:
            mfs.resume_chunkserver()
        deadline = time.time() + 60
        while True:
            try:
                sb = await _busybox(client, "ws/od-unreach:v1")
                break
            except dsec.DsecError:
                assert time.time() < deadline
                await asyncio.sleep(1)
        while (await sb.exec("cat /unreach/* > /dev/null", timeout=60)).exit_code != 0:  # reads recover too
            assert time.time() < deadline
            await asyncio.sleep(1)
        await sb.stop()
    finally:
        await bystander.stop()


async def test_writes_stay_on_the_node(node: Platform, client: dsec.AsyncClient,
                                       shared: tuple[str, dict[str, str]]) -> None:
    store_root = shared[0]
    blobs = os.path.join(store_root, "blobs", "sha256")

    def listing() -> dict[str, tuple[int, float]]:
        return {n: (os.stat(os.path.join(blobs, n)).st_size, os.stat(os.path.join(blobs, n)).st_mtime)
                for n in os.listdir(blobs)}

    before = listing()
    sb = await _busybox(client, "ws/od-big:v1")
    try:
        r = await sb.exec(["sh", "-c", "dd if=/dev/zero of=/od/new bs=1M count=8 && echo x >> /od/f0 && rm /od/f5"])
        assert r.exit_code == 0, r.stderr
        assert listing() == before
    finally:
        await sb.stop()


async def test_reader_survives_edge_restart(node: Platform, client: dsec.AsyncClient,
                                            shared: tuple[str, dict[str, str]]) -> None:
    sums = shared[1]
    sb = await _busybox(client, "ws/od-big:v1")
    try:
        pids = _reader_pids(node.data_dir)
        assert len(pids) == 1
        node.restart(crash=True)
        assert _reader_pids(node.data_dir) == pids
        async with dsec.AsyncClient(url=node.url, token=TOKEN) as fresh:
            again = await fresh.connect(sb.sandbox_id)
            # a file not read before: fetched through the same reader
            assert await _sum(again, "/od/f4") == sums["/od/f4"]
            await again.stop()
    finally:
        await sb.stop()


async def test_new_sandboxes_work_after_the_reader_dies(node: Platform, client: dsec.AsyncClient,
                                                        shared: tuple[str, dict[str, str]]) -> None:
    sums = shared[1]
    (old,) = _reader_pids(node.data_dir)
    os.kill(old, signal.SIGKILL)
    deadline = time.time() + 10
    while os.path.exists(f"/proc/{old}"):
        assert time.time() < deadline
        await asyncio.sleep(0.05)
    sb = await _busybox(client, "ws/od-big:v1")  # mounts afresh through a new reader
    try:
        assert await _sum(sb, "/od/f5") == sums["/od/f5"]
        assert await _sum(sb, "/od/f1") == sums["/od/f1"]  # from the chunk cache the dead reader filled
        (new,) = _reader_pids(node.data_dir)
        assert new != old
    finally:
        await sb.stop()


def test_layer_stats_cli(node: Platform) -> None:
    out = subprocess.run([sys.executable, "-m", "dsec.client.cli.main", "layer", "stats", "--json", "--url", node.url,
                          "--token", TOKEN], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    (edge,) = json.loads(out.stdout)
    assert edge["backend"] == "sharedfs" and edge["mode"] == "ondemand"
    big = [b for b in edge["blobs"] if "ws/od-big:v1" in b["layers"]]
    assert big and big[0]["remote_bytes"] > 0 and big[0]["chunk_latency_s"] > 0
    metrics = httpx.get(f"{node.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    assert 'dsec_layer_remote_bytes_total{' in metrics and "ws/od-big:v1" in metrics


async def test_record_access_needs_a_shared_store(client: dsec.AsyncClient, platform: Platform) -> None:
    async with dsec.AsyncClient(url=platform.url, token=TOKEN) as local:
        with pytest.raises(dsec.InvalidRequest) as e:
            await local.run_container(dsec.ContainerArgs(image="base/busybox", record_access=True))
        assert e.value.field == "record_access"


def test_second_node_eager_mode_shares_the_store(shared: tuple[str, dict[str, str]],
                                                 tmp_path_factory: pytest.TempPathFactory) -> None:
    """Another node on the same store sees the same catalog; in eager mode it copies
    whole data blobs to local disk before mounting (the baseline of bench/ondemand.py)."""
    store_root, sums = shared
    data_dir = str(tmp_path_factory.mktemp("node2"))
    p = Platform(data_dir, ["--store", store_root, "--fetch-mode", "eager", "--edge-name", "edge0"])
    p.start()
    try:
        with dsec.Client(url=p.url, token=TOKEN) as c:
            layer = c.layer("ws/od-big:v1")
            (data,) = layer.data.values()
            sb = c.run_container(dsec.ContainerArgs(image="base/busybox", layers=["ws/od-big:v1"],
                                                    memory_limit_mb=64))
            r = sb.exec(["sha256sum", "/od/f0"])
            assert r.stdout.split()[0] == sums["/od/f0"]
            full = os.path.join(data_dir, "node", "full", f"{data}.data")
            assert os.path.getsize(full) == os.path.getsize(os.path.join(store_root, "blobs", "sha256",
                                                                         f"{data}.data"))
            (st,) = c.storage_stats()
            assert st.mode == "eager" and st.copied_bytes >= os.path.getsize(full)
            assert not _reader_pids(data_dir)
            sb.stop()
    finally:
        p.stop()
    with open("/proc/self/mountinfo") as f:
        assert not [line for line in f if data_dir in line]
