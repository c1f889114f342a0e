"""Memory of paused sandboxes: the node's compressed swap (zram, set up and sized by the
edge), pushing a frozen sandbox's anonymous memory out to it (process_madvise
MADV_PAGEOUT on every mapping of every process in its cgroup: proactive reclaim that
works the same on cgroup v1 and v2), and prefetching it back (MADV_WILLNEED starts
asynchronous swap-in) before the sandbox is thawed.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import subprocess

from dsec.node.host.cgroup import WORKLOAD, Cgroup

log = logging.getLogger("dsec.edge.memory")
CGROUP_ROOT = "/sys/fs/cgroup"
SYS_PROCESS_MADVISE = 440
MADV_WILLNEED = 3
MADV_PAGEOUT = 21
IOV_MAX = 1024
_libc = ctypes.CDLL(None, use_errno=True)


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def swap_status() -> list[dict[str, str]]:
    with open("/proc/swaps") as f:
        lines = f.read().splitlines()[1:]
    return [dict(zip(("name", "type", "size_kb", "used_kb", "priority"), line.split(), strict=False))
            for line in lines if line.strip()]


def ensure_swap(fraction: float = 0.5, device: str = "zram0") -> str:
    """Compressed swap for paused sandboxes: zram sized at ``fraction`` of RAM (its
    uncompressed capacity; it holds only what is pushed out, compressed). Left alone when
    the node already has swap. Returns a line saying what the node has."""
    active = swap_status()
    if active:
        return ", ".join(f"{s['name']} ({int(s['size_kb']) >> 10} MiB)" for s in active)
    sysdir = f"/sys/block/{device}"
    if not os.path.isdir(sysdir):
        with contextlib.suppress(OSError):
            subprocess.run(["modprobe", "zram"], capture_output=True, check=False)
    if not os.path.isdir(sysdir):
        return "none (no zram device; paused sandboxes keep their memory)"
    with open("/proc/meminfo") as f:
        total_kb = int(f.readline().split()[1])
    size = int(total_kb * 1024 * fraction) & ~0xFFFFF
    try:
        with open(f"{sysdir}/disksize") as f:
            configured = int(f.read().strip())
        if configured == 0:
            with contextlib.suppress(OSError), open(f"{sysdir}/comp_algorithm", "w") as f:
                f.write("lz4")
            with open(f"{sysdir}/disksize", "w") as f:
                f.write(str(size))
        subprocess.run(["mkswap", f"/dev/{device}"], capture_output=True, check=True)
        subprocess.run(["swapon", "-p", "100", f"/dev/{device}"], capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        return f"none (zram setup failed: {e})"
    return f"/dev/{device} ({size >> 20} MiB zram, lz4)"


def psi(resource: str) -> dict[str, float]:
    """``/proc/pressure/<resource>`` (cpu, memory, io): avg10 of ``some`` and ``full`` (%);
    empty where the kernel has no PSI."""
    out: dict[str, float] = {}
    with contextlib.suppress(OSError, ValueError, KeyError):
        with open(f"/proc/pressure/{resource}") as f:
            for line in f:
                kind, *fields = line.split()
                out[kind] = float(dict(x.split("=") for x in fields)["avg10"])
    return out


def pressure() -> dict[str, float]:
    """Memory pressure (PSI, % of the last 10 s): ``some`` (a task stalled on memory) and
    ``full`` (all non-idle tasks stalled), plus MemAvailable in MiB."""
    out: dict[str, float] = dict(psi("memory"))
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                out["available_mb"] = int(line.split()[1]) / 1024
    return out


def cgroup_pids(cgroup_path: str) -> list[int]:
    """Every process of the cgroup and its children (the sandbox's init and its workload)."""
    return sorted(Cgroup(cgroup_path).procs())


def cgroup_memory(cgroup_path: str) -> dict[str, int]:
    """Memory charged to a cgroup: total, anon, file and swap (bytes), v1 or v2 names."""
    rel = cgroup_path.lstrip("/")
    out: dict[str, int] = {}
    v1 = os.path.join(CGROUP_ROOT, "memory", rel)
    if os.path.isdir(v1):
        with contextlib.suppress(OSError):
            with open(os.path.join(v1, "memory.usage_in_bytes")) as f:
                out["total"] = int(f.read())
            with open(os.path.join(v1, "memory.stat")) as f:
                st = dict(line.split() for line in f)
            out["anon"] = int(st.get("total_rss", st.get("rss", 0)))
            out["file"] = int(st.get("total_cache", st.get("cache", 0)))
            out["swap"] = int(st.get("total_swap", st.get("swap", 0)))
            # memory.stat may lag by seconds (its flush is rate-limited); the page
            # counters are exact, and a pause reports right after pushing memory out
            with open(os.path.join(v1, "memory.memsw.usage_in_bytes")) as f:
                out["swap"] = max(0, int(f.read()) - out["total"])
            # the same lag can leave anon/file above what is charged now (right after a
            # pause pushed it out): never report more than the exact total
            out["anon"] = min(out["anon"], out["total"])
            out["file"] = min(out["file"], out["total"] - out["anon"])
        return out
    v2 = os.path.join(CGROUP_ROOT, rel)
    with contextlib.suppress(OSError):
        with open(os.path.join(v2, "memory.current")) as f:
            out["total"] = int(f.read())
        with open(os.path.join(v2, "memory.stat")) as f:
            st = dict(line.split() for line in f)
        out["anon"] = int(st.get("anon", 0))
        out["file"] = int(st.get("file", 0))
        with open(os.path.join(v2, "memory.swap.current")) as f:
            out["swap"] = int(f.read())
    return out


def _key_of(path: str, key: str) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        with open(path) as f:
            for line in f:
                k, _, v = line.partition(" ")
                if k == key:
                    return int(v)
    return None


def _cgroup_key(cgroup_path: str, files: list[tuple[str, str]], key: str) -> int:
    """The ``key N`` line of the first readable (controller, file) of a cgroup (v1 or v2).
    v1 counts events where they happen, so the workload's child cgroup is added in; v2's
    are hierarchical already."""
    rel = cgroup_path.lstrip("/")
    for controller, name in files:
        if controller:
            found = [_key_of(os.path.join(CGROUP_ROOT, controller, r, name), key) for r in (rel, f"{rel}/{WORKLOAD}")]
            if any(v is not None for v in found):
                return sum(v or 0 for v in found)
        elif (v := _key_of(os.path.join(CGROUP_ROOT, rel, name), key)) is not None:
            return v
    return 0


def memory_failures(cgroup_path: str) -> int:
    """How often the workload's memory charges hit its limit (v1 failcnt; v2 "max" events)."""
    w = Cgroup(cgroup_path).workload("memory")
    with contextlib.suppress(OSError, ValueError), open(os.path.join(w, "memory.failcnt")) as f:
        return int(f.read())
    return _key_of(os.path.join(w, "memory.events"), "max") or 0


def oom_kills(cgroup_path: str) -> int:
    """How many processes of the cgroup the kernel has killed at its memory limit."""
    return _cgroup_key(cgroup_path, [("memory", "memory.oom_control"), ("", "memory.events")], "oom_kill")


def pids_limit_hits(cgroup_path: str) -> int:
    """How many forks the cgroup's pids limit has refused."""
    return _cgroup_key(cgroup_path, [("pids", "pids.events"), ("", "pids.events")], "max")


def cpu_throttled_s(cgroup_path: str) -> float:
    """Time the cgroup's tasks were held back by its CPU quota."""
    v1 = _cgroup_key(cgroup_path, [("cpu", "cpu.stat")], "throttled_time")
    return v1 / 1e9 if v1 else _cgroup_key(cgroup_path, [("", "cpu.stat")], "throttled_usec") / 1e6


def disk_usage(path: str) -> int:
    """Bytes allocated under ``path`` (a file or a tree), not following links."""
    total = 0
    with contextlib.suppress(OSError):
        st = os.lstat(path)
        total += st.st_blocks * 512
        if not os.path.isdir(path) or os.path.islink(path):
            return total
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def _ranges(pid: int) -> list[tuple[int, int]]:
    """The private mappings of ``pid`` worth paging out: anonymous and private file
    mappings that can hold dirty anonymous copies (not shared ones, not [vsyscall])."""
    out = []
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.split()
                start, end = (int(x, 16) for x in parts[0].split("-"))
                perms = parts[1]
                name = parts[5] if len(parts) > 5 else ""
                if perms[3] != "p" or name in ("[vsyscall]", "[vvar]", "[vdso]"):
                    continue
                out.append((start, end - start))
    except OSError:
        pass
    return out


def _madvise_process(pid: int, advice: int) -> int:
    """process_madvise over every private mapping of ``pid``; bytes advised."""
    ranges = _ranges(pid)
    if not ranges:
        return 0
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return 0
    done = 0
    try:
        for i in range(0, len(ranges), IOV_MAX):
            batch = ranges[i:i + IOV_MAX]
            iov = (_IOVec * len(batch))(*[_IOVec(start, length) for start, length in batch])
            r = _libc.syscall(SYS_PROCESS_MADVISE, pidfd, iov, len(batch), advice, 0)
            if r > 0:
                done += r
    finally:
        os.close(pidfd)
    return done


def _v2_swap_max(cgroup_path: str, value: str) -> None:
    """cgroup v2 keeps a running sandbox out of swap with memory.swap.max 0 (crun's
    reading of the OCI limit); a paused one may use it. v1 charges memory+swap together
    (memsw), so paging out needs no change there."""
    path = os.path.join(CGROUP_ROOT, cgroup_path.lstrip("/"), "memory.swap.max")
    if os.path.exists(path):
        with contextlib.suppress(OSError), open(path, "w") as f:
            f.write(value)


def page_out(cgroup_path: str) -> int:
    """Push the anonymous memory of every process in the cgroup out to swap (it should
    be frozen, so nothing touches it meanwhile)."""
    _v2_swap_max(cgroup_path, "max")
    return sum(_madvise_process(pid, MADV_PAGEOUT) for pid in cgroup_pids(cgroup_path))


def prefetch(cgroup_path: str) -> int:
    """Start bringing a paused sandbox's memory back (asynchronous swap-in)."""
    n = sum(_madvise_process(pid, MADV_WILLNEED) for pid in cgroup_pids(cgroup_path))
    _v2_swap_max(cgroup_path, "0")  # what is still out comes back as it is touched
    return n


def has_core_scheduling() -> bool:
    """Whether the kernel offers core scheduling (prctl PR_SCHED_CORE)."""
    PR_SCHED_CORE, PR_SCHED_CORE_GET = 62, 0  # noqa: N806
    cookie = ctypes.c_ulong(0)
    r = _libc.prctl(PR_SCHED_CORE, PR_SCHED_CORE_GET, 0, 0, ctypes.byref(cookie))
    return bool(r == 0)

