"""A MergeKit config resolved per tensor for the planner: output tensors whose inputs are source tensors of other
names (slices renumber layers, passthrough stacks them), and each tensor's own parameters.

The planner plans over *output* tensors: `base_tensors` are the output tensors in output order (index i = the
i-th output tensor), each pointing at the bytes of the source tensor θ₀ is read from (for passthrough, the
slice's one source, of whichever model); an expert's `tensors` map an output tensor's name to the expert's source
tensor (its own catalog index, so the ranking SQL joins the expert's block rows). A source tensor used by two
output tensors (a layer reused) is two candidates (the executor reads its bytes once: `base_reuse`).
Per-tensor coefficients (from the gradient- or filter-resolved weights) enter the ranking scores through
`mp_plan_tensor.coef`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import sqlalchemy as sa

from mergepipe_db.core.mergekit_config import Recipe, resolve
from mergepipe_db.core.plan import TensorInfo
from mergepipe_db.core.spec import METHOD_PARAMS, MergeSpec
from mergepipe_db.db import schema
from mergepipe_db.db.checkpoints import load_tensors_many
from mergepipe_db.errors import CoordinateMismatchError, SpecError
from mergepipe_db.sources import source_class


@dataclass(frozen=True)
class Layout:
    recipe: Recipe
    base_tensors: list[TensorInfo]  # output tensors, output order, θ₀'s bytes
    expert_ids: list[str]  # by position
    expert_tensors: list[dict[str, TensorInfo]]  # by position: output name -> the expert's source tensor
    #: by output tensor index: (model parameters of each expert position, global parameters); an expert that is
    #: no input of the tensor has weight 0 (it contributes nothing)
    params: dict[int, tuple[tuple[dict[str, Any], ...], dict[str, Any]]]


def plan_base(conn: sa.Connection, spec: MergeSpec, ids: dict[str, str]) -> str:
    """The checkpoint whose tensors are θ₀: the config's base model; without one, passthrough's first source and
    linear's catalogue base (the base its models were ingested against, or the first model itself)."""
    cfg = spec.config
    if cfg.base_model:
        return ids[cfg.base_model]
    first = ids[cfg.slices[0].sources[0].model]
    if cfg.method == "passthrough":
        return first
    if not METHOD_PARAMS[cfg.method].base_is_input:
        raise SpecError(f"spec {spec.source}: {cfg.method} needs a base_model")
    c = schema.checkpoint
    row = conn.execute(sa.select(c.c.base_id, c.c.kind).where(c.c.id == first)).one()
    return row.base_id if row.base_id is not None and row.kind != "snapshot" else first


def checkpoint_name(conn: sa.Connection, checkpoint_id: str) -> str:
    c = schema.checkpoint
    return conn.execute(sa.select(c.c.name).where(c.c.id == checkpoint_id)).scalar_one()


