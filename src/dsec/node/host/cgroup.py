"""A sandbox's cgroup as the edge sees it from the host: the workload split and the kill.

Each container sandbox is cgroup ``S`` (made by crun, holding dsec-init) with a child
``S/w`` that holds everything the workload runs: dsec-init moves each child it spawns
into ``S/w`` before exec. ``S/w`` carries the sandbox's limits (memory, pids, CPU quota,
SCHED_IDLE); ``S`` carries the same memory and pids limits plus a small reserve and no
CPU quota. So a workload at its memory or pids limit leaves dsec-init room to fork,
answer and kill, and a throttled workload never throttles the agent.

Teardown never asks anything inside the sandbox: :meth:`Cgroup.kill` lifts the CPU
quota and idle policy (killed tasks need CPU time to exit), freezes, SIGKILLs every
task, thaws, and repeats until the cgroup is empty or its deadline passes; on cgroup v2
with ``cgroup.kill`` one write does it. Works on v1 (one hierarchy per controller) and
v2 (one tree).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

ROOT = "/sys/fs/cgroup"
WORKLOAD = "w"
# what dsec-init keeps beyond the workload's own limits: room to fork a command and
# answer while the workload sits at its limit
PIDS_RESERVE = 32
MEMORY_RESERVE_MB = 16
V1_SPLIT = ("memory", "pids", "cpu")  # the controllers whose limits the workload gets


def _write(path: str, value: str) -> bool:
    try:
        with open(path, "w") as f:
            f.write(value)
        return True
    except OSError:
        return False


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def is_v2() -> bool:
    return os.path.exists(os.path.join(ROOT, "cgroup.controllers"))


class Cgroup:
    """The cgroup of one sandbox, by its path under each hierarchy (``/dsec-x/ID``)."""

    def __init__(self, path: str) -> None:
        self.rel = path.strip("/")
        self.v2 = is_v2()

    def dir(self, controller: str, sub: str = "") -> str:
        base = ROOT if self.v2 else os.path.join(ROOT, controller)
        return os.path.join(base, self.rel, sub) if sub else os.path.join(base, self.rel)

    def hierarchies(self) -> list[str]:
        """Every directory of this cgroup (one per mounted v1 hierarchy, or the v2 one)."""
        if self.v2:
            d = os.path.join(ROOT, self.rel)
            return [d] if os.path.isdir(d) else []
        seen: dict[str, str] = {}
        with contextlib.suppress(OSError):
            for name in os.listdir(ROOT):
                d = os.path.join(ROOT, name, self.rel)
                if os.path.isdir(d):
                    seen.setdefault(os.path.realpath(d), d)
        return list(seen.values())

    def procs(self) -> set[int]:
        """Every process in the cgroup and below it (threads' groups included)."""
        base = self.dir("pids") if os.path.isdir(self.dir("pids")) else self.dir("memory")
        out: set[int] = set()
        for d, _, _ in os.walk(base):
            for name in ("cgroup.procs", "tasks"):
                out.update(int(x) for x in _read(os.path.join(d, name)).split())
        return out

    # ---- the workload split ---------------------------------------------------------
    def split_workload(self, memory_mb: int, cpu_cores: float, pids: int, cpu_shares: int,
                       idle: bool) -> list[int]:
        """Make ``S/w`` with the sandbox's limits and give ``S`` the reserve on top.
        Returns fds of ``S/w``'s cgroup.procs files (open for writing) for dsec-init;
        the caller closes them once init holds its copies."""
        mem, memsw = (memory_mb << 20), (memory_mb << 20)
        quota = int(cpu_cores * 100_000)
        if self.v2:
            return self._split_v2(mem, quota, pids, cpu_shares, idle)
        fds = []
        for ctrl in V1_SPLIT:
            top = self.dir(ctrl)
            w = os.path.join(top, WORKLOAD)
            os.makedirs(w, exist_ok=True)
            if ctrl == "memory":
                # memsw first when raising, limit first when lowering: the kernel wants limit <= memsw
                reserve = MEMORY_RESERVE_MB << 20
                _write(os.path.join(top, "memory.memsw.limit_in_bytes"), str(memsw + reserve))
                _write(os.path.join(top, "memory.limit_in_bytes"), str(mem + reserve))
                _write(os.path.join(w, "memory.limit_in_bytes"), str(mem))
                _write(os.path.join(w, "memory.memsw.limit_in_bytes"), str(memsw))
            elif ctrl == "pids":
                _write(os.path.join(top, "pids.max"), str(pids + PIDS_RESERVE))
                _write(os.path.join(w, "pids.max"), str(pids))
            else:
                _write(os.path.join(top, "cpu.cfs_quota_us"), "-1")
                _write(os.path.join(w, "cpu.cfs_period_us"), "100000")
                _write(os.path.join(w, "cpu.cfs_quota_us"), str(quota))
                _write(os.path.join(w, "cpu.shares"), str(cpu_shares))
                if idle:
                    _write(os.path.join(w, "cpu.idle"), "1")
            fds.append(os.open(os.path.join(w, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC))
        return fds

    def _split_v2(self, mem: int, quota: int, pids: int, weight_shares: int, idle: bool) -> list[int]:
        # no internal processes in v2: init moves to S/i before S's controllers reach S/w
        top = os.path.join(ROOT, self.rel)
        init_dir, w = os.path.join(top, "i"), os.path.join(top, WORKLOAD)
        os.makedirs(init_dir, exist_ok=True)
        for pid in _read(os.path.join(top, "cgroup.procs")).split():
            _write(os.path.join(init_dir, "cgroup.procs"), pid)
        _write(os.path.join(top, "cgroup.subtree_control"), "+memory +pids +cpu")
        os.makedirs(w, exist_ok=True)
        _write(os.path.join(top, "memory.max"), str(mem + (MEMORY_RESERVE_MB << 20)))
        _write(os.path.join(top, "pids.max"), str(pids + PIDS_RESERVE))
        _write(os.path.join(top, "cpu.max"), "max 100000")
        _write(os.path.join(w, "memory.max"), str(mem))
        _write(os.path.join(w, "memory.swap.max"), "0")
        _write(os.path.join(w, "pids.max"), str(pids))
        _write(os.path.join(w, "cpu.max"), f"{quota} 100000")
        _write(os.path.join(w, "cpu.weight"), str(max(1, min(10000, weight_shares * 100 // 1024))))
        if idle:
            _write(os.path.join(w, "cpu.idle"), "1")
        return [os.open(os.path.join(w, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)]

    def workload(self, controller: str) -> str:
        """The directory holding the workload's limits for ``controller`` (S/w if split)."""
        w = self.dir(controller, WORKLOAD)
        return w if os.path.isdir(w) else self.dir(controller)

    # ---- freezing and killing -------------------------------------------------------
    def _freezer(self) -> tuple[str, str, str]:
        if self.v2:
            return os.path.join(ROOT, self.rel, "cgroup.freeze"), "1", "0"
        return os.path.join(self.dir("freezer"), "freezer.state"), "FROZEN", "THAWED"

    def freeze(self, frozen: bool) -> None:
        path, on, off = self._freezer()
        _write(path, on if frozen else off)

    def freeze_all(self, timeout: float) -> bool:
        """Freeze every task and wait until the kernel says all are frozen (v1 reads FREEZING
        while tasks are still on their way); False if that takes past ``timeout``. What
        ``crun pause`` does, without its fork and exec (~5 ms a pause here)."""
        path, on, _ = self._freezer()
        _write(path, on)
        deadline = time.monotonic() + timeout
        pause = 0.0005
        while True:
            state = _read(os.path.join(ROOT, self.rel, "cgroup.events")) if self.v2 else _read(path)
            if ("frozen 1" in state) if self.v2 else state == on:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def frozen(self) -> bool:
        path, on, _ = self._freezer()
        if self.v2:
            return "frozen 1" in _read(os.path.join(ROOT, self.rel, "cgroup.events"))
        return _read(path) in (on, "FREEZING")

    def _unthrottle(self, pids: set[int]) -> None:
        """Killed tasks need CPU time to exit: lift the quota and the idle policy first."""
        for d, _, _ in os.walk(self.dir("cpu")):
            if self.v2:
                _write(os.path.join(d, "cpu.max"), "max 100000")
            else:
                _write(os.path.join(d, "cpu.cfs_quota_us"), "-1")
                _write(os.path.join(d, "cpu.shares"), "1024")
            _write(os.path.join(d, "cpu.idle"), "0")
        for pid in pids:
            with contextlib.suppress(OSError):
                os.sched_setscheduler(pid, os.SCHED_OTHER, os.sched_param(0))

    def kill(self, timeout: float = 10.0) -> bool:
        """SIGKILL everything in the cgroup, whatever it does; True once it is empty."""
        deadline = time.monotonic() + timeout
        pids = self.procs()
        if not pids:
            self.freeze(False)
            return True
        kill_file = os.path.join(ROOT, self.rel, "cgroup.kill")
        if self.v2 and os.path.exists(kill_file):
            _write(kill_file, "1")
        pause = 0.001
        while True:
            self.freeze(True)  # no new forks while the signals go out
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            self.freeze(False)  # a frozen task cannot die
            pids = self.procs()
            if not pids:
                return True
            if time.monotonic() > deadline:
                return False
            # still there: killed tasks need CPU time to exit, which a quota or the idle
            # policy may withhold (lifted only now: most sandboxes are gone by the first look)
            self._unthrottle(pids)
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def remove(self, children_only: bool = False) -> list[str]:
        """Remove the (empty) cgroup in every hierarchy, children first; what is left.
        ``children_only``: leave ``S`` itself (crun removes its own cgroup on delete)."""
        left = []
        for top in self.hierarchies():
            for d, _, _ in sorted(os.walk(top), key=lambda x: -len(x[0])):
                if children_only and d == top:
                    continue
                try:
                    os.rmdir(d)
                except FileNotFoundError:
                    pass
                except OSError:
                    left.append(d)
        return left
