"""``dsec snapshot take | list | drop | rollback`` (docs/snapshots.md): a running
container's in-place snapshots on its edge, and the rollback to one; ``dsec branch``: the
live branch of a running sandbox into new ones."""

from __future__ import annotations

import datetime
import json
from typing import Annotated

import typer
from rich.table import Table

from dsec.client.cli.common import TokenOpt, UrlOpt, _errors, console
from dsec.client.sdk import Client
from dsec.shared.wire.snapshots import SandboxSnapshot

snapshot_app = typer.Typer(help="A running container's in-place snapshots, and rollback", no_args_is_help=True)
JsonOpt = Annotated[bool, typer.Option("--json", help="JSON instead of a table")]


def _table(items: list[SandboxSnapshot]) -> Table:
    t = Table("name", "taken", "freeze ms", "own bytes", "commands", "sessions")
    for s in items:
        at = datetime.datetime.fromtimestamp(s.taken_at).strftime("%Y-%m-%d %H:%M:%S")
        t.add_row(s.name, at, f"{s.freeze_ms:.1f}", "?" if s.bytes is None else str(s.bytes), str(s.commands_seq),
                  ", ".join(sorted(s.sessions)))
    return t


@snapshot_app.command("take")
def take(sandbox_id: str, name: Annotated[str | None, typer.Option(help="default: snap-N")] = None,
         url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """Snapshot SANDBOX_ID's files now."""
    with _errors(), Client(url=url, token=token) as c:
        snap = c.connect(sandbox_id).snapshot(name)
    if as_json:
        print(snap.model_dump_json(indent=1))
    else:
        console.print(_table([snap]))


@snapshot_app.command("list")
def list_(sandbox_id: str, url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """SANDBOX_ID's in-place snapshots, oldest first."""
    with _errors(), Client(url=url, token=token) as c:
        items = c.connect(sandbox_id).snapshots()
    if as_json:
        print(json.dumps([s.model_dump(mode="json") for s in items], indent=1))
    else:
        console.print(_table(items))


@snapshot_app.command("drop")
def drop(sandbox_id: str, name: str, url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Drop SANDBOX_ID's snapshot NAME."""
    with _errors(), Client(url=url, token=token) as c:
        c.connect(sandbox_id).drop_snapshot(name)
    console.print(f"dropped {name}")


@snapshot_app.command("rollback")
def rollback(sandbox_id: str, name: str, url: UrlOpt = None, token: TokenOpt = None,
             as_json: JsonOpt = False) -> None:
    """Bring SANDBOX_ID's files back to snapshot NAME (its processes but dsec-init are killed)."""
    with _errors(), Client(url=url, token=token) as c:
        res = c.connect(sandbox_id).rollback(name)
    if as_json:
        print(res.model_dump_json(indent=1))
    else:
        console.print(f"{sandbox_id} rolled back to {name} in {res.rollback_ms:.1f} ms: {res.killed} processes "
                      f"killed, sessions restarted: {', '.join(res.sessions) or 'none'}, "
                      f"{res.commands_dropped} command records dropped")


def branch(sandbox_id: str, n: Annotated[int, typer.Option("-n", "--children", help="how many children (1-16)")] = 1,
           url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """Live-branch running SANDBOX_ID into N new sandboxes that continue from its state,
    processes included (microVMs and VMs); it runs on."""
    with _errors(), Client(url=url, token=token) as c:
        children = c.connect(sandbox_id).branch(n)
    if as_json:
        print(json.dumps([ch.info.model_dump(mode="json") for ch in children], indent=1))
    else:
        for ch in children:
            console.print(ch.sandbox_id)
