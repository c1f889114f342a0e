"""The rollout tables: one row per rollout (its spec, state, the worker holding it and its
lease, the outcome) and one per journal step, so a rollout outlives its trainer and its
worker, and any apiserver replica serves it. Alembic's revision 0006 creates them."""

from __future__ import annotations

from sqlalchemy import Boolean, Column, Float, Index, Integer, String, Table, Text

from dsec.shared.meta.schema import metadata

rollouts = Table(
    "rollouts", metadata,
    Column("id", String, primary_key=True),
    Column("project", String, nullable=False),
    Column("key", String, nullable=True),  # the trainer's idempotency key, unique per project
    Column("job", String, nullable=True),
    Column("agent", String, nullable=False),
    Column("spec", Text, nullable=False),  # RolloutSpec JSON
    Column("labels", Text, nullable=False, default="{}"),
    Column("state", String, nullable=False),  # queued | running | done | failed | cancelled
    Column("attempts", Integer, nullable=False, default=0),
    Column("max_attempts", Integer, nullable=False, default=3),
    Column("worker", String, nullable=True),
    Column("lease_until", Float, nullable=True),
    Column("sandbox_id", String, nullable=True),
    Column("created_at", Float, nullable=False),
    Column("started_at", Float, nullable=True),
    Column("finished_at", Float, nullable=True),
    Column("consumed", Boolean, nullable=False, default=False),
    Column("reward", Float, nullable=True),
    Column("result", Text, nullable=True),  # JSON
    Column("failure", String, nullable=True),
    Column("error", Text, nullable=True),
    Column("n_steps", Integer, nullable=False, default=0),
    Index("rollouts_project_key", "project", "key", unique=True),
    Index("rollouts_state", "state", "created_at"),
    Index("rollouts_job", "project", "job", "state"),
)

rollout_steps = Table(
    "rollout_steps", metadata,
    Column("rollout_id", String, primary_key=True),
    Column("seq", Integer, primary_key=True),
    Column("kind", String, nullable=False),
    Column("request", Text, nullable=True),  # JSON
    Column("response", Text, nullable=True),  # JSON
    Column("digest", String, nullable=False, default=""),
    Column("at", Float, nullable=False),
    Column("attempt", Integer, nullable=False),
)
