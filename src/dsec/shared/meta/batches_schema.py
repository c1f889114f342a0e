"""The batch tables: one row per batch create (its args, size, state) and one per item that
has an outcome (made, failed, cancelled), so a batch survives an apiserver restart: items
with no row are still to be made. Alembic's revision 0005 creates them."""

from __future__ import annotations

from sqlalchemy import Boolean, Column, Float, Integer, String, Table, Text, false

from dsec.shared.meta.schema import metadata

batches = Table(
    "batches", metadata,
    Column("id", String, primary_key=True),
    Column("project", String, nullable=False),
    Column("job", String, nullable=True),
    Column("n", Integer, nullable=False),
    Column("args", Text, nullable=False),  # the sandbox args JSON (with its backend tag)
    Column("state", String, nullable=False),  # running | done | cancelled
    Column("created_at", Float, nullable=False),
    Column("finished_at", Float, nullable=True),
    Column("owner", String, nullable=True),  # the apiserver process running it
    Column("heartbeat_at", Float, nullable=True),  # its owner's last sign of life (None: released)
    Column("gang", Boolean, nullable=False, default=False, server_default=false()),  # all or nothing (0011)
)

batch_items = Table(
    "batch_items", metadata,
    Column("batch_id", String, primary_key=True),
    Column("idx", Integer, primary_key=True),
    Column("state", String, nullable=False),  # running | failed | cancelled
    Column("sandbox_id", String, nullable=True),
    Column("error", String, nullable=True),
    Column("reason", Text, nullable=True),
)
