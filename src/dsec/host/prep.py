"""Makes this node able to run dsec sandboxes: cgroup layout that crun accepts and
the per-boot runtime directory. Idempotent; run by the edge at start."""

from __future__ import annotations

import logging
import os

from dsec.host import linux

log = logging.getLogger("dsec.edge")


def cgroup_mode() -> str:
    """'v2' (unified), 'hybrid' (v1 controllers plus a cgroup2 mount) or 'v1'."""
    with open("/proc/self/mountinfo") as f:
        mounts = {line.split()[4]: line.split(" - ")[1].split()[0] for line in f}
    if mounts.get("/sys/fs/cgroup") == "cgroup2":
        return "v2"
    return "hybrid" if "/sys/fs/cgroup/unified" in mounts else "v1"


def prepare_cgroups() -> str:
    """crun refuses hybrid hosts whose cgroup2 mount holds a controller (hugetlb here);
    mounting that controller as a v1 hierarchy moves it out of cgroup2."""
    mode = cgroup_mode()
    if mode != "hybrid":
        return mode
    with open("/sys/fs/cgroup/unified/cgroup.controllers") as f:
        controllers = f.read().split()
    for ctl in controllers:
        target = f"/sys/fs/cgroup/{ctl}"
        if os.path.ismount(target):
            continue
        os.makedirs(target, exist_ok=True)
        linux.mount("cgroup", target, "cgroup", 0, ctl)
        log.info("mounted the %s cgroup controller as v1 so crun accepts this hybrid host", ctl)
    return mode
