"""Alembic environment: migrations run from code on the connection mergepipe_db hands over."""

from __future__ import annotations

from alembic import context
from alembic.ddl.impl import DefaultImpl


class DuckDBImpl(DefaultImpl):
    """Alembic has no DuckDB dialect of its own; DuckDB speaks enough PostgreSQL DDL for ours."""

    __dialect__ = "duckdb"


def run_migrations_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is None:
        raise RuntimeError("mergepipe_db migrations run through `mergepipe db upgrade`, not the alembic CLI")
    context.configure(connection=connection, target_metadata=None, transaction_per_migration=False)
    with context.begin_transaction():
        context.run_migrations()


run_migrations_online()
