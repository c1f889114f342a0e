"""Embedded mode: apiserver + placement + watcher + one edge in one process, state in
SQLite under the data dir. This is what ``dsec serve`` runs."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI

from dsec.apiserver.app import Apiserver, build_app
from dsec.edge.api import EdgeAPI
from dsec.edge.config import EdgeConfig
from dsec.edge.service import Edge
from dsec.host.prep import prepare_cgroups
from dsec.iam import TokenStore
from dsec.layers.base import build_busybox
from dsec.layers.store import LayerStore
from dsec.placement.engine import Placement
from dsec.storage.chunks import DEFAULT_CHUNK_SIZE
from dsec.watcher.watcher import Watcher

DEFAULT_DATA_DIR = "/var/lib/dsec"
DEFAULT_PORT = 7777
log = logging.getLogger("dsec")


def data_dir_default() -> str:
    return os.environ.get("DSEC_DATA_DIR", DEFAULT_DATA_DIR)


def open_store(data_dir: str, store: str | None = None) -> LayerStore:
    """The layer store: ``store`` (or $DSEC_STORE) is a shared filesystem path mounted on
    every node; without one, the local data dir. $DSEC_CHUNK_SIZE sets the chunk size
    new layers are indexed with (bytes, default 1 MiB)."""
    store = store or os.environ.get("DSEC_STORE") or None
    chunk = int(os.environ.get("DSEC_CHUNK_SIZE", DEFAULT_CHUNK_SIZE))
    if store:
        return LayerStore(store, "sharedfs", chunk_size=chunk)
    return LayerStore(os.path.join(os.path.abspath(data_dir), "layers"), "local", chunk_size=chunk)


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
               store: str | None = None) -> Edge:
    """This node's edge (not started): cgroups prepared, its layer store opened."""
    prepare_cgroups()
    layer_store = open_store(data_dir, store)
    build_busybox(layer_store)  # cheap and always available; base/debian:12 comes from `dsec setup`
    return Edge(EdgeConfig(name=edge_name, data_dir=os.path.abspath(data_dir), **(edge_cfg or {})), layer_store)


def build_platform(edges: dict[str, EdgeAPI], data_dir: str, token: str | None, layer_store: LayerStore,
                   start: Callable[[], Awaitable[None]], stop: Callable[[], Awaitable[None]],
                   max_file_bytes: int = EdgeConfig.model_fields["max_file_bytes"].default) -> FastAPI:
    """The apiserver (with placement and the watcher) in front of ``edges``, in-process or
    remote alike; ``start``/``stop`` bring what it fronts up and down with it."""
    tok = load_or_create_token(data_dir, token)
    watcher = Watcher(edges)
    placement = Placement(lambda: watcher.view)
    tokens = TokenStore(os.path.join(data_dir, "iam.db"), tok)
    api = Apiserver(edges, watcher, placement, tokens, layer_store, max_file_bytes=max_file_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await start()
        await watcher.refresh()
        watcher.start()
        log.info("dsec ready: edges %s, data dir %s", ", ".join(sorted(edges)), data_dir)
        try:
            yield
        finally:
            await watcher.close()
            await stop()

    app = build_app(api)
    app.router.lifespan_context = lifespan
    return app


def build_embedded(data_dir: str, token: str | None = None, edge_name: str = "edge0",
                   edge_cfg: dict[str, Any] | None = None, store: str | None = None) -> tuple[FastAPI, Edge]:
    """``dsec serve``: the apiserver and one in-process edge."""
    data_dir = os.path.abspath(data_dir)
    os.makedirs(data_dir, exist_ok=True)
    edge = build_edge(data_dir, edge_name, edge_cfg, store)
    app = build_platform({edge.name: edge}, data_dir, token, edge.layers, edge.start, edge.close,
                         edge.cfg.max_file_bytes)
    return app, edge


def build_apiserver(edges: dict[str, str], secret: str, data_dir: str, token: str | None = None,
                    store: str | None = None) -> FastAPI:
    """``dsec apiserver``: the apiserver in front of edge daemons (name -> URL)."""
    from dsec.edge.remote.client import remote_edge

    data_dir = os.path.abspath(data_dir)
    os.makedirs(data_dir, exist_ok=True)
    remote = {name: remote_edge(name, url, secret) for name, url in edges.items()}

    async def nothing() -> None:
        return None

    async def close() -> None:
        for e in remote.values():
            await e.close()
    return build_platform(dict(remote), data_dir, token, open_store(data_dir, store), nothing, close)
