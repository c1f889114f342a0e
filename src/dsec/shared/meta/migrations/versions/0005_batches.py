"""Batches: batch creates and the outcome of each of their items.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "batches",
        sa.Column("id", sa.String, primary_key=True),
        sa.Column("project", sa.String, nullable=False),
        sa.Column("job", sa.String, nullable=True),
        sa.Column("n", sa.Integer, nullable=False),
        sa.Column("args", sa.Text, nullable=False),
        sa.Column("state", sa.String, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("finished_at", sa.Float, nullable=True),
        sa.Column("owner", sa.String, nullable=True),
        sa.Column("heartbeat_at", sa.Float, nullable=True),
    )
    op.create_index("batches_state", "batches", ["state"])
    op.create_table(
        "batch_items",
        sa.Column("batch_id", sa.String, primary_key=True),
        sa.Column("idx", sa.Integer, primary_key=True),
        sa.Column("state", sa.String, nullable=False),
        sa.Column("sandbox_id", sa.String, nullable=True),
        sa.Column("error", sa.String, nullable=True),
        sa.Column("reason", sa.Text, nullable=True),
    )


def downgrade() -> None:
    op.drop_table("batch_items")
    op.drop_index("batches_state", "batches")
    op.drop_table("batches")
