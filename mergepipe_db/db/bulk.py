"""Fast multi-row inserts: Arrow into DuckDB, executemany (pipelined by psycopg) elsewhere."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection


def bulk_insert(conn: Connection, table: sa.Table, rows: Sequence[dict[str, Any]]) -> None:
    """Insert `rows` (dicts keyed by column name) into `table` inside the caller's transaction."""
    if not rows:
        return
    if conn.dialect.name == "duckdb" and len(rows) > 64:
        import pyarrow as pa

        cols = [c.name for c in table.columns]
        arrow = pa.table({c: [r.get(c) for r in rows] for c in cols})
        raw = conn.connection.driver_connection  # the duckdb connection, same transaction
        name = f"_mp_bulk_{table.name}"
        raw.register(name, arrow)
        try:
            col_list = ", ".join(f'"{c}"' for c in cols)
            raw.execute(f'INSERT INTO "{table.name}" ({col_list}) SELECT {col_list} FROM {name}')
        finally:
            raw.unregister(name)
        return
    conn.execute(table.insert(), list(rows))
