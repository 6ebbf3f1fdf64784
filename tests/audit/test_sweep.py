"""`mergepipe sweep`: one committed merge per budget (full budget added), and the frontier files."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import yaml
from conftest import ingest_family

from mergepipe_db.audit.sweep import parse_budgets, rel_l2_deviation
from mergepipe_db.cli import main
from mergepipe_db.core.spec import Budget
from mergepipe_db.core.units import fmt_bytes
from mergepipe_db.errors import BudgetError, OutputExistsError

pytestmark = pytest.mark.catalog


def test_parse_budgets() -> None:
    assert parse_budgets("0.05, 0.1,0.05") == [("0.05", Budget(fraction=0.05)), ("0.1", Budget(fraction=0.1)),
                                               ("1", Budget(fraction=1.0))]
    assert parse_budgets("1.0,20KiB") == [("1", Budget(fraction=1.0)), ("20KiB", Budget(nbytes=20480))]
    for bad in ("", " , ", "-1", "lots"):
        with pytest.raises(BudgetError):
            parse_budgets(bad)


def test_sweep_writes_the_frontier(catalog, catalog_url, tiny_family, tmp_path, capsys) -> None:
    names = ingest_family(catalog, tiny_family)
    spec = tmp_path / "spec.yml"
    spec.write_text(yaml.safe_dump({
        "merge_method": "task_arithmetic", "base_model": "base", "budget": 0.9,
        "models": [{"model": n, "parameters": {"weight": w}} for n, w in zip(names, (0.6, 0.5, 0.4))]}))
    out = tmp_path / "sw"
    assert main(["sweep", str(spec), "--budgets", "0.5,0.1", "--out", str(out), "--catalog", catalog_url]) == 0
    cap = capsys.readouterr()
    assert cap.err.count("sweep: [") == 6 and "frontier.csv" in cap.out  # progress on stderr, table on stdout

    with open(out / "frontier.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0]) == ["budget", "budget_bytes", "expert_bytes", "total_bytes", "seconds",
                             "deviation_rel_l2", "deviation_abs_l2", "bound_rel_l2", "bound_abs_l2"]
    assert [r["budget"] for r in rows] == ["0.1", "0.5", "1"]  # the full budget was added, rows by bytes
    expert = [int(r["expert_bytes"]) for r in rows]
    budget = [int(r["budget_bytes"]) for r in rows]
    assert expert == sorted(expert) and all(e <= b for e, b in zip(expert, budget)) and expert[0] > 0
    assert all(int(r["total_bytes"]) > int(r["expert_bytes"]) for r in rows)
    dev = [float(r["deviation_rel_l2"]) for r in rows]
    assert dev[-1] == 0.0 and dev[0] >= dev[1] >= 0.0 and dev[0] > 0.0
    assert all(float(r["bound_abs_l2"]) >= 0.0 for r in rows) and float(rows[-1]["bound_abs_l2"]) == 0.0
    # absolute and relative columns agree through ‖out_full‖ (the naive norm, computed here)
    import torch
    from safetensors.torch import load_file

    full = {}
    for f in sorted((out / "budget-1").glob("*.safetensors")):
        full.update(load_file(str(f)))
    norm = math.sqrt(sum(float(torch.sum(v.double() ** 2)) for v in full.values() if v.is_floating_point()))
    for r in rows:
        assert math.isclose(float(r["deviation_abs_l2"]), float(r["deviation_rel_l2"]) * norm, rel_tol=1e-6,
                            abs_tol=1e-12)
        assert math.isclose(float(r["bound_rel_l2"]), float(r["bound_abs_l2"]) / norm, rel_tol=1e-6, abs_tol=1e-12)
        assert float(r["deviation_abs_l2"]) <= float(r["bound_abs_l2"]) * (1 + 1e-6) + 1e-6  # the bound holds
    # a person reads human units: the terminal table and frontier.md; the CSV keeps exact integers
    assert all(fmt_bytes(int(r["expert_bytes"])) in cap.out for r in rows)
    assert all(r["expert_bytes"] not in cap.out.split() for r in rows if int(r["expert_bytes"]) >= 1024)
    assert (cap.out + cap.err).count("wrote ") == 1
    assert all(float(r["seconds"]) > 0 for r in rows)

    for r in rows:
        assert (out / f"budget-{r['budget']}" / "manifest.json").is_file()
    _, refs = catalog.sql("SELECT name FROM refs ORDER BY name")
    assert [r[0] for r in refs] == ["sw-b0.1", "sw-b0.5", "sw-b1"]
    _, snaps = catalog.sql("SELECT realized_bytes FROM snapshots ORDER BY realized_bytes")
    assert [s[0] for s in snaps] == expert
    assert rel_l2_deviation(out / "budget-0.1", out / "budget-1") == dev[0]
    assert rel_l2_deviation(out / "budget-1", out / "budget-1") == 0.0

    md = (out / "frontier.md").read_text(encoding="utf-8")
    table = [ln for ln in md.splitlines() if ln.startswith("| ") and not ln.startswith("| budget ")]
    assert len(table) == 3 and "![frontier](frontier.png)" in md and "Budget sweep: task_arithmetic" in md
    assert all(fmt_bytes(int(r["expert_bytes"])) in md for r in rows)
    assert (out / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # a second sweep into the same directory is refused before any merge runs
    with pytest.raises(OutputExistsError):
        catalog.sweep(str(spec), budgets="0.3,1", out=out)
    assert not (out / "budget-0.3").exists()
    assert main(["sweep", str(spec), "--budgets", "0.3", "--out", str(out), "--catalog", catalog_url]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "OutputExistsError" in err
    assert sorted(p.name for p in Path(out).iterdir()) == ["budget-0.1", "budget-0.5", "budget-1", "frontier.csv",
                                                          "frontier.md", "frontier.png"]
