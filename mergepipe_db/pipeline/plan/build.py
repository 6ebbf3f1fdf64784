"""Planner: choose the access set — which expert delta blocks to read — under an expert-read budget.

The ranking is SQL (`sql/plan_rank.sql`, one statement): score each candidate (expert, block) by c_k·‖Δ_k,b‖₂,
rank with deterministic tie-breaks (score, tensor order, block index, expert order) and keep the prefix whose
running cost fits the budget; the same statement returns the per-(tensor, expert) summary. Operators with a
joint sign election (ties, dare_ties) rank block rows instead, every expert's candidate of one (tensor, block)
as one unit (`sql/plan_rank_grouped.sql`). Planner and executor
use the same cost (stored bytes of the block), so budget soundness holds by construction: planned bytes ≤
budget, and the executor checks realized == planned.

Two shortcuts give the same plan without ranking every candidate: a budget that holds every candidate takes
them all (a tensor whose every block is a candidate as one whole-tensor read, `ranking.whole_tensors`; the
other tensors' blocks from `sql/plan_take_all.sql`), and a budgeted single-block plan ranks only the top of
each expert's ranking, found from the ranking summaries ingest keeps (`db/rank_tables.py`; `ranking.py` beside
this module, `sql/plan_rank_top.sql`).
Each checks its premise on the rows it reads and hands over to the full ranking when it fails.

TIES (density d < 1) never reads a block that provably trims to zero: from the summed block sketches of a
tensor the bin b_τ holding the trim threshold τ is known exactly, and a block whose max |Δ| lies in a lower bin
(``delta_max < bin_edges()[b_τ] <= τ``) is not a candidate (`ties_prune_bounds`; docs/SEMANTICS.md).
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections import defaultdict, deque
from collections.abc import Iterator
from dataclasses import replace
from itertools import repeat
from typing import Any

import numpy as np
import sqlalchemy as sa

from mergepipe_db.core import sketch
from mergepipe_db.core.dtypes import ARITHMETIC_DTYPES
from mergepipe_db.core.plan import ExpertPlan, Plan, Read, TensorInfo
from mergepipe_db.core.spec import MergeSpec
from mergepipe_db.db.checkpoints import load_checkpoint_info, load_checkpoint_infos, load_tensors, load_tensors_many
from mergepipe_db.db.fetch import fetch_columns, pylist
from mergepipe_db.db.rank_tables import tensor_sketches
from mergepipe_db.db.sql_files import sql_text
from mergepipe_db.errors import SpecError
from mergepipe_db.pipeline.plan import layout, ranking
from mergepipe_db.pipeline.plan.complete import complete_plan
from mergepipe_db.pipeline.plan.gram import gram_coefficients, layout_gram_coefficients, plans_from_gram
from mergepipe_db.sources import packed as blockstore
from mergepipe_db.sources import source_class

_EDGES = sketch.bin_edges()  # the smallest float32 of each sketch bin


# --- catalog reads ---------------------------------------------------------------------------------


def trim_bound(hist: np.ndarray, complete: bool, density: float, numel: int) -> float | None:
    """TIES: a value every block with ``delta_max`` below it provably trims to zero, or None (no pruning).

    k = int(d·numel) (the operator's k); τ = the k-th largest |Δ| lies in bin b_τ of the exact tensor
    histogram, so τ >= edges[b_τ], and for float32 x, ``x < edges[b_τ]`` iff bin(x) < b_τ (core/sketch.py): a block
    whose max |Δ| is below edges[b_τ] holds only |Δ| < τ. k == 0 means τ = +inf (everything trims). A tensor
    with values in the last bin (huge, inf or NaN) or an incomplete or inconsistent sketch is never pruned.
    """
    if not complete or int(hist.sum()) != numel or int(hist[sketch.LAST_BIN]) > 0:
        return None
    k = int(density * numel)
    if k <= 0:
        return math.inf
    b, _ = sketch.locate_kth_largest(hist, k)
    if b == sketch.ZERO_BIN:
        return None  # τ = 0 keeps everything
    return float(_EDGES[b])


def ties_prunable(e: ExpertPlan, op: Any, base_id: str) -> bool:
    """TIES trim (magnitude sparsification) at density < 1, for an expert whose block statistics are of the
    same Δ the executor forms (`ExpertSource.ties_prunable`: not a LoRA adapter), catalogued against this base."""
    return (getattr(op, "sparsification", None) == "magnitude" and not op.tensor_granular and e.density < 1
            and e.checkpoint.has_stats and source_class(e.checkpoint.kind).ties_prunable
            and e.checkpoint.base_id == base_id)


def ties_prune_bounds(conn: sa.Connection, experts: list[ExpertPlan], op: Any, base_id: str,
                      base_tensors: list[TensorInfo]) -> tuple[dict[tuple[int, int], float],
                                                                dict[int, dict[int, np.ndarray]]]:
    """TIES pruning bounds ``{(position, expert tensor_idx): bound}`` (a block with delta_max < bound is never
    a candidate, see `trim_bound`), and the tensor sketches loaded for them, ``{position: {base tensor_idx:
    histogram}}`` (`complete_plan` reuses them for partially selected tensors)."""
    bounds: dict[tuple[int, int], float] = {}
    loaded: dict[int, dict[int, np.ndarray]] = {}
    by_name = {t.name: t for t in base_tensors}
    for e in experts:
        if not ties_prunable(e, op, base_id):
            continue
        sketches = tensor_sketches(conn, e.checkpoint.id)
        mine: dict[int, np.ndarray] = {}
        for et in e.tensors.values():
            bt = by_name.get(et.name)
            if bt is None or et.dtype not in ARITHMETIC_DTYPES or et.idx not in sketches:
                continue
            hist, complete = sketches[et.idx]
            mine[bt.idx] = hist
            bound = trim_bound(hist, complete, e.density, math.prod(bt.shape))
            if bound is not None:
                bounds[(e.position, et.idx)] = bound
        loaded[e.position] = mine
    return bounds, loaded


# --- planning --------------------------------------------------------------------------------------


def load_experts(conn: sa.Connection, spec: MergeSpec, expert_ids: list[str]) -> tuple[list[ExpertPlan], Any]:
    """The experts of `spec` (in spec order) with their tensors, and the operator (for coefficients)."""
    from mergepipe_db.operators import ExpertParams, make_operator

    infos = load_checkpoint_infos(conn, expert_ids)
    tensors_of = load_tensors_many(conn, expert_ids)
    op = make_operator(
        spec.method,
        [ExpertParams(key=info.id, weight=m.weight, density=m.density, gamma=m.gamma, epsilon=m.epsilon)
         for info, m in zip(infos, spec.models)],
        normalize=spec.normalize, lam=spec.lam, t=spec.t, options=spec.options,
    )
    experts = []
    for pos, (info, m) in enumerate(zip(infos, spec.models)):
        tensors = {t.name: t for t in tensors_of[info.id]}
        experts.append(ExpertPlan(pos, info, m.weight, m.density, m.gamma, float(op.coefficient(pos)), tensors))
    return experts, op


def layout_experts(conn: sa.Connection, spec: MergeSpec, lay: layout.Layout
                   ) -> tuple[list[ExpertPlan], Any, dict[tuple[int, int], float], dict[int, Any]]:
    """The experts of a per-tensor layout, an operator (for its flags), each (position, output tensor)'s
    ranking coefficient from that tensor's own operator, and those operators by output tensor index."""
    from mergepipe_db.operators.by_name import expert_params, operator_from_params

    infos = load_checkpoint_infos(conn, lay.expert_ids)
    coef: dict[tuple[int, int], float] = {}
    op = None
    ops: dict[int, Any] = {}
    for idx, (mparams, gparams) in lay.params.items():
        t_op = operator_from_params(spec.method, [expert_params(i.id, p) for i, p in zip(infos, mparams)], gparams)
        ops[idx] = t_op
        op = op or t_op
        for pos in range(len(infos)):
            coef[(pos, idx)] = float(t_op.coefficient(pos))
    if op is None:
        raise SpecError(f"spec {spec.source}: the config has no tensor to merge")
    experts = [ExpertPlan(pos, info, 1.0, 1.0, 0.01,
                          max((abs(c) for (p, _i), c in coef.items() if p == pos), default=0.0),
                          lay.expert_tensors[pos]) for pos, info in enumerate(infos)]
    return experts, op, coef, ops



#: PostgreSQL settings for the rest of the planning transaction (`set_config(..., is_local => true)`, i.e. SET
#: LOCAL): the ranking sorts and keeps ~150 B per candidate, so the default 4 MB work_mem spills it to disk
#: from ~30k candidates on; JIT compilation of the ranking costs more than it saves (~0.1 s per plan); no
#: input of a planning join comes sorted, yet PostgreSQL's cost model picks a merge join to match the chosen
#: block rows with 10^6 candidates (plan_rank_grouped.sql), sorting all of them: 1.6 s, where hashing the
#: few chosen rows takes 0.15 s
_PG_PLAN_SETTINGS: tuple[tuple[str, str], ...] = (("work_mem", "256MB"), ("jit", "off"), ("enable_mergejoin", "off"))


def _prepare_ranking(conn: sa.Connection) -> None:
    """PostgreSQL: planner statistics for the freshly filled plan tables (without them it assumes ~1,700 rows
    each, estimates ~300 candidates, and hashes mp_block instead of them, in batches spilled to disk), and the
    transaction-local settings above. DuckDB needs neither."""
    if conn.dialect.name != "postgresql":
        return
    for name in ("mp_plan_expert", "mp_plan_tensor"):
        conn.execute(sa.text(f"ANALYZE {name}"))
    for name, value in _PG_PLAN_SETTINGS:
        conn.execute(sa.text("SELECT set_config(:name, :value, true)"), {"name": name, "value": value})


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off: a plan builds ~10^5 objects (rows, reads) that hold no cycles, and the
    collector's passes over them would cost as much as building them."""
    paused = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


def build_plan(
    conn: sa.Connection,
    spec: MergeSpec,
    *,
    base_id: str,
    expert_ids: list[str],
    budget_spec: Any,
) -> Plan:
    """Run the ranking SQL for `spec` over the catalog and return the access set within the budget."""
    with _collector_paused():
        return _build_plan(conn, spec, base_id=base_id, expert_ids=expert_ids, budget_spec=budget_spec)


def _build_plan(conn: sa.Connection, spec: MergeSpec, *, base_id: str, expert_ids: list[str], budget_spec: Any
                ) -> Plan:
    base = load_checkpoint_info(conn, base_id)
    out_dtype = spec.dtype or None  # non-arithmetic tensors are copied from the base in their own dtype
    lay = None
    if spec.config is not None:  # a MergeKit config resolved per output tensor (pipeline/plan/layout.py)
        lay = layout.build_layout(conn, spec, base_id, dict(zip([m.ref for m in spec.models], expert_ids))
                                  | ({spec.base: base_id} if spec.base else {}))
        base_tensors = lay.base_tensors
        experts, op, tensor_coef, tensor_ops = layout_experts(conn, spec, lay)
    else:
        base_tensors = load_tensors(conn, base_id)
        experts, op = load_experts(conn, spec, expert_ids)
        tensor_coef = None

    full_bytes = sum(e.tensors[t.name].nbytes for e in experts for t in base_tensors
                     if t.dtype in ARITHMETIC_DTYPES and t.name in e.tensors)  # delta/LoRA experts cover a subset
    budget_bytes = budget_spec.resolve(full_bytes)
    # the geometric methods: coefficients from the catalog's statistics, then planned by blocks (plan/gram.py)
    coefficients = None
    if plans_from_gram(op) and budget_bytes < full_bytes:
        coefficients = gram_coefficients(conn, op, base, base_tensors, experts) if lay is None else (
            layout_gram_coefficients(conn, lay, op, tensor_ops, base, experts))
    if coefficients is not None:
        op.tensor_granular = False
    bounds, sketch_cache = ties_prune_bounds(conn, experts, op, base.id, base_tensors) if lay is None else ({}, {})

    # The (expert, tensor) pairs to rank, with the base's tensor_idx matched by name here (never in SQL text);
    # a config's renumbered inputs (Δ not catalogued) are read whole, selected before the ranking
    base_idx = {t.name: t.idx for t in base_tensors}
    renumbered = lay.recipe.renumbered() if lay is not None else frozenset()
    fixed, fixed_bytes = renumbered_selection(experts, base_tensors, renumbered, budget_bytes)
    rank_budget = budget_bytes - fixed_bytes
    pt: tuple[list[Any], ...] = ([], [], [], [], [])
    for e in experts:
        for et in sorted(e.tensors.values(), key=lambda x: (x.idx, base_idx.get(x.name, -1))):
            if (et.dtype in ARITHMETIC_DTYPES and et.name in base_idx
                    and (e.position, base_idx[et.name]) not in renumbered):
                coef = None if tensor_coef is None else tensor_coef[(e.position, base_idx[et.name])]
                for col, v in zip(pt, (e.position, et.idx, base_idx[et.name], bounds.get((e.position, et.idx)),
                                       coef)):
                    col.append(v)
    tensor_level = [bool(op.tensor_granular or not e.checkpoint.has_stats) for e in experts]
    grouped = bool(getattr(op, "joint_election", False))
    assert not (grouped and op.additive)  # plan_rank_grouped.sql sums no bound terms
    packed = blockstore.packed_checkpoints(conn, [e.checkpoint.id for e in experts])
    take_all = budget_bytes >= full_bytes
    # the shortcuts rank from per-checkpoint summaries: not for per-tensor coefficients or renamed tensors
    top = None if take_all or grouped or bounds or any(tensor_level) or lay is not None else (
        ranking.top_of_ranking(conn, experts, pt[:4], budget_bytes, packed))
    # a budget that takes everything reads whole tensors where every block is a candidate: no row per block
    whole = ranking.whole_tensors(conn, experts, pt[:4], {t.idx: (t.n_blocks, t.rows_per_block) for t in base_tensors},
                                  tensor_level, packed) if take_all and lay is None else None
    for name in ("mp_plan_expert", "mp_plan_tensor"):
        conn.execute(sa.text(f"DROP TABLE IF EXISTS {name}"))
    conn.execute(sa.text(sql_text("plan_expert_table")))
    conn.execute(sa.text(sql_text("plan_tensor_table")))
    conn.execute(sa.text(sql_text("plan_expert_insert")), {
        "position": [e.position for e in experts], "checkpoint_id": [e.checkpoint.id for e in experts],
        "coef": [abs(e.coef) for e in experts], "tensor_level": tensor_level,
        "packed": [e.checkpoint.id in packed for e in experts],
        "score_floor": [None if top is None else top.floors[e.position] for e in experts]})
    _insert_plan_tensors(conn, pt, None if whole is None else whole.rest)
    _prepare_ranking(conn)
    selection = None
    if take_all:
        selection = ranking.take_all(conn, rank_budget - (whole.nbytes if whole else 0))
        if selection is not None and whole is not None:
            selection = ranking.merge_selections(whole.selection, selection)
        elif whole is not None:  # the rest does not fit beside them: rank every candidate, whole tensors too
            _insert_plan_tensors(conn, pt, [not r for r in whole.rest])
            _prepare_ranking(conn)
    elif top is not None:
        selection = top.rank(conn, rank_budget)
    pruned = None
    if selection is None and grouped:  # every block row ranked (sql/plan_rank_grouped.sql), pruned ones counted
        selection, pruned_cols = ranking.Selection.from_grouped_rows(fetch_columns(conn, conn.execute(
            sa.text(sql_text("plan_rank_grouped")), {"budget": rank_budget})))
        pruned = list(zip(*(pylist(pruned_cols[c]) for c in ("tensor_idx", "position", "n_blocks", "nbytes"))))
    elif selection is None:  # every candidate ranked (sql/plan_rank.sql)
        selection = ranking.Selection.from_rows(fetch_columns(conn, conn.execute(
            sa.text(sql_text("plan_rank")), {"budget": rank_budget})))
    if pruned is None:
        pruned = conn.execute(sa.text(sql_text("plan_pruned"))).all() if bounds else []
    for name in ("mp_plan_expert", "mp_plan_tensor"):
        conn.execute(sa.text(f"DROP TABLE IF EXISTS {name}"))
    if fixed is not None:
        selection = ranking.merge_selections(fixed, selection)

    access = _reads_by_key(selection.reads)

    # Per (tensor, expert), in tensor then expert order (the bound sums in that order).
    candidate_bytes = 0
    planned_bytes = 0
    e_planned, e_selected, e_pruned, e_blocks_pruned = ([0] * len(experts) for _ in range(4))
    full_selection: dict[tuple[int, int], bool] = {}
    bound_per_tensor: dict[int, float] = defaultdict(float)
    summary = zip(*(pylist(selection.summary[c]) for c in ranking.SUMMARY_COLUMNS))
    for tidx, pos, candidates, cbytes, selected, pbytes, omitted_score, omitted_unscored in summary:
        tidx, pos = int(tidx), int(pos)
        candidate_bytes += int(cbytes)
        planned_bytes += int(pbytes)
        e_planned[pos] += int(pbytes)
        e_selected[pos] += int(selected)
        full_selection[(pos, tidx)] = int(selected) == int(candidates)
        if int(omitted_unscored):
            bound_per_tensor[tidx] = math.inf
        else:
            bound_per_tensor[tidx] += float(omitted_score or 0.0)
    for _tidx, pos, n_blocks, nbytes in pruned:
        e_blocks_pruned[int(pos)] += int(n_blocks)
        e_pruned[int(pos)] += int(nbytes)
    experts = [replace(e, planned_bytes=e_planned[k], blocks_selected=e_selected[k], pruned_bytes=e_pruned[k],
                       blocks_pruned=e_blocks_pruned[k]) for k, e in enumerate(experts)]
    bound_total: float | None = math.fsum(bound_per_tensor.values()) if bound_per_tensor else 0.0
    per_tensor: dict[int, float] | None = dict(bound_per_tensor)
    if not op.additive:
        bound_total, per_tensor = None, None

    if coefficients is not None:  # recorded for the tensors some expert reads in part
        partial = {t.name for t in base_tensors if any(not full_selection.get((e.position, t.idx), True)
                                                       for e in experts)}
        coefficients = {name: c for name, c in coefficients.items() if name in partial}

    return complete_plan(
        conn, op, spec=spec, base=base, base_tensors=base_tensors, experts=experts, out_dtype=out_dtype,
        budget_bytes=budget_bytes, full_bytes=full_bytes, candidate_bytes=candidate_bytes,
        planned_bytes=planned_bytes, access=access, full_selection=full_selection, bound_per_tensor=per_tensor,
        bound_total=bound_total, sketch_cache=sketch_cache, packed_ids=packed,
        layout=None if lay is None else (lay.recipe, lay.params), coefficients=coefficients)


def renumbered_selection(experts: list[ExpertPlan], base_tensors: list[TensorInfo],
                         renumbered: frozenset[tuple[int, int]], budget: int) -> tuple[ranking.Selection | None, int]:
    """The whole-tensor reads of a config's renumbered inputs (`Recipe.renumbered`: an expert's source tensor
    is not θ₀'s, so the catalog holds no statistics of its Δ) and their bytes. They are taken first, before
    anything is ranked, in output tensor order then expert position, each one that fits in what is left of
    `budget` (its cost: the tensor's stored bytes, what a whole-tensor θ read counts); the others are omitted
    (Δ = 0, the expert equals θ₀ there) with an unscored omission (the tensor's bound is infinite). None when
    there is no such input."""
    pairs = []
    for t in base_tensors:
        if t.dtype not in ARITHMETIC_DTYPES:
            continue
        for e in experts:
            if (e.position, t.idx) in renumbered and t.name in e.tensors:
                pairs.append((t.idx, e.position, e.tensors[t.name]))
    if not pairs:
        return None, 0
    reads: dict[str, list[Any]] = {k: [] for k in ranking.READ_COLUMNS}
    summary: dict[str, list[Any]] = {k: [] for k in ranking.SUMMARY_COLUMNS}
    left = budget
    for tidx, pos, et in pairs:
        chosen = et.nbytes <= left
        if chosen:
            left -= et.nbytes
            for k, v in zip(ranking.READ_COLUMNS, (pos, tidx, -1, et.offset, et.nbytes, et.xxh3)):
                reads[k].append(v)
        for k, v in zip(ranking.SUMMARY_COLUMNS, (tidx, pos, et.n_blocks, et.nbytes, et.n_blocks if chosen else 0,
                                                  et.nbytes if chosen else 0, 0.0, 0 if chosen else 1)):
            summary[k].append(v)
    cols = {k: np.asarray(v, dtype=object if k == "xxh3" else np.int64) for k, v in reads.items()}
    sums = {k: np.asarray(v, dtype=np.float64 if k == "omitted_score" else np.int64) for k, v in summary.items()}
    return ranking.Selection(cols, sums), budget - left


def _insert_plan_tensors(conn: sa.Connection, pairs: tuple[list[Any], ...], keep: list[bool] | None) -> None:
    """Insert the plan's (expert, tensor) pairs into mp_plan_tensor: all of them, or those `keep` marks."""
    cols = pairs if keep is None else tuple([v for v, k in zip(col, keep) if k] for col in pairs)
    if cols[0]:
        conn.execute(sa.text(sql_text("plan_tensor_insert")), {
            "position": cols[0], "tensor_idx": cols[1], "base_idx": cols[2], "prune_below": cols[3],
            "coef": cols[4] if len(cols) > 4 else [None] * len(cols[0])})


def _reads_by_key(reads: dict[str, Any]) -> dict[tuple[int, int], tuple[Read, ...]]:
    """The selected reads (columns, sorted by tensor, expert, block) grouped into the access dict."""
    n = len(reads["position"])
    if n == 0:
        return {}
    pos = np.asarray(reads["position"], dtype=np.int64)
    tidx = np.asarray(reads["tensor_idx"], dtype=np.int64)
    cuts = (np.flatnonzero((pos[1:] != pos[:-1]) | (tidx[1:] != tidx[:-1])) + 1).tolist()
    pl, tl = pos.tolist(), tidx.tolist()
    columns = (pylist(reads[c]) for c in ("block_idx", "block_offset", "nbytes", "xxh3"))
    fields = _new_reads(n, *columns)
    return {(pl[s], tl[s]): tuple(fields[s:e]) for s, e in zip([0, *cuts], [*cuts, n])}


#: the slot descriptors of Read's fields, in field order
_READ_SLOTS = tuple(Read.__dict__[name] for name in Read.__slots__)


def _new_reads(n: int, *columns: list[Any]) -> list[Read]:
    """``list(map(Read, *columns))``, a field at a time: the slots are set with their descriptors (no
    frozen-dataclass ``__init__`` per read, which takes ~2/3 of the time at 10^5 reads), with the cyclic
    garbage collector paused (reads hold no cycles; its passes over a large heap cost as much again)."""
    with _collector_paused():
        reads = list(map(object.__new__, repeat(Read, n)))
        for slot, values in zip(_READ_SLOTS, columns, strict=True):
            deque(map(slot.__set__, reads, values), maxlen=0)
    return reads
