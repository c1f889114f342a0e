"""What a sandbox still holds on this host after its stop: mounts, cgroups, processes,
runtime state, files, sockets, network namespaces and QEMU processes. The test suite's
teardown checks and the chaos soak (bench/chaos.py) read it; empty means fully released."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable


def sandbox_leftovers(sandbox_id: str, data_dirs: Iterable[str]) -> list[str]:
    """Everything of ``sandbox_id`` on this host. ``data_dirs`` hold edges' data under
    ``edges/NAME`` (glob patterns allowed)."""
    found = []
    with open("/proc/self/mountinfo") as f:
        found += [f"mount {line.split()[4]}" for line in f if sandbox_id in line]
    found += [f"cgroup {p}" for p in glob.glob(f"/sys/fs/cgroup/**/{sandbox_id}", recursive=True)]
    for cg in glob.glob("/proc/[0-9]*/cgroup"):
        try:
            with open(cg) as f:
                if sandbox_id not in f.read():
                    continue
            # a zombie holds nothing but its pid until its parent reaps it: the edge reaps
            # the inits it started; one re-adopted after an edge restart is the host
            # init's to reap, which on some hosts takes its time
            with open(cg.replace("/cgroup", "/stat"), "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue
            found.append(f"process {cg.split('/')[2]}")
        except (OSError, IndexError):
            pass
    for d in data_dirs:
        for where in (("sandboxes",), ("volume", "sandboxes")):
            found += [f"file {p}" for p in glob.glob(os.path.join(d, "edges", "*", *where, sandbox_id))]
    found += [f"runtime {p}" for p in glob.glob(f"/run/dsec/*/s/{sandbox_id}")]
    found += [f"crun {p}" for p in glob.glob(f"/run/dsec/*/crun/{sandbox_id}")]
    found += [f"netns {p}" for p in glob.glob(f"/run/netns/*{sandbox_id}*")]
    found += [f"vm socket {p}" for p in glob.glob(f"/run/dsec/*/v/{sandbox_id}.*")]
    found += [f"qemu {pid}" for pid in qemu_pids(sandbox_id)]
    return found


def qemu_pids(sandbox_id: str) -> list[int]:
    """QEMU processes serving ``sandbox_id`` (their socket paths name it)."""
    out = []
    for cmd in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(cmd[:-7] + "comm", "rb") as f:  # cheap, unlike the arguments (see VMRuntime.qemus)
                if not f.read().startswith(b"qemu-system"):
                    continue
            with open(cmd, "rb") as f:
                argv = f.read()
        except OSError:
            continue
        if argv.startswith(b"qemu-system") or b"/qemu-system" in argv.split(b"\0")[0]:
            if sandbox_id.encode() in argv:
                out.append(int(cmd.split("/")[2]))
    return out
