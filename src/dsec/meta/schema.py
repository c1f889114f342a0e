"""The metadata tables, as SQLAlchemy Core objects the queries use. Alembic's revisions
(dsec/meta/migrations/versions) create and change them; a change here is a new revision
there."""

from __future__ import annotations

from sqlalchemy import Column, Float, Index, Integer, MetaData, String, Table, Text

metadata = MetaData()

tokens = Table(
    "tokens", metadata,
    Column("id", String, primary_key=True),
    Column("digest", String, nullable=False, unique=True),
    Column("project", String, nullable=False),
    Column("role", String, nullable=False),
    Column("name", String, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("expires_at", Float, nullable=True),  # None: never (revision 0007)
    Column("created_by", String, nullable=True),  # the token id that made it ("admin": the node's own)
)

# every IAM change, who made it and when (revision 0007)
iam_events = Table(
    "iam_events", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("at", Float, nullable=False),
    Column("actor", String, nullable=False),  # a token id ("admin": the node's own token)
    Column("action", String, nullable=False),  # token.create | token.revoke
    Column("target", String, nullable=False),
    Column("detail", Text, nullable=False, default="{}"),  # JSON
)

# one row per edge the cluster ever had; the controller writes stats, replicas read them
edges = Table(
    "edges", metadata,
    Column("name", String, primary_key=True),
    Column("url", String, nullable=False),
    Column("node_id", String, nullable=False),
    Column("state", String, nullable=False),  # active | lost | removed
    Column("reason", Text, nullable=False, default=""),
    Column("registered_at", Float, nullable=False),
    Column("changed_at", Float, nullable=False),
    Column("stats", Text, nullable=True),  # NodeStats JSON, from the watcher's last poll
    Column("stats_at", Float, nullable=True),
)

# which edge holds each sandbox made through an apiserver (cluster mode): what a lost
# node's sandboxes were, when the node cannot say
sandboxes = Table(
    "sandboxes", metadata,
    Column("id", String, primary_key=True),
    Column("edge", String, nullable=False),
    Column("project", String, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("info", Text, nullable=False),  # SandboxInfo JSON as created
    Column("lost_reason", Text, nullable=True),
    Index("sandboxes_by_edge", "edge"),
)

settings = Table(
    "settings", metadata,
    Column("key", String, primary_key=True),
    Column("value", Text, nullable=False),
)
