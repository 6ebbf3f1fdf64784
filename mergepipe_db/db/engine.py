"""Engine and session boundary for the catalog database.

One rule shapes this module: a DuckDB file admits a single process at a time, and that process locks out
every other one. So a connection is opened for a short unit of work only (read the plan's rows, or commit a
result), under a cross-process file lock with bounded retry, and closed at once. PostgreSQL needs no lock
(MVCC); the same code runs on both.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import NullPool

from mergepipe_db.errors import (
    CatalogError,
    CatalogLockedError,
    CatalogNotFoundError,
    CatalogOutOfDateError,
    CommitConflictError,
    UnsupportedCatalogUrlError,
)

DEFAULT_CATALOG = "./mergepipe.duckdb"
ENV_CATALOG = "MERGEPIPE_CATALOG"
ENV_LOCK_TIMEOUT = "MERGEPIPE_LOCK_TIMEOUT"
#: the newest migration in migrations/versions (tests/integration/test_catalog.py checks it is alembic's only head)
SCHEMA_HEAD = "0006"
#: URL schemes a catalog may use (a path without ``://`` is a DuckDB file)
SUPPORTED_SCHEMES = ("duckdb", "postgresql", "postgres")
CREATE_HINT = "create one with `mergepipe init`, `mergepipe ingest` or `mergepipe demo`"


def resolve_url(catalog: str | None) -> str:
    """A SQLAlchemy URL from `--catalog`, `$MERGEPIPE_CATALOG` or the default `./mergepipe.duckdb`.

    A plain path (no `://`) means a DuckDB file.
    """
    value = catalog or os.environ.get(ENV_CATALOG) or DEFAULT_CATALOG
    if "://" in value:
        scheme = value.split("://", 1)[0].split("+", 1)[0].lower()
        if scheme not in SUPPORTED_SCHEMES:
            raise UnsupportedCatalogUrlError(
                f"catalog URL scheme {scheme!r} is not supported; use a DuckDB file path (or duckdb:///PATH) or "
                f"postgresql://user:password@host/db")
        if value.startswith("postgres://"):
            value = "postgresql+psycopg://" + value[len("postgres://") :]
        elif value.startswith("postgresql://"):
            value = "postgresql+psycopg://" + value[len("postgresql://") :]
        return value
    return "duckdb:///" + str(Path(value).expanduser().resolve())


@dataclass
class Database:
    """A catalog database reachable by URL. Cheap to create; holds no connection between calls."""

    url: str

    @property
    def is_duckdb(self) -> bool:
        return self.url.startswith("duckdb")

    @property
    def duckdb_path(self) -> Path | None:
        if not self.is_duckdb:
            return None
        return Path(sa.engine.make_url(self.url).database or ":memory:")

    def display(self) -> str:
        return str(sa.engine.make_url(self.url).render_as_string(hide_password=True))

    def require_existing(self) -> None:
        """Raise CatalogNotFoundError (naming where it looked) unless the catalog exists: the DuckDB file is
        there, or the PostgreSQL database holds the schema. Creates nothing (no file, no directory, no lock)."""
        path = self.duckdb_path
        if path is not None:
            if not path.is_file():
                raise CatalogNotFoundError(f"no catalog at {path}; {CREATE_HINT} (or give --catalog / "
                                           f"${ENV_CATALOG})")
            return
        engine = self._engine()
        try:
            with engine.connect() as conn:
                revision = self.current_revision(conn)
                empty = revision is None and not sa.inspect(conn).get_table_names()
        except sa.exc.DBAPIError as e:
            raise CatalogError(f"catalog {self.display()} is unavailable: {_first_line(e)}") from e
        finally:
            engine.dispose()
        if empty:  # tables without a schema revision: `connect` says it is out of date
            raise CatalogNotFoundError(f"no catalog in {self.display()} (the database holds no mergepipe schema); "
                                       f"{CREATE_HINT}")

    # -- connections --------------------------------------------------------------------------------

    def _engine(self) -> Engine:
        try:
            return sa.create_engine(self.url, poolclass=NullPool)
        except Exception as e:  # noqa: BLE001 - unknown driver, bad URL
            raise CatalogError(f"cannot use catalog {self.display()}: {e}") from e

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        path = self.duckdb_path
        if path is None:
            yield
            return
        from filelock import FileLock, Timeout

        timeout = float(os.environ.get(ENV_LOCK_TIMEOUT, "120"))
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(path) + ".lock")
        try:
            lock.acquire(timeout=timeout, poll_interval=0.05)
        except Timeout as e:
            raise CatalogLockedError(
                f"catalog {path} is busy: another mergepipe process held its lock for {timeout:.0f} s "
                f"(set {ENV_LOCK_TIMEOUT} to wait longer)"
            ) from e
        try:
            yield
        finally:
            lock.release()

    @contextlib.contextmanager
    def connect(self, *, check_schema: bool = True) -> Iterator[Connection]:
        """One transaction: commits when the block ends normally, rolls back on any exception."""
        with self._lock():
            engine = self._engine()
            try:
                with engine.connect() as conn:
                    if check_schema:
                        self._check_schema(conn)
                    if conn.in_transaction():
                        conn.commit()
                    with conn.begin():
                        yield conn
            except sa.exc.IntegrityError as e:
                # A unique key another writer committed first (PostgreSQL: concurrent inserts of one ref/name).
                raise CommitConflictError(f"catalog write lost a race with another writer: {_first_line(e)}; "
                                          f"rerun the command") from e
            except sa.exc.OperationalError as e:
                if getattr(getattr(e, "orig", None), "sqlstate", None) in ("40001", "40P01"):
                    raise CommitConflictError(f"catalog transaction conflicted with another writer: "
                                              f"{_first_line(e)}; rerun the command") from e
                raise CatalogError(f"catalog {self.display()} is unavailable: {_first_line(e)}") from e
            except sa.exc.DBAPIError as e:  # any other database error: one line, never a traceback
                raise CatalogError(f"catalog {self.display()} error: {_first_line(e)}") from e
            finally:
                engine.dispose()

    # -- migrations ---------------------------------------------------------------------------------

    def _alembic_config(self, conn: Connection):  # -> alembic.config.Config
        from alembic.config import Config

        from mergepipe_db.db.sql_files import data_dir

        cfg = Config()
        cfg.set_main_option("script_location", str(data_dir("migrations")))
        cfg.attributes["connection"] = conn
        return cfg

    def head_revision(self) -> str:
        """The schema revision this code needs: `SCHEMA_HEAD`, the head of migrations/ (a test checks they
        agree), so opening a catalog neither imports alembic nor parses the migration scripts."""
        return SCHEMA_HEAD

    def current_revision(self, conn: Connection) -> str | None:
        # information_schema directly: SQLAlchemy's inspector costs ~40 ms per connection on DuckDB
        found = conn.execute(sa.text("SELECT COUNT(*) FROM information_schema.tables WHERE table_name = "
                                     "'alembic_version' AND table_schema = current_schema()")).scalar()
        if not found:
            return None
        row = conn.execute(sa.text("SELECT version_num FROM alembic_version")).first()
        return None if row is None else str(row[0])

    def _check_schema(self, conn: Connection) -> None:
        current = self.current_revision(conn)
        head = self.head_revision()
        if current == head:
            return
        if current is None and not sa.inspect(conn).get_table_names():
            # A brand-new, empty database: create the catalog in place.
            self._upgrade(conn)
            conn.commit()
            return
        raise CatalogOutOfDateError(
            f"catalog {self.display()} is at schema revision {current or 'none'}, this mergepipe needs {head}: "
            f"run `mergepipe db upgrade --catalog '{self.display()}'`"
        )

    def _upgrade(self, conn: Connection) -> None:
        from alembic import command

        command.upgrade(self._alembic_config(conn), "head")

    def upgrade(self) -> tuple[str | None, str]:
        """Migrate the catalog to the newest schema. Returns (revision before, revision after)."""
        with self._lock():
            engine = self._engine()
            try:
                with engine.connect() as conn:
                    before = self.current_revision(conn)
                    self._upgrade(conn)
                    conn.commit()
                    return before, self.current_revision(conn) or ""
            except sa.exc.OperationalError as e:
                raise CatalogError(f"catalog {self.display()} is unavailable: {_first_line(e)}") from e
            finally:
                engine.dispose()


def retry_delay(attempt: int) -> float:
    """Backoff for retryable catalog conflicts: 50 ms, 100 ms, ... capped at 1 s."""
    return min(1.0, 0.05 * (2**attempt))


def sleep_backoff(attempt: int) -> None:
    time.sleep(retry_delay(attempt))


def _first_line(e: BaseException) -> str:
    text = str(getattr(e, "orig", None) or e)
    return text.strip().splitlines()[0] if text.strip() else type(e).__name__
