"""Makes this node able to run dsec sandboxes: cgroup layout that crun accepts and
the per-boot runtime directory. Idempotent; run by the edge at start."""

from __future__ import annotations

import logging
import os

from dsec.node.host import linux

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
    mounting that controller as a v1 hierarchy moves it out of cgroup2. Every host gets
    ``favordynmods`` (:func:`favor_dynmods`)."""
    mode = cgroup_mode()
    favor_dynmods("/sys/fs/cgroup" if mode == "v2" else "/sys/fs/cgroup/unified")
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


def favor_dynmods(cgroup2: str) -> bool:
    """Remount the cgroup2 hierarchy at ``cgroup2`` with ``favordynmods`` (its other options
    kept); True when it has it. Each sandbox start moves processes between cgroups, which
    takes the kernel's threadgroup lock for writing; without the option, that waits for an
    RCU grace period first: 11 ms of a 20 ms ``crun run`` here (measured with ``perf sched``,
    docs/performance.md). With it, the lock stays on its slow reader path (an atomic in
    fork and exit instead of a per-CPU counter) and writers never wait. The lock is one for
    every hierarchy, v1 ones included, so the option on the cgroup2 mount is enough."""
    opts = _super_options(cgroup2)
    if opts is None:
        return False
    if "favordynmods" in opts:
        return True
    keep = [o for o in opts if o not in ("rw", "ro")]
    try:
        linux.mount("cgroup2", cgroup2, "cgroup2", linux.MS_REMOUNT, ",".join([*keep, "favordynmods"]))
    except OSError as e:  # an older kernel (< 6.0) or a host that does not let us: slower starts, nothing else
        log.warning("cgroup2 at %s not remounted with favordynmods (%s): each sandbox start waits for an RCU "
                    "grace period", cgroup2, e)
        return False
    log.info("remounted cgroup2 at %s with favordynmods: sandbox starts do not wait for RCU", cgroup2)
    return True


def _super_options(target: str) -> list[str] | None:
    """The superblock options of the cgroup2 mount at ``target`` (None: none there)."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields, _, rest = line.partition(" - ")
            if fields.split()[4] == target and rest.split()[0] == "cgroup2":
                return rest.split()[2].split(",")
    return None
