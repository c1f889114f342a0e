"""Live branch of a running microVM against n fresh creates of the same backend, in the
same run, on a private ``dsec serve`` (real QEMU; under TCG on our machines).

The parent: a microVM (template clone) running a process that holds ``--hold-mib`` MiB
of written memory (the state a branch carries and a fresh create does not have).

- branch: ``parent.branch(n)`` until every child has answered a first exec; the time per
  child is that over n. The parent's pause (its stop, RAM streamed out, disk copied,
  ``cont``) is read from its ``branched`` event.
- fresh: n ``run_microvm`` at once until each has answered a first exec (template
  clones: dsec's fastest VM create), and then, to reach the parent's state, the same
  process started in each ("fresh + setup").
- memory per child: RSS, PSS and USS (private pages: what one more costs) of each
  child's QEMU after a settle, branch children against fresh ones after their setup.

Medians over ``--rounds`` rounds, for n in ``--n`` (default 1 and 4).

    python bench/livefork.py --write docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from container import start_server, write_section  # noqa: E402
from vm import memory_kb, private_data_dir, qemu_pid  # noqa: E402

import dsec  # noqa: E402
from dsec.node.host.prep import prepare_cgroups  # noqa: E402


def hold_cmd(mib: int) -> str:
    """A background process that writes ``mib`` MiB of its memory and keeps it."""
    return (f"(python3 -c 'import time; b = bytearray({mib} << 20); b[::4096] = b\"x\" * len(b[::4096]); "
            "time.sleep(1e6)' >/dev/null 2>&1 &); sleep 0.5")


async def first_exec(sb: dsec.AsyncSandbox) -> None:
    r = await sb.exec("true")
    assert r.exit_code == 0


async def fresh(c: dsec.AsyncClient, memory_mb: int) -> dsec.AsyncSandbox:
    sb = await c.run_microvm(dsec.MicroVMArgs(memory_mb=memory_mb), timeout=600)
    await first_exec(sb)
    return sb


def mem(children: list[dsec.AsyncSandbox]) -> list[tuple[int, int, int]]:
    return [memory_kb(qemu_pid(ch.sandbox_id)) for ch in children]


async def round_(c: dsec.AsyncClient, parent: dsec.AsyncSandbox, n: int, a: argparse.Namespace,
                 out: dict[str, list[float]]) -> None:
    t0 = time.monotonic()
    kids = await parent.branch(n, timeout=600)
    await asyncio.gather(*(first_exec(k) for k in kids))
    out["branch_s"].append(time.monotonic() - t0)
    ev = [e.message for e in await parent.events() if e.kind == "branched"][-1]
    out["pause_ms"].append(float(re.search(r"paused ([\d.]+) ms", ev).group(1)))  # type: ignore[union-attr]
    held = [(await k.exec(["pgrep", "-f", "bytearray"])).exit_code == 0 for k in kids]
    assert all(held), "a child lost the parent's process"
    await asyncio.sleep(a.settle)
    for rss, pss, uss in mem(kids):
        out["branch_rss"].append(rss / 1024)
        out["branch_pss"].append(pss / 1024)
        out["branch_uss"].append(uss / 1024)
    await asyncio.gather(*(k.stop() for k in kids))

    t0 = time.monotonic()
    fresh_kids = await asyncio.gather(*(fresh(c, a.memory_mb) for _ in range(n)))
    out["fresh_s"].append(time.monotonic() - t0)
    await asyncio.gather(*(k.run_shell(hold_cmd(a.hold_mib)) for k in fresh_kids))
    out["fresh_setup_s"].append(time.monotonic() - t0)
    await asyncio.sleep(a.settle)
    for rss, pss, uss in mem(list(fresh_kids)):
        out["fresh_rss"].append(rss / 1024)
        out["fresh_pss"].append(pss / 1024)
        out["fresh_uss"].append(uss / 1024)
    await asyncio.gather(*(k.stop() for k in fresh_kids))


def render(a: argparse.Namespace, res: dict[int, dict[str, list[float]]], accel: str) -> str:
    med = statistics.median
    lines = [f"microVM parent: {a.memory_mb} MiB guest, a process holding {a.hold_mib} MiB written; accelerator "
             f"{accel}; {os.cpu_count()} cores, kernel {platform.release()}; medians of {a.rounds} rounds "
             f"(memory: of every child of every round, after {a.settle:g} s idle).", "",
             "| n | branch: all n answering (s) | per child (s) | parent paused (ms) | fresh creates (s) | "
             "per child (s) | fresh + setup (s) | branch / fresh | branch / (fresh + setup) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for n, r in res.items():
        b, f, fs = med(r["branch_s"]), med(r["fresh_s"]), med(r["fresh_setup_s"])
        lines.append(f"| {n} | {b:.2f} | {b / n:.2f} | {med(r['pause_ms']):.0f} | {f:.2f} | {f / n:.2f} | "
                     f"{fs:.2f} | {b / f:.2f} | {b / fs:.2f} |")
    lines += ["", "| n | child QEMU RSS (MiB) | PSS | USS (its own pages) | fresh + setup RSS | PSS | USS | "
              "USS branch / fresh |", "|---|---|---|---|---|---|---|---|"]
    for n, r in res.items():
        lines.append(f"| {n} | {med(r['branch_rss']):.0f} | {med(r['branch_pss']):.0f} | {med(r['branch_uss']):.0f} "
                     f"| {med(r['fresh_rss']):.0f} | {med(r['fresh_pss']):.0f} | {med(r['fresh_uss']):.0f} | "
                     f"{med(r['branch_uss']) / med(r['fresh_uss']):.2f} |")
    return "\n".join(lines)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--memory-mb", type=int, default=512)
    ap.add_argument("--hold-mib", type=int, default=128)
    ap.add_argument("--settle", type=float, default=3.0)
    ap.add_argument("--data-dir", default=os.environ.get("DSEC_DATA_DIR", "/var/lib/dsec"))
    ap.add_argument("--write", metavar="MARKDOWN", help="replace this benchmark's section in that file")
    a = ap.parse_args()
    prepare_cgroups()
    data_dir = private_data_dir(a.data_dir)
    with open(os.path.join(data_dir, "vm", "accel.json")) as f:
        accel = json.load(f)["accel"]
    token = "bench-" + os.urandom(8).hex()
    proc, url = start_server(data_dir, token, log=os.path.join(data_dir, "serve.log"))
    res: dict[int, dict[str, list[float]]] = {}
    try:
        async with dsec.AsyncClient(url=url, token=token, timeout=600) as c:
            await (await fresh(c, a.memory_mb)).stop()  # the template is built once, outside the timings
            parent = await fresh(c, a.memory_mb)
            await parent.run_shell(hold_cmd(a.hold_mib))
            try:
                for n in a.n:
                    res[n] = {k: [] for k in ("branch_s", "pause_ms", "fresh_s", "fresh_setup_s", "branch_rss",
                                              "branch_pss", "branch_uss", "fresh_rss", "fresh_pss", "fresh_uss")}
                    for i in range(a.rounds):
                        await round_(c, parent, n, a, res[n])
                        print(n, i, {k: round(v[-1], 2) for k, v in res[n].items()}, flush=True)
            finally:
                await parent.stop()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        shutil.rmtree(data_dir, ignore_errors=True)
    body = render(a, res, accel)
    print(body)
    if a.write:
        write_section(a.write, body, "python bench/livefork.py --write docs/benchmarks.md", name="livefork",
                      title="Live branch of a running microVM (`bench/livefork.py`)")


if __name__ == "__main__":
    asyncio.run(main())
