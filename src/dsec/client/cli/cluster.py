"""``dsec cluster up | status | down``: dsec across the nodes of a Ray cluster (see
docs/cluster.md)."""

from __future__ import annotations

import json
import os
import sys
from typing import Annotated

import typer

from dsec.client.cli.common import StoreOpt, console, err, interruptible

cluster_app = typer.Typer(help="dsec across the nodes of a Ray cluster", no_args_is_help=True)
RayOpt = Annotated[str, typer.Option("--ray-address", help="the Ray cluster (auto: the one this node is in)")]


@cluster_app.command()
def up(ray_address: RayOpt = "auto",
       db: Annotated[str | None, typer.Option(
           help="the cluster's PostgreSQL (postgresql://USER:PASS@HOST/DB); default: a private one on this node")]
       = None,
       db_allow: Annotated[list[str] | None, typer.Option(
           help="a network (CIDR) the private database admits besides its node's own subnet (repeatable): "
                "nodes routed from elsewhere")] = None,
       store: StoreOpt = None,
       apiservers: Annotated[int, typer.Option(help="apiserver replicas to run")] = 2,
       apiserver_resource: Annotated[str | None, typer.Option(
           help="a Ray resource the replicas require, to keep them on the nodes that have it "
                "(default: spread over every node)")] = None,
       data_root: Annotated[str, typer.Option(help="each node's edge keeps its state in DATA_ROOT/NAME")]
       = "/var/lib/dsec/cluster",
       listen_host: Annotated[str | None, typer.Option(help="address the daemons bind (default: each node's IP)")]
       = None,
       edge_port: Annotated[int, typer.Option(help="each edge daemon's port (0: a free one)")] = 7801,
       api_port: Annotated[int, typer.Option(help="replica i listens on API_PORT + i (0: free ports)")] = 7777,
       edge_arg: Annotated[list[str] | None, typer.Option(
           help="one more `dsec edge serve` option for every edge, e.g. --edge-arg=--cpu-overcommit=4")] = None,
       protect: Annotated[list[str] | None, typer.Option(
           help="an address, network (CIDR) or host name no sandbox may reach (repeatable), besides the "
                "cluster's nodes, database, edges, replicas and MooseFS master, which are walled off anyway: "
                "chunkservers, a metadata service, anything else of the infrastructure")] = None,
       token_file: Annotated[str | None, typer.Option(help="where to write the admin token (0600)")] = None,
       tls: Annotated[bool, typer.Option(
           help="mutual TLS between replicas and edges (a cluster CA, a certificate per daemon)")] = True) -> None:
    """Start dsec on a Ray cluster: an edge on every node with the dsec_edge resource, the
    apiserver replicas, the controller; prints the apiserver URLs."""
    interruptible()  # it waits minutes for the cluster: Ctrl-C quits within a second
    from sqlalchemy.exc import SQLAlchemyError

    from dsec.control.cluster import ops
    from dsec.node.storage.backend import open_backend

    if store is None and not os.environ.get("DSEC_STORE"):
        err.print("[red]error[/red]: a cluster needs --store: a shared filesystem path mounted on every node")
        raise typer.Exit(2)
    from dsec.node.edge.network.wall import entry

    for item in protect or []:
        try:
            entry(item)
        except ValueError as e:
            err.print(f"[red]error[/red]: --protect: {e}")
            raise typer.Exit(2) from None
    try:  # here first, at once: each edge would refuse it too, but only past `up`'s wait
        open_backend(store or os.environ["DSEC_STORE"], "sharedfs")
    except ValueError as e:
        err.print(f"[red]error[/red]: --store: {e}")
        raise typer.Exit(2) from None
    try:
        res = ops.up(ray_address, db, store=store or os.environ.get("DSEC_STORE"), apiservers=apiservers,
                     apiserver_resource=apiserver_resource,
                     data_root=data_root, listen_host=listen_host, edge_port=edge_port, api_port=api_port,
                     edge_args=edge_arg or [], db_allow=db_allow or [], protect=protect or [], tls=tls,
                     say=lambda line: err.print(f"[dim]{line}[/dim]"))
    except (TimeoutError, RuntimeError, ValueError, ConnectionError, SQLAlchemyError) as e:
        err.print(f"[red]error[/red]: {str(e).splitlines()[0]}")
        raise typer.Exit(2) from None
    path = token_file or os.path.join(data_root, "token")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(res.token + "\n")
    console.print(f"edges: {', '.join(res.edges)}")
    console.print(f"apiservers: {','.join(res.apiservers)}")
    console.print(f"admin token: {path}")
    console.print(f"export DSEC_URL={','.join(res.apiservers)} DSEC_TOKEN=$(cat {path})")


