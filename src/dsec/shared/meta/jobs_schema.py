"""The jobs table: one row per job (a project's named group of sandboxes), with its
labels, quota and state, so every apiserver replica serves every job. Alembic's revision
0004 creates it."""

from __future__ import annotations

from sqlalchemy import Column, Float, Integer, String, Table, Text

from dsec.shared.meta.schema import metadata

jobs = Table(
    "jobs", metadata,
    Column("project", String, primary_key=True),
    Column("name", String, primary_key=True),  # unique per project: two teams may both run "eval"
    Column("labels", Text, nullable=False, default="{}"),  # JSON
    Column("quota", Text, nullable=False, default="{}"),  # JobQuota JSON
    Column("state", String, nullable=False),  # active | paused | stopped
    Column("created_at", Float, nullable=False),
    Column("paused_at", Float, nullable=True),
    Column("stopped_at", Float, nullable=True),
    Column("checkpoint_every_s", Integer, nullable=True),  # its container sandboxes' default (0009)
    # its creation-rate budget's bucket (0011): tokens left as of rate_at (wall clock)
    Column("rate_tokens", Float, nullable=True),
    Column("rate_at", Float, nullable=True),
)
