"""An edge's settings (``dsec serve`` / ``dsec edge serve`` options)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from dsec.node.storage.node import FetchMode
from dsec.shared.wire.models import EDGE_NAME_RE


class EdgeConfig(BaseModel):
    # its sandboxes' ids are NAME-xxxxxxxxxxxx, which every client parses to route them
    name: str = Field(default="edge0", pattern=EDGE_NAME_RE.pattern)
    data_dir: str
    cpu_overcommit: float = 8.0
    memory_overcommit: float = 1.5
    max_sandboxes: int = 4096
    max_file_bytes: int = 256 * 1024 * 1024
    ttl_check_interval_s: float = 1.0
    # how a shared layer store reaches this node: see dsec.node.storage.node
    fetch_mode: FetchMode = "ondemand"
    chunk_cache_bytes: int = 10 << 30
    fetch_timeout_s: float = 20.0
    # memory pressure: below this much available memory, idle best-effort sandboxes are
    # paused (longest idle first); above this PSI "full" share, creations are refused
    pause_below_mb: int = 1024
    admit_max_psi: float = 20.0
    # sandbox networking: services beyond the built-in ones (name=host,*.suffix), and the
    # subnet for sandbox addresses (default: a free /19 of 10.211.0.0/16)
    egress_services: list[str] = []
    sandbox_subnet: str | None = None
    # writable layers with quotas live on a btrfs volume (None: sized from free space; 0: off)
    sandbox_volume_gb: int | None = None
    # a hollow edge (dsec.node.backends.hollow; docs/scale.md): the real edge over a runtime that
    # starts no process and mounts nothing, a load instrument for the control plane that
    # models a node of ``hollow_cpus`` cores and ``hollow_memory_mb`` (never a user's choice)
    hollow: bool = False
    hollow_cpus: int = 192
    hollow_memory_mb: int = 2 * 1024 * 1024
