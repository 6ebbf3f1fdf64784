"""mergepipe_db: merge LLM checkpoints from a SQL catalog of parameter blocks, under an expert-read budget.

Public API::

    from mergepipe_db import Catalog
    cat = Catalog.open("./mergepipe.duckdb")
    cat.ingest("models/base", name="base")
    cat.ingest("models/math", name="math", base="base")
    plan = cat.plan("merge.yml", budget="0.25")
    result = cat.merge("merge.yml", out="merged/", budget="0.25")
"""

from __future__ import annotations

from mergepipe_db.core.version import __version__  # noqa: E402
from mergepipe_db.errors import MergePipeError  # noqa: E402

__all__ = ["Catalog", "MergePipeError", "__version__"]


def __getattr__(name: str):  # lazy: keeps `mergepipe --help` free of heavy imports
    if name == "Catalog":
        from mergepipe_db.catalog import Catalog

        return Catalog
    raise AttributeError(name)