def build_layout(conn: sa.Connection, spec: MergeSpec, base_id: str, ids: dict[str, str]) -> Layout:
    """Resolve `spec.config` against the catalogued models (`ids`: model reference -> checkpoint id)."""
    c = schema.checkpoint
    names = dict(conn.execute(sa.select(c.c.id, c.c.name).where(c.c.id.in_(sorted({base_id, *ids.values()})))).all())
    refs = dict(ids)
    base_ref = next((r for r, i in ids.items() if i == base_id and r == spec.config.base_model), None)
    if base_ref is None:
        base_ref = next((r for r, i in ids.items() if i == base_id), names[base_id])
        refs.setdefault(base_ref, base_id)
    tensors = load_tensors_many(conn, sorted(set(refs.values())))
    by_name = {cid: {t.name: t for t in ts} for cid, ts in tensors.items()}
    # a delta checkpoint or LoRA adapter holds Δ against the base's tensors of the same names, and only where
    # Δ ≠ 0: it has the base's layers, and a tensor it lacks is Δ = 0 there (as in a plain spec)
    kinds = dict(conn.execute(sa.select(c.c.id, c.c.kind).where(c.c.id.in_(sorted(set(refs.values()))))).all())
    sparse = {cid for cid, kind in kinds.items() if cid != base_id and not source_class(kind).plain_blocks}
    recipe = resolve(spec.config, base_ref,
                     lambda ref: [t.name for t in tensors[base_id if refs[ref] in sparse else refs[ref]]])
    expert_ids = [refs[r] for r in recipe.experts]
    _check_models(conn, recipe, refs, base_id)
    _check_renumbered(spec, recipe, refs, kinds)

    base_tensors: list[TensorInfo] = []
    expert_tensors: list[dict[str, TensorInfo]] = [{} for _ in expert_ids]
    params: dict[int, tuple[tuple[dict[str, Any], ...], dict[str, Any]]] = {}
    for i, r in enumerate(recipe.tensors):
        model, src = r.base
        t0 = by_name[refs[model]][src]
        base_tensors.append(replace(t0, idx=i, name=r.name))
        per = [{"weight": 0.0} for _ in expert_ids]
        for pos, src_name, mp in r.inputs:
            et = by_name[expert_ids[pos]].get(src_name)
            if et is None and expert_ids[pos] in sparse:  # Δ = 0 on this tensor: an input with nothing to read
                per[pos] = dict(mp)
                continue
            if et is None:
                raise SpecError(f"model {recipe.experts[pos]!r} has no tensor {src_name!r}")
            if et.shape != t0.shape:
                raise CoordinateMismatchError(f"{recipe.experts[pos]!r}: tensor {src_name!r} has shape "
                                              f"{et.shape}, the base's {src!r} {t0.shape}")
            expert_tensors[pos][r.name] = replace(et, name=r.name)
            per[pos] = dict(mp)
        params[i] = (tuple(per), dict(r.params))
    return Layout(recipe, base_tensors, expert_ids, expert_tensors, params)


def _check_models(conn: sa.Connection, recipe: Recipe, refs: dict[str, str], base_id: str) -> None:
    """Each expert is catalogued against the plan's base (its block statistics are deltas to θ₀) or is that
    base itself (linear lists it among its inputs); passthrough reads no expert."""
    if recipe.method == "passthrough":
        return
    c = schema.checkpoint
    ids = [refs[r] for r in recipe.experts]
    rows = {r.id: r for r in conn.execute(sa.select(c.c.id, c.c.base_id, c.c.kind).where(c.c.id.in_(ids)))}
    for ref, cid in zip(recipe.experts, ids):
        r = rows[cid]
        if cid != base_id and r.base_id != base_id:
            raise SpecError(f"model {ref!r} was not ingested against the merge's base; re-ingest it with --base "
                            f"{recipe.base}")


def _check_renumbered(spec: MergeSpec, recipe: Recipe, refs: dict[str, str], kinds: dict[str, str]) -> None:
    """An input whose source tensor is not θ₀'s (`Recipe.renumbered`: a slice whose sources have different layer
    ranges) is read whole as θ_k and its Δ formed against θ₀ by the executor: its source must deliver θ
    (`ExpertSource.plain_blocks`: a full checkpoint, a snapshot, packed blocks). A delta checkpoint or a LoRA
    adapter holds Δ against its base's same-named tensor only: refused, naming the source's layer_range
    (`kinds`: checkpoint id -> kind, of every model of the config)."""
    renumbered = recipe.renumbered()
    if not renumbered:
        return
    positions = sorted({pos for pos, _i in renumbered})
    ids = [refs[recipe.experts[p]] for p in positions]
    for pos, cid in zip(positions, ids):
        if source_class(kinds[cid]).plain_blocks:
            continue
        ref = recipe.experts[pos]
        path = next((f"{src.path}.layer_range" for s in spec.config.slices
                     if len({x.layer_range for x in s.sources}) > 1 for src in s.sources if src.model == ref),
                    "slices")
        raise SpecError(f"{path}: {ref!r} is a {kinds[cid]} checkpoint (Δ against its base's tensor of the "
                        f"same name), but this slice reads it at other layers than the base model's; give a "
                        f"full checkpoint or the same layer_range as the base")
