"""The plan a manifest records, rebuilt without ranking: replay re-executes exactly this access set."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import replace
from typing import Any

import sqlalchemy as sa

from mergepipe_db.core.manifest import MANIFEST_FORMAT
from mergepipe_db.core.plan import ExpertPlan, Plan, Read
from mergepipe_db.core.spec import MergeSpec, ModelEntry
from mergepipe_db.db import schema
from mergepipe_db.db.checkpoints import load_checkpoint_info, load_tensors
from mergepipe_db.errors import ReplayError
from mergepipe_db.pipeline.plan.build import ARITHMETIC_DTYPES, load_experts, ties_prune_bounds
from mergepipe_db.pipeline.plan.complete import complete_plan


def _check_input(conn: sa.Connection, rec: dict[str, Any], role: str) -> None:
    c, f = schema.checkpoint, schema.source_file
    if conn.execute(sa.select(c.c.id).where(c.c.id == rec["id"])).scalar() is None:
        raise ReplayError(f"{role} {rec['name']!r} (id {rec['id']}) of the manifest is not in this catalog")
    files = conn.execute(sa.select(f.c.relpath, f.c.sha256).where(f.c.checkpoint_id == rec["id"])
                         .order_by(f.c.file_idx)).all()
    if [[a, b] for a, b in files] != [list(x) for x in rec["files"]]:
        raise ReplayError(f"{role} {rec['name']!r}: its files no longer match the manifest's sha256 hashes")


def plan_from_manifest(conn: sa.Connection, manifest: dict[str, Any]) -> Plan:
    """The plan a manifest recorded, rebuilt from the catalog; ReplayError if inputs changed."""
    if manifest.get("format") != MANIFEST_FORMAT:
        raise ReplayError(f"unsupported manifest format {manifest.get('format')!r}")
    sp, inputs = manifest["spec"], manifest["inputs"]
    _check_input(conn, inputs["base"], "base")
    for e in inputs["experts"]:
        _check_input(conn, e, "expert")
    if "config" in manifest:
        return _config_plan(conn, manifest)
    gp = sp["parameters"]
    spec = MergeSpec(
        method=sp["merge_method"], base=inputs["base"]["name"],
        models=tuple(ModelEntry(m["model"], float(m["parameters"]["weight"]), float(m["parameters"]["density"]),
                                float(m["parameters"]["gamma"]),
                                None if "epsilon" not in m["parameters"] else float(m["parameters"]["epsilon"]))
                     for m in sp["models"]),
        normalize=gp["normalize"], lam=float(gp["lambda"]), t=gp["t"], dtype=sp["dtype"], budget=None,
        seed=int(manifest["seed"]), source="<manifest>",
        # method options (rescale, select_topk, ...): absent in manifests written before them (DARE: classic)
        options=tuple(sorted((k, v) for k, v in gp.items() if k not in ("normalize", "lambda", "t"))),
    )
    base = load_checkpoint_info(conn, inputs["base"]["id"])
    base_tensors = load_tensors(conn, base.id)
    by_name = {t.name: t for t in base_tensors}
    experts, op = load_experts(conn, spec, [e["id"] for e in inputs["experts"]])

    selected: dict[tuple[int, str], set[int]] = defaultdict(set)
    for pos, tname, ranges in manifest["access"]:
        if tname not in by_name or not 0 <= pos < len(experts):
            raise ReplayError(f"manifest access names an unknown tensor or expert ({pos}, {tname!r})")
        for lo, hi in ranges:
            selected[(pos, tname)].update(range(lo, hi))

    # TIES blocks that trim to zero are no candidates, as when planning (so full_selection is the same)
    prune, sketch_cache = ties_prune_bounds(conn, experts, op, base.id, base_tensors)
    b, t = schema.block, schema.tensor
    access: dict[tuple[int, int], tuple[Read, ...]] = {}
    full_selection: dict[tuple[int, int], bool] = {}
    bound_per_tensor: dict[int, float] = defaultdict(float)
    candidate_bytes = 0
    counted: list[ExpertPlan] = []
    for e in experts:
        planned_bytes = blocks_selected = pruned_bytes = blocks_pruned = 0
        rows = conn.execute(
            sa.select(t.c.name, t.c.dtype, b.c.block_idx, b.c.offset, b.c.nbytes, b.c.xxh3, b.c.delta_l2,
                      b.c.delta_max)
            .join(t, (t.c.checkpoint_id == b.c.checkpoint_id) & (t.c.tensor_idx == b.c.tensor_idx))
            .where(b.c.checkpoint_id == e.checkpoint.id).order_by(t.c.tensor_idx, b.c.block_idx)
        ).all()
        per_tensor: dict[str, list[Any]] = defaultdict(list)
        for row in rows:
            if row.dtype in ARITHMETIC_DTYPES:
                per_tensor[row.name].append(row)
        for tname, blocks in per_tensor.items():
            tidx = by_name[tname].idx
            chosen = selected.get((e.position, tname), set())
            bound = prune.get((e.position, e.tensors[tname].idx))
            reads, all_candidates_read = [], True
            for row in blocks:
                candidate = row.delta_l2 is None or row.delta_l2 != 0
                if candidate and bound is not None and row.delta_max is not None and row.delta_max < bound:
                    candidate = False
                    pruned_bytes += row.nbytes
                    blocks_pruned += 1
                candidate_bytes += row.nbytes if candidate else 0
                if row.block_idx in chosen:
                    reads.append(Read(row.block_idx, row.offset, row.nbytes, row.xxh3))
                elif candidate:
                    all_candidates_read = False
                    score = math.inf if row.delta_l2 is None else abs(e.coef) * row.delta_l2
                    if row.block_idx != -2:  # a LoRA factor unit is no update of its own
                        bound_per_tensor[tidx] += score
            if len(reads) != len(chosen):
                raise ReplayError(f"manifest selects blocks of {tname!r} that the catalog does not have")
            if reads:
                access[(e.position, tidx)] = tuple(reads)
                planned_bytes += sum(r.nbytes for r in reads)
                blocks_selected += len(reads)
            full_selection[(e.position, tidx)] = all_candidates_read
        counted.append(replace(e, planned_bytes=planned_bytes, blocks_selected=blocks_selected,
                               pruned_bytes=pruned_bytes, blocks_pruned=blocks_pruned))
    experts = counted
    planned = sum(e.planned_bytes for e in experts)
    full_bytes = sum(e.tensors[x.name].nbytes for e in experts for x in base_tensors
                     if x.dtype in ARITHMETIC_DTYPES and x.name in e.tensors)
    additive = bool(op.additive)
    plan = complete_plan(
        conn, op, spec=spec, base=base, base_tensors=base_tensors, experts=experts, out_dtype=sp["dtype"],
        budget_bytes=int(manifest["budget_bytes"]), full_bytes=full_bytes, candidate_bytes=candidate_bytes,
        planned_bytes=planned, access=access, full_selection=full_selection,
        bound_per_tensor=dict(bound_per_tensor) if additive else None,
        bound_total=math.fsum(bound_per_tensor.values()) if additive else None, sketch_cache=sketch_cache,
        coefficients=manifest.get("coefficients"))
    if plan.plan_hash != manifest["plan_hash"]:
        raise ReplayError(f"rebuilt plan hash {plan.plan_hash[:16]} != recorded {manifest['plan_hash'][:16]}: "
                          f"the catalog no longer describes the recorded inputs")
    return plan


def _config_plan(conn: sa.Connection, manifest: dict[str, Any]) -> Plan:
    """A config resolved per tensor: planned again from its text, at the recorded budget in bytes, over the
    recorded inputs; the plan hash (which covers every tensor's sources and parameters) must match."""
    import yaml

    from mergepipe_db.core.mergekit_config import substitute_refs
    from mergepipe_db.core.spec import Budget, load_spec
    from mergepipe_db.pipeline.plan.build import build_plan

    text, aliases = manifest["config"]["text"], manifest["config"].get("aliases") or {}
    raw = yaml.safe_load(text)
    substitute_refs(raw, aliases)
    spec = load_spec(raw)
    spec = replace(spec, text=text, seed=int(manifest["seed"]), dtype=manifest["spec"]["dtype"], aliases=aliases)
    # the config's references as the merge resolved them (a Hugging Face id, a path): the recorded inputs
    recipe, inputs = manifest["config"]["recipe"], manifest["inputs"]
    ids = {recipe["base"]: inputs["base"]["id"]} | {
        ref: e["id"] for ref, e in zip(recipe["experts"], inputs["experts"])}
    if any(m.ref not in ids for m in spec.models):
        raise ReplayError("the manifest's config names a model its inputs do not record")
    plan = build_plan(conn, spec, base_id=inputs["base"]["id"], expert_ids=[ids[m.ref] for m in spec.models],
                      budget_spec=Budget(nbytes=int(manifest["budget_bytes"])))
    if plan.plan_hash != manifest["plan_hash"]:
        raise ReplayError(f"rebuilt plan hash {plan.plan_hash[:16]} != recorded {manifest['plan_hash'][:16]}: "
                          f"the catalog no longer describes the recorded inputs")
    return plan
