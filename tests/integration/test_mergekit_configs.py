"""MergeKit configs run unchanged: the same YAML (models given by path) merged by MergeKit 0.1.5 and by mergepipe
at full budget on a small F32 family (6 layers) must give the same tensor names, shapes, `num_hidden_layers` and
values (≤ 1e-6 relative per tensor); DARE, whose masks MergeKit draws from torch's global generator, is
compared in distribution. One family and catalog per module; one MergeKit run per config."""

from __future__ import annotations

import pytest
from mergekit_peer import load_config, load_dir, run_mergekit

pytestmark = [pytest.mark.mergekit]

N_LAYERS = 6


@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory):
    from mergepipe_db import Catalog
    from mergepipe_db.demo.family import LlamaShape, make_family

    root = tmp_path_factory.mktemp("mkcfg")
    shape = LlamaShape(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=N_LAYERS, num_heads=4,
                       num_kv_heads=2)
    family = make_family(root / "fam", n_experts=2, preset=shape, dtype="float32", seed=3, delta_scale=0.05)
    cat = Catalog.open(str(root / "catalog.duckdb"))
    cat.ingest(family.base, name="base")
    for i, e in enumerate(family.experts):
        cat.ingest(e, name=f"e{i}", base="base")
    return root, family, cat


def _subst(text: str, family) -> str:
    return (text.replace("BASE", str(family.base)).replace("E0", str(family.experts[0]))
            .replace("E1", str(family.experts[1])))


def _both(fam, name: str, text: str):
    root, family, cat = fam
    text = _subst(text, family)
    mk = run_mergekit(text, root / f"mk-{name}")
    spec = root / f"{name}.yml"
    spec.write_text(text)
    cat.merge(str(spec), out=root / f"mp-{name}", budget=1.0)
    return load_dir(mk), load_dir(root / f"mp-{name}"), load_config(mk), load_config(root / f"mp-{name}")


def _assert_equal(mk: dict, mp: dict, mk_cfg: dict, mp_cfg: dict) -> None:
    import torch

    assert sorted(mp) == sorted(mk)
    for name, want in mk.items():
        got = mp[name]
        assert got.shape == want.shape, name
        assert got.dtype == want.dtype == torch.float32, name
        scale = float(want.abs().max()) or 1.0
        err = float((got - want).abs().max())
        assert err <= 1e-6 * scale, f"{name}: max |mergepipe - mergekit| {err:g} (scale {scale:g})"
    assert mp_cfg["num_hidden_layers"] == mk_cfg["num_hidden_layers"]


SLERP = """
slices:
  - sources:
      - model: BASE
        layer_range: [0, 4]
      - model: E0
        layer_range: [0, 4]
  - sources:
      - model: BASE
        layer_range: [4, 6]
      - model: E0
        layer_range: [4, 6]
merge_method: slerp
base_model: BASE
parameters:
  t:
    - filter: self_attn
      value: [0, 0.5, 0.3, 0.7, 1]
    - filter: mlp
      value: [1, 0.5, 0.7, 0.3, 0]
    - value: 0.5
dtype: float32
"""

TIES = """
models:
  - model: BASE
  - model: E0
    parameters:
      density: [0.8, 0.3, 0.1]
      weight: [0.2, 0.9]
  - model: E1
    parameters:
      density: 0.6
merge_method: ties
base_model: BASE
parameters:
  weight: 0.4
  normalize: true
dtype: float32
"""

TASK_ARITHMETIC = """
models:
  - model: E0
    parameters:
      weight:
        - filter: mlp
          value: 0.9
        - filter: self_attn
          value: [0.1, 0.7]
        - value: 0.3
  - model: E1
    parameters:
      weight: 0.5
merge_method: task_arithmetic
base_model: BASE
parameters:
  lambda: 0.8
dtype: float32
"""

LINEAR = """
models:
  - model: E0
    parameters:
      weight: 0.7
  - model: E1
    parameters:
      weight: [0.1, 0.6]
merge_method: linear
dtype: float32
"""

PASSTHROUGH = """
slices:
  - sources:
      - model: BASE
        layer_range: [0, 4]
  - sources:
      - model: E0
        layer_range: [2, 5]
  - sources:
      - model: BASE
        layer_range: [3, 6]
        parameters:
          scale:
            - filter: o_proj
              value: 0.5
            - value: 1.0
merge_method: passthrough
dtype: float32
"""


def test_slerp_slices_filters_gradients_and_ties_with_gradients_equal_mergekit(fam) -> None:
    for name, text in (("slerp", SLERP), ("ties", TIES)):
        _assert_equal(*_both(fam, name, text))


def test_task_arithmetic_filters_and_linear_without_base_equal_mergekit(fam) -> None:
    for name, text in (("ta", TASK_ARITHMETIC), ("linear", LINEAR)):
        _assert_equal(*_both(fam, name, text))


