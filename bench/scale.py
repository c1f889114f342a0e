"""The control plane at DSec's scale, measured on this machine (docs/scale.md): a real
PostgreSQL, real apiserver replicas (``dsec apiserver --db``), a controller's watcher (the
fleet view written to the registry once a second), and N hollow edges (``dsec edge
hollow``: the real edge over a runtime that starts no process and mounts nothing), with
projects nested 3 deep (quotas on each) and one RL job.

  a. sustained creations/s for one project tree as replicas go 1, 2, 4 (closed loop, a
     fixed number of clients per replica), and the CPU ms one create costs in each
     component (replicas, PostgreSQL, the controller, the hollow edges), read from /proc;
  b. one batch of --batch sandboxes (32K) in one call: time to accept, time until all run,
     per-item p50/p99 (made at, from the batch's accept), and, counted from the edges' own
     lists, none lost and none made twice;
  c. --sandboxes held in all: replica and controller RSS, one fleet-view round's time,
     a list by job, the console's query p99, the quota sweep's reads (holds + list);
  d. (--chaos) a replica SIGKILLed and PostgreSQL restarted in the middle of a batch:
     nothing accepted is lost or doubled (counted from the edges).

    .venv/bin/python bench/scale.py --edges 160 --replicas 1,2,4 --sandboxes 40000 \
        [--fleets 2] [--batch 32768] [--chaos] [--json FILE] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
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
from cluster import cpu_s  # noqa: E402
from container import write_section  # noqa: E402

import dsec  # noqa: E402
from dsec.control.cluster.postgres import Postgres  # noqa: E402
from dsec.shared.wire.iam import ProjectQuota  # noqa: E402
from dsec.shared.wire.jobs import JobQuota  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TOKEN = "scale-bench-admin-token"
SECRET = "scale-bench-cluster-secret"
PROJECT, JOB = "rl/team/grpo", "grpo"
ARGS = dict(image="base/busybox", memory_limit_mb=512, cpu_cores_limit=1.0)
CLI = [sys.executable, "-m", "dsec.client.cli.main"]


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def pg_pids(data_dir: str) -> list[int]:
    """The postmaster of ``data_dir`` and its children (backends, WAL writer, ...)."""
    try:
        with open(os.path.join(data_dir, "postmaster.pid")) as f:
            master = int(f.readline())
    except (OSError, ValueError):
        return []
    out = subprocess.run(["pgrep", "-P", str(master)], capture_output=True, text=True).stdout
    return [master, *(int(p) for p in out.split())]


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.root = tempfile.mkdtemp(prefix="dsec-scale-")
        os.chmod(self.root, 0o711)  # PostgreSQL runs as its own user
        self.pg = Postgres(os.path.join(self.root, "pg"), port=_free_port())
        self.db = ""
        self.key = os.path.join(self.root, "cluster.key")
        with open(self.key, "w") as f:
            f.write(SECRET + "\n")
        self.fleets: list[subprocess.Popen[str]] = []
        self.controller: subprocess.Popen[bytes] | None = None
        self.replicas: list[tuple[subprocess.Popen[bytes], str]] = []

    # ---- the cluster ---------------------------------------------------------------
    def start(self) -> None:
        self.db = self.pg.start()
        t0 = time.monotonic()
        # the edges split over --fleets processes (each one event loop, one core at most):
        # edges h0.. in the first, the next share in the second, and so on
        n, k = self.a.edges, self.a.fleets
        bounds = [n * i // k for i in range(k + 1)]
        for i in range(k):
            count = bounds[i + 1] - bounds[i]
            self.fleets.append(subprocess.Popen(
                [*CLI, "edge", "hollow", "--count", str(count), "--first", str(bounds[i]), "--db", self.db,
                 "--secret-file", self.key, "--data-root", os.path.join(self.root, "edges"),
                 "--max-sandboxes", str(self.a.per_edge), "--sweep-s", str(self.a.sweep_s)],
                stdout=subprocess.PIPE, stderr=open(os.path.join(self.root, f"fleet{i}.log"), "w"), text=True,
                cwd=ROOT))
        for i, f in enumerate(self.fleets):
            assert f.stdout is not None
            for _ in range(bounds[i + 1] - bounds[i]):
                if not f.stdout.readline():
                    raise RuntimeError(f"hollow fleet {i} ended; see {self.root}/fleet{i}.log")
        self.fleet_up_s = time.monotonic() - t0
        self.controller = subprocess.Popen([sys.executable, __file__, "--controller", self.db, self.key], cwd=ROOT,
                                           stderr=open(os.path.join(self.root, "controller.log"), "w"))
        for i in range(max(self.a.replicas)):
            self.replicas.append(self._replica(i))
        self._wait_healthy([u for _, u in self.replicas])

    def _replica(self, i: int, port: int | None = None) -> tuple[subprocess.Popen[bytes], str]:
        port = port or _free_port()
        d = os.path.join(self.root, f"api{i}")
        os.makedirs(d, exist_ok=True)
        p = subprocess.Popen([*CLI, "apiserver", "--db", self.db, "--secret-file", self.key, "--data-dir", d,
                              "--token", TOKEN, "--port", str(port), "--log-level", "warning"], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=open(os.path.join(d, "apiserver.log"), "a"))
        return p, f"http://127.0.0.1:{port}"

    @staticmethod
    def _wait_healthy(urls: list[str], timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        for u in urls:
            while True:
                try:
                    if httpx.get(f"{u}/healthz", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"replica {u} did not come up")
                time.sleep(0.2)

    def stop(self) -> None:
        for p, _ in self.replicas:
            p.terminate()
        for p in [self.controller, *self.fleets]:
            if p is not None:
                p.terminate()
        for p in [*(p for p, _ in self.replicas), self.controller, *self.fleets]:
            if p is not None:
                try:
                    p.wait(600)  # the fleet stops every hollow sandbox it holds first
                except subprocess.TimeoutExpired:
                    p.kill()
        self.pg.remove()
        for i in range(self.a.edges):  # a fleet killed leaves its edges' per-boot dirs
            d = os.path.join(self.root, "edges", f"h{i}")
            shutil.rmtree(f"/run/dsec/{hashlib.sha1(d.encode()).hexdigest()[:8]}-h{i}", ignore_errors=True)
        shutil.rmtree(self.root, ignore_errors=True)

    def fleet_rss_mb(self) -> int:
        return round(sum(rss_mb(f.pid) for f in self.fleets))

    def cpu(self, replicas: int) -> dict[str, float]:
        assert self.fleets and self.controller is not None
        return {"replicas": sum(cpu_s(p.pid, children=False) for p, _ in self.replicas[:replicas]),
                "postgresql": sum(cpu_s(p, children=False) for p in pg_pids(self.pg.data_dir)),
                "controller": cpu_s(self.controller.pid, children=False),
                "hollow edges": sum(cpu_s(f.pid, children=False) for f in self.fleets)}

    async def setup_tree(self) -> str:
        async with dsec.AsyncClient(url=self.replicas[0][1], token=TOKEN) as admin:
            big = ProjectQuota(sandboxes=2_000_000, cpu_cores=2_000_000, memory_mb=2_000_000_000)
            for name in ("rl", "rl/team", PROJECT):
                await admin.projects.create(name, big)
            await admin.create_job(JOB, quota=JobQuota(), project=PROJECT)
            return (await admin.create_token(PROJECT, "runner", "bench")).token


# ---- a. sustained creations/s ----------------------------------------------------------
async def sustained(b: Bench, token: str, replicas: int) -> dict[str, Any]:
    urls = [u for _, u in b.replicas[:replicas]]
    clients = [dsec.AsyncClient(url=u, token=token) for u in urls]
    args = dsec.ContainerArgs(job=JOB, **ARGS)  # type: ignore[arg-type]
    made = failed = 0
    stop_at = 0.0

    async def worker(c: dsec.AsyncClient) -> None:
        nonlocal made, failed
        while time.monotonic() < stop_at:
            try:
                await c.run_container(args)
                made += 1
            except dsec.DsecError:
                failed += 1

    try:
        # warm: each client's connection, each replica's caches
        await asyncio.gather(*(c.run_container(args) for c in clients))
        before, t0 = b.cpu(replicas), time.monotonic()
        stop_at = t0 + b.a.seconds
        await asyncio.gather(*(worker(c) for c in clients for _ in range(b.a.clients)))
        took = time.monotonic() - t0
        after = b.cpu(replicas)
    finally:
        for c in clients:
            await c.close()
    per = {k: (after[k] - before[k]) * 1000 / max(made, 1) for k in after}
    return {"replicas": replicas, "clients": b.a.clients * replicas, "seconds": round(took, 1), "made": made,
            "failed": failed, "creations_per_s": round(made / took, 1),
            "cpu_ms_per_create": {k: round(v, 2) for k, v in per.items()},
            "control_plane_cpu_ms_per_create": round(per["replicas"] + per["postgresql"] + per["controller"], 2)}


# ---- b / d. one big batch --------------------------------------------------------------
async def big_batch(b: Bench, token: str, n: int, chaos: bool) -> dict[str, Any]:
    url = b.replicas[0][1]
    args = dsec.ContainerArgs(job=JOB, **ARGS)  # type: ignore[arg-type]
    async with dsec.AsyncClient(url=url, token=token) as c:
        t0 = time.time()
        batch = await c.create_many(args, n, all_or_nothing=b.a.gang)
        accepted = time.time()
    out: dict[str, Any] = {"n": n, "all_or_nothing": b.a.gang, "accept_s": round(accepted - t0, 3)}
    done_at = None
    events: list[str] = []
    killed = restarted = False
    deadline = time.monotonic() + b.a.batch_timeout
    while time.monotonic() < deadline:
        live = [u for p, u in b.replicas if p.poll() is None]
        try:
            async with dsec.AsyncClient(url=live[-1], token=token) as c:
                info = await (await c.batch(batch.id)).get()
        except (dsec.DsecError, httpx.HTTPError, OSError) as e:
            events.append(f"{time.time() - t0:.1f}s progress unread: {type(e).__name__}")
            await asyncio.sleep(1)
            continue
        ran = info.counts.running + info.counts.failed + info.counts.cancelled
        if chaos and not killed and ran >= n * 0.3:
            b.replicas[0][0].send_signal(signal.SIGKILL)  # the batch's owner
            killed = True
            events.append(f"{time.time() - t0:.1f}s replica 0 (the batch's owner) SIGKILLed at {ran} items")
        if chaos and killed and not restarted and ran >= n * 0.6:
            b.pg.stop()
            events.append(f"{time.time() - t0:.1f}s PostgreSQL stopped at {ran} items")
            await asyncio.sleep(2)
            b.pg.start()
            restarted = True
            events.append(f"{time.time() - t0:.1f}s PostgreSQL back")
        if info.state != "running" and info.finished_at:
            done_at = info.finished_at
            out["state"] = info.state
            out["counts"] = info.counts.model_dump()
            if info.counts.failed:
                async with dsec.AsyncClient(url=live[-1], token=token) as c:
                    recent = await c._json("GET", "/v1/batches", params={"limit": 5})
                out["failure_reasons"] = next((x["failure_reasons"] for x in recent if x["id"] == batch.id), {})
            break
        await asyncio.sleep(0.5)
    out["events"] = events
    out["all_run_s"] = round(done_at - t0, 1) if done_at else None
    # counted from the edges' own lists: each item's sandbox once
    live_url = [u for p, u in b.replicas if p.poll() is None][-1]
    async with dsec.AsyncClient(url=live_url, token=token) as c:
        listed = await c.list(job=JOB)
    mine = [s for s in listed if s.labels.get("dsec.batch", "").startswith(batch.id + "/")]
    idx = [int(s.labels["dsec.batch"].rsplit("/", 1)[1]) for s in mine]
    made_at = sorted(s.created_at - accepted for s in mine)
    failed = (out.get("counts") or {}).get("failed", 0) + (out.get("counts") or {}).get("cancelled", 0)
    # lost: accepted, yet neither made (a sandbox on an edge) nor given an outcome saying why not
    out.update(made=len(mine), distinct_items=len(set(idx)), doubled=len(idx) - len(set(idx)),
               not_made=failed, lost=n - len(set(idx)) - failed)
    if made_at:
        out["item_p50_s"] = round(statistics.median(made_at), 2)
        out["item_p99_s"] = round(made_at[min(len(made_at) - 1, int(len(made_at) * 0.99))], 2)
        out["made_per_s"] = round(len(made_at) / max(made_at[-1], 1e-3), 1)
    if chaos and killed:  # the killed replica back, for what follows
        b.replicas[0] = b._replica(0)
        b._wait_healthy([b.replicas[0][1]])
        out.update(await quota_settles(b))
    return out


async def quota_settles(b: Bench, within_s: float = 300.0) -> dict[str, Any]:
    """After the chaos: the project tree's usage comes back to what the edges hold (the
    killed replica's quota block freed by the sweep, its creates in flight adopted)."""
    t0 = time.monotonic()
    usage = held = -1
    async with dsec.AsyncClient(url=b.replicas[-1][1], token=TOKEN) as admin:
        while time.monotonic() - t0 < within_s:
            held = sum(n.sandboxes for n in await admin.nodes())
            usage = (await admin.projects.get("rl")).usage.sandboxes
            if usage == held:
                break
            await asyncio.sleep(2)
    return {"quota_usage": usage, "quota_edges_hold": held, "quota_settled": usage == held,
            "quota_settled_s": round(time.monotonic() - t0, 1)}


