"""Merge specs: MergeKit-compatible YAML plus `budget` and `seed`, and budget parsing.

Example::

    merge_method: ties
    base_model: base                 # catalog name or path
    models:
      - model: expert_00
        parameters: {weight: 0.5, density: 0.5}
    parameters: {normalize: true, lambda: 1.0}
    dtype: bfloat16
    budget: 0.25                     # fraction of full-read expert bytes, or bytes: 3GiB, 500MB, 123456
    seed: 0
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mergepipe_db.errors import BudgetError, SpecError

METHODS = ("linear", "task_arithmetic", "ties", "dare_linear", "dare_ties", "breadcrumbs", "slerp",
           "model_stock", "nuslerp", "multislerp", "karcher")
DTYPES = {
    "float32": "F32", "fp32": "F32", "f32": "F32",
    "bfloat16": "BF16", "bf16": "BF16",
    "float16": "F16", "fp16": "F16", "f16": "F16",
}
_TOP_KEYS = {"merge_method", "base_model", "models", "parameters", "dtype", "budget", "seed", "tokenizer_source",
             "name", "out_dtype"}
_MODEL_PARAMS = {"weight", "density", "gamma"}
_GLOBAL_PARAMS = {"normalize", "lambda", "t", "int8_mask", "rescale"}
#: method options (MergeKit 0.1.5's names): kept in `MergeSpec.options`, checked by the method's operator
_OPTION_PARAMS = {"filter_wise", "nuslerp_flatten", "nuslerp_row_wise", "normalize_weights", "eps", "max_iter",
                  "tol"}
#: methods whose models take no `weight` (MergeKit's signatures have none)
_NO_WEIGHT = ("slerp", "model_stock", "karcher")
_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}


@dataclass(frozen=True)
class Budget:
    """An expert-read budget: a fraction of the merge's full-read expert bytes, or absolute bytes."""

    fraction: float | None = None
    nbytes: int | None = None

    def resolve(self, full_bytes: int) -> int:
        """Budget in bytes for a merge whose full read of the experts is `full_bytes`."""
        if self.nbytes is not None:
            return self.nbytes
        assert self.fraction is not None
        return int(math.floor(self.fraction * full_bytes))

    def __str__(self) -> str:
        return f"{self.nbytes} B" if self.nbytes is not None else f"{self.fraction:g} of full"


def parse_budget(value: Any) -> Budget:
    """`0.25` → fraction; `123456`, `500MB`, `3GiB` → bytes. A plain number ≤ 1 is a fraction."""
    if isinstance(value, Budget):
        return value
    if isinstance(value, bool) or value is None:
        raise BudgetError(f"unparsable budget {value!r}: give bytes (3GiB, 500MB, 123456) or a fraction (0.25)")
    text = str(value).strip()
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)", text)
    if not m:
        if text.startswith("-"):
            raise BudgetError(f"budget must not be negative, got {text!r}")
        raise BudgetError(f"unparsable budget {text!r}: give bytes (3GiB, 500MB, 123456) or a fraction (0.25)")
    number, unit = float(m.group(1)), m.group(2).lower()
    if unit not in _UNITS:
        raise BudgetError(f"unknown budget unit {m.group(2)!r} in {text!r}; use B, KB, MB, GB, KiB, MiB, GiB")
    if not math.isfinite(number):
        raise BudgetError(f"budget must be finite, got {text!r}")
    if unit == "" and number <= 1.0:
        return Budget(fraction=number)
    nbytes = number * _UNITS[unit]
    if not nbytes < 2**63:  # also inf: '1e300TiB'
        raise BudgetError(f"budget {text!r} is too large: at most 2^63 - 1 bytes")
    if unit == "" and not number.is_integer():
        raise BudgetError(f"budget {text!r} is neither a fraction in [0, 1] nor a whole number of bytes")
    return Budget(nbytes=int(nbytes))


@dataclass(frozen=True)
class ModelEntry:
    ref: str  # catalog name or path, as written in the spec
    weight: float = 1.0
    density: float = 1.0
    gamma: float = 0.01


