"""The last step of planning, shared by planned and replayed plans: every field computed, then the frozen `Plan`.

Each expert gets its source (`sources.sources_for`: packed, delta, LoRA or full), which fixes the reads the plan
records — a packed block costs its compressed length, a tensor-level LoRA selection is one whole-tensor read —
so both kinds of plan cost the same bytes; then the sketches partial reads need, the dtype check and the plan hash.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import sqlalchemy as sa

from mergepipe_db.core.dtypes import ARITHMETIC_DTYPES
from mergepipe_db.core.plan import CheckpointInfo, ExpertPlan, Plan, Read, TensorInfo, compute_plan_hash
from mergepipe_db.core.spec import MergeSpec
from mergepipe_db.db.rank_tables import tensor_sketches
from mergepipe_db.errors import UnsupportedDtypeError
from mergepipe_db.sources import sources_for


def complete_plan(
    conn: sa.Connection,
    op: Any,
    *,
    spec: MergeSpec,
    base: CheckpointInfo,
    base_tensors: list[TensorInfo],
    experts: list[ExpertPlan],
    out_dtype: str | None,
    budget_bytes: int,
    full_bytes: int,
    candidate_bytes: int,
    planned_bytes: int,
    access: dict[tuple[int, int], tuple[Read, ...]],
    full_selection: dict[tuple[int, int], bool],
    bound_per_tensor: dict[int, float] | None,
    bound_total: float | None,
    sketch_cache: dict[int, dict[int, np.ndarray]] | None = None,
    packed_ids: set[str] | None = None,
    layout: tuple[Any, Any] | None = None,
    coefficients: dict[str, Any] | None = None,
) -> Plan:
    """The plan these fields describe, with its sources, source costs, sketches and hash (`access` is taken
    over: its reads are replaced by those the sources plan).

    `sketch_cache`: tensor sketches already loaded (`ties_prune_bounds`), by position and base tensor_idx;
    `packed_ids`: the experts with blocks in the packed store, where the caller has queried them; `layout`: the
    (recipe, per-tensor parameters) of a config resolved per tensor (`pipeline/plan/layout.py`);
    `coefficients`: a geometric method's coefficients from catalog statistics, by tensor name (`plan/gram.py`)."""
    sources = sources_for(conn, [e.checkpoint for e in experts], packed_ids)
    if any(s.adjusts_reads for s in sources):  # packed costs, LoRA whole-tensor reads: bytes counted from reads
        by_idx = {t.idx: t for t in base_tensors}
        for key, reads in list(access.items()):
            src = sources[key[0]]
            if src.adjusts_reads:
                access[key] = src.planned(experts[key[0]].tensors[by_idx[key[1]].name], reads)
        per_expert = [0] * len(experts)
        for (pos, _tidx), reads in access.items():
            per_expert[pos] += sum(r.nbytes for r in reads)
        experts = [replace(e, planned_bytes=per_expert[e.position]) for e in experts]
        planned_bytes = sum(per_expert)
    # a renumbered input's Δ is not the one the catalog's sketches describe (`Recipe.renumbered`): none for it
    renumbered = layout[0].renumbered() if layout is not None else frozenset()
    sketches = {k: v for k, v in _partial_sketches(conn, op, experts, base_tensors, full_selection,
                                                    sketch_cache).items() if k not in renumbered}
    for t in base_tensors:
        if t.dtype not in ARITHMETIC_DTYPES and any((e.position, t.idx) in access for e in experts):
            raise UnsupportedDtypeError(f"tensor {t.name!r} has dtype {t.dtype}, which cannot be merged")
    return Plan(
        spec=spec, base=base, base_tensors=base_tensors, experts=experts, out_dtype=out_dtype,
        budget_bytes=budget_bytes, full_bytes=full_bytes, candidate_bytes=candidate_bytes,
        planned_bytes=planned_bytes, access=access, full_selection=full_selection,
        bound_per_tensor=bound_per_tensor, bound_total=bound_total,
        plan_hash=compute_plan_hash(spec, out_dtype, base.id, experts, budget_bytes, access, base_tensors,
                                    recipe=None if layout is None else layout[0]),
        sketches=sketches, sources=sources,
        recipe=None if layout is None else layout[0], tensor_params=None if layout is None else layout[1],
        pruned_bytes=sum(e.pruned_bytes for e in experts), pruned_blocks=sum(e.blocks_pruned for e in experts),
        coefficients=coefficients or {},
    )


def _partial_sketches(conn: sa.Connection, op: Any, experts: list[ExpertPlan], base_tensors: list[TensorInfo],
                      full_selection: dict[tuple[int, int], bool],
                      sketch_cache: dict[int, dict[int, np.ndarray]] | None) -> dict[tuple[int, int], Any]:
    """The tensor sketches the operator needs, by (position, base tensor_idx): partial reads take their
    thresholds from them; TIES also uses them on full reads, to find τ's bin without a histogram pass
    (`operators.sign_consensus.TiesFold._exact_tau_fast`)."""
    sketches: dict[tuple[int, int], Any] = {}
    if not op.needs_full_tensor_stats:
        return sketches
    base_idx_by_name = {t.name: t.idx for t in base_tensors}
    every = op.sparsification == "magnitude"
    for e in experts:
        partial = [tidx for (pos, tidx), full in full_selection.items() if pos == e.position and (every or not full)]
        if partial and e.checkpoint.has_stats:
            sk = (sketch_cache or {}).get(e.position)
            if sk is None:
                sk = _load_sketches(conn, e, base_idx_by_name)
            for tidx in partial:
                if tidx in sk:
                    sketches[(e.position, tidx)] = sk[tidx]
    return sketches


def _load_sketches(conn: sa.Connection, expert: ExpertPlan, base_idx_by_name: dict[str, int]) -> dict[int, Any]:
    """Tensor-level |Δ| histograms of one expert (sum of its block sketches), by base tensor_idx."""
    by_idx: dict[int, list[str]] = {}
    for t in expert.tensors.values():  # a source tensor may serve several output tensors (a config's layout)
        by_idx.setdefault(t.idx, []).append(t.name)
    out: dict[int, Any] = {}
    for tidx, (h, _complete) in tensor_sketches(conn, expert.checkpoint.id).items():
        for name in by_idx.get(tidx, ()):
            if name in base_idx_by_name:
                out[base_idx_by_name[name]] = h
    return out
