"""The golden merges: small deterministic families and the merges recorded in tests/golden/golden.json.

Shared by the recorder (``python -m tests.golden.record``) and the test
(tests/integration/test_golden.py), so both build
exactly the same thing. Only stable entry points are used: ``mergepipe_db.Catalog`` (open, ingest, ingest_many,
pack, export_delta, merge), the ``manifest.json`` a merge writes into its output directory, and the family
generator ``mergepipe_db.demo.family.make_family``; LoRA adapters are written here with safetensors + torch.

Four families (tiny Llama shape, ~92 K parameters per model):

* ``bf16``: BF16, base + 3 full experts (sharded files, experts ingested together): every method at budgets
  0.1, 0.5 and 1.0;
* ``f32`` and ``f16``: F32 / F16, base + 3 full experts: every method at budgets 0.1 and 1.0, plus one merge
  with another output dtype;
* ``mixed``: BF16, experts of every source kind: a full checkpoint (``full0``), a packed one (``packed1``,
  `Catalog.pack`), a delta checkpoint (``delta2``, written by `Catalog.export_delta` of a full expert), a PEFT
  LoRA adapter (``lora``) and the snapshot of an earlier merge (``snap3``, made by this family's first case);
  every non-slerp method over all five at budgets 0.1, 0.5 and 1.0, and slerp over each non-full source.

Everything is seeded; nothing recorded depends on where the files are (the manifest holds no paths).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GOLDEN_PATH = Path(__file__).resolve().with_name("golden.json")
RECORD_COMMAND = "python -m tests.golden.record"
FORMAT = 1

METHODS = ("linear", "task_arithmetic", "ties", "dare_linear", "dare_ties", "breadcrumbs", "slerp")
BUDGETS = (0.1, 0.5, 1.0)
SEED = 1234  # the merges' seed (DARE masks)
WEIGHTS = (0.5, 0.3, 0.2, 0.35, 0.25)  # per expert, in the spec's order
DENSITY = {"ties": 0.5, "dare_linear": 0.6, "dare_ties": 0.5, "breadcrumbs": 0.8}
GAMMA = 0.05  # breadcrumbs
GLOBAL_PARAMS: dict[str, dict[str, Any]] = {
    "linear": {"normalize": True},
    "task_arithmetic": {"lambda": 0.9},
    "ties": {"normalize": True, "lambda": 1.0},
    # DARE's classic 1/density rescale, the only one before `rescale` was honoured: these cases keep pinning
    # the bytes (and plan and manifest hashes) recorded before it, which old manifests replay to
    "dare_linear": {"rescale": "classic"},
    "dare_ties": {"normalize": True, "rescale": "classic"},
    "breadcrumbs": {"lambda": 1.1},
    "slerp": {"t": 0.4},
}
# LoRA adapter of the mixed family
LORA_SEED = 4321
LORA_R = 4
LORA_ALPHA = 8
LORA_TARGETS = ("q_proj", "v_proj", "down_proj")


@dataclass(frozen=True)
class FamilySpec:
    name: str
    dtype: str  # make_family's dtype
    seed: int
    n_experts: int
    block_bytes: int
    shard_bytes: int | None = None  # of the generated checkpoints
    mixed_sources: bool = False


@dataclass(frozen=True)
class Case:
    name: str
    family: str
    method: str
    budget: float
    experts: tuple[str, ...]  # catalog names (or refs), in the spec's order
    out_dtype: str | None = None  # the spec's dtype; None: the base's

    @property
    def ref(self) -> str:
        """The merge's ref (and output directory name): the case name, '/' replaced."""
        return self.name.replace("/", "-")


FAMILIES: dict[str, FamilySpec] = {
    f.name: f
    for f in (
        FamilySpec("bf16", "bfloat16", seed=11, n_experts=3, block_bytes=1024, shard_bytes=48 * 1024),
        FamilySpec("f32", "float32", seed=12, n_experts=3, block_bytes=2048),
        FamilySpec("f16", "float16", seed=13, n_experts=3, block_bytes=1024),
        FamilySpec("mixed", "bfloat16", seed=14, n_experts=4, block_bytes=1024, mixed_sources=True),
    )
}

FULL3 = ("e0", "e1", "e2")  # the full experts of bf16, f32 and f16
MIXED = ("full0", "packed1", "delta2", "lora", "snap3")  # one expert of each source kind
SNAPSHOT_CASE = "mixed/snapshot-source/b0.5"  # makes ref snap3 (below, renamed by `_ref_of`)


