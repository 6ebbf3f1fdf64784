"""The manifest: the deterministic record of one merge (what replay and audit need), and its hash."""

from __future__ import annotations

from typing import Any

from mergepipe_db.core.hashing import sha256_hex
from mergepipe_db.core.plan import Plan
from mergepipe_db.core.results import ExecutionResult
from mergepipe_db.core.version import __version__

MANIFEST_FORMAT = "mergepipe-manifest/1"


def build_manifest(plan: Plan, result: ExecutionResult, *, parents: list[str]) -> dict[str, Any]:
    """Deterministic manifest content (no timings, no paths): what replay needs and what audit checks."""
    s = plan.spec
    doc = {
        "format": MANIFEST_FORMAT,
        "tool_version": __version__,
        "spec": {
            "merge_method": s.method,
            "base_model": plan.base.name,
            "models": [{"model": e.checkpoint.name, "parameters": {"weight": e.weight, "density": e.density,
                                                                   "gamma": e.gamma,
                                                                   **({} if m.epsilon is None
                                                                      else {"epsilon": m.epsilon})}}
                       for e, m in zip(plan.experts, s.models)],
            # method options (core.method_params) only where a spec has them: older manifests are unchanged
            "parameters": {"normalize": s.normalize, "lambda": s.lam, "t": s.t, **dict(s.options)},
            "dtype": plan.out_dtype,
        },
        "seed": s.seed,
        "inputs": {
            "base": {"id": plan.base.id, "name": plan.base.name,
                     "files": [[r, h] for r, h in plan.base.file_hashes]},
            "experts": [{"position": e.position, "id": e.checkpoint.id, "name": e.checkpoint.name,
                         "files": [[r, h] for r, h in e.checkpoint.file_hashes]} for e in plan.experts],
        },
        "budget_bytes": plan.budget_bytes,
        "full_bytes": plan.full_bytes,
        "planned_bytes": plan.planned_bytes,
        "plan_hash": plan.plan_hash,
        "access": plan.access_mask(),
        "realized": {"per_expert": result.realized_per_expert, "total": result.realized_bytes},
        # Summation order (SQL aggregates vs replay's per-block sum) moves the last bits: record 9 digits.
        "bound": None if plan.bound_total is None else float(f"{plan.bound_total:.9g}"),
        "outputs": {
            "tensors": [[t.name, t.dtype, list(t.shape), h] for t, h in zip(result.out_tensors, result.tensor_xxh3)],
            "files": [[n, h] for n, h in zip(result.shard_names, result.shard_sha256)],
        },
        "parents": parents,
        # the geometric methods' coefficients from catalog statistics, where a budget cut a tensor's reads
        **({"coefficients": {k: [v[0], list(v[1])] for k, v in plan.coefficients.items()}}
           if plan.coefficients else {}),
    }
    if plan.recipe is not None:  # a config resolved per tensor: its text verbatim and every tensor's parameters
        r = plan.recipe
        names = {r.base: plan.base.name} | {ref: e.checkpoint.name for ref, e in zip(r.experts, plan.experts)}
        doc["config"] = {"text": s.text, "aliases": dict(s.aliases or {}), "recipe": r.to_json(),
                         # the lineage of layers: per output layer, the (checkpoint, layer) it came from
                         "layers": [[[names.get(m, m), li] for m, li in layer] for layer in r.layer_sources]}
    return doc


def manifest_hash(manifest: dict[str, Any]) -> str:
    return sha256_hex(manifest)
