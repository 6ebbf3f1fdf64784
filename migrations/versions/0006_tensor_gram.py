"""tensor inner-product statistics: per tensor of a checkpoint, <θ₀, Δ>, ||Δ||², a count sketch of Δ (experts)
or ||θ||² (bases), for the geometric methods' budgeted plans (mp_tensor_gram), and the exact <Δ_a, Δ_b> of
experts ingested together (mp_tensor_cross). Checkpoints catalogued before
have none (their merges by these methods read whole tensors, as before); ingesting them again adds them.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "mp_tensor_gram",
        sa.Column("checkpoint_id", sa.String(64), primary_key=True),
        sa.Column("tensor_idx", sa.Integer, primary_key=True),
        sa.Column("base_dot", sa.Double, nullable=True),
        sa.Column("delta_sq", sa.Double, nullable=True),
        sa.Column("base_sq", sa.Double, nullable=True),
        sa.Column("proj", sa.LargeBinary, nullable=True),
        sa.Column("complete", sa.Boolean, nullable=False),
    )
    op.create_table(
        "mp_tensor_cross",
        sa.Column("checkpoint_id", sa.String(64), primary_key=True),
        sa.Column("other_id", sa.String(64), primary_key=True),
        sa.Column("tensor_idx", sa.Integer, primary_key=True),
        sa.Column("dot", sa.Double, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("mp_tensor_cross")
    op.drop_table("mp_tensor_gram")
