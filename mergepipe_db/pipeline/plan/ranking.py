"""Ranking summaries: what the planner needs to rank an expert's blocks without scanning all of them.

A budgeted plan keeps the prefix of the ranking (score = c_k·‖Δ_k,b‖₂ descending) whose running cost fits the
budget B. Any score threshold T whose candidate set C(T) = {score >= T} holds more than B bytes contains that
whole prefix, and running costs over C(T) equal those over all candidates (C(T) is itself a prefix of the
ranking). So a plan only has to read and sort C(T), through an index range on mp_block(checkpoint_id,
delta_l2) per expert, once T is known: that is what these summaries give, per checkpoint, written from its
blocks in the transaction that inserts them (ingest, snapshot commit; migration 0003 for older catalogs):

- mp_rank_bucket: the scored candidates in log-scale buckets of delta_l2, with their bytes and the smallest
  delta_l2 of each. Every block of bucket (k, j) scores at least v = c_k·min_l2 (float multiplication by
  c_k >= 0 is monotone), so taking buckets in descending v until their bytes exceed B gives a T with
  bytes(C(T)) > B (`threshold`). The planner checks that on the rows it reads and ranks every candidate
  instead when it does not hold.
- mp_rank_tensor: per tensor, the candidates, their bytes, the unscored ones and the sum of delta_l2, from
  which the per-(tensor, expert) plan summary (candidate counts, omitted-update bound) follows without
  reading the omitted blocks.

mp_tensor_sketch holds, per tensor, the sum of its block sketches (`core/sketch.py`): TIES takes its trim
threshold's bin from it, without decoding a sketch per block (10^6 of them hold ~250 MB).

Blocks are also inserted in descending delta_l2 order (`in_rank_order`), so the top of a checkpoint's ranking
is a contiguous run of rows: few heap pages on PostgreSQL, few row groups (zone maps) on DuckDB.

Every way of ranking hands the planner a `Selection`: the top of the ranking (`TopOfRanking`), every candidate
taken when the budget holds them all (`take_all`), or every candidate ranked (sql/plan_rank.sql, read by
`Selection.from_rows`; block rows for operators with a joint sign election, sql/plan_rank_grouped.sql, read by
`Selection.from_grouped_rows`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import sqlalchemy as sa

from mergepipe_db.db import schema
from mergepipe_db.db.fetch import fetch_columns
from mergepipe_db.db.sql_files import sql_text
from mergepipe_db.sources import source_class

if TYPE_CHECKING:
    from mergepipe_db.core.plan import ExpertPlan

#: a bound a few ulps below T / c_k: every delta_l2 with fl(c_k · delta_l2) >= T is at least this (the
#: two roundings move the quotient by at most 2 ulps; see `index_floor`)
_FLOOR_MARGIN = 1.0 - 2.0 ** -48
#: T must be a normal number well inside float range for that margin to hold
_T_MIN, _T_MAX = 1e-280, 1e280


def threshold(lower: np.ndarray, nbytes: np.ndarray, budget: int) -> float | None:
    """The score threshold T of a budgeted plan, from every bucket of every expert: `lower` = c_k · min_l2 (a
    lower bound on its scores), `nbytes` its bytes. T is the largest lower bound at which the buckets at or above
    it hold more than `budget` bytes, so bytes(C(T)) > budget. None when there is none (everything scored fits),
    or when T is not a positive normal number well inside float range (NaN, inf, zero, subnormal, or a zero
    coefficient): the planner then ranks every candidate."""
    special = ~np.isfinite(lower)  # NaN and inf lower bounds: those buckets rank first
    order = np.argsort(np.where(special, -np.inf, -lower), kind="stable")
    running = np.cumsum(nbytes[order])
    over = int(np.searchsorted(running, budget, side="right"))  # the first bucket past the budget
    if over == len(order):
        return None
    t = float(lower[order[over]])
    return t if _T_MIN <= t <= _T_MAX else None


def index_floor(t: float, coef: float) -> float:
    """A lower bound on every delta_l2 with fl(coef · delta_l2) >= t (for `threshold`'s t and coef > 0 with t /
    coef normal): fl(coef·x) >= t gives x >= t / (coef·(1 + u)), and fl(t / coef) <= (t / coef)·(1 + u), so x >=
    fl(t / coef)·(1 − 2u) > fl(t / coef)·(1 − 2^-48) with u = 2^-53."""
    return (t / coef) * _FLOOR_MARGIN


READ_COLUMNS = ("position", "tensor_idx", "block_idx", "block_offset", "nbytes", "xxh3")
SUMMARY_COLUMNS = ("tensor_idx", "position", "n_blocks", "nbytes", "n_selected", "selected_bytes", "omitted_score",
                   "omitted_unscored")


@dataclass
class Selection:
    """What a ranking gives the planner, as columns (sequences of equal length): the selected reads
    (`READ_COLUMNS`, sorted by base tensor_idx, position, block_idx) and, per (tensor, expert) with candidates,
    the summary (`SUMMARY_COLUMNS`, sorted by tensor_idx, position): candidates and their bytes, how many of
    them are selected and their bytes, and the omitted-update bound terms."""

    reads: dict[str, Any]
    summary: dict[str, Any]

    @classmethod
    def from_rows(cls, cols: dict[str, Any]) -> Selection:
        """From the rows of sql/plan_rank.sql: kind 0 (reads), then kind 1 (summary)."""
        n = int(np.searchsorted(np.asarray(cols["kind"], dtype=np.int64), 1))
        return cls({k: cols[k][:n] for k in READ_COLUMNS}, {k: cols[k][n:] for k in SUMMARY_COLUMNS})

    @classmethod
    def from_grouped_rows(cls, cols: dict[str, Any]) -> tuple[Selection, dict[str, np.ndarray]]:
        """From the rows of sql/plan_rank_grouped.sql: the selection, and the pruned candidates per (tensor,
        expert) (columns tensor_idx, position, n_blocks, nbytes). The summary's selected counts and bytes are
        those of the reads of each (tensor, expert); its bound terms are zero (block-row operators are not
        additive: the planner computes no bound for them)."""
        kind = np.asarray(cols["kind"], dtype=np.int64)
        n_reads, n_ranked = (int(v) for v in np.searchsorted(kind, [1, 2]))
        reads, _rows = _sorted_reads({k: cols[k][:n_reads] for k in READ_COLUMNS})

        def pairs(lo: int, hi: int) -> dict[str, np.ndarray]:
            return {k: np.asarray(cols[k][lo:hi], dtype=np.int64) for k in ("tensor_idx", "position", "n_blocks",
                                                                              "nbytes")}

        ranked, pruned = pairs(n_reads, n_ranked), pairs(n_ranked, kind.size)
        # each read's (tensor, expert) row of the summary: both are sorted by tensor_idx, position
        n_pos = int(max(ranked["position"].max(initial=-1), reads["position"].max(initial=-1))) + 1
        keys = ranked["tensor_idx"] * n_pos + ranked["position"]
        row = np.searchsorted(keys, reads["tensor_idx"] * n_pos + reads["position"])
        m = keys.size
        selected_bytes = np.zeros(m, np.int64)
        np.add.at(selected_bytes, row, reads["nbytes"])
        summary = {**ranked, "n_selected": np.bincount(row, minlength=m).astype(np.int64),
                   "selected_bytes": selected_bytes, "omitted_score": np.zeros(m),
                   "omitted_unscored": np.zeros(m, np.int64)}
        return cls(reads, summary), pruned


def _sorted_reads(cols: dict[str, Any], rows: np.ndarray | None = None
                  ) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """The read columns of `rows` (indices into `cols`; None: all of them) sorted by tensor_idx, position,
    block_idx, and the rows in that order (None: all, in the order given, which was sorted)."""
    out = {k: np.asarray(cols[k], dtype=np.int64) for k in READ_COLUMNS if k != "xxh3"}
    xxh3 = np.asarray(cols["xxh3"], dtype=object)
    if rows is not None:
        out = {k: v[rows] for k, v in out.items()}
    key = (out["block_idx"], out["position"], out["tensor_idx"])
    if _ascending(*key):
        out["xxh3"] = xxh3 if rows is None else xxh3[rows]
        return out, rows
    order = np.lexsort(key)
    rows = order if rows is None else rows[order]
    out = {k: v[order] for k, v in out.items()}
    out["xxh3"] = xxh3[rows]
    return out, rows


def _ascending(block: np.ndarray, position: np.ndarray, tensor: np.ndarray) -> bool:
    """Whether rows are already sorted by (tensor, position, block) (a database that sorted them)."""
    if tensor.size < 2:
        return True
    dt, dp, db = np.diff(tensor), np.diff(position), np.diff(block)
    return bool(np.all((dt > 0) | ((dt == 0) & ((dp > 0) | ((dp == 0) & (db >= 0))))))


def take_all(conn: sa.Connection, budget: int) -> Selection | None:
    """Every candidate selected (sql/plan_take_all.sql), as sql/plan_rank.sql selects them for a budget that holds
    all of them, without ranking; None when their read cost exceeds `budget` (LoRA factors, which cost more than
    the rows they make): then the planner ranks every candidate."""
    cols = fetch_columns(conn, conn.execute(sa.text(sql_text("plan_take_all"))))
    reads, _rows = _sorted_reads(cols)
    if int(reads["nbytes"].sum()) > budget:
        return None
    t, p = reads["tensor_idx"], reads["position"]
    starts = np.flatnonzero(np.r_[True, (t[1:] != t[:-1]) | (p[1:] != p[:-1])]) if t.size else np.empty(0, np.int64)
    counts = np.diff(np.r_[starts, t.size])
    nbytes = np.add.reduceat(reads["nbytes"], starts) if t.size else np.empty(0, np.int64)
    summary = {"tensor_idx": t[starts], "position": p[starts], "n_blocks": counts, "nbytes": nbytes,
               "n_selected": counts, "selected_bytes": nbytes, "omitted_score": np.zeros(starts.size),
               "omitted_unscored": np.zeros(starts.size, np.int64)}
    return Selection(reads, summary)


def merge_selections(a: Selection, b: Selection) -> Selection:
    """One selection holding the reads and summary rows of both (disjoint (tensor, expert) pairs), sorted."""
    def joined(x: dict[str, Any], y: dict[str, Any], keys: tuple[str, ...], order: tuple[str, ...]
               ) -> dict[str, Any]:
        cols = {k: np.concatenate([x[k], y[k]]) for k in keys}  # numpy columns (`_sorted_reads`, `take_all`)
        rows = np.lexsort(tuple(cols[k] for k in reversed(order)))
        return {k: v[rows] for k, v in cols.items()}

    return Selection(joined(a.reads, b.reads, READ_COLUMNS, ("tensor_idx", "position", "block_idx")),
                     joined(a.summary, b.summary, SUMMARY_COLUMNS, ("tensor_idx", "position")))


@dataclass
class WholeTensors:
    """The (tensor, expert) pairs of a take-all plan whose every block is a candidate, each read as its whole
    tensor (one read unit, block_idx -1), and `rest`: per plan pair, whether it is still read block by block."""

    selection: Selection
    nbytes: int
    rest: list[bool]


def whole_tensors(conn: sa.Connection, experts: list[ExpertPlan], pairs: tuple[list[Any], ...],
                  base_blocks: dict[int, tuple[int, int]], tensor_level: list[bool], packed: set[str]
                  ) -> WholeTensors | None:
    """The pairs of a budget that takes every candidate which need no block rows: every block of the expert's
    tensor is a candidate (mp_rank_tensor: candidates == n_blocks, their bytes == the tensor's), nothing is
    pruned, and the expert's blocks are the base's (`base_blocks`: base tensor_idx -> (n_blocks,
    rows_per_block)). Taking every block of such a tensor reads exactly its bytes, so the plan reads them as
    one whole-tensor unit: the access mask, plan hash, bytes and summary are those of its block reads, without
    fetching (PostgreSQL) or building (Python) a row per block. Experts of another kind (LoRA factor units),
    planned at tensor level, or with packed blocks (`packed`: the checkpoints with blocks in the store, costed
    by compressed length) keep their block rows. None when no pair qualifies."""
    by_pos = {e.position: e for e in experts
              if not tensor_level[e.position] and e.checkpoint.has_stats
              and source_class(e.checkpoint.kind).ranked_by_block}
    ids = sorted({e.checkpoint.id for e in by_pos.values()})
    if not ids:
        return None
    rt = schema.rank_tensor
    summaries = {(cid, int(t)): (int(n), int(nb)) for cid, t, n, nb in conn.execute(
        sa.select(rt.c.checkpoint_id, rt.c.tensor_idx, rt.c.candidates, rt.c.candidate_bytes)
        .where(rt.c.checkpoint_id.in_(sorted(set(ids) - packed))))}
    tensors = {pos: {t.idx: t for t in e.tensors.values()} for pos, e in by_pos.items()}
    reads: dict[str, list[Any]] = {k: [] for k in READ_COLUMNS}
    counts, sizes, rest = [], [], []
    for pos, et_idx, bt_idx, prune_below in zip(*pairs[:4]):
        e = by_pos.get(pos)
        found = None if e is None or prune_below is not None else summaries.get((e.checkpoint.id, et_idx))
        et = tensors[pos][et_idx] if found is not None else None
        if et is None or found != (et.n_blocks, et.nbytes) or base_blocks.get(bt_idx) != (et.n_blocks,
                                                                                           et.rows_per_block):
            rest.append(True)
            continue
        rest.append(False)
        for k, v in zip(READ_COLUMNS, (pos, bt_idx, -1, et.offset, et.nbytes, et.xxh3)):
            reads[k].append(v)
        counts.append(et.n_blocks)
        sizes.append(et.nbytes)
    if all(rest):
        return None
    n = len(counts)
    cols = {k: np.asarray(v, dtype=object if k == "xxh3" else np.int64) for k, v in reads.items()}
    order = np.lexsort((cols["position"], cols["tensor_idx"]))
    cols = {k: v[order] for k, v in cols.items()}
    c, s = np.asarray(counts, np.int64)[order], np.asarray(sizes, np.int64)[order]
    summary = {"tensor_idx": cols["tensor_idx"], "position": cols["position"], "n_blocks": c, "nbytes": s,
               "n_selected": c, "selected_bytes": s, "omitted_score": np.zeros(n),
               "omitted_unscored": np.zeros(n, np.int64)}
    return WholeTensors(Selection(cols, summary), int(s.sum()), rest)


@dataclass
class TopOfRanking:
    """A budgeted single-block plan read from the top of each expert's ranking: the threshold T (more than the
    budget's bytes score at least T), each expert's index floor, and the summaries of the plan's (tensor,
    expert) pairs with candidates, sorted by base tensor_idx then position."""

    threshold: float
    floors: dict[int, float]  # position -> lower bound on the delta_l2 of its candidates scoring >= T
    n_positions: int
    pair_tensor: np.ndarray  # base tensor_idx of each summarized pair
    pair_position: np.ndarray
    candidates: np.ndarray
    candidate_bytes: np.ndarray
    unscored: np.ndarray
    full_score: np.ndarray  # c_k · Σ delta_l2 over the pair's scored candidates

    def rank(self, conn: sa.Connection, budget: int) -> Selection | None:
        """The selection from the top of the ranking (sql/plan_rank_top.sql); None when the top holds no more
        than `budget` bytes or reads a pair without a summary (summaries that disagree with the blocks): then
        the planner ranks every candidate."""
        cols = fetch_columns(conn, conn.execute(sa.text(sql_text("plan_rank_top")),
                                                {"threshold": self.threshold, "budget": budget}))
        running = np.asarray(cols["running_cost"], dtype=np.int64)
        sel = np.flatnonzero(running <= budget)
        if sel.size == running.size:  # no candidate past the budget: C holds no more than it
            return None
        reads, rows = _sorted_reads(cols, sel)
        score = np.asarray(cols["score"], dtype=np.float64)[rows]

        # the reads' pair (a row of the summary), and per pair: reads, their bytes, the sum of their scores
        keys = self.pair_tensor * self.n_positions + self.pair_position
        mine = reads["tensor_idx"] * self.n_positions + reads["position"]
        pair = np.searchsorted(keys, mine)
        if pair.size and (pair.max() >= keys.size or not np.array_equal(keys[pair], mine)):
            return None
        m = keys.size
        n_sel = np.bincount(pair, minlength=m)
        sel_bytes = np.zeros(m, np.int64)
        np.add.at(sel_bytes, pair, reads["nbytes"])
        sel_score = np.bincount(pair, weights=score, minlength=m)
        # the sum over the omitted scored candidates, Σ c·delta_l2 − Σ selected scores (to rounding); zero where
        # every scored candidate is read
        omitted = np.where(n_sel < self.candidates - self.unscored,
                           np.maximum(0.0, self.full_score - sel_score), 0.0)
        summary = {"tensor_idx": self.pair_tensor, "position": self.pair_position, "n_blocks": self.candidates,
                   "nbytes": self.candidate_bytes, "n_selected": n_sel, "selected_bytes": sel_bytes,
                   "omitted_score": omitted, "omitted_unscored": self.unscored}
        return Selection(reads, summary)


def top_of_ranking(conn: sa.Connection, experts: list[ExpertPlan], pairs: tuple[list[Any], ...], budget: int,
                   packed: set[str]) -> TopOfRanking | None:
    """The top-of-ranking plan for single-block ranking of `experts` (`pairs`: the plan's (position, expert
    tensor_idx, base tensor_idx) columns), or None where it does not apply: an expert of another kind (LoRA:
    factor units) or with packed blocks (in `packed`: their costs are compressed lengths), a coefficient that is not a
    positive number, a tensor with scored candidates outside the plan (its buckets would count), no summaries,
    or no threshold (everything scored fits the budget)."""
    if any(not source_class(e.checkpoint.kind).ranked_by_block or not 0 < abs(e.coef) < math.inf for e in experts):
        return None
    ids = sorted({e.checkpoint.id for e in experts})
    rt, rb = schema.rank_tensor, schema.rank_bucket
    if packed & set(ids):
        return None
    tensors: dict[str, list[Any]] = defaultdict(list)
    for row in conn.execute(sa.select(rt.c.checkpoint_id, rt.c.tensor_idx, rt.c.candidates, rt.c.candidate_bytes,
                                      rt.c.unscored, rt.c.l2_sum).where(rt.c.checkpoint_id.in_(ids))):
        tensors[row[0]].append(row[1:])
    b = fetch_columns(conn, conn.execute(sa.select(rb.c.checkpoint_id, rb.c.nbytes, rb.c.min_l2)
                                         .where(rb.c.checkpoint_id.in_(ids))))
    bucket_owner = np.asarray(b["checkpoint_id"], dtype=object)
    bucket_bytes = np.asarray(b["nbytes"], dtype=np.int64)
    bucket_min = np.asarray(b["min_l2"], dtype=np.float64)

    base_idx = {(p, et): bt for p, et, bt in zip(*pairs[:3])}
    rows: list[tuple[int, int, int, int, int, float]] = []
    lower, nbytes = [], []
    for e in experts:
        coef = abs(e.coef)
        if not tensors.get(e.checkpoint.id):
            return None
        for et, cands, cbytes, unscored, l2_sum in tensors[e.checkpoint.id]:
            bt = base_idx.get((e.position, et))
            if bt is None:
                if cands > unscored:
                    return None
                continue
            if cands:
                rows.append((bt, e.position, int(cands), int(cbytes), int(unscored), coef * float(l2_sum or 0.0)))
        mine = bucket_owner == e.checkpoint.id
        lower.append(coef * bucket_min[mine])
        nbytes.append(bucket_bytes[mine])
    t = threshold(np.concatenate(lower), np.concatenate(nbytes), budget)
    if t is None:
        return None
    floors = {e.position: index_floor(t, abs(e.coef)) for e in experts}
    if not all(1e-300 < f < math.inf for f in floors.values()):
        return None
    rows.sort()
    cols = [np.array(c) for c in zip(*rows)] if rows else [np.empty(0, np.int64)] * 5 + [np.empty(0)]
    return TopOfRanking(t, floors, len(experts), cols[0].astype(np.int64), cols[1].astype(np.int64),
                        cols[2].astype(np.int64), cols[3].astype(np.int64), cols[4].astype(np.int64),
                        cols[5].astype(np.float64))
