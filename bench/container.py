"""Container backend benchmark: dsec end to end (SDK -> apiserver -> placement -> edge ->
crun -> dsec-init) against raw crun on the same EROFS+overlayfs rootfs, same run.

Measures create-to-first-exec latency (p50/p90), creations/s with 8 concurrent
clients, and exec round trip (one-off and in a shell session). Prints medians and
ratios; ``--write docs/benchmarks.md`` replaces this benchmark's section there.

    .venv/bin/python bench/container.py --write docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

import dsec
from dsec.node.backends.container.runtime import Limits, oci_config
from dsec.node.host import linux
from dsec.node.host.prep import prepare_cgroups
from dsec.node.layers.store import LayerStore

IMAGE = "base/busybox"


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


class RawCrun:
    """The baseline: what a hand-rolled runner would do per sandbox with crun."""

    def __init__(self, layer_mnt: str, minimal: bool = False) -> None:
        """``minimal``: a bare config (mount and pid namespaces, no seccomp, no masked paths,
        no cgroup limits) instead of dsec's own, for what the isolation itself costs."""
        self.layer_mnt = layer_mnt
        self.minimal = minimal
        self.root = tempfile.mkdtemp(prefix="bench-crun-")
        self.state = os.path.join(self.root, "state")
        self.n = 0

    async def _crun(self, *args: str) -> None:
        p = await asyncio.create_subprocess_exec("crun", "--root", self.state, *args,
                                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if await p.wait() != 0:
            raise RuntimeError(f"crun {args[0]} failed")

    def _bundle(self, argv: list[str], memory_mb: int) -> tuple[str, str]:
        """A fresh container bundle (overlay rootfs + config) running ``argv``: (id, dir)."""
        self.n += 1
        cid = f"rawbench{self.n}"
        d = os.path.join(self.root, cid)
        for sub in ("upper", "work", "rootfs"):
            os.makedirs(os.path.join(d, sub))
        linux.mount("overlay", f"{d}/rootfs", "overlay", 0,
                    f"lowerdir={self.layer_mnt},upperdir={d}/upper,workdir={d}/work")
        cfg = oci_config(cid, f"{d}/rootfs", Limits(memory_mb, 1.0, 4096), f"/dsec-bench/{cid}")
        if self.minimal:
            lin = cfg["linux"]
            for k in ("seccomp", "maskedPaths", "readonlyPaths", "resources"):
                del lin[k]  # type: ignore[attr-defined]
            # (the hostname, mqueue and sysfs need their uts, ipc and network namespaces)
            lin["namespaces"] = [{"type": t} for t in ("pid", "mount", "ipc", "uts", "network")]  # type: ignore[index]
        cfg["process"]["args"] = argv  # type: ignore[index]
        cfg["process"]["cwd"] = "/tmp"  # type: ignore[index]
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        return cid, d

    async def create(self) -> str:
        cid, d = self._bundle(["/bin/sleep", "100000"], 64)
        await self._crun("run", "-d", "--bundle", d, cid)
        return cid

    async def run_once(self, argv: list[str], memory_mb: int = 512) -> bytes:
        """A fresh container for one command (overlay, crun run in the foreground, teardown): stdout."""
        cid, d = self._bundle(argv, memory_mb)
        try:
            p = await asyncio.create_subprocess_exec("crun", "--root", self.state, "run", "--bundle", d, cid,
                                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                                     stderr=subprocess.DEVNULL)
            out, _ = await p.communicate()
            return out
        finally:
            linux.umount(os.path.join(d, "rootfs"))
            shutil.rmtree(d)

    async def exec(self, cid: str) -> None:
        await self._crun("exec", cid, "/bin/true")

    async def delete(self, cid: str) -> None:
        await self._crun("delete", "-f", cid)
        linux.umount(os.path.join(self.root, cid, "rootfs"))
        shutil.rmtree(os.path.join(self.root, cid))

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        for d in glob.glob("/sys/fs/cgroup/dsec-bench") + glob.glob("/sys/fs/cgroup/*/dsec-bench"):
            with contextlib.suppress(OSError):
                os.rmdir(d)


async def raw_latency(layer_mnt: str, n: int, minimal: bool) -> list[float]:
    """create -> first exec of ``n`` raw crun containers, one at a time."""
    raw = RawCrun(layer_mnt, minimal)
    try:
        lat = []
        for _ in range(n):
            t = time.perf_counter()
            cid = await raw.create()
            await raw.exec(cid)
            lat.append(time.perf_counter() - t)
            await raw.delete(cid)
        return lat
    finally:
        raw.close()


async def bench_raw(layer_mnt: str, n: int, conc: int, execs: int) -> dict[str, float | list[float]]:
    minimal = await raw_latency(layer_mnt, n, True)
    lat = await raw_latency(layer_mnt, n, False)
    raw = RawCrun(layer_mnt)
    try:
        cid = await raw.create()
        ex = []
        await raw.exec(cid)
        for _ in range(execs):
            t = time.perf_counter()
            await raw.exec(cid)
            ex.append(time.perf_counter() - t)
        await raw.delete(cid)
        ids: list[str] = []

        async def worker(k: int) -> None:
            for _ in range(k):
                ids.append(await raw.create())

        t = time.perf_counter()
        await asyncio.gather(*(worker(n // conc) for _ in range(conc)))
        rate = len(ids) / (time.perf_counter() - t)
        for cid in ids:
            await raw.delete(cid)
        return {"lat": lat, "exec": ex, "rate": rate, "minimal": minimal}
    finally:
        raw.close()


async def bench_dsec(url: str, token: str, n: int, conc: int, execs: int) -> dict[str, float | list[float]]:
    args = dsec.ContainerArgs(image=IMAGE, memory_limit_mb=64, cpu_cores_limit=1.0)
    # the burst holds all its sandboxes at once: small CPU shares so admission has room
    burst_args = args.model_copy(update={"cpu_cores_limit": 0.25})
    async with dsec.AsyncClient(url=url, token=token) as c:
        lat = []
        for _ in range(n):
            t = time.perf_counter()
            sb = await c.run_container(args)
            await sb.exec(["/bin/true"])
            lat.append(time.perf_counter() - t)
            await sb.stop()
        sb = await c.run_container(args)
        ex, sess, inside = [], [], []
        await asyncio.sleep(1)  # let the kernel finish tearing down the stopped ones
        for _ in range(20):
            await sb.exec(["/bin/true"])
        for _ in range(execs):
            t = time.perf_counter()
            r = await sb.exec(["/bin/true"])
            ex.append(time.perf_counter() - t)
            inside.append(r.duration_ms / 1000)
        await sb.run_shell("true")
        for _ in range(execs):
            t = time.perf_counter()
            await sb.run_shell("true")
            sess.append(time.perf_counter() - t)
        await sb.stop()
        made: list[dsec.AsyncSandbox] = []

        async def worker(k: int) -> None:
            for _ in range(k):
                made.append(await c.run_container(burst_args))

        t = time.perf_counter()
        try:
            await asyncio.gather(*(worker(n // conc) for _ in range(conc)))
            rate = len(made) / (time.perf_counter() - t)
        finally:
            await asyncio.gather(*(s.stop() for s in made))
        return {"lat": lat, "exec": ex, "session": sess, "inside": inside, "rate": rate}


def private_server(node_data_dir: str, extra_args: list[str] | None = None,
                   log: bool = False) -> tuple[subprocess.Popen[bytes], str, str, str]:
    """A dsec server on a private data dir whose layers are hard-linked from the node's
    store, so a benchmark neither sees nor disturbs a platform already running here.
    Returns (process, url, token, data dir)."""
    from dsec.node.host.prep import prepare_cgroups
    from dsec.node.layers.store import LayerStore

    prepare_cgroups()
    data_dir = tempfile.mkdtemp(prefix="dsec-bench-")
    LayerStore(os.path.join(data_dir, "layers")).link_from(os.path.join(node_data_dir, "layers"))
    token = "bench-" + os.urandom(8).hex()
    proc, url = start_server(data_dir, token, extra_args, log=os.path.join(data_dir, "serve.log") if log else None)
    return proc, url, token, data_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, proc: subprocess.Popen[bytes], headers: dict[str, str] | None = None,
               verify: Any = True) -> None:
    """Until ``url``/healthz answers 200 (at most a minute); the process is killed if not.
    ``verify``: an SSLContext for an https daemon (bench/remote_edge.py's mutual TLS)."""
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/healthz", timeout=1, headers=headers, verify=verify).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{url} never became ready")


def start_server(data_dir: str, token: str, extra_args: list[str] | None = None,
                 log: str | None = None) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dsec.client.cli.main", "serve", "--port", str(port), "--data-dir",
                             data_dir, "--token", token, "--log-level", "info" if log else "warning",
                             *(extra_args or [])],
                            stdout=subprocess.DEVNULL, stderr=open(log, "ab") if log else subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc)
    return proc, url


def render(raw: dict, ds: dict, n: int, conc: int, execs: int) -> str:  # type: ignore[type-arg]
    ms = 1000.0
    rows = [
        ("create-to-first-exec p50 (ms)", pct(raw["lat"], 50) * ms, pct(ds["lat"], 50) * ms, "<= 1.15x raw"),
        ("create-to-first-exec p90 (ms)", pct(raw["lat"], 90) * ms, pct(ds["lat"], 90) * ms, ""),
        ("  against raw crun with a minimal config, p50 (ms)", pct(raw["minimal"], 50) * ms, pct(ds["lat"], 50) * ms,
         ""),
        (f"creations/s, {conc} concurrent clients", raw["rate"], ds["rate"], ">= 0.8x raw"),
        ("exec round trip p50 (ms)", pct(raw["exec"], 50) * ms, pct(ds["exec"], 50) * ms, "<= 1.5 ms"),
        ("  of which inside the edge (spawn to exit, ms)", float("nan"), pct(ds["inside"], 50) * ms, ""),
        ("session command round trip p50 (ms)", float("nan"), pct(ds["session"], 50) * ms, "<= 1.0 ms"),
    ]
    out = [f"n={n} sandboxes per latency series, {execs} execs, image {IMAGE}; "
           f"{os.cpu_count()} cores, kernel {platform.release()}. Raw crun runs dsec's own OCI config "
           "(the same namespaces, seccomp profile, masked paths and cgroup limits; the program "
           "`sleep` instead of dsec-init) and `crun exec`; the minimal config has the pid, mount, ipc, uts "
           "and network namespaces its mounts need, and no seccomp, masked paths or limits.", "",
           "| metric | raw crun | dsec (SDK->API->edge) | dsec / raw | target |", "|---|---|---|---|---|"]
    for name, r, d, target in rows:
        ratio = "" if r != r else f"{d / r:.2f}x"
        rs = "n/a" if r != r else f"{r:.1f}"
        out.append(f"| {name} | {rs} | {d:.1f} | {ratio} | {target} |")
    return "\n".join(out)


def report(body: str, write: str | None, script: str, name: str, title: str) -> None:
    """Print a benchmark's result and, with ``--write``, replace its section of the results file."""
    print(body)
    if write:
        write_section(write, body, f"python bench/{script} --write docs/benchmarks.md", name=name, title=title)


def write_section(path: str, body: str, cmd: str, name: str = "container",
                  title: str = "Container backend (`bench/container.py`)") -> None:
    """Replace (or append) one benchmark's section of the results file."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    section = (f"{start}\n## {title}\n\nCommand: `{cmd}`, "
               f"run {time.strftime('%Y-%m-%d')}.\n\n{body}\n{end}")
    if start in text:
        text = text[:text.index(start)] + section + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    with open(path, "w") as f:
        f.write(text)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--execs", type=int, default=200)
    ap.add_argument("--data-dir", default=os.environ.get("DSEC_DATA_DIR", "/var/lib/dsec"))
    ap.add_argument("--write", metavar="MARKDOWN", help="replace this benchmark's section in that file")
    a = ap.parse_args()
    prepare_cgroups()
    # a private data dir (layers hard-linked from the node's store), so the benchmark
    # neither sees nor disturbs the sandboxes of a platform already running here
    data_dir = tempfile.mkdtemp(prefix="dsec-bench-")
    store = LayerStore(os.path.join(data_dir, "layers"))
    store.link_from(os.path.join(a.data_dir, "layers"))
    digest = store.get(f"{IMAGE}:latest").digest
    layer_mnt = os.path.join(data_dir, "layers", "mnt", digest)
    token = "bench-" + os.urandom(8).hex()
    proc, url = start_server(data_dir, token)
    try:
        ds = await bench_dsec(url, token, a.n, a.concurrency, a.execs)
    finally:
        proc.terminate()
        proc.wait()
    mounted_here = not os.path.ismount(layer_mnt)
    if mounted_here:  # the same file-backed EROFS mount the edge uses
        os.makedirs(layer_mnt, exist_ok=True)
        source, opts = store.mount_args(digest)
        linux.mount(source, layer_mnt, "erofs", linux.MS_RDONLY, opts)
    try:
        raw = await bench_raw(layer_mnt, a.n, a.concurrency, a.execs)
    finally:
        if mounted_here:
            linux.umount(layer_mnt)
        shutil.rmtree(data_dir, ignore_errors=True)
    body = render(raw, ds, a.n, a.concurrency, a.execs)
    if a.write:
        body += "\n\n" + figures(raw, ds, a.write)
    print(body)
    if a.write:
        write_section(a.write, body, "python bench/container.py " + " ".join(sys.argv[1:]))


def figures(raw: dict, ds: dict, markdown: str) -> str:  # type: ignore[type-arg]
    """The distributions behind the table, as PNGs beside ``markdown``: their markdown links."""
    import plots

    out = plots.img_dir(markdown)

    def ms(xs: list[float]) -> list[float]:
        return [x * 1000 for x in xs]

    create = plots.latency_cdf({"raw crun": ms(raw["lat"]), "dsec (SDK->API->edge)": ms(ds["lat"])},
                               bench="container", name="create-to-first-exec",
                               title=f"Create to first exec, {IMAGE}, one at a time", xlabel="latency (ms)",
                               out_dir=out)
    execs = plots.latency_histogram({"raw crun exec": ms(raw["exec"]), "dsec exec (one-off)": ms(ds["exec"]),
                                     "dsec session command": ms(ds["session"]),
                                     "dsec exec, inside the edge": ms(ds["inside"])},
                                    bench="container", name="exec-round-trip", logx=True, bins=40,
                                    title="Exec of /bin/true: round trip as the client sees it", xlabel="latency (ms)",
                                    out_dir=out)
    return "\n\n".join([plots.image_link("create-to-first-exec latency, raw crun vs dsec", create),
                        plots.image_link("exec round trip distribution, raw crun vs dsec", execs)])


if __name__ == "__main__":
    asyncio.run(main())
