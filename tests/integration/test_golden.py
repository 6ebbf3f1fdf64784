"""Golden merges: the fixed, deterministic merges of tests/golden/cases.py must reproduce tests/golden/golden.json.

Each family (bf16, f32, f16, mixed sources) is generated, catalogued (DuckDB) and merged again, and every case's
plan hash, manifest hash, budget/full/planned/realized bytes and output tensors (name, dtype, shape, xxh3) are
compared with the record, as are the generated inputs and what ingest and pack reported. A difference means the
merge output changed: if that is intended, re-record with ``python -m tests.golden.record`` and commit the new
golden.json with the change.
"""

from __future__ import annotations

import pytest

from tests.golden import cases

HINT = (f"if this change of output is intended, re-record with `{cases.RECORD_COMMAND}` (from the repository "
        f"root) and commit tests/golden/golden.json")


def _golden() -> dict:
    if not cases.GOLDEN_PATH.exists():
        pytest.fail(f"{cases.GOLDEN_PATH} is missing; record it with `{cases.RECORD_COMMAND}`")
    doc = cases.load_golden()
    if doc.get("format") != cases.FORMAT:
        pytest.fail(f"{cases.GOLDEN_PATH} has format {doc.get('format')!r}, expected {cases.FORMAT}; {HINT}")
    return doc


def test_golden_file_lists_every_case() -> None:
    doc = _golden()
    want = [c.name for c in cases.CASES]
    have = list(doc["cases"])
    missing = [n for n in want if n not in have]
    extra = [n for n in have if n not in want]
    assert not missing and not extra and have == want, (
        f"golden.json's cases differ from tests/golden/cases.py: missing {missing}, not defined {extra}"
        f"{'' if missing or extra else ' (order differs)'}; re-record with `{cases.RECORD_COMMAND}`")
    assert list(doc["families"]) == list(cases.FAMILIES), (
        f"golden.json's families {list(doc['families'])} differ from cases.py's {list(cases.FAMILIES)}; "
        f"re-record with `{cases.RECORD_COMMAND}`")


def test_golden_covers_methods_sources_budgets_dtypes() -> None:
    by_family = {name: [c for c in cases.CASES if c.family == name] for name in cases.FAMILIES}
    assert {c.method for c in cases.CASES} == set(cases.METHODS)
    assert {c.budget for c in cases.CASES} >= {0.1, 0.5, 1.0}
    assert {f.dtype for f in cases.FAMILIES.values()} == {"bfloat16", "float32", "float16"}
    for name, fam in cases.FAMILIES.items():
        assert {c.method for c in by_family[name]} == set(cases.METHODS), name
        if fam.mixed_sources:
            used = {e for c in by_family[name] for e in c.experts}
            assert set(cases.MIXED) <= used, name


@pytest.mark.parametrize("family", list(cases.FAMILIES))
def test_golden_merges_unchanged(family: str, tmp_path) -> None:
    doc = _golden()
    got = cases.run_family(family, tmp_path)
    problems = cases.compare_records(f"family {family} (set-up)", doc["families"].get(family, {}), got["setup"])
    if problems:
        problems.append(f"(family {family}: the generated inputs or their ingest differ from the record: if "
                        f"`inputs` differ, the family generator changed, not the merge)")
    for name, record in got["cases"].items():
        expected = doc["cases"].get(name)
        if expected is None:
            problems.append(f"case {name}: not in golden.json")
            continue
        problems += cases.compare_records(f"case {name}", expected, record)
    limit = 60
    shown = problems[:limit] + ([f"... and {len(problems) - limit} more"] if len(problems) > limit else [])
    assert not problems, (f"{len(problems)} difference(s) from tests/golden/golden.json:\n  "
                          + "\n  ".join(shown) + f"\n{HINT}")
