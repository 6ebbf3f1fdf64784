"""MergeKit 0.1.5's configuration language: slices, layer ranges, gradients, filters and parameter precedence.

`parse_config` validates a loaded YAML mapping into a `MergeConfig` (one-line `SpecError`s naming the key path,
`slices[1].sources[0].layer_range`; unknown keys are collected as warnings, as MergeKit ignores them);
`resolve` turns it, given each model's tensor names, into a `Recipe`: for every output tensor, in output order,
the source tensor each input reads and the parameters resolved for that tensor, exactly as MergeKit does:

- gradients: a list value is interpolated over the layers of an output slice (layer i of L: t = i/(L-1), or 1
  when L = 1; value = linear interpolation in the list at t·(n-1); lists of booleans or strings pick entry
  int(t·(n-1))); tensors outside the layers take t = 0;
- filters: a list of ``{filter, value}`` entries, the first whose filter is absent, ``*`` or a substring of the
  tensor name wins, else the next level is asked;
- precedence: source (model) → slice → top level. Model parameters (`METHOD_PARAMS[m].model`) may be given at
  slice or top level as defaults for every model; global parameters are never read from a model's parameters.
  Global parameters match the output tensor's name, model parameters the source tensor's.

The method table (`core.spec.METHOD_PARAMS`) says which parameters of a method are model and which global ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mergepipe_db.core.arch import LayerNaming, layer_naming
from mergepipe_db.errors import SpecError

Setting = Any  # a scalar, a gradient list, a {filter, value} mapping, or a list of such mappings
_SCALARS = (bool, int, float, str)

TOP_KEYS = {"merge_method", "base_model", "models", "slices", "parameters", "dtype", "out_dtype", "budget", "seed",
            "tokenizer_source", "name"}
#: keys MergeKit has that mergepipe does not use: accepted, named in the warning
IGNORED_TOP_KEYS = {"tokenizer", "chat_template", "modules"}
_SLICE_KEYS = {"sources", "base_model", "parameters", "residual_weight"}
_SOURCE_KEYS = {"model", "layer_range", "parameters"}
_MODEL_KEYS = {"model", "parameters"}
_FILTER_KEYS = {"filter", "value"}


@dataclass(frozen=True)
class SourceDef:
    model: str
    layer_range: tuple[int, int] | None  # None: every layer (the `models:` form)
    parameters: Mapping[str, Setting]
    path: str  # key path in the config, for messages
    implicit: bool = False  # the base model, added to `models:` as MergeKit does when it is not listed


@dataclass(frozen=True)
class SliceDef:
    sources: tuple[SourceDef, ...]
    base_model: str | None
    parameters: Mapping[str, Setting]
    path: str


@dataclass(frozen=True)
class MergeConfig:
    """A validated MergeKit config (`models:` is the one-slice case over all layers, `from_slices` False)."""

    method: str
    base_model: str | None
    slices: tuple[SliceDef, ...]
    from_slices: bool
    parameters: Mapping[str, Setting]
    tokenizer_source: str | None
    warnings: tuple[str, ...] = ()

    def models(self) -> list[str]:
        """Every model the config names (base first when given), once each, in order of appearance."""
        refs = [self.base_model] if self.base_model else []
        for s in self.slices:
            refs += [s.base_model] if s.base_model else []
            refs += [src.model for src in s.sources]
        return list(dict.fromkeys(refs))


def _ref(value: Any, path: str) -> str:
    if isinstance(value, str) and value:
        return value
    raise SpecError(f"{path} must name a model (a catalog name, a path or org/name)")


def _check_setting(value: Setting, path: str, kind: type, warnings: list[str]) -> None:
    """A setting's shape and leaf types: scalars of `kind`, non-empty gradient lists, {filter, value} entries
    (other keys of an entry are ignored, as MergeKit does, and warned about: `pattern:` is no filter)."""
    if isinstance(value, dict):
        value = [value]
    if isinstance(value, list):
        if not value:
            raise SpecError(f"{path}: a gradient list must not be empty")
        if all(isinstance(v, dict) for v in value):
            for i, cond in enumerate(value):
                _unknown(cond, _FILTER_KEYS, f"{path}[{i}]", warnings)
                if "value" not in cond:
                    raise SpecError(f"{path}[{i}] has no `value`")
                f = cond.get("filter")
                if f is not None and not isinstance(f, str):
                    raise SpecError(f"{path}[{i}].filter must be a string, got {f!r}")
                _check_setting(cond["value"], f"{path}[{i}].value", kind, warnings)
            return
        for i, v in enumerate(value):
            if isinstance(v, (dict, list)):
                raise SpecError(f"{path}[{i}]: a gradient holds scalars, got {v!r}")
            _check_scalar(v, f"{path}[{i}]", kind)
        return
    _check_scalar(value, path, kind)


def _check_scalar(v: Any, path: str, kind: type) -> None:
    if kind is bool:
        if not isinstance(v, bool):
            raise SpecError(f"{path} must be true or false, got {v!r}")
    elif kind is float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise SpecError(f"{path} must be a number, got {v!r}")
        try:
            ok = math.isfinite(float(v))
        except OverflowError:
            ok = False
        if not ok:
            raise SpecError(f"{path} must be finite, got {v!r}")
    elif not isinstance(v, _SCALARS):
        raise SpecError(f"{path} must be a scalar, got {v!r}")


def _params(raw: Any, path: str, method: str, *, level: str, warnings: list[str]) -> dict[str, Setting]:
    """The parameters at one level, checked; names the method does not use are warned about and dropped."""
    from mergepipe_db.core.spec import METHOD_PARAMS, param_type

    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise SpecError(f"{path} must be a mapping")
    decl = METHOD_PARAMS[method]
    out: dict[str, Setting] = {}
    for name, value in raw.items():
        if not isinstance(name, str) or not name.isprintable():
            raise SpecError(f"{path}: parameter name {name!r} is not a printable string")
        if level == "model" and name not in decl.model and any(name in d.global_ for d in METHOD_PARAMS.values()):
            warnings.append(f"{path}.{name} (a global parameter, never read from a model's parameters)")
            continue
        if name not in decl.model and name not in decl.global_:
            if not any(name in d.model or name in d.global_ for d in METHOD_PARAMS.values()):
                warnings.append(f"{path}.{name} (not a parameter of any method)")
            continue  # another method's parameter (density under task_arithmetic): ignored, as MergeKit does
        _check_setting(value, f"{path}.{name}", param_type(name), warnings)
        out[name] = value
    return out


def _unknown(raw: dict, known: set[str], path: str, warnings: list[str]) -> None:
    for k in raw:
        if not isinstance(k, str) or not k.isprintable():
            raise SpecError(f"{path}: key {k!r} is not a printable string")
        if k not in known:
            note = " (the old spelling of `filter:`, ignored: the entry has no filter)" if k == "pattern" else ""
            warnings.append(f"{path}.{k}{note}" if path else f"{k}{note}")


def parse_config(raw: dict[str, Any], method: str, label: str) -> MergeConfig:
    """Validate the MergeKit part of a loaded spec (`method` already checked against `core.spec.METHODS`)."""
    warnings: list[str] = []
    _unknown(raw, TOP_KEYS | IGNORED_TOP_KEYS, "", warnings)
    warnings += [f"{k} (MergeKit's; not used by mergepipe)" for k in sorted(IGNORED_TOP_KEYS & set(raw))]
    base = raw.get("base_model")
    base = None if base is None else _ref(base, "base_model")
    if "slices" in raw and "models" in raw:
        raise SpecError("slices, models: give one of them, not both")
    top = _params(raw.get("parameters"), "parameters", method, level="top", warnings=warnings)
    slices: list[SliceDef] = []
    if "slices" in raw:
        sl = raw["slices"]
        if not isinstance(sl, list) or not sl:
            raise SpecError("slices must be a non-empty list")
        for i, s in enumerate(sl):
            p = f"slices[{i}]"
            if not isinstance(s, dict):
                raise SpecError(f"{p} must be a mapping with `sources`")
            _unknown(s, _SLICE_KEYS, p, warnings)
            if s.get("residual_weight") is not None:
                raise SpecError(f"{p}.residual_weight is not supported")
            srcs = s.get("sources")
            if not isinstance(srcs, list) or not srcs:
                raise SpecError(f"{p}.sources must be a non-empty list")
            sources = []
            for j, src in enumerate(srcs):
                q = f"{p}.sources[{j}]"
                if not isinstance(src, dict):
                    raise SpecError(f"{q} must be a mapping with `model` and `layer_range`")
                _unknown(src, _SOURCE_KEYS, q, warnings)
                lr = src.get("layer_range")
                if (not isinstance(lr, list) or len(lr) != 2
                        or not all(isinstance(x, int) and not isinstance(x, bool) for x in lr)):
                    raise SpecError(f"{q}.layer_range must be [start, end], two integers")
                if not 0 <= lr[0] < lr[1]:
                    raise SpecError(f"{q}.layer_range {lr} must have 0 <= start < end")
                sources.append(SourceDef(_ref(src.get("model"), f"{q}.model"), (lr[0], lr[1]),
                                         _params(src.get("parameters"), f"{q}.parameters", method, level="model",
                                                 warnings=warnings), q))
            lengths = {b - a for a, b in (x.layer_range for x in sources if x.layer_range)}
            if len(lengths) > 1:
                raise SpecError(f"{p}.sources[*].layer_range: the sources of a slice must have equal lengths, got "
                                f"{[list(x.layer_range or ()) for x in sources]}")
            sb = s.get("base_model")
            slices.append(SliceDef(tuple(sources), None if sb is None else _ref(sb, f"{p}.base_model"),
                                   _params(s.get("parameters"), f"{p}.parameters", method, level="slice",
                                           warnings=warnings), p))
    else:
        models = raw.get("models")
        if not isinstance(models, list) or not models:
            raise SpecError("models must be a non-empty list (or give slices)")
        sources = []
        for i, m in enumerate(models):
            q = f"models[{i}]"
            if not isinstance(m, dict):
                raise SpecError(f"{q} must be a mapping with a `model` name or path")
            _unknown(m, _MODEL_KEYS | {"layer_range"}, q, warnings)
            sources.append(SourceDef(_ref(m.get("model"), f"{q}.model"), None,
                                     _params(m.get("parameters"), f"{q}.parameters", method, level="model",
                                             warnings=warnings), q))
        if len({s.model for s in sources}) != len(sources):
            raise SpecError("models: a model is listed twice")
        if base is not None and base not in {s.model for s in sources}:  # MergeKit adds it, last
            sources.append(SourceDef(base, None, {}, "base_model", implicit=True))
        slices.append(SliceDef(tuple(sources), None, {}, "models"))
    if method == "passthrough":
        for s in slices:
            if len(s.sources) != 1:
                raise SpecError(f"{s.path}.sources: passthrough takes one source per slice, got {len(s.sources)}")
    ts = raw.get("tokenizer_source")
    if ts is not None and not isinstance(ts, str):
        raise SpecError("tokenizer_source must be `base` or a model name")
    if ts == "union":
        raise SpecError("tokenizer_source: union is not supported (give `base` or a model)")
    return MergeConfig(method, base, tuple(slices), "slices" in raw, top, ts, tuple(dict.fromkeys(warnings)))


def _ref_holders(raw: dict[str, Any]) -> list[tuple[dict, str]]:
    """(mapping, key) of every place a loaded config names a model: base_model, tokenizer_source, the models,
    the slices' base models and sources."""
    holders: list[tuple[dict, str]] = [(raw, "base_model"), (raw, "tokenizer_source")]
    holders += [(m, "model") for m in raw.get("models") or [] if isinstance(m, dict)]
    for s in raw.get("slices") or []:
        if isinstance(s, dict):
            holders.append((s, "base_model"))
            holders += [(src, "model") for src in s.get("sources") or [] if isinstance(src, dict)]
    return [(h, k) for h, k in holders if isinstance(h.get(k), str)]


