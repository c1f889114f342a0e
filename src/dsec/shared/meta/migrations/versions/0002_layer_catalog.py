"""The layer catalog: layers, built, blob_data, access_lists (until now a SQLite file at the
layer store's root, shared over the store's filesystem by every node).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "layers",
        sa.Column("ref", sa.String, primary_key=True),
        sa.Column("kind", sa.String, nullable=False),
        sa.Column("digest", sa.String, nullable=False),
        sa.Column("size", sa.BigInteger, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("meta", sa.Text, nullable=False, server_default="{}"),
    )
    op.create_table(
        "built",
        sa.Column("key", sa.String, primary_key=True),
        sa.Column("digest", sa.String, nullable=False),
    )
    op.create_table(
        "blob_data",
        sa.Column("meta", sa.String, primary_key=True),
        sa.Column("data", sa.String, nullable=False),
    )
    op.create_table(
        "access_lists",
        sa.Column("data", sa.String, primary_key=True),
        sa.Column("chunks", sa.Text, nullable=False),
        sa.Column("source", sa.String, nullable=False),
        sa.Column("recorded_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    for t in ("access_lists", "blob_data", "built", "layers"):
        op.drop_table(t)
