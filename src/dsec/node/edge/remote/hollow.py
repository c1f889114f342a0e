"""``dsec edge hollow``: many hollow edges (dsec.node.backends.hollow) in one process, each the
real edge and its real daemon face on a port of its own, so that a fleet of DSec's size
(160 nodes) fits on one machine to measure the control plane against (bench/scale.py,
docs/scale.md). With a cluster database each registers in its registry, as a node's edge
daemon does, and its layer catalog is the cluster's. A load instrument, never a backend."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from sqlalchemy import Engine

from dsec.node.edge.config import EdgeConfig
from dsec.node.edge.remote.server import build_app
from dsec.node.edge.service import Edge
from dsec.node.layers.base import build_busybox
from dsec.node.layers.store import open_store
from dsec.shared.meta import open_db, sqlite_url
from dsec.shared.meta.registry import Registry

log = logging.getLogger("dsec.edge.hollow")


@dataclass
class HollowEdge:
    name: str
    url: str
    edge: Edge
    runner: web.AppRunner


async def start_fleet(count: int, prefix: str, data_root: str, secret: str, host: str = "127.0.0.1",
                      port: int = 0, db: str | None = None, store: str | None = None,
                      cfg: Mapping[str, Any] | None = None, first: int = 0) -> list[HollowEdge]:
    """``count`` hollow edges named PREFIX<first>..; on ``port``, ``port+1``, ... (0: free ports).
    They share one layer catalog (the cluster's with ``db``) and one metadata database."""
    os.makedirs(data_root, exist_ok=True)
    engine: Engine = open_db(db) if db else open_db(sqlite_url(data_root))
    layers = open_store(data_root, store, engine if db else None)
    build_busybox(layers)  # what a real edge ensures at start (idempotent, race-safe)
    fleet: list[HollowEdge] = []
    try:
        for i in range(count):
            name = f"{prefix}{first + i}"
            edge = Edge(EdgeConfig.model_validate({"name": name, "data_dir": os.path.join(data_root, name),
                                                   "hollow": True, **(cfg or {})}), layers, meta=engine)
            runner = web.AppRunner(build_app(edge, secret, edge.cfg.max_file_bytes), access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, host, port + i if port else 0)
            await site.start()
            bound = runner.addresses[0][1]
            url = f"http://{host}:{bound}"
            await edge.start()
            fleet.append(HollowEdge(name, url, edge, runner))
            if db:
                await asyncio.to_thread(Registry(engine).register, name, url, f"hollow-{name}")
    except BaseException:
        await stop_fleet(fleet)
        raise
    return fleet


async def stop_fleet(fleet: list[HollowEdge]) -> None:
    """Stop serving; a hollow sandbox cannot outlive its edge, so each is stopped (its
    record ends ``stopped``) and the edges leave nothing behind."""
    async def one(h: HollowEdge) -> None:
        with contextlib.suppress(Exception):
            await h.runner.cleanup()
        await asyncio.gather(*(h.edge.stop(sid) for sid in list(h.edge.sandboxes)), return_exceptions=True)
        with contextlib.suppress(Exception):
            await h.edge.close()
    await asyncio.gather(*(one(h) for h in fleet))


async def serve_fleet(count: int, prefix: str, data_root: str, secret: str, host: str, port: int,
                      db: str | None, store: str | None, cfg: Mapping[str, Any], first: int = 0) -> None:
    """Run the fleet until SIGTERM or SIGINT; prints ``NAME URL`` per edge once all serve."""
    fleet = await start_fleet(count, prefix, data_root, secret, host, port, db, store, cfg, first)
    for h in fleet:
        print(h.name, h.url, flush=True)
    log.info("%d hollow edges serving", len(fleet))
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)
    try:
        await done.wait()
    finally:
        await stop_fleet(fleet)
