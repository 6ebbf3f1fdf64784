"""The merge methods by name: each family module registers its operator classes with `register`; the planner
and the executor look them up here (`get`, `make_operator`), never in a table of their own.

The names must equal `mergepipe_db.core.spec.METHODS` (what a spec may name): tests/test_operators.py checks it,
as the spec layer cannot import the operators.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from mergepipe_db.errors import SpecError
from mergepipe_db.operators.base import ExpertParams, MergeOperator

__all__ = ["get", "make_operator", "methods", "register"]

_M = TypeVar("_M", bound=type[MergeOperator])
_REGISTRY: dict[str, type[MergeOperator]] = {}


def register(name: str) -> Callable[[_M], _M]:
    """Class decorator: the operator class for merge method `name` (sets its ``name``); a name is registered once."""

    def add(cls: _M) -> _M:
        if name in _REGISTRY:
            raise ValueError(f"merge method {name!r} is already registered ({_REGISTRY[name].__qualname__})")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return add


def methods() -> tuple[str, ...]:
    """The registered method names, sorted."""
    return tuple(sorted(_REGISTRY))


def get(method: str) -> type[MergeOperator]:
    """The operator class of `method` (SpecError for an unknown method)."""
    cls = _REGISTRY.get(method)
    if cls is None:
        raise SpecError(f"unknown merge method {method!r}; known: {', '.join(sorted(_REGISTRY))}")
    return cls


def make_operator(method: str, experts: Sequence[ExpertParams], *, normalize: bool | None = None,
                  lam: float = 1.0, t: float | None = None, options: Any = None) -> MergeOperator:
    """The operator for ``method`` (SpecError for an unknown method or bad parameters); ``options`` are the
    spec's method options (`MergeSpec.options`: pairs or a mapping)."""
    return get(method)(experts, normalize=normalize, lam=lam, t=t, options=options)
