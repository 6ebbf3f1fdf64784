"""Coefficients of the geometric methods (slerp, model_stock, nuslerp, multislerp, karcher) from the catalog's
inner-product statistics (mp_tensor_gram), before any expert byte is read: the planner hook that lets them be
planned by blocks under a budget (docs/SEMANTICS.md, "Inner-product statistics").

Per tensor, the Gram matrix of [θ₀, Δ_1 … Δ_K] is assembled from ‖θ₀‖² (the base's row), ⟨θ₀, Δ_k⟩ and ‖Δ_k‖²
(exact sums taken at ingest) and ⟨Δ_i, Δ_j⟩: exact where the two experts were ingested together (mp_tensor_cross),
else ⟨proj_i, proj_j⟩ (count sketches: exact for tensors of at most `GRAM_DIM` elements, an unbiased estimate
otherwise); the operator turns it into (a₀, c_k)
(`coefficients_from_gram`). The plan and the manifest carry them, so replay needs nothing else."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import sqlalchemy as sa

from mergepipe_db.core.dtypes import ARITHMETIC_DTYPES
from mergepipe_db.core.plan import CheckpointInfo, ExpertPlan, TensorInfo
from mergepipe_db.db.checkpoints import load_tensors
from mergepipe_db.db.gram import tensor_cross, tensor_gram

__all__ = ["gram_coefficients", "layout_gram_coefficients", "plans_from_gram"]


def plans_from_gram(op: Any) -> bool:
    """Whether `op` is a geometric method that a partial read plans from the catalog's statistics."""
    return bool(getattr(op, "plans_from_gram", False))


def gram_matrices(conn: sa.Connection, base: CheckpointInfo, base_tensors: list[TensorInfo],
                  experts: list[ExpertPlan], base_idx: Mapping[str, int] | None = None
                  ) -> dict[str, np.ndarray] | None:
    """The estimated Gram matrix of every arithmetic tensor, by name; None when some checkpoint lacks the
    statistics (catalogued before them, a delta checkpoint without ⟨θ₀, Δ⟩, a LoRA adapter, a snapshot) or is
    not catalogued against this base. `base_idx`: the base's catalog index of each tensor, by name, where
    `base_tensors` are a config's output tensors (their `idx` is the output index); else their own `idx`."""
    if any(e.checkpoint.base_id != base.id for e in experts):
        return None
    base_rows = tensor_gram(conn, base.id)
    rows = [tensor_gram(conn, e.checkpoint.id) for e in experts]
    exact = [tensor_cross(conn, e.checkpoint.id) for e in experts]
    out: dict[str, np.ndarray] = {}
    for t in base_tensors:
        if t.dtype not in ARITHMETIC_DTYPES:
            continue
        b = base_rows.get(t.idx if base_idx is None else base_idx[t.name])
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
                      experts: list[ExpertPlan], *, ops: Mapping[str, Any] | None = None,
                      base_idx: Mapping[str, int] | None = None) -> dict[str, list[Any]] | None:
    """{tensor name: [a₀, [c_1 … c_K]]} from the statistics (`gram_matrices`), or None where they are missing.
    `ops`: each tensor's own operator, by name (a config resolved per tensor: its t, weights), else `op` for all.
    Raises what the operator raises for a degenerate tensor (multislerp's zero mean), before reading."""
    grams = gram_matrices(conn, base, base_tensors, experts, base_idx)
    if grams is None:
        return None
    out: dict[str, list[Any]] = {}
    for name, g in grams.items():
        a0, c = (op if ops is None else ops[name]).coefficients_from_gram(g)
        out[name] = [a0, c]
    return out


def layout_gram_coefficients(conn: sa.Connection, lay: Any, op: Any, ops: dict[int, Any],
                             base: CheckpointInfo, experts: list[ExpertPlan]) -> dict[str, list[Any]] | None:
    """A config's geometric coefficients from the catalog's statistics, each output tensor's
    from its own operator (its resolved t or weights) and the statistics of its source tensors (θ₀: the base's
    tensor of the slice's layer); None unless every tensor's operator plans from them and reads θ₀ from the
    base."""
    if not all(plans_from_gram(o) for o in ops.values()) or any(r.base[0] != lay.recipe.base
                                                                 for r in lay.recipe.tensors):
        return None
    src = {t.name: t.idx for t in load_tensors(conn, base.id)}
    base_idx = {r.name: src[r.base[1]] for r in lay.recipe.tensors}
    return gram_coefficients(conn, op, base, lay.base_tensors, experts,
                             ops={t.name: ops[t.idx] for t in lay.base_tensors if t.idx in ops}, base_idx=base_idx)