@cluster_app.command()
def status(ray_address: RayOpt = "auto", as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Edges (state, health, load, sandboxes), replicas and the controller's last events."""
    from rich.table import Table

    from dsec.control.cluster import ops

    # Ray's driver prints what it hears of the cluster (a lost raylet, say) to stdout, from
    # its own threads and at exit: with --json, stdout holds the document and nothing else
    doc = os.fdopen(os.dup(1), "w") if as_json else None
    if doc is not None:
        sys.stdout.flush()
        os.dup2(2, 1)
    try:
        st = ops.status(ray_address)
    except (ops.ClusterDown, ConnectionError) as e:
        err.print(f"[red]error[/red]: {e}")
        raise typer.Exit(2) from None
    if doc is not None:
        with doc:
            doc.write(json.dumps(st, indent=2) + "\n")
        return
    t = Table("edge", "state", "healthy", "url", "sandboxes", "cpu reserved", "memory reserved", "why")
    for edge in st["edges"]:
        s = edge["stats"] or {}
        t.add_row(edge["name"], edge["state"], "yes" if edge["healthy"] else "no", edge["url"],
                  str(s.get("sandboxes", "-")),
                  f"{s.get('cpu_reserved', 0):.1f}/{s.get('cpus', 0) * s.get('cpu_overcommit', 0):g}" if s else "-",
                  f"{s.get('memory_reserved_mb', 0)}/{int(s.get('memory_mb', 0) * s.get('memory_overcommit', 0))} MiB"
                  if s else "-", edge["reason"])
    console.print(t)
    console.print("apiservers: " + ", ".join(st["apiservers"][k] for k in sorted(st["apiservers"])))
    for what, f in sorted(st.get("failing_starts", {}).items()):
        last = [ln for ln in f["error"].strip().splitlines() if ln.strip()][-1:] or [""]
        err.print(f"[red]{what} fails to start[/red] ({f['tries']} tries, trying again): {last[0][:300]}")
    if st["last_error"]:
        console.print(f"[yellow]controller[/yellow]: {st['last_error']}")


@cluster_app.command("rotate-certs")
def rotate_certs(ray_address: RayOpt = "auto",
                 new_ca: Annotated[bool, typer.Option(
                     help="sign with a new cluster CA (trusted alongside the old one until the next rotation)")]
                 = False) -> None:
    """New TLS certificates for every replica, edge and the controller, taken up while they
    run: no sandbox, connection or request is dropped."""
    from dsec.control.cluster import ops

    try:
        done = ops.rotate_certs(ray_address, new_ca)
    except (ops.ClusterDown, ConnectionError) as e:
        err.print(f"[red]error[/red]: {e}")
        raise typer.Exit(2) from None
    console.print(f"new certificates for {done['daemons']} daemons" + (" (a new CA)" if new_ca else ""))


@cluster_app.command()
def down(ray_address: RayOpt = "auto",
         stop_sandboxes: Annotated[bool, typer.Option(
             help="stop every sandbox too (default: they run on, and the next `up` re-adopts them)")] = False,
         keep_db: Annotated[bool, typer.Option(help="leave the private PostgreSQL running")] = False) -> None:
    """Stop the replicas, the edges and the controller (and the private database)."""
    from dsec.control.cluster import ops

    try:
        done = ops.down(ray_address, stop_sandboxes, keep_db)
    except (ops.ClusterDown, ConnectionError) as e:
        err.print(f"[red]error[/red]: {e}")
        raise typer.Exit(2) from None
    console.print(f"stopped {done['apiservers']} apiservers, {done['edges']} edges"
                  + (f", {done['sandboxes_stopped']} sandboxes" if stop_sandboxes else ""))
