"""Merge operators: pure float32 array math (numpy, numba kernels), one tensor at a time, streaming over the
experts; no I/O, no catalog. `make_operator(method, experts, ...)` gives the operator of a spec's method.

Modules: `base` (ExpertParams, TensorContext, MergeOperator: the begin/add/finish protocol), `inputs`
(ExpertInput, buffers, dtype conversion), `dare` (seeded DARE draws), `order_stats` (k-th largest |Δ|),
`fold` (DeltaFold: T_k from Δ_k, shared by the task-vector families), `registry` (methods by name), and one
module per family: `linear`, `additive` (task_arithmetic, dare_linear, breadcrumbs), `sign_consensus`
(ties, dare_ties, breadcrumbs_ties, della), `geometric` (slerp, model_stock, nuslerp, multislerp, karcher:
coefficients from Gram matrices); `gather` (GatherFold: whole tensors of every expert) and
its families `nearswap`, `ram` (ram, ramplus_tl), `sce`, `fusion` (arcee_fusion); additive also holds
della_linear. Importing this package imports neither torch nor numba (`base.kernels()` loads
the fused kernels on first use; slerp imports torch when it finishes a tensor).

How to add a merge method:
1. Write its literal, whole-tensor formula in docs/SEMANTICS.md, and add its name to
   `mergepipe_db.core.spec.METHODS` (what a spec may name).
2. In its family module (or a new `operators/<family>.py`), subclass `MergeOperator` (implement `_begin`,
   `_add`, `_finish`; where they apply `_validate`, `coefficient`, `_base_only`, `_end`), or `fold.DeltaFold`
   for a method on task vectors, or a family's template (`additive.AdditiveFold`, `sign_consensus.TiesFold`)
   setting `sparsification` (and `_fold_trimmed` for a new magnitude trim).
3. Set the class flags the planner and executor read (`additive`, `uses_theta`, `tensor_granular`,
   `needs_full_tensor_stats`, `joint_election`, `normalize_default`, `uses_torch`).
4. Decorate the class with `@register("name")`; a new module is imported below, so that it registers.
5. Keep torch and the numba kernels function-local. In tests/test_operators.py add a `lit_*` formula, the name
   to its METHODS and to `literal_merge`: the streamed result must equal it bit for bit at full selection;
   `test_registry_methods_are_the_spec_methods` keeps the registry and `core.spec.METHODS` equal.
"""

from __future__ import annotations

# the family modules: importing them registers their methods
from mergepipe_db.operators import (  # noqa: F401
    additive,
    fusion,
    geometric,
    linear,
    nearswap,
    passthrough,
    ram,
    sce,
    sign_consensus,
)
from mergepipe_db.operators.base import ExpertParams, MergeOperator, TensorContext, block_bounds, live_ranges
from mergepipe_db.operators.dare import dare_keep_mask
from mergepipe_db.operators.inputs import ExpertInput, empty_buffer
from mergepipe_db.operators.registry import get as operator_class
from mergepipe_db.operators.registry import make_operator, methods, register

__all__ = [
    "ExpertInput",
    "ExpertParams",
    "MergeOperator",
    "TensorContext",
    "block_bounds",
    "dare_keep_mask",
    "empty_buffer",
    "live_ranges",
    "make_operator",
    "methods",
    "operator_class",
    "register",
]
