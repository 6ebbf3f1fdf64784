"""Coefficients of the geometric methods (slerp, model_stock, nuslerp, multislerp, karcher) from the catalog's
inner-product statistics (mp_tensor_gram), before any expert byte is read: the planner hook that lets them be
planned by blocks under a budget (docs/SEMANTICS.md, "Inner-product statistics").

Per tensor, the Gram matrix of [θ₀, Δ_1 … Δ_K] is assembled from ‖θ₀‖² (the base's row), ⟨θ₀, Δ_k⟩ and ‖Δ_k‖²
(exact sums taken at ingest) and ⟨Δ_i, Δ_j⟩: exact where the two experts were ingested together (mp_tensor_cross),
else ⟨proj_i, proj_j⟩ (count sketches: exact for tensors of at most `GRAM_DIM` elements, an unbiased estimate
otherwise); the operator turns it into (a₀, c_k)
(`coefficients_from_gram`). The plan and the manifest carry them, so replay needs nothing else."""

from __future__ import annotations

from typing import Any

import numpy as np
import sqlalchemy as sa

from mergepipe_db.core.dtypes import ARITHMETIC_DTYPES
from mergepipe_db.core.plan import CheckpointInfo, ExpertPlan, TensorInfo
from mergepipe_db.db.gram import tensor_cross, tensor_gram

__all__ = ["gram_coefficients", "plans_from_gram"]


def plans_from_gram(op: Any) -> bool:
    """Whether `op` is a geometric method that a partial read plans from the catalog's statistics."""
    return bool(getattr(op, "plans_from_gram", False))


def gram_matrices(conn: sa.Connection, base: CheckpointInfo, base_tensors: list[TensorInfo],
                  experts: list[ExpertPlan]) -> dict[str, np.ndarray] | None:
    """The estimated Gram matrix of every arithmetic tensor, by name; None when some checkpoint lacks the
    statistics (catalogued before them, a delta checkpoint without ⟨θ₀, Δ⟩, a LoRA adapter, a snapshot) or is
    not catalogued against this base."""
    if any(e.checkpoint.base_id != base.id for e in experts):
        return None
    base_rows = tensor_gram(conn, base.id)
    rows = [tensor_gram(conn, e.checkpoint.id) for e in experts]
    exact = [tensor_cross(conn, e.checkpoint.id) for e in experts]
    out: dict[str, np.ndarray] = {}
    for t in base_tensors:
        if t.dtype not in ARITHMETIC_DTYPES:
            continue
        b = base_rows.get(t.idx)
        if b is None or b.base_sq is None:
            return None
        stats = []
        for e, r in zip(experts, rows):
            et = e.tensors.get(t.name)
            g = None if et is None else r.get(et.idx)
            if et is not None and (g is None or g.base_dot is None or g.delta_sq is None or g.proj is None):
                return None
            stats.append(g)  # None: the expert does not cover this tensor (Δ = 0)
        k = len(experts)
        m = np.zeros((k + 1, k + 1))
        m[0, 0] = b.base_sq
        for i, gi in enumerate(stats):
            if gi is None:
                continue
            m[0, i + 1] = m[i + 1, 0] = gi.base_dot
            m[i + 1, i + 1] = gi.delta_sq
            for j in range(i + 1, k):
                gj = stats[j]
                if gj is not None:
                    dot = exact[i].get((experts[i].tensors[t.name].idx, experts[j].checkpoint.id))
                    m[i + 1, j + 1] = m[j + 1, i + 1] = float(gi.proj @ gj.proj) if dot is None else dot
        out[t.name] = m
    return out


def gram_coefficients(conn: sa.Connection, op: Any, base: CheckpointInfo, base_tensors: list[TensorInfo],
                      experts: list[ExpertPlan]) -> dict[str, list[Any]] | None:
    """{tensor name: [a₀, [c_1 … c_K]]} from the statistics (`gram_matrices`), or None where they are missing.
    Raises what the operator raises for a degenerate tensor (multislerp's zero mean), before reading."""
    grams = gram_matrices(conn, base, base_tensors, experts)
    if grams is None:
        return None
    out: dict[str, list[Any]] = {}
    for name, g in grams.items():
        a0, c = op.coefficients_from_gram(g)
        out[name] = [a0, c]
    return out
