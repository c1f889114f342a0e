"""``dsec rollout-worker`` (the process that runs agent loops for trainers) and ``dsec rollout
list | get | counts | cancel`` (docs/rl.md, "Rollouts that outlive the trainer")."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Annotated

import typer

from dsec.client.cli.common import TokenOpt, UrlOpt, _errors
from dsec.client.sdk import Client
from dsec.client.sdk.rollouts import AsyncRollouts
from dsec.client.sdk.sync import Rollouts

rollout_app = typer.Typer(help="Rollouts: agent loops run by the platform's rollout workers", no_args_is_help=True)
ProjectOpt = Annotated[str | None, typer.Option(help="admin tokens: the project (default: every project's)")]


def worker(url: UrlOpt = None, token: TokenOpt = None,
           concurrency: Annotated[int, typer.Option(min=1, max=10_000, help="rollouts run at once")] = 64,
           path: Annotated[list[str] | None, typer.Option(
               "--path", help="a directory the agents are imported from (repeatable)")] = None,
           name: Annotated[str | None, typer.Option(help="this worker's name (default host:pid:random)")] = None,
           lease_s: Annotated[float, typer.Option(min=2, max=600, help="a lost worker's rollouts are run again "
                                                  "this long after its last heartbeat")] = 30.0,
           project: ProjectOpt = None,
           log_level: Annotated[str, typer.Option(help="debug, info, warning")] = "info") -> None:
    """Claim queued rollouts and run their agent loops until SIGTERM or SIGINT (then the
    running ones are handed back to the platform, journals kept, for another worker)."""
    from dsec.client.cli.common import err
    from dsec.client.rollouts import Worker
    from dsec.client.sdk import AsyncClient

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        async with AsyncClient(url=url, token=token) as client:
            w = Worker(client, name=name, concurrency=concurrency, lease_s=lease_s, project=project, paths=path)
            err.print(f"rollout worker {w.name}: {concurrency} at once, apiserver {client.url}")
            await w.run(stop)
    with _errors():
        asyncio.run(main())


@rollout_app.command("list")
def list_(job: Annotated[str | None, typer.Option(help="those of this job")] = None,
          state: Annotated[list[str] | None, typer.Option(help="queued, running, done, failed, cancelled")] = None,
          project: ProjectOpt = None, url: UrlOpt = None, token: TokenOpt = None) -> None:
    """One JSON line per rollout, in creation order."""
    with _errors(), Client(url=url, token=token) as c:
        for r in _face(c, project).list(job=job, state=state or []):
            print(r.model_dump_json(exclude_none=True))


@rollout_app.command("get")
def get(rollout_id: str, steps: Annotated[bool, typer.Option("--steps", help="with the trajectory")] = False,
        project: ProjectOpt = None, url: UrlOpt = None, token: TokenOpt = None) -> None:
    with _errors(), Client(url=url, token=token) as c:
        print(_face(c, project).get(rollout_id, steps=steps, spec=True).model_dump_json(exclude_none=True))


@rollout_app.command("counts")
def counts(job: Annotated[str | None, typer.Option(help="those of this job")] = None, project: ProjectOpt = None,
           url: UrlOpt = None, token: TokenOpt = None) -> None:
    with _errors(), Client(url=url, token=token) as c:
        print(_face(c, project).counts(job=job).model_dump_json())


@rollout_app.command("cancel")
def cancel(rollout_id: str, project: ProjectOpt = None, url: UrlOpt = None, token: TokenOpt = None) -> None:
    with _errors(), Client(url=url, token=token) as c:
        print(_face(c, project).cancel(rollout_id).model_dump_json(exclude_none=True))


def _face(c: Client, project: str | None) -> Rollouts:
    return Rollouts(c._portal, AsyncRollouts(c._inner, project))
