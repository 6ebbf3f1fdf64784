"""Planner: choose the access set — which expert delta blocks to read — under an expert-read budget.

The ranking is SQL (`sql/plan_rank.sql`): score each candidate (expert, block) by c_k·‖Δ_k,b‖₂, rank with
deterministic tie-breaks (score, tensor order, block index, expert order) and keep the prefix whose running
cost fits the budget. Planner and executor use the same cost (stored bytes of the block), so budget
soundness holds by construction: planned bytes ≤ budget, and the executor checks realized == planned.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from mergepipe_db import __version__
from mergepipe_db.db import schema
from mergepipe_db.errors import UnsupportedDtypeError
from mergepipe_db.resources import sql_text
from mergepipe_db.spec import MergeSpec
from mergepipe_db.storage import FileStamp

ARITHMETIC = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class TensorInfo:
    idx: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    path: str
    offset: int  # absolute byte offset in `path`
    nbytes: int
    rows_per_block: int
    n_blocks: int
    xxh3: str


@dataclass(frozen=True)
class CheckpointInfo:
    id: str
    name: str
    kind: str
    root: str
    has_stats: bool
    block_bytes: int
    files: tuple[FileStamp, ...]
    file_hashes: tuple[tuple[str, str], ...]  # (relpath, sha256)
    config: dict[str, Any] | None


@dataclass(frozen=True)
class Read:
    """One selected unit: a block (block_idx ≥ 0) or a whole tensor (block_idx = -1)."""

    block_idx: int
    offset: int
    nbytes: int
    xxh3: str


@dataclass
class ExpertPlan:
    position: int
    checkpoint: CheckpointInfo
    weight: float
    density: float
    gamma: float
    coef: float
    tensors: dict[str, TensorInfo]  # by name
    planned_bytes: int = 0
    blocks_selected: int = 0


@dataclass
class Plan:
    spec: MergeSpec
    base: CheckpointInfo
    base_tensors: list[TensorInfo]  # checkpoint order
    experts: list[ExpertPlan]
    out_dtype: str | None
    budget_bytes: int
    full_bytes: int  # what a full read of every expert tensor costs (the naive merge)
    candidate_bytes: int  # bytes of blocks with a non-zero delta
    planned_bytes: int
    access: dict[tuple[int, int], tuple[Read, ...]]  # (position, base tensor_idx) -> reads, block order
    full_selection: dict[tuple[int, int], bool]  # every candidate block of (expert, tensor) selected
    bound_per_tensor: dict[int, float] | None
    bound_total: float | None
    plan_hash: str = ""
    sketches: dict[tuple[int, int], Any] = field(default_factory=dict)
    sources: dict[int, Any] = field(default_factory=dict)  # position -> sources.ExpertSource (delta/LoRA/packed)

    def access_mask(self) -> list[list[Any]]:
        """Compact access set: [position, tensor name, [[first_block, stop_block], ...]] sorted."""
        out: list[list[Any]] = []
        names = {t.idx: t for t in self.base_tensors}
        for (pos, tidx), reads in sorted(self.access.items()):
            t = names[tidx]
            ranges: list[list[int]] = []
            for r in reads:
                if r.block_idx == -1:
                    ranges.append([0, t.n_blocks])
                elif ranges and ranges[-1][1] == r.block_idx:
                    ranges[-1][1] = r.block_idx + 1
                else:
                    ranges.append([r.block_idx, r.block_idx + 1])
            out.append([pos, t.name, ranges])
        return out

    def canonical(self) -> dict[str, Any]:
        """Deterministic content the plan hash is computed from."""
        s = self.spec
        return {
            "method": s.method,
            "normalize": s.normalize,
            "lambda": s.lam,
            "t": s.t,
            "seed": s.seed,
            "dtype": self.out_dtype,
            "base": self.base.id,
            "experts": [[e.checkpoint.id, e.weight, e.density, e.gamma] for e in self.experts],
            "budget_bytes": self.budget_bytes,
            "access": self.access_mask(),
        }

    def summary(self) -> dict[str, Any]:
        return {
            "plan_hash": self.plan_hash,
            "method": self.spec.method,
            "base": self.base.name,
            "budget_bytes": self.budget_bytes,
            "full_bytes": self.full_bytes,
            "candidate_bytes": self.candidate_bytes,
            "planned_bytes": self.planned_bytes,
            "bound": self.bound_total,
            "experts": [
                {"name": e.checkpoint.name, "position": e.position, "planned_bytes": e.planned_bytes,
                 "blocks_selected": e.blocks_selected, "coef": e.coef}
                for e in self.experts
            ],
        }


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=True).encode("utf-8")


def sha256_hex(obj: Any) -> str:
    return hashlib.sha256(canonical_json(obj)).hexdigest()


# --- catalog reads ---------------------------------------------------------------------------------


def load_checkpoint_info(conn: sa.Connection, checkpoint_id: str) -> CheckpointInfo:
    c, f = schema.checkpoint, schema.source_file
    row = conn.execute(sa.select(c).where(c.c.id == checkpoint_id)).mappings().one()
    files = conn.execute(sa.select(f).where(f.c.checkpoint_id == checkpoint_id).order_by(f.c.file_idx)).mappings()
    files = list(files)
    return CheckpointInfo(
        id=row["id"], name=row["name"], kind=row["kind"], root=row["root"], has_stats=bool(row["has_stats"]),
        block_bytes=int(row["block_bytes"]),
        files=tuple(FileStamp(r["path"], r["size"], r["mtime_ns"]) for r in files),
        file_hashes=tuple((r["relpath"], r["sha256"]) for r in files),
        config=json.loads(row["config"]) if row["config"] else None,
    )


def load_tensors(conn: sa.Connection, checkpoint_id: str) -> list[TensorInfo]:
    t, f = schema.tensor, schema.source_file
    rows = conn.execute(
        sa.select(t, f.c.path).join(f, f.c.id == t.c.file_id)
        .where(t.c.checkpoint_id == checkpoint_id).order_by(t.c.tensor_idx)
    ).mappings()
    return [
        TensorInfo(r["tensor_idx"], r["name"], r["dtype"], tuple(json.loads(r["shape"])), r["path"], r["offset"],
                   r["nbytes"], r["rows_per_block"], r["n_blocks"], r["xxh3"])
        for r in rows
    ]


def _load_sketches(conn: sa.Connection, expert_id: str, base_idx_by_name: dict[str, int]) -> dict[int, Any]:
    """Tensor-level |Δ| histograms of one expert (sum of its block sketches), by base tensor_idx."""
    from mergepipe_db import sketch

    b, t = schema.block, schema.tensor
    out: dict[int, Any] = {}
    rows = conn.execute(
        sa.select(t.c.name, b.c.sketch).join(t, (t.c.checkpoint_id == b.c.checkpoint_id)
                                             & (t.c.tensor_idx == b.c.tensor_idx))
        .where(b.c.checkpoint_id == expert_id, b.c.sketch.is_not(None))
    )
    for name, blob in rows:
        h = sketch.decode(blob)
        idx = base_idx_by_name[name]
        out[idx] = h if idx not in out else out[idx] + h
    return out


# --- planning --------------------------------------------------------------------------------------


def load_experts(conn: sa.Connection, spec: MergeSpec, expert_ids: list[str]) -> tuple[list[ExpertPlan], Any]:
    """The experts of `spec` (in spec order) with their tensors, and the operator (for coefficients)."""
    from mergepipe_db.operators import ExpertParams, make_operator

    infos = [load_checkpoint_info(conn, eid) for eid in expert_ids]
    op = make_operator(
        spec.method,
        [ExpertParams(key=info.id, weight=m.weight, density=m.density, gamma=m.gamma)
         for info, m in zip(infos, spec.models)],
        normalize=spec.normalize, lam=spec.lam, t=spec.t,
    )
    experts = []
    for pos, (info, m) in enumerate(zip(infos, spec.models)):
        tensors = {t.name: t for t in load_tensors(conn, info.id)}
        experts.append(ExpertPlan(pos, info, m.weight, m.density, m.gamma, float(op.coefficient(pos)), tensors))
    return experts, op


def finalize(conn: sa.Connection, plan: Plan, op: Any) -> None:
    """Attach the sketches partial reads need, check dtypes, and compute the plan hash."""
    from mergepipe_db.sources import attach_sources

    attach_sources(conn, plan)  # delta / LoRA / packed experts: read hooks and packed read costs
    base_idx_by_name = {t.name: t.idx for t in plan.base_tensors}
    if op.needs_full_tensor_stats:
        for e in plan.experts:
            partial = [tidx for (pos, tidx), full in plan.full_selection.items() if pos == e.position and not full]
            if partial and e.checkpoint.has_stats:
                sk = _load_sketches(conn, e.checkpoint.id, base_idx_by_name)
                for tidx in partial:
                    if tidx in sk:
                        plan.sketches[(e.position, tidx)] = sk[tidx]
    for t in plan.base_tensors:
        if t.dtype not in ARITHMETIC and any((e.position, t.idx) in plan.access for e in plan.experts):
            raise UnsupportedDtypeError(f"tensor {t.name!r} has dtype {t.dtype}, which cannot be merged")
    plan.plan_hash = sha256_hex({"tool": __version__.split(".")[0], **plan.canonical()})


def build_plan(
    conn: sa.Connection,
    spec: MergeSpec,
    *,
    base_id: str,
    expert_ids: list[str],
    budget_spec: Any,
) -> Plan:
    """Run the ranking SQL for `spec` over the catalog and return the access set within the budget."""
    base = load_checkpoint_info(conn, base_id)
    base_tensors = load_tensors(conn, base_id)
    out_dtype = spec.dtype or None  # non-arithmetic tensors are copied from the base in their own dtype

    experts, op = load_experts(conn, spec, expert_ids)

    full_bytes = sum(e.tensors[t.name].nbytes for e in experts for t in base_tensors
                     if t.dtype in ARITHMETIC and t.name in e.tensors)  # delta/LoRA experts cover a subset
    budget_bytes = budget_spec.resolve(full_bytes)

    conn.execute(sa.text("DROP TABLE IF EXISTS mp_plan_ranked"))
    conn.execute(sa.text("DROP TABLE IF EXISTS mp_plan_expert"))
    conn.execute(sa.text(sql_text("plan_expert_table")))
    conn.execute(sa.text(sql_text("plan_expert_insert")), [
        {"position": e.position, "checkpoint_id": e.checkpoint.id, "coef": abs(e.coef),
         "tensor_level": bool(op.tensor_granular or not e.checkpoint.has_stats)}
        for e in experts
    ])
    conn.execute(sa.text(sql_text("plan_rank")), {"base_id": base.id})
    params = {"budget": budget_bytes}
    access_lists: dict[tuple[int, int], list[Read]] = defaultdict(list)
    # One fetchall (not a row-at-a-time cursor walk): at 10^5 selected blocks the fetch dominates planning.
    selected = conn.execute(sa.text(sql_text("plan_select")), params).fetchall()
    for pos, tidx, bidx, nbytes, offset, xxh3 in selected:
        access_lists[(pos, tidx)].append(Read(bidx, offset, nbytes, xxh3))
    summary = conn.execute(sa.text(sql_text("plan_summary")), params).all()
    conn.execute(sa.text("DROP TABLE IF EXISTS mp_plan_ranked"))
    conn.execute(sa.text("DROP TABLE IF EXISTS mp_plan_expert"))

    candidate_bytes = 0
    planned_bytes = 0
    full_selection: dict[tuple[int, int], bool] = {}
    bound_per_tensor: dict[int, float] = defaultdict(float)
    for tidx, pos, candidates, cbytes, selected, pbytes, omitted_score, omitted_unscored in summary:
        candidate_bytes += int(cbytes)
        planned_bytes += int(pbytes)
        experts[int(pos)].planned_bytes += int(pbytes)
        experts[int(pos)].blocks_selected += int(selected)
        full_selection[(int(pos), int(tidx))] = int(selected) == int(candidates)
        if int(omitted_unscored):
            bound_per_tensor[int(tidx)] = math.inf
        else:
            bound_per_tensor[int(tidx)] += float(omitted_score or 0.0)
    bound_total: float | None = math.fsum(bound_per_tensor.values()) if bound_per_tensor else 0.0
    per_tensor: dict[int, float] | None = dict(bound_per_tensor)
    if not op.additive:
        bound_total, per_tensor = None, None

    plan = Plan(
        spec=spec, base=base, base_tensors=base_tensors, experts=experts, out_dtype=out_dtype,
        budget_bytes=budget_bytes, full_bytes=full_bytes, candidate_bytes=candidate_bytes,
        planned_bytes=planned_bytes,
        access={k: tuple(v) for k, v in access_lists.items()},
        full_selection=full_selection, bound_per_tensor=per_tensor, bound_total=bound_total,
    )
    finalize(conn, plan, op)
    return plan
