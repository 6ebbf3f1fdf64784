"""The inner-product statistics of a checkpoint's tensors (mp_tensor_gram; `kernels/gram_stats.py` computes
them at ingest): written beside its blocks, read by the planner of the geometric methods."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import sqlalchemy as sa

from mergepipe_db.db import schema

__all__ = ["TensorGram", "has_tensor_gram", "tensor_cross", "tensor_gram", "write_tensor_gram"]


@dataclass(frozen=True)
class TensorGram:
    """One tensor's statistics: an expert's ⟨θ₀, Δ⟩ (None for a delta checkpoint), ‖Δ‖² and count sketch of Δ;
    a base's ‖θ₀‖² (`base_sq`)."""

    base_dot: float | None
    delta_sq: float | None
    base_sq: float | None
    proj: np.ndarray | None


def write_tensor_gram(conn: sa.Connection, checkpoint_id: str, rows: Sequence[tuple[int, dict[str, Any]]],
                      crosses: Sequence[tuple[int, str, float]] = ()) -> None:
    """Insert the statistics of one checkpoint's tensors ((tensor_idx, values) pairs) and its exact products
    with the experts ingested with it ((tensor_idx, other checkpoint id, ⟨Δ, Δ_other⟩)) in the caller's
    transaction."""
    if crosses:
        conn.execute(schema.tensor_cross.insert(), [
            {"checkpoint_id": checkpoint_id, "other_id": other, "tensor_idx": int(tidx), "dot": float(dot)}
            for tidx, other, dot in crosses])
    out = []
    for tidx, g in rows:
        proj = g.get("proj")
        out.append({"checkpoint_id": checkpoint_id, "tensor_idx": int(tidx), "base_dot": g.get("base_dot"),
                    "delta_sq": g.get("delta_sq"), "base_sq": g.get("base_sq"),
                    "proj": None if proj is None or len(proj) == 0 else np.asarray(proj, "<f8").tobytes(),
                    "complete": True})
    if out:
        conn.execute(schema.tensor_gram.insert(), out)


def has_tensor_gram(conn: sa.Connection, checkpoint_id: str) -> bool:
    tg = schema.tensor_gram
    return conn.execute(sa.select(sa.func.count()).select_from(tg).where(tg.c.checkpoint_id == checkpoint_id)
                        ).scalar() != 0


def tensor_gram(conn: sa.Connection, checkpoint_id: str) -> dict[int, TensorGram]:
    """Per tensor of one checkpoint (its own tensor_idx): its statistics, where ingest took them."""
    tg = schema.tensor_gram
    rows = conn.execute(sa.select(tg.c.tensor_idx, tg.c.base_dot, tg.c.delta_sq, tg.c.base_sq, tg.c.proj)
                        .where(tg.c.checkpoint_id == checkpoint_id, tg.c.complete))
    return {int(t): TensorGram(bd, dd, bs, None if p is None else np.frombuffer(p, "<f8").copy())
            for t, bd, dd, bs, p in rows}


def tensor_cross(conn: sa.Connection, checkpoint_id: str) -> dict[tuple[int, str], float]:
    """{(its tensor_idx, other checkpoint id): ⟨Δ, Δ_other⟩} for the experts ingested with this one."""
    tc = schema.tensor_cross
    rows = conn.execute(sa.select(tc.c.tensor_idx, tc.c.other_id, tc.c.dot).where(tc.c.checkpoint_id == checkpoint_id))
    return {(int(t), str(o)): float(d) for t, o, d in rows}
