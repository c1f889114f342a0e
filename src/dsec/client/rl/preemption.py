"""Preemption for trainers (docs/rl.md, "Preemption"): a trainer that is about to be killed
(SIGTERM from a scheduler) pauses its job, so its sandboxes keep their state with their
memory reclaimed and no straggler starts new work; the next trainer process resumes it.

Async (``async with Preemptible(client, "grpo-1"):``) and sync (``with preemptible(client,
"grpo-1"):``) faces; both resume the job on entry if a previous process paused it, and on
SIGTERM pause it (bounded by ``grace_s``) and leave with exit status 143, as a process
killed by SIGTERM does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator
from types import FrameType, TracebackType

from dsec.client.sdk.client import AsyncClient
from dsec.client.sdk.jobs import AsyncJob
from dsec.client.sdk.sync import Client, Job
from dsec.shared.errors import DsecError

log = logging.getLogger("dsec.rl.preemption")
EXIT_STATUS = 128 + signal.SIGTERM


class Preempted(SystemExit):
    """Raised out of the trainer's main task once its job is paused."""

    def __init__(self) -> None:
        super().__init__(EXIT_STATUS)


class Preemptible:
    def __init__(self, client: AsyncClient, job: str, *, grace_s: float = 20.0,
                 signals: tuple[signal.Signals, ...] = (signal.SIGTERM,)) -> None:
        self.client = client
        self.name = job
        self.grace_s = grace_s
        self.signals = signals
        self.job: AsyncJob | None = None
        self.preempted = False
        self._main: asyncio.Task[object] | None = None
        self._pausing: asyncio.Task[None] | None = None

    async def __aenter__(self) -> AsyncJob:
        self.job = await self.client.job(self.name)
        if self.job.info.state == "paused":
            await self.job.resume()
            log.info("job %s resumed", self.name)
        self._main = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in self.signals:
            loop.add_signal_handler(sig, self._on_signal)
        return self.job

    def _on_signal(self) -> None:
        if not self.preempted:
            self.preempted = True
            self._pausing = asyncio.get_running_loop().create_task(self._pause())

    async def _pause(self) -> None:
        assert self.job is not None
        try:
            await asyncio.wait_for(self.job.pause(), self.grace_s)
            log.info("job %s paused on preemption", self.name)
        except (DsecError, TimeoutError) as e:  # the sandboxes expire by their own timeouts
            log.warning("job %s not paused on preemption: %s", self.name, e)
        if self._main is not None:
            self._main.cancel()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        loop = asyncio.get_running_loop()
        for sig in self.signals:
            loop.remove_signal_handler(sig)
        if self.preempted:
            self._main = None  # the pause, finishing, must not cancel this exit
            if self._pausing is not None:
                try:
                    await asyncio.shield(self._pausing)
                except asyncio.CancelledError:
                    pass  # the signal came while the body was leaving: it was that cancel
            raise Preempted()


@contextlib.contextmanager
def preemptible(client: Client, job: str, *, grace_s: float = 20.0) -> Iterator[Job]:
    """The sync face: resume ``job`` if paused; on SIGTERM pause it and exit with 143."""
    handle = client.job(job)
    if handle.info.state == "paused":
        handle.resume()

    def on_term(_sig: int, _frame: FrameType | None) -> None:
        try:
            client._portal.call(asyncio.wait_for(handle._inner.pause(), grace_s))
        except (DsecError, TimeoutError) as e:
            log.warning("job %s not paused on preemption: %s", job, e)
        raise Preempted()

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield handle
    finally:
        signal.signal(signal.SIGTERM, previous)
