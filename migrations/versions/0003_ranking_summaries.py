"""ranking summaries: per-checkpoint tensor and score-bucket summaries of the blocks, and (PostgreSQL) the index
on mp_block(checkpoint_id, delta_l2) a budgeted plan reads the top of each expert's ranking through

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from mergepipe_db.db.sql_files import data_dir

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "mp_rank_tensor",
        sa.Column("checkpoint_id", sa.String(64), primary_key=True),
        sa.Column("tensor_idx", sa.Integer, primary_key=True),
        sa.Column("candidates", sa.BigInteger, nullable=False),
        sa.Column("candidate_bytes", sa.BigInteger, nullable=False),
        sa.Column("unscored", sa.BigInteger, nullable=False),
        sa.Column("l2_sum", sa.Double, nullable=True),
    )
    op.create_table(
        "mp_rank_bucket",
        sa.Column("checkpoint_id", sa.String(64), primary_key=True),
        sa.Column("bucket", sa.Integer, primary_key=True),
        sa.Column("blocks", sa.BigInteger, nullable=False),
        sa.Column("nbytes", sa.BigInteger, nullable=False),
        sa.Column("min_l2", sa.Double, nullable=False),
    )
    conn = op.get_bind()
    if conn.dialect.name == "postgresql":
        op.create_index("ix_mp_block_rank", "mp_block", ["checkpoint_id", "delta_l2"])
    # the summaries of every checkpoint already catalogued, with the statements ingest runs (sql/)
    sql = data_dir("sql")
    statements = [sa.text((sql / f"{name}.sql").read_text(encoding="utf-8"))
                  for name in ("rank_tensor_insert", "rank_bucket_insert")]
    for (cid,) in conn.execute(sa.text("SELECT id FROM mp_checkpoint ORDER BY id")).all():
        for stmt in statements:
            conn.execute(stmt, {"checkpoint_id": cid})


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.drop_index("ix_mp_block_rank", table_name="mp_block")
    op.drop_table("mp_rank_bucket")
    op.drop_table("mp_rank_tensor")
