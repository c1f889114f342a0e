"""Cluster metadata: what every apiserver replica and the cluster controller share (the
edge registry with the fleet view, IAM tokens, the index of sandboxes by edge, cluster
settings). One SQLAlchemy schema over SQLite (embedded, a file in the data dir) or
PostgreSQL (cluster mode); node-local state (an edge's sandbox records, its chunk cache)
never comes here."""

from dsec.shared.meta.db import open_db, sqlite_url

__all__ = ["open_db", "sqlite_url"]
