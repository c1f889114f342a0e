"""Sandbox checkpoints (after TRANSOM's TCE): asynchronous, incremental copies of a
container's writable layer in the shared store, taken after a freeze of a few
milliseconds, with its command log and record, so that it can come back under its own id
on another edge (docs/fault-tolerance.md)."""
