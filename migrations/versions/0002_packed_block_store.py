"""packed block store: content-addressed zstd blobs and the packed blocks of experts

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "mp_blob",
        sa.Column("hash", sa.String(32), primary_key=True),
        sa.Column("store_path", sa.Text, nullable=False),
        sa.Column("offset", sa.BigInteger, nullable=False),
        sa.Column("clen", sa.BigInteger, nullable=False),
        sa.Column("raw_len", sa.BigInteger, nullable=False),
        sa.Column("codec", sa.String(16), nullable=False),
    )
    op.create_table(
        "mp_packed_block",
        sa.Column("checkpoint_id", sa.String(64), primary_key=True),
        sa.Column("tensor_idx", sa.Integer, primary_key=True),
        sa.Column("block_idx", sa.Integer, primary_key=True),
        sa.Column("blob_hash", sa.String(32), nullable=False),
        sa.Column("clen", sa.BigInteger, nullable=False),
        sa.Column("base_xxh3", sa.String(32), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("mp_packed_block")
    op.drop_table("mp_blob")
