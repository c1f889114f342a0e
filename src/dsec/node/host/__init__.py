"""Host-level helpers every component that touches the kernel shares: mounts, namespaces
and openat2 (linux), cgroups (cgroup), and preparing a node's cgroup hierarchy (prep).
Nothing here knows what a sandbox or an edge is."""
