"""The control plane: the apiserver's core and routes, placement, the watcher, health, IAM,
jobs, batches, the rollout store, the console, the checkpoint mover and the cluster (Ray,
PostgreSQL, certificates). Reaches edges through the edge contract (node tier); imports node
and shared."""
