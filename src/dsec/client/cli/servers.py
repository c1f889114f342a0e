"""The commands that run dsec's services: ``dsec serve`` (apiserver and one edge in one
process), ``dsec edge serve`` (one node's edge daemon) and ``dsec apiserver`` (the
apiserver in front of edge daemons). The edge's options are declared once and shared by
the two commands that run an edge."""

from __future__ import annotations

import asyncio
import faulthandler
import inspect
import logging
import os
import re
import resource
import signal
from collections.abc import Callable
from typing import Annotated, Any

import typer

from dsec.client.cli.common import StoreOpt, _errors, err
from dsec.shared.wire.models import EDGE_NAME_RE

SHUTDOWN_GRACE_S = 10  # requests in flight get this long at a stop, then are cancelled (sandboxes run on)
DEFAULT_EDGE_PORT = 7801

edge_app = typer.Typer(help="This node's edge daemon (cluster mode)", no_args_is_help=True)


def _edge_options(
        data_dir: Annotated[str | None, typer.Option(help="state and layers (default /var/lib/dsec)")] = None,
        store: StoreOpt = None,
        log_level: str = "info",
        fetch_mode: Annotated[str, typer.Option(help="shared store: ondemand (lazy, chunked) or eager")] = "ondemand",
        chunk_cache_mb: Annotated[int, typer.Option(help="bound of the node's chunk cache")] = 10240,
        fetch_timeout: Annotated[float, typer.Option(help="seconds before a stalled chunk read fails")] = 20.0,
        pause_below_mb: Annotated[int, typer.Option(
            help="pause idle best-effort sandboxes while the node has less memory available (MiB)")] = 1024,
        admit_max_psi: Annotated[float, typer.Option(
            help="refuse new sandboxes while memory pressure (PSI full avg10, %) is above this")] = 20.0,
        cpu_overcommit: Annotated[float, typer.Option(help="admit CPU limits up to this many times the cores")] = 8.0,
        memory_overcommit: Annotated[float, typer.Option(help="admit memory limits up to this many times RAM")] = 1.5,
        egress_service: Annotated[list[str] | None, typer.Option(
            help="an egress service beyond pypi/npm/debian, NAME=HOST[,*.SUFFIX] (repeatable)")] = None,
        sandbox_subnet: Annotated[str | None, typer.Option(
            help="IPv4 subnet for sandbox addresses (default: a free /19 of 10.211.0.0/16)")] = None,
        sandbox_volume_gb: Annotated[int | None, typer.Option(
            help="size of the btrfs volume holding writable layers with per-sandbox quotas "
                 "(default: half the free space, 4-256 GiB; 0: plain directories, no quotas)")] = None,
) -> dict[str, Any]:
    """The edge's settings from its options (EdgeConfig fields)."""
    if fetch_mode not in ("ondemand", "eager"):
        err.print("[red]error[/red]: --fetch-mode must be ondemand or eager")
        raise typer.Exit(2)
    return {"fetch_mode": fetch_mode, "chunk_cache_bytes": chunk_cache_mb << 20, "fetch_timeout_s": fetch_timeout,
            "pause_below_mb": pause_below_mb, "admit_max_psi": admit_max_psi, "cpu_overcommit": cpu_overcommit,
            "memory_overcommit": memory_overcommit, "egress_services": egress_service or [],
            "sandbox_subnet": sandbox_subnet, "sandbox_volume_gb": sandbox_volume_gb}


def _with_edge_options(fn: Callable[..., None]) -> Callable[..., None]:
    """Give a command the edge's options too (typer reads the merged signature); the
    command gets them in ``**edge``."""
    own = [p for p in inspect.signature(fn, eval_str=True).parameters.values()
           if p.kind != inspect.Parameter.VAR_KEYWORD]
    shared = inspect.signature(_edge_options, eval_str=True).parameters.values()
    fn.__signature__ = inspect.Signature([*own, *shared])  # type: ignore[attr-defined]
    return fn


def _edge_settings(edge: dict[str, Any]) -> tuple[str, str | None, dict[str, Any]]:
    """(data dir, store, EdgeConfig fields) of a command's edge options."""
    from dsec.faces.embedded import data_dir_default

    cfg = _edge_options(**edge)
    _prepare_process(edge["log_level"])
    return edge["data_dir"] or data_dir_default(), edge["store"], cfg