async def fill(b: Bench, token: str, to: int, within_s: float) -> dict[str, Any]:
    """Batches until the job holds ``to`` sandboxes (the edges' count), or ``within_s`` has
    passed (the batch under way is then cancelled: (c) is measured at what is held)."""
    async with dsec.AsyncClient(url=b.replicas[0][1], token=TOKEN) as admin:
        held = sum(n.sandboxes for n in await admin.nodes())
    args = dsec.ContainerArgs(job=JOB, **ARGS)  # type: ignore[arg-type]
    t0 = time.monotonic()
    rates = []
    while held < to and time.monotonic() - t0 < within_s:
        k, t1, before = min(32_768, to - held), time.monotonic(), held
        async with dsec.AsyncClient(url=b.replicas[0][1], token=token) as c:
            batch = await c.create_many(args, k)
            try:
                await asyncio.wait_for(batch.wait(timeout=3600), max(1.0, within_s - (time.monotonic() - t0)))
            except TimeoutError:
                await batch.cancel()
        async with dsec.AsyncClient(url=b.replicas[0][1], token=TOKEN) as admin:
            held = sum(n.sandboxes for n in await admin.nodes())
        rates.append([held, round((held - before) / (time.monotonic() - t1), 1)])
        print(json.dumps({"held": held, "per_s": rates[-1][1]}), flush=True)
    return {"held": held, "wanted": to, "fill_s": round(time.monotonic() - t0), "per_s_by_held": rates}


