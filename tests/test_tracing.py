"""OpenTelemetry tracing end to end: real dsec processes with tracing on export their spans
over OTLP/HTTP to a receiver this test runs on 127.0.0.1. The receiver stands in for an
external collector (Jaeger, Tempo, an OpenTelemetry Collector), which is outside the
machine: it decodes the standard protobuf export and keeps the spans. The SDK runs in a
child process with the same variables, so one trace goes SDK -> apiserver -> placement ->
edge -> backend, in one process (`dsec serve`) and across the network to an edge daemon."""

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

from dsec import tracing


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


def run_sdk(url: str, env: dict[str, str]) -> str:
    r = subprocess.run([sys.executable, "-c", SDK_SCRIPT, url, TOKEN], capture_output=True, text=True, timeout=120,
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
    for step in ("backend.prepare", "layers.mount", "rootfs.mount", "backend.start", "crun.run", "agent.attach"):
        s = c.one(step, client.trace)
        assert s.service == edge_service, (step, s.service)
        assert c.chain(s)[-3:] == ["edge.create", "POST /v1/sandboxes", "dsec POST /v1/sandboxes"] or \
            c.chain(s)[-4:] == ["edge.call create", "edge.create", "POST /v1/sandboxes", "dsec POST /v1/sandboxes"], \
            c.chain(s)
    assert c.one("crun.run", client.trace).attrs["dsec.sandbox_id"]


def check_exec_and_error(c: Collector) -> None:
    client = c.one("dsec POST /v1/sandboxes/{id}/exec")
    server = c.one("POST /v1/sandboxes/{sandbox_id}/exec", client.trace)
    assert server.parent == client.id
    edge = c.one("edge.exec", client.trace)
    assert "POST /v1/sandboxes/{sandbox_id}/exec" in c.chain(edge)
    missing = [s for s in c.spans if s.name == "dsec GET /v1/sandboxes/{id}" and s.error]
    assert len(missing) == 1 and missing[0].attrs["http.response.status_code"] == 404
    srv = c.one("GET /v1/sandboxes/{sandbox_id}", missing[0].trace)
    assert not srv.error  # a 404 is the client's failure, not the server's (OpenTelemetry's conventions)


async def test_one_trace_from_the_sdk_through_the_apiserver_to_the_backend(
        tmp_path_factory: pytest.TempPathFactory, collector: Collector) -> None:
    from conftest import own_platform
    gen = own_platform(tmp_path_factory, "traced", env=collector.env())
    platform: Platform = next(gen)
    try:
        await asyncio.to_thread(run_sdk, platform.url, collector.env())
        await collector.wait_for("dsec POST /v1/sandboxes", "crun.run", "edge.exec",
                                 "POST /v1/sandboxes/{sandbox_id}/exec", "GET /v1/sandboxes/{sandbox_id}")
        check_create_trace(collector, "dsec-serve", "dsec-serve")
        check_exec_and_error(collector)
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
        await collector.wait_for("dsec POST /v1/sandboxes", "edge.call create", "crun.run", "edge.exec")
        check_create_trace(collector, "dsec-apiserver", "dsec-edge")
        call = collector.one("edge.call create")
        assert call.service == "dsec-edge" and call.kind == 2
        assert collector.chain(call)[1:] == ["edge.create", "POST /v1/sandboxes", "dsec POST /v1/sandboxes"]
        check_exec_and_error(collector)
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