def _prepare_process(log_level: str) -> None:
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1`: every thread's stack to stderr
    # the CLI dies quietly on a closed pipe (`dsec ... | head`); a service must not: a write to a
    # pipe whose reader died (a sandbox's shell killed from inside) is an EPIPE to handle
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    # a sandbox holds a few fds in the edge (init socket, session pipes): thousands need more than 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _read_secret(path: str) -> str:
    try:
        with open(path) as f:
            secret = f.read().strip()
    except OSError as e:
        err.print(f"[red]error[/red]: --secret-file {path}: {e.strerror}")
        raise typer.Exit(2) from None
    if len(secret) < 16:
        err.print(f"[red]error[/red]: --secret-file {path}: the cluster secret must be at least 16 characters "
                  "(e.g. `head -c 32 /dev/urandom | base64`)")
        raise typer.Exit(2)
    return secret


TLSCertOpt = Annotated[str | None, typer.Option(
    help="mutual TLS on the edge wire: this daemon's certificate (PEM; with --tls-key and --ca)")]
TLSKeyOpt = Annotated[str | None, typer.Option(help="this daemon's private key (PEM, a file readable by it only)")]
CAOpt = Annotated[str | None, typer.Option(
    help="the cluster CA's certificate(s) (PEM): the peers this daemon accepts are those it signed")]


def _tls_files(cert: str | None, key: str | None, ca: str | None) -> Any:
    """The TLS files a daemon run by hand was given: all three or none (else exit 2,
    naming the one missing). Re-read whenever they change (``dsec cluster rotate-certs``)."""
    from dsec.shared.tls import TLSFiles

    given = {"--tls-cert": cert, "--tls-key": key, "--ca": ca}
    if not any(given.values()):
        return None
    missing = [opt for opt, v in given.items() if not v]
    if missing:
        err.print(f"[red]error[/red]: {missing[0]}: mutual TLS needs --tls-cert, --tls-key and --ca together")
        raise typer.Exit(2)
    files = TLSFiles(cert=str(cert), key=str(key), ca=str(ca))
    try:
        files.check()
    except ValueError as e:
        err.print(f"[red]error[/red]: {e}")
        raise typer.Exit(2) from None
    return files


def _tls_context(files: Any, server: bool) -> Any:
    """The SSLContext for ``files`` (None: plain HTTP), reloaded when they change."""
    import ssl

    from dsec.shared.tls import Reloader, client_context, server_context

    if files is None:
        return None
    try:
        ctx = server_context(files) if server else client_context(files)
    except (ssl.SSLError, OSError) as e:
        err.print(f"[red]error[/red]: --tls-cert {files.cert}: {e}")
        raise typer.Exit(2) from None
    Reloader(files, [ctx]).start()
    return ctx


AccessLogOpt = Annotated[bool, typer.Option(
    help="log every request (uvicorn's access log, signatures cut out); off by default: a line per request "
         "costs ~0.1 ms of the apiserver's CPU, a tenth of a session command")]


def _run_uvicorn(fastapi_app: Any, host: str, port: int, log_level: str, access_log: bool = False) -> None:
    import uvicorn

    from dsec.control.apiserver.limits import GuardedHttpTools

    # keep-alive longer than clients keep idle connections (the SDK: 30 s), so a client never
    # sends on a connection the server is closing
    # the standard asyncio loop, not uvloop: uvloop and a Python socket object can both
    # believe they own one fd (a transport handed a socket, then closed on error or by the
    # garbage collector), and the second close lands on whatever file got that number next
    # (seen here: sandbox sockets and client connections closed under their owners)
    # a shutdown waits SHUTDOWN_GRACE_S for requests in flight (a 300 s exec, an open TTY),
    # then cancels them: the sandboxes keep running and are re-adopted by the next start
    # http: uvicorn's httptools (C) HTTP/1.1 parser, with a deadline on a request's headers
    # (dsec.control.apiserver.limits); h11, uvicorn's pure-Python one, cost ~0.3 ms more a request
    config = uvicorn.Config(fastapi_app, host=host, port=port, log_level=log_level, ws_max_size=1 << 20,
                            timeout_keep_alive=65, loop="asyncio", access_log=access_log,
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S, http=GuardedHttpTools)
    logging.getLogger("uvicorn.access").addFilter(_no_signatures)  # after the Config set up uvicorn's logging
    uvicorn.Server(config).run()


_SIGNATURE = re.compile(r"(signature=)[^&\s]+")


def _no_signatures(record: logging.LogRecord) -> bool:
    """A signed URL (E2B's file URLs, a build context's upload URL) is a credential: the
    access log shows it with its signature cut out."""
    if isinstance(record.args, tuple) and len(record.args) >= 3 and isinstance(record.args[2], str):
        record.args = (*record.args[:2], _SIGNATURE.sub(r"\1***", record.args[2]), *record.args[3:])
    return True


@_with_edge_options
def serve(host: str = "127.0.0.1", port: int = 7777,
          token: Annotated[str | None, typer.Option(help="API token (default: generated into DATA_DIR/token)")] = None,
          edge_name: str = "edge0", access_log: AccessLogOpt = False, **edge: Any) -> None:
    """Run apiserver, placement, watcher and one edge in this process until SIGTERM."""
    from dsec.faces.embedded import build_embedded
    from dsec.shared import tracing

    tracing.setup("dsec-serve")
    data_dir, store, cfg = _edge_settings(edge)
    with _errors():
        try:
            fastapi_app, _ = build_embedded(data_dir, token or os.environ.get("DSEC_TOKEN"),
                                            edge_name=edge_name, edge_cfg=cfg, store=store)
        except ValueError as e:
            err.print(f"[red]error[/red]: {e}")
            raise typer.Exit(2) from None
    _run_uvicorn(fastapi_app, host, port, edge["log_level"], access_log)


@_with_edge_options
def edge_serve(name: Annotated[str, typer.Option(help="this edge's name in the cluster (unique)")],
               secret_file: Annotated[str, typer.Option(help="file holding the cluster secret")],
               listen: Annotated[str, typer.Option(help="HOST:PORT the daemon listens on")]
               = f"127.0.0.1:{DEFAULT_EDGE_PORT}",
               db: Annotated[str | None, typer.Option(
                   envvar="DSEC_DB", help="a cluster's database (postgresql://...; default $DSEC_DB): the layer "
                                          "catalog lives there, shared by the cluster (what `dsec cluster up` "
                                          "gives)")] = None,
               tls_cert: TLSCertOpt = None, tls_key: TLSKeyOpt = None, ca: CAOpt = None,
               **edge: Any) -> None:
    """Run this node's edge daemon until SIGTERM: the edge contract over HTTP and
    WebSocket, for apiservers holding the cluster secret."""
    from aiohttp import web

    from dsec.faces.embedded import build_edge
    from dsec.node.edge.remote.server import build_app
    from dsec.shared import tracing

    tracing.setup("dsec-edge")
    if not EDGE_NAME_RE.match(name):
        err.print(f"[red]error[/red]: --name {name!r}: an edge's name is a lower-case letter, then up to 30 "
                  "lower-case letters or digits (its sandboxes' ids are NAME-xxxxxxxxxxxx)")
        raise typer.Exit(2)
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        err.print(f"[red]error[/red]: --listen must be HOST:PORT, not {listen!r}")
        raise typer.Exit(2)
    secret = _read_secret(secret_file)
    tls = _tls_context(_tls_files(tls_cert, tls_key, ca), server=True)
    data_dir, store, cfg = _edge_settings(edge)
    with _errors():
        try:
            node = build_edge(data_dir, name, cfg, store, db)
        except (ValueError, ConnectionError) as e:  # ConnectionError: the cluster's database unreachable, why
            err.print(f"[red]error[/red]: {e}")
            raise typer.Exit(2) from None
    app = build_app(node, secret, node.cfg.max_file_bytes)

    async def start(_: web.Application) -> None:
        await node.start()
        logging.getLogger("dsec").info("edge %s serving on %s, data dir %s", name, listen, data_dir)

    async def stop(_: web.Application) -> None:
        await node.close()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    # keep-alive longer than a RemoteEdge keeps idle connections (30 s)
    web.run_app(app, host=host.strip("[]"), port=int(port), shutdown_timeout=SHUTDOWN_GRACE_S,
                keepalive_timeout=75, print=None, access_log=None, ssl_context=tls)


def apiserver(secret_file: Annotated[str, typer.Option(help="file holding the cluster secret")],
              edges: Annotated[str | None, typer.Option(
                  help="the edges, named by hand: NAME=URL[,NAME=URL...]")] = None,
              db: Annotated[str | None, typer.Option(
                  envvar="DSEC_DB", help="a cluster's database (postgresql://...; default $DSEC_DB): run as one of "
                                         "its replicas, edges from its registry (what `dsec cluster up` starts)")]
              = None,
              host: str = "127.0.0.1", port: int = 7777,
              data_dir: Annotated[str | None, typer.Option(help="tokens and IAM (default /var/lib/dsec)")] = None,
              token: Annotated[str | None, typer.Option(help="API token (default: generated into DATA_DIR/token)")]
              = None,
              store: StoreOpt = None, log_level: str = "info", access_log: AccessLogOpt = False,
              tls_cert: TLSCertOpt = None, tls_key: TLSKeyOpt = None, ca: CAOpt = None) -> None:
    """Run the apiserver (with placement and the watcher) in front of edge daemons: named
    by hand (--edges), or a cluster's (--db)."""
    from dsec.faces.embedded import build_apiserver, build_replica, data_dir_default
    from dsec.shared import tracing

    tracing.setup("dsec-apiserver")
    if (edges is None) == (db is None):
        err.print("[red]error[/red]: give --edges (edges named by hand) or --db (a cluster's registry), not both")
        raise typer.Exit(2)
    secret = _read_secret(secret_file)
    # the client side of the edges' mutual TLS (the API itself is served as before)
    tls = _tls_context(_tls_files(tls_cert, tls_key, ca), server=False)
    token = token or os.environ.get("DSEC_TOKEN")
    _prepare_process(log_level)
    if db is not None:
        if not token:
            err.print("[red]error[/red]: a replica needs the cluster's admin token (--token or $DSEC_TOKEN)")
            raise typer.Exit(2)
        from sqlalchemy.exc import SQLAlchemyError

        with _errors():
            try:
                fastapi_app = build_replica(db, secret, token, data_dir or data_dir_default(), store, tls)
            except (ValueError, ConnectionError, SQLAlchemyError) as e:  # ConnectionError: unreachable, why
                err.print(f"[red]error[/red]: --db: {str(e).splitlines()[0]}")
                raise typer.Exit(2) from None
    else:
        pairs = _edge_pairs(edges or "")
        if tls is None and (bad := [n for n, u in pairs.items() if u.startswith("https://")]):
            err.print(f"[red]error[/red]: --edges: {bad[0]} is https://: give this apiserver its certificate "
                      "(--tls-cert, --tls-key, --ca)")
            raise typer.Exit(2)
        fastapi_app = build_apiserver(pairs, secret, data_dir or data_dir_default(), token, store,
                                      tls)
    _run_uvicorn(fastapi_app, host, port, log_level, access_log)


def _edge_pairs(edges: str) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for item in filter(None, (x.strip() for x in edges.split(","))):
        name, sep, url = item.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            err.print(f"[red]error[/red]: --edges: {item!r} is not NAME=http://HOST:PORT")
            raise typer.Exit(2)
        if name in pairs:
            err.print(f"[red]error[/red]: --edges: edge {name!r} is named twice")
            raise typer.Exit(2)
        pairs[name] = url
    if not pairs:
        err.print("[red]error[/red]: --edges names no edge")
        raise typer.Exit(2)
    return pairs


def edge_hollow(count: Annotated[int, typer.Option(min=1, max=1000, help="how many hollow edges")],
                secret_file: Annotated[str, typer.Option(help="file holding the cluster secret")],
                data_root: Annotated[str, typer.Option(help="each edge keeps its records in DATA_ROOT/NAME")],
                db: Annotated[str | None, typer.Option(
                    envvar="DSEC_DB", help="a cluster's database: each edge registers in its registry")] = None,
                prefix: Annotated[str, typer.Option(help="edge names: PREFIX0, PREFIX1, ...")] = "h",
                first: Annotated[int, typer.Option(help="the first edge's number")] = 0,
                host: str = "127.0.0.1",
                port: Annotated[int, typer.Option(help="edge i listens on PORT + i (0: free ports)")] = 0,
                cpus: Annotated[int, typer.Option(help="cores each models (a DSec node's)")] = 192,
                memory_gb: Annotated[int, typer.Option(help="memory each models")] = 2048,
                max_sandboxes: Annotated[int, typer.Option(help="each edge's sandbox limit")] = 4096,
                sweep_s: Annotated[float, typer.Option(
                    min=0.1, max=60, help="seconds between each edge's TTL sweeps (a real edge's: 1)")] = 1.0,
                store: StoreOpt = None, log_level: str = "warning") -> None:
    """Run COUNT hollow edges in this process (a load instrument for the control plane,
    docs/scale.md: the real edge over a runtime that starts no process and mounts nothing;
    never a backend a user can choose). Prints NAME URL per edge, runs until SIGTERM."""
    from dsec.node.edge.remote.hollow import serve_fleet

    _prepare_process(log_level)
    secret = _read_secret(secret_file)
    cfg = {"hollow_cpus": cpus, "hollow_memory_mb": memory_gb * 1024, "max_sandboxes": max_sandboxes,
           "ttl_check_interval_s": sweep_s}
    asyncio.run(serve_fleet(count, prefix, os.path.abspath(data_root), secret, host, port, db, store, cfg, first))


def register(app: typer.Typer) -> None:
    app.command()(serve)
    app.command()(apiserver)
    edge_app.command("serve")(edge_serve)
    edge_app.command("hollow")(edge_hollow)
    app.add_typer(edge_app, name="edge")
