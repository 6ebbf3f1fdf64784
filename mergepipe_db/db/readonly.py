"""`mergepipe sql`: one read-only query over the catalog views; writes and file access are refused.

DuckDB: a separate read-only connection with external access disabled and the configuration locked.
PostgreSQL: a READ ONLY transaction under a role that may only SELECT (created on first use when the
connecting user may create roles). Either way exactly one statement is accepted.
"""

from __future__ import annotations

import json
import re
from typing import Any

from mergepipe_db.db.engine import Database
from mergepipe_db.errors import CatalogError, ReadOnlySqlError, SqlSyntaxError

READER_ROLE = "mergepipe_sql_reader"


def _one_statement(query: str) -> str:
    import duckdb

    try:
        statements = duckdb.extract_statements(query)
    except duckdb.Error as e:
        raise SqlSyntaxError(f"cannot parse query: {str(e).splitlines()[0]}") from e
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
            if isinstance(e, duckdb.ParserException):
                raise SqlSyntaxError(f"query failed: {msg}") from e
            raise CatalogError(f"query failed: {msg}") from e
        finally:
            con.close()


def _ensure_reader_role(db: Database) -> bool:
    import sqlalchemy as sa

    r = {"r": READER_ROLE}
    with db.connect() as conn:
        exists = conn.execute(sa.text("SELECT 1 FROM pg_roles WHERE rolname = :r"), r).scalar()
        can = conn.execute(sa.text("SELECT rolsuper OR rolcreaterole FROM pg_roles WHERE rolname = current_user")
                           ).scalar()
        if not exists and not can:
            return False
        if not can:
            return bool(conn.execute(sa.text("SELECT pg_has_role(current_user, :r, 'MEMBER')"), r).scalar())
        # Grant only what is missing, one `mergepipe sql` at a time: concurrent CREATE ROLE/GRANT on the same
        # objects fail ("tuple concurrently updated").
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(hashtext(:r))"), r)
        if not conn.execute(sa.text("SELECT 1 FROM pg_roles WHERE rolname = :r"), r).scalar():
            conn.execute(sa.text(f"CREATE ROLE {READER_ROLE} NOLOGIN"))
        schema = conn.execute(sa.text("SELECT current_schema()")).scalar()
        quoted = '"' + str(schema).replace('"', '""') + '"'
        s = {"r": READER_ROLE, "s": schema}
        if not conn.execute(sa.text("SELECT has_schema_privilege(:r, :s, 'USAGE')"), s).scalar():
            conn.execute(sa.text(f"GRANT USAGE ON SCHEMA {quoted} TO {READER_ROLE}"))
        if conn.execute(sa.text(
                "SELECT COUNT(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = :s "
                "AND c.relkind IN ('r', 'v', 'm', 'p', 'f') AND NOT has_table_privilege(:r, c.oid, 'SELECT')"),
                s).scalar():
            conn.execute(sa.text(f"GRANT SELECT ON ALL TABLES IN SCHEMA {quoted} TO {READER_ROLE}"))
        if not conn.execute(sa.text("SELECT pg_has_role(current_user, :r, 'MEMBER')"), r).scalar():
            conn.execute(sa.text(f"GRANT {READER_ROLE} TO current_user"))
    return True


# A login role may always switch back to itself: `set_config('role', ...)` in a SELECT undoes SET LOCAL ROLE
# (and a superuser login then reads server files through dynamic SQL). So, on PostgreSQL, a query whose plan
# calls a setting changer, or a function that runs SQL text the plan cannot show, is refused.
_PG_REFUSED = re.compile(
    r"\b(set_config|query_to_xml\w*|cursor_to_xml\w*|ts_stat|ts_rewrite|dblink\w*|lo_\w+|pg_read_\w+"
    r"|pg_ls_\w+|pg_stat_file|pg_file_\w+)\s*\(", re.IGNORECASE)
_PG_LITERAL = re.compile(r"'(?:[^']|'')*'")


def _pg_refuse_escapes(conn: Any, query: str) -> None:
    """Plan `query` (EXPLAIN VERBOSE does not run it) and refuse it if it calls a function in _PG_REFUSED."""
    import duckdb

    if duckdb.extract_statements(query)[0].type == duckdb.StatementType.EXPLAIN:
        if re.search(r"\banaly[sz]e\b", query, re.IGNORECASE):
            raise ReadOnlySqlError("refused: EXPLAIN ANALYZE runs the query; use EXPLAIN")
        return  # a plain EXPLAIN only plans
    plan = conn.exec_driver_sql("EXPLAIN (VERBOSE, FORMAT JSON) " + query).scalar()
    text = _PG_LITERAL.sub("''", plan if isinstance(plan, str) else json.dumps(plan))
    found = _PG_REFUSED.search(text)
    if found:
        raise ReadOnlySqlError(f"refused: {found.group(1)}() is not allowed in mergepipe sql")


def _postgres(db: Database, query: str) -> tuple[list[str], list[tuple[Any, ...]]]:
    import sqlalchemy as sa

    has_role = _ensure_reader_role(db)
    with db.connect() as conn:
        conn.execute(sa.text("SET TRANSACTION READ ONLY"))
        if has_role:
            conn.execute(sa.text(f"SET LOCAL ROLE {READER_ROLE}"))
        conn.execute(sa.text("SET LOCAL statement_timeout = '300s'"))
        try:
            _pg_refuse_escapes(conn, query)
            res = conn.exec_driver_sql(query)
            cols = list(res.keys())
            rows = [tuple(r) for r in res.fetchall()]
        except sa.exc.DBAPIError as e:
            msg = str(getattr(e, "orig", e)).strip().splitlines()[0]
            if "read-only" in msg or "permission denied" in msg:
                raise ReadOnlySqlError(f"refused: {msg}") from e
            if "syntax error" in msg:
                raise SqlSyntaxError(f"query failed: {msg}") from e
            raise CatalogError(f"query failed: {msg}") from e
    return cols, rows
