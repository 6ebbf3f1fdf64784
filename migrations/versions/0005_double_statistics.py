"""double-precision block statistics: on DuckDB the float columns (delta_l2, delta_l1, delta_max, pos_frac of
mp_block, delta_l2 of mp_tensor, bound of mp_snapshot) were FLOAT, 4 bytes, which rounded the float64 norms
ingest computes to float32: blocks whose norms differ by less than a float32 ulp tied on DuckDB but not on
PostgreSQL (where FLOAT is double precision), so the two backends could plan the same merge differently.
Widening keeps the values already stored (they stay float32-rounded until their checkpoint is ingested
again); new rows keep every bit. PostgreSQL: nothing to change.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

COLUMNS = {
    "mp_block": ("delta_l2", "delta_l1", "delta_max", "pos_frac"),
    "mp_tensor": ("delta_l2",),
    "mp_snapshot": ("bound",),
}


def _retype(type_: str) -> None:
    if op.get_bind().dialect.name != "duckdb":
        return
    for table, columns in COLUMNS.items():
        for column in columns:  # no index depends on them on DuckDB (ix_mp_block_rank is PostgreSQL's only)
            op.execute(sa.text(f'ALTER TABLE {table} ALTER COLUMN "{column}" TYPE {type_}'))


def upgrade() -> None:
    _retype("DOUBLE")


def downgrade() -> None:
    _retype("FLOAT")
