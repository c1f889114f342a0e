"""The edge's data dir on a small filesystem of its own (a loop-mounted ext4 image) that a
sandbox fills. Writes fail with ENOSPC inside the sandbox; the edge, its records and the
other sandboxes carry on; a create that cannot get space fails with a clear error and
leaves nothing; freeing the space (stopping the filler) brings everything back, across an
edge restart too."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Iterator

import pytest

import dsec
from tests.conftest import TOKEN, Platform, _seed_layers, leftovers, stop_all, wait_for
from tests.faults.conftest import Probe, stop_within_bound

pytestmark = pytest.mark.timeout(300)
FS_MB = 192


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    data_dir = str(tmp_path_factory.mktemp("diskfull"))
    _seed_layers(data_dir)  # the layer store stays on the host's filesystem (hard links)
    image, edges = os.path.join(data_dir, "edges.img"), os.path.join(data_dir, "edges")
    os.makedirs(edges)
    with open(image, "wb") as f:
        f.truncate(FS_MB << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", image], check=True)  # no root reserve
    subprocess.run(["mount", "-o", "loop", image, edges], check=True)
    # plain directories: a sparse btrfs volume on a filesystem this small would promise
    # space it does not have (docs/reliability.md)
    p = Platform(data_dir, ["--sandbox-volume-gb", "0"])
    try:
        p.start()
        yield p
        stop_all(p)
    finally:
        p.stop()
        subprocess.run(["umount", edges], check=True)


def _free_mb(platform: Platform) -> float:
    st = os.statvfs(os.path.join(platform.data_dir, "edges"))
    return st.f_bavail * st.f_frsize / (1 << 20)


async def test_data_dir_filesystem_full(platform: Platform) -> None:
    async with dsec.AsyncClient(url=platform.url, token=TOKEN) as c:
        bystander = await c.run_container(dsec.ContainerArgs(image="base/busybox"))
        filler = await c.run_container(dsec.ContainerArgs(image="base/busybox", disk_limit_mb=16 << 10))
        async with Probe(platform, bystander):
            r = await filler.exec("dd if=/dev/zero of=/root/fill bs=1M", timeout=120)
            assert r.exit_code != 0 and "No space left" in r.stderr, r
            assert _free_mb(platform) < 1
            assert (await filler.exec(["echo", "full"])).stdout == "full\n"
            pad = os.path.join(platform.data_dir, "edges", "pad")  # the last blocks, from the host
            await asyncio.to_thread(subprocess.run, ["dd", "if=/dev/zero", f"of={pad}", "bs=4k"], capture_output=True)
            # a create needs a few blocks in the data dir: it fails, clearly, and leaves nothing
            with pytest.raises(dsec.InsufficientStorage, match="no space left in its data dir"):
                await c.run_container(dsec.ContainerArgs(image="base/busybox", labels={"case": "full"}))
            assert not await c.list(labels={"case": "full"})
            await stop_within_bound(platform, filler)
            os.unlink(pad)
        assert _free_mb(platform) > FS_MB / 2  # its writable layer went with it
        again = await c.run_container(dsec.ContainerArgs(image="base/busybox"))
        assert (await again.exec(["echo", "back"])).stdout == "back\n"
    platform.restart()  # the records were written through it all: the restart re-adopts both
    async with dsec.AsyncClient(url=platform.url, token=TOKEN) as c:
        for sb in (bystander, again):
            v = await c.connect(sb.sandbox_id)
            assert (await v.exec(["echo", "ok"])).stdout == "ok\n"
            await stop_within_bound(platform, v)
    assert wait_for(lambda: not leftovers(platform, filler.sandbox_id), 5)
