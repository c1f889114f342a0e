"""``dsec project create | list | usage | set-quota | delete`` (docs/iam.md): the project
tree, its quotas and what each project and job holds."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table
from rich.tree import Tree

from dsec.client.cli.common import TokenOpt, UrlOpt, _errors, console
from dsec.client.sdk import Client
from dsec.shared.wire.iam import ProjectInfo, ProjectQuota, Usage

project_app = typer.Typer(help="Projects: a tree with quotas carved from the parent's (docs/iam.md)",
                          no_args_is_help=True)
QUOTA_HELP = ("comma-separated: sandboxes=N, cpu=CORES, memory_gb=N or memory_mb=N, disk_gb=N or disk_mb=N, "
              "starting=N, fncall_per_s=N; NAME=none lifts a cap")
QuotaOpt = Annotated[str | None, typer.Option(help=QUOTA_HELP)]
_KEYS = {"sandboxes": ("sandboxes", 1), "cpu": ("cpu_cores", 1), "cpu_cores": ("cpu_cores", 1),
         "memory_mb": ("memory_mb", 1), "memory_gb": ("memory_mb", 1024), "disk_mb": ("disk_mb", 1),
         "disk_gb": ("disk_mb", 1024), "starting": ("starting", 1), "fncall_per_s": ("fncall_per_s", 1)}


def parse_quota(text: str) -> dict[str, Any]:
    """``sandboxes=20000,cpu=4000,memory_gb=16000`` -> ProjectQuota's fields (None: lift)."""
    out: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in _KEYS:
            raise typer.BadParameter(f"{item!r}: expected NAME=VALUE with NAME one of {', '.join(_KEYS)}",
                                     param_hint="--quota")
        field, scale = _KEYS[key.strip()]
        if value.strip().lower() in ("none", "null", ""):
            out[field] = None
            continue
        try:
            n = float(value) * scale
        except ValueError:
            raise typer.BadParameter(f"{item!r}: {value!r} is not a number", param_hint="--quota") from None
        out[field] = n if field in ("cpu_cores", "fncall_per_s") else int(n)
    try:
        ProjectQuota(**out)
    except ValueError as e:
        raise typer.BadParameter(str(e).splitlines()[-1], param_hint="--quota") from None
    return out


@project_app.command("create")
def create(name: str, quota: QuotaOpt = None, description: str = "", url: UrlOpt = None,
           token: TokenOpt = None) -> None:
    """Create NAME (a path: team/sub-team) with a quota carved from its parent's."""
    q = ProjectQuota(**parse_quota(quota)) if quota else None
    with _errors(), Client(url=url, token=token) as c:
        print(c.projects.create(name, q, description=description).model_dump_json(exclude_none=True))


@project_app.command("set-quota")
def set_quota(name: str, quota: Annotated[str, typer.Option(help=QUOTA_HELP)], url: UrlOpt = None,
              token: TokenOpt = None) -> None:
    """Change NAME's quota: the resources named are set, the others kept."""
    with _errors(), Client(url=url, token=token) as c:
        print(c.projects.set_quota(name, **parse_quota(quota)).model_dump_json(exclude_none=True))


@project_app.command("list")
def list_(under: Annotated[str | None, typer.Option(help="one project and its subtree")] = None,
          url: UrlOpt = None, token: TokenOpt = None) -> None:
    with _errors(), Client(url=url, token=token) as c:
        for p in c.projects.list(under):
            print(p.model_dump_json(exclude_none=True))


def _cell(used: float, cap: float | None, unit: str = "") -> str:
    return f"{used:g}{unit}" + (f" / {cap:g}{unit}" if cap is not None else "")


def _row(t: Table, label: str, u: Usage, q: ProjectQuota | None) -> None:
    q = q or ProjectQuota()
    t.add_row(label, _cell(u.sandboxes, q.sandboxes), _cell(u.cpu_cores, q.cpu_cores),
              _cell(u.memory_mb / 1024, q.memory_mb / 1024 if q.memory_mb is not None else None, " GiB"),
              _cell(u.disk_mb / 1024, q.disk_mb / 1024 if q.disk_mb is not None else None, " GiB"),
              _cell(u.starting, q.starting))


@project_app.command("usage")
def usage(name: str, tree: Annotated[bool, typer.Option(help="every sub-project and job")] = False,
          json_out: Annotated[bool, typer.Option("--json", help="the ProjectInfo as JSON")] = False,
          url: UrlOpt = None, token: TokenOpt = None) -> None:
    """What NAME's subtree holds against its quota (--tree: per sub-project and job)."""
    with _errors(), Client(url=url, token=token) as c:
        info = c.projects.get(name, tree=tree)
    if json_out:
        print(info.model_dump_json(exclude_none=True))
        return
    t = Table("project / job", "sandboxes", "CPU cores", "memory", "disk", "starting", title=f"{name}: held / quota")

    def walk(p: ProjectInfo, depth: int) -> None:
        _row(t, "  " * depth + p.name.rsplit("/", 1)[-1] if depth else p.name, p.usage, p.quota)
        for job, u in sorted((p.jobs or {}).items()):
            _row(t, "  " * (depth + 1) + f"job {job}", u, None)
        for child in p.children or []:
            walk(child, depth + 1)
    walk(info, 0)
    console.print(t)
    if not tree and info.delegated != Usage():
        d = info.delegated
        console.print(Tree(f"delegated to sub-projects: {d.sandboxes} sandboxes, {d.cpu_cores:g} CPU cores, "
                           f"{d.memory_mb / 1024:g} GiB memory, {d.disk_mb / 1024:g} GiB disk"))


@project_app.command("delete")
def delete(name: str, stop: Annotated[bool, typer.Option(help="stop its sandboxes first")] = False,
           url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Delete NAME (no sub-projects; its tokens are revoked)."""
    with _errors(), Client(url=url, token=token) as c:
        print(c.projects.delete(name, stop=stop))