def _experts_for(method: str, experts: tuple[str, ...]) -> tuple[str, ...]:
    return experts[:1] if method == "slerp" else experts


def _budget_tag(budget: float) -> str:
    return f"b{budget}"


def _build_cases() -> list[Case]:
    out: list[Case] = []
    for method in METHODS:
        for b in BUDGETS:
            out.append(Case(f"bf16/{method}/{_budget_tag(b)}", "bf16", method, b, _experts_for(method, FULL3)))
    for fam, extra in (("f32", ("linear", "bfloat16", 0.5)), ("f16", ("ties", "float32", 1.0))):
        for method in METHODS:
            for b in (0.1, 1.0):
                out.append(Case(f"{fam}/{method}/{_budget_tag(b)}", fam, method, b, _experts_for(method, FULL3)))
        method, dtype, b = extra
        out.append(Case(f"{fam}/{method}-out_{dtype}/{_budget_tag(b)}", fam, method, b, FULL3, out_dtype=dtype))
    # mixed: first the merge whose snapshot becomes the expert snap3
    out.append(Case(SNAPSHOT_CASE, "mixed", "task_arithmetic", 0.5, ("src3",)))
    for method in METHODS:
        if method == "slerp":
            continue
        for b in BUDGETS:
            out.append(Case(f"mixed/{method}/{_budget_tag(b)}", "mixed", method, b, MIXED))
    for source in MIXED[1:]:
        for b in (0.5, 1.0):
            out.append(Case(f"mixed/slerp-{source}/{_budget_tag(b)}", "mixed", "slerp", b, (source,)))
    out.append(Case("mixed/ties-out_float32/b1.0", "mixed", "ties", 1.0, MIXED, out_dtype="float32"))
    return out


CASES: list[Case] = _build_cases()


def _ref_of(case: Case) -> str:
    return "snap3" if case.name == SNAPSHOT_CASE else case.ref


def spec_for(case: Case) -> dict[str, Any]:
    """The merge spec dict of a case (base "base", seed SEED, budget in the spec)."""
    models = []
    for k, name in enumerate(case.experts):
        p: dict[str, Any] = {}
        if case.method != "slerp":
            p["weight"] = 0.8 if case.name == SNAPSHOT_CASE else WEIGHTS[k]
        if case.method in DENSITY:
            p["density"] = DENSITY[case.method]
        if case.method == "breadcrumbs":
            p["gamma"] = GAMMA
        models.append({"model": name, "parameters": p})
    spec: dict[str, Any] = {
        "merge_method": case.method,
        "base_model": "base",
        "models": models,
        "parameters": dict(GLOBAL_PARAMS[case.method]),
        "budget": case.budget,
        "seed": SEED,
    }
    if case.out_dtype is not None:
        spec["dtype"] = case.out_dtype
    return spec


# --- building ------------------------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _file_hashes(root: Path, dirs: Iterable[Path]) -> dict[str, str]:
    """sha256 of every file under `dirs`, by path relative to `root` (POSIX separators), sorted."""
    out: dict[str, str] = {}
    for d in dirs:
        for p in sorted(d.rglob("*")):
            if p.is_file():
                out[p.relative_to(root).as_posix()] = _sha256(p)
    return dict(sorted(out.items()))


