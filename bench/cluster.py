"""dsec across Ray nodes, measured on this machine (dsec.control.cluster.local: raylets, a private
PostgreSQL, a MooseFS store; every hop is real, every machine is this one).

1. The hop: exec round trip and create to first exec through an apiserver replica to an
   edge daemon on another Ray node, against the embedded platform (``dsec serve``), in one
   run, alternating rounds. Targets (issue 17): <= +1 ms per exec, <= +5 ms per create.
2. Creations/s with 1, 2 and 3 edges (nodes join one by one, as they would), and the CPU
   time one create costs in each component (replicas, edge daemons with their crun and
   helpers, the controller, PostgreSQL), read from /proc before and after: on 2 cores the
   rate is CPU bound, so these costs are what predicts it elsewhere (bench/cluster_model.py
   takes them as inputs).

3. ``--steps`` (a run of its own, tracing on): where a create's time goes outside the edge,
   step by step, read from the spans the replica and the edge daemon export (the hot path's
   receiver, bench/hotpath.py), beside the embedded platform's same steps.

    .venv/bin/python bench/cluster.py --write docs/benchmarks.md
    .venv/bin/python bench/cluster.py --steps [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import httpx  # noqa: E402
from container import pct, private_server, report  # noqa: E402
from hotpath import Spans  # noqa: E402
from remote_edge import _create_first_exec, _exec_rtts  # noqa: E402

import dsec  # noqa: E402
from dsec.control.cluster import ops  # noqa: E402
from dsec.control.cluster.local import LocalCluster  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int, children: bool = True) -> float:
    """utime + stime (and the reaped children's: crun, mount helpers) of a process, in s."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = int(fields[11]) + int(fields[12]) + (int(fields[13]) + int(fields[14]) if children else 0)
    return ticks / TICK


def pids_matching(pattern: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def components(local: LocalCluster) -> dict[str, list[int]]:
    """The processes of each component of the cluster, by what runs them."""
    return {
        "apiserver replicas": pids_matching(f"dsec.client.cli.main apiserver .*{local.root}"),
        "edge daemons": pids_matching(f"dsec.client.cli.main edge serve .*{local.root}"),
        "lazy layer readers": pids_matching(f"lazyfs --mount {local.root}"),
        "controller (watcher)": pids_matching("ray::Controller"),
        "PostgreSQL": pids_matching(f"postgres.*{local.pg_root}") + pids_matching("postgres: "),
    }


def cpu_of(comp: dict[str, list[int]]) -> dict[str, float]:
    return {name: sum(cpu_s(p) for p in pids) for name, pids in comp.items()}


Samples = dict[str, dict[str, list[float]]]  # setup -> measure -> samples


async def hop(urls: dict[str, tuple[str, str]], rounds: int, execs: int, creates: int) -> Samples:
    res: Samples = {k: {"exec": [], "create": [], "outside": []} for k in urls}
    clients = {k: dsec.AsyncClient(url=u, token=t) for k, (u, t) in urls.items()}
    sbs = {k: await c.run_container(dsec.ContainerArgs(image="base/busybox")) for k, c in clients.items()}
    try:
        for k, sb in sbs.items():
            await _exec_rtts(sb, 20)
            await _create_first_exec(clients[k], 2)
        for _ in range(rounds):
            for k in urls:
                res[k]["exec"] += await _exec_rtts(sbs[k], execs)
                total, outside = await _create_first_exec(clients[k], creates)
                res[k]["create"] += total
                res[k]["outside"] += outside
    finally:
        for k, sb in sbs.items():
            await sb.stop()
            await clients[k].close()
    return res


async def live_replica(local: LocalCluster) -> str:
    """The replica's URL once it answers (a restarted replica listens on a new free port)."""
    for _ in range(600):
        url = str(ops.status(local.address)["apiservers"].get("apiserver:0", ""))
        if url and answers(url):
            return url
        await asyncio.sleep(0.2)
    raise RuntimeError("the apiserver replica did not come back")


def answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


async def burst(url: str, token: str, n: int, conc: int) -> tuple[float, int]:
    """n creates (conc at once), each stopped once made; returns (creations/s, failures)."""
    gate = asyncio.Semaphore(conc)
    made: list[dsec.AsyncSandbox] = []
    failed = 0
    async with dsec.AsyncClient(url=url, token=token) as c:
        async def one() -> None:
            nonlocal failed
            async with gate:
                try:
                    made.append(await c.run_container(dsec.ContainerArgs(image="base/busybox", job="bench-rate")))
                except dsec.DsecError:
                    failed += 1
        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        rate = len(made) / (time.perf_counter() - t0)
        await c.stop_many(job="bench-rate")
    return rate, failed


def render(h: Samples, rates: list[dict[str, Any]], a: argparse.Namespace) -> str:
    med = statistics.median
    e, c = h["embedded"], h["cluster"]

    def row(name: str, key: str) -> str:
        x, y = med(e[key]), med(c[key])
        return f"| {name} | {x:.2f} ms | {y:.2f} ms | {y - x:+.2f} ms | {y / x:.2f}x |"

    lines = [
        f"Machine: {os.cpu_count()} cores, {platform.machine()}, Linux {platform.release()}; busybox sandboxes; "
        f"every node, replica, edge, the database and the store on this one machine (loopback).",
        "",
        f"The hop ({a.rounds} rounds alternating the two setups, each {a.execs} execs and {a.creates} creates; "
        "medians):",
        "",
        "| | embedded (`dsec serve`) | cluster (SDK -> replica -> edge on another Ray node) | hop | ratio |",
        "|---|---|---|---|---|",
        row("exec round trip (`true`)", "exec"),
        row("create to first exec", "create"),
        row("of a create, time outside the edge's own create", "outside"),
        "",
        f"Targets: <= +1 ms per exec (measured {med(c['exec']) - med(e['exec']):+.2f} ms), <= +5 ms per create "
        f"(measured {med(c['outside']) - med(e['outside']):+.2f} ms, read outside the edge's own create, which "
        "varies by tens of ms from one create to the next).",
        "",
        f"Creations/s as edges join ({a.burst} creates of busybox sandboxes, {a.conc} at once, each stopped "
        "after; CPU seconds per create in each component, from /proc):",
        "",
        "| edges | creations/s | failed | " + " | ".join(f"CPU ms/create: {k}" for k in rates[0]["cpu"]) + " |",
        "|---|---|---|" + "---|" * len(rates[0]["cpu"]),
    ]
    for r in rates:
        lines.append(f"| {r['edges']} | {r['rate']:.1f} | {r['failed']} | "
                     + " | ".join(f"{v * 1000 / r['made']:.1f}" for v in r["cpu"].values()) + " |")
    total = [sum(r["cpu"].values()) * 1000 / r["made"] for r in rates]
    lines += ["", f"All components together: {', '.join(f'{t:.0f}' for t in total)} CPU ms per create with "
              f"{', '.join(str(r['edges']) for r in rates)} edges. On {os.cpu_count()} cores that bounds the rate "
              f"at about {os.cpu_count() or 1} / that (the edges' share is the edge daemons, their crun and mount "
              "helpers and lazy readers; a real node brings its own cores, so the rate scales with the edges while "
              "the replica share stays per create)."]
    return "\n".join(lines)


# (label, the embedded platform's span, the replica's or edge daemon's span)
STEPS = [
    ("POST /v1/sandboxes (the apiserver's whole answer)", "dsec-serve:POST /v1/sandboxes",
     "dsec-apiserver:POST /v1/sandboxes"),
    ("quota.admit (SQLite / PostgreSQL)", "dsec-serve:quota.admit", "dsec-apiserver:quota.admit"),
    ("placement.choose", "dsec-serve:placement.choose", "dsec-apiserver:placement.choose"),
    ("edge.create, as the apiserver sees it (in process / RPC)", "dsec-serve:edge.create",
     "dsec-apiserver:edge.create"),
    ("the edge's own create", "dsec-serve:edge.create", "dsec-edge:edge.call create"),
    ("quota.bind", "dsec-serve:quota.bind", "dsec-apiserver:quota.bind"),
    ("index.put (the cluster's sandbox index)", "-", "dsec-apiserver:index.put"),
]


async def steps(a: argparse.Namespace) -> str:
    """n creates (and stops) on each platform, sequential, tracing on; the steps' p50."""
    spans = Spans(by_service=True)  # the embedded platform, the replica and the edge daemon
    runner, endpoint = await spans.start()
    saved = dict(os.environ)
    os.environ.update({"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"})
    root = tempfile.mkdtemp(prefix="dsec-bench-cluster-")
    local = LocalCluster(root, ("b1",), os.path.join(a.data_dir, "layers"), {"base/busybox:latest"}, apiservers=1)
    emb_proc, emb_url, emb_token, emb_dir = private_server(a.data_dir)
    try:
        up = local.start()
        os.environ.clear()  # the bench's own client traces nothing
        os.environ.update(saved)
        for url, token, services in ((emb_url, emb_token, ("dsec-serve:",)),
                                     (up.apiservers[0], up.token, ("dsec-apiserver:", "dsec-edge:"))):
            async with dsec.AsyncClient(url=url, token=token) as c:
                for i in range(a.creates * a.rounds + 3):
                    sb = await c.run_container(dsec.ContainerArgs(image="base/busybox"))
                    await sb.stop()
                    if i == 2:  # the first creates warm caches: their spans are dropped
                        await asyncio.sleep(1.0)
                        for k in [k for k in spans.ms if k.startswith(services)]:
                            del spans.ms[k]
        await asyncio.sleep(1.0)  # the last batch of spans
    finally:
        os.environ.clear()
        os.environ.update(saved)
        emb_proc.send_signal(signal.SIGTERM)
        emb_proc.wait(timeout=60)
        local.stop()
        await runner.cleanup()
        shutil.rmtree(emb_dir, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)

    def p50(key: str) -> float:
        xs = spans.ms.get(key) or []
        return pct(xs, 50) if xs else float("nan")
    n = len(spans.ms.get("dsec-serve:POST /v1/sandboxes", []))
    out = [f"{n} sequential creates (busybox) on each, tracing on, p50 of each span; one edge on its own Ray node, "
           f"one replica, PostgreSQL; {os.cpu_count()} cores.", "",
           "| step | embedded (`dsec serve`) ms | cluster ms |", "|---|---:|---:|"]
    for label, emb, clu in STEPS:
        out.append(f"| {label} | {'-' if emb == '-' else f'{p50(emb):.2f}'} | {p50(clu):.2f} |")
    emb_out = p50("dsec-serve:POST /v1/sandboxes") - p50("dsec-serve:edge.create")
    clu_out = p50("dsec-apiserver:POST /v1/sandboxes") - p50("dsec-edge:edge.call create")
    rpc = p50("dsec-apiserver:edge.create") - p50("dsec-edge:edge.call create")
    out.append(f"| **outside the edge** (the answer less the edge's own create) | {emb_out:.2f} | {clu_out:.2f} |")
    out.append(f"| of which the RPC to the edge daemon | - | {rpc:.2f} |")
    return "\n".join(out)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--execs", type=int, default=200)
    ap.add_argument("--creates", type=int, default=10)
    ap.add_argument("--burst", type=int, default=48)
    ap.add_argument("--conc", type=int, default=8)
    ap.add_argument("--data-dir", default=os.environ.get("DSEC_DATA_DIR", "/var/lib/dsec"))
    ap.add_argument("--write", metavar="MARKDOWN", help="replace this benchmark's section in that file")
    ap.add_argument("--steps", action="store_true", help="only the per-step cost of a create outside the edge")
    a = ap.parse_args()
    if a.steps:
        report(await steps(a), a.write, "cluster.py --steps", "cluster-steps",
               "Cluster: a create's steps outside the edge (`bench/cluster.py --steps`)")
        return
    root = tempfile.mkdtemp(prefix="dsec-bench-cluster-")
    local = LocalCluster(root, ("b1", "b2"), os.path.join(a.data_dir, "layers"), {"base/busybox:latest"},
                         apiservers=1)
    emb_proc, emb_url, emb_token, emb_dir = private_server(a.data_dir)
    rates: list[dict[str, Any]] = []
    lost_s = float("nan")
    try:
        up = local.start()
        # the replica on one node, the sandbox on the other: every create and exec crosses nodes
        h = await hop({"embedded": (emb_url, emb_token), "cluster": (up.apiservers[0], up.token)},
                      a.rounds, a.execs, a.creates)
        emb_proc.send_signal(signal.SIGTERM)
        emb_proc.wait(timeout=60)
        local.remove_node("b2", graceful=True)  # the rate series starts at one edge, then nodes join
        await asyncio.sleep(3)
        for edges, join in ((1, None), (2, "b2"), (3, "b3")):
            url = await live_replica(local)  # it may have been on a removed node: Ray restarted it elsewhere
            if join:
                local.add_node(join)
                async with dsec.AsyncClient(url=url, token=up.token) as c:
                    for _ in range(600):
                        serving = {n.edge for n in await c.nodes() if n.healthy}
                        if join in serving and len(serving) >= edges:
                            break
                        await asyncio.sleep(0.2)
            comp = components(local)
            before = cpu_of(comp)
            rate, failed = await burst(url, up.token, a.burst, a.conc)
            after = cpu_of(comp)
            rates.append({"edges": edges, "rate": rate, "failed": failed, "made": a.burst - failed,
                          "cpu": {k: after[k] - before[k] for k in comp}})
            print(rates[-1], flush=True)
        # a node dies (its raylet killed): until the cluster reports its edge lost
        t0 = time.perf_counter()
        local.remove_node("b3")
        while not any(e["name"] == "b3" and e["state"] == "lost" for e in ops.status(local.address)["edges"]):
            await asyncio.sleep(0.1)
        lost_s = time.perf_counter() - t0
    finally:
        if emb_proc.poll() is None:
            emb_proc.send_signal(signal.SIGTERM)
            emb_proc.wait(timeout=60)
        local.stop()
        shutil.rmtree(emb_dir, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    report(render(h, rates, a) + f"\n\nA node whose raylet is killed is reported lost {lost_s:.1f} s later "
           "(Ray's health check at 1 s x 3, as dsec.control.cluster.local sets it, plus the controller's 1 s round; "
           "with Ray's "
           "default 3 s x 5 it is ~16 s).", a.write, "cluster.py", "cluster",
           "Cluster on Ray: the hop and creations/s as edges join (`bench/cluster.py`)")


if __name__ == "__main__":
    asyncio.run(main())
