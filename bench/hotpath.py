"""The hot path, step by step, against its budget (docs/performance.md).

A private ``dsec serve`` exports every span over OTLP/HTTP to a receiver in this process,
which decodes them; a client drives the operations of the hot path (create -> first exec,
exec, session command, stop, an FnCall call, pause, resume -> first exec) and times each
end to end. Each step's p50 (from the spans) and each operation's p50 (from the client)
is printed against its budget, so a regression shows which step grew. Tracing costs a
little (docs/benchmarks.md, "Tracing"); the end-to-end figures to quote are the ones of
``bench/container.py`` and ``bench/fncall.py``, measured with tracing off.

    .venv/bin/python bench/hotpath.py [--write docs/benchmarks.md]

Runs in under a minute. Exit status 0 whatever the numbers: a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import platform
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from aiohttp import web  # noqa: E402
from container import pct, start_server, write_section  # noqa: E402
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest  # noqa: E402
from tracing import Sink  # noqa: E402

import dsec  # noqa: E402
from dsec.node.host.prep import prepare_cgroups  # noqa: E402
from dsec.node.layers.store import LayerStore  # noqa: E402

# (operation or step, budget in ms). Operations are timed by the client; steps are spans,
# indented under the operation they belong to. docs/performance.md explains each line.
BUDGET: list[tuple[str, float]] = [
    ("create -> first exec", 19.0),  # 1.15x raw crun run + crun exec with the same config (16.5 ms)
    ("  POST /v1/sandboxes", 15.5),
    ("    quota.admit", 0.5),
    ("    edge.create", 13.0),
    ("      backend.prepare", 1.0),
    ("        layers.mount", 0.2),
    ("        rootfs.mount", 0.5),
    ("      backend.start", 11.0),
    ("        crun.run", 9.0),  # crun run -d by itself, measured outside dsec: 8-9 ms
    ("        agent.attach", 1.5),
    ("    quota.bind", 0.5),
    ("exec", 1.5),
    ("  edge.exec", 1.0),
    ("session command", 1.0),
    ("stop (idle sandbox)", 10.0),
    ("  edge.stop", 7.0),
    ("    teardown kill", 2.0),
    ("    teardown release its runtime", 2.0),
    ("    teardown unmount", 2.0),
    ("fncall python hello", 5.0),
    ("pause", 30.0),
    ("resume -> first exec", 30.0),
]


class Spans(Sink):
    """An OTLP/HTTP endpoint that keeps every span's duration by its name, or with
    ``by_service`` by "service:name" (several processes exporting to one receiver)."""

    def __init__(self, by_service: bool = False) -> None:
        super().__init__()
        self.by_service = by_service
        self.ms: dict[str, list[float]] = collections.defaultdict(list)
        self.before: dict[str, list[float]] | None = None

    async def receive(self, request: web.Request) -> web.Response:
        req = ExportTraceServiceRequest()
        req.ParseFromString(await request.read())
        for rs in req.resource_spans:
            prefix = ""
            if self.by_service:
                service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "?")
                prefix = service + ":"
            for ss in rs.scope_spans:
                for s in ss.spans:
                    self.ms[prefix + s.name].append((s.end_time_unix_nano - s.start_time_unix_nano) / 1e6)
        return web.Response(body=b"", content_type="application/x-protobuf")

    def clear(self) -> None:
        """Keep what was seen so far (the sequential operations') apart; collect afresh."""
        self.before = {k: list(v) for k, v in self.ms.items()}
        self.ms.clear()


async def timed(fn, n: int) -> list[float]:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await fn()
        out.append((time.perf_counter() - t) * 1000)
    return out


async def drive(url: str, token: str, n: int, burst: Spans | None = None) -> dict[str, list[float]]:
    ops: dict[str, list[float]] = {}
    busybox = dsec.ContainerArgs(image="base/busybox", memory_limit_mb=64)
    async with dsec.AsyncClient(url=url, token=token) as c:
        creates: list[float] = []
        stops: list[float] = []
        for i in range(n + 1):  # the first is a warm-up: the layer mounts, the connection
            t = time.perf_counter()
            sb = await c.run_container(busybox)
            await sb.exec(["true"])
            t1 = time.perf_counter()
            await sb.stop()
            if i:
                creates.append((t1 - t) * 1000)
                stops.append((time.perf_counter() - t1) * 1000)
        ops["create -> first exec"], ops["stop (idle sandbox)"] = creates, stops
        sb = await c.run_container(busybox)
        ops["exec"] = await timed(lambda: sb.exec(["true"]), 10 * n)
        await sb.run_shell("true")
        ops["session command"] = await timed(lambda: sb.run_shell("true"), 10 * n)
        pause, resume = [], []
        for _ in range(max(3, n // 4)):
            t = time.perf_counter()
            await sb.pause()
            pause.append((time.perf_counter() - t) * 1000)
            t = time.perf_counter()
            await sb.resume()
            await sb.exec(["true"])
            resume.append((time.perf_counter() - t) * 1000)
        ops["pause"], ops["resume -> first exec"] = pause, resume
        await sb.stop()
        call = dsec.FnCallArgs(language="python", code="print('hello')")
        await c.fncall(call)  # warm: the pool
        ops["fncall python hello"] = await timed(lambda: c.fncall(call), 5 * n)
        if burst is not None:  # the same steps under 8 concurrent creates: where a burst waits
            await asyncio.sleep(1.0)  # (the spans so far reach the receiver first)
            burst.clear()
            made: list[dsec.AsyncSandbox] = []

            async def creator() -> None:
                for _ in range(n // 2):
                    made.append(await c.run_container(busybox))

            t = time.perf_counter()
            await asyncio.gather(*(creator() for _ in range(8)))
            ops["burst: creations/s, 8 concurrent"] = [len(made) / (time.perf_counter() - t)]
            await asyncio.sleep(1.0)
            await asyncio.gather(*(s.stop() for s in made))
    return ops


def render(ops: dict[str, list[float]], spans: dict[str, list[float]], n: int) -> str:
    out = [f"n={n} creates and stops, {10 * n} execs and session commands, {5 * n} FnCall calls; tracing on; "
           f"{os.cpu_count()} cores, kernel {platform.release()}", "",
           "| operation / step | budget (ms) | p50 (ms) | p90 (ms) | samples | |", "|---|---|---|---|---|---|"]
    for name, budget in BUDGET:
        key = name.strip()
        xs = ops.get(key) or spans.get(key) or []
        if not xs:
            out.append(f"| {name.replace('  ', '&nbsp;&nbsp;')} | {budget:g} | - | - | 0 | no samples |")
            continue
        p50, p90 = pct(xs, 50), pct(xs, 90)
        verdict = "ok" if p50 <= budget else f"OVER by {p50 - budget:.1f}"
        out.append(f"| {name.replace('  ', '&nbsp;&nbsp;')} | {budget:g} | {p50:.2f} | {p90:.2f} | {len(xs)} "
                   f"| {verdict} |")
    return "\n".join(out)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=30)
    ap.add_argument("--data-dir", default=os.environ.get("DSEC_DATA_DIR", "/var/lib/dsec"))
    ap.add_argument("--spans", action="store_true", help="also list every span seen, by p50")
    ap.add_argument("--burst", action="store_true", help="also 8 concurrent creates, and their spans")
    ap.add_argument("--write", metavar="MARKDOWN", help="replace this benchmark's section in that file")
    a = ap.parse_args()
    prepare_cgroups()
    spans = Spans()
    runner, endpoint = await spans.start()
    d = tempfile.mkdtemp(prefix="dsec-bench-")
    saved = dict(os.environ)
    os.environ.update({"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"})
    try:
        LayerStore(os.path.join(d, "layers")).link_from(os.path.join(a.data_dir, "layers"))
        token = "bench-" + os.urandom(8).hex()
        proc, url = start_server(d, token)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        ops = await drive(url, token, a.n, spans if a.burst else None)
        await asyncio.sleep(1.0)  # the last batch of spans
    finally:
        proc.terminate()
        proc.wait()
        await runner.cleanup()
        shutil.rmtree(d, ignore_errors=True)
    burst, sequential = (spans.ms, spans.before) if spans.before is not None else ({}, spans.ms)
    text = render(ops, sequential, a.n)
    if burst:
        text += (f"\n\nBurst: {ops['burst: creations/s, 8 concurrent'][0]:.1f} creations/s at 8 concurrent; "
                 "p50 of its steps: " + ", ".join(f"{k} {pct(burst[k], 50):.1f} ms" for k in (
                     "POST /v1/sandboxes", "quota.admit", "edge.create", "crun.run", "agent.attach", "quota.bind")
                     if k in burst) + ".")
    print(text)
    if burst:
        print(f"burst: {ops['burst: creations/s, 8 concurrent'][0]:.1f} creations/s; its spans:")
        for name, xs in sorted(burst.items(), key=lambda kv: -pct(kv[1], 50)):
            print(f"{pct(xs, 50):8.2f} ms p50  {pct(xs, 90):8.2f} ms p90  {len(xs):5d}x  {name}")
    if a.spans:
        for name, xs in sorted(sequential.items(), key=lambda kv: -pct(kv[1], 50)):
            print(f"{pct(xs, 50):8.2f} ms p50  {len(xs):5d}x  {name}")
    if a.write:
        write_section(a.write, text, "python bench/hotpath.py " + " ".join(sys.argv[1:]), "hotpath",
                      "Hot path against its budget (`bench/hotpath.py`)")


if __name__ == "__main__":
    asyncio.run(main())
