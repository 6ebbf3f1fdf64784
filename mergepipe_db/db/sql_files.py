"""Locates the SQL files and Alembic migrations shipped with the package.

In a built wheel they live in `mergepipe_db/_data/{sql,migrations}`; in a source checkout (editable
install) they are the top-level `sql/` and `migrations/` folders.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from mergepipe_db.errors import CatalogError

_PKG = Path(__file__).resolve().parents[1]  # the mergepipe_db folder


def data_dir(name: str) -> Path:
    """Return the folder `sql` or `migrations`, wherever this install keeps it."""
    for candidate in (_PKG / "_data" / name, _PKG.parent / name):
        if candidate.is_dir():
            return candidate
    raise CatalogError(f"mergepipe_db is installed without its '{name}' folder; reinstall the package")


_INCLUDE = re.compile(r"/\*include ([a-z_]+)\*/")


@functools.cache
def sql_text(name: str) -> str:
    """The text of `sql/<name>.sql` (one statement, `:named` parameters), with each ``/*include NAME*/`` replaced
    by the fragment `sql/NAME.sql` (a part two statements share, such as a CTE)."""
    path = data_dir("sql") / f"{name}.sql"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise CatalogError(f"missing SQL file {path}") from e
    return _INCLUDE.sub(lambda m: sql_text(m.group(1)).rstrip("\n"), text)
