"""Method parameters beyond weight/density/gamma/normalize/lambda/t, and each method's constraints as MergeKit 0.1.5
enforces them, checked when a spec is loaded (before any checkpoint byte is read).

`spec.options` holds the method-level options as (name, value) pairs, sorted by name:

- ``rescale`` (dare_linear, dare_ties, della, della_linear): ``"l1"`` (MergeKit's ``rescale: true``, the default:
  the kept task vector is scaled by ‖Δ‖₁ / ‖kept Δ‖₁), ``"none"`` (``rescale: false``) or ``"classic"`` (the
  spec says ``rescale: classic``: 1/density for DARE, 1/p for DELLA). ``"classic"`` is never stored: a plan or
  manifest of a DARE/DELLA merge without ``rescale`` is classic (every manifest written before the option
  existed), so its plan hash and bytes are unchanged.
- ``select_topk`` (sce, default 1.0), ``epsilon`` (ram, ramplus_tl; default 1e-5), ``r`` (0.1) and ``alpha``
  (0.2) (ramplus_tl).

della's ``epsilon`` is per model (`ModelEntry.epsilon`, default 0.15; a global ``epsilon`` is every model's
default, as in MergeKit).
"""

from __future__ import annotations

import math
from typing import Any

from mergepipe_db.errors import MethodParameterError

__all__ = [
    "DELLA_EPSILON",
    "OPTION_DEFAULTS",
    "OPTION_NAMES",
    "RESCALE_METHODS",
    "check_method",
    "option",
    "parse_options",
    "rescale_mode",
    "uses_epsilon_per_model",
]

#: methods whose random drop takes MergeKit's ``rescale``
RESCALE_METHODS = frozenset({"dare_linear", "dare_ties", "della", "della_linear"})
#: methods with a per-model ``epsilon`` (DELLA's probability spread)
_PER_MODEL_EPSILON = frozenset({"della", "della_linear"})
DELLA_EPSILON = 0.15
#: method-level options a spec's ``parameters`` may give, by method, with their defaults
OPTION_DEFAULTS: dict[str, dict[str, float]] = {
    "sce": {"select_topk": 1.0},
    "ram": {"epsilon": 1e-5},
    "ramplus_tl": {"r": 0.1, "alpha": 0.2, "epsilon": 1e-5},
}
#: the geometric methods' options (operators/geometric.py checks their values and holds their defaults)
GEOMETRIC_OPTIONS = frozenset({"filter_wise", "nuslerp_flatten", "nuslerp_row_wise", "normalize_weights", "eps",
                               "max_iter", "tol"})
OPTION_NAMES = frozenset({"rescale", "select_topk", "r", "alpha", "epsilon"}) | GEOMETRIC_OPTIONS
#: methods that take exactly one model besides the base (MergeKit's min/max inputs 2)
_TWO_MODELS = frozenset({"slerp", "nearswap", "arcee_fusion"})
#: methods whose models carry no weight (MergeKit declares none)
NO_WEIGHT = frozenset({"slerp", "nearswap", "arcee_fusion", "sce", "ram", "ramplus_tl"})


def uses_epsilon_per_model(method: str) -> bool:
    return method in _PER_MODEL_EPSILON


def _num(value: Any, what: str, label: str) -> float:
    try:
        ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(float(value))
    except OverflowError:  # an int beyond float range
        ok = False
    if not ok:
        raise MethodParameterError(f"spec {label}: {what} must be a finite number, got {str(value)[:40]!r}")
    return float(value)


def parse_options(method: str, gparams: dict[str, Any], label: str) -> tuple[tuple[str, Any], ...]:
    """The method-level options of `gparams` (a spec's ``parameters``) for `method`, validated, as sorted pairs
    (defaults filled in, ``rescale: classic`` left out; see the module docstring). MethodParameterError names
    the parameter."""
    out: dict[str, Any] = {}
    if "rescale" in gparams:
        r = gparams["rescale"]
        if r not in (True, False, "classic", "l1", "none"):
            raise MethodParameterError(f"spec {label}: rescale must be true, false or classic, got {r!r}")
        mode = {True: "l1", False: "none"}.get(r, r)  # type: ignore[call-overload]
        # the other methods of MergeKit's task-arithmetic family take `rescale` too, without effect (as MergeKit)
        if method in RESCALE_METHODS and mode != "classic":
            out["rescale"] = mode
    elif method in RESCALE_METHODS:
        out["rescale"] = "l1"  # MergeKit's default for DARE and DELLA: rescale: true
    defaults = OPTION_DEFAULTS.get(method, {})
    for name in ("select_topk", "r", "alpha", "epsilon"):
        if name not in gparams:
            if name in defaults:
                out[name] = defaults[name]
            continue
        if name == "epsilon" and method in _PER_MODEL_EPSILON:
            continue  # della: every model's default (`ModelEntry.epsilon`)
        if name not in defaults:
            raise MethodParameterError(f"spec {label}: parameter {name!r} does not apply to {method}")
        out[name] = _num(gparams[name], name, label)
    for name in sorted(GEOMETRIC_OPTIONS & set(gparams)):  # given ones only: plans without them keep their hashes
        v = gparams[name]
        if not isinstance(v, (bool, int, float)):
            raise MethodParameterError(f"spec {label}: parameters.{name} must be a single number or true/false, "
                                       f"got {str(v)[:40]!r}")
        out[name] = v
    return tuple(sorted(out.items()))


def option(options: tuple[tuple[str, Any], ...] | dict[str, Any] | None, name: str, default: Any = None) -> Any:
    """The value of option `name` in `options` (pairs or a dict), or `default`."""
    if not options:
        return default
    return dict(options).get(name, default)


def rescale_mode(method: str, options: Any) -> str | None:
    """``"l1"``, ``"none"`` or ``"classic"`` for a DARE/DELLA method (absent: classic); None for the others."""
    if method not in RESCALE_METHODS:
        return None
    return str(option(options, "rescale", "classic"))


def check_method(method: str, models: list[Any], t: float | None, label: str) -> None:
    """Each method's constraints on its models and parameters, as MergeKit enforces them (MethodParameterError,
    one line naming the parameter). `models`: the spec's `ModelEntry`s (the base excluded)."""
    if method in _TWO_MODELS and len(models) != 1:
        raise MethodParameterError(f"spec {label}: {method} merges exactly two models (models: the base and one "
                                   f"other), got {len(models)} besides the base")
    if method == "nearswap" and t is None:
        raise MethodParameterError(f"spec {label}: nearswap needs parameters.t")
    if method in _PER_MODEL_EPSILON:
        for i, m in enumerate(models):
            eps = m.epsilon
            if m.density < 1 and not (m.density - eps > 0 and m.density + eps < 1):
                raise MethodParameterError(
                    f"spec {label}: models[{i}] ({m.ref}) epsilon {eps:g} with density {m.density:g}: "
                    f"{method} needs density - epsilon > 0 and density + epsilon < 1")