def substitute_refs(raw: dict[str, Any], mapping: Mapping[str, str]) -> None:
    """Replace, in a loaded config, each model reference that `mapping` names by what it maps to."""
    for holder, key in _ref_holders(raw):
        holder[key] = mapping.get(holder[key], holder[key])


def model_refs(raw: dict[str, Any]) -> list[str]:
    """Every model reference of a loaded config, once each, in order of appearance (tokenizer_source's `base`
    and `union` are no references)."""
    refs = [h[k] for h, k in _ref_holders(raw) if not (k == "tokenizer_source" and h[k] in ("base", "union"))]
    return list(dict.fromkeys(refs))


# --- resolution --------------------------------------------------------------------------------------------


def evaluate(setting: Setting, tensor_name: str, t: float, kind: type) -> Any:
    """A setting's value for one tensor at gradient position t (MergeKit's `evaluate_setting`); None when no
    filter matches (the next level is asked)."""
    if isinstance(setting, dict):
        setting = [setting]
    if isinstance(setting, list):
        if all(isinstance(e, dict) for e in setting):
            for cond in setting:
                f = cond.get("filter")
                if f is None or f == "*" or (tensor_name and f in tensor_name):
                    return evaluate(cond["value"], tensor_name, t, kind)
            return None
        values = [_convert(e, kind) for e in setting]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            return values[int(t * (len(values) - 1))]
        scaled = t * (len(values) - 1)
        i0 = int(scaled)
        i1 = min(len(values) - 1, i0 + 1)
        frac = scaled - i0
        return _convert((1 - frac) * values[i0] + frac * values[i1], kind)
    return _convert(setting, kind)


