"""The MergeKit config language resolved per tensor (core/mergekit_config.py), against plain references written
here: gradients, filters, precedence, the names parameters match, and every bad input as a one-line SpecError
naming its key path."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from mergepipe_db.core.arch import layer_naming
from mergepipe_db.core.mergekit_config import resolve
from mergepipe_db.core.spec import load_spec
from mergepipe_db.errors import ArchitectureError, SpecError

SUFFIXES = ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.o_proj.weight", "mlp.up_proj.weight",
            "mlp.down_proj.weight", "post_attention_layernorm.weight")


def llama_names(n_layers: int) -> list[str]:
    return (["model.embed_tokens.weight"] + [f"model.layers.{i}.{s}" for i in range(n_layers) for s in SUFFIXES]
            + ["model.norm.weight", "lm_head.weight"])


def recipe(text: str, layers: dict[str, int] | None = None, base: str | None = None):
    spec = load_spec(yaml.safe_load(text))
    assert spec.config is not None
    layers = layers or {}
    return resolve(spec.config, base or spec.config.base_model or "base",
                   lambda ref: llama_names(layers.get(ref, 6)))


def by_name(r) -> dict:
    return {t.name: t for t in r.tensors}


def ref_gradient(values: list[float], i: int, n_layers: int) -> float:
    """MergeKit's rule, plainly: t = i/(L-1) (1 when L = 1), linear interpolation in the list at t·(n-1)."""
    t = i / (n_layers - 1) if n_layers > 1 else 1.0
    return float(np.interp(t * (len(values) - 1), np.arange(len(values)), values))


def test_a_gradient_is_interpolated_over_each_slice_and_t_is_zero_outside_the_layers() -> None:
    values = [0.0, 0.5, 0.3, 0.7, 1.0]
    r = recipe(f"""
merge_method: slerp
base_model: base
slices:
  - sources: [{{model: base, layer_range: [0, 4]}}, {{model: chat, layer_range: [0, 4]}}]
  - sources: [{{model: base, layer_range: [4, 5]}}, {{model: chat, layer_range: [4, 5]}}]
  - sources: [{{model: base, layer_range: [5, 6]}}, {{model: chat, layer_range: [5, 6]}}]
parameters:
  t: {values}
""")
    t = by_name(r)
    for i in range(4):
        assert t[f"model.layers.{i}.mlp.up_proj.weight"].params["t"] == pytest.approx(ref_gradient(values, i, 4),
                                                                                      abs=1e-12)
    assert t["model.layers.4.mlp.up_proj.weight"].params["t"] == 1.0  # a one-layer slice: t = 1
    assert t["model.embed_tokens.weight"].params["t"] == 0.0 and t["lm_head.weight"].params["t"] == 0.0
    assert r.num_layers == 6


def test_filters_first_match_wins_and_an_unmatched_filter_asks_the_next_level() -> None:
    r = recipe("""
merge_method: ties
base_model: base
slices:
  - sources:
      - model: base
        layer_range: [0, 6]
      - model: e0
        layer_range: [0, 6]
        parameters:
          weight:
            - filter: q_proj
              value: 0.9
            - filter: proj
              value: 0.8
          density: [0.8, 0.3, 0.1]
    parameters:
      weight: [{filter: mlp, value: 0.6}]
parameters:
  weight: 0.25
  lambda: [{filter: "*", value: 0.5}]
""")
    t = by_name(r)
    w = {n: dict(x.inputs[0][2])["weight"] for n, x in t.items()}
    assert w["model.layers.2.self_attn.q_proj.weight"] == 0.9
    assert w["model.layers.2.self_attn.o_proj.weight"] == 0.8
    assert w["model.layers.2.mlp.up_proj.weight"] == 0.8  # `proj` matches before the slice level is asked
    assert w["model.layers.2.input_layernorm.weight"] == 0.25  # no source or slice filter matches: top level
    assert w["model.embed_tokens.weight"] == 0.25
    for i in range(6):
        got = dict(t[f"model.layers.{i}.mlp.down_proj.weight"].inputs[0][2])["density"]
        assert got == pytest.approx(ref_gradient([0.8, 0.3, 0.1], i, 6), abs=1e-12)
    assert all(x.params["lambda"] == 0.5 for x in t.values())
    assert [m for m in r.experts] == ["e0"]  # the base receives no model parameters: it is no input
    assert all(len(x.inputs) == 1 for x in t.values())


