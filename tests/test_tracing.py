"""OpenTelemetry tracing end to end: real dsec processes with tracing on export their spans
over OTLP/HTTP to a receiver this test runs on 127.0.0.1. The receiver stands in for an
external collector (Jaeger, Tempo, an OpenTelemetry Collector), which is outside the
machine: it decodes the standard protobuf export and keeps the spans. The SDK
(``dsec.AsyncClient``, traced as ``dsec-sdk``) runs in a child process with the same
variables: a process sets its tracer provider once, and the test runner's would trace every
later test of the session. One trace goes SDK -> apiserver -> placement -> edge -> backend,
in one process (`dsec serve`) and across the network to an edge daemon; a microVM's create
shows its template boot and clone."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from aiohttp import web
from conftest import TOKEN, Cluster, Platform, stop_all
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from dsec.shared import tracing


@dataclass
class Span:
    service: str
    name: str
    trace: str
    id: str
    parent: str
    kind: int
    error: bool
    attrs: dict[str, object]


class Collector:
    """An OTLP/HTTP trace receiver (POST /v1/traces, protobuf)."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def receive(self, request: web.Request) -> web.Response:
        req = ExportTraceServiceRequest()
        req.ParseFromString(await request.read())
        for rs in req.resource_spans:
            service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    attrs: dict[str, object] = {}
                    for a in s.attributes:
                        v = a.value
                        attrs[a.key] = v.string_value or v.int_value or v.bool_value or v.double_value
                    self.spans.append(Span(service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                           s.kind, s.status.code == 2, attrs))
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def start(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/traces", self.receive)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    def env(self) -> dict[str, str]:
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": self.url, "OTEL_BSP_SCHEDULE_DELAY": "100"}

    async def wait_for(self, *names: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            have = {s.name for s in self.spans}
            if all(n in have for n in names):
                return
            await asyncio.sleep(0.2)
        raise AssertionError(f"spans {set(names) - {s.name for s in self.spans}} never came; got "
                             f"{sorted({s.name for s in self.spans})}")

    def one(self, name: str, trace: str | None = None) -> Span:
        found = [s for s in self.spans if s.name == name and (trace is None or s.trace == trace)]
        assert len(found) == 1, (name, [(s.service, s.id, s.parent, s.kind, s.attrs) for s in found],
                                 [(s.name, s.id, s.parent) for s in self.spans if s.trace == (trace or "")])
        return found[0]

    def chain(self, span: Span) -> list[str]:
        """The names from ``span`` up to its trace's root."""
        by_id = {s.id: s for s in self.spans if s.trace == span.trace}
        out = [span.name]
        while span.parent:
            span = by_id[span.parent]
            out.append(span.name)
        return out


SDK_SCRIPT = textwrap.dedent("""
    import asyncio, sys
    import dsec

    async def main():
        async with dsec.AsyncClient(url=sys.argv[1], token=sys.argv[2]) as c:
            sb = await c.run_container(dsec.ContainerArgs(image="base/busybox", memory_limit_mb=64))
            assert (await sb.exec("echo traced")).stdout == "traced\\n"
            assert [e.data async for e in sb.exec_stream("echo streamed") if e.type == "stdout"] == ["streamed\\n"]
            try:
                await c.connect(sb.sandbox_id[:-3] + "zzz")
                await (await c.connect(sb.sandbox_id[:-3] + "zzz")).refresh()
            except dsec.NotFound:
                pass
            else:
                raise SystemExit("no 404")
            await sb.stop()
            print(sb.sandbox_id)

    asyncio.run(main())
""")


@pytest.fixture
async def collector() -> AsyncIterator[Collector]:
    c = Collector()
    await c.start()
    yield c
    assert c.runner is not None
    await c.runner.cleanup()


VM_SCRIPT = textwrap.dedent("""
    import asyncio, sys
    import dsec

    async def main():
        async with dsec.AsyncClient(url=sys.argv[1], token=sys.argv[2]) as c:
            vm = await c.run_microvm(dsec.MicroVMArgs(memory_mb=256))  # the first: boots its template
            assert (await vm.exec("echo vm")).stdout == "vm\\n"
            await vm.stop()

    asyncio.run(main())
""")


def run_sdk(url: str, env: dict[str, str], script: str = SDK_SCRIPT) -> str:
    r = subprocess.run([sys.executable, "-c", script, url, TOKEN], capture_output=True, text=True, timeout=120,
                       env={**os.environ, **env})
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def check_create_trace(c: Collector, server_service: str, edge_service: str) -> None:
    client = c.one("dsec POST /v1/sandboxes")
    assert client.service == "dsec-sdk" and client.kind == 3  # CLIENT
    server = c.one("POST /v1/sandboxes", client.trace)
    assert server.service == server_service and server.parent == client.id and server.kind == 2  # SERVER
    assert server.attrs["http.response.status_code"] == 201
    choose = c.one("placement.choose", client.trace)
    assert choose.parent == server.id and choose.attrs["dsec.edge"]
    assert choose.attrs["dsec.candidates"] == 1 and choose.attrs["dsec.sampled"] == 1  # control/placement/engine.py
    for step in ("backend.prepare", "layers.mount", "rootfs.mount", "backend.start", "crun.run", "agent.attach"):
        s = c.one(step, client.trace)
        assert s.service == edge_service, (step, s.service)
        assert c.chain(s)[-3:] == ["edge.create", "POST /v1/sandboxes", "dsec POST /v1/sandboxes"] or \
            c.chain(s)[-4:] == ["edge.call create", "edge.create", "POST /v1/sandboxes", "dsec POST /v1/sandboxes"], \
            c.chain(s)
    assert c.one("crun.run", client.trace).attrs["dsec.sandbox_id"]


def check_exec_and_error(c: Collector) -> None:
    client, streamed = sorted((s for s in c.spans if s.name == "dsec POST /v1/sandboxes/{id}/exec"),
                              key=lambda s: bool(s.attrs.get("dsec.stream")))
    server = c.one("POST /v1/sandboxes/{sandbox_id}/exec", client.trace)
    assert server.parent == client.id
    edge = c.one("edge.exec", client.trace)
    assert "POST /v1/sandboxes/{sandbox_id}/exec" in c.chain(edge)
    missing = [s for s in c.spans if s.name == "dsec GET /v1/sandboxes/{id}" and s.error]
    assert len(missing) == 1 and missing[0].attrs["http.response.status_code"] == 404
    srv = c.one("GET /v1/sandboxes/{sandbox_id}", missing[0].trace)
    assert not srv.error  # a 404 is the client's failure, not the server's (OpenTelemetry's conventions)
    # a stream: the client's span (to the response's headers) is the parent of the whole exec
    assert streamed.attrs["dsec.stream"] and streamed.attrs["http.response.status_code"] == 200
    assert c.one("POST /v1/sandboxes/{sandbox_id}/exec", streamed.trace).parent == streamed.id
    assert c.chain(c.one("edge.exec", streamed.trace))[-1] == streamed.name


# a stop's spans end in separate exports (the server's span after the edge's, the client's
# last): all of them, before the chain is checked
STOP_SPANS = ("teardown remove its files", "DELETE /v1/sandboxes/{sandbox_id}", "dsec DELETE /v1/sandboxes/{id}")


def check_stop(c: Collector, edge_service: str) -> None:
    stop = c.one("edge.stop")
    assert stop.service == edge_service and stop.attrs["dsec.backend"] == "container"
    chain = c.chain(stop)
    assert chain[-2:] == ["DELETE /v1/sandboxes/{sandbox_id}", "dsec DELETE /v1/sandboxes/{id}"], chain
    teardown = c.one("edge.teardown", stop.trace)
    assert teardown.parent == stop.id and teardown.attrs["dsec.reason"] == "stopped"
    for step in ("teardown kill", "teardown unmount", "teardown remove its files"):
        s = c.one(step, stop.trace)
        assert s.parent == teardown.id and not s.error, (step, s)


async def test_one_trace_from_the_sdk_through_the_apiserver_to_the_backend(
        tmp_path_factory: pytest.TempPathFactory, collector: Collector) -> None:
    from conftest import own_platform
    gen = own_platform(tmp_path_factory, "traced", env=collector.env())
    platform: Platform = next(gen)
    try:
        await asyncio.to_thread(run_sdk, platform.url, collector.env())
        await collector.wait_for("dsec POST /v1/sandboxes", "crun.run", "edge.exec",
                                 "POST /v1/sandboxes/{sandbox_id}/exec", "GET /v1/sandboxes/{sandbox_id}",
                                 *STOP_SPANS)
        check_create_trace(collector, "dsec-serve", "dsec-serve")
        check_exec_and_error(collector)
        check_stop(collector, "dsec-serve")
    finally:
        next(gen, None)


async def test_a_microvm_create_traces_its_boot_steps(tmp_path_factory: pytest.TempPathFactory,
                                                     collector: Collector) -> None:
    from conftest import own_platform
    gen = own_platform(tmp_path_factory, "traced-vm", env=collector.env())
    platform: Platform = next(gen)
    try:
        await asyncio.to_thread(run_sdk, platform.url, collector.env(), VM_SCRIPT)
        await collector.wait_for("vm.clone", "edge.exec", "teardown kill", "edge.stop")
        client = collector.one("dsec POST /v1/sandboxes")
        tpl, clone = collector.one("vm.template", client.trace), collector.one("vm.clone", client.trace)
        # the template's own boot (once per guest shape), then the sandbox cloned from it
        assert collector.one("vm.spec", client.trace).parent == collector.one("backend.prepare", client.trace).id
        start = collector.one("backend.start", client.trace)
        assert tpl.parent == clone.parent == collector.one("agent.attach", client.trace).parent == start.id
        launch = collector.one("qemu.launch", client.trace)
        assert launch.parent == tpl.id and launch.attrs["dsec.sandbox_id"] != clone.attrs["dsec.sandbox_id"]
        for step in ("vm.upper", "qemu.restore"):
            assert collector.one(step, client.trace).parent == clone.id
        assert sorted(collector.chain(s)[1] for s in collector.spans
                      if s.name == "agent.handshake" and s.trace == client.trace) == ["vm.clone", "vm.template"]
        assert collector.chain(start)[-3:] == ["edge.create", "POST /v1/sandboxes", "dsec POST /v1/sandboxes"]
        assert collector.one("edge.stop").attrs["dsec.backend"] == "microvm"
    finally:
        next(gen, None)


async def test_the_trace_crosses_to_an_edge_daemon(tmp_path_factory: pytest.TempPathFactory,
                                                   collector: Collector) -> None:
    c = Cluster(str(tmp_path_factory.mktemp("traced-cluster")), ("t1",))
    for s in (*c.edges.values(), c.api):
        s.env = collector.env()
    try:
        await asyncio.to_thread(c.start)
        await asyncio.to_thread(run_sdk, c.url, collector.env())
        await collector.wait_for("dsec POST /v1/sandboxes", "edge.call create", "crun.run", "edge.exec",
                                 *STOP_SPANS)
        check_create_trace(collector, "dsec-apiserver", "dsec-edge")
        call = collector.one("edge.call create")
        assert call.service == "dsec-edge" and call.kind == 2
        assert collector.chain(call)[1:] == ["edge.create", "POST /v1/sandboxes", "dsec POST /v1/sandboxes"]
        check_exec_and_error(collector)
        check_stop(collector, "dsec-edge")
        assert "edge.call stop" in collector.chain(collector.one("edge.stop"))
    finally:
        await asyncio.to_thread(stop_all, c)


def test_off_unless_an_endpoint_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "DSEC_TRACING"):
        monkeypatch.delenv(var, raising=False)
    assert not tracing.wanted()
    assert not tracing.on()  # this process (the test runner) set nothing up
    with tracing.span("nothing") as s:
        assert s is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    assert tracing.wanted()
    monkeypatch.setenv("DSEC_TRACING", "0")
    assert not tracing.wanted()


OFF_SCRIPT = textwrap.dedent("""
    import threading
    from opentelemetry import trace
    from dsec.shared import tracing
    assert not tracing.setup("dsec-serve")
    assert type(trace.get_tracer_provider()).__name__ == "ProxyTracerProvider"  # the API's no-op
    assert not [t.name for t in threading.enumerate() if t.name.startswith("Otel")]
""")


def test_the_default_platform_configures_no_exporter(platform: Platform) -> None:
    """The session's platform runs with tracing off: its environment names no collector, and
    in that environment ``setup`` installs no provider and starts no exporter thread."""
    assert platform.proc is not None
    with open(f"/proc/{platform.proc.pid}/cmdline", "rb") as f:
        assert b"serve\0--port" in f.read()  # the dsec serve process itself
    with open(f"/proc/{platform.proc.pid}/environ", "rb") as f:
        environ = dict(v.decode(errors="replace").partition("=")[::2] for v in f.read().split(b"\0") if v)
    assert not [k for k in environ if k.startswith("OTEL_EXPORTER_OTLP")] and environ.get("DSEC_TRACING") != "1"
    r = subprocess.run([sys.executable, "-c", OFF_SCRIPT], capture_output=True, text=True, timeout=60, env=environ)
    assert r.returncode == 0, r.stderr


def test_a_cluster_gives_its_daemons_the_collector(monkeypatch: pytest.MonkeyPatch) -> None:
    """`dsec cluster up`'s tracing variables reach each edge daemon and replica Ray starts
    (under the node's own), except the service name: each daemon names itself."""
    from dsec.control.cluster.actors import _tracing_env
    from dsec.control.cluster.config import ClusterConfig
    for var in [v for v in os.environ if v.startswith("OTEL_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "my-trainer")
    forwarded = tracing.forwarded_env()
    assert forwarded == {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
                         "OTEL_TRACES_SAMPLER": "parentbased_traceidratio"}
    cfg = ClusterConfig(db="postgresql://x", secret="s", admin_token="t", tracing_env=forwarded)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT")  # this node's environment names no collector
    assert _tracing_env(cfg) == {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}  # its sampler stays
