"""Parameter resolution checked against MergeKit's own resolver: random settings (scalars, gradients, filter
lists, nested), tensor names and gradient positions, evaluated level by level by MergeKit 0.1.5's
`parameter_resolver.resolve_parameter` (in its venv, one process for all cases) and by mergepipe's
`core.mergekit_config.resolve_param`; the values must be equal."""

from __future__ import annotations

import json
import random
import subprocess

import pytest
from mergekit_peer import VENV, ensure_mergekit

from mergepipe_db.core.mergekit_config import resolve_param

pytestmark = pytest.mark.mergekit

NAMES = ["model.layers.3.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight", "model.norm.weight",
         "model.embed_tokens.weight", "lm_head.weight", "model.layers.12.input_layernorm.weight"]
FILTERS = [None, "*", "self_attn", "mlp", "layers.3.", "norm", "q_proj", "nothing_matches", ""]

_ORACLE = r"""
import json, sys
from typing import Optional
from pydantic import TypeAdapter
from mergekit.config import ParameterSetting
from mergekit.merge_methods.base import ParameterSpec, ParameterScope
from mergekit.parameter_resolver import resolve_parameter
adapter = TypeAdapter(ParameterSetting)
out = []
for case in json.load(sys.stdin):
    spec = ParameterSpec(case["param"], Optional[float] if case["kind"] == "float" else Optional[bool],
                         ParameterScope.SHARED, default=None)
    levels = [None if lv is None else {k: adapter.validate_python(v) for k, v in lv.items()}
              for lv in case["levels"]]
    out.append(resolve_parameter(spec, levels, tensor_name=case["name"], t=case["t"]))
print(json.dumps(out))
"""


def _setting(rng: random.Random, kind: str, depth: int = 0):
    scalar = (lambda: rng.choice([True, False])) if kind == "bool" else (
        lambda: rng.choice([0, 1, 0.25, -0.5, 0.8, rng.uniform(-2, 2)]))
    r = rng.random()
    if r < 0.3:
        return scalar()
    if r < 0.6 or depth > 0:
        return [scalar() for _ in range(rng.randint(1, 6))]
    entries = []
    for _ in range(rng.randint(1, 4)):
        e = {"value": _setting(rng, kind, depth + 1)}
        f = rng.choice(FILTERS)
        if f is not None:
            e["filter"] = f
        entries.append(e)
    return entries


def test_resolution_equals_mergekits_resolver() -> None:
    ensure_mergekit()
    rng = random.Random(34)
    cases = []
    for _ in range(1000):
        kind = rng.choice(["float", "float", "bool"])
        param = "normalize" if kind == "bool" else rng.choice(["weight", "density", "t"])
        levels = []
        for _ in range(rng.randint(1, 3)):
            levels.append(None if rng.random() < 0.15 else (
                {param: _setting(rng, kind)} if rng.random() < 0.8 else {"other": 1}))
        t = rng.choice([0.0, 1.0, 0.5, 1 / 3, 0.2]) if rng.random() < 0.3 else rng.random()
        cases.append({"param": param, "kind": kind, "levels": levels, "name": rng.choice(NAMES), "t": t})
    proc = subprocess.run([str(VENV / "bin" / "python"), "-c", _ORACLE], input=json.dumps(cases),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    theirs = json.loads(proc.stdout)
    for case, want in zip(cases, theirs):
        got = resolve_param(case["param"], [lv or {} for lv in case["levels"]], case["name"], case["t"])
        if isinstance(want, float) and isinstance(got, float):
            assert got == pytest.approx(want, rel=1e-12, abs=1e-15), case
        else:
            assert got == want, case
