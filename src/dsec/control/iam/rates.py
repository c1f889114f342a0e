"""FnCall calls per second per project: a token bucket per project with a cap, on each
apiserver replica, holding a second's worth of calls. A call is taken from the buckets of
its project and every ancestor with a cap, or refused with a 429 naming the first that is
empty. The caps are read from the project tree at most every ``CACHE_S``."""

from __future__ import annotations

import asyncio
import time

from dsec.control.iam.projects import ProjectStore
from dsec.shared.errors import QuotaExceeded

CACHE_S = 2.0


class FnCallRates:
    def __init__(self, projects: ProjectStore) -> None:
        self.projects = projects
        self._caps: dict[str, tuple[list[tuple[str, float]], float]] = {}
        self._buckets: dict[str, tuple[float, float]] = {}  # project -> (tokens, at)

    async def take(self, project: str) -> None:
        now = time.monotonic()
        caps, at = self._caps.get(project, ([], float("-inf")))
        if now - at > CACHE_S:
            caps = await asyncio.to_thread(self.projects.rates, project)
            if len(self._caps) > 100_000:
                self._caps.clear()
            self._caps[project] = (caps, now)
        filled = []
        for p, rate in caps:
            size = max(rate, 1.0)  # a second's worth, and at least one call
            tokens, last = self._buckets.get(p, (size, now))
            tokens = min(size, tokens + (now - last) * rate)
            if tokens < 1.0:
                self._buckets[p] = (tokens, now)
                raise QuotaExceeded(f"project {p!r} is at its FnCall rate of {rate:g} calls per second",
                                    field="quota.fncall_per_s")
            filled.append((p, tokens))
        for p, tokens in filled:
            self._buckets[p] = (tokens - 1.0, now)