def test_passthrough_stacking_with_a_reused_layer_equals_mergekit(fam) -> None:
    mk, mp, mk_cfg, mp_cfg = _both(fam, "passthrough", PASSTHROUGH)
    _assert_equal(mk, mp, mk_cfg, mp_cfg)
    assert mp_cfg["num_hidden_layers"] == 10
    # output layer 7 is the base's layer 3 again (scaled o_proj aside): a copy, bit for bit
    base = load_dir(fam[1].base)
    for suffix in ("self_attn.q_proj.weight", "mlp.up_proj.weight"):
        assert mp[f"model.layers.7.{suffix}"].equal(base[f"model.layers.3.{suffix}"])
        assert mp[f"model.layers.3.{suffix}"].equal(base[f"model.layers.3.{suffix}"])


def test_dare_ties_with_gradients_matches_mergekit_in_distribution(fam) -> None:
    """DARE's masks differ (MergeKit draws them from torch's global generator): the share of elements changed
    from the base and the mean |change| of the layer tensors agree within a few percent."""
    import torch

    text = """
models:
  - model: BASE
  - model: E0
    parameters:
      density: [0.7, 0.4]
      weight: 0.6
  - model: E1
    parameters:
      density: 0.5
merge_method: dare_ties
base_model: BASE
parameters:
  weight: 0.5
dtype: float32
"""
    mk, mp, mk_cfg, mp_cfg = _both(fam, "dare", text)
    assert sorted(mk) == sorted(mp) and mk_cfg["num_hidden_layers"] == mp_cfg["num_hidden_layers"]
    base = load_dir(fam[1].base)
    layer = [n for n in mk if ".layers." in n and mk[n].ndim == 2]

    def stats(out: dict) -> tuple[float, float]:
        d = torch.cat([(out[n] - base[n]).flatten() for n in layer])
        return float((d != 0).float().mean()), float(d.abs().mean())

    (f_mk, m_mk), (f_mp, m_mp) = stats(mk), stats(mp)
    assert 0.1 < f_mk < 0.95
    assert abs(f_mp - f_mk) < 0.03 * f_mk + 0.005, (f_mp, f_mk)
    assert abs(m_mp - m_mk) < 0.05 * m_mk, (m_mp, m_mk)


# Sources of one slice with different layer ranges (equal lengths): output layer i of a slice merges each
# source's layer start + i; θ₀ is the base model's own layer there (MergeKit's `plan_layer`), so E0's task vector
# at output layer 1 is θ_E0[layer 3] − θ_base[layer 1].
TA_OFFSET = """
slices:
  - sources:
      - model: BASE
        layer_range: [0, 4]
      - model: E0
        layer_range: [2, 6]
        parameters:
          weight: [0.3, 0.9]
      - model: E1
        layer_range: [0, 4]
  - sources:
      - model: BASE
        layer_range: [2, 4]
      - model: E0
        layer_range: [4, 6]
      - model: E1
        layer_range: [0, 2]
merge_method: task_arithmetic
base_model: BASE
parameters:
  weight: 0.5
  lambda: 0.9
dtype: float32
"""

SLERP_OFFSET = """
slices:
  - sources:
      - model: BASE
        layer_range: [0, 4]
      - model: E0
        layer_range: [2, 6]
  - sources:
      - model: BASE
        layer_range: [4, 6]
      - model: E0
        layer_range: [0, 2]
merge_method: slerp
base_model: BASE
parameters:
  t:
    - filter: self_attn
      value: [0.2, 0.8]
    - value: 0.6
dtype: float32
"""

LINEAR_OFFSET = """
slices:
  - sources:
      - model: E0
        layer_range: [0, 4]
        parameters:
          weight: 0.7
      - model: E1
        layer_range: [2, 6]
        parameters:
          weight: [0.2, 0.6]
merge_method: linear
dtype: float32
"""

TIES_OFFSET = """
slices:
  - sources:
      - model: E0
        layer_range: [0, 4]
        parameters:
          density: 0.5
          weight: 0.8
      - model: BASE
        layer_range: [1, 5]
      - model: E1
        layer_range: [2, 6]
        parameters:
          density: [0.9, 0.3]
          weight: 0.6
merge_method: ties
base_model: BASE
dtype: float32
"""


#: a geometric method: its coefficients come from the tensors read (θ_E0 of another layer than θ₀'s)
MODEL_STOCK_OFFSET = """
slices:
  - sources:
      - {model: BASE, layer_range: [0, 4]}
      - {model: E0, layer_range: [2, 6]}
      - {model: E1, layer_range: [1, 5]}
merge_method: model_stock
base_model: BASE
dtype: float32
"""


@pytest.mark.parametrize(("name", "text", "layers"), [("ta-offset", TA_OFFSET, 6), ("slerp-offset", SLERP_OFFSET, 6),
                                                      ("linear-offset", LINEAR_OFFSET, 4),
                                                      ("ties-offset", TIES_OFFSET, 4),
                                                      ("model-stock-offset", MODEL_STOCK_OFFSET, 4)])
def test_sources_of_one_slice_with_different_layer_ranges_equal_mergekit(fam, name: str, text: str,
                                                                         layers: int) -> None:
    mk, mp, mk_cfg, mp_cfg = _both(fam, name, text)
    _assert_equal(mk, mp, mk_cfg, mp_cfg)
    assert mp_cfg["num_hidden_layers"] == layers
    assert sorted(n for n in mp if n.startswith("model.layers.")) == sorted(
        f"model.layers.{i}.{s}" for i in range(layers) for s in {n.split(".", 3)[3] for n in mk if ".layers." in n})
