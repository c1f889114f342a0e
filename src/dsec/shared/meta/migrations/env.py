"""Alembic's environment: runs on the connection dsec.shared.meta.db hands it (no ini file)."""

from alembic import context

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=None)
with context.begin_transaction():
    context.run_migrations()
