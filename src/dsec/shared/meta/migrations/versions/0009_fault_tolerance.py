"""Fleet fault tolerance: edge health (ok / suspect / cordoned, with the evidence),
fleet events, sandbox checkpoints (and a job's checkpoint interval), and sandboxes that
moved to another edge.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("edges") as t:
        t.add_column(sa.Column("health", sa.String, nullable=False, server_default="ok"))
        t.add_column(sa.Column("health_reason", sa.Text, nullable=False, server_default=""))
        t.add_column(sa.Column("health_at", sa.Float, nullable=True))
        t.add_column(sa.Column("evidence", sa.Text, nullable=False, server_default="[]"))
        t.add_column(sa.Column("cordoned_by", sa.String, nullable=False, server_default=""))
    with op.batch_alter_table("sandboxes") as t:
        t.add_column(sa.Column("moved", sa.Boolean, nullable=False, server_default=sa.false()))
        t.add_column(sa.Column("restore", sa.Text, nullable=True))
    op.create_index("sandboxes_moved", "sandboxes", ["moved"])
    with op.batch_alter_table("jobs") as t:
        t.add_column(sa.Column("checkpoint_every_s", sa.Integer, nullable=True))
    op.create_table(
        "fleet_events",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("at", sa.Float, nullable=False),
        sa.Column("edge", sa.String, nullable=False),
        sa.Column("sandbox_id", sa.String, nullable=True),
        sa.Column("kind", sa.String, nullable=False),
        sa.Column("actor", sa.String, nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("detail", sa.Text, nullable=False, server_default="{}"),
    )
    op.create_index("fleet_events_at", "fleet_events", ["at"])
    op.create_table(
        "checkpoints",
        sa.Column("sandbox_id", sa.String, primary_key=True),
        sa.Column("seq", sa.Integer, primary_key=True),
        sa.Column("kind", sa.String, nullable=False),
        sa.Column("edge", sa.String, nullable=False),
        sa.Column("project", sa.String, nullable=False),
        sa.Column("digest", sa.String, nullable=True),
        sa.Column("stack", sa.Text, nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("files", sa.Integer, nullable=False),
        sa.Column("freeze_ms", sa.Float, nullable=False),
        sa.Column("build_ms", sa.Float, nullable=False),
        sa.Column("taken_at", sa.Float, nullable=False),
        sa.Column("record", sa.Text, nullable=False),
        sa.Column("commands", sa.String, nullable=True),
    )
    op.create_index("checkpoints_taken_at", "checkpoints", ["taken_at"])


def downgrade() -> None:
    op.drop_index("checkpoints_taken_at", "checkpoints")
    op.drop_table("checkpoints")
    op.drop_index("fleet_events_at", "fleet_events")
    op.drop_table("fleet_events")
    with op.batch_alter_table("jobs") as t:
        t.drop_column("checkpoint_every_s")
    op.drop_index("sandboxes_moved", "sandboxes")
    with op.batch_alter_table("sandboxes") as t:
        t.drop_column("restore")
        t.drop_column("moved")
    with op.batch_alter_table("edges") as t:
        for c in ("cordoned_by", "evidence", "health_at", "health_reason", "health"):
            t.drop_column(c)
