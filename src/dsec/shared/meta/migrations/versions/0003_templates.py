"""Template builds (E2B's template API): templates, builds, build logs, tags, step cache.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "templates",
        sa.Column("id", sa.String, primary_key=True),
        sa.Column("name", sa.String, nullable=False, unique=True),
        sa.Column("project", sa.String, nullable=False),
        sa.Column("public", sa.Integer, nullable=False, server_default="0"),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
        sa.Column("build_count", sa.Integer, nullable=False, server_default="0"),
        sa.Column("spawn_count", sa.Integer, nullable=False, server_default="0"),
        sa.Column("last_spawned_at", sa.Float, nullable=True),
    )
    op.create_table(
        "template_builds",
        sa.Column("id", sa.String, primary_key=True),
        sa.Column("template_id", sa.String, nullable=False),
        sa.Column("status", sa.String, nullable=False),
        sa.Column("cpu_count", sa.Integer, nullable=False),
        sa.Column("memory_mb", sa.Integer, nullable=False),
        sa.Column("tags", sa.Text, nullable=False, server_default="[]"),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
        sa.Column("finished_at", sa.Float, nullable=True),
        sa.Column("spec", sa.Text, nullable=True),
        sa.Column("result", sa.Text, nullable=True),
        sa.Column("reason", sa.Text, nullable=True),
        sa.Column("runner", sa.String, nullable=True),
        sa.Column("heartbeat_at", sa.Float, nullable=True),
        sa.Column("builder", sa.String, nullable=True),
        sa.Column("log_count", sa.Integer, nullable=False, server_default="0"),
    )
    op.create_index("template_builds_by_template", "template_builds", ["template_id"])
    op.create_table(
        "template_build_logs",
        sa.Column("build_id", sa.String, primary_key=True),
        sa.Column("seq", sa.Integer, primary_key=True),
        sa.Column("ts", sa.Float, nullable=False),
        sa.Column("level", sa.String, nullable=False),
        sa.Column("step", sa.String, nullable=True),
        sa.Column("message", sa.Text, nullable=False),
    )
    op.create_table(
        "template_tags",
        sa.Column("template_id", sa.String, primary_key=True),
        sa.Column("tag", sa.String, primary_key=True),
        sa.Column("build_id", sa.String, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_table(
        "template_cache",
        sa.Column("key", sa.String, primary_key=True),
        sa.Column("result", sa.Text, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    for t in ("template_cache", "template_tags", "template_build_logs", "template_builds", "templates"):
        op.drop_table(t)
