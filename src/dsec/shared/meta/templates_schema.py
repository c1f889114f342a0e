"""The template tables (E2B template builds): templates by name, their builds with status
and config, build logs, tags, and the step cache that makes a rebuild of the same steps on
the same base free. Alembic's revision 0003 creates them."""

from __future__ import annotations

from sqlalchemy import Column, Float, Index, Integer, String, Table, Text

from dsec.shared.meta.schema import metadata

templates = Table(
    "templates", metadata,
    Column("id", String, primary_key=True),
    Column("name", String, nullable=False, unique=True),
    Column("project", String, nullable=False),
    Column("public", Integer, nullable=False, default=0),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("build_count", Integer, nullable=False, default=0),
    Column("spawn_count", Integer, nullable=False, default=0),
    Column("last_spawned_at", Float, nullable=True),
)

template_builds = Table(
    "template_builds", metadata,
    Column("id", String, primary_key=True),
    Column("template_id", String, nullable=False),
    Column("status", String, nullable=False),  # waiting | building | ready | error
    Column("cpu_count", Integer, nullable=False),
    Column("memory_mb", Integer, nullable=False),
    Column("tags", Text, nullable=False, default="[]"),  # what the build was asked to be tagged
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("finished_at", Float, nullable=True),
    Column("spec", Text, nullable=True),  # the build's steps as requested (TemplateSpec JSON)
    Column("result", Text, nullable=True),  # BuiltTemplate JSON once ready
    Column("reason", Text, nullable=True),  # {"message", "step"} once failed
    Column("runner", String, nullable=True),  # who runs it, and when it last said so
    Column("heartbeat_at", Float, nullable=True),
    Column("builder", String, nullable=True),  # the builder sandbox's id while it runs
    Column("log_count", Integer, nullable=False, default=0),
    Index("template_builds_by_template", "template_id"),
)

template_build_logs = Table(
    "template_build_logs", metadata,
    Column("build_id", String, primary_key=True),
    Column("seq", Integer, primary_key=True),
    Column("ts", Float, nullable=False),
    Column("level", String, nullable=False),
    Column("step", String, nullable=True),
    Column("message", Text, nullable=False),
)

template_tags = Table(
    "template_tags", metadata,
    Column("template_id", String, primary_key=True),
    Column("tag", String, primary_key=True),
    Column("build_id", String, nullable=False),
    Column("created_at", Float, nullable=False),
)

template_cache = Table(
    "template_cache", metadata,
    Column("key", String, primary_key=True),
    Column("result", Text, nullable=False),  # BuiltTemplate JSON: the stack and config after those steps
    Column("created_at", Float, nullable=False),
)
