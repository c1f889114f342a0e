"""Does abuse in one sandbox cost the others? A bystander sandbox's exec round trip, idle
(the baseline) and while an attacker sandbox on the same node runs each attack of the
red-team suite's resource section, in one run; ratios to the idle baseline.

    .venv/bin/python bench/abuse.py --write docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from container import pct, private_server, report  # noqa: E402

import dsec  # noqa: E402

ATTACKS = {  # name -> (args of the attacker sandbox, command it runs until stopped)
    "fork bomb (pids limit 128)": (dict(image="base/busybox", pids_limit=128),
                                   "while :; do b() { b | b & }; b; sleep 0.2; done"),
    "memory bomb (limit 128 MiB, OOM-killed over and over)": (
        dict(memory_limit_mb=128), "while :; do python3 -c 'x=[]\nwhile 1: x.append(bytearray(8<<20))'; done"),
    "CPU spin, 4 processes (quota 1 core)": (dict(image="base/busybox"),
                                             "for i in 1 2 3 4; do (while :; do :; done) & done; wait"),
    "endless output (yes, 1 MiB capture)": (dict(image="base/busybox"), "yes spam"),
    "disk fill to its 256 MiB quota, over and over": (
        dict(image="base/busybox", disk_limit_mb=256),
        "while :; do dd if=/dev/zero of=/root/f bs=1M count=400 2>/dev/null; rm -f /root/f; done"),
}


async def probe(sb: dsec.AsyncSandbox, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        r = await sb.exec(["true"], timeout=30)
        assert r.exit_code == 0
        out.append(time.perf_counter() - t)
        await asyncio.sleep(0.02)
    return out


async def bench(url: str, token: str, n: int, secs: float) -> dict[str, list[float]]:
    res: dict[str, list[float]] = {}
    async with dsec.AsyncClient(url=url, token=token) as c:
        by = await c.run_container(dsec.ContainerArgs(image="base/busybox", qos="latency_sensitive"))
        try:
            await probe(by, 10)
            res["idle"] = await probe(by, n)
            for name, (args, cmd) in ATTACKS.items():
                atk = await c.run_container(dsec.ContainerArgs(**args))  # type: ignore[arg-type]
                run = asyncio.ensure_future(atk.exec(cmd, timeout=secs + 5, max_output_bytes=1 << 20))
                await asyncio.sleep(1.0)  # let it get going
                res[name] = await probe(by, n)
                await atk.stop()
                await asyncio.gather(run, return_exceptions=True)
        finally:
            await by.stop()
    return res


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=100, help="bystander execs per phase")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--data-dir", default=os.environ.get("DSEC_DATA_DIR", "/var/lib/dsec"))
    ap.add_argument("--write", metavar="MARKDOWN")
    a = ap.parse_args()
    proc, url, token, _ = private_server(a.data_dir)
    try:
        res = await bench(url, token, a.n, a.seconds)
    finally:
        proc.terminate()
        proc.wait(60)
    ms = 1000.0
    base = statistics.median(res["idle"])
    rows = [f"A latency-sensitive bystander's `exec true` round trip, {a.n} per phase, while one attacker sandbox "
            f"(best-effort) runs the attack; {os.cpu_count()} cores, kernel {platform.release()}", "",
            "| attacker runs | p50 (ms) | p90 (ms) | p50 / idle |", "|---|---|---|---|"]
    for name, v in res.items():
        rows.append(f"| {'nothing (baseline)' if name == 'idle' else name} | {statistics.median(v) * ms:.1f} | "
                    f"{pct(v, 90) * ms:.1f} | {statistics.median(v) / base:.2f}x |")
    body = "\n".join(rows)
    report(body, a.write, "abuse.py", "abuse", "Abuse containment (`bench/abuse.py`)")


if __name__ == "__main__":
    asyncio.run(main())
