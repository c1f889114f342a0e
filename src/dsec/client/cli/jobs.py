"""``dsec job create | get | list | status | pause | resume | stop``: jobs through the SDK
(see docs/rl.md, "Jobs"). Each prints JSON, for scripts."""

from __future__ import annotations

from typing import Annotated

import typer

from dsec.client.cli.common import TokenOpt, UrlOpt, _errors
from dsec.client.sdk import Client

job_app = typer.Typer(help="Jobs: named groups of sandboxes with a quota, paused, resumed and stopped as one",
                      no_args_is_help=True)
ProjectOpt = Annotated[str | None, typer.Option(help="admin tokens: the job's project (default: default)")]
LabelOpt = Annotated[list[str] | None, typer.Option("--label", help="key=value (repeatable)")]


def _labels(items: list[str] | None) -> dict[str, str]:
    out = {}
    for item in items or []:
        if "=" not in item:
            raise typer.BadParameter(f"label {item!r} must be key=value", param_hint="--label")
        k, v = item.split("=", 1)
        out[k] = v
    return out


@job_app.command("create")
def create(name: str,
           sandboxes: Annotated[int | None, typer.Option(help="quota: live sandboxes at most")] = None,
           cpu_cores: Annotated[float | None, typer.Option(help="quota: sum of their cpu_cores_limit")] = None,
           memory_mb: Annotated[int | None, typer.Option(help="quota: sum of their memory_limit_mb")] = None,
           creates_per_s: Annotated[float | None, typer.Option(
               help="creation-rate budget: creates per second for the whole job, every replica together "
                    "(past it: 429 rate_limited with Retry-After)")] = None,
           label: LabelOpt = None, project: ProjectOpt = None, url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Create job NAME; sandboxes created with job=NAME then count against its quota."""
    from dsec.shared.wire.jobs import JobQuota

    with _errors(), Client(url=url, token=token) as c:
        job = c.create_job(name, quota=JobQuota(sandboxes=sandboxes, cpu_cores=cpu_cores, memory_mb=memory_mb,
                                                creates_per_s=creates_per_s),
                           labels=_labels(label), project=project)
        print(job.info.model_dump_json())


@job_app.command("get")
def get(name: str, project: ProjectOpt = None, url: UrlOpt = None, token: TokenOpt = None) -> None:
    with _errors(), Client(url=url, token=token) as c:
        print(c.job(name, project=project).info.model_dump_json())


@job_app.command("list")
def list_(label: LabelOpt = None, state: Annotated[str | None, typer.Option(help="active, paused or stopped")] = None,
          project: ProjectOpt = None, url: UrlOpt = None, token: TokenOpt = None) -> None:
    """One JSON line per job."""
    with _errors(), Client(url=url, token=token) as c:
        for info in c.jobs(labels=_labels(label), state=state, project=project):
            print(info.model_dump_json())


@job_app.command("status")
def status(name: str, usage: Annotated[bool, typer.Option("--usage", help="add CPU time and memory used now")]
           = False, project: ProjectOpt = None, url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Counts by state, backend and edge; usage against the quota; creations in the last minute."""
    with _errors(), Client(url=url, token=token) as c:
        print(c.job(name, project=project).status(usage=usage).model_dump_json(indent=1))


def _act(name: str, what: str, project: str | None, url: str | None, token: str | None) -> None:
    with _errors(), Client(url=url, token=token) as c:
        job = c.job(name, project=project)
        r = {"pause": job.pause, "resume": job.resume, "stop": job.stop}[what]()
        print(r.model_dump_json())


@job_app.command("pause")
def pause(name: str, project: ProjectOpt = None, url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Refuse new sandboxes for the job and pause every running one."""
    _act(name, "pause", project, url, token)


@job_app.command("resume")
def resume(name: str, project: ProjectOpt = None, url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Take new sandboxes again and resume every paused one."""
    _act(name, "resume", project, url, token)


@job_app.command("stop")
def stop(name: str, project: ProjectOpt = None, url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Stop every sandbox of the job; it takes none again."""
    _act(name, "stop", project, url, token)
