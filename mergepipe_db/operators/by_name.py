"""An operator built from parameters given by name: how a merge resolved per tensor (gradients, filters:
core/mergekit_config.py) constructs the operator of each output tensor, for every registered method alike.

Model parameters become fields of each expert's `ExpertParams` (a name it has no field for is not read by any
operator); global parameters become keyword arguments of the method's constructor (`lambda` as `lam`; a name
the constructor does not take, such as MergeKit's `int8_mask`, has no effect)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

from mergepipe_db.operators.base import ExpertParams, MergeOperator
from mergepipe_db.operators.registry import get

__all__ = ["expert_params", "operator_from_params"]

_KEYWORD = {"lambda": "lam"}


@cache
def _expert_fields() -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(ExpertParams)) - {"key"}


@cache
def _keywords(method: str) -> frozenset[str]:
    sig = inspect.signature(get(method).__init__)
    return frozenset(p.name for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY)


def expert_params(key: str, params: Mapping[str, Any]) -> ExpertParams:
    """One expert's `ExpertParams` from its resolved model parameters (defaults for those not given)."""
    fields = _expert_fields()
    return ExpertParams(key=key, **{k: v for k, v in params.items() if k in fields})


def operator_from_params(method: str, experts: Sequence[ExpertParams], params: Mapping[str, Any]) -> MergeOperator:
    """The operator of `method` for one tensor, from its experts and its resolved global parameters; method
    options (`core.method_params`: rescale, select_topk, ...) are checked there and given as `options`."""
    from mergepipe_db.core import method_params

    keywords = _keywords(method)
    kwargs = {_KEYWORD.get(k, k): v for k, v in params.items()}
    chosen = {k: v for k, v in kwargs.items() if k in keywords and k not in method_params.OPTION_NAMES}
    if "options" in keywords:
        given = {k: v for k, v in params.items() if k in method_params.OPTION_NAMES}
        chosen["options"] = method_params.parse_options(method, given, "<config>")
    return get(method)(experts, **chosen)
