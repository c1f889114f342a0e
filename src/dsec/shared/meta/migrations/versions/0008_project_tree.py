"""Projects nest and carry quotas; admission holds their share per sandbox; IAM events name
the project they changed; layers have an owner project and a visibility.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("iam_events") as t:
        t.add_column(sa.Column("project", sa.String, nullable=True))
    op.create_table(
        "projects",
        sa.Column("name", sa.String, primary_key=True),
        sa.Column("parent", sa.String, nullable=True),
        sa.Column("description", sa.Text, nullable=False, server_default=""),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("created_by", sa.String, nullable=True),
        *(sa.Column(f"q_{r}", sa.BigInteger, nullable=True)
          for r in ("sandboxes", "cpu_milli", "memory_mb", "disk_mb", "starting")),
        sa.Column("q_fncall_per_s", sa.Float, nullable=True),
        *(sa.Column(f"u_{r}", sa.BigInteger, nullable=False, server_default="0")
          for r in ("sandboxes", "cpu_milli", "memory_mb", "disk_mb", "starting")),
    )
    op.create_index("projects_by_parent", "projects", ["parent"])
    op.create_table(
        "project_holds",
        sa.Column("id", sa.String, primary_key=True),
        sa.Column("sandbox_id", sa.String, nullable=True, unique=True),
        sa.Column("project", sa.String, nullable=False),
        sa.Column("job", sa.String, nullable=True),
        sa.Column("state", sa.String, nullable=False),
        sa.Column("cpu_milli", sa.BigInteger, nullable=False),
        sa.Column("memory_mb", sa.BigInteger, nullable=False),
        sa.Column("disk_mb", sa.BigInteger, nullable=False),
        sa.Column("charged_cpu_milli", sa.BigInteger, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("bound_at", sa.Float, nullable=True),
    )
    op.create_index("project_holds_by_project", "project_holds", ["project"])
    op.create_table(
        "layer_acl",
        sa.Column("ref", sa.String, primary_key=True),
        sa.Column("project", sa.String, nullable=False),
        sa.Column("visibility", sa.String, nullable=False),
        sa.Column("created_by", sa.String, nullable=True),
        sa.Column("created_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("layer_acl")
    op.drop_index("project_holds_by_project", "project_holds")
    op.drop_table("project_holds")
    op.drop_index("projects_by_parent", "projects")
    op.drop_table("projects")
    with op.batch_alter_table("iam_events") as t:
        t.drop_column("project")
