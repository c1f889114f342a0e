"""Assembling the services: embedded mode (apiserver + placement + watcher + one edge in
one process, state in SQLite under the data dir: what ``dsec serve`` runs), an apiserver
in front of edges named by hand, and a cluster replica reading its edges and tokens from
the cluster's database."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from fastapi import FastAPI

from dsec.control.apiserver.core import Routes, SandboxIndex
from dsec.control.health.detector import Detector, Settings
from dsec.control.health.fleet import FleetHealth
from dsec.control.iam import TokenStore
from dsec.control.placement.engine import Placement
from dsec.control.watcher.watcher import FleetView, Watcher
from dsec.faces.front.app import Apiserver, build_app
from dsec.node.edge.api import EdgeAPI
from dsec.node.edge.config import EdgeConfig
from dsec.node.edge.service import Edge
from dsec.node.host.prep import prepare_cgroups
from dsec.node.layers.base import build_busybox
from dsec.node.layers.store import LayerStore, open_store
from dsec.shared.meta import open_db, sqlite_url
from dsec.shared.meta.registry import Registry

DEFAULT_DATA_DIR = "/var/lib/dsec"
DEFAULT_PORT = 7777
# how often each apiserver brings the project quotas to what the edges hold (dsec.control.iam.quota)
QUOTA_SWEEP_S = float(os.environ.get("DSEC_QUOTA_SWEEP_S", "5"))
log = logging.getLogger("dsec")


def data_dir_default() -> str:
    return os.environ.get("DSEC_DATA_DIR", DEFAULT_DATA_DIR)


def load_or_create_token(data_dir: str, token: str | None = None) -> str:
    path = os.path.join(data_dir, "token")
    if token:
        return token
    if os.path.exists(path):
        with open(path) as f:
            return f.read().strip()
    os.makedirs(data_dir, exist_ok=True)
    tok = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(tok + "\n")
    return tok


def build_edge(data_dir: str, edge_name: str = "edge0", edge_cfg: dict[str, Any] | None = None,
               store: str | None = None, db: str | None = None) -> Edge:
    """This node's edge (not started): cgroups prepared, its layer store opened (its
    catalog in the cluster's database ``db`` when given)."""
    prepare_cgroups()
    engine = open_db(db) if db else None
    layer_store = open_store(data_dir, store, engine)
    build_busybox(layer_store)  # cheap and always available; base/debian:12 comes from `dsec setup`
    return Edge(EdgeConfig(name=edge_name, data_dir=os.path.abspath(data_dir), **(edge_cfg or {})), layer_store,
                meta=engine)


async def _nothing() -> None:
    return None


def build_platform(edges: Mapping[str, EdgeAPI], tokens: TokenStore, layer_store: LayerStore,
                   start: Callable[[], Awaitable[None]] = _nothing, stop: Callable[[], Awaitable[None]] = _nothing,
                   max_file_bytes: int = EdgeConfig.model_fields["max_file_bytes"].default,
                   watcher: FleetView | None = None, index: SandboxIndex | None = None,
                   routes: Routes | None = None) -> FastAPI:
    """The apiserver (with placement and the watcher) in front of ``edges``, in-process or
    remote alike; ``start``/``stop`` bring what it fronts up and down with it. Without a
    ``watcher`` it polls the edges itself."""
    # (an empty cluster is falsy); the edges' health lives in the tokens' database: its
    # ``edges`` table is the cluster registry's, here holding the edges named by hand
    view = watcher if watcher is not None else Watcher(
        edges, health=FleetHealth(Registry(tokens.db), Detector(Settings.from_env())))
    placement = Placement(lambda: view.view)
    api = Apiserver(edges, view, placement, tokens, layer_store, max_file_bytes=max_file_bytes, index=index,
                    routes=routes)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await start()
        await view.refresh()
        view.start()
        await app.state.template_builder.reap(at_start=True)  # builds an earlier process here left running
        await api.batches.start()  # the queue, and the batches an earlier process left unfinished
        refresher = asyncio.create_task(tokens.refresh_forever())
        sweeper = asyncio.create_task(api.quota_sweep_forever(QUOTA_SWEEP_S))
        sampler = asyncio.create_task(api.series.run_forever())
        blocks = asyncio.create_task(api.blocks.run())
        log.info("dsec ready: edges %s", ", ".join(sorted(edges)) or "none yet")
        try:
            yield
        finally:
            await api.batches.close()
            await app.state.template_builder.close()  # builds of this process fail; their builders stop
            refresher.cancel()
            sweeper.cancel()
            sampler.cancel()
            blocks.cancel()  # (gives back what is unused)
            await asyncio.gather(blocks, return_exceptions=True)
            await view.close()
            await stop()

    app = build_app(api)
    app.router.lifespan_context = lifespan
    return app


def local_tokens(data_dir: str, token: str | None) -> TokenStore:
    """Tokens in the data dir's metadata database (SQLite), with an older iam.db's taken in."""
    tokens = TokenStore(open_db(sqlite_url(data_dir)), load_or_create_token(data_dir, token))
    tokens.import_sqlite(os.path.join(data_dir, "iam.db"))
    return tokens


def build_embedded(data_dir: str, token: str | None = None, edge_name: str = "edge0",
                   edge_cfg: dict[str, Any] | None = None, store: str | None = None) -> tuple[FastAPI, Edge]:
    """``dsec serve``: the apiserver and one in-process edge."""
    data_dir = os.path.abspath(data_dir)
    os.makedirs(data_dir, exist_ok=True)
    edge = build_edge(data_dir, edge_name, edge_cfg, store)
    app = build_platform({edge.name: edge}, local_tokens(data_dir, token), edge.layers, edge.start, edge.close,
                         edge.cfg.max_file_bytes)
    return app, edge


def build_apiserver(edges: dict[str, str], secret: str, data_dir: str, token: str | None = None,
                    store: str | None = None, tls: ssl.SSLContext | None = None) -> FastAPI:
    """``dsec apiserver --edges``: the apiserver in front of edge daemons named by hand
    (name -> URL), its tokens in the data dir."""
    from dsec.node.edge.remote.client import remote_edge

    data_dir = os.path.abspath(data_dir)
    os.makedirs(data_dir, exist_ok=True)
    remote = {name: remote_edge(name, url, secret, tls) for name, url in edges.items()}

    async def close() -> None:
        for e in remote.values():
            await e.close()
    return build_platform(dict(remote), local_tokens(data_dir, token), open_store(data_dir, store), stop=close)


def build_replica(db: str, secret: str, token: str, data_dir: str, store: str | None = None,
                  tls: ssl.SSLContext | None = None) -> FastAPI:
    """``dsec apiserver --db``: one stateless replica of a cluster. Its edges come from the
    registry, its fleet view from the controller's watcher, its tokens and sandbox index
    from the cluster's database; the data dir holds nothing but scratch."""
    from dsec.control.cluster.view import ClusterEdges

    data_dir = os.path.abspath(data_dir)
    os.makedirs(data_dir, exist_ok=True)
    engine = open_db(db)
    registry = Registry(engine)
    edges = ClusterEdges(registry, secret, tls=tls)
    return build_platform(edges, TokenStore(engine, token), open_store(data_dir, store, engine), watcher=edges,
                          index=registry, routes=edges)
