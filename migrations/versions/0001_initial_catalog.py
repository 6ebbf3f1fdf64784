"""initial catalog: checkpoints, files, tensors, blocks, snapshots, manifests, lineage, refs, reads, staging

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from mergepipe_db.db.sql_files import data_dir

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

VIEWS = ("checkpoints", "files", "tensors", "blocks", "snapshots", "manifests", "lineage", "reads", "refs")


def upgrade() -> None:
    op.create_table(
        "mp_checkpoint",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("name", sa.Text, nullable=False, unique=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("base_id", sa.String(64), nullable=True),
        sa.Column("root", sa.Text, nullable=False),
        sa.Column("config", sa.Text, nullable=True),
        sa.Column("block_bytes", sa.BigInteger, nullable=False),
        sa.Column("n_tensors", sa.Integer, nullable=False),
        sa.Column("total_bytes", sa.BigInteger, nullable=False),
        sa.Column("has_stats", sa.Boolean, nullable=False),
        sa.Column("created_at", sa.Text, nullable=False),
        sa.Column("tool_version", sa.Text, nullable=False),
    )
    op.create_table(
        "mp_file",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("checkpoint_id", sa.String(64), nullable=False),
        sa.Column("file_idx", sa.Integer, nullable=False),
        sa.Column("relpath", sa.Text, nullable=False),
        sa.Column("path", sa.Text, nullable=False),
        sa.Column("size", sa.BigInteger, nullable=False),
        sa.Column("mtime_ns", sa.BigInteger, nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("header_len", sa.BigInteger, nullable=False),
    )
    op.create_index("ix_mp_file_checkpoint_id", "mp_file", ["checkpoint_id"])
    op.create_table(
        "mp_tensor",
        sa.Column("checkpoint_id", sa.String(64), primary_key=True),
        sa.Column("tensor_idx", sa.Integer, primary_key=True),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("dtype", sa.String(16), nullable=False),
        sa.Column("shape", sa.Text, nullable=False),
        sa.Column("file_id", sa.String(64), nullable=False),
        sa.Column("offset", sa.BigInteger, nullable=False),
        sa.Column("nbytes", sa.BigInteger, nullable=False),
        sa.Column("n_rows", sa.BigInteger, nullable=False),
        sa.Column("rows_per_block", sa.BigInteger, nullable=False),
        sa.Column("n_blocks", sa.Integer, nullable=False),
        sa.Column("xxh3", sa.String(32), nullable=False),
        sa.Column("delta_l2", sa.Float, nullable=True),
        sa.Column("equal_to_base", sa.Boolean, nullable=True),
        sa.UniqueConstraint("checkpoint_id", "name", name="uq_mp_tensor_name"),
    )
    op.create_table(
        "mp_block",
        sa.Column("checkpoint_id", sa.String(64), primary_key=True),
        sa.Column("tensor_idx", sa.Integer, primary_key=True),
        sa.Column("block_idx", sa.Integer, primary_key=True),
        sa.Column("row_start", sa.BigInteger, nullable=False),
        sa.Column("row_stop", sa.BigInteger, nullable=False),
        sa.Column("offset", sa.BigInteger, nullable=False),
        sa.Column("nbytes", sa.BigInteger, nullable=False),
        sa.Column("xxh3", sa.String(32), nullable=False),
        sa.Column("delta_l2", sa.Float, nullable=True),
        sa.Column("delta_l1", sa.Float, nullable=True),
        sa.Column("delta_max", sa.Float, nullable=True),
        sa.Column("pos_frac", sa.Float, nullable=True),
        sa.Column("sketch", sa.LargeBinary, nullable=True),
    )
    op.create_table(
        "mp_snapshot",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("checkpoint_id", sa.String(64), nullable=False),
        sa.Column("ref", sa.Text, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("out_path", sa.Text, nullable=False),
        sa.Column("staging_path", sa.Text, nullable=False),
        sa.Column("method", sa.String(32), nullable=False),
        sa.Column("plan_hash", sa.String(64), nullable=False),
        sa.Column("budget_bytes", sa.BigInteger, nullable=False),
        sa.Column("planned_bytes", sa.BigInteger, nullable=False),
        sa.Column("realized_bytes", sa.BigInteger, nullable=False),
        sa.Column("full_bytes", sa.BigInteger, nullable=False),
        sa.Column("base_bytes", sa.BigInteger, nullable=False),
        sa.Column("output_bytes", sa.BigInteger, nullable=False),
        sa.Column("bound", sa.Float, nullable=True),
        sa.Column("seed", sa.BigInteger, nullable=False),
        sa.Column("created_at", sa.Text, nullable=False),
    )
    op.create_table(
        "mp_manifest",
        sa.Column("snapshot_id", sa.String(64), primary_key=True),
        sa.Column("manifest", sa.Text, nullable=False),
        sa.Column("timings", sa.Text, nullable=False),
    )
    op.create_table(
        "mp_lineage",
        sa.Column("child_id", sa.String(64), primary_key=True),
        sa.Column("parent_id", sa.String(64), primary_key=True),
        sa.Column("role", sa.String(16), primary_key=True),
        sa.Column("position", sa.Integer, nullable=False),
        sa.Column("snapshot_id", sa.String(64), nullable=False),
    )
    op.create_table(
        "mp_ref",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("snapshot_id", sa.String(64), nullable=False),
        sa.Column("version", sa.BigInteger, nullable=False),
        sa.Column("updated_at", sa.Text, nullable=False),
    )
    op.create_table(
        "mp_read",
        sa.Column("snapshot_id", sa.String(64), primary_key=True),
        sa.Column("expert_id", sa.String(64), primary_key=True),
        sa.Column("tensor_idx", sa.Integer, primary_key=True),
        sa.Column("position", sa.Integer, nullable=False),
        sa.Column("blocks_total", sa.Integer, nullable=False),
        sa.Column("blocks_read", sa.Integer, nullable=False),
        sa.Column("bytes_full", sa.BigInteger, nullable=False),
        sa.Column("bytes_planned", sa.BigInteger, nullable=False),
        sa.Column("bytes_read", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "mp_staging",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("staging_path", sa.Text, nullable=False),
        sa.Column("out_path", sa.Text, nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("host", sa.Text, nullable=False),
        sa.Column("created_at", sa.Text, nullable=False),
    )
    views = data_dir("sql") / "views"
    for name in VIEWS:
        op.execute((views / f"{name}.sql").read_text(encoding="utf-8"))


def downgrade() -> None:
    for name in reversed(VIEWS):
        op.execute(f"DROP VIEW IF EXISTS {name}")
    for table in ("mp_staging", "mp_read", "mp_ref", "mp_lineage", "mp_manifest", "mp_snapshot", "mp_block",
                  "mp_tensor", "mp_file", "mp_checkpoint"):
        op.drop_table(table)
