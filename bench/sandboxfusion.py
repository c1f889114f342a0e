"""SandboxFusion's ``/run_code`` on dsec against dsec's own ``/v1/fncall``, in one run on one
server: python hello, p50 latency and calls/s at concurrency 1, 8 and 32. What the
SandboxFusion face costs is the difference (target: under 10%).

Both APIs get the same HTTP client (one aiohttp session, kept-alive connections, a JSON
body, each API's defaults) and are measured in alternating rounds, so drift on a busy
machine falls on both alike.

    .venv/bin/python bench/sandboxfusion.py                 # a private server, results printed
    .venv/bin/python bench/sandboxfusion.py --write docs/benchmarks.md

``fusion_vs_fncall(url, token)`` is the same measurement against a running server
(bench/harnesses.py calls it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

sys.path.append(os.path.dirname(os.path.abspath(__file__)))

from container import pct, private_server, report  # noqa: E402

PY_HELLO = "print('hello')"
PLAN = {1: 150, 8: 400, 32: 400}  # concurrency -> calls per API
ROUNDS = 4  # alternating rounds per concurrency


async def _measure(call: Callable[[], Awaitable[str]], n: int, conc: int, lat: list[float]) -> float:
    """Run ``n`` calls, ``conc`` at a time; latencies go to ``lat``; returns the wall time."""
    left = iter(range(n))

    async def worker() -> None:
        for _ in left:
            t = time.perf_counter()
            out = await call()
            lat.append(time.perf_counter() - t)
            if out != "hello\n":
                raise RuntimeError(f"unexpected output {out[:200]!r}")

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    return time.perf_counter() - t0


async def _run(url: str, token: str) -> list[dict[str, Any]]:
    import aiohttp

    url = url.rstrip("/")
    conn = aiohttp.TCPConnector(limit=64)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as s:
        async def fncall() -> str:
            async with s.post(f"{url}/v1/fncall", json={"language": "python", "code": PY_HELLO},
                              headers={"Authorization": f"Bearer {token}"}) as r:
                body = await r.json()
            if r.status != 200 or body.get("status") != "ok":
                raise RuntimeError(f"/v1/fncall answered {r.status}: {body}")
            return str(body["stdout"])

        async def fusion() -> str:
            async with s.post(f"{url}/sandboxfusion/{token}/run_code",
                              json={"code": PY_HELLO, "language": "python"}) as r:
                body = await r.json()
            if r.status != 200 or body.get("status") != "Success":
                raise RuntimeError(f"/run_code answered {r.status}: {body}")
            return str(body["run_result"]["stdout"])

        apis = {"dsec /v1/fncall": fncall, "SandboxFusion /run_code": fusion}
        for call in apis.values():  # warm the pool to its working size, as a running service would be
            await asyncio.gather(*(call() for _ in range(64)))
        rows = []
        for conc, n in PLAN.items():
            lat: dict[str, list[float]] = {name: [] for name in apis}
            wall = dict.fromkeys(apis, 0.0)
            for _ in range(ROUNDS):
                for name, call in apis.items():
                    wall[name] += await _measure(call, n // ROUNDS, conc, lat[name])
            for name in apis:
                rows.append({"api": name, "conc": conc, "p50": pct(lat[name], 50) * 1000,
                             "p90": pct(lat[name], 90) * 1000, "rps": len(lat[name]) / wall[name]})
                print(rows[-1], flush=True)
        return rows


def render(rows: list[dict[str, Any]]) -> str:
    base = {r["conc"]: r for r in rows if r["api"] == "dsec /v1/fncall"}
    out = [f"python hello, each API's defaults, one aiohttp session; {ROUNDS} alternating rounds per row; "
           f"{os.cpu_count()} cores, kernel {platform.release()}.", "",
           "| API | concurrency | p50 ms | p90 ms | calls/s | p50 vs FnCall | calls/s vs FnCall |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        b = base[r["conc"]]
        out.append(f"| {r['api']} | {r['conc']} | {r['p50']:.2f} | {r['p90']:.2f} | {r['rps']:.0f} | "
                   f"{r['p50'] / b['p50']:.2f}x | {r['rps'] / b['rps']:.2f}x |")
    out += ["", "Target: the SandboxFusion face costs under 10% (p50 at most 1.10x, calls/s at least 0.90x)."]
    return "\n".join(out)


def fusion_vs_fncall(url: str, token: str) -> str:
    """The comparison against a running server, as a markdown table."""
    return render(asyncio.run(_run(url, token)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=os.environ.get("DSEC_DATA_DIR", "/var/lib/dsec"))
    ap.add_argument("--write", metavar="MARKDOWN", help="replace this benchmark's section in that file")
    a = ap.parse_args()
    proc, url, token, _ = private_server(a.data_dir)
    try:
        body = fusion_vs_fncall(url, token)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    report(body, a.write, "sandboxfusion.py", "sandboxfusion", "SandboxFusion API on FnCall (`bench/sandboxfusion.py`)")


if __name__ == "__main__":
    main()
