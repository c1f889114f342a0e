"""Layer provisioning benchmark: the same workspace + toolkit files given to N sandboxes
by per-sandbox tar extraction (the baseline) versus dsec's shared EROFS layer mounts
under a per-sandbox overlay, same run, same files. Reports setup time and bytes
written to disk (block device counters, after sync), then pack_diff and fork timings
through the SDK.

    .venv/bin/python bench/layers.py --write docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

from container import start_server  # noqa: E402

import dsec  # noqa: E402
from dsec.node.host import linux  # noqa: E402
from dsec.node.host.prep import prepare_cgroups  # noqa: E402
from dsec.node.layers.store import LayerStore  # noqa: E402


def _dev_of(path: str) -> str:
    """The block device name holding ``path`` (for /sys/block/<dev>/stat)."""
    dev = os.stat(path).st_dev
    name = f"{os.major(dev)}:{os.minor(dev)}"
    for blk in os.listdir("/sys/class/block"):
        try:
            if open(f"/sys/class/block/{blk}/dev").read().strip() == name:
                return blk
        except OSError:
            continue
    raise RuntimeError(f"no block device for {path}")


def written(blk: str) -> int:
    os.sync()
    with open(f"/sys/class/block/{blk}/stat") as f:
        return int(f.read().split()[6]) * 512


def drop_caches() -> None:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
    except OSError:
        pass  # not allowed here: both paths then run warm alike


def fill(dst: str, sources: list[str]) -> None:
    for src in sources:
        shutil.copytree(src, os.path.join(dst, os.path.basename(src)), symlinks=True, dirs_exist_ok=True)


def read_all(d: str) -> float:
    """Cold read of every file under ``d``: what the first task pays after setup."""
    drop_caches()
    t = time.perf_counter()
    subprocess.run(f"find {d} -type f -print0 | xargs -0 cat > /dev/null", shell=True, check=True)
    return time.perf_counter() - t


def tar_path(root: str, tars: list[str], n: int, blk: str) -> tuple[float, int, float]:
    before = written(blk)
    drop_caches()
    t = time.perf_counter()
    procs = []
    for i in range(n):
        d = os.path.join(root, f"sb{i}")
        os.makedirs(d)
        for tarball in tars:
            procs.append(subprocess.Popen(["tar", "-xf", tarball, "-C", d]))
        if len(procs) >= 4:  # bounded parallelism, as a runtime would use
            for p in procs:
                p.wait()
            procs = []
    for p in procs:
        p.wait()
    os.sync()
    elapsed, delta = time.perf_counter() - t, written(blk) - before
    return elapsed, delta, read_all(os.path.join(root, "sb0"))


def erofs_path(root: str, store: LayerStore, refs: list[str], n: int, blk: str) -> tuple[float, int, float]:
    before = written(blk)
    drop_caches()
    t = time.perf_counter()
    lowers = []
    for ref in refs:  # once per node
        digest = store.get(ref).digest
        mnt = os.path.join(root, "mnt", digest)
        os.makedirs(mnt)
        source, opts = store.mount_args(digest)
        linux.mount(source, mnt, "erofs", linux.MS_RDONLY, opts)
        lowers.insert(0, mnt)
    for i in range(n):  # per sandbox
        d = os.path.join(root, f"sb{i}")
        for sub in ("upper", "work", "rootfs"):
            os.makedirs(os.path.join(d, sub))
        linux.mount("overlay", f"{d}/rootfs", "overlay", 0,
                    f"lowerdir={':'.join(lowers)},upperdir={d}/upper,workdir={d}/work")
    os.sync()
    elapsed = time.perf_counter() - t
    delta = written(blk) - before
    cold = read_all(os.path.join(root, "sb0", "rootfs"))
    for mp in linux.mounted_under(root):
        linux.umount(mp)
    return elapsed, delta, cold


async def sdk_timings(url: str, token: str, refs: list[str], forks: int) -> dict[str, float]:
    async with dsec.AsyncClient(url=url, token=token) as c:
        t = time.perf_counter()
        sb = await c.run_container(dsec.ContainerArgs(image="base/debian:12", layers=refs))
        create = time.perf_counter() - t
        await sb.run_shell("cd /root && for i in $(seq 200); do echo $i > f$i; done; rm -rf /usr/share/doc; "
                           "pip --version >/dev/null; mkdir -p /root/build && cp -r /usr/lib/python3/dist-packages/pip "
                           "/root/build/")
        t = time.perf_counter()
        snap = await sb.pack_diff(f"ws/bench-snap-{os.getpid()}:v1")
        pack = time.perf_counter() - t
        t = time.perf_counter()
        kids = await c.fork(snap, n=forks, args=dsec.ContainerArgs(memory_limit_mb=128, cpu_cores_limit=0.1))
        fork = time.perf_counter() - t
        await asyncio.gather(sb.stop(), *(k.stop() for k in kids))
        return {"create": create, "pack": pack, "pack_bytes": snap.size, "fork": fork}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=16, help="sandboxes")
    ap.add_argument("--forks", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workspace", default="/usr/lib/python3/dist-packages",
                    help="directory whose files make the workspace layer")
    ap.add_argument("--toolkit", nargs="+", default=["/usr/share/perl", "/usr/lib/gcc"],
                    help="directories whose files make the toolkit layer")
    ap.add_argument("--data-dir", default=os.environ.get("DSEC_DATA_DIR", "/var/lib/dsec"))
    ap.add_argument("--write", metavar="MARKDOWN")
    a = ap.parse_args()
    prepare_cgroups()
    work = tempfile.mkdtemp(prefix="dsec-bench-layers-", dir="/var/tmp")
    blk = _dev_of(work)
    try:
        store = LayerStore(os.path.join(work, "data", "layers"))
        store.link_from(os.path.join(a.data_dir, "layers"))
        src = os.path.join(work, "src")
        fill(os.path.join(src, "ws"), [a.workspace])
        fill(os.path.join(src, "tk"), a.toolkit)
        tag = os.getpid()
        refs = [store.import_dir(os.path.join(src, "ws"), f"ws/bench-{tag}:v1").ref,
                store.import_dir(os.path.join(src, "tk"), f"tk/bench-{tag}:v1").ref]
        tars = []
        for name in ("ws", "tk"):
            tarball = os.path.join(work, f"{name}.tar")
            subprocess.run(["tar", "-cf", tarball, "-C", os.path.join(src, name), "."], check=True)
            tars.append(tarball)
        files = int(subprocess.run(f"find {src} | wc -l", shell=True, capture_output=True, text=True).stdout)
        src_bytes = sum(os.path.getsize(t) for t in tars)
        shutil.rmtree(src)
        tar_runs, erofs_runs = [], []
        for r in range(a.repeat):
            tar_runs.append(tar_path(os.path.join(work, f"tar{r}"), tars, a.n, blk))
            shutil.rmtree(os.path.join(work, f"tar{r}"))
            erofs_runs.append(erofs_path(os.path.join(work, f"erofs{r}"), store, refs, a.n, blk))
            shutil.rmtree(os.path.join(work, f"erofs{r}"))
        token = "bench-" + os.urandom(6).hex()
        proc, url = start_server(os.path.join(work, "data"), token)
        try:
            sdk = asyncio.run(sdk_timings(url, token, refs, a.forks))
        finally:
            proc.terminate()
            proc.wait()
    finally:
        for mp in linux.mounted_under(work):
            linux.umount(mp, detach=True)
        shutil.rmtree(work, ignore_errors=True)
    tt = statistics.median(x[0] for x in tar_runs)
    tb = statistics.median(x[1] for x in tar_runs)
    et = statistics.median(x[0] for x in erofs_runs)
    eb = statistics.median(x[1] for x in erofs_runs)
    tr = statistics.median(x[2] for x in tar_runs)
    er = statistics.median(x[2] for x in erofs_runs)
    body = "\n".join([
        f"{a.n} sandboxes, workspace+toolkit = {files} files, {src_bytes / 1e6:.0f} MB as tar; "
        f"median of {a.repeat} runs, page cache dropped before each; bytes written from /sys/block/{blk}/stat.", "",
        "| provisioning | per-sandbox tar extraction | EROFS layers + overlay (dsec) | ratio | target |",
        "|---|---|---|---|---|",
        f"| setup time (s) | {tt:.2f} | {et:.3f} | {tt / max(et, 1e-6):.0f}x faster | >= 3x |",
        f"| bytes written (MB) | {tb / 1e6:.1f} | {eb / 1e6:.2f} | {tb / max(eb, 4096):.0f}x fewer | >= 5x |",
        f"| then a cold read of every file in one sandbox (s) | {tr:.2f} | {er:.2f} | {er / tr:.2f}x the time | |",
        "",
        "| through the SDK | time |", "|---|---|",
        f"| create a sandbox on base/debian:12 + these 2 layers | {sdk['create'] * 1000:.0f} ms |",
        f"| pack_diff after 200 new files, a copied package and a deleted dir ({sdk['pack_bytes'] / 1e6:.1f} MB layer) "
        f"| {sdk['pack'] * 1000:.0f} ms |",
        f"| fork the snapshot into {a.forks} sandboxes | {sdk['fork'] * 1000:.0f} ms |",
    ])
    print(body)
    if a.write:
        from container import write_section

        write_section(a.write, body, "python bench/layers.py " + " ".join(sys.argv[1:]), name="layers",
                      title="Layer provisioning (`bench/layers.py`)")


if __name__ == "__main__":
    main()
