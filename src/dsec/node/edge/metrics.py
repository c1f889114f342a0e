"""Prometheus metrics of an edge: counters the edge bumps as it works, and per-sandbox
resource use read from the sandbox's cgroup at scrape time (v1 and v2 file names)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from dsec.shared.wire.models import SandboxUsage, StorageStats

CGROUP_ROOT = "/sys/fs/cgroup"


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def cgroup_usage(cgroup_path: str) -> dict[str, int]:
    """memory (bytes), cpu (nanoseconds), pids of one sandbox's cgroup, where readable."""
    rel = cgroup_path.lstrip("/")
    v2 = os.path.join(CGROUP_ROOT, rel)
    out: dict[str, int] = {}
    candidates = {
        "memory_bytes": [os.path.join(CGROUP_ROOT, "memory", rel, "memory.usage_in_bytes"),
                         os.path.join(v2, "memory.current")],
        "cpu_ns": [os.path.join(CGROUP_ROOT, "cpuacct", rel, "cpuacct.usage")],
        "pids": [os.path.join(CGROUP_ROOT, "pids", rel, "pids.current"), os.path.join(v2, "pids.current")],
    }
    for key, paths in candidates.items():
        for p in paths:
            if (v := _read_int(p)) is not None:
                out[key] = v
                break
    if "cpu_ns" not in out:  # cgroup v2: cpu.stat usage_usec
        try:
            with open(os.path.join(v2, "cpu.stat")) as f:
                for line in f:
                    if line.startswith("usage_usec "):
                        out["cpu_ns"] = int(line.split()[1]) * 1000
        except OSError:
            pass
    return out


class EdgeMetrics:
    def __init__(self, edge: str, sandboxes: Callable[[], Iterable[tuple[str, str, str | None, SandboxUsage]]],
                 storage: Callable[[], StorageStats] | None = None) -> None:
        """``sandboxes`` yields (sandbox_id, state, job, usage) at scrape time."""
        self.registry = CollectorRegistry()
        labels = {"edge": edge}
        self.created = Counter("dsec_sandboxes_created", "Sandboxes created", ["edge"],
                               registry=self.registry).labels(**labels)
        self.stopped = Counter("dsec_sandboxes_ended", "Sandboxes that ended, by final state",
                               ["edge", "state"], registry=self.registry)
        self.rejected = Counter("dsec_admission_rejected", "Creations refused by admission", ["edge"],
                                registry=self.registry).labels(**labels)
        self.exec_seconds = Histogram("dsec_exec_seconds", "Command duration inside the edge", ["edge", "kind"],
                                      buckets=(0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 300),
                                      registry=self.registry)
        self.create_seconds = Histogram("dsec_create_seconds", "Sandbox creation time inside the edge", ["edge"],
                                        buckets=(0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 5),
                                        registry=self.registry).labels(**labels)
        self.edge = edge
        self.registry.register(_SandboxCollector(edge, sandboxes))
        if storage is not None:
            self.registry.register(_StorageCollector(storage))


class _SandboxCollector(Collector):
    GAUGES = (("memory_bytes", "dsec_sandbox_memory_bytes", "Memory charged to the sandbox's cgroup"),
              ("anon_bytes", "dsec_sandbox_anon_bytes", "Anonymous memory charged to the sandbox"),
              ("file_bytes", "dsec_sandbox_file_bytes", "Page cache charged to the sandbox"),
              ("swap_bytes", "dsec_sandbox_swap_bytes", "The sandbox's memory out in swap (paused sandboxes)"),
              ("cpu_s", "dsec_sandbox_cpu_seconds", "CPU time used by the sandbox"),
              ("pids", "dsec_sandbox_pids", "Processes and threads in the sandbox"),
              ("disk_bytes", "dsec_sandbox_disk_bytes", "Disk allocated by the sandbox's writable layer"),
              ("oom_kills", "dsec_sandbox_oom_kills", "Processes killed at the sandbox's memory limit"))

    def __init__(self, edge: str, sandboxes: Callable[[], Iterable[tuple[str, str, str | None, SandboxUsage]]]) -> None:
        self.edge = edge
        self.sandboxes = sandboxes

    def collect(self) -> Iterable[GaugeMetricFamily]:
        fams = [(key, GaugeMetricFamily(name, doc, labels=["edge", "sandbox", "job"]))
                for key, name, doc in self.GAUGES]
        states: dict[str, int] = {}
        for sid, state, job, use in self.sandboxes():
            states[state] = states.get(state, 0) + 1
            lbl = [self.edge, sid, job or ""]
            for key, fam in fams:
                fam.add_metric(lbl, getattr(use, key))
        live = GaugeMetricFamily("dsec_sandboxes", "Sandboxes on this edge by state", labels=["edge", "state"])
        for state, n in states.items():
            live.add_metric([self.edge, state], n)
        yield live
        yield from (fam for _, fam in fams)


class _StorageCollector(Collector):
    """Layer reads of this node, per data blob (labelled with the layers that use it)."""

    def __init__(self, storage: Callable[[], StorageStats]) -> None:
        self.storage = storage

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        st = self.storage()
        per_blob: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            "remote_bytes": CounterMetricFamily("dsec_layer_remote_bytes", "Bytes fetched from the shared store",
                                                labels=["edge", "blob", "layers"]),
            "hits": CounterMetricFamily("dsec_layer_cache_hits", "Layer reads served by the node's chunk cache",
                                        labels=["edge", "blob", "layers"]),
            "misses": CounterMetricFamily("dsec_layer_cache_misses", "Chunks fetched from the shared store on a read",
                                          labels=["edge", "blob", "layers"]),
            "prefetched": CounterMetricFamily("dsec_layer_prefetched_chunks", "Chunks fetched from access lists",
                                              labels=["edge", "blob", "layers"]),
            "errors": CounterMetricFamily("dsec_layer_fetch_errors", "Chunk fetches that failed or timed out",
                                          labels=["edge", "blob", "layers"]),
            "chunk_latency_s": GaugeMetricFamily("dsec_layer_chunk_latency_seconds",
                                                 "Mean shared-store chunk fetch latency",
                                                 labels=["edge", "blob", "layers"]),
        }
        for b in st.blobs:
            lbl = [st.edge, b.data[:12], ",".join(b.layers)]
            for key, fam in per_blob.items():
                fam.add_metric(lbl, getattr(b, key))
        node = GaugeMetricFamily("dsec_chunk_cache_bytes", "Bytes in the node's chunk cache", labels=["edge"])
        node.add_metric([st.edge], st.cache_bytes)
        ev = CounterMetricFamily("dsec_chunk_cache_evictions", "Chunks evicted from the node's cache", labels=["edge"])
        ev.add_metric([st.edge], st.cache_evictions)
        yield from (*per_blob.values(), node, ev)
