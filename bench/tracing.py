"""Tracing benchmark: what OpenTelemetry tracing costs when it is on, against the same
platform with it off, in the same run (docs/tracing.md).

Two private ``dsec serve`` processes, one with tracing off (the default) and one exporting
every span over OTLP/HTTP to a receiver in this process (it decodes nothing: a collector's
cost is not dsec's). Against each, a client process (tracing as its server) measures
create-to-first-exec of busybox containers and exec round trips; the two run alternately,
several rounds, and the medians and p90s are compared.

    .venv/bin/python bench/tracing.py --write docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import textwrap

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from aiohttp import web  # noqa: E402
from container import pct, report, start_server  # noqa: E402

from dsec.node.host.prep import prepare_cgroups  # noqa: E402
from dsec.node.layers.store import LayerStore  # noqa: E402

CLIENT = textwrap.dedent("""
    import asyncio, json, sys, time
    import dsec

    async def main():
        url, token, creates, execs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
        out = {"create": [], "exec": []}
        async with dsec.AsyncClient(url=url, token=token) as c:
            for _ in range(creates):
                t = time.perf_counter()
                sb = await c.run_container(dsec.ContainerArgs(image="base/busybox", memory_limit_mb=64))
                await sb.exec("true")
                out["create"].append(time.perf_counter() - t)
                await sb.stop()
            sb = await c.run_container(dsec.ContainerArgs(image="base/busybox", memory_limit_mb=64))
            for _ in range(execs):
                t = time.perf_counter()
                await sb.exec(["true"])
                out["exec"].append(time.perf_counter() - t)
            await sb.stop()
        print(json.dumps(out))

    asyncio.run(main())
""")


class Sink:
    """An OTLP/HTTP endpoint that takes every export and counts the bytes."""

    def __init__(self) -> None:
        self.bytes = 0
        self.exports = 0

    async def receive(self, request: web.Request) -> web.Response:
        self.bytes += len(await request.read())
        self.exports += 1
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def start(self) -> tuple[web.AppRunner, str]:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/traces", self.receive)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]


async def client(url: str, token: str, env: dict[str, str], creates: int, execs: int) -> dict[str, list[float]]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", CLIENT, url, token, str(creates), str(execs),
                                                env={**os.environ, **env}, stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    assert proc.returncode == 0, out
    return dict(json.loads(out))


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--creates", type=int, default=10, help="per round")
    ap.add_argument("--execs", type=int, default=200, help="per round")
    ap.add_argument("--data-dir", default=os.environ.get("DSEC_DATA_DIR", "/var/lib/dsec"))
    ap.add_argument("--write", metavar="MARKDOWN", help="replace this benchmark's section in that file")
    a = ap.parse_args()
    prepare_cgroups()
    sink = Sink()
    runner, endpoint = await sink.start()
    traced = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}
    dirs, procs = [], []
    try:
        servers = {}
        for name, env in (("off", {}), ("on", traced)):
            d = tempfile.mkdtemp(prefix="dsec-bench-")
            dirs.append(d)
            LayerStore(os.path.join(d, "layers")).link_from(os.path.join(a.data_dir, "layers"))
            saved = dict(os.environ)
            os.environ.update(env)
            try:
                token = "bench-" + os.urandom(8).hex()
                proc, url = start_server(d, token)
            finally:
                os.environ.clear()
                os.environ.update(saved)
            procs.append(proc)
            servers[name] = (url, token, env)
        res: dict[str, dict[str, list[float]]] = {n: {"create": [], "exec": []} for n in servers}
        for r in range(a.rounds):
            for name in (("off", "on") if r % 2 == 0 else ("on", "off")):
                url, token, env = servers[name]
                got = await client(url, token, env, a.creates, a.execs)
                for k in got:
                    res[name][k] += got[k]
            print(f"round {r + 1}: " + ", ".join(
                f"{n} exec p50 {statistics.median(v['exec']) * 1000:.2f} ms" for n, v in res.items()), flush=True)
    finally:
        for p in procs:
            p.terminate()
            p.wait()
        await runner.cleanup()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    ms = 1000.0
    rows = []
    for metric, key in (("create-to-first-exec", "create"), ("exec round trip", "exec")):
        for q in (50, 90):
            off, on = pct(res["off"][key], q) * ms, pct(res["on"][key], q) * ms
            rows.append(f"| {metric} p{q} (ms) | {off:.2f} | {on:.2f} | {on / off:.2f}x |")
    spans_kb = sink.bytes / 1024
    body = "\n".join([
        f"{a.rounds} alternating rounds of {a.creates} creates and {a.execs} execs (busybox containers, "
        f"SDK -> apiserver -> edge in one `dsec serve`), {os.cpu_count()} cores. Tracing on: every span of the "
        f"SDK and the server exported over OTLP/HTTP to a local receiver ({sink.exports} exports, "
        f"{spans_kb:.0f} KiB).", "",
        "| metric | tracing off | tracing on | on / off |", "|---|---|---|---|", *rows])
    report(body, a.write, "tracing.py", "tracing", "Tracing (`bench/tracing.py`)")


if __name__ == "__main__":
    asyncio.run(main())