def write_lora(dest: Path, base_dir: Path, *, dtype: str) -> None:
    """A PEFT LoRA adapter (r=LORA_R, alpha=LORA_ALPHA) for the LORA_TARGETS modules of every layer of the
    model at `base_dir`, its factors drawn from a generator seeded LORA_SEED, stored in `dtype`."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    tdtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(base_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open has no __iter__)
                shapes[name] = tuple(st.get_slice(name).get_shape())
    g = torch.Generator().manual_seed(LORA_SEED)
    factors: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        parts = name.split(".")
        if len(shapes[name]) != 2 or parts[-1] != "weight" or parts[-2] not in LORA_TARGETS:
            continue
        rows, cols = shapes[name]
        module = "base_model.model." + name[: -len(".weight")]
        factors[f"{module}.lora_A.weight"] = (torch.randn(LORA_R, cols, generator=g) * 0.1).to(tdtype)
        factors[f"{module}.lora_B.weight"] = (torch.randn(rows, LORA_R, generator=g) * 0.1).to(tdtype)
    if not factors:
        raise RuntimeError(f"no LoRA target module among the tensors of {base_dir}")
    cfg = {"peft_type": "LORA", "r": LORA_R, "lora_alpha": LORA_ALPHA, "target_modules": list(LORA_TARGETS),
           "fan_in_fan_out": False, "use_rslora": False, "bias": "none"}
    dest.mkdir(parents=True)
    (dest / "adapter_config.json").write_text(json.dumps(cfg, sort_keys=True, indent=1) + "\n")
    save_file(factors, str(dest / "adapter_model.safetensors"))


def _ingested(res: Any) -> dict[str, Any]:
    return {"id": res.checkpoint_id, "kind": res.kind, "n_tensors": res.n_tensors, "n_blocks": res.n_blocks,
            "total_bytes": res.total_bytes}


@dataclass
class BuiltFamily:
    spec: FamilySpec
    root: Path
    catalog: Any
    setup: dict[str, Any]  # what building it recorded: input file hashes, ingests, pack, exported delta


def build_family(fam: FamilySpec, root: Path) -> BuiltFamily:
    """Generate `fam` under `root` (must be empty or absent) and catalogue it in root/catalog.duckdb."""
    from mergepipe_db import Catalog
    from mergepipe_db.demo.family import make_family

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    family = make_family(root / "family", n_experts=fam.n_experts, preset="tiny", dtype=fam.dtype, seed=fam.seed,
                         shard_bytes=fam.shard_bytes)
    generated = [family.base, *family.experts]
    if fam.mixed_sources:
        write_lora(root / "family" / "lora", family.base, dtype=fam.dtype)
        generated.append(root / "family" / "lora")
    setup: dict[str, Any] = {"inputs": _file_hashes(root / "family", generated)}

    cat = Catalog.open(str(root / "catalog.duckdb"))
    ingests: dict[str, Any] = {}
    ingests["base"] = _ingested(cat.ingest(family.base, name="base", block_bytes=fam.block_bytes))
    if not fam.mixed_sources:
        names = [f"e{k}" for k in range(fam.n_experts)]
        if fam.shard_bytes is not None:  # one family read together (ingest_many), the others one by one
            results = cat.ingest_many(list(family.experts), names=names, base="base")
        else:
            results = [cat.ingest(p, name=n, base="base") for p, n in zip(family.experts, names)]
        for n, res in zip(names, results):
            ingests[n] = _ingested(res)
    else:
        e = family.experts
        ingests["full0"] = _ingested(cat.ingest(e[0], name="full0", base="base"))
        ingests["packed1"] = _ingested(cat.ingest(e[1], name="packed1", base="base"))
        pack = cat.pack("packed1", store=root / "store")
        setup["pack"] = {k: getattr(pack, k) for k in ("expert", "blocks_packed", "blocks_deduplicated", "raw_bytes",
                                                         "stored_bytes", "packed_bytes", "blocks_left_raw")}
        ingests["full2"] = _ingested(cat.ingest(e[2], name="full2", base="base"))
        cat.export_delta("full2", root / "delta2")
        setup["exported_delta"] = _file_hashes(root, [root / "delta2"])
        ingests["delta2"] = _ingested(cat.ingest(root / "delta2", name="delta2", base="base", kind="delta"))
        ingests["lora"] = _ingested(cat.ingest(root / "family" / "lora", name="lora", base="base"))
        ingests["src3"] = _ingested(cat.ingest(e[3], name="src3", base="base"))
    setup["ingested"] = ingests
    return BuiltFamily(fam, root, cat, setup)


def run_case(built: BuiltFamily, case: Case) -> dict[str, Any]:
    """Merge `case` into built.root/out/<ref> and return what is recorded of it."""
    assert case.family == built.spec.name, (case.name, built.spec.name)
    ref = _ref_of(case)
    out = built.root / "out" / ref
    out.parent.mkdir(exist_ok=True)
    res = built.catalog.merge(spec_for(case), out=out, ref=ref)
    doc = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    manifest = doc["manifest"]
    if res.manifest_hash != doc["manifest_hash"] or res.plan_hash != manifest["plan_hash"]:
        raise AssertionError(f"{case.name}: MergeResult and manifest.json disagree on the hashes")
    return {
        "method": case.method,
        "budget": case.budget,
        "experts": list(case.experts),
        "out_dtype": case.out_dtype,
        "plan_hash": manifest["plan_hash"],
        "manifest_hash": doc["manifest_hash"],
        "budget_bytes": manifest["budget_bytes"],
        "full_bytes": manifest["full_bytes"],
        "planned_bytes": manifest["planned_bytes"],
        "realized_bytes": manifest["realized"]["total"],
        "tensors": [list(t) for t in manifest["outputs"]["tensors"]],
    }


def run_family(fam: FamilySpec | str, root: Path) -> dict[str, Any]:
    """Build family `fam` under `root` and run its cases, in order: {"setup": ..., "cases": {name: record}}."""
    fam = FAMILIES[fam] if isinstance(fam, str) else fam
    built = build_family(fam, root)
    return {"setup": built.setup,
            "cases": {c.name: run_case(built, c) for c in CASES if c.family == fam.name}}


def record_all(workdir: Path) -> dict[str, Any]:
    """The whole golden document, every family built in its own directory under `workdir`."""
    import mergepipe_db

    doc: dict[str, Any] = {
        "format": FORMAT,
        "about": "golden merges of tests/golden/cases.py; checked by tests/integration/test_golden.py; re-record with "
                 f"`{RECORD_COMMAND}` (only when a change of merge output is intended)",
        "tool_version": mergepipe_db.__version__,
        "families": {},
        "cases": {},
    }
    for name, fam in FAMILIES.items():
        got = run_family(fam, Path(workdir) / name)
        doc["families"][name] = got["setup"]
        doc["cases"].update(got["cases"])
    return doc


# --- golden.json: writing, reading, comparing ---------------------------------------------------------------------


def _is_flat(value: Any) -> bool:
    """A list printed on one line: no mappings in it, and no list of lists."""
    return isinstance(value, list) and all(
        not isinstance(v, (dict, list)) or (isinstance(v, list) and all(not isinstance(x, (dict, list)) for x in v))
        for v in value)


def dumps(value: Any, indent: int = 0) -> str:
    """JSON text with one line per mapping entry and per tensor entry (diff-friendly)."""
    pad, inner = " " * indent, " " * (indent + 1)
    if isinstance(value, dict):
        if not value:
            return "{}"
        items = [f"{inner}{json.dumps(k)}: {dumps(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(value, list) and value and not _is_flat(value):
        items = [f"{inner}{dumps(v, indent + 1)}" for v in value]
        return "[\n" + ",\n".join(items) + "\n" + pad + "]"
    return json.dumps(value)


def write_golden(doc: dict[str, Any], path: Path = GOLDEN_PATH) -> None:
    Path(path).write_text(dumps(doc) + "\n", encoding="utf-8")


def load_golden(path: Path = GOLDEN_PATH) -> dict[str, Any]:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def compare_records(where: str, expected: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """One line per differing field of two records (mappings), naming `where` and the field; tensor lists
    are compared entry by entry."""
    problems: list[str] = []
    for field in list(expected) + [k for k in got if k not in expected]:
        if field not in got:
            problems.append(f"{where}: field {field!r} is recorded but was not produced")
            continue
        if field not in expected:
            problems.append(f"{where}: field {field!r} was produced but is not recorded")
            continue
        e, g = expected[field], got[field]
        if field == "tensors" and isinstance(e, list) and isinstance(g, list):
            problems += _compare_tensors(where, e, g)
        elif isinstance(e, dict) and isinstance(g, dict):
            problems += compare_records(f"{where}: {field}", e, g)
        elif not _same(e, g):
            problems.append(f"{where}: {field}: expected {e!r}, got {g!r}")
    return problems


def _compare_tensors(where: str, expected: list[list[Any]], got: list[list[Any]]) -> list[str]:
    problems: list[str] = []
    e_names, g_names = [t[0] for t in expected], [t[0] for t in got]
    if e_names != g_names:
        missing = [n for n in e_names if n not in g_names]
        extra = [n for n in g_names if n not in e_names]
        problems.append(f"{where}: tensors: output tensor names/order differ (missing {missing}, extra {extra})")
    by_name = {t[0]: t for t in got}
    for t in expected:
        g = by_name.get(t[0])
        if g is None:
            continue
        for i, label in enumerate(("dtype", "shape", "xxh3"), start=1):
            if t[i] != g[i]:
                problems.append(f"{where}: tensors[{t[0]!r}].{label}: expected {t[i]!r}, got {g[i]!r}")
    return problems
