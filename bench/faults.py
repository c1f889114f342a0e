"""What a hostile sandbox at the default limits costs: how long its stop takes, and a
bystander's exec round trip while it runs, each against the same measure with an idle
sandbox in its place (the baseline), in one run; plus the edge's restart time with the
fault running. The cases are the fault-injection suite's (tests/faults/).

    .venv/bin/python bench/faults.py --write docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable

sys.path.insert(0, os.path.dirname(__file__))

from abuse import probe  # noqa: E402
from container import pct, private_server, report, start_server  # noqa: E402

import dsec  # noqa: E402

_SIG_PROOF = ("import os, signal, time\n"
              "[signal.signal(s, signal.SIG_IGN) for s in range(1, signal.NSIG) if s not in (9, 19, 32, 33)]\n"
              "signal.pthread_sigmask(signal.SIG_BLOCK, range(1, signal.NSIG))\n"
              "[os.fork() for _ in range(5)]\n"
              "while True: time.sleep(0.01)")
FAULTS: dict[str, tuple[dict[str, object], str]] = {  # name -> (sandbox args beyond the defaults, detached script)
    "idle (baseline)": ({}, "sleep 100000"),
    "fork bomb, defaults": ({}, "b() { b | b & }; b"),
    "fork bomb, 128 MiB": ({"memory_limit_mb": 128}, "b() { b | b & }; b"),
    "64 processes spinning at the 1-core limit": ({}, "for i in $(seq 64); do (while :; do :; done) & done; wait"),
    "32 processes ignoring and blocking every signal": ({}, f"python3 -c '{_SIG_PROOF}'"),
    "300 MiB working set at a 128 MiB limit (swap, OOM)": (
        {"memory_limit_mb": 128},
        "while :; do python3 -c 'a = bytearray(300 << 20)\nwhile 1: a[::4096] = bytes(len(a) // 4096)'; done"),
    "disk filled to its 64 MiB quota, over and over": (
        {"disk_limit_mb": 64}, "while :; do dd if=/dev/zero of=/root/f bs=1M 2>/dev/null; rm -f /root/f; done"),
    "endless output into a stream nobody reads": ({}, ""),
}


async def _start(sb: dsec.AsyncSandbox, script: str) -> Callable[[], Awaitable[None]]:
    """Start the fault; returns how to let go of what the client holds for it."""
    if not script:
        stream = sb.exec_stream("yes", timeout=3600)
        await stream.__anext__()  # one event, then nobody reads
        return stream.aclose
    quoted = "'" + script.replace("'", "'\"'\"'") + "'"
    await sb.exec(f"setsid sh -c {quoted} >/dev/null 2>&1 < /dev/null &")

    async def nothing() -> None:
        return None
    return nothing


async def bench(url: str, token: str, n: int, secs: float) -> dict[str, tuple[list[float], float]]:
    """fault -> (bystander exec round trips, stop seconds)."""
    res: dict[str, tuple[list[float], float]] = {}
    async with dsec.AsyncClient(url=url, token=token) as c:
        by = await c.run_container(dsec.ContainerArgs(image="base/busybox"))  # a default neighbour
        try:
            await probe(by, 10)
            for name, (args, script) in FAULTS.items():
                sb = await c.run_container(dsec.ContainerArgs(**args))  # type: ignore[arg-type]
                release = await _start(sb, script)
                await asyncio.sleep(secs)
                lat = await probe(by, n)
                t0 = time.perf_counter()
                await sb.stop()
                res[name] = (lat, time.perf_counter() - t0)
                await release()
                print(f"{name}: exec p50 {statistics.median(lat) * 1000:.1f} ms, stop {res[name][1]:.3f} s",
                      flush=True)
        finally:
            await by.stop()
    return res


class Server:
    """The dsec server under test, restartable on its data dir."""

    def __init__(self, node_data_dir: str) -> None:
        self.proc, self.url, self.token, self.data_dir = private_server(node_data_dir, log=True)

    def restart(self) -> float:
        """Graceful stop, start again; seconds until /healthz answers."""
        self.stop()
        t0 = time.perf_counter()
        self.proc, self.url = start_server(self.data_dir, self.token, log=os.path.join(self.data_dir, "serve.log"))
        return time.perf_counter() - t0

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


async def restart_times(server: Server) -> dict[str, float]:
    """Edge restart time with an idle sandbox, and with a fork-bombed one, on it."""
    out = {}
    for name, script in (("idle sandbox", "sleep 100000"), ("fork-bombed sandbox", "b() { b | b & }; b")):
        async with dsec.AsyncClient(url=server.url, token=server.token) as c:
            sb = await c.run_container(dsec.ContainerArgs(memory_limit_mb=128))
            await _start(sb, script)
            await asyncio.sleep(3)
        out[name] = server.restart()
        async with dsec.AsyncClient(url=server.url, token=server.token) as c:
            await (await c.connect(sb.sandbox_id)).stop()
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=50, help="bystander execs per fault")
    ap.add_argument("--seconds", type=float, default=3.0, help="how long each fault runs before the probe")
    ap.add_argument("--data-dir", default=os.environ.get("DSEC_DATA_DIR", "/var/lib/dsec"))
    ap.add_argument("--write", metavar="MARKDOWN")
    a = ap.parse_args()
    server = Server(a.data_dir)
    try:
        res = await bench(server.url, server.token, a.n, a.seconds) if a.n else {}
        restarts = await restart_times(server)
    finally:
        server.stop()
    ms = 1000.0
    base_lat = statistics.median(res["idle (baseline)"][0])
    base_stop = res["idle (baseline)"][1]
    rows = [f"One sandbox at the default limits (unless stated) runs the fault for {a.seconds:g} s; a default "
            f"busybox neighbour's `exec true` round trip is measured {a.n} times while it runs, then the faulty "
            f"sandbox is stopped. {os.cpu_count()} cores, kernel {platform.release()}.", "",
            "| fault | bystander p50 (ms) | p90 (ms) | p50 / idle | stop (s) | stop / idle |",
            "|---|---|---|---|---|---|"]
    for name, (lat, stop) in res.items():
        rows.append(f"| {name} | {statistics.median(lat) * ms:.1f} | {pct(lat, 90) * ms:.1f} | "
                    f"{statistics.median(lat) / base_lat:.2f}x | {stop:.3f} | {stop / base_stop:.1f}x |")
    rows += ["", "Edge restart (graceful stop, then `dsec serve` again until `/healthz` answers, its sandboxes "
             "re-adopted):", "", "| on the edge | restart (s) | / idle |", "|---|---|---|"]
    for name, secs in restarts.items():
        rows.append(f"| {name} | {secs:.2f} | {secs / restarts['idle sandbox']:.2f}x |")
    report("\n".join(rows), a.write, "faults.py", "faults", "Faults at the default limits (`bench/faults.py`)")


if __name__ == "__main__":
    asyncio.run(main())
