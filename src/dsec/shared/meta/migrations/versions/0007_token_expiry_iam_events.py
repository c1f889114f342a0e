"""Tokens expire and say who made them; IAM changes are recorded.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tokens") as t:
        t.add_column(sa.Column("expires_at", sa.Float, nullable=True))
        t.add_column(sa.Column("created_by", sa.String, nullable=True))
    op.create_table(
        "iam_events",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("at", sa.Float, nullable=False),
        sa.Column("actor", sa.String, nullable=False),
        sa.Column("action", sa.String, nullable=False),
        sa.Column("target", sa.String, nullable=False),
        sa.Column("detail", sa.Text, nullable=False),
    )
    op.create_index("iam_events_at", "iam_events", ["at"])


def downgrade() -> None:
    op.drop_index("iam_events_at", "iam_events")
    op.drop_table("iam_events")
    with op.batch_alter_table("tokens") as t:
        t.drop_column("created_by")
        t.drop_column("expires_at")