def _convert(v: Any, kind: type) -> Any:
    if kind is float and isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    return v


def resolve_param(name: str, levels: list[Mapping[str, Setting]], tensor_name: str, t: float) -> Any:
    """The first value a level gives (most specific first), or None."""
    from mergepipe_db.core.spec import param_type

    for level in levels:
        if name in level:
            v = evaluate(level[name], tensor_name, t, param_type(name))
            if v is not None:
                return v
    return None


@dataclass(frozen=True)
class TensorRecipe:
    """One output tensor: where each input reads it and the parameters resolved for it.

    `inputs` holds (expert position, source tensor name, model parameters) for the experts of this tensor's
    slice; `base` is (model, source tensor name) of the tensor the base reads; `params` the global parameters."""

    name: str
    base: tuple[str, str]
    inputs: tuple[tuple[int, str, Mapping[str, Any]], ...]
    params: Mapping[str, Any]
    t: float


@dataclass(frozen=True)
class Recipe:
    """A config resolved against its models' tensor names: the output tensors in output order."""

    method: str
    base: str  # the model whose coordinates the merge is in (its tensors are θ₀)
    experts: tuple[str, ...]  # the models read as experts, in order
    tensors: tuple[TensorRecipe, ...]
    num_layers: int
    #: per output layer: [(model, source layer), ...] it came from
    layer_sources: tuple[tuple[tuple[str, int], ...], ...] = field(default=())

    def renumbered(self) -> frozenset[tuple[int, int]]:
        """(expert position, output tensor index) of every input whose source tensor is not θ₀'s (a slice whose
        sources have different layer ranges): its Δ = θ_k[source] − θ₀[base source] is not the Δ the catalog
        holds statistics of (that is θ_k[source] − θ_base[source]), so it is read whole, as θ."""
        return frozenset((pos, i) for i, r in enumerate(self.tensors) for pos, src, _mp in r.inputs
                         if src != r.base[1])

    def to_json(self) -> dict[str, Any]:
        return {"method": self.method, "base": self.base, "experts": list(self.experts),
                "num_hidden_layers": self.num_layers,
                "layer_sources": [[list(x) for x in layer] for layer in self.layer_sources],
                "tensors": [[r.name, list(r.base), [[p, n, dict(mp)] for p, n, mp in r.inputs], dict(r.params)]
                            for r in self.tensors]}


