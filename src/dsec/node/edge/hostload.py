"""The node's own load as /proc tells it (CPU busy since the last read, load, memory,
swap): what the console shows per edge next to what its sandboxes reserve."""

from __future__ import annotations

import os

from dsec.shared.wire.fleet import HostLoad


class HostLoadReader:
    """CPU busy is a difference of /proc/stat counters, so a reader keeps the last ones."""

    def __init__(self) -> None:
        self._last: tuple[int, int] | None = None

    def _cpu_pct(self) -> float:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return 0.0
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        total = sum(fields[:8])  # guest time is already counted in user
        last, self._last = self._last, (total, idle)
        if last is None or total <= last[0]:
            return 0.0
        return round(100.0 * (1 - (idle - last[1]) / (total - last[0])), 1)

    def read(self) -> HostLoad:
        mem: dict[str, int] = {}
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    key, _, rest = line.partition(":")
                    if key in ("MemTotal", "MemAvailable", "SwapTotal", "SwapFree"):
                        mem[key] = int(rest.split()[0]) >> 10
        except (OSError, ValueError):
            pass
        return HostLoad(cpu_pct=self._cpu_pct(), load1=round(os.getloadavg()[0], 2),
                        memory_total_mb=mem.get("MemTotal", 0), memory_available_mb=mem.get("MemAvailable", 0),
                        swap_total_mb=mem.get("SwapTotal", 0), swap_free_mb=mem.get("SwapFree", 0))
