"""The demo workload: 16 container sandboxes created concurrently, each unpacking a real
Python project (more-itertools 10.5.0, its sdist) and running its test suite inside,
then a summary table. Exits non-zero if any sandbox failed."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import time

from rich.console import Console
from rich.table import Table

import dsec

PROJECT = "more-itertools-10.5.0"


async def one(client: dsec.AsyncClient, idx: int, tarball: bytes) -> dict[str, object]:
    t0 = time.perf_counter()
    sb = await client.run_container(dsec.ContainerArgs(
        image="base/debian:12", memory_limit_mb=512, cpu_cores_limit=0.5, ttl_running_stop=600,
        labels={"demo": "more-itertools", "idx": str(idx)}, job="demo"))
    created = time.perf_counter() - t0
    try:
        await sb.write_file(f"/root/{PROJECT}.tar.gz", tarball)
        await sb.run_shell(f"cd /root && tar xzf {PROJECT}.tar.gz && cd {PROJECT}")
        t1 = time.perf_counter()
        r = await sb.run_shell("PYTHONPATH=. python3 -m unittest discover -s tests -t . 2>&1 | tail -n 4",
                               timeout=600)
        ran = re.search(r"Ran (\d+) tests? in", r.stdout)
        return {"idx": idx, "sandbox": sb.sandbox_id, "create_s": created, "test_s": time.perf_counter() - t1,
                "tests": int(ran.group(1)) if ran else 0, "ok": "\nOK" in r.stdout and r.exit_code == 0,
                "tail": r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-200:]}
    finally:
        await sb.stop()


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("-n", type=int, default=16, help="sandboxes to run concurrently")
    ap.add_argument("--tarball", default=os.path.join(os.environ.get("DSEC_DATA_DIR", "/var/lib/dsec"),
                                                      "demo", f"{PROJECT}.tar.gz"))
    a = ap.parse_args()
    with open(a.tarball, "rb") as f:
        tarball = f.read()
    console = Console()
    t0 = time.perf_counter()
    async with dsec.AsyncClient() as client:
        results = await asyncio.gather(*(one(client, i, tarball) for i in range(a.n)), return_exceptions=True)
    wall = time.perf_counter() - t0
    table = Table(title=f"{a.n} sandboxes running the {PROJECT} test suite")
    for col in ("#", "sandbox", "edge", "create s", "tests s", "tests", "result"):
        table.add_column(col)
    failed = 0
    for i, r in enumerate(results):
        if isinstance(r, BaseException):
            failed += 1
            table.add_row(str(i), "-", "-", "-", "-", "-", f"[red]{type(r).__name__}: {r}[/red]")
            continue
        failed += 0 if r["ok"] else 1
        table.add_row(str(r["idx"]), str(r["sandbox"]), str(r["sandbox"]).rsplit("-", 1)[0], f"{r['create_s']:.3f}",
                      f"{r['test_s']:.2f}",
                      str(r["tests"]), "[green]OK[/green]" if r["ok"] else f"[red]{r['tail']}[/red]")
    console.print(table)
    per_edge: dict[str, int] = {}
    for r in results:
        if not isinstance(r, BaseException):
            edge = str(r["sandbox"]).rsplit("-", 1)[0]
            per_edge[edge] = per_edge.get(edge, 0) + 1
    console.print(f"wall time {wall:.1f}s, {a.n - failed}/{a.n} sandboxes passed; "
                  f"where they ran: {', '.join(f'{e} {n}' for e, n in sorted(per_edge.items()))}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
