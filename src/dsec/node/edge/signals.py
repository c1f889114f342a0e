"""What an edge counts about its own health for the fleet's detector (dsec.control.health.detector):
counters since this process started, bumped where the Prometheus counters are bumped
(dsec.node.edge.metrics), and gauges (disk, pressure) read when the watcher polls. The
counters restart from zero with the process; ``started_at`` tells the detector so.

The cordon lives here too: a cordoned edge refuses new sandboxes. It is not persisted on
the edge: whoever holds the fleet's records (the watcher, the cluster's controller)
asserts it again every round, so an edge restart cannot lift it."""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field

from dsec.node.host import memory
from dsec.shared.wire.fleet import EdgeSignals


@dataclass
class Signals:
    started_at: float = field(default_factory=time.time)
    creates: int = 0
    create_failures: int = 0
    create_seconds: float = 0.0
    admission_refusals: int = 0
    execs: int = 0
    exec_failures: int = 0
    agent_deadline_misses: int = 0
    store_errors: int = 0
    # the cordon: None, or why this edge takes no new sandboxes
    cordon: str | None = None

    def created(self, seconds: float) -> None:
        self.creates += 1
        self.create_seconds += seconds

    def read(self, disk_path: str) -> EdgeSignals:
        """The counters and the gauges now: ``disk_path``'s filesystem (the sandbox volume,
        else the data dir) and the node's pressure stall information."""
        counters = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "cordon"}
        try:
            st = os.statvfs(disk_path)
            total = st.f_blocks * st.f_frsize
            used = total - st.f_bavail * st.f_frsize  # what is left to us, not to root's reserve
        except OSError:
            total = used = 0
        return EdgeSignals(**counters, disk_used_bytes=used, disk_total_bytes=total,
                           psi_cpu=memory.psi("cpu").get("some", 0.0),
                           psi_memory=memory.psi("memory").get("some", 0.0),
                           psi_io=memory.psi("io").get("some", 0.0))
