"""Console benchmark: what a live console page costs as the fleet grows, against the
baseline a console without server-side paging would pay (fetching the whole list).

On a private ``dsec serve``, with N real sandboxes (busybox containers, grown step by
step), times each answer the console polls: a page of 50 sandboxes (the edge filters,
sorts and cuts), the same with usage, the busiest 15 by CPU (``dsec top``: usage of every
sandbox), the fleet overview; and the whole ``GET /v1/sandboxes`` list. Then a real
browser (Debian's Chromium via Playwright) times the sandboxes page from navigation to 50
rows. Last, the query's own cost on a 10,000-sandbox fleet (records built in memory, 10
edges): what the edges' answers and the merge cost per page, without the network.

    .venv/bin/python bench/console.py --write docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import aiohttp  # noqa: E402
from container import report, start_server  # noqa: E402
from plots import density_curve, image_link  # noqa: E402
from test_console_query import fleet  # noqa: E402

import dsec  # noqa: E402
from dsec.node.host.prep import prepare_cgroups  # noqa: E402
from dsec.node.layers.store import LayerStore  # noqa: E402
from dsec.shared import query  # noqa: E402
from dsec.shared.wire.console import SandboxQuery  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
CALLS = {
    "page of 50": "/v1/console/sandboxes?limit=50",
    "page of 50 + usage": "/v1/console/sandboxes?limit=50&usage=true",
    "busiest 15 by CPU": "/v1/console/sandboxes?limit=15&sort=-cpu&state=running",
    "fleet overview": "/v1/console/fleet",
    "whole list (baseline)": "/v1/sandboxes",
}


def med(xs: list[float]) -> float:
    return statistics.median(xs)


async def time_calls(url: str, token: str, reps: int) -> tuple[dict[str, float], dict[str, int]]:
    out: dict[str, float] = {}
    size: dict[str, int] = {}
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as s:
        for name, path in CALLS.items():
            xs = []
            for _ in range(reps):
                t = time.perf_counter()
                async with s.get(url + path) as r:
                    size[name] = len(await r.read())
                    assert r.status == 200, (path, r.status)
                xs.append(time.perf_counter() - t)
            out[name] = med(xs) * 1000
    return out, size


async def browser_page(url: str, token: str, reps: int, rows: int) -> float:
    from playwright.async_api import async_playwright
    xs = []
    async with async_playwright() as p:
        b = await p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = await b.new_page()
        await page.goto(f"{url}/ui/")
        await page.fill("input[name=token]", token)
        await page.click("button[type=submit]")
        await page.wait_for_selector("[data-testid=whoami]")
        for i in range(reps):
            await page.goto(f"{url}/ui/#/fleet")
            await page.wait_for_selector("[data-testid=edges]")
            t = time.perf_counter()
            await page.goto(f"{url}/ui/#/sandboxes?q=&n={i}")
            await page.wait_for_function(f"() => document.querySelectorAll('tr[data-sandbox]').length >= {rows}")
            xs.append(time.perf_counter() - t)
        await b.close()
    return med(xs) * 1000


def pure_query(n: int, edges: int, reps: int) -> dict[str, float]:
    by_edge = fleet(n, edges)
    out = {}
    for name, q in (("newest page", SandboxQuery(limit=50)), ("page 100 (offset 4,950)", SandboxQuery(offset=4950)),
                    ("filtered: running grpo", SandboxQuery(state=["running"], job="grpo")),
                    ("counts only", SandboxQuery(limit=0))):
        xs = []
        for _ in range(reps):
            t = time.perf_counter()
            pages = [query.answer(items, q) for items in by_edge.values()]
            query.merge(pages, q, [])
            xs.append(time.perf_counter() - t)
        out[name] = med(xs) * 1000
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", default="50,100,200,400", help="fleet sizes to measure at")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--data-dir", default=os.environ.get("DSEC_DATA_DIR", "/var/lib/dsec"))
    ap.add_argument("--write", metavar="MARKDOWN", help="replace this benchmark's section in that file")
    a = ap.parse_args()
    steps = [int(x) for x in a.steps.split(",")]
    prepare_cgroups()
    data_dir = tempfile.mkdtemp(prefix="dsec-bench-")
    LayerStore(os.path.join(data_dir, "layers")).link_from(os.path.join(a.data_dir, "layers"))
    token = "bench-" + os.urandom(8).hex()
    proc, url = start_server(data_dir, token)
    rows: dict[int, dict[str, float]] = {}
    sizes: dict[int, dict[str, int]] = {}
    page_ms = float("nan")
    try:
        async with dsec.AsyncClient(url=url, token=token) as c:
            made: list[dsec.AsyncSandbox] = []
            sem = asyncio.Semaphore(8)

            async def one() -> dsec.AsyncSandbox:
                async with sem:
                    return await c.run_container(dsec.ContainerArgs(
                        image="base/busybox", memory_limit_mb=32, cpu_cores_limit=0.02, job=f"j{len(made) % 4}"))
            try:
                for n in steps:
                    made += await asyncio.gather(*(one() for _ in range(n - len(made))))
                    await asyncio.sleep(6)  # a watcher round and a fleet sample see them
                    rows[n], sizes[n] = await time_calls(url, token, a.reps)
                    print(n, {k: round(v, 1) for k, v in rows[n].items()}, flush=True)
                page_ms = await browser_page(url, token, 5, min(50, max(steps)))
                print("browser page", round(page_ms), flush=True)
            finally:
                for i in range(0, len(made), 32):
                    await asyncio.gather(*(sb.stop() for sb in made[i:i + 32]), return_exceptions=True)
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(data_dir, ignore_errors=True)
    pure = pure_query(10_000, 10, 7)
    print(pure)

    top = max(steps)
    base = rows[top]["whole list (baseline)"]
    lines = [f"A private `dsec serve`, busybox containers (32 MiB), {os.cpu_count()} cores; medians of {a.reps} "
             "requests at each fleet size, over loopback with the SDK's HTTP client.", "",
             "| answer (ms) | " + " | ".join(f"{n} sandboxes" for n in steps) + f" | vs whole list at {top} |",
             "|---|" + "---|" * (len(steps) + 1)]
    for name in CALLS:
        ratio = "" if name.startswith("whole") else f"{rows[top][name] / base:.2f}x"
        lines.append(f"| {name} | " + " | ".join(f"{rows[n][name]:.1f}" for n in steps) + f" | {ratio} |")
    lines += ["", "| bytes per answer | " + " | ".join(f"{n} sandboxes" for n in steps) + " |",
              "|---|" + "---|" * len(steps)]
    for name in CALLS:
        lines.append(f"| {name} | " + " | ".join(f"{sizes[n][name]:,}" for n in steps) + " |")
    lines += ["", f"The sandboxes page in Chromium, from navigation to 50 rows shown, at {top} sandboxes: "
              f"{page_ms:.0f} ms (median of 5).", "",
              "The query alone on 10,000 sandboxes over 10 edges (records in memory: the edges' answers and the "
              "merge, no network), median of 7:", "", "| page | ms |", "|---|---|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in pure.items()]
    if a.write:
        img = density_curve({name: (steps, [rows[n][name] for n in steps]) for name in CALLS},
                            bench="console", name="answers", title="What a console poll costs as the fleet grows",
                            xlabel="sandboxes on the edge", ylabel="answer (ms, median)",
                            out_dir=os.path.join(os.path.dirname(os.path.abspath(a.write)), "img"))
        lines += ["", image_link("console answers against fleet size", img)]
    report("\n".join(lines), a.write, "console.py", "console", "Web console (`bench/console.py`)")


if __name__ == "__main__":
    asyncio.run(main())
