"""The catalog tests run on the backend they were asked to run on. `make test-postgres` sets
MERGEPIPE_TEST_CATALOG to the URL `.ci/start-postgres.sh` printed; an empty or wrong value used to fall back to
DuckDB silently (conftest), so the PostgreSQL half of `make test` passed without a server."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.catalog


def test_catalog_tests_run_on_the_backend_asked_for(catalog) -> None:
    asked = os.environ.get("MERGEPIPE_TEST_CATALOG")
    with catalog.db.connect() as conn:
        dialect = conn.dialect.name
        if dialect == "postgresql":
            assert conn.exec_driver_sql("SELECT 1").scalar() == 1  # a live server, not only a URL
    if asked is None:
        assert dialect == "duckdb"
    else:
        assert dialect == "postgresql", (
            f"MERGEPIPE_TEST_CATALOG={asked!r} is set, but the catalog tests run on {dialect}: the PostgreSQL "
            f"server did not start or its URL was lost (make test-postgres)")