def resolve(cfg: MergeConfig, base: str, names_of: Callable[[str], list[str]]) -> Recipe:
    """Resolve `cfg` against the models' tensor names (`names_of(model)`, checkpoint order). `base` is the model
    whose tensors are θ₀ (the config's `base_model`, or the catalog base the planner chose)."""
    from mergepipe_db.core.spec import METHOD_PARAMS

    decl = METHOD_PARAMS[cfg.method]
    namings: dict[str, LayerNaming] = {}

    def naming(model: str, path: str) -> LayerNaming:
        if model not in namings:
            namings[model] = layer_naming(names_of(model), label=f"{path} ({model})")
        return namings[model]

    slices: list[tuple[SliceDef, list[tuple[int, int]]]] = []
    for s in cfg.slices:
        ranges = []
        for src in s.sources:
            nm = naming(src.model, f"{src.path}.model")
            lo, hi = src.layer_range or (0, nm.num_layers)
            if hi > nm.num_layers:
                raise SpecError(f"{src.path}.layer_range [{lo}, {hi}] is out of bounds: {src.model} has "
                                f"{nm.num_layers} layers")
            ranges.append((lo, hi))
        if len({b - a for a, b in ranges}) > 1:
            raise SpecError(f"{s.path}.sources: the sources of a slice cover unequal numbers of layers "
                            f"{[list(r) for r in ranges]}")
        if (cfg.method != "passthrough" and len(set(ranges)) > 1 and not decl.base_is_input
                and base not in {src.model for src in s.sources}):
            raise SpecError(f"{s.path}.sources: the base model {base!r} is no source of this slice, whose sources "
                            f"have different layer ranges {[list(r) for r in ranges]}: the layer θ₀ is read from "
                            f"is undefined (list the base model with its layer_range)")
        slice_base = s.base_model or cfg.base_model
        if slice_base is not None and slice_base != (cfg.base_model or slice_base):
            raise SpecError(f"{s.path}.base_model: a slice base other than the config's base_model is not "
                            f"supported")
        slices.append((s, ranges))

    # experts: every source model (the base too where the method takes it as an input), in order
    experts: list[str] = []
    for s, _r in slices:
        for src in s.sources:
            is_input = decl.base_is_input or src.model != base
            if is_input and src.model not in experts and cfg.method != "passthrough":
                experts.append(src.model)
    if cfg.method == "passthrough":
        experts = [m for m in dict.fromkeys(src.model for s, _r in slices for src in s.sources) if m != base]
    position = {m: i for i, m in enumerate(experts)}
    if cfg.method != "passthrough" and not experts:
        raise SpecError("no model to merge besides the base model")
    if cfg.method == "slerp":
        for s, _r in slices:
            if len(s.sources) != 2 or base not in [x.model for x in s.sources]:
                raise SpecError(f"{s.path}.sources: slerp merges exactly two models, the base model and one other")

    out: list[TensorRecipe] = []
    layer_sources: list[tuple[tuple[str, int], ...]] = []

    def add(name: str, s: SliceDef, src_names: list[tuple[str, str]], t: float) -> None:
        levels_g = [s.parameters, cfg.parameters]
        params = {}
        for p in decl.global_:
            v = resolve_param(p, levels_g, name, t)
            if v is None and p in decl.required:
                raise SpecError(f"{s.path}: missing parameter {p} for {name}")
            if v is not None:
                params[p] = v
        # θ₀ is the base model's own source tensor in this slice (MergeKit gathers each input's tensor from its
        # own layer_range[0] + offset); a slice without the base (linear) reads the first source's tensor name
        base_src = next((n for m, n in src_names if m == base), src_names[0][1])
        if cfg.method == "passthrough":
            base_src = src_names[0][1]
        inputs = []
        by_model = {src.model: src for src in s.sources}
        for m, src_name in src_names:
            if m not in position and cfg.method != "passthrough":
                continue
            src = by_model[m]
            mp = {}
            for p in decl.model:
                v = resolve_param(p, [src.parameters, s.parameters, cfg.parameters], src_name, t)
                if v is None and p in decl.required:
                    raise SpecError(f"{src.path}: missing parameter {p} for {m} ({src_name})")
                if v is not None:
                    mp[p] = v
            _check_ranges(mp, f"{src.path}.parameters ({src_name})")
            if cfg.method == "passthrough":
                params.update({k: v for k, v in mp.items()})
                continue
            inputs.append((position[m], src_name, mp))
        _check_ranges(params, f"{s.path} ({name})")
        base_model = src_names[0][0] if cfg.method == "passthrough" else base
        out.append(TensorRecipe(name, (base_model, base_src), tuple(inputs), params, t))

    first, last = slices[0][0], slices[-1][0]
    pre_names = naming(first.sources[0].model, first.sources[0].path).pre
    for name in pre_names:
        out_ = [(src.model, name) for src in first.sources]
        add(name, first, out_, 0.0)
    out_naming = naming(first.sources[0].model, first.sources[0].path)
    layer = 0
    for s, ranges in slices:
        length = ranges[0][1] - ranges[0][0]
        for i in range(length):
            t = i / (length - 1) if length > 1 else 1.0
            src_layers = [(src.model, lo + i) for src, (lo, _hi) in zip(s.sources, ranges)]
            first_nm = naming(s.sources[0].model, s.sources[0].path)
            for name0 in first_nm.layers[src_layers[0][1]]:
                suffix = first_nm.suffix(name0)
                src_names = []
                for (m, li), src in zip(src_layers, s.sources):
                    nm = naming(m, src.path)
                    cand = f"{nm.prefix}{li}.{suffix}"
                    if cand not in nm.layers[li]:
                        raise SpecError(f"{src.path}: {m} has no tensor {cand!r} (layer {li} of the slice)")
                    src_names.append((m, cand))
                add(f"{out_naming.prefix}{layer}.{suffix}", s, src_names, t)
            layer_sources.append(tuple(src_layers))
            layer += 1
    for name in naming(last.sources[0].model, last.sources[0].path).post:
        add(name, last, [(src.model, name) for src in last.sources], 0.0)
    return Recipe(cfg.method, base, tuple(experts), tuple(out), layer, tuple(layer_sources))


def _check_ranges(params: Mapping[str, Any], where: str) -> None:
    d = params.get("density")
    if d is not None and not 0.0 < d <= 1.0:
        raise SpecError(f"{where}: density must be in (0, 1], got {d:g}")
    g = params.get("gamma")
    if g is not None and not 0.0 <= g < 1.0:
        raise SpecError(f"{where}: gamma must be in [0, 1), got {g:g}")
    t = params.get("t")
    if t is not None and not 0.0 <= t <= 1.0:
        raise SpecError(f"{where}: t must be in [0, 1], got {t:g}")
