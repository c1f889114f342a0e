"""The web console's ended sessions: a logout, or an operator ending every session of a
token, is recorded until the sessions it ends would have expired anyway.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "console_revocations",
        sa.Column("key", sa.String, primary_key=True),
        sa.Column("cut", sa.Float, nullable=False),
        sa.Column("until", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("console_revocations")