def test_model_parameters_match_the_source_name_and_global_ones_the_output_name() -> None:
    r = recipe("""
merge_method: task_arithmetic
base_model: base
slices:
  - sources:
      - {model: base, layer_range: [2, 4]}
      - model: e0
        layer_range: [2, 4]
        parameters:
          weight: [{filter: layers.2., value: 0.7}, {value: 0.1}]
parameters:
  lambda: [{filter: layers.0., value: 0.3}, {value: 1.0}]
""")
    t = by_name(r)
    out0 = t["model.layers.0.mlp.up_proj.weight"]
    assert out0.inputs[0][1] == "model.layers.2.mlp.up_proj.weight" and out0.base == ("base", out0.inputs[0][1])
    assert dict(out0.inputs[0][2])["weight"] == 0.7 and out0.params["lambda"] == 0.3
    out1 = t["model.layers.1.mlp.up_proj.weight"]
    assert dict(out1.inputs[0][2])["weight"] == 0.1 and out1.params["lambda"] == 1.0
    assert r.num_layers == 2 and "model.layers.2.mlp.up_proj.weight" not in t


def test_booleans_and_strings_in_a_gradient_pick_an_entry() -> None:
    r = recipe("""
merge_method: ties
base_model: base
models:
  - model: e0
    parameters: {weight: 1}
parameters:
  normalize: [true, false, true]
""")
    t = by_name(r)
    got = [t[f"model.layers.{i}.mlp.up_proj.weight"].params["normalize"] for i in range(6)]
    assert got == [[True, False, True][int(i / 5 * 2)] for i in range(6)]


def test_linear_without_base_takes_every_model_and_top_level_weight_is_a_default() -> None:
    r = recipe("""
merge_method: linear
models:
  - model: base
  - model: e0
    parameters: {weight: 3}
parameters:
  weight: 0.5
""", base="base")
    assert r.experts == ("base", "e0")
    x = by_name(r)["model.norm.weight"]
    assert [dict(p)["weight"] for _pos, _n, p in x.inputs] == [0.5, 3.0]


def test_passthrough_stacks_ranges_and_records_source_layers() -> None:
    r = recipe("""
merge_method: passthrough
slices:
  - sources: [{model: a, layer_range: [0, 3]}]
  - sources: [{model: b, layer_range: [1, 4], parameters: {scale: 2}}]
  - sources: [{model: a, layer_range: [2, 3]}]
""", base="a")
    assert r.num_layers == 7
    assert [list(x) for x in r.layer_sources] == [[("a", 0)], [("a", 1)], [("a", 2)], [("b", 1)], [("b", 2)],
                                                  [("b", 3)], [("a", 2)]]
    t = by_name(r)
    assert t["model.layers.3.mlp.up_proj.weight"].base == ("b", "model.layers.1.mlp.up_proj.weight")
    assert t["model.layers.3.mlp.up_proj.weight"].params == {"scale": 2.0}
    assert t["model.layers.6.mlp.up_proj.weight"].base == ("a", "model.layers.2.mlp.up_proj.weight")
    assert t["lm_head.weight"].base == ("a", "lm_head.weight") and r.experts == ("b",)
    assert all(not x.inputs for x in r.tensors)


def test_sources_with_different_layer_ranges_read_each_their_own_layer_and_the_base_reads_its_own() -> None:
    """MergeKit's `plan_layer`: output layer i of a slice reads layer start + i of every source; θ₀ is the base
    model's own source (listed anywhere in the slice), so the expert's Δ there is θ_chat[its layer] − θ_base[the
    base's layer]; `renumbered` names exactly the inputs whose layer is not the base's."""
    r = recipe("""
merge_method: task_arithmetic
base_model: base
slices:
  - sources: [{model: chat, layer_range: [2, 6], parameters: {weight: [0, 1]}}, {model: base, layer_range: [0, 4]},
              {model: e1, layer_range: [0, 4]}]
  - sources: [{model: base, layer_range: [5, 6]}, {model: chat, layer_range: [0, 1]}, {model: e1, layer_range: [5, 6]}]
parameters: {weight: 0.5}
""")
    t = by_name(r)
    assert r.num_layers == 5 and r.experts == ("chat", "e1")
    assert [list(x) for x in r.layer_sources] == [[("chat", 2 + i), ("base", i), ("e1", i)] for i in range(4)] + [
        [("base", 5), ("chat", 0), ("e1", 5)]]
    want = {}
    for out_l, (base_l, chat_l, e1_l) in enumerate([(0, 2, 0), (1, 3, 1), (2, 4, 2), (3, 5, 3), (5, 0, 5)]):
        for suffix in SUFFIXES:
            x = t[f"model.layers.{out_l}.{suffix}"]
            assert x.base == ("base", f"model.layers.{base_l}.{suffix}")
            assert [(pos, n) for pos, n, _p in x.inputs] == [(0, f"model.layers.{chat_l}.{suffix}"),
                                                              (1, f"model.layers.{e1_l}.{suffix}")]
            want[(0, x.name)] = True
    assert dict(t["model.layers.1.mlp.up_proj.weight"].inputs[0][2])["weight"] == pytest.approx(1 / 3)
    names = [x.name for x in r.tensors]
    assert {(pos, names[i]) for pos, i in r.renumbered()} == set(want)
    assert t["model.embed_tokens.weight"].base == ("base", "model.embed_tokens.weight")