@dataclass(frozen=True)
class MergeSpec:
    method: str
    base: str
    models: tuple[ModelEntry, ...]
    normalize: bool | None = None
    lam: float = 1.0
    t: float | None = None
    dtype: str | None = None  # safetensors dtype name of the output; None = the base's
    budget: Budget | None = None
    seed: int = 0
    source: str = field(default="<dict>", compare=False)
    #: method options (`_OPTION_PARAMS`) as sorted (name, value) pairs; () when none is given
    options: tuple[tuple[str, Any], ...] = ()


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        if isinstance(value, list):
            raise SpecError(f"{what}: per-layer gradients (lists) are not supported; give one number")
        raise SpecError(f"{what} must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond float range
        number = math.inf
    if not math.isfinite(number):
        raise SpecError(f"{what} must be finite, got {value!r}")
    return number


def load_spec(source: str | Path | dict[str, Any]) -> MergeSpec:
    """Parse and validate a spec from a YAML path or an already-loaded dict. Raises SpecError."""
    import yaml

    label = "<dict>"
    if isinstance(source, dict):
        raw = source
    else:
        label = str(source)
        try:
            text = Path(source).read_text(encoding="utf-8")
        except FileNotFoundError as e:
            raise SpecError(f"spec file {label} does not exist") from e
        except (OSError, UnicodeDecodeError) as e:
            raise SpecError(f"cannot read spec {label}: {e}") from e
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise SpecError(f"spec {label} is not valid YAML: {str(e).splitlines()[0]}") from e
        except (ValueError, TypeError, OverflowError, RecursionError) as e:  # bad dates, !!int/!!float, nesting
            raise SpecError(f"spec {label} is not valid YAML: {type(e).__name__}: "
                            f"{(str(e).splitlines() or [''])[0][:200]}") from e
    if not isinstance(raw, dict):
        raise SpecError(f"spec {label} must be a YAML mapping")
    unknown = set(raw) - _TOP_KEYS
    if "slices" in raw:
        raise SpecError(f"spec {label}: `slices` are not supported; list models under `models`")
    if unknown:
        raise SpecError(f"spec {label}: unknown key(s) {', '.join(sorted(map(repr, unknown)))}")
    method = raw.get("merge_method")
    if method not in METHODS:
        raise SpecError(f"spec {label}: unknown merge_method {method!r}; known: {', '.join(METHODS)}")
    base = raw.get("base_model")
    if not isinstance(base, str) or not base:
        raise SpecError(f"spec {label}: base_model must name a checkpoint or a path")
    gparams = raw.get("parameters") or {}
    if not isinstance(gparams, dict):
        raise SpecError(f"spec {label}: parameters must be a mapping")
    bad = set(gparams) - _GLOBAL_PARAMS - _OPTION_PARAMS
    if bad:
        raise SpecError(f"spec {label}: unknown parameter(s) {', '.join(sorted(map(repr, bad)))}")
    normalize = gparams.get("normalize")
    if normalize is not None and not isinstance(normalize, bool):
        raise SpecError(f"spec {label}: normalize must be true or false")
    lam = _number(gparams.get("lambda", 1.0), "lambda")
    t = _number(gparams["t"], "t") if "t" in gparams else None
    options = tuple(sorted((k, v) for k, v in gparams.items() if k in _OPTION_PARAMS))
    for k, v in options:
        if not isinstance(v, (bool, int, float)):
            raise SpecError(f"spec {label}: parameters.{k} must be a single number or true/false, got {v!r}")

    models_raw = raw.get("models")
    if not isinstance(models_raw, list) or not models_raw:
        raise SpecError(f"spec {label}: models must be a non-empty list")
    models: list[ModelEntry] = []
    for i, m in enumerate(models_raw):
        if not isinstance(m, dict) or not isinstance(m.get("model"), str) or not m["model"]:
            raise SpecError(f"spec {label}: models[{i}] must be a mapping with a `model` name or path")
        p = m.get("parameters") or {}
        if not isinstance(p, dict):
            raise SpecError(f"spec {label}: models[{i}].parameters must be a mapping")
        bad = set(p) - _MODEL_PARAMS
        if bad:
            raise SpecError(f"spec {label}: models[{i}] unknown parameter(s) {', '.join(sorted(map(repr, bad)))}")
        if m["model"] == base:
            continue  # MergeKit lists the base among the models; it is not an expert
        needs_weight = method not in _NO_WEIGHT
        if needs_weight and "weight" not in p:
            raise SpecError(f"spec {label}: models[{i}] ({m['model']}) needs parameters.weight")
        weight = _number(p.get("weight", 1.0), f"models[{i}].weight")
        density = _number(p.get("density", 1.0), f"models[{i}].density")
        if not 0.0 < density <= 1.0:
            raise SpecError(f"spec {label}: models[{i}].density must be in (0, 1], got {density:g}")
        gamma = _number(p.get("gamma", 0.01), f"models[{i}].gamma")
        if not 0.0 <= gamma < 1.0:
            raise SpecError(f"spec {label}: models[{i}].gamma must be in [0, 1), got {gamma:g}")
        models.append(ModelEntry(m["model"], weight, density, gamma))
    if not models:
        raise SpecError(f"spec {label}: no expert besides the base model")
    if len({m.ref for m in models}) != len(models):
        raise SpecError(f"spec {label}: a model is listed twice")
    if method == "slerp":
        if len(models) != 1:
            raise SpecError(f"spec {label}: slerp merges exactly two models (the base and one other)")
        if t is None or not 0.0 <= t <= 1.0:
            raise SpecError(f"spec {label}: slerp needs parameters.t in [0, 1]")

    dtype_raw = raw.get("dtype", raw.get("out_dtype"))
    dtype = None
    if dtype_raw is not None:
        if str(dtype_raw).lower() not in DTYPES:
            raise SpecError(f"spec {label}: unsupported dtype {dtype_raw!r}; use float32, bfloat16 or float16")
        dtype = DTYPES[str(dtype_raw).lower()]
    budget = parse_budget(raw["budget"]) if raw.get("budget") is not None else None
    seed = raw.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise SpecError(f"spec {label}: seed must be an integer in [0, 2^63)")
    return MergeSpec(method, base, tuple(models), normalize, lam, t, dtype, budget, seed, source=label,
                     options=options)
