"""The catalog schema in SQLAlchemy Core: the source of truth for the Alembic migrations.

Tables carry an `mp_` prefix; users query the unprefixed views defined in `sql/views/` (see README).
Ids are hex strings derived from content, so ingesting the same content twice is a no-op.
Sizes and offsets are bytes; `offset` columns are absolute file offsets (8 + header length + begin).
"""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()

checkpoint = sa.Table(
    "mp_checkpoint",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),  # content-derived, see ingest.checkpoint_id
    sa.Column("name", sa.Text, nullable=False, unique=True),
    sa.Column("kind", sa.String(16), nullable=False),  # full | delta | lora | snapshot
    sa.Column("base_id", sa.String(64), nullable=True),
    sa.Column("root", sa.Text, nullable=False),
    sa.Column("config", sa.Text, nullable=True),  # config.json as JSON text
    sa.Column("block_bytes", sa.BigInteger, nullable=False),
    sa.Column("n_tensors", sa.Integer, nullable=False),
    sa.Column("total_bytes", sa.BigInteger, nullable=False),
    sa.Column("has_stats", sa.Boolean, nullable=False),
    sa.Column("created_at", sa.Text, nullable=False),
    sa.Column("tool_version", sa.Text, nullable=False),
)

source_file = sa.Table(
    "mp_file",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("checkpoint_id", sa.String(64), nullable=False, index=True),
    sa.Column("file_idx", sa.Integer, nullable=False),
    sa.Column("relpath", sa.Text, nullable=False),
    sa.Column("path", sa.Text, nullable=False),
    sa.Column("size", sa.BigInteger, nullable=False),
    sa.Column("mtime_ns", sa.BigInteger, nullable=False),
    sa.Column("sha256", sa.String(64), nullable=False),
    sa.Column("header_len", sa.BigInteger, nullable=False),
)

tensor = sa.Table(
    "mp_tensor",
    metadata,
    sa.Column("checkpoint_id", sa.String(64), primary_key=True),
    sa.Column("tensor_idx", sa.Integer, primary_key=True),
    sa.Column("name", sa.Text, nullable=False),
    sa.Column("dtype", sa.String(16), nullable=False),
    sa.Column("shape", sa.Text, nullable=False),  # JSON list
    sa.Column("file_id", sa.String(64), nullable=False),
    sa.Column("offset", sa.BigInteger, nullable=False),
    sa.Column("nbytes", sa.BigInteger, nullable=False),
    sa.Column("n_rows", sa.BigInteger, nullable=False),
    sa.Column("rows_per_block", sa.BigInteger, nullable=False),
    sa.Column("n_blocks", sa.Integer, nullable=False),
    sa.Column("xxh3", sa.String(32), nullable=False),  # xxh3_128 of the stored bytes
    sa.Column("delta_l2", sa.Double, nullable=True),
    sa.Column("equal_to_base", sa.Boolean, nullable=True),
    sa.UniqueConstraint("checkpoint_id", "name", name="uq_mp_tensor_name"),
)

block = sa.Table(
    "mp_block",
    metadata,
    sa.Column("checkpoint_id", sa.String(64), primary_key=True),
    sa.Column("tensor_idx", sa.Integer, primary_key=True),
    sa.Column("block_idx", sa.Integer, primary_key=True),
    sa.Column("row_start", sa.BigInteger, nullable=False),
    sa.Column("row_stop", sa.BigInteger, nullable=False),
    sa.Column("offset", sa.BigInteger, nullable=False),
    sa.Column("nbytes", sa.BigInteger, nullable=False),
    sa.Column("xxh3", sa.String(32), nullable=False),
    sa.Column("delta_l2", sa.Double, nullable=True),
    sa.Column("delta_l1", sa.Double, nullable=True),
    sa.Column("delta_max", sa.Double, nullable=True),
    sa.Column("pos_frac", sa.Double, nullable=True),
    sa.Column("sketch", sa.LargeBinary, nullable=True),
)

# The index a budgeted plan reads the top of each expert's ranking through (planner: ranking summaries below);
# PostgreSQL only: DuckDB scans the column (ingest writes a checkpoint's blocks in descending delta_l2 order, so
# its zone maps skip what lies below the threshold).
sa.Index("ix_mp_block_rank", block.c.checkpoint_id, block.c.delta_l2).ddl_if(dialect="postgresql")

# Ranking summaries (mergepipe_db/db/rank_tables.py): derived from a checkpoint's blocks in the transaction that inserts
# them (`ranking.write`, `sql/rank_*_insert.sql`), never changed after, like the blocks. A block is a *candidate*
# when its delta_l2 is NULL (unscored) or non-zero.
rank_tensor = sa.Table(
    "mp_rank_tensor",
    metadata,
    sa.Column("checkpoint_id", sa.String(64), primary_key=True),
    sa.Column("tensor_idx", sa.Integer, primary_key=True),
    sa.Column("candidates", sa.BigInteger, nullable=False),
    sa.Column("candidate_bytes", sa.BigInteger, nullable=False),
    sa.Column("unscored", sa.BigInteger, nullable=False),  # candidates with delta_l2 NULL
    sa.Column("l2_sum", sa.Double, nullable=True),  # sum of delta_l2 over the scored candidates
)

rank_bucket = sa.Table(
    "mp_rank_bucket",
    metadata,
    sa.Column("checkpoint_id", sa.String(64), primary_key=True),
    sa.Column("bucket", sa.Integer, primary_key=True),  # floor(256·ln delta_l2); NaN/huge and tiny apart
    sa.Column("blocks", sa.BigInteger, nullable=False),
    sa.Column("nbytes", sa.BigInteger, nullable=False),
    sa.Column("min_l2", sa.Double, nullable=False),  # the smallest delta_l2 in the bucket (NaN counts as largest)
)