def test_linear_without_base_over_different_ranges_reads_the_first_sources_name_as_base() -> None:
    r = recipe("""
merge_method: linear
slices:
  - sources: [{model: e0, layer_range: [0, 2], parameters: {weight: 1}}, {model: e1, layer_range: [3, 5],
              parameters: {weight: 2}}]
""", base="base")
    x = by_name(r)["model.layers.1.self_attn.q_proj.weight"]
    assert x.base == ("base", "model.layers.1.self_attn.q_proj.weight")
    assert [(pos, n) for pos, n, _p in x.inputs] == [(0, "model.layers.1.self_attn.q_proj.weight"),
                                                      (1, "model.layers.4.self_attn.q_proj.weight")]
    assert {pos for pos, _i in r.renumbered()} == {1}


def test_a_base_missing_from_a_slice_of_different_ranges_is_refused() -> None:
    with pytest.raises(SpecError) as ei:
        recipe("""
merge_method: ties
base_model: base
slices:
  - sources: [{model: base, layer_range: [0, 6]}, {model: e0, layer_range: [0, 6]}]
  - sources: [{model: e0, layer_range: [0, 2]}, {model: e1, layer_range: [2, 4]}]
parameters: {weight: 1}
""")
    assert "slices[1].sources" in str(ei.value) and "'base'" in str(ei.value)
    assert len(str(ei.value).splitlines()) == 1


def test_unknown_keys_are_warned_about_once_each_and_the_merge_goes_on(capsys: pytest.CaptureFixture) -> None:
    spec = load_spec(yaml.safe_load("""
merge_method: ties
base_model: base
chat_template: chatml
frobnicate: 1
models:
  - model: e0
    wat: 2
    parameters: {weight: 1, t: 0.3, epsilonx: 1}
parameters: {rescale: true, weight: [{pattern: mlp, value: 1}]}
"""))
    err = capsys.readouterr().err
    assert err.count("warning") == 1
    for word in ("frobnicate", "chat_template", "models[0].wat", "models[0].parameters.t",
                 "models[0].parameters.epsilonx", "parameters.weight[0].pattern", "filter"):
        assert word in err, word
    assert spec.config is not None


BAD = [
    ("slices:\n  - sources: [{model: a, layer_range: [0, 9]}, {model: b, layer_range: [0, 9]}]\n",
     "slices[0].sources[0].layer_range", True),
    ("slices:\n  - sources: [{model: a, layer_range: [0, 6]}]\n  - sources: [{model: a, layer_range: [0, 2]},"
     " {model: b, layer_range: [0, 3]}]\n", "slices[1].sources[*].layer_range", False),
    ("models: [{model: b, parameters: {weight: []}}]\n", "models[0].parameters.weight", False),
    ("models: [{model: b, parameters: {weight: [{filter: 3, value: 1}]}}]\n", "models[0].parameters.weight[0]"
     ".filter", False),
    ("models: [{model: b, parameters: {weight: [1, x]}}]\n", "models[0].parameters.weight[1]", False),
    ("models: [{model: b}]\nslices: [{sources: [{model: b, layer_range: [0, 1]}]}]\n", "slices, models", False),
    ("slices: [{sources: [{model: b, layer_range: [3, 2]}]}]\n", "slices[0].sources[0].layer_range", False),
]


