"""``dsec nodes`` and ``dsec node info | cordon | uncordon | events`` (docs/fault-tolerance.md):
the fleet's edges with their health and load, an operator's cordon, and the event log."""

from __future__ import annotations

import datetime
import json
from typing import Annotated

import typer
from rich.table import Table

from dsec.client.cli.common import TokenOpt, UrlOpt, _errors, console
from dsec.client.sdk import Client
from dsec.shared.wire.nodes import NodeInfo

node_app = typer.Typer(help="This cluster's nodes (edges): health, cordons, events", no_args_is_help=True)
JsonOpt = Annotated[bool, typer.Option("--json", help="JSON instead of a table")]
_STYLE = {"ok": "green", "suspect": "yellow", "cordoned": "red"}


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "-"


def _row(n: NodeInfo) -> list[str]:
    s = n.signals
    disk = _pct(s.disk_used_bytes, s.disk_total_bytes) if s else "-"
    why = n.health_reason or ("" if n.state == "up" else n.state)
    if n.cordoned_by and n.cordoned_by != "detector":
        why = f"by {n.cordoned_by}: {why}"
    cpu = _pct(n.cpu_reserved, n.cpus * n.cpu_overcommit)
    mem = _pct(n.memory_reserved_mb, n.memory_mb * n.memory_overcommit)
    return [n.edge, n.state, f"[{_STYLE[n.health]}]{n.health}[/]", why, str(n.sandboxes), cpu, mem, disk]


def nodes(url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """Every edge: whether it answers, its health (ok / suspect / cordoned) and why, and its
    load (sandboxes; CPU and memory reserved of what it admits; disk used)."""
    with _errors(), Client(url=url, token=token) as c:
        items = c.nodes()
    if as_json:
        print(json.dumps([n.model_dump(mode="json") for n in items], indent=1))
        return
    t = Table("name", "state", "health", "why", "sandboxes", "cpu", "mem", "disk")
    for n in items:
        t.add_row(*_row(n))
    console.print(t)


@node_app.command("info")
def info(url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """Each edge's capabilities: backends, and for VMs the accelerator (KVM only when a
    probe boot showed it runs guests, else TCG), agent channel, QEMU and guest kernel."""
    with _errors(), Client(url=url, token=token) as c:
        items = c.nodes()
    if as_json:
        print(json.dumps([n.model_dump(mode="json") for n in items], indent=1))
        return
    for n in items:
        console.print(f"[bold]{n.edge}[/bold] {'healthy' if n.healthy else 'UNHEALTHY'}: {n.cpus} CPUs, "
                      f"{n.memory_mb} MiB, {n.sandboxes} sandboxes; backends {', '.join(b.value for b in n.backends)}")
        for k, v in (n.vm or {}).items():
            console.print(f"  vm.{k}: {v}")


def _show(n: NodeInfo) -> None:
    console.print(f"{n.edge}: [{_STYLE[n.health]}]{n.health}[/]" + (f" ({n.health_reason})" if n.health_reason else ""))


@node_app.command("cordon")
def cordon(node: str, reason: Annotated[str, typer.Option(help="why (kept with the cordon and its event)")],
           url: UrlOpt = None, token: TokenOpt = None) -> None:
    """No new sandboxes on NODE until it is uncordoned; what runs there runs on."""
    with _errors(), Client(url=url, token=token) as c:
        _show(c.nodes.cordon(node, reason))


@node_app.command("uncordon")
def uncordon(node: str, reason: Annotated[str, typer.Option(help="why (kept with the event)")] = "",
             url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Lift NODE's cordon (an operator's or the detector's)."""
    with _errors(), Client(url=url, token=token) as c:
        _show(c.nodes.uncordon(node, reason))


@node_app.command("events")
def events(edge: Annotated[str | None, typer.Option(help="this edge's only")] = None,
           kind: Annotated[str | None, typer.Option(help="suspect, cordoned, recovered, uncordoned, ...")] = None,
           after: int = 0, limit: int = 200, url: UrlOpt = None, token: TokenOpt = None,
           as_json: JsonOpt = False) -> None:
    """The fleet's events, oldest first: health changes with their evidence, cordons and
    uncordons with who and why."""
    with _errors(), Client(url=url, token=token) as c:
        items = c.nodes.events(edge, kind=kind, after=after, limit=limit)
    if as_json:
        print(json.dumps([e.model_dump(mode="json") for e in items], indent=1))
        return
    t = Table("id", "at", "edge", "kind", "actor", "reason")
    for e in items:
        at = datetime.datetime.fromtimestamp(e.at).strftime("%Y-%m-%d %H:%M:%S")
        t.add_row(str(e.id), at, e.edge, e.kind, e.actor, e.reason + (f" [{e.sandbox_id}]" if e.sandbox_id else ""))
    console.print(t)