# Per tensor of a checkpoint with block sketches: their sum (the tensor's exact |Δ| histogram, `sketch.encode`),
# and whether every row block (block_idx >= 0) has one. TIES plans from these without decoding block sketches.
tensor_sketch = sa.Table(
    "mp_tensor_sketch",
    metadata,
    sa.Column("checkpoint_id", sa.String(64), primary_key=True),
    sa.Column("tensor_idx", sa.Integer, primary_key=True),
    sa.Column("sketch", sa.LargeBinary, nullable=False),
    sa.Column("complete", sa.Boolean, nullable=False),
)

# Per tensor of a checkpoint: the inner-product statistics the geometric methods (slerp, model_stock, nuslerp,
# multislerp, karcher) take their coefficients from before reading (`kernels/gram_stats.py`). An expert catalogued
# against a base: base_dot = <θ₀, Δ>, delta_sq = ||Δ||², proj = the count sketch of Δ (float64 little-endian, GRAM_DIM
# values). A base (an original checkpoint): base_sq = ||θ||². complete: every block of the tensor contributed.
tensor_gram = sa.Table(
    "mp_tensor_gram",
    metadata,
    sa.Column("checkpoint_id", sa.String(64), primary_key=True),
    sa.Column("tensor_idx", sa.Integer, primary_key=True),
    sa.Column("base_dot", sa.Double, nullable=True),
    sa.Column("delta_sq", sa.Double, nullable=True),
    sa.Column("base_sq", sa.Double, nullable=True),
    sa.Column("proj", sa.LargeBinary, nullable=True),
    sa.Column("complete", sa.Boolean, nullable=False),
)

# Exact <Δ_a, Δ_b> of one tensor for two experts ingested together (one scan group): tensor_idx is checkpoint_id's.
tensor_cross = sa.Table(
    "mp_tensor_cross",
    metadata,
    sa.Column("checkpoint_id", sa.String(64), primary_key=True),
    sa.Column("other_id", sa.String(64), primary_key=True),
    sa.Column("tensor_idx", sa.Integer, primary_key=True),
    sa.Column("dot", sa.Double, nullable=False),
)

snapshot = sa.Table(
    "mp_snapshot",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),  # = manifest hash
    sa.Column("checkpoint_id", sa.String(64), nullable=False),  # the output, catalogued as kind 'snapshot'
    sa.Column("ref", sa.Text, nullable=False),
    sa.Column("state", sa.String(16), nullable=False),  # COMMITTED
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
    sa.Column("bound", sa.Double, nullable=True),
    sa.Column("seed", sa.BigInteger, nullable=False),
    sa.Column("created_at", sa.Text, nullable=False),
)

manifest = sa.Table(
    "mp_manifest",
    metadata,
    sa.Column("snapshot_id", sa.String(64), primary_key=True),
    sa.Column("manifest", sa.Text, nullable=False),  # canonical JSON, hashed
    sa.Column("timings", sa.Text, nullable=False),  # JSON, outside the hash
)

lineage = sa.Table(
    "mp_lineage",
    metadata,
    sa.Column("child_id", sa.String(64), primary_key=True),
    sa.Column("parent_id", sa.String(64), primary_key=True),
    sa.Column("role", sa.String(16), primary_key=True),  # base | expert
    sa.Column("position", sa.Integer, nullable=False),
    sa.Column("snapshot_id", sa.String(64), nullable=False),
)

ref = sa.Table(
    "mp_ref",
    metadata,
    sa.Column("name", sa.Text, primary_key=True),
    sa.Column("snapshot_id", sa.String(64), nullable=False),
    sa.Column("version", sa.BigInteger, nullable=False),
    sa.Column("updated_at", sa.Text, nullable=False),
)

read_stat = sa.Table(
    "mp_read",
    metadata,
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

staging = sa.Table(
    "mp_staging",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("staging_path", sa.Text, nullable=False),
    sa.Column("out_path", sa.Text, nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
    sa.Column("host", sa.Text, nullable=False),
    sa.Column("created_at", sa.Text, nullable=False),
)

# Packed block store (mergepipe_db/sources/packed.py, written by admin/pack.py): content-addressed,
# zstd-compressed block payloads.
blob = sa.Table(
    "mp_blob",
    metadata,
    sa.Column("hash", sa.String(32), primary_key=True),  # xxh3_128 of the uncompressed payload
    sa.Column("store_path", sa.Text, nullable=False),  # append-only store file (absolute path)
    sa.Column("offset", sa.BigInteger, nullable=False),  # byte offset of the compressed payload in the file
    sa.Column("clen", sa.BigInteger, nullable=False),  # compressed length (bytes): the read cost
    sa.Column("raw_len", sa.BigInteger, nullable=False),  # uncompressed length (bytes)
    sa.Column("codec", sa.String(16), nullable=False),  # zstd-xor: payload = zstd(expert bytes XOR base bytes)
)

packed_block = sa.Table(
    "mp_packed_block",
    metadata,
    sa.Column("checkpoint_id", sa.String(64), primary_key=True),
    sa.Column("tensor_idx", sa.Integer, primary_key=True),  # the expert's tensor_idx (as in mp_block)
    sa.Column("block_idx", sa.Integer, primary_key=True),
    sa.Column("blob_hash", sa.String(32), nullable=False),
    sa.Column("clen", sa.BigInteger, nullable=False),  # = the blob's clen, kept here for the planner's join
    sa.Column("base_xxh3", sa.String(32), nullable=False),  # the base block the payload is XORed against
)