@pytest.mark.parametrize(("body", "path", "at_resolve"), BAD)
def test_bad_configs_are_one_line_errors_naming_the_key_path(body: str, path: str, at_resolve: bool) -> None:
    text = "merge_method: ties\nbase_model: a\n" + body
    with pytest.raises(SpecError) as ei:
        recipe(text, {"a": 6, "b": 6}) if at_resolve else load_spec(yaml.safe_load(text))
    assert path in str(ei.value) and len(str(ei.value).splitlines()) == 1


def test_passthrough_with_two_sources_and_an_unknown_architecture_are_refused() -> None:
    with pytest.raises(SpecError, match=r"slices\[0\]\.sources: passthrough takes one source"):
        load_spec(yaml.safe_load("merge_method: passthrough\nslices: [{sources: [{model: a, layer_range: [0, 1]},"
                                 " {model: b, layer_range: [0, 1]}]}]"))
    spec = load_spec(yaml.safe_load("merge_method: passthrough\nslices: [{sources: [{model: a, layer_range: "
                                    "[0, 1]}]}]"))
    with pytest.raises(ArchitectureError, match=r"slices\[0\]\.sources\[0\]\.model \(a\).*cannot find"):
        resolve(spec.config, "a", lambda ref: ["encoder.block.0.weight", "shared.weight"])


def test_layer_naming_of_the_common_decoder_layouts() -> None:
    for prefix in ("model.layers.", "transformer.h.", "model.decoder.layers.", "gpt_neox.layers."):
        names = ["wte.weight"] + [f"{prefix}{i}.attn.weight" for i in range(3)] + ["ln_f.weight"]
        nm = layer_naming(names)
        assert nm.prefix == prefix and nm.num_layers == 3 and nm.pre == ("wte.weight",)
        assert nm.post == ("ln_f.weight",)
    with pytest.raises(ArchitectureError, match="not numbered"):
        layer_naming(["model.layers.0.a", "model.layers.2.a"])


def test_a_simple_spec_keeps_the_per_merge_fields() -> None:
    spec = load_spec(yaml.safe_load("merge_method: ties\nbase_model: b\nmodels: [{model: e, parameters: "
                                    "{weight: 1, density: 0.5}}]\nparameters: {lambda: 0.5}"))
    assert spec.config is None and spec.models[0].density == 0.5 and spec.lam == 0.5


def test_another_methods_parameter_is_ignored_without_a_warning(capsys: pytest.CaptureFixture) -> None:
    spec = load_spec(yaml.safe_load("merge_method: task_arithmetic\nbase_model: b\nmodels: [{model: e, parameters: "
                                    "{weight: 1, density: 0.5}}]"))
    assert capsys.readouterr().err == "" and spec.models[0].weight == 1.0


def test_every_method_declares_its_parameters() -> None:
    """`METHOD_PARAMS` (core/spec.py) is the one table of model and global parameters: every method a spec may
    name has a row, and a required parameter is one of its own."""
    from mergepipe_db.core.spec import METHOD_PARAMS, METHODS

    assert set(METHOD_PARAMS) == set(METHODS)
    for decl in METHOD_PARAMS.values():
        assert set(decl.required) <= set(decl.model) | set(decl.global_)
        assert not set(decl.model) & set(decl.global_)


def test_models_form_adds_an_unlisted_base_as_mergekit_does() -> None:
    """`models:` with a base_model not listed: MergeKit appends the base as a source (so slerp with a gradient
    has its two models, and linear takes the base as an input, which then needs a weight)."""
    r = recipe("merge_method: slerp\nbase_model: base\nmodels: [{model: e1}]\nparameters: {t: [0, 1]}")
    assert r.experts == ("e1",) and by_name(r)["model.layers.5.mlp.up_proj.weight"].params["t"] == 1.0
    r = recipe("merge_method: linear\nbase_model: base\nmodels: [{model: e1, parameters: {weight: [1, 2]}}]\n"
               "parameters: {weight: 0.5}")
    assert r.experts == ("e1", "base")
    with pytest.raises(SpecError, match="missing parameter weight for base"):
        recipe("merge_method: linear\nbase_model: base\nmodels: [{model: e1, parameters: {weight: [1, 2]}}]")
    # a plain spec keeps mergepipe's per-merge linear over the listed models
    assert load_spec(yaml.safe_load("merge_method: linear\nbase_model: b\nmodels: [{model: e, parameters: "
                                    "{weight: 2}}]")).config is None
