"""``dsec checkpoint take | list``, ``dsec move``, ``dsec restore`` and ``dsec node drain``
(docs/fault-tolerance.md): a sandbox's checkpoints, and moving checkpointed sandboxes
between edges."""

from __future__ import annotations

import datetime
import json
from typing import Annotated

import typer
from rich.table import Table

from dsec.client.cli.common import TokenOpt, UrlOpt, _errors, console, interruptible
from dsec.client.sdk import Client
from dsec.shared.wire.fleet import CheckpointInfo

checkpoint_app = typer.Typer(help="A sandbox's checkpoints in the shared store", no_args_is_help=True)
JsonOpt = Annotated[bool, typer.Option("--json", help="JSON instead of a table")]


def _table(items: list[CheckpointInfo]) -> Table:
    t = Table("seq", "kind", "edge", "taken", "entries", "bytes", "freeze ms", "build ms")
    for cp in items:
        at = datetime.datetime.fromtimestamp(cp.taken_at).strftime("%Y-%m-%d %H:%M:%S")
        t.add_row(str(cp.seq), cp.kind, cp.edge, at, str(cp.files), str(cp.bytes), f"{cp.freeze_ms:.1f}",
                  f"{cp.build_ms:.0f}")
    return t


@checkpoint_app.command("take")
def take(sandbox_id: str, full: Annotated[bool, typer.Option(help="all of its writable layer")] = False,
         url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """Checkpoint SANDBOX_ID now."""
    with _errors(), Client(url=url, token=token) as c:
        cp = c.connect(sandbox_id).checkpoint(full=full)
    if as_json:
        print(cp.model_dump_json(indent=1))
    else:
        console.print(_table([cp]))


@checkpoint_app.command("list")
def list_(sandbox_id: str, url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """SANDBOX_ID's checkpoints, oldest first."""
    with _errors(), Client(url=url, token=token) as c:
        items = c.connect(sandbox_id).checkpoints()
    if as_json:
        print(json.dumps([cp.model_dump(mode="json") for cp in items], indent=1))
    else:
        console.print(_table(items))


def move(sandbox_id: str, url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Move a checkpointed sandbox to another edge (same id; its processes restart)."""
    interruptible()  # a move waits on the edges: Ctrl-C quits within a second
    with _errors(), Client(url=url, token=token) as c:
        info = c.connect(sandbox_id).move()
    console.print(f"{info.sandbox_id} runs on {info.edge} ({info.restored_from})")


def restore(sandbox_id: str, url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Restore a lost node's sandbox from its newest checkpoint on another edge."""
    interruptible()  # a move waits on the edges: Ctrl-C quits within a second
    with _errors(), Client(url=url, token=token) as c:
        info = c.connect(sandbox_id).restore()
    console.print(f"{info.sandbox_id} runs on {info.edge} ({info.restored_from})")


def drain(node: str, url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """Move every checkpointed sandbox off NODE (cordon it first); list what was left."""
    interruptible()  # a move waits on the edges: Ctrl-C quits within a second
    with _errors(), Client(url=url, token=token) as c:
        report = c.nodes.drain(node)
    if as_json:
        print(report.model_dump_json(indent=1))
        return
    t = Table("sandbox", "outcome", "detail")
    for sid, edge in report.moved.items():
        t.add_row(sid, "moved", edge)
    for sid, why in report.failed.items():
        t.add_row(sid, "[red]failed[/]", why)
    for sid, why in report.left.items():
        t.add_row(sid, "left", why)
    console.print(t)
