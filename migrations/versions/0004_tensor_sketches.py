"""tensor sketches: per tensor of a checkpoint, the sum of its block sketches (mp_tensor_sketch), written for
every checkpoint already catalogued

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    from mergepipe_db.db.rank_tables import write_tensor_sketches  # the function ingest and commit call

    op.create_table(
        "mp_tensor_sketch",
        sa.Column("checkpoint_id", sa.String(64), primary_key=True),
        sa.Column("tensor_idx", sa.Integer, primary_key=True),
        sa.Column("sketch", sa.LargeBinary, nullable=False),
        sa.Column("complete", sa.Boolean, nullable=False),
    )
    conn = op.get_bind()
    for (cid,) in conn.execute(sa.text("SELECT id FROM mp_checkpoint ORDER BY id")).all():
        write_tensor_sketches(conn, cid)


def downgrade() -> None:
    op.drop_table("mp_tensor_sketch")
