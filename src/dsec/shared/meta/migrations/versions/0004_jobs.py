"""Jobs: a project's named groups of sandboxes with labels, a quota and a state.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("project", sa.String, primary_key=True),
        sa.Column("name", sa.String, primary_key=True),
        sa.Column("labels", sa.Text, nullable=False, server_default="{}"),
        sa.Column("quota", sa.Text, nullable=False, server_default="{}"),
        sa.Column("state", sa.String, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("paused_at", sa.Float, nullable=True),
        sa.Column("stopped_at", sa.Float, nullable=True),
    )


def downgrade() -> None:
    op.drop_table("jobs")
