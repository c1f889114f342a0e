"""Rollouts: agent loops run by rollout workers, and their journals.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "rollouts",
        sa.Column("id", sa.String, primary_key=True),
        sa.Column("project", sa.String, nullable=False),
        sa.Column("key", sa.String, nullable=True),
        sa.Column("job", sa.String, nullable=True),
        sa.Column("agent", sa.String, nullable=False),
        sa.Column("spec", sa.Text, nullable=False),
        sa.Column("labels", sa.Text, nullable=False),
        sa.Column("state", sa.String, nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("max_attempts", sa.Integer, nullable=False),
        sa.Column("worker", sa.String, nullable=True),
        sa.Column("lease_until", sa.Float, nullable=True),
        sa.Column("sandbox_id", sa.String, nullable=True),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("started_at", sa.Float, nullable=True),
        sa.Column("finished_at", sa.Float, nullable=True),
        sa.Column("consumed", sa.Boolean, nullable=False),
        sa.Column("reward", sa.Float, nullable=True),
        sa.Column("result", sa.Text, nullable=True),
        sa.Column("failure", sa.String, nullable=True),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("n_steps", sa.Integer, nullable=False),
    )
    op.create_index("rollouts_project_key", "rollouts", ["project", "key"], unique=True)
    op.create_index("rollouts_state", "rollouts", ["state", "created_at"])
    op.create_index("rollouts_job", "rollouts", ["project", "job", "state"])
    op.create_table(
        "rollout_steps",
        sa.Column("rollout_id", sa.String, primary_key=True),
        sa.Column("seq", sa.Integer, primary_key=True),
        sa.Column("kind", sa.String, nullable=False),
        sa.Column("request", sa.Text, nullable=True),
        sa.Column("response", sa.Text, nullable=True),
        sa.Column("digest", sa.String, nullable=False),
        sa.Column("at", sa.Float, nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("rollout_steps")
    op.drop_index("rollouts_job", "rollouts")
    op.drop_index("rollouts_state", "rollouts")
    op.drop_index("rollouts_project_key", "rollouts")
    op.drop_table("rollouts")
