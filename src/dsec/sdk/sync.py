"""The sync SDK: the async core driven from a private event-loop thread, so both faces
share one implementation (every coroutine method becomes a blocking call, every async
iterator a plain iterator)."""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, TypeVar

from dsec.sdk.client import AsyncClient, AsyncSandbox

T = TypeVar("T")


class _Portal:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="dsec-sdk", daemon=True)
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        while True:
            try:
                yield self.call(agen.__anext__())  # type: ignore[arg-type]
            except StopAsyncIteration:
                return

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.loop.close()


def _blocking(portal: _Portal, attr: Any, wrap: Callable[[Any], Any]) -> Any:
    if inspect.iscoroutinefunction(attr):
        def call(*a: Any, **kw: Any) -> Any:
            return wrap(portal.call(attr(*a, **kw)))
        return call
    if inspect.isasyncgenfunction(attr):
        def gen(*a: Any, **kw: Any) -> Iterator[Any]:
            return portal.iterate(attr(*a, **kw))
        return gen
    return attr


class Sandbox:
    """Blocking handle to one sandbox; the same methods as :class:`AsyncSandbox`."""

    def __init__(self, portal: _Portal, inner: AsyncSandbox) -> None:
        self._portal = portal
        self._inner = inner

    @property
    def sandbox_id(self) -> str:
        return self._inner.sandbox_id

    @property
    def info(self) -> Any:
        return self._inner.info

    def __repr__(self) -> str:
        return f"<Sandbox {self.sandbox_id} {self.info.state.value}>"

    def __getattr__(self, name: str) -> Any:
        return _blocking(self._portal, getattr(self._inner, name), lambda x: x)


class Client:
    """Blocking client; the same methods as :class:`AsyncClient`."""

    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 60.0) -> None:
        self._portal = _Portal()
        self._inner: AsyncClient = self._portal.call(self._make(url, token, timeout))

    @staticmethod
    async def _make(url: str | None, token: str | None, timeout: float) -> AsyncClient:
        return AsyncClient(url=url, token=token, timeout=timeout)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._portal.call(self._inner.close())
        self._portal.close()

    def _wrap(self, x: Any) -> Any:
        if isinstance(x, list):
            return [self._wrap(i) for i in x]
        return Sandbox(self._portal, x) if isinstance(x, AsyncSandbox) else x

    def __getattr__(self, name: str) -> Any:
        return _blocking(self._portal, getattr(self._inner, name), self._wrap)
