"""Network policy costs: creation with a network link vs without, a live rule change, DNS
through the edge's resolver vs the host's resolver, and an HTTPS fetch from an allowed
registry through the egress gate vs the same fetch from the host, in one run.

The registry fetches are few and small (the index page of one package); nothing else
leaves the machine.

    .venv/bin/python bench/network.py --write docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from container import pct, private_server, report  # noqa: E402

import dsec  # noqa: E402
from dsec.node.edge.network.catalog import pip_config, pip_hosts  # noqa: E402

LOOKUPS = ("import socket, sys, time\nout = []\nfor _ in range({n}):\n"
           "    t = time.perf_counter(); socket.getaddrinfo(sys.argv[1], 443); out.append(time.perf_counter() - t)\n"
           "print(' '.join(f'{{v:.6f}}' for v in out))\n")
FETCH = "curl -sS -o /dev/null -w '%{{time_total}}' https://{host}/simple/six/"


async def bench(url: str, token: str, n: int, fetches: int, host: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"none": [], "deny": [], "pypi": [], "update": [], "dns": [], "fetch": []}
    async with dsec.AsyncClient(url=url, token=token) as c:
        for kind, rules in (("none", None), ("deny", {}), ("pypi", {"pypi": True})):
            for _ in range(n):
                t = time.perf_counter()
                sb = await c.run_container(dsec.ContainerArgs(image="base/debian:12", network_rules=rules))
                await sb.exec(["true"])
                out[kind].append(time.perf_counter() - t)
                await sb.stop()
        sb = await c.run_container(dsec.ContainerArgs(image="base/debian:12", network_rules={"pypi": True}))
        try:
            for i in range(n):
                t = time.perf_counter()
                await sb.set_network_rules({"npm": bool(i % 2)})
                out["update"].append(time.perf_counter() - t)
            await sb.exec(["getent", "hosts", host])  # warm the upstream's cache, as the host's was
            r = await sb.exec(["python3", "-c", LOOKUPS.format(n=100), host])
            out["dns"] = [float(v) for v in r.stdout.split()]
            for _ in range(fetches):
                r = await sb.run_shell(FETCH.format(host=host), timeout=60)
                if r.exit_code == 0:
                    out["fetch"].append(float(r.stdout))
        finally:
            await sb.stop()
    return out


def host_side(host: str, fetches: int) -> dict[str, list[float]]:
    socket.getaddrinfo(host, 443)
    dns = []
    for _ in range(100):
        t = time.perf_counter()
        socket.getaddrinfo(host, 443)
        dns.append(time.perf_counter() - t)
    fetch = []
    for _ in range(fetches):
        r = subprocess.run(["sh", "-c", FETCH.format(host=host)], capture_output=True, text=True, timeout=60)
        if r.returncode == 0:
            fetch.append(float(r.stdout))
    return {"dns": dns, "fetch": fetch}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=20)
    ap.add_argument("--fetches", type=int, default=5)
    ap.add_argument("--data-dir", default=os.environ.get("DSEC_DATA_DIR", "/var/lib/dsec"))
    ap.add_argument("--write", metavar="MARKDOWN")
    a = ap.parse_args()
    host = next(h for h in pip_hosts(pip_config()) if not h.startswith("files."))
    proc, url, token, _ = private_server(a.data_dir)
    try:
        ds = await bench(url, token, a.n, a.fetches, host)
    finally:
        proc.terminate()
        proc.wait(60)
    hs = host_side(host, a.fetches)
    ms = 1000.0
    med = statistics.median
    rows = [
        "| metric | baseline | dsec | dsec / baseline |", "|---|---|---|---|",
        f"| create-to-first-exec p50 (ms): no network (baseline) vs deny-all link | {med(ds['none']) * ms:.1f} | "
        f"{med(ds['deny']) * ms:.1f} | {med(ds['deny']) / med(ds['none']):.2f}x |",
        f"| create-to-first-exec p50 (ms): no network vs pypi allowed | {med(ds['none']) * ms:.1f} | "
        f"{med(ds['pypi']) * ms:.1f} | {med(ds['pypi']) / med(ds['none']):.2f}x |",
        f"| live rule change, round trip p50 / p90 (ms) | | {med(ds['update']) * ms:.1f} / "
        f"{pct(ds['update'], 90) * ms:.1f} | |",
        f"| DNS lookup of an allowed name p50 (ms): host resolver vs sandbox via the edge | {med(hs['dns']) * ms:.2f} "
        f"| {med(ds['dns']) * ms:.2f} | {med(ds['dns']) / med(hs['dns']):.2f}x |",
    ]
    if hs["fetch"] and ds["fetch"]:
        rows.append(f"| HTTPS GET of a package index page p50 (ms): host vs sandbox through the gate | "
                    f"{med(hs['fetch']) * ms:.0f} | {med(ds['fetch']) * ms:.0f} | "
                    f"{med(ds['fetch']) / med(hs['fetch']):.2f}x |")
    body = "\n".join([f"n={a.n} creations per series, 100 lookups, {a.fetches} fetches; {os.cpu_count()} cores, "
                      f"kernel {platform.release()}", "", *rows])
    report(body, a.write, "network.py", "network", "Network policy (`bench/network.py`)")


if __name__ == "__main__":
    asyncio.run(main())
