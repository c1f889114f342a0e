"""`pip install dsec` is the SDK and the CLI: a trainer node gets no server dependency
(FastAPI, uvicorn, pyfuse3, pyroute2, ...), and the SDK, sync and async, works without
any of them against a real platform."""

from __future__ import annotations

import subprocess
import sys
import tomllib

from tests.conftest import TOKEN, Platform

SERVER_ONLY = ("fastapi", "starlette", "uvicorn", "pyfuse3", "pyroute2", "zstandard", "prometheus_client", "dns",
               "multipart", "python_multipart", "websockets")


def test_base_dependencies_are_the_sdks() -> None:
    with open("pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    base = {d.split(">")[0].split("[")[0].split("=")[0] for d in project["dependencies"]}
    assert base == {"aiohttp", "pydantic", "typer", "rich", "opentelemetry-api"}  # the API only: tracing off
    server = {d.split(">")[0].split("[")[0] for d in project["optional-dependencies"]["server"]}
    assert {"fastapi", "uvicorn", "pyfuse3", "pyroute2"} <= server


def test_the_sdk_runs_without_server_packages(platform: Platform) -> None:
    # a finder that refuses every server-only package, as a machine without them would
    script = f"""
import importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {SERVER_ONLY!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (refused: server-only)")
sys.meta_path.insert(0, Refuse())
import asyncio, dsec
with dsec.Client(url={platform.url!r}, token={TOKEN!r}) as c:
    sb = c.run_container(dsec.ContainerArgs(image="base/busybox"))
    assert sb.exec("echo sync").stdout == "sync\\n"
    assert [e.type for e in sb.exec_stream("echo a")][-1] == "result"
    sb.stop()
async def main():
    async with dsec.AsyncClient(url={platform.url!r}, token={TOKEN!r}) as c:
        sb = await c.run_container(dsec.ContainerArgs(image="base/busybox"))
        assert (await sb.exec("echo async")).stdout == "async\\n"
        await sb.stop()
asyncio.run(main())
from dsec.client.cli.main import app
app(["ps", "--url", {platform.url!r}, "--token", {TOKEN!r}], standalone_mode=False)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {SERVER_ONLY!r})
assert not loaded, loaded
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
