"""A job's creation-rate budget (JobQuota.creates_per_s): the token bucket every replica
takes a create's token from, kept on the job's row so it is one budget for the whole job;
and gangs: a batch made all or nothing (its items hold reserved quota).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as b:
        b.add_column(sa.Column("rate_tokens", sa.Float, nullable=True))
        b.add_column(sa.Column("rate_at", sa.Float, nullable=True))
    with op.batch_alter_table("batches") as b:
        b.add_column(sa.Column("gang", sa.Boolean, nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("batches") as b:
        b.drop_column("gang")
    with op.batch_alter_table("jobs") as b:
        b.drop_column("rate_at")
        b.drop_column("rate_tokens")
