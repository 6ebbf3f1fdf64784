"""Fuzzing the text a user hands mergepipe: the shard index JSON of a checkpoint directory
(`formats.hf_layout.resolve_checkpoint`), the merge spec YAML (`spec.load_spec`) and budgets (`spec.parse_budget`).
Whatever the input, only MergePipeError subclasses may escape, with one-line messages; what is accepted
satisfies the parser's invariants.

The default run tries ~100 examples a target. `pytest -m fuzz tests/core/test_fuzz_inputs.py` runs each target for
MERGEPIPE_FUZZ_SECONDS (default 60) in batches of fresh random examples and prints the executions; with
MERGEPIPE_FUZZ_REPORT=path.json it also records them there (benchmarks/reliability.py reads that file).
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from mergepipe_db.core.spec import METHODS, load_spec, parse_budget
from mergepipe_db.errors import MergePipeError
from mergepipe_db.formats.hf_layout import INDEX_FILE, resolve_checkpoint

FAST = settings(max_examples=100, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
EXECUTIONS: Counter = Counter()

SHARDS = {"model-00001-of-00002.safetensors": ["a", "b"], "model-00002-of-00002.safetensors": ["c"]}


def _refused(e: MergePipeError) -> None:
    assert len(str(e).splitlines()) <= 1, repr(str(e))


# --- targets --------------------------------------------------------------------------------------


def index_target(root: Path, doc: bytes) -> None:
    """Write `doc` as the shard index of `root` (which holds SHARDS) and resolve the directory."""
    EXECUTIONS["index_json"] += 1
    (root / INDEX_FILE).write_bytes(doc)
    try:
        layout = resolve_checkpoint(root)
    except MergePipeError as e:
        _refused(e)
        return
    real = root.resolve()
    for header in layout.files:
        assert Path(header.path).resolve().parent == real
    wm = json.loads(doc)["weight_map"]
    assert set(layout.tensor_file) == set(wm)
    for name, i in layout.tensor_file.items():
        assert Path(layout.files[i].path).name == wm[name]


def spec_text_target(path: Path, text: str) -> None:
    EXECUTIONS["spec_yaml"] += 1
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        spec = load_spec(path)
    except MergePipeError as e:
        _refused(e)
        return
    _check_spec(spec)


def spec_dict_target(doc: dict) -> None:
    EXECUTIONS["spec_yaml"] += 1
    try:
        spec = load_spec(doc)
    except MergePipeError as e:
        _refused(e)
        return
    _check_spec(spec)


def budget_target(value: object) -> None:
    EXECUTIONS["budget"] += 1
    try:
        b = parse_budget(value)
    except MergePipeError as e:
        _refused(e)
        return
    assert (b.fraction is not None and 0.0 <= b.fraction <= 1.0) or (b.nbytes is not None and 0 <= b.nbytes < 2**63)
    assert 0 <= b.resolve(10**12) < 2**63


def _check_spec(spec) -> None:
    # a MergeKit config resolved per tensor (spec.config) may have no base_model (linear, passthrough) and, for
    # linear and passthrough, no model besides it
    assert spec.method in METHODS and isinstance(spec.base, str)
    assert (spec.models and spec.base) or spec.config is not None
    assert spec.models or spec.method in ("linear", "passthrough")
    assert all(0.0 < m.density <= 1.0 and 0.0 <= m.gamma < 1.0 for m in spec.models)
    assert len({m.ref for m in spec.models}) == len(spec.models) and 0 <= spec.seed < 2**63
    if spec.budget is not None:
        assert 0 <= spec.budget.resolve(10**12) < 2**63


# --- strategies -------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=16)
shard_names = st.sampled_from([*SHARDS, "../outside.safetensors", "/etc/passwd", "sub/x.safetensors", "..", ".",
                               "", "pytorch_model.bin", "missing.safetensors", INDEX_FILE, "config.json",
                               "model-00001-of-00002.safetensors\x00", "MODEL-00001-OF-00002.safetensors"]) | st.text(
    max_size=24)
tensor_names = st.sampled_from(["a", "b", "c", "d", "", "a\x00", "x" * 1025, "../a"]) | st.text(max_size=12)
index_docs = st.fixed_dictionaries({"weight_map": st.dictionaries(tensor_names, shard_names, max_size=5)},
                                   optional={"metadata": json_values})
index_bytes = st.one_of(
    st.binary(max_size=200),
    json_values.map(lambda v: json.dumps(v).encode()),
    index_docs.map(lambda d: json.dumps(d).encode()),
    st.just({"weight_map": {t: s for s, ts in SHARDS.items() for t in ts}}).map(lambda d: json.dumps(d).encode()),
    st.tuples(index_docs, st.integers(0, 400)).map(lambda x: json.dumps(x[0]).encode()[: x[1]]),
    st.integers(1, 5000).map(lambda n: b'{"weight_map": ' + b"[" * n),
)

YAML_TOKENS = ["merge_method:", " ties", " linear", " slerp", "models:", "\n- model: e0", "\n- model: base",
               "\n  parameters:", " {weight: 1, density: 0.5}", "budget:", " 0.5", " 1e300TiB", " -3", " 2020-13-45",
               " !!float x", " !!int 0x", " !!binary '*'", " &a", " *a", "[", "]", "{", "}", "\n", "  ", "- ", ": ",
               "seed:", " 99999999999999999999999", " -1", "? ", "|", ">", "'", '"', "#", "dtype:", " bfloat16",
               "base_model:", " base", "parameters:", " {normalize: true, lambda: .5, t: 2}", "slices:", " ~",
               " .nan", " .inf", " 1_000", " 0o17", " 2001-12-14t21:59:43.10+99:99", "\t", "%YAML 1.1\n", "---\n"]
spec_text = st.one_of(st.text(max_size=300), st.lists(st.sampled_from(YAML_TOKENS), max_size=40).map("".join),
                      st.integers(1, 1200).map(lambda n: "a: " + "[" * n))
values = st.one_of(json_values, st.sampled_from([0, 0.5, 1, -1, 1e300, 10**400, float("inf"), float("nan"), True,
                                                 "0.5", "1e300TiB", "3GiB", "x", "", [1, 2], {"a": 1}]))
model_entries = st.fixed_dictionaries(
    {"model": st.sampled_from(["e0", "e1", "base", "", "../x"]) | values},
    optional={"parameters": st.dictionaries(st.sampled_from(["weight", "density", "gamma", "epsilon", "x"]), values,
                                            max_size=3) | values})
spec_dicts = st.fixed_dictionaries(
    {"merge_method": st.sampled_from([*METHODS, "magic"]) | values, "base_model": st.sampled_from(["base"]) | values,
     "models": st.lists(model_entries, max_size=3) | values},
    optional={"parameters": st.dictionaries(st.sampled_from(["normalize", "lambda", "t", "rescale", "select_topk", "r",
                                                                   "alpha", "epsilon", "zzz"]), values,
                                            max_size=3) | values,
              "dtype": st.sampled_from(["bfloat16", "fp32", "int8"]) | values, "budget": values, "seed": values,
              "slices": values, "extra": values})
budget_values = st.one_of(
    st.text(max_size=20), values,
    st.tuples(st.floats(allow_nan=True, allow_infinity=True) | st.integers(-10, 10**30),
              st.sampled_from(["", "B", "KB", "MiB", "GiB", "TiB", "tib", "e", " GB", "XB"])).map(
        lambda x: f"{x[0]}{x[1]}"))


# --- fixtures and in-suite runs --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def index_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import numpy as np

    root = tmp_path_factory.mktemp("fuzz_index") / "ckpt"
    root.mkdir()
    for shard, names in SHARDS.items():
        save_file({n: np.ones(2, dtype=np.float32) for n in names}, str(root / shard))
    save_file({"a": np.ones(2, dtype=np.float32)}, str(root.parent / "outside.safetensors"))
    (root / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")  # a pickle: must never be opened
    (root / "sub").mkdir()
    return root


@pytest.fixture(scope="module")
def spec_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz_spec") / "spec.yml"


def test_index_json_only_refuses_with_mergepipe_errors(index_root: Path) -> None:
    FAST(given(index_bytes)(lambda doc: index_target(index_root, doc)))()


def test_spec_yaml_text_only_refuses_with_mergepipe_errors(spec_path: Path) -> None:
    FAST(given(spec_text)(lambda text: spec_text_target(spec_path, text)))()


def test_spec_dicts_and_their_yaml_only_refuse_with_mergepipe_errors(spec_path: Path) -> None:
    def both(doc: dict) -> None:
        spec_dict_target(doc)
        spec_text_target(spec_path, yaml.safe_dump(doc, allow_unicode=True))

    FAST(given(spec_dicts)(both))()


def test_budgets_only_refuse_with_budget_errors() -> None:
    FAST(given(budget_values)(budget_target))()


def test_known_crashers_are_refused(index_root: Path, spec_path: Path) -> None:
    """Inputs that escaped as raw Python errors before (OverflowError, ValueError, RecursionError): each is now a
    named, one-line refusal."""
    from mergepipe_db.errors import BudgetError, SpecError

    ok = "merge_method: linear\nbase_model: b\nmodels: [{model: e, parameters: {weight: 1}}]\n"
    assert load_spec(_write(spec_path, ok)).method == "linear"
    for text in (ok + "budget: 1e300TiB", ok + "seed: 2020-13-45", ok + "seed: !!float x", ok + "seed: !!int 0x",
                 ok + "seed: 99999999999999999999999", ok.replace("weight: 1", "weight: 1" + "0" * 400),
                 ok + "budget: 2001-12-14t21:59:43.10+99:99", "a: " + "[" * 5000, "- " * 3000 + "x",
                 ok + '"bogus\\r": 1', ok + 'parameters: {"x\\ny": 1}',
                 ok.replace("weight: 1", 'weight: 1, "\\r": 0')):  # unknown keys holding line breaks
        with pytest.raises(SpecError) as ei:
            load_spec(_write(spec_path, text))
        _refused(ei.value)
    with pytest.raises(BudgetError):
        parse_budget("1e300TiB")
    index_target(index_root, b'{"weight_map": ' + b"[" * 100000)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# --- the long run (pytest -m fuzz) ---------------------------------------------------------------------------


def _for_a_while(name: str, strategy, target, seconds: float) -> int:
    """Run `target` on fresh random examples of `strategy` until `seconds` pass; return the executions."""
    start, deadline, n = EXECUTIONS[name], time.monotonic() + seconds, 50
    while (left := deadline - time.monotonic()) > 0:
        t0 = time.monotonic()
        settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate, Phase.shrink],
                 suppress_health_check=list(HealthCheck))(given(strategy)(target))()
        per = (time.monotonic() - t0) / n
        n = max(10, min(10_000, int(min(left, 5.0) / max(per, 1e-6))))  # batches of about 5 s
    return EXECUTIONS[name] - start


def _report(name: str, n: int, seconds: float) -> None:
    print(f"fuzz {name}: {n} executions in {seconds:.0f} s, no escape")
    path = os.environ.get("MERGEPIPE_FUZZ_REPORT")
    if path:
        p = Path(path)
        doc = json.loads(p.read_text()) if p.exists() else {}
        doc[name] = {"executions": n, "seconds": seconds}
        p.write_text(json.dumps(doc, indent=2))


SECONDS = float(os.environ.get("MERGEPIPE_FUZZ_SECONDS", "60"))


@pytest.mark.fuzz
def test_fuzz_index_json_for_a_while(index_root: Path) -> None:
    t0 = time.monotonic()
    n = _for_a_while("index_json", index_bytes, lambda doc: index_target(index_root, doc), SECONDS)
    _report("index_json", n, time.monotonic() - t0)


@pytest.mark.fuzz
def test_fuzz_spec_yaml_for_a_while(spec_path: Path) -> None:
    t0 = time.monotonic()
    texts = st.one_of(spec_text, spec_dicts.map(lambda d: yaml.safe_dump(d, allow_unicode=True)))
    n = _for_a_while("spec_yaml", texts, lambda text: spec_text_target(spec_path, text), SECONDS)
    _report("spec_yaml", n, time.monotonic() - t0)


@pytest.mark.fuzz
def test_fuzz_budget_for_a_while() -> None:
    t0 = time.monotonic()
    n = _for_a_while("budget", budget_values, budget_target, min(SECONDS, 20.0))
    _report("budget", n, time.monotonic() - t0)
