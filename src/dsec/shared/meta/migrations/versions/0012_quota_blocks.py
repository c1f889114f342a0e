"""Quota blocks: a share of a project lineage's quota charged ahead to one apiserver
replica, which admits creates from it in memory (dsec.control.iam.blocks).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "quota_blocks",
        sa.Column("id", sa.String, primary_key=True),
        sa.Column("replica", sa.String, nullable=False),
        sa.Column("project", sa.String, nullable=False),
        sa.Column("sandboxes", sa.BigInteger, nullable=False),
        sa.Column("cpu_milli", sa.BigInteger, nullable=False),
        sa.Column("memory_mb", sa.BigInteger, nullable=False),
        sa.Column("disk_mb", sa.BigInteger, nullable=False),
        sa.Column("starting", sa.BigInteger, nullable=False),
        sa.Column("renewed_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("quota_blocks")
