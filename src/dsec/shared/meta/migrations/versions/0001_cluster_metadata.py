"""Cluster metadata: tokens, the edge registry, the sandbox index, settings.

Revision ID: 0001
Revises:
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tokens",
        sa.Column("id", sa.String, primary_key=True),
        sa.Column("digest", sa.String, nullable=False, unique=True),
        sa.Column("project", sa.String, nullable=False),
        sa.Column("role", sa.String, nullable=False),
        sa.Column("name", sa.String, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_table(
        "edges",
        sa.Column("name", sa.String, primary_key=True),
        sa.Column("url", sa.String, nullable=False),
        sa.Column("node_id", sa.String, nullable=False),
        sa.Column("state", sa.String, nullable=False),
        sa.Column("reason", sa.Text, nullable=False, server_default=""),
        sa.Column("registered_at", sa.Float, nullable=False),
        sa.Column("changed_at", sa.Float, nullable=False),
        sa.Column("stats", sa.Text, nullable=True),
        sa.Column("stats_at", sa.Float, nullable=True),
    )
    op.create_table(
        "sandboxes",
        sa.Column("id", sa.String, primary_key=True),
        sa.Column("edge", sa.String, nullable=False),
        sa.Column("project", sa.String, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("info", sa.Text, nullable=False),
        sa.Column("lost_reason", sa.Text, nullable=True),
    )
    op.create_index("sandboxes_by_edge", "sandboxes", ["edge"])
    op.create_table(
        "settings",
        sa.Column("key", sa.String, primary_key=True),
        sa.Column("value", sa.Text, nullable=False),
    )


def downgrade() -> None:
    for t in ("settings", "sandboxes", "edges", "tokens"):
        op.drop_table(t)
