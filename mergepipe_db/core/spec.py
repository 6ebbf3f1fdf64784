"""Merge specs: MergeKit-compatible YAML plus `budget` and `seed`, and budget parsing.

Example::

    merge_method: ties
    base_model: base                 # catalog name or path
    models:
      - model: expert_00
        parameters: {weight: 0.5, density: 0.5}
    parameters: {normalize: true, lambda: 1.0}
    dtype: bfloat16
    budget: 0.25                     # fraction in [0, 1] of full-read expert bytes, or bytes: 3GiB, 500MB, 2B
    seed: 0

Any MergeKit 0.1.5 config is a spec (slices, gradients, filters, passthrough, ...): `load_spec` validates it
with `core.mergekit_config`; one the per-merge fields below cannot express is kept as `MergeSpec.config` and
resolved per tensor by the planner. `METHOD_PARAMS` is the one table of each method's parameters.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mergepipe_db.core import method_params
from mergepipe_db.errors import BudgetError, SpecError

METHODS = ("linear", "task_arithmetic", "ties", "dare_linear", "dare_ties", "breadcrumbs", "slerp", "passthrough",
           "breadcrumbs_ties", "della", "della_linear", "sce", "nearswap", "ram", "ramplus_tl", "arcee_fusion",
           "model_stock", "nuslerp", "multislerp", "karcher")
DTYPES = {
    "float32": "F32", "fp32": "F32", "f32": "F32",
    "bfloat16": "BF16", "bf16": "BF16",
    "float16": "F16", "fp16": "F16", "f16": "F16",
}


@dataclass(frozen=True)
class MethodParams:
    """The parameters a merge method reads (one row of `METHOD_PARAMS`).

    `model`: per-model parameters (given under a model or source, or at slice/top level as a default for every
    model; the operator gets them in each expert's `ExpertParams`); `global_`: parameters of the merge (given at
    slice or top level only; the operator gets them as keyword arguments, `lambda` as `lam`); `required`: those
    without a default; `base_is_input`: the base model is merged like any other input (linear) rather than being
    θ₀ and receiving no model parameters."""

    model: tuple[str, ...] = ()
    global_: tuple[str, ...] = ()
    required: tuple[str, ...] = ()
    base_is_input: bool = False


#: The one table of which parameters each method reads and how (docs/ARCHITECTURE.md, "… a merge method"): a
#: new method adds its row; a new parameter name also gets its type in `PARAM_TYPES` when it is not a number.
#: Per-tensor resolution (gradients, filters, precedence: core/mergekit_config.py) is generic over it.
_GTA = ("normalize", "lambda", "int8_mask", "rescale")  # the global parameters of MergeKit's task-arithmetic family
METHOD_PARAMS: dict[str, MethodParams] = {
    "linear": MethodParams(("weight",), ("normalize",), ("weight",), base_is_input=True),
    "task_arithmetic": MethodParams(("weight",), ("normalize", "lambda", "int8_mask", "rescale"), ("weight",)),
    "ties": MethodParams(("weight", "density"), ("normalize", "lambda", "int8_mask", "rescale"), ("weight",)),
    "dare_linear": MethodParams(("weight", "density"), ("normalize", "lambda", "int8_mask", "rescale"),
                                ("weight",)),
    "dare_ties": MethodParams(("weight", "density"), ("normalize", "lambda", "int8_mask", "rescale"), ("weight",)),
    "breadcrumbs": MethodParams(("weight", "density", "gamma"), ("normalize", "lambda", "int8_mask", "rescale"),
                                ("weight",)),
    "slerp": MethodParams((), ("t",), ("t",)),
    "passthrough": MethodParams(("scale",), ()),
    "breadcrumbs_ties": MethodParams(("weight", "density", "gamma"), _GTA, ("weight",)),
    "della": MethodParams(("weight", "density", "epsilon"), _GTA, ("weight",)),
    "della_linear": MethodParams(("weight", "density", "epsilon"), _GTA, ("weight",)),
    "sce": MethodParams(("weight",), _GTA + ("select_topk",)),
    "nearswap": MethodParams((), ("t",), ("t",)),
    "ram": MethodParams((), ("epsilon",)),
    "ramplus_tl": MethodParams((), ("epsilon", "r", "alpha")),
    "arcee_fusion": MethodParams((), ()),
    "model_stock": MethodParams((), ("filter_wise",)),
    "nuslerp": MethodParams(("weight",), ("nuslerp_flatten", "nuslerp_row_wise"), ("weight",)),
    "multislerp": MethodParams(("weight",), ("normalize_weights", "eps"), ("weight",)),
    "karcher": MethodParams((), ("max_iter", "tol")),
}
#: parameter types other than float (a number)
#: (`object`: any scalar, checked by the method: rescale is true, false or "classic", core.method_params)
PARAM_TYPES: dict[str, type] = {"normalize": bool, "int8_mask": bool, "rescale": object, "filter_wise": bool,
                                "nuslerp_flatten": bool, "nuslerp_row_wise": bool, "normalize_weights": bool,
                                "max_iter": object}
#: parameters MergeKit has that mergepipe's operators do not read (accepted, without effect: docs/SEMANTICS.md)
UNUSED_PARAMS = ("int8_mask",)


def param_type(name: str) -> type:
    """The value type of parameter `name`: bool or float."""
    return PARAM_TYPES.get(name, float)


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
    """`0.25` → fraction of the full read; `2B`, `500MB`, `3GiB` → bytes.

    A bare number is a fraction in [0, 1]; an absolute budget needs a unit (`2` is an error, not 2 bytes:
    a budget that small selects nothing and silently commits a copy of the base). Raises BudgetError.
    """
    if isinstance(value, Budget):
        return value
    hint = "give a fraction in [0, 1] (0.25) or bytes with a unit (2B, 500MB, 3GiB)"
    if isinstance(value, bool) or value is None:
        raise BudgetError(f"unparsable budget {value!r}: {hint}")
    text = str(value).strip()
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)", text)
    if not m:
        if text.startswith("-"):
            raise BudgetError(f"budget must not be negative, got {text!r}")
        raise BudgetError(f"unparsable budget {text!r}: {hint}")
    number, unit = float(m.group(1)), m.group(2).lower()
    if unit not in _UNITS or unit == "":
        if unit == "":
            if not math.isfinite(number):
                raise BudgetError(f"budget must be finite, got {text!r}")
            if number <= 1.0:
                return Budget(fraction=number)
            raise BudgetError(f"budget {text!r} is a bare number above 1: a bare number is a fraction in [0, 1]; "
                              f"an absolute budget needs a unit ({m.group(1)}B, 500MB, 3GiB)")
        raise BudgetError(f"unknown budget unit {m.group(2)!r} in {text!r}; use B, KB, MB, GB, KiB, MiB, GiB")
    if not math.isfinite(number):
        raise BudgetError(f"budget must be finite, got {text!r}")
    nbytes = number * _UNITS[unit]
    if not nbytes < 2**63:  # also inf: '1e300TiB'
        raise BudgetError(f"budget {text!r} is too large: at most 2^63 - 1 bytes")
    if not float(nbytes).is_integer():
        raise BudgetError(f"budget {text!r} is not a whole number of bytes")
    return Budget(nbytes=int(nbytes))


@dataclass(frozen=True)
class ModelEntry:
    ref: str  # catalog name or path, as written in the spec
    weight: float = 1.0
    density: float = 1.0
    gamma: float = 0.01
    epsilon: float | None = None  #: della's per-model spread (core.method_params); None for other methods


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
    #: a MergeKit config the legacy fields cannot express (slices, gradients, filters, top-level model defaults,
    #: no base_model, passthrough): `core.mergekit_config.MergeConfig`; the planner resolves it per tensor
    config: Any = field(default=None, compare=False)
    #: the spec's text as given (the manifest stores it verbatim)
    text: str | None = field(default=None, compare=False)
    #: write README.md (a model card) beside the output of a spec given as text; copy the tokenizer files
    model_card: bool = field(default=True, compare=False)
    copy_tokenizer: bool = field(default=True, compare=False)
    #: references of `text` replaced before loading (a Hugging Face id -> its cache directory): replay applies
    #: them to the text again (`core.mergekit_config.substitute_refs`)
    aliases: dict[str, str] | None = field(default=None, compare=False)
    #: method-level options as sorted (name, value) pairs: rescale, select_topk, epsilon, r, alpha
    #: (`core.method_params`)
    options: tuple[tuple[str, Any], ...] = ()


def load_spec(source: str | Path | dict[str, Any]) -> MergeSpec:
    """Parse and validate a spec from a YAML path or an already-loaded dict. Raises SpecError."""
    import yaml

    label = "<dict>"
    text: str | None = None
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
    method = raw.get("merge_method")
    if method not in METHODS:
        raise SpecError(f"spec {label}: unknown merge_method {method!r}; known: {', '.join(METHODS)}")
    from mergepipe_db.core.mergekit_config import parse_config

    try:
        cfg = parse_config(raw, method, label)
    except SpecError as e:
        raise SpecError(f"spec {label}: {e}") from e
    if cfg.warnings:
        import sys

        print(f"mergepipe: warning: spec {label}: ignored (unknown to mergepipe): {'; '.join(cfg.warnings)}",
              file=sys.stderr)
    legacy = _legacy_fields(cfg, label)
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
    if legacy is None:  # resolved per tensor by the planner
        refs = [m for m in cfg.models() if m != cfg.base_model]
        if not refs and not (method == "passthrough" or METHOD_PARAMS[method].base_is_input):
            raise SpecError(f"spec {label}: no model to merge besides the base model")
        if text is None:  # a dict: the manifest keeps its YAML form
            text = yaml.safe_dump(raw, sort_keys=False)
        options = method_params.parse_options(method, {k: v for k, v in cfg.parameters.items() if _plain(v)}, label)
        return MergeSpec(method, cfg.base_model or "", tuple(ModelEntry(m) for m in refs), None, 1.0, None, dtype,
                         budget, seed, source=label, config=cfg, text=text, options=options)
    models, normalize, lam, t = legacy
    method_params.check_method(method, models, t, label)
    options = method_params.parse_options(method, dict(cfg.parameters), label)
    return MergeSpec(method, cfg.base_model or "", tuple(models), normalize, lam, t, dtype, budget, seed,
                     source=label, text=text, options=options)


def _plain(value: Any) -> bool:
    return not isinstance(value, (list, dict))


def _legacy_fields(cfg: Any, label: str) -> tuple[list[ModelEntry], bool | None, float, float | None] | None:
    """The models and global parameters of a config the per-merge fields express (a base model, `models:`, one
    number per parameter and model), or None when it needs per-tensor resolution (`MergeSpec.config`)."""
    decl = METHOD_PARAMS[cfg.method]
    [sl] = cfg.slices if len(cfg.slices) == 1 else (None,)
    if (sl is None or cfg.from_slices or not cfg.base_model or cfg.method == "passthrough"
            or not all(_plain(v) for v in cfg.parameters.values())
            or not all(_plain(v) for src in sl.sources for v in src.parameters.values())
            or (decl.base_is_input and any(src.model == cfg.base_model and not src.implicit
                                           for src in sl.sources))):
        return None
    g = cfg.parameters
    normalize = g.get("normalize")
    lam = float(g.get("lambda", 1.0))
    t = float(g["t"]) if "t" in g else None
    models: list[ModelEntry] = []
    defaults = {k: v for k, v in g.items() if k in decl.model}  # top-level model parameters: every model's default
    for i, src in enumerate(sl.sources):
        if src.model == cfg.base_model:
            continue  # MergeKit lists the base among the models; it is not an expert
        p = {**defaults, **src.parameters}
        if "weight" in decl.required and "weight" not in p:
            raise SpecError(f"spec {label}: models[{i}] ({src.model}) needs parameters.weight")
        weight = float(p.get("weight", 1.0))
        density = float(p.get("density", 1.0))
        if not 0.0 < density <= 1.0:
            raise SpecError(f"spec {label}: models[{i}].density must be in (0, 1], got {density:g}")
        gamma = float(p.get("gamma", 0.01))
        if not 0.0 <= gamma < 1.0:
            raise SpecError(f"spec {label}: models[{i}].gamma must be in [0, 1), got {gamma:g}")
        epsilon = None
        if method_params.uses_epsilon_per_model(cfg.method):
            epsilon = float(p.get("epsilon", method_params.DELLA_EPSILON))
        models.append(ModelEntry(src.model, weight, density, gamma, epsilon))
    if not models:
        raise SpecError(f"spec {label}: no expert besides the base model")
    if cfg.method == "slerp":
        if len(models) != 1:
            raise SpecError(f"spec {label}: slerp merges exactly two models (the base and one other)")
        if t is None or not 0.0 <= t <= 1.0:
            raise SpecError(f"spec {label}: slerp needs parameters.t in [0, 1]")
    return models, normalize, lam, t
