"""What ``dsec cluster up``, ``status`` and ``down`` do, as functions (the CLI, the cluster
demo and the tests call these): connect to a Ray cluster, start the controller (and a
private PostgreSQL when given no database), wait until every edge node serves and every
replica answers, and take it all down again."""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from collections.abc import Callable
from typing import Any

import ray
from pydantic import BaseModel
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from dsec.control.cluster import certs, postgres
from dsec.control.cluster.actors import CONTROLLER, PostgresActor, controller
from dsec.control.cluster.config import NAMESPACE, ClusterConfig
from dsec.shared import tracing
from dsec.shared.meta import open_db
from dsec.shared.meta.registry import Registry

POSTGRES = "postgres"
PRIVATE_DB_PORT = 5433
UP_TIMEOUT_S = 300.0


class ClusterDown(RuntimeError):
    """No dsec cluster runs on this Ray cluster."""


class UpResult(BaseModel):
    apiservers: list[str]
    edges: list[str]
    token: str
    db: str


def connect(ray_address: str) -> None:
    if not ray.is_initialized():
        ray.init(address=ray_address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING,
                 configure_logging=False)


def _private_db(data_root: str, host: str | None, allow: list[str], say: Callable[[str], None]) -> str:
    node = ray.get_runtime_context().get_node_id()
    host = host or ray.util.get_node_ip_address()
    actor: Any = ray.remote(PostgresActor).options(  # type: ignore[attr-defined]
        name=POSTGRES, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, max_restarts=-1,
        max_task_retries=0, num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
    ).remote(os.path.join(data_root, "postgres"), host, PRIVATE_DB_PORT, allow)
    ref = actor.admit.remote(allow)  # (an actor found from an earlier `up`: the networks named now)
    log_path = os.path.join(data_root, "postgres.log")
    deadline = time.monotonic() + UP_TIMEOUT_S
    while not ray.wait([ref], timeout=5)[0]:
        if time.monotonic() > deadline:  # the server goes on (recovering, say): a later `up` finds it
            raise TimeoutError(f"the cluster's PostgreSQL ({host}:{PRIVATE_DB_PORT}) does not take queries yet: "
                               f"{postgres.state(log_path)}; run `dsec cluster up` again once it does")
        say(f"waiting for the cluster's PostgreSQL: {postgres.state(log_path)}")
    nets = ray.get(ref)
    say(f"the cluster's PostgreSQL admits {', '.join(nets) or 'this node only'}")
    return str(ray.get(actor.db_url.remote()))


def up(ray_address: str = "auto", db: str | None = None, timeout_s: float = UP_TIMEOUT_S,
       say: Callable[[str], None] = lambda _: None, **settings: Any) -> UpResult:
    """``settings``: ClusterConfig fields (store, apiservers, data_root, ports, edge args);
    ``say``: progress for a person waiting (a database recovering, say)."""
    connect(ray_address)
    data_root = settings.get("data_root") or ClusterConfig.model_fields["data_root"].default
    db = db or _private_db(data_root, settings.get("listen_host"), list(settings.get("db_allow") or []), say)
    registry = Registry(open_db(db))
    secret = registry.setting_once("cluster_secret", secrets.token_urlsafe(32))
    token = registry.setting_once("admin_token", "dsec_" + secrets.token_urlsafe(32))
    settings.setdefault("tracing_env", tracing.forwarded_env())  # a collector named here reaches every node
    cfg = ClusterConfig(db=db, secret=secret, admin_token=token, **settings)
    if cfg.tls:  # the cluster CA: made once, kept in the registry, its files here for daemons run by hand
        say(f"the cluster CA is in {certs.cluster_ca(registry, data_root)}")
    ctl = controller(cfg)
    ray.get(ctl.ready.remote(), timeout=60)
    deadline = time.monotonic() + timeout_s
    while True:
        st = ray.get(ctl.status.remote(), timeout=30)
        nodes = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get(cfg.resource, 0) >= 1]
        serving = [e["name"] for e in st["edges"] if e["state"] == "active" and e["healthy"]]
        urls = [st["apiservers"][k] for k in sorted(st["apiservers"])]
        if len(serving) >= len(nodes) and len(urls) >= cfg.apiservers and all(_sees(u, token, serving)
                                                                                for u in urls):
            return UpResult(apiservers=urls, edges=sorted(serving), token=token, db=db)
        if time.monotonic() > deadline:
            failing = "; ".join(f"{what} fails to start ({f['tries']} tries so far): {_last_line(f['error'])}"
                                for what, f in sorted(st.get("failing_starts", {}).items()))
            raise TimeoutError(f"the cluster did not come up in {timeout_s:g} s: {len(serving)} of {len(nodes)} "
                               f"edges serve, {len(urls)} of {cfg.apiservers} apiservers; "
                               f"{failing or st['last_error'] or 'see the edges logs under ' + data_root}")
        time.sleep(0.5)


def _last_line(error: str) -> str:
    """A failed start's error ends with the daemon's log: its last ``error:`` (which the
    terminal library wrapped over lines) or else its last line says why."""
    lines = [ln.strip() for ln in error.strip().splitlines() if ln.strip()]
    said = [i for i, ln in enumerate(lines) if ln.lower().startswith("error:")]
    if said:
        return " ".join(lines[said[-1]:said[-1] + 4])[:300]
    return lines[-1][:300] if lines else error[:300]


def _sees(url: str, token: str, edges: list[str]) -> bool:
    """The replica at ``url`` answers and its own fleet view has every one of ``edges``
    healthy: until then its first creates would all go to the edges it already sees."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"{url}/v1/nodes", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=2) as r:
            seen = {n["edge"] for n in json.loads(r.read()) if n.get("healthy")}
    except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError):
        return False
    return set(edges) <= seen


def _controller() -> Any:
    try:
        return ray.get_actor(CONTROLLER, namespace=NAMESPACE)
    except ValueError:
        raise ClusterDown("no dsec cluster on this Ray cluster (start one with `dsec cluster up`)") from None


def status(ray_address: str = "auto") -> dict[str, Any]:
    connect(ray_address)
    return dict(ray.get(_controller().status.remote(), timeout=30))


def rotate_certs(ray_address: str = "auto", new_ca: bool = False) -> dict[str, Any]:
    """New certificates for every daemon of the cluster (signed by a new CA when asked),
    taken up while they run (Controller.rotate_certs)."""
    connect(ray_address)
    return dict(ray.get(_controller().rotate_certs.remote(new_ca), timeout=600))


def down(ray_address: str = "auto", stop_sandboxes: bool = False, keep_db: bool = False) -> dict[str, Any]:
    """Stop the replicas, the edges (their sandboxes too when asked) and the controller;
    and the private database unless ``keep_db``."""
    connect(ray_address)
    ctl = _controller()
    done = dict(ray.get(ctl.shutdown.remote(stop_sandboxes), timeout=600))
    ray.kill(ctl, no_restart=True)
    if not keep_db:
        try:
            pg = ray.get_actor(POSTGRES, namespace=NAMESPACE)
        except ValueError:
            pass
        else:
            ray.get(pg.shutdown.remote(), timeout=60)
            ray.kill(pg, no_restart=True)
    return done
