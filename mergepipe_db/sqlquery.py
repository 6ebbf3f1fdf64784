"""`mergepipe sql`: one read-only query over the catalog views; writes and file access are refused.

DuckDB: a separate read-only connection with external access disabled and the configuration locked.
PostgreSQL: a READ ONLY transaction under a role that may only SELECT (created on first use when the
connecting user may create roles). Either way exactly one statement is accepted.
"""

from __future__ import annotations

from typing import Any

from mergepipe_db.db.engine import Database
from mergepipe_db.errors import CatalogError, ReadOnlySqlError

READER_ROLE = "mergepipe_sql_reader"


def _one_statement(query: str) -> str:
    import duckdb

    try:
        statements = duckdb.extract_statements(query)
    except duckdb.Error as e:
        raise ReadOnlySqlError(f"cannot parse query: {str(e).splitlines()[0]}") from e
    if len(statements) != 1:
        raise ReadOnlySqlError(f"give exactly one SQL statement (got {len(statements)})")
    if statements[0].type not in (duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN):
        raise ReadOnlySqlError(f"only SELECT queries are allowed (got {statements[0].type.name})")
    return query.strip().rstrip(";")


def run_readonly(db: Database, query: str) -> tuple[list[str], list[tuple[Any, ...]]]:
    query = _one_statement(query)
    if db.is_duckdb:
        return _duckdb(db, query)
    return _postgres(db, query)


def _duckdb(db: Database, query: str) -> tuple[list[str], list[tuple[Any, ...]]]:
    import duckdb

    path = db.duckdb_path
    with db.connect():  # creates/checks the schema and takes the cross-process lock for the duration
        pass
    with db._lock():  # noqa: SLF001 - the same lock every catalog access takes
        con = duckdb.connect(str(path), read_only=True,
                             config={"enable_external_access": False, "lock_configuration": True,
                                     "autoload_known_extensions": False, "autoinstall_known_extensions": False})
        try:
            cur = con.execute(query)
            cols = [d[0] for d in cur.description or []]
            return cols, [tuple(r) for r in cur.fetchall()]
        except duckdb.PermissionException as e:
            raise ReadOnlySqlError(f"refused: {str(e).splitlines()[0]}") from e
        except duckdb.Error as e:
            msg = str(e).splitlines()[0]
            if "read-only" in msg.lower() or "external access" in msg.lower():
                raise ReadOnlySqlError(f"refused: {msg}") from e
            raise CatalogError(f"query failed: {msg}") from e
        finally:
            con.close()


def _ensure_reader_role(db: Database) -> bool:
    import sqlalchemy as sa

    with db.connect() as conn:
        exists = conn.execute(sa.text("SELECT 1 FROM pg_roles WHERE rolname = :r"), {"r": READER_ROLE}).scalar()
        can = conn.execute(sa.text("SELECT rolsuper OR rolcreaterole FROM pg_roles WHERE rolname = current_user")
                           ).scalar()
        if not exists and not can:
            return False
        if not exists:
            conn.execute(sa.text(f"CREATE ROLE {READER_ROLE} NOLOGIN"))
        if can:
            schema = conn.execute(sa.text("SELECT current_schema()")).scalar()
            conn.execute(sa.text(f'GRANT USAGE ON SCHEMA "{schema}" TO {READER_ROLE}'))
            conn.execute(sa.text(f'GRANT SELECT ON ALL TABLES IN SCHEMA "{schema}" TO {READER_ROLE}'))
            conn.execute(sa.text(f"GRANT {READER_ROLE} TO current_user"))
    return True


def _postgres(db: Database, query: str) -> tuple[list[str], list[tuple[Any, ...]]]:
    import sqlalchemy as sa

    has_role = _ensure_reader_role(db)
    with db.connect() as conn:
        conn.execute(sa.text("SET TRANSACTION READ ONLY"))
        if has_role:
            conn.execute(sa.text(f"SET LOCAL ROLE {READER_ROLE}"))
        conn.execute(sa.text("SET LOCAL statement_timeout = '300s'"))
        try:
            res = conn.exec_driver_sql(query)
            cols = list(res.keys())
            rows = [tuple(r) for r in res.fetchall()]
        except sa.exc.DBAPIError as e:
            msg = str(getattr(e, "orig", e)).strip().splitlines()[0]
            if "read-only" in msg or "permission denied" in msg:
                raise ReadOnlySqlError(f"refused: {msg}") from e
            raise CatalogError(f"query failed: {msg}") from e
    return cols, rows
