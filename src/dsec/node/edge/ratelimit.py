"""Per-sandbox token buckets for what a sandbox can make the edge record at its own pace
(process executions, denied connections): the first ``burst`` at once, then ``rate`` a
second, the rest counted and said once the bucket refills."""

from __future__ import annotations

import time


class Buckets:
    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self._by_key: dict[str, list[float]] = {}  # key -> [tokens, last refill, suppressed]

    def admit(self, key: str) -> tuple[bool, int]:
        """Whether this one is recorded, and how many were left out since the last one was."""
        now = time.monotonic()
        b = self._by_key.setdefault(key, [self.burst, now, 0.0])
        b[0] = min(self.burst, b[0] + (now - b[1]) * self.rate)
        b[1] = now
        if b[0] >= 1:
            b[0] -= 1
            dropped, b[2] = int(b[2]), 0.0
            return True, dropped
        b[2] += 1
        return False, 0

    def forget(self, key: str) -> None:
        self._by_key.pop(key, None)