# ---- c. holding S sandboxes --------------------------------------------------------------
async def holding(b: Bench, token: str) -> dict[str, Any]:
    from dsec.control.cluster.view import ClusterEdges
    from dsec.control.iam.quota import ProjectQuotas
    from dsec.shared.meta import open_db
    from dsec.shared.meta.registry import Registry

    out: dict[str, Any] = {}
    engine = open_db(b.db)
    view = ClusterEdges(Registry(engine), SECRET, poll=True)
    try:
        await view.refresh()  # connections made
        t0 = time.monotonic()
        await view.refresh()
        out["fleet_view_round_s"] = round(time.monotonic() - t0, 3)
    finally:
        await view.close()
    t0 = time.monotonic()
    holds = ProjectQuotas(engine).holds()
    out["quota_holds_read_s"] = round(time.monotonic() - t0, 3)
    out["quota_holds"] = len(holds)
    engine.dispose()
    url = b.replicas[0][1]
    async with dsec.AsyncClient(url=url, token=token, timeout=600) as c:
        t0 = time.monotonic()
        listed = await c.list(job=JOB)
        out["list_by_job_s"] = round(time.monotonic() - t0, 2)
        out["listed"] = len(listed)
    async with dsec.AsyncClient(url=url, token=TOKEN, timeout=600) as admin:
        t0 = time.monotonic()
        everything = await admin.list()
        out["list_all_s (the sweep's listing)"] = round(time.monotonic() - t0, 2)
        out["sandboxes"] = len(everything)
    lat = []
    async with httpx.AsyncClient(timeout=120) as h:
        for _ in range(20):
            t0 = time.monotonic()
            r = await h.get(f"{url}/v1/console/sandboxes", params={"job": JOB, "limit": 50},
                            headers={"Authorization": f"Bearer {token}"})
            lat.append(time.monotonic() - t0)
            assert r.status_code == 200, r.text
    lat.sort()
    out["console_query_p50_ms"] = round(lat[len(lat) // 2] * 1000, 1)
    out["console_query_p99_ms"] = round(lat[-1] * 1000, 1)
    out["replica_rss_mb"] = [round(rss_mb(p.pid)) for p, _ in b.replicas]
    assert b.controller is not None and b.fleets
    out["controller_rss_mb"] = round(rss_mb(b.controller.pid))
    out["hollow_fleet_rss_mb"] = b.fleet_rss_mb()
    out["rss_per_hollow_edge_mb"] = round(b.fleet_rss_mb() / b.a.edges, 1)
    return out


def render(r: dict[str, Any], a: argparse.Namespace) -> str:
    lines = [f"{a.edges} hollow edges in {a.fleets} process(es) (up in {r['fleet_up_s']:.1f} s, "
             f"{r['hollow_rss_at_start_mb']} MB, "
             f"{r['hollow_rss_at_start_mb'] / a.edges:.1f} MB each), PostgreSQL 15, replicas "
             f"{','.join(map(str, a.replicas))}; {platform.node()}, {os.cpu_count()} cores", "",
             "a. sustained creations/s, one project tree 3 deep, one job "
             f"({a.clients} clients per replica, {a.seconds:g} s each)", "",
             "| replicas | creations/s | x of 1 replica | replicas ms | PostgreSQL ms | controller ms | "
             "hollow edges ms | control plane ms/create |", "|---|---|---|---|---|---|---|---|"]
    base = r["sustained"][0]["creations_per_s"] if r["sustained"] else 1
    for s in r["sustained"]:
        c = s["cpu_ms_per_create"]
        lines.append(f"| {s['replicas']} | {s['creations_per_s']} | {s['creations_per_s'] / base:.2f} | "
                     f"{c['replicas']} | {c['postgresql']} | {c['controller']} | {c['hollow edges']} | "
                     f"{s['control_plane_cpu_ms_per_create']} |")
    for key, title in (("batch", "b. one batch in one call"), ("chaos", "d. a batch through a replica SIGKILL "
                                                                     "and a PostgreSQL restart")):
        if key in r:
            lines += ["", title, "", "```", json.dumps(r[key], indent=1), "```"]
    if "holding" in r:
        lines += ["", f"c. holding {r['holding'].get('sandboxes')} sandboxes", "", "```",
                  json.dumps(r["holding"], indent=1), "```"]
    return "\n".join(lines)


async def controller(db: str, key: str) -> None:
    """The controller's watcher alone: every edge polled once a second, the view written
    to the registry (what replicas read instead of polling)."""
    from dsec.control.cluster.view import ClusterEdges
    from dsec.shared.meta import open_db
    from dsec.shared.meta.registry import Registry

    with open(key) as f:
        secret = f.read().strip()
    view = ClusterEdges(Registry(open_db(db)), secret, poll=True)
    view.start()
    done = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, done.set)
    await done.wait()
    await view.close()


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--edges", type=int, default=160)
    p.add_argument("--replicas", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    p.add_argument("--clients", type=int, default=8, help="closed-loop clients per replica")
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--batch", type=int, default=32_768)
    p.add_argument("--gang", action="store_true", help="the batch all or nothing")
    p.add_argument("--batch-timeout", type=float, default=3600.0)
    p.add_argument("--chaos", type=int, default=0, help="a batch of this many through a replica SIGKILL and a "
                   "PostgreSQL restart (d)")
    p.add_argument("--sandboxes", type=int, default=0, help="hold this many in all, then measure (c)")
    p.add_argument("--per-edge", type=int, default=4096)
    p.add_argument("--fleets", type=int, default=1,
                   help="hollow edges split over this many processes (one core each at most)")
    p.add_argument("--fill-s", type=float, default=float("inf"),
                   help="stop filling toward --sandboxes after this long and measure (c) at what is held")
    p.add_argument("--sweep-s", type=float, default=20.0,
                   help="each hollow edge's TTL sweep period (all share one process: docs/scale.md)")
    p.add_argument("--json")
    p.add_argument("--write")
    p.add_argument("--controller", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.controller:
        await controller(*a.controller)
        return
    # a SIGTERM (timeout, kill) still stops what the bench started (the finally below)
    def _terminated(*_: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one (timeout's, say) must not cut the cleanup
        sys.exit(143)
    signal.signal(signal.SIGTERM, _terminated)
    b = Bench(a)
    r: dict[str, Any] = {"args": vars(a), "cores": os.cpu_count(), "host": platform.node()}
    try:
        b.start()
        r["fleet_up_s"] = b.fleet_up_s
        r["hollow_rss_at_start_mb"] = b.fleet_rss_mb()
        token = await b.setup_tree()
        r["sustained"] = []
        for n in a.replicas:
            s = await sustained(b, token, n)
            print(json.dumps(s), flush=True)
            r["sustained"].append(s)
        if a.batch:
            r["batch"] = await big_batch(b, token, a.batch, chaos=False)
            print(json.dumps(r["batch"]), flush=True)
        if a.chaos:
            r["chaos"] = await big_batch(b, token, a.chaos, chaos=True)
            print(json.dumps(r["chaos"]), flush=True)
        if a.sandboxes:
            r["filled"] = await fill(b, token, a.sandboxes, a.fill_s)
            r["holding"] = await holding(b, token)
            print(json.dumps(r["holding"]), flush=True)
    finally:
        b.stop()
    text = render(r, a)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    if a.write:
        write_section(a.write, text, ".venv/bin/python bench/scale.py " + " ".join(sys.argv[1:]), name="scale",
                      title="Control plane at DSec scale, hollow edges (`bench/scale.py`)")


if __name__ == "__main__":
    asyncio.run(main())
