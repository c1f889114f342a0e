"""The sync SDK: the async core driven from a private event-loop thread, so both faces
share one implementation. Each blocking method is declared from its async twin
(``exec = _blocking(AsyncSandbox.exec)``): a type checker sees the same parameters and
the awaited result, an async iterator becomes an iterator, and an ``AsyncSandbox``
coming back becomes a :class:`Sandbox`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload

from dsec.client.sdk.batches import AsyncBatch
from dsec.client.sdk.client import AsyncClient, AsyncSandbox
from dsec.client.sdk.iam import AsyncProjects
from dsec.client.sdk.jobs import AsyncJob
from dsec.client.sdk.nodes import AsyncNodes
from dsec.client.sdk.rollouts import AsyncRollouts
from dsec.shared.wire.batches import BatchCounts, BatchInfo, BatchItem
from dsec.shared.wire.jobs import JobInfo
from dsec.shared.wire.models import ContainerArgs, MicroVMArgs, SandboxInfo, VMArgs
from dsec.shared.wire.rollouts import RolloutInfo

T = TypeVar("T")
R = TypeVar("R")
P = ParamSpec("P")


class _Portal:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="dsec-sdk", daemon=True)
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result()
        except BaseException:  # the caller interrupted (Ctrl-C): the call is cancelled, not left to fail unheard
            fut.cancel()
            raise

    def iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        pending: list[asyncio.Task[Any]] = []  # the step under way, if the caller left mid-step

        async def step() -> T:
            task = asyncio.current_task()
            assert task is not None
            pending[:] = [task]
            return await anext(agen)

        async def close() -> None:
            # a caller interrupted while waiting (Ctrl-C) left its step running in this loop:
            # it ends first, or closing the generator would find it still running
            for task in pending:
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await task
            aclose = getattr(agen, "aclose", None)
            if aclose is not None:
                await aclose()
        try:
            while True:
                try:
                    yield self.call(step())
                except StopAsyncIteration:
                    return
        finally:  # a caller that stops early closes the stream (and ends the command)
            if not self.loop.is_closed():
                self.call(close())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.loop.close()


class _Face:
    """A blocking face over an async object: its portal and the object."""

    _portal: _Portal
    _inner: Any

    def _wrap(self, x: Any) -> Any:
        return x


class _Blocking(Generic[P, R]):
    """A blocking method made from an async one (``wrap`` turns its result into the
    sync face's, e.g. an AsyncSandbox into a Sandbox)."""

    def __init__(self, fn: Callable[..., Any], kind: str) -> None:
        self.fn, self.kind = fn, kind
        self.__doc__ = fn.__doc__

    @overload
    def __get__(self, obj: None, owner: type) -> _Blocking[P, R]: ...
    @overload
    def __get__(self, obj: _Face, owner: type) -> Callable[P, R]: ...

    def __get__(self, obj: _Face | None, owner: type) -> Any:
        if obj is None:
            return self
        fn, portal, inner = self.fn, obj._portal, obj._inner
        if self.kind == "iter":
            def iterate(*a: Any, **kw: Any) -> Any:
                return portal.iterate(fn(inner, *a, **kw))
            return iterate
        if self.kind == "plain":
            def plain(*a: Any, **kw: Any) -> Any:
                return fn(inner, *a, **kw)
            return plain

        def call(*a: Any, **kw: Any) -> Any:
            return obj._wrap(portal.call(fn(inner, *a, **kw)))
        return call


def _blocking(fn: Callable[Concatenate[Any, P], Coroutine[Any, Any, T]]) -> _Blocking[P, T]:
    return _Blocking(fn, "call")


def _to_sandbox(fn: Callable[Concatenate[Any, P], Coroutine[Any, Any, AsyncSandbox]]) -> _Blocking[P, Sandbox]:
    return _Blocking(fn, "call")


def _to_sandboxes(fn: Callable[Concatenate[Any, P], Coroutine[Any, Any, list[AsyncSandbox]]]
                  ) -> _Blocking[P, list[Sandbox]]:
    return _Blocking(fn, "call")


def _iterating(fn: Callable[Concatenate[Any, P], AsyncIterator[T]]) -> _Blocking[P, Iterator[T]]:
    return _Blocking(fn, "iter")


def _plain(fn: Callable[Concatenate[Any, P], T]) -> _Blocking[P, T]:
    return _Blocking(fn, "plain")


class Sandbox(_Face):
    """Blocking handle to one sandbox; the same methods as :class:`AsyncSandbox`."""

    def __init__(self, portal: _Portal, inner: AsyncSandbox) -> None:
        self._portal = portal
        self._inner = inner

    @property
    def sandbox_id(self) -> str:
        return str(self._inner.sandbox_id)

    @property
    def info(self) -> SandboxInfo:
        return self._inner.info  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        return f"<Sandbox {self.sandbox_id} {self.info.state.value}>"

    def _wrap(self, x: Any) -> Any:  # a live branch's children: sync handles too
        if isinstance(x, list):
            return [self._wrap(i) for i in x]
        return Sandbox(self._portal, x) if isinstance(x, AsyncSandbox) else x

    refresh = _blocking(AsyncSandbox.refresh)
    exec = _blocking(AsyncSandbox.exec)
    run_shell = _blocking(AsyncSandbox.run_shell)
    exec_stream = _iterating(AsyncSandbox.exec_stream)
    command_log = _blocking(AsyncSandbox.command_log)
    write_file = _blocking(AsyncSandbox.write_file)
    read_file = _blocking(AsyncSandbox.read_file)
    list_dir = _blocking(AsyncSandbox.list_dir)
    stat = _blocking(AsyncSandbox.stat)
    remove = _blocking(AsyncSandbox.remove)
    http = _blocking(AsyncSandbox.http)
    tty_url = _plain(AsyncSandbox.tty_url)
    pack_diff = _blocking(AsyncSandbox.pack_diff)
    checkpoint = _blocking(AsyncSandbox.checkpoint)
    checkpoints = _blocking(AsyncSandbox.checkpoints)
    snapshot = _blocking(AsyncSandbox.snapshot)
    snapshots = _blocking(AsyncSandbox.snapshots)
    drop_snapshot = _blocking(AsyncSandbox.drop_snapshot)
    rollback = _blocking(AsyncSandbox.rollback)
    branch = _to_sandboxes(AsyncSandbox.branch)
    move = _blocking(AsyncSandbox.move)
    restore = _blocking(AsyncSandbox.restore)
    events = _blocking(AsyncSandbox.events)
    save_access_list = _blocking(AsyncSandbox.save_access_list)
    audit = _blocking(AsyncSandbox.audit)
    protect = _blocking(AsyncSandbox.protect)
    set_network_rules = _blocking(AsyncSandbox.set_network_rules)
    pause = _blocking(AsyncSandbox.pause)
    resume = _blocking(AsyncSandbox.resume)
    screenshot = _blocking(AsyncSandbox.screenshot)
    send_keys = _blocking(AsyncSandbox.send_keys)
    click = _blocking(AsyncSandbox.click)
    usage = _blocking(AsyncSandbox.usage)
    stop = _blocking(AsyncSandbox.stop)


def _to_job(fn: Callable[Concatenate[Any, P], Coroutine[Any, Any, AsyncJob]]) -> _Blocking[P, Job]:
    return _Blocking(fn, "call")


class Job(_Face):
    """Blocking handle to one job; the same methods as :class:`dsec.client.sdk.jobs.AsyncJob`."""

    def __init__(self, portal: _Portal, inner: AsyncJob) -> None:
        self._portal = portal
        self._inner = inner

    @property
    def name(self) -> str:
        return str(self._inner.name)

    @property
    def info(self) -> JobInfo:
        return self._inner.info  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        return f"<Job {self.name} {self.info.state}>"

    def _wrap(self, x: Any) -> Any:
        if isinstance(x, AsyncBatch):
            return Batch(self._portal, x)
        return Sandbox(self._portal, x) if isinstance(x, AsyncSandbox) else x

    get = _blocking(AsyncJob.get)
    status = _blocking(AsyncJob.status)
    sandboxes = _blocking(AsyncJob.sandboxes)
    run = _to_sandbox(AsyncJob.run)
    def create_many(self, args: ContainerArgs | MicroVMArgs | VMArgs, n: int, *,
                    all_or_nothing: bool = False) -> Batch:
        """The blocking :meth:`dsec.client.sdk.jobs.AsyncJob.create_many`."""
        return Batch(self._portal, self._portal.call(self._inner.create_many(args, n, all_or_nothing=all_or_nothing)))

    pause = _blocking(AsyncJob.pause)
    resume = _blocking(AsyncJob.resume)
    stop = _blocking(AsyncJob.stop)


class Batch(_Face):
    """Blocking handle to one batch create; the same methods as :class:`dsec.client.sdk.batches.AsyncBatch`."""

    def __init__(self, portal: _Portal, inner: AsyncBatch) -> None:
        self._portal = portal
        self._inner = inner

    @property
    def id(self) -> str:
        return str(self._inner.id)

    @property
    def info(self) -> BatchInfo:
        return self._inner.info  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        return f"<Batch {self.id} {self.info.state}>"

    def _wrap(self, x: Any) -> Any:
        if isinstance(x, tuple):
            return tuple(self._wrap(i) for i in x)
        if isinstance(x, list):
            return [self._wrap(i) for i in x]
        return Sandbox(self._portal, x) if isinstance(x, AsyncSandbox) else x

    get = _blocking(AsyncBatch.get)
    progress: _Blocking[[], Iterator[BatchCounts]] = _iterating(AsyncBatch.progress)
    wait = _blocking(AsyncBatch.wait)
    items = _blocking(AsyncBatch.items)
    result: _Blocking[[], tuple[list[Sandbox], list[BatchItem]]] = _Blocking(AsyncBatch.result, "call")
    cancel = _blocking(AsyncBatch.cancel)


class Rollouts(_Face):
    """Blocking face of the rollout service; the same methods as :class:`dsec.client.sdk.rollouts.AsyncRollouts`."""

    def __init__(self, portal: _Portal, inner: AsyncRollouts) -> None:
        self._portal = portal
        self._inner = inner

    submit = _blocking(AsyncRollouts.submit)
    get = _blocking(AsyncRollouts.get)
    list = _blocking(AsyncRollouts.list)
    counts = _blocking(AsyncRollouts.counts)
    wait = _blocking(AsyncRollouts.wait)
    finished: _Blocking[..., Iterator[RolloutInfo]] = _iterating(AsyncRollouts.finished)
    ack = _blocking(AsyncRollouts.ack)
    cancel = _blocking(AsyncRollouts.cancel)


class Projects(_Face):
    """Blocking face of the project tree; the same methods as :class:`dsec.client.sdk.iam.AsyncProjects`."""

    def __init__(self, portal: _Portal, inner: AsyncProjects) -> None:
        self._portal = portal
        self._inner = inner

    create = _blocking(AsyncProjects.create)
    get = _blocking(AsyncProjects.get)
    list = _blocking(AsyncProjects.list)
    set_quota = _blocking(AsyncProjects.set_quota)
    delete = _blocking(AsyncProjects.delete)


class Nodes(_Face):
    """Blocking face of the fleet's nodes; the same methods as :class:`dsec.client.sdk.nodes.AsyncNodes`
    (``client.nodes()`` lists them)."""

    def __init__(self, portal: _Portal, inner: AsyncNodes) -> None:
        self._portal = portal
        self._inner = inner

    __call__ = _blocking(AsyncNodes.__call__)
    list = _blocking(AsyncNodes.list)
    get = _blocking(AsyncNodes.get)
    cordon = _blocking(AsyncNodes.cordon)
    uncordon = _blocking(AsyncNodes.uncordon)
    events = _blocking(AsyncNodes.events)
    drain = _blocking(AsyncNodes.drain)


def _shut(portal: _Portal, inner: AsyncClient) -> None:
    if not portal.loop.is_closed():
        with contextlib.suppress(Exception):  # at exit the server may be long gone
            portal.call(inner.close())
        portal.close()


class Client(_Face):
    """Blocking client; the same methods as :class:`AsyncClient`."""

    def __init__(self, url: str | Sequence[str] | None = None, token: str | None = None,
                 timeout: float = 60.0) -> None:
        self._portal = _Portal()
        self._inner: AsyncClient = self._portal.call(self._make(url, token, timeout))
        # a client never closed is closed when collected or at exit (aiohttp warned "Unclosed
        # client session" at exit, where httpx and requests say nothing); once, whichever first
        self._closer = weakref.finalize(self, _shut, self._portal, self._inner)

    @staticmethod
    async def _make(url: str | Sequence[str] | None, token: str | None, timeout: float) -> AsyncClient:
        return AsyncClient(url=url, token=token, timeout=timeout)

    @property
    def url(self) -> str:
        """The apiserver in use (of several replicas, the one that answered last)."""
        return self._inner.url

    @property
    def urls(self) -> tuple[str, ...]:
        """Every apiserver URL given, in order."""
        return self._inner.urls

    @property
    def token(self) -> str | None:
        return self._inner.token

    @property
    def projects(self) -> Projects:
        """The project tree: sub-projects, quotas, usage (docs/iam.md)."""
        return Projects(self._portal, self._inner.projects)

    @property
    def nodes(self) -> Nodes:
        """The fleet: ``client.nodes()`` lists every edge with its load and health; cordon,
        uncordon, events (docs/fault-tolerance.md)."""
        return Nodes(self._portal, self._inner.nodes)

    @property
    def rollouts(self) -> Rollouts:
        """The rollout service: submit, stream finished rollouts, ack (docs/rl.md)."""
        return Rollouts(self._portal, self._inner.rollouts)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._closer()

    def _wrap(self, x: Any) -> Any:
        if isinstance(x, list):
            return [self._wrap(i) for i in x]
        if isinstance(x, AsyncJob):
            return Job(self._portal, x)
        if isinstance(x, AsyncBatch):
            return Batch(self._portal, x)
        return Sandbox(self._portal, x) if isinstance(x, AsyncSandbox) else x

    _request = _blocking(AsyncClient._request)
    run_container = _to_sandbox(AsyncClient.run_container)
    run_microvm = _to_sandbox(AsyncClient.run_microvm)
    run_vm = _to_sandbox(AsyncClient.run_vm)
    connect = _to_sandbox(AsyncClient.connect)
    list = _blocking(AsyncClient.list)
    fork = _to_sandboxes(AsyncClient.fork)
    layers = _blocking(AsyncClient.layers)
    layer = _blocking(AsyncClient.layer)
    remove_layer = _blocking(AsyncClient.remove_layer)
    set_layer_visibility = _blocking(AsyncClient.set_layer_visibility)
    gc_layers = _blocking(AsyncClient.gc_layers)
    pause_many = _blocking(AsyncClient.pause_many)
    resume_many = _blocking(AsyncClient.resume_many)
    stop_many = _blocking(AsyncClient.stop_many)
    fncall = _blocking(AsyncClient.fncall)
    fncall_many = _blocking(AsyncClient.fncall_many)
    fncall_languages = _blocking(AsyncClient.fncall_languages)
    storage_stats = _blocking(AsyncClient.storage_stats)
    create_token = _blocking(AsyncClient.create_token)
    tokens = _blocking(AsyncClient.tokens)
    revoke_token = _blocking(AsyncClient.revoke_token)
    iam_events = _blocking(AsyncClient.iam_events)
    create_job = _to_job(AsyncClient.create_job)
    job = _to_job(AsyncClient.job)
    jobs = _blocking(AsyncClient.jobs)
    def create_many(self, args: ContainerArgs | MicroVMArgs | VMArgs, n: int, job: str | None = None,
                    *, all_or_nothing: bool = False) -> Batch:
        """The blocking :meth:`dsec.client.sdk.client.AsyncClient.create_many`."""
        return Batch(self._portal, self._portal.call(self._inner.create_many(args, n, job,
                                                                             all_or_nothing=all_or_nothing)))

    batch: _Blocking[[str], Batch] = _Blocking(AsyncClient.batch, "call")
